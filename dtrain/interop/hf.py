"""Hugging Face checkpoints (Llama here, Mixtral in `dtrain.hf_mixtral`): config and tensor-name
mapping, reading (one safetensors file or shards with `model.safetensors.index.json`) and writing.
dtrain's RoPE uses HF's rotate-half layout, so q/k projections are copied unpermuted and a round
trip is bit-exact."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any, Iterable

import attrs
import torch

from models import families, spec
from models.config import LlamaConfig, MoEConfig, RopeScaling
from models.errors import UserError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"

# (HF name pattern, dtrain name template); `{i}` is the layer index. What every family shares:
SHARED_NAMES = [
    ("model.embed_tokens.weight", "embed.weight"),
    ("model.layers.{i}.self_attn.q_proj.weight", "blocks.{i}.attn.wq"),
    ("model.layers.{i}.self_attn.k_proj.weight", "blocks.{i}.attn.wk"),
    ("model.layers.{i}.self_attn.v_proj.weight", "blocks.{i}.attn.wv"),
    ("model.layers.{i}.self_attn.o_proj.weight", "blocks.{i}.attn.wo"),
    ("model.layers.{i}.input_layernorm.weight", "blocks.{i}.attn_norm"),
    ("model.layers.{i}.post_attention_layernorm.weight", "blocks.{i}.mlp_norm"),
    ("model.norm.weight", "head.norm"),
    ("lm_head.weight", "head.output"),
]
# Llama's dense feed-forward.
_NAMES = SHARED_NAMES + [
    ("model.layers.{i}.mlp.gate_proj.weight", "blocks.{i}.mlp.w_gate"),
    ("model.layers.{i}.mlp.up_proj.weight", "blocks.{i}.mlp.w_up"),
    ("model.layers.{i}.mlp.down_proj.weight", "blocks.{i}.mlp.w_down"),
]
# Buffers some older exports carry; they are recomputed from the config, never trained.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


def pattern(template: str) -> re.Pattern:
    """A template with `{i}` (layer) and `{j}` (expert) placeholders as a regular expression."""
    escaped = re.escape(template)
    for key in ("i", "j"):
        escaped = escaped.replace(re.escape("{" + key + "}"), rf"(?P<{key}>\d+)")
    return re.compile("^" + escaped + "$")


def name_tables(names: list[tuple[str, str]]) -> tuple[list, list]:
    """(HF -> dtrain, dtrain -> HF) lookup tables of a list of (HF, dtrain) templates."""
    return [(pattern(h), d) for h, d in names], [(pattern(d), h) for h, d in names]


_HF_TO_DTRAIN, _DTRAIN_TO_HF = name_tables(_NAMES)


def map_name(name: str, table: list[tuple[re.Pattern, str]]) -> str | None:
    for regex, template in table:
        if m := regex.match(name):
            for key, value in m.groupdict().items():
                template = template.replace("{" + key + "}", value)
            return template
    return None


def to_dtrain_name(hf_name: str) -> str | None:
    return map_name(hf_name, _HF_TO_DTRAIN)


def to_hf_name(dtrain_name: str) -> str:
    name = map_name(dtrain_name, _DTRAIN_TO_HF)
    assert name is not None, dtrain_name
    return name


@attrs.frozen
class Piece:
    """Where (part of) a dtrain parameter lies in an HF checkpoint: a whole tensor; expert
    `expert`'s [out, in] matrix of a stacked [E, out, in] parameter; or the first (`half`=0) or
    second half of dim 1 of a fused [E, 2F, D] tensor."""

    hf_name: str
    expert: int | None = None
    half: int | None = None

    def hf_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        """The HF tensor's shape, for a dtrain parameter of `shape`."""
        if self.expert is not None:
            return tuple(shape[1:])
        if self.half is not None:
            return (shape[0], 2 * shape[1], *shape[2:])
        return tuple(shape)


