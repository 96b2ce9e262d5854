"""Hugging Face interop: dtrain on imported weights gives transformers' logits and loss; HF ->
dtrain checkpoint -> HF is bit-exact; --init-from-hf trains from such weights on a tp mesh."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from dtrain import hf
from models import llama, spec
from models.context import LocalContext
from models.errors import UserError
from models.layers import rms_norm
from tests.launch import TINY_ARGS, run_cli, train_scalars
from tools import hf_convert

transformers = pytest.importorskip("transformers")

LLAMA3_ROPE = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 16}


def make_hf_model(path: Path, *, tie: bool = False, rope: dict | None = None, rope_theta: float = 5000.0,
                  dtype=torch.float32, max_shard_size: str | None = None, **shape) -> "transformers.LlamaForCausalLM":
    """A random small Llama saved with save_pretrained; norms are random too, so their mapping counts."""
    kw = dict(vocab_size=97, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, rms_norm_eps=1e-5, max_position_embeddings=256, tie_word_embeddings=tie)
    kw.update(shape)
    kw["rope_parameters"] = {"rope_theta": rope_theta, **(rope or {"rope_type": "default"})}
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(transformers.LlamaConfig(**kw)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model = model.to(dtype)
    model.save_pretrained(path, **({"max_shard_size": max_shard_size} if max_shard_size else {}))
    return model


@pytest.mark.parametrize("tie,rope", [(False, None), (True, LLAMA3_ROPE)], ids=["untied", "tied-llama3-rope"])
def test_imported_weights_give_transformers_logits_and_loss(tmp_path, tie, rope):
    model = make_hf_model(tmp_path, tie=tie, rope=rope)
    cfg, params = hf_convert.load_hf_params(tmp_path)
    assert cfg.tie_embeddings == tie and (cfg.rope_scaling is not None) == (rope is not None)
    assert ("head.output" in params) != tie
    tokens = torch.randint(0, cfg.vocab_size, (2, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(input_ids=tokens, labels=tokens)
        # dtrain's labels are already the next tokens; HF shifts inside. The last position has none.
        labels = torch.cat([tokens[:, 1:], torch.full((2, 1), -100)], dim=1)
        loss_sum = llama.forward(spec.unflatten(params), tokens, labels, cfg, LocalContext())
        logits = _dtrain_logits(params, tokens, cfg)
    torch.testing.assert_close(logits, expected.logits, rtol=1e-5, atol=1e-5)
    n_tokens = tokens.numel() - tokens.shape[0]
    torch.testing.assert_close(loss_sum, expected.loss * n_tokens, rtol=1e-6, atol=1e-5)


def _dtrain_logits(params, tokens, cfg):
    """The layers' forward functions up to the head, then the head's norm and output matmul."""
    tree, ctx = spec.unflatten(params), LocalContext()
    aux = llama.make_aux(cfg, torch.arange(tokens.shape[1]))
    x = tokens
    for layer in llama.layers(cfg)[:-1]:
        x = layer.forward(llama._lookup(tree, layer.name), x, aux, ctx)
    output = tree["head"].get("output", tree["embed"]["weight"])
    return ctx.linear(rms_norm(x, tree["head"]["norm"], cfg.norm_eps), output)


def test_round_trip_through_a_dtrain_checkpoint_is_bit_exact(tmp_path):
    from safetensors.torch import load_file

    source = tmp_path / "hf"
    # bf16 and sharded with an index, as published checkpoints are.
    make_hf_model(source, rope=LLAMA3_ROPE, dtype=torch.bfloat16, max_shard_size="20KB")
    assert (source / hf.INDEX_FILE).is_file()
    dtrain_dir = hf_convert.import_hf(source, tmp_path / "run" / "checkpoints" / "step_000000")
    assert (dtrain_dir / "COMPLETE").is_file()
    out = hf_convert.export_hf(tmp_path / "run", tmp_path / "exported", max_shard_bytes=30_000)
    assert (out / hf.INDEX_FILE).is_file()

    def tensors(path: Path) -> dict[str, torch.Tensor]:
        files = set(json.loads((path / hf.INDEX_FILE).read_text())["weight_map"].values())
        return {k: v for f in files for k, v in load_file(path / f).items()}

    before, after = tensors(source), tensors(out)
    assert before.keys() == after.keys()
    for name in before:
        assert before[name].dtype == after[name].dtype == torch.bfloat16, name
        assert torch.equal(before[name].view(torch.int16), after[name].view(torch.int16)), name
    # transformers reads the exported config back to the same model.
    original, reloaded = (transformers.LlamaForCausalLM.from_pretrained(p).eval() for p in (source, out))
    tokens = torch.randint(0, 97, (1, 24))
    with torch.no_grad():
        torch.testing.assert_close(reloaded(input_ids=tokens).logits, original(input_ids=tokens).logits, rtol=0, atol=0)


def _tiny_hf(path: Path) -> "transformers.LlamaForCausalLM":
    # The `tiny` preset's shape, so the CLI's --model tiny takes these weights.
    return make_hf_model(path, vocab_size=2048, hidden_size=64, intermediate_size=192, num_hidden_layers=4,
                         num_attention_heads=4, num_key_value_heads=2, rope_theta=10000.0)


@pytest.mark.slow
def test_init_from_hf_on_tp2_and_resume_from_an_import_give_the_hf_loss(tmp_path):
    from dtrain import data as data_lib

    source = tmp_path / "hf"
    model = _tiny_hf(source)
    # The loss logged at step 1 is that of the weights before the first update, on step 0's batch.
    dataset = data_lib.TokenDataset("bundled", None, 64, 2048, 0)
    loss_sum, tokens = 0.0, 0
    with torch.no_grad():
        for inputs, labels in dataset.micro_batches(0, 8, 2, 0, 1):
            logits = model(input_ids=inputs).logits
            loss_sum += torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten(), reduction="sum").item()
            tokens += labels.numel()
    expected = loss_sum / tokens
    tp = train_scalars(tmp_path / "tp", ["--mesh", "tp=2", "--steps", "1", "--init-from-hf", str(source)], nproc=2)
    assert abs(tp["train/loss"][0] - expected) <= 1e-5 * expected, (tp["train/loss"], expected)
    imported = hf_convert.import_hf(source, tmp_path / "imported" / "step_000000")
    single = train_scalars(tmp_path / "single", ["--steps", "1", "--resume", str(imported)])
    assert abs(single["train/loss"][0] - expected) <= 1e-5 * expected, (single["train/loss"], expected)


def test_init_from_hf_with_another_shape_names_the_overrides(tmp_path):
    make_hf_model(tmp_path)
    result = run_cli([*TINY_ARGS, "--run-dir", str(tmp_path / "run"), "--init-from-hf", str(tmp_path)])
    assert result.returncode == 2
    line = result.stderr.strip().splitlines()[-1]
    assert line.startswith("dtrain: error: ") and "add --model-overrides dim=32," in line, result.stderr


def test_broken_hf_directories_are_clear_errors(tmp_path):
    with pytest.raises(UserError, match="no config.json"):
        hf.HFCheckpoint(tmp_path)
    make_hf_model(tmp_path / "sharded", max_shard_size="20KB")
    index = json.loads((tmp_path / "sharded" / hf.INDEX_FILE).read_text())
    (tmp_path / "sharded" / sorted(set(index["weight_map"].values()))[-1]).unlink()
    with pytest.raises(UserError, match=r"shard model-.*safetensors named in model.safetensors.index.json is missing"):
        hf.HFCheckpoint(tmp_path / "sharded")
    make_hf_model(tmp_path / "moe")
    config = json.loads((tmp_path / "moe" / "config.json").read_text())
    (tmp_path / "moe" / "config.json").write_text(json.dumps({**config, "model_type": "mixtral"}))
    with pytest.raises(UserError, match="model_type 'mixtral' is not supported"):
        hf.HFCheckpoint(tmp_path / "moe")
    make_hf_model(tmp_path / "fewer", num_hidden_layers=2)
    config = json.loads((tmp_path / "fewer" / "config.json").read_text())
    (tmp_path / "fewer" / "config.json").write_text(json.dumps({**config, "num_hidden_layers": 3}))
    with pytest.raises(UserError, match=r"lacks model.layers.2.input_layernorm.weight \(9 missing"):
        hf.HFCheckpoint(tmp_path / "fewer")
