"""FP8 all-gather under FSDP (tensorwise): which weights are gathered in float8 for which recipe,
mesh and device; the float8 path through forward, backward and the optimizer on CPU with a fake
process group; the scales' one all-reduce and checkpoints over two gloo ranks; and, marked gpu,
the real float8 all-gather over NCCL on two GPUs (eager and compiled) against bf16 all-gather
and plain bf16."""

from __future__ import annotations

import json
import re
import tempfile
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

from parallel import precision
from tests.launch import run_cli, scalars
from tests.unit.test_fp8_all_gather import _build, _float8_gathered


def _two_rank_worker(rank: int, world_size: int, init_file: str, out_dir: str) -> None:
    """Scales from the one all-reduce match each weight's global amax on every rank; a checkpoint
    of float8-gathered weights loads into bf16-gathered ones and back (DCP sees plain values)."""
    from dtrain.checkpoint import train_state
    from dtrain.config import OptimArgs
    from dtrain.optim import build_optimizer

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world_size)
    try:
        # gloo cannot move float8: nothing here all-gathers (no forward), it only reduces fp32.
        precision.FLOAT8_COLLECTIVE_DEVICES = ("cuda", "cpu")
        results: dict = {}

        def build(float8_all_gather: bool, seed: int):
            _, model, _ = _build("tiny", "dp=2", "tensorwise", {1, 2}, float8_all_gather=float8_all_gather)
            optimizer = build_optimizer([model], OptimArgs())
            generator = torch.Generator().manual_seed(seed + rank)
            for p in model.parameters():
                p.grad = DTensor.from_local(torch.randn(p.to_local().shape, generator=generator),
                                            p.device_mesh, p.placements)
            optimizer.step()
            optimizer.zero_grad()
            return model, optimizer

        model, optimizer = build(True, 0)
        precision.after_optimizer_step([model])
        scales = {}
        for name in sorted(_float8_gathered(model)):
            local = model.get_parameter(name)._local_tensor
            amax = local._tensor.abs().max().reshape(1)
            dist.all_reduce(amax, op=dist.ReduceOp.MAX)
            expected = (torch.finfo(torch.float8_e4m3fn).max / amax.double()).float()[0]
            scales[name] = [local._precomputed_scale.item(), expected.item()]
        results["scales"] = scales

        def shards(m, o):
            params = dict(m.named_parameters())
            local = {n: getattr(p._local_tensor, "_tensor", p._local_tensor).clone() for n, p in params.items()}
            local.update({f"{n}/exp_avg": o.state[p]["exp_avg"].to_local().clone() for n, p in params.items()})
            return local

        root = Path(out_dir)
        for saved_float8, path in ((True, root / "from_float8"), (False, root / "from_bf16")):
            source, source_opt = (model, optimizer) if saved_float8 else build(False, 1)
            train_state.save_train_state(source, source_opt, path, rank=rank)
            target, target_opt = build(not saved_float8, 2)
            expected, before = shards(source, source_opt), shards(target, target_opt)
            train_state.load_train_state(target, target_opt, path, rank=rank, has_optim=True)
            loaded = shards(target, target_opt)
            results[path.name] = {
                "differed_before": sum(not torch.equal(expected[n], before[n]) for n in expected),
                "mismatched": sorted(n for n in expected if not torch.equal(expected[n], loaded[n])),
                "float8_gathered": len(_float8_gathered(target)),
            }
        (root / f"rank{rank}.json").write_text(json.dumps(results))
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def two_rank_results(tmp_path_factory):
    out_dir = tmp_path_factory.mktemp("fp8_all_gather")
    init_file = tempfile.mktemp(dir=out_dir)
    mp.spawn(_two_rank_worker, args=(2, init_file, str(out_dir)), nprocs=2, join=True)
    return [json.loads((out_dir / f"rank{rank}.json").read_text()) for rank in range(2)]


def test_scales_come_from_the_global_amax_on_every_rank(two_rank_results):
    by_rank = [results["scales"] for results in two_rank_results]
    assert len(by_rank[0]) == 14
    for name, (scale, expected) in by_rank[0].items():
        assert scale == expected, name
        assert by_rank[1][name][0] == scale, name


@pytest.mark.parametrize("direction,float8_gathered", [("from_float8", 0), ("from_bf16", 14)])
def test_checkpoints_move_between_float8_and_bf16_all_gather(two_rank_results, direction, float8_gathered):
    for results in two_rank_results:
        assert results[direction]["differed_before"] > 0
        assert results[direction]["mismatched"] == []
        assert results[direction]["float8_gathered"] == float8_gathered


GPU_ARGS = ["--model", "tiny", "--steps", "8", "--seed", "0", "--precision", "bf16", "--seq-len", "256",
            "--global-batch", "8", "--micro-batch", "4", "--lr", "1e-3"]


@pytest.mark.gpu
def test_float8_all_gather_on_two_gpus(tmp_path):
    """FSDP over 2 GPUs with --fp8 tensorwise: the worker checks that FP8 blocks see float8
    weights from the all-gather, and that the scales were precomputed after each step; the losses
    stay close to bf16 all-gather (the same FP8 matmuls) and to plain bf16."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 CUDA GPUs")
    runs = {"float8": ["--fp8", "tensorwise"], "float8_compiled": ["--fp8", "tensorwise", "--compile"],
            "bf16_gather": ["--fp8", "tensorwise", "--no-fp8-all-gather"], "bf16": []}
    losses = {}
    for name, extra in runs.items():
        run_dir = tmp_path / name
        args = [*GPU_ARGS, "--mesh", "dp=2", "--run-dir", str(run_dir), *extra]
        result = run_cli([name, *args], nproc=2, module="tests.workers.fp8_all_gather")
        assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
        report = json.loads(re.findall(r"^FP8_ALL_GATHER (.*)$", result.stdout, re.M)[-1])
        if name.startswith("float8"):
            assert report["float8_weights"] > 0 and report["bf16_weights"] == 0, report
            assert report["precomputed_steps"] == 8, report
            assert report["scale_errors"] == [], report
        elif name == "bf16_gather":
            assert report["float8_weights"] == 0 and report["bf16_weights"] > 0, report
        losses[name] = scalars(run_dir)["train/loss"]
    assert len(losses["float8"]) == 8
    series = zip(losses["float8"], losses["float8_compiled"], losses["bf16_gather"], losses["bf16"])
    for step, (f8, compiled, bf16_gather, bf16) in enumerate(series, 1):
        # Float8 cast from the fp32 shard vs from the gathered bf16 weight: nearly the same values.
        assert abs(f8 - bf16_gather) <= 0.01 * bf16_gather, (step, f8, bf16_gather)
        assert abs(f8 - compiled) <= 0.01 * f8, (step, f8, compiled)
        assert abs(f8 - bf16) <= 0.05 * bf16, (step, f8, bf16)