class Llama:
    """What one HF model_type means to dtrain. `dtrain.hf_mixtral.Mixtral` follows the same interface."""

    model_type, architecture, title, config_cls = "llama", "LlamaForCausalLM", "Llama", LlamaConfig
    # Fields that change neither the parameters nor the forward math, which a run may choose freely.
    free_fields = frozenset({"init_std"})
    export_layout = "hub"

    def config_from_hf(self, hf: dict[str, Any], source: str) -> LlamaConfig:
        common = common_config_from_hf(hf, source, self.title, default_theta=10000.0, default_eps=1e-6)
        return LlamaConfig(ffn_dim=hf["intermediate_size"], **common)

    def config_to_hf(self, cfg: LlamaConfig, dtype: torch.dtype, base: dict[str, Any] | None) -> dict[str, Any]:
        return common_config_to_hf(cfg, dtype, base, 8192, architectures=[self.architecture],
                                   model_type=self.model_type, intermediate_size=cfg.ffn_dim,
                                   attention_bias=False, mlp_bias=False)

    def known(self, hf_name: str) -> bool:
        return to_dtrain_name(hf_name) is not None

    def layout(self, hf_names: Iterable[str]) -> str:
        return "hub"

    def pieces(self, name: str, cfg: LlamaConfig, layout: str) -> list[Piece]:
        return [Piece(to_hf_name(name))]


LLAMA = Llama()


def _families() -> dict[str, Llama]:
    from dtrain import hf_mixtral

    return {"llama": LLAMA, "mixtral": hf_mixtral.MIXTRAL}


def family_of_config(cfg: LlamaConfig | MoEConfig) -> Llama:
    return next(f for f in _families().values() if isinstance(cfg, f.config_cls))


def _family_of_hf(hf: dict[str, Any], source: str) -> Llama:
    kind, known = hf.get("model_type"), _families()
    if kind not in known:
        raise UserError(f"{source}: model_type {kind!r} is not supported; dtrain imports "
                        f"{' and '.join(map(repr, known))} checkpoints")
    return known[kind]


def common_config_from_hf(hf: dict[str, Any], source: str, title: str, *, default_theta: float,
                          default_eps: float) -> dict[str, Any]:
    """The config fields every family shares (the legacy `rope_theta`/`rope_scaling` keys or the
    newer `rope_parameters`), after checking what dtrain's attention cannot do."""
    unsupported = {key: hf.get(key) for key, ok in (("hidden_act", "silu"), ("attention_bias", False),
                                                    ("mlp_bias", False)) if hf.get(key, ok) != ok}
    if unsupported:
        raise UserError(f"{source}: {unsupported} differ from dtrain's {title} (silu, no biases); "
                        f"this checkpoint cannot be imported")
    heads = hf["num_attention_heads"]
    if hf.get("head_dim") not in (None, hf["hidden_size"] // heads):
        raise UserError(f"{source}: head_dim={hf['head_dim']} is not hidden_size/num_attention_heads="
                        f"{hf['hidden_size'] // heads}; dtrain needs head_dim = dim / num_heads")
    rope = dict(hf.get("rope_parameters") or {})
    if not rope:
        rope = dict(hf.get("rope_scaling") or {})
        rope.setdefault("rope_theta", hf.get("rope_theta", default_theta))
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "llama3"):
        raise UserError(f"{source}: rope type {rope_type!r} is not supported; dtrain has the default and "
                        f"'llama3' RoPE scalings")
    scaling = None
    if rope_type == "llama3":
        scaling = RopeScaling(factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
                              high_freq_factor=float(rope["high_freq_factor"]),
                              original_max_seq_len=int(rope["original_max_position_embeddings"]))
    return dict(
        dim=hf["hidden_size"], num_layers=hf["num_hidden_layers"], num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads, vocab_size=hf["vocab_size"],
        rope_theta=float(rope["rope_theta"]), rope_scaling=scaling,
        norm_eps=float(hf.get("rms_norm_eps", default_eps)), tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
    )


