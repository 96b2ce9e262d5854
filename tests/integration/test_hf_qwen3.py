"""Hugging Face Qwen3 and Qwen3-MoE interop: dtrain on weights transformers saved gives its logits
and loss (heads wider than hidden_size / heads, qk-norm, tied embeddings; the hub's and the fused
expert layouts, mlp_only_layers and decoder_sparse_step, norm_topk_prob either way); ten training
steps from an import follow transformers + torch AdamW on the same batches; HF -> dtrain -> HF is
bit-exact and transformers loads the export with no missing or unexpected keys."""

from __future__ import annotations

import json

import pytest
import torch

from dtrain.interop import hf
from models.errors import UserError
from tests.launch import run_cli, train_scalars
from tools import hf_convert
from tests.unit.test_hf_qwen3 import make_hf_qwen3


# The shapes of the tiny-qwen3 and tiny-qwen3-moe presets, so that --model takes these weights.
TINY = dict(vocab_size=2048, hidden_size=64, intermediate_size=192, num_hidden_layers=4, num_attention_heads=4,
            num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6)


TINY_MOE = {**TINY, "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8, "num_experts_per_tok": 2,
            "mlp_only_layers": [0], "norm_topk_prob": True}


def _decay_groups(model) -> list[dict]:
    """dtrain's weight-decay groups in transformers' names: matrices decay; norms and the input
    embedding do not."""
    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "embed_tokens" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "embed_tokens" not in n)]
    return [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]


def _train_transformers(model, steps: int) -> tuple[list[float], list[float]]:
    """transformers + torch AdamW on the CLI's batches (bundled data, seq 64, global batch 8 in
    micro-batches of 2), constant lr 1e-3, clipping at 1: losses and gradient norms per step."""
    from dtrain.data import TokenDataset

    dataset = TokenDataset("bundled", None, 64, 2048, 0)
    optimizer = torch.optim.AdamW(_decay_groups(model), lr=1e-3, betas=(0.9, 0.95), eps=1e-8)
    model.train()
    losses, norms = [], []
    for step in range(steps):
        optimizer.zero_grad()
        # The step's micro-batches in one forward: the same mean over the global batch's tokens.
        batches = dataset.micro_batches(step, 8, 2, 0, 1)
        inputs, labels = (torch.cat(parts) for parts in zip(*batches))
        loss = torch.nn.functional.cross_entropy(model(input_ids=inputs).logits.flatten(0, 1), labels.flatten())
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0).item())
        optimizer.step()
        losses.append(loss.item())
    return losses, norms


@pytest.mark.parametrize("preset,kw", [("tiny-qwen3", TINY), ("tiny-qwen3-moe", {"moe": True, **TINY_MOE})],
                         ids=["qwen3", "qwen3-moe"])
def test_ten_steps_from_an_import_follow_transformers_and_adamw(tmp_path, preset, kw):
    """Losses within 1e-4, gradient norms within 1e-3 and the final weights within 1e-3 (relative,
    per tensor) of transformers trained by torch AdamW on the same batches (no balancing loss: transformers
    adds none without output_router_logits)."""
    model = make_hf_qwen3(tmp_path / "hf", rope_theta=1e6, **kw)
    overrides = ["--model-overrides", "aux_loss_coef=0"] if kw.get("moe") else []
    run = train_scalars(tmp_path / "run", ["--model", preset, *overrides, "--init-from-hf", str(tmp_path / "hf"),
                                           "--warmup-steps", "1", "--decay", "constant", "--checkpoint-every", "10"])
    losses, norms = _train_transformers(model, 10)
    for step, (ours, theirs) in enumerate(zip(run["train/loss"], losses, strict=True), 1):
        assert abs(ours - theirs) <= 1e-4 * theirs, (step, run["train/loss"], losses)
    for step, (ours, theirs) in enumerate(zip(run["train/grad_norm"], norms, strict=True), 1):
        assert abs(ours - theirs) <= 1e-3 * theirs, (step, run["train/grad_norm"], norms)
    out = hf_convert.export_hf(tmp_path / "run", tmp_path / "exported")
    trained = type(model).from_pretrained(out)
    theirs = dict(model.named_parameters())
    for name, ours in trained.named_parameters():
        # Tensor-wise: Adam moves elements whose gradients are rounding noise by up to lr per step
        # in either direction, so element-wise tolerances would test the noise.
        error = (ours - theirs[name].detach()).norm() / theirs[name].detach().norm()
        assert error <= 1e-3 and (ours - theirs[name]).abs().max() <= 1e-3, (name, error.item())


def test_what_qwen3_cannot_hold_is_a_one_line_error(tmp_path, capsys):
    make_hf_qwen3(tmp_path / "hf", moe=True)
    config_path = tmp_path / "hf" / "config.json"
    config = json.loads(config_path.read_text())
    for change, message in (({"mlp_only_layers": [5]}, r"mlp_only_layers=\[5\] must list layers of 0 .. 2"),
                            ({"num_experts": 3}, "num_experts=3 and num_local_experts=4; it needs one"),
                            ({"use_sliding_window": True, "sliding_window": 8, "max_window_layers": 1},
                             "dtrain reads a Qwen3 window only where it covers every layer"),
                            ({"norm_topk_prob": "yes"}, "norm_topk_prob='yes', which must be true or false")):
        config_path.write_text(json.dumps({**config, **change}))
        with pytest.raises(UserError, match=message) as info:
            hf.HFCheckpoint(tmp_path / "hf")
        assert "\n" not in str(info.value)
    # A whole-model window is read; the published configs' num_experts alone is too (transformers
    # 5 writes num_local_experts).
    assert "num_experts" not in config and config["num_local_experts"] == 4
    config_path.write_text(json.dumps({**{k: v for k, v in config.items() if k != "num_local_experts"}, "num_experts": 4,
                                       "use_sliding_window": True, "sliding_window": 8, "max_window_layers": 0}))
    assert (hf.HFCheckpoint(tmp_path / "hf").config.sliding_window, hf.HFCheckpoint(tmp_path / "hf").config.num_experts) == (8, 4)
    # A Qwen3 checkpoint under a Llama preset names the Qwen3 presets.
    make_hf_qwen3(tmp_path / "dense", **TINY)
    result = run_cli(["--model", "tiny", "--steps", "1", "--run-dir", str(tmp_path / "run"),
                      "--init-from-hf", str(tmp_path / "dense")])
    line = result.stderr.strip().splitlines()[-1]
    assert result.returncode == 2 and "is a Qwen3 checkpoint but --model tiny is not; choose a Qwen3 preset" in line
    # Export of what Qwen3-MoE cannot hold fails before any tensor is written.
    from dtrain.checkpoint import storage

    checkpoint = hf_convert.import_hf(tmp_path / "dense", tmp_path / "imported" / "step_000000")
    meta = json.loads((checkpoint / "meta.json").read_text())
    meta["model"].update(layer_pattern="window-full", sliding_window=4)
    storage.write_meta(checkpoint, meta)
    capsys.readouterr()
    assert hf_convert.main(["export", str(checkpoint), str(tmp_path / "out")]) == 2
    assert "Qwen3's layers all attend alike" in capsys.readouterr().err and not (tmp_path / "out").exists()
