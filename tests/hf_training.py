"""Training against transformers: dtrain's CLI from a Hugging Face checkpoint (--init-from-hf) and
transformers' own model with torch's AdamW on the same batches, as dtrain's trainer takes them (the
bundled data's rows, the summed token loss over the global batch, the global gradient norm and
its clipping, dtrain's learning-rate schedule and weight-decay groups). `assert_trains_like_transformers`
compares the losses and gradient norms of every step and the weights after the last."""

from __future__ import annotations

from pathlib import Path

import torch
import torch.nn.functional as F

from dtrain.config import OptimArgs
from dtrain.data import TokenDataset
from dtrain.interop import hf
from dtrain.optim import lr_multiplier
from models import families, spec
from tests.launch import TINY_ARGS, train_scalars
from tools import hf_convert

STEPS, SEQ, GLOBAL_BATCH, MICRO_BATCH, LR = 10, 64, 8, 2, 1e-3
LOSS_RTOL, GRAD_NORM_RTOL, WEIGHT_RTOL = 1e-4, 1e-3, 1e-3


def decayed_hf_names(cfg, hf_dir: Path) -> set[str]:
    """The HF tensors dtrain's AdamW decays (those of its matrices: not embeddings, norms, biases, sinks)."""
    source = hf.HFCheckpoint(hf_dir)
    specs = {f"{layer.name}.{path}": s for layer in families.layers(cfg) for path, s in spec.flatten(layer.params)}
    return {name for dtrain_name, pieces in source.pieces.items() for piece in pieces for name in piece.hf_names()
            if specs[dtrain_name].weight_decay}


def transformers_training(model: torch.nn.Module, decayed: set[str], logits_of=None) -> dict:
    """`model` (fp32) trained as dtrain's CLI trains with TINY_ARGS: losses and gradient norms per
    step, and the final state dict. `logits_of(model, inputs)` (default: the model's own logits)."""
    logits_of = logits_of or (lambda m, inputs: m(input_ids=inputs).logits)
    optim = OptimArgs(lr=LR)
    named = [(name, p) for name, p in model.named_parameters() if p.requires_grad]
    groups = [{"params": [p for n, p in named if n in decayed], "weight_decay": optim.weight_decay},
              {"params": [p for n, p in named if n not in decayed], "weight_decay": 0.0}]
    optimizer = torch.optim.AdamW(groups, lr=LR, betas=(optim.beta1, optim.beta2), eps=optim.eps)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_multiplier(step, STEPS, optim))
    dataset = TokenDataset("bundled", None, SEQ, model.config.get_text_config().vocab_size, 0)
    losses, grad_norms = [], []
    model.train()
    for step in range(STEPS):
        optimizer.zero_grad()
        loss_sum = 0.0
        for inputs, labels in dataset.micro_batches(step, GLOBAL_BATCH, MICRO_BATCH, 0, 1):
            logits = logits_of(model, inputs)
            loss = F.cross_entropy(logits.flatten(0, 1).float(), labels.flatten(), reduction="sum")
            (loss / (GLOBAL_BATCH * SEQ)).backward()
            loss_sum += loss.item()
        losses.append(loss_sum / (GLOBAL_BATCH * SEQ))
        grad_norms.append(torch.nn.utils.clip_grad_norm_([p for _, p in named], optim.grad_clip).item())
        optimizer.step()
        scheduler.step()
    return {"train/loss": losses, "train/grad_norm": grad_norms,
            "weights": {k: v.detach().clone() for k, v in model.state_dict().items()}}


def assert_trains_like_transformers(tmp_path: Path, hf_dir: Path, model: torch.nn.Module, cfg, preset: str,
                                    overrides: str = "", logits_of=None, weight_name=lambda name: name) -> None:
    """dtrain's CLI (--model `preset` --model-overrides `overrides`, --init-from-hf `hf_dir`) against
    transformers' `model` loaded from it: losses within 1e-4, gradient norms within 1e-3 (relative)
    at every step, and every weight after the last step within 1e-3 of its largest value; the
    dtrain run's weights exported to HF names (`weight_name` maps them to `model`'s)."""
    expected = transformers_training(model, decayed_hf_names(cfg, hf_dir), logits_of)
    run_dir = tmp_path / "dtrain"
    extra = ["--model", preset, "--init-from-hf", str(hf_dir), "--checkpoint-every", str(STEPS)]
    actual = train_scalars(run_dir, extra + (["--model-overrides", overrides] if overrides else []))
    assert float(TINY_ARGS[TINY_ARGS.index("--lr") + 1]) == LR
    for tag, rtol in (("train/loss", LOSS_RTOL), ("train/grad_norm", GRAD_NORM_RTOL)):
        assert len(actual[tag]) == STEPS, tag
        for step, (a, e) in enumerate(zip(actual[tag], expected[tag]), 1):
            assert abs(a - e) <= rtol * abs(e), f"{tag} at step {step}: dtrain {a} vs transformers {e}"
    exported = hf_convert.export_hf(run_dir, tmp_path / "exported")
    from safetensors.torch import load_file

    weights = {weight_name(k): v for file in exported.glob("*.safetensors") for k, v in load_file(file).items()}
    assert weights.keys() <= expected["weights"].keys()
    for name, value in weights.items():
        reference = expected["weights"][name]
        error = ((value.float() - reference).abs().max() / reference.abs().max().clamp_min(1e-12)).item()
        assert error <= WEIGHT_RTOL, f"{name} after {STEPS} steps: relative difference {error:.2e}"
