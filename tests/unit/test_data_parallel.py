"""Loss parity of FSDP and HSDP against one process (CPU, gloo, fp32), with and without CPU
offload, and on a GPU that offloaded shards stay in host memory."""

import pytest

from parallel.data_parallel import units_to_reshard
from parallel.mesh import MeshSpec
from tests.launch import TINY_ARGS


BLOCKS = [f"blocks.{i}" for i in range(4)]


@pytest.mark.parametrize("mesh,world,mode,mtp,expected", [
    # Not the last block: its backward comes right after forward; the embedding with the blocks.
    ("dp=4", 4, "default", False, {"blocks.0", "blocks.1", "blocks.2", "embed"}),
    ("dp=4", 4, "always", False, {*BLOCKS, "embed"}),
    ("dp=4", 4, "always", True, {*BLOCKS, "mtp", "embed"}),
    ("dp=4", 4, "default", True, {"blocks.0", "blocks.1", "blocks.2", "embed"}),  # the MTP layer runs last
    ("dp=4", 4, "never", False, set()),
    ("cp=2", 2, "default", False, {"blocks.0", "blocks.1", "blocks.2", "embed"}),  # FSDP shards over cp too
    ("tp=2", 2, "always", True, set()),  # one shard: nothing to free
    ("dp=2,pp=2", 4, "default", False, set()),  # a pipeline runs each block once per micro-batch
    ("dp=2,pp=2", 4, "always", False, {*BLOCKS, "embed"}),
])
def test_units_to_reshard(mesh, world, mode, mtp, expected):
    assert units_to_reshard(BLOCKS, MeshSpec.parse(mesh, world), mode, has_mtp=mtp) == expected


@pytest.mark.parametrize("args,message", [
    (["--dp-mode", "zero1", "--fsdp-reshard-after-forward", "always"], "drop one of them"),
    (["--dp-mode", "zero1", "--cpu-offload"], "drop one of them"),
])
def test_zero1_refuses_what_contradicts_it(args, message):
    from models.errors import UserError
    from tests.layouts import resolved

    with pytest.raises(UserError, match=message):
        resolved([*TINY_ARGS, "--mesh", "dp=2", *args], 2)


@pytest.mark.gpu
def test_cpu_offload_keeps_shards_in_host_memory_on_a_gpu(tmp_path):
    """`python -m pytest -m gpu tests/unit/test_data_parallel.py -k offload` on one GPU: the shards and
    the optimizer state live on the CPU while the step runs on the GPU, with the same losses."""
    import torch

    from dtrain import distributed
    from dtrain.layout import Machine
    from dtrain.trainer import Trainer
    from tests.layouts import resolved

    histories = {}
    for offload in (False, True):
        args = [*TINY_ARGS, "--steps", "4", "--run-dir", str(tmp_path / str(offload))]
        layout = resolved(args + (["--cpu-offload"] if offload else []), machine=Machine.detect())
        runtime = distributed.init_process_group()
        try:
            trainer = Trainer(layout, runtime)
            histories[offload] = trainer.fit()
            devices = {p.to_local().device.type for p in trainer.parameters()}
            states = {t.device.type for s in trainer.optimizer.state.values() for t in s.values()}
            assert devices == ({"cpu"} if offload else {"cuda"}), devices
            if offload:
                assert states == {"cpu"} and trainer.optimizer.defaults["fused"]
                assert torch.cuda.max_memory_allocated() > 0  # the blocks ran on the GPU
        finally:
            distributed.shutdown()
    for step, (a, b) in enumerate(zip(histories[False], histories[True]), 1):
        assert abs(a["train/loss"] - b["train/loss"]) <= 1e-5 * abs(a["train/loss"]), step
