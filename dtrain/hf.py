"""Hugging Face Llama checkpoints: config and tensor-name mapping, reading (one safetensors file or
shards with `model.safetensors.index.json`) and writing. dtrain's RoPE uses HF Llama's
rotate-half layout, so q/k projections are copied unpermuted and a round trip is bit-exact."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import attrs
import torch

from models import llama, spec
from models.config import LlamaConfig, RopeScaling
from models.errors import UserError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# (HF name pattern, dtrain name template); `{i}` is the layer index.
_NAMES = [
    ("model.embed_tokens.weight", "embed.weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "blocks.{i}.attn.wq"),
    ("model.layers.{i}.self_attn.k_proj.weight", "blocks.{i}.attn.wk"),
    ("model.layers.{i}.self_attn.v_proj.weight", "blocks.{i}.attn.wv"),
    ("model.layers.{i}.self_attn.o_proj.weight", "blocks.{i}.attn.wo"),
    ("model.layers.{i}.mlp.gate_proj.weight", "blocks.{i}.mlp.w_gate"),
    ("model.layers.{i}.mlp.up_proj.weight", "blocks.{i}.mlp.w_up"),
    ("model.layers.{i}.mlp.down_proj.weight", "blocks.{i}.mlp.w_down"),
    ("model.layers.{i}.input_layernorm.weight", "blocks.{i}.attn_norm"),
    ("model.layers.{i}.post_attention_layernorm.weight", "blocks.{i}.mlp_norm"),
    ("model.norm.weight", "head.norm"),
    ("lm_head.weight", "head.output"),
]
# Buffers some older exports carry; they are recomputed from the config, never trained.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def _pattern(template: str) -> re.Pattern:
    return re.compile("^" + re.escape(template).replace(re.escape("{i}"), r"(?P<i>\d+)") + "$")


_HF_TO_DTRAIN = [(_pattern(hf), dt) for hf, dt in _NAMES]
_DTRAIN_TO_HF = [(_pattern(dt), hf) for hf, dt in _NAMES]


def _map(name: str, table: list[tuple[re.Pattern, str]]) -> str | None:
    for pattern, template in table:
        if m := pattern.match(name):
            return template.replace("{i}", m.group("i")) if "i" in m.groupdict() else template
    return None


def to_dtrain_name(hf_name: str) -> str | None:
    return _map(hf_name, _HF_TO_DTRAIN)


def to_hf_name(dtrain_name: str) -> str:
    name = _map(dtrain_name, _DTRAIN_TO_HF)
    assert name is not None, dtrain_name
    return name


def config_from_hf(hf: dict[str, Any], source: str) -> LlamaConfig:
    """A LlamaConfig from HF's config.json (the legacy `rope_theta`/`rope_scaling` keys or the
    newer `rope_parameters`)."""
    kind = hf.get("model_type")
    if kind != "llama":
        raise UserError(f"{source}: model_type {kind!r} is not supported; only 'llama' checkpoints "
                        f"are imported (Mixtral import is not available yet)")
    unsupported = {key: hf.get(key) for key, ok in (("hidden_act", "silu"), ("attention_bias", False),
                                                    ("mlp_bias", False)) if hf.get(key, ok) != ok}
    if unsupported:
        raise UserError(f"{source}: {unsupported} differ from dtrain's Llama (silu, no biases); "
                        f"this checkpoint cannot be imported")
    heads = hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
        raise UserError(f"{source}: head_dim={hf['head_dim']} is not hidden_size/num_attention_heads="
                        f"{hf['hidden_size'] // heads}; dtrain needs head_dim = dim / num_heads")
    rope = dict(hf.get("rope_parameters") or {})
    if not rope:
        rope = dict(hf.get("rope_scaling") or {})
        rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise UserError(f"{source}: rope type {rope_type!r} is not supported; dtrain has the default and "
                        f"'llama3' RoPE scalings")
    scaling = None
    if rope_type == "llama3":
        scaling = RopeScaling(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                              high_freq_factor=float(rope["high_freq_factor"]),
                              original_max_seq_len=int(rope["original_max_position_embeddings"]))
    return LlamaConfig(
        dim=hf["hidden_size"], num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, ffn_dim=hf["intermediate_size"],
        vocab_size=hf["vocab_size"], rope_theta=float(rope["rope_theta"]), rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", 1e-6)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def config_to_hf(cfg: LlamaConfig, dtype: torch.dtype, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """HF's config.json for `cfg`; `base` (the config an import came from) keeps its other keys."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    max_positions = 8192
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_seq_len}
        max_positions = int(s.original_max_seq_len * s.factor)
    out = dict(base or {"max_position_embeddings": max_positions})
    out.update(
        architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=cfg.dim,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, intermediate_size=cfg.ffn_dim,
        vocab_size=cfg.vocab_size, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
        hidden_act="silu", attention_bias=False, mlp_bias=False,
    )
    # transformers >= 5 reads `dtype`, older versions `torch_dtype`.
    out["dtype"] = out["torch_dtype"] = str(dtype).removeprefix("torch.")
    # Both spellings of RoPE, so that transformers before and after 5.0 read the same model.
    out["rope_parameters"] = rope
    out["rope_theta"] = cfg.rope_theta
    out["rope_scaling"] = None if cfg.rope_scaling is None else {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


def check_matches(hf_cfg: LlamaConfig, model_cfg: LlamaConfig, model_name: str, source: str) -> None:
    """The run's model must have the checkpoint's shape; the message gives the flags that fix it."""
    if not isinstance(model_cfg, LlamaConfig):
        raise UserError(f"{source}: --init-from-hf reads Llama checkpoints; --model {model_name} is not a Llama")
    differ = [f.name for f in attrs.fields(LlamaConfig)
              if f.name != "init_std" and getattr(hf_cfg, f.name) != getattr(model_cfg, f.name)]
    if not differ:
        return
    have = ",".join(f"{k}={getattr(model_cfg, k)}" for k in differ)
    want = ",".join(f"{k}={getattr(hf_cfg, k)}" for k in differ)
    fix = (f"add --model-overrides {want}" if "rope_scaling" not in differ
           else f"choose a --model preset with rope_scaling={hf_cfg.rope_scaling}")
    raise UserError(f"{source} has {want} but --model {model_name} has {have}; {fix}")


def param_shapes(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model, by dtrain name, in layer order."""
    return {f"{layer.name}.{path}": s.shape for layer in llama.layers(cfg) for path, s in spec.flatten(layer.params)}


class HFCheckpoint:
    """A Hugging Face Llama checkpoint directory, read one tensor at a time (a rank never holds
    more than one full tensor beyond its shards)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise UserError(f"{self.path}: no config.json; pass a Hugging Face model directory")
        try:
            self.raw_config = json.loads(config_path.read_text())
        except ValueError as error:
            raise UserError(f"{config_path} is not valid JSON ({error})") from None
        self.config = config_from_hf(self.raw_config, str(self.path))
        self.files = self._hf_files()  # HF name -> file
        self.locations: dict[str, tuple[Path, str]] = {}
        for hf_name, file in self.files.items():
            name = to_dtrain_name(hf_name)
            if name is None:
                if _IGNORED.search(hf_name):
                    continue
                raise UserError(f"{self.path}: unexpected tensor {hf_name}; it is not part of a Llama model")
            if name == "head.output" and self.config.tie_embeddings:
                continue  # some tied exports also write the (identical) output matrix
            self.locations[name] = (file, hf_name)
        self.shapes = param_shapes(self.config)
        expected = self.shapes
        missing = sorted(set(expected) - set(self.locations), key=list(expected).index)
        extra = sorted(set(self.locations) - set(expected))
        if missing or extra:
            what = f"lacks {to_hf_name(missing[0])}" if missing else f"has {self.locations[extra[0]][1]} beyond num_hidden_layers"
            raise UserError(f"{self.path} {what} ({len(missing)} missing, {len(extra)} unexpected tensors); "
                            f"the checkpoint does not match its config.json")

    def _hf_files(self) -> dict[str, Path]:
        index, single = self.path / INDEX_FILE, self.path / SINGLE_FILE
        from safetensors import safe_open

        if index.is_file():
            weight_map = json.loads(index.read_text())["weight_map"]
            for file in sorted(set(weight_map.values())):
                if not (self.path / file).is_file():
                    raise UserError(f"{self.path}: shard {file} named in {INDEX_FILE} is missing")
            return {name: self.path / file for name, file in weight_map.items()}
        if single.is_file():
            with safe_open(single, "pt") as f:
                return {name: single for name in f.keys()}
        raise UserError(f"{self.path}: neither {SINGLE_FILE} nor {INDEX_FILE}; pass a directory saved "
                        f"with safetensors (save_pretrained(..., safe_serialization=True))")


    def tensor(self, name: str) -> torch.Tensor:
        from safetensors import safe_open

        file, hf_name = self.locations[name]
        with safe_open(file, "pt") as f:
            value = f.get_tensor(hf_name)
        expected = self.shapes[name]
        if tuple(value.shape) != tuple(expected):
            raise UserError(f"{file}: {hf_name} has shape {list(value.shape)} but config.json implies "
                            f"{list(expected)}")
        return value

    def load_all(self) -> dict[str, torch.Tensor]:
        """Every parameter, by dtrain name, in the checkpoint's dtype."""
        return {name: self.tensor(name) for name in self.shapes}


def save_hf(params: dict[str, torch.Tensor], cfg: LlamaConfig, out_dir: str | Path, dtype: torch.dtype,
            base_config: dict[str, Any] | None = None, max_shard_bytes: int = 5 * 2**30) -> None:
    """Writes `params` (dtrain names, full tensors) as HF safetensors, split into shards with an
    index when larger than `max_shard_bytes`, and config.json."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, value in params.items():
        value = value.detach().to("cpu", dtype).contiguous()
        nbytes = value.numel() * value.element_size()
        if shards[-1] and size + nbytes > max_shard_bytes:
            shards.append({})
            size = 0
        shards[-1][to_hf_name(name)] = value
        size += nbytes
    if len(shards) == 1:
        save_file(shards[0], out / SINGLE_FILE, metadata={"format": "pt"})
    else:
        weight_map, total = {}, 0
        for i, shard in enumerate(shards, 1):
            file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            save_file(shard, out / file, metadata={"format": "pt"})
            weight_map.update({name: file for name in shard})
            total += sum(t.numel() * t.element_size() for t in shard.values())
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        (out / INDEX_FILE).write_text(json.dumps(index, indent=2))
    (out / "config.json").write_text(json.dumps(config_to_hf(cfg, dtype, base_config), indent=2))