def common_config_to_hf(cfg: LlamaConfig | MoEConfig, dtype: torch.dtype, base: dict[str, Any] | None,
                        max_positions: int, **fields: Any) -> dict[str, Any]:
    """HF's config.json: the shared fields, RoPE and dtype, plus the family's `fields`; `base`
    (the config an import came from) keeps its other keys."""
    rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
    if cfg.rope_scaling is not None:
        s = cfg.rope_scaling
        rope = {"rope_type": "llama3", "rope_theta": cfg.rope_theta, "factor": s.factor,
                "low_freq_factor": s.low_freq_factor, "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_seq_len}
        max_positions = int(s.original_max_seq_len * s.factor)
    out = dict(base or {"max_position_embeddings": max_positions})
    out.update(
        hidden_size=cfg.dim, num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads,
        num_key_value_heads=cfg.num_kv_heads, head_dim=cfg.head_dim, vocab_size=cfg.vocab_size,
        rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings, hidden_act="silu", **fields,
    )
    # transformers >= 5 reads `dtype`, older versions `torch_dtype`.
    out["dtype"] = out["torch_dtype"] = str(dtype).removeprefix("torch.")
    # Both spellings of RoPE, so that transformers before and after 5.0 read the same model.
    out["rope_parameters"] = rope
    out["rope_theta"] = cfg.rope_theta
    out["rope_scaling"] = None if cfg.rope_scaling is None else {k: v for k, v in rope.items() if k != "rope_theta"}
    return out


def config_from_hf(hf: dict[str, Any], source: str) -> LlamaConfig | MoEConfig:
    """The model config of HF's config.json (model_type 'llama' or 'mixtral')."""
    family = _family_of_hf(hf, source)
    try:
        return family.config_from_hf(hf, source)
    except KeyError as error:
        raise UserError(f"{source}: config.json has no {error.args[0]!r}; it is not a complete "
                        f"{family.title} config") from None


def config_to_hf(cfg: LlamaConfig | MoEConfig, dtype: torch.dtype, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """HF's config.json for `cfg` (a UserError when HF has no equivalent); `base` keeps its other keys."""
    return family_of_config(cfg).config_to_hf(cfg, dtype, base)


def check_matches(hf_cfg: LlamaConfig | MoEConfig, model_cfg: LlamaConfig | MoEConfig, model_name: str,
                  source: str) -> None:
    """The run's model must have the checkpoint's shape; the message gives the flags that fix it."""
    family = family_of_config(hf_cfg)
    if type(model_cfg) is not type(hf_cfg):
        other = "a Mixtral (MoE) preset such as mixtral-8x7b" if isinstance(hf_cfg, MoEConfig) else "a Llama preset"
        raise UserError(f"{source} is a {family.title} checkpoint but --model {model_name} is not; choose {other}")
    differ = [f.name for f in attrs.fields(type(hf_cfg))
              if f.name not in family.free_fields and getattr(hf_cfg, f.name) != getattr(model_cfg, f.name)]
    if not differ:
        return
    have = ",".join(f"{k}={getattr(model_cfg, k)}" for k in differ)
    want = ",".join(f"{k}={getattr(hf_cfg, k)}" for k in differ)
    fix = (f"add --model-overrides {want}" if "rope_scaling" not in differ
           else f"choose a --model preset with rope_scaling={hf_cfg.rope_scaling}")
    raise UserError(f"{source} has {want} but --model {model_name} has {have}; {fix}")


def param_shapes(cfg: LlamaConfig | MoEConfig) -> dict[str, tuple[int, ...]]:
    """Every parameter of the model, by dtrain name, in layer order."""
    return {f"{layer.name}.{path}": s.shape for layer in families.layers(cfg) for path, s in spec.flatten(layer.params)}


class HFCheckpoint:
    """A Hugging Face Llama or Mixtral checkpoint directory, read one parameter at a time (a rank
    never holds more than one full parameter beyond its shards)."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        config_path = self.path / "config.json"
        if not config_path.is_file():
            raise UserError(f"{self.path}: no config.json; pass a Hugging Face model directory")
        try:
            self.raw_config = json.loads(config_path.read_text())
        except ValueError as error:
            raise UserError(f"{config_path} is not valid JSON ({error})") from None
        self.family = _family_of_hf(self.raw_config, str(self.path))
        self.config = config_from_hf(self.raw_config, str(self.path))
        self.files = self._hf_files()  # HF name -> file
        present = [name for name in self.files if not _IGNORED.search(name)]
        unknown = [name for name in present if not self.family.known(name)]
        if unknown:
            raise UserError(f"{self.path}: unexpected tensor {unknown[0]}; it is not part of a {self.family.title} model")
        self.layout = self.family.layout(present)
        self.shapes = param_shapes(self.config)
        self.pieces = {name: self.family.pieces(name, self.config, self.layout) for name in self.shapes}
        expected = list(dict.fromkeys(p.hf_name for pieces in self.pieces.values() for p in pieces))
        # Some tied exports also write the (identical) output matrix.
        allowed = set(expected) | ({"lm_head.weight"} if self.config.tie_embeddings else set())
        missing = [name for name in expected if name not in self.files]
        extra = [name for name in present if name not in allowed]
        if missing or extra:
            what = f"lacks {missing[0]}" if missing else f"has {extra[0]}, which its config.json does not account for"
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

    def _read(self, piece: Piece, shape: tuple[int, ...]) -> torch.Tensor:
        from safetensors import safe_open

        file = self.files[piece.hf_name]
        with safe_open(file, "pt") as f:
            view = f.get_slice(piece.hf_name)
            expected = piece.hf_shape(shape)
            if tuple(view.get_shape()) != expected:
                raise UserError(f"{file}: {piece.hf_name} has shape {list(view.get_shape())} but config.json "
                                f"implies {list(expected)}")
            if piece.half is None:
                return f.get_tensor(piece.hf_name)
            rows = shape[1]
            return view[:, piece.half * rows:(piece.half + 1) * rows]

    def tensor(self, name: str) -> torch.Tensor:
        """One parameter by dtrain name, in the checkpoint's dtype (experts stacked as dtrain keeps them)."""
        shape, pieces = self.shapes[name], self.pieces[name]
        values = [self._read(piece, shape) for piece in pieces]
        return torch.stack(values) if pieces[0].expert is not None else values[0].contiguous()

    def load_all(self) -> dict[str, torch.Tensor]:
        """Every parameter, by dtrain name, in the checkpoint's dtype."""
        return {name: self.tensor(name) for name in self.shapes}


def save_hf(params: dict[str, torch.Tensor], cfg: LlamaConfig | MoEConfig, out_dir: str | Path, dtype: torch.dtype,
            base_config: dict[str, Any] | None = None, max_shard_bytes: int = 5 * 2**30) -> None:
    """Writes `params` (dtrain names, full tensors) as HF safetensors in the hub's layout (Mixtral:
    one tensor per expert), split into shards with an index when larger than `max_shard_bytes`,
    and config.json."""
    from safetensors.torch import save_file

    family = family_of_config(cfg)
    config = family.config_to_hf(cfg, dtype, base_config)  # refuses a model HF has no equivalent of
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name, value in params.items():
        value = value.detach().to("cpu", dtype)
        for piece in family.pieces(name, cfg, family.export_layout):
            # A clone per expert: safetensors refuses tensors that share memory.
            part = value[piece.expert].clone() if piece.expert is not None else value.contiguous()
            nbytes = part.numel() * part.element_size()
            if shards[-1] and size + nbytes > max_shard_bytes:
                shards.append({})
                size = 0
            shards[-1][piece.hf_name] = part
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
    (out / "config.json").write_text(json.dumps(config, indent=2))
