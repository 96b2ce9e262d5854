"""Checkpoints that cannot lie: checksums of every file verified in parallel at resume, a fall back
from a corrupt latest checkpoint to the newest good one, no save of non-finite weights, and a
resume with another global batch or learning rate that says what it changes and applies it, and
a read-only checkpoint directory found before the first step."""

from __future__ import annotations

import random

import pytest
import torch

from dtrain import distributed
from dtrain.checkpoint import integrity, resume
from dtrain.checkpoint import storage as ckpt
from dtrain.config import load_config, to_toml
from dtrain.data import TokenDataset
from dtrain.trainer import Trainer
from models.errors import UserError
from tests.damage import flip_middle_bytes
from tests.launch import TINY_ARGS
from tests.layouts import resolved


def test_each_rank_hashes_what_it_wrote_and_verifies_its_share(tmp_path):
    for name in ("__0_0.distcp", "__1_0.distcp", ".metadata", "rng/rank_00000.pt", "rng/rank_00001.pt", "extra.bin"):
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_bytes(random.Random(name).randbytes(1000))
    own = [integrity.own_checksums(tmp_path, rank) for rank in (0, 1)]
    assert sorted(own[0]) == [".metadata", "__0_0.distcp", "rng/rank_00000.pt"]
    assert sorted(own[1]) == ["__1_0.distcp", "rng/rank_00001.pt"]
    files = integrity.manifest(tmp_path, own)
    assert "extra.bin" in files and len(files) == 6  # a file no rank claimed is hashed at commit
    assert all(integrity.verify(tmp_path, files, rank, 3) == [] for rank in range(3))
    flip_middle_bytes(tmp_path / "__1_0.distcp")
    found = [integrity.verify(tmp_path, files, rank, 3) for rank in range(3)]
    assert sorted(p for problems in found for p in problems) == ["file __1_0.distcp does not match its checksum"]
    flip_middle_bytes(tmp_path / ".metadata")  # every rank checks it: each one unpickles it
    assert all("file .metadata does not match its checksum" in problems
               for problems in (integrity.verify(tmp_path, files, rank, 3) for rank in range(3)))


def test_the_data_stream_continues_at_the_consumed_sample_under_another_global_batch():
    data = TokenDataset("bundled", None, 64, 2048, 0)
    continued = data.micro_batches(3, 16, 16, 0, 1, first_sample=3 * 8)[0].inputs
    two_old_batches = torch.cat([data.micro_batches(step, 8, 8, 0, 1)[0].inputs for step in (3, 4)])
    assert torch.equal(continued, two_old_batches)
    assert not torch.equal(data.micro_batches(3, 16, 16, 0, 1)[0].inputs, two_old_batches)  # step x 16 would skip


def test_a_resume_names_only_the_settings_that_changed_not_those_the_old_run_left_unset_or_lacked():
    saved = to_toml(load_config([*TINY_ARGS, "--lr", "2e-3"]))
    # An older run's config.toml without the skip flags; None-valued flags are never written.
    saved = "\n".join(line for line in saved.splitlines() if not line.startswith(("max_skipped_steps", "skip_spikes")))
    assert resume.changed_settings({"config": saved}, load_config([*TINY_ARGS, "--resume"])) == [
        "optim.lr 0.002 -> 0.001"]


def test_a_checkpoint_is_never_written_with_non_finite_weights(tmp_path):
    layout = resolved([*TINY_ARGS, "--run-dir", str(tmp_path), "--checkpoint-every", "1"])
    runtime = distributed.init_process_group()
    try:
        trainer = Trainer(layout, runtime)
        trainer._read_back(trainer.launch_step())
        with torch.no_grad():
            dict(trainer.model.named_parameters())["blocks.1.mlp.w_up"][3, 5] = float("inf")
        with pytest.raises(UserError, match="hold NaN or infinite values at step 1: not saved") as info:
            trainer.checkpointer.save(trainer.step, wait=True)
        assert "\n" not in str(info.value)
    finally:
        distributed.shutdown()
    assert not list((tmp_path / ckpt.CHECKPOINTS).iterdir())
