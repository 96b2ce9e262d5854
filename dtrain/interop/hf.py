"""Hugging Face checkpoints <-> dtrain: reading (one safetensors file, or shards with
`model.safetensors.index.json`) one parameter at a time, writing in the hub's layout, and the
config conversion of each family. The families (Llama, Mixtral, ...) are the modules of this
package that define `FAMILY`; this module finds them."""

from __future__ import annotations

import functools
import importlib
import json
import pkgutil
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import attrs
import torch

from dtrain.interop import mxfp4
from dtrain.interop.family import CONFIG_TYPES, HFFamily, Piece, check_config_types, join_halves
from models import families, spec
from models.config import LlamaConfig, MoEConfig
from models.errors import UserError

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
_SHARD_NAME = re.compile(r"^model-\d{5}-of-\d{5}\.safetensors$")
# In the header of every safetensors file an export writes: what says a directory is an earlier
# export that the next one may replace ("format": "pt" is what transformers expects there).
EXPORT_METADATA = {"format": "pt", "writer": "dtrain"}

# Buffers some older exports carry; they are recomputed from the config, never trained.
_IGNORED = re.compile(r"(^|\.)rotary_emb\.inv_freq$")


@functools.cache
def hf_families() -> dict[str, HFFamily]:
    """Every family of this package by HF model_type: each module here that defines `FAMILY`."""
    package = importlib.import_module(__package__)
    found = {}
    for info in pkgutil.iter_modules(package.__path__):
        family = getattr(importlib.import_module(f"{__package__}.{info.name}"), "FAMILY", None)
        if family is not None:
            for model_type in (family.model_type, *family.also_reads):
                found[model_type] = family
    return found


def family_of_config(cfg: LlamaConfig | MoEConfig) -> HFFamily | None:
    """The family that describes `cfg` (`HFFamily.describes`), or None where no HF family does."""
    return next((f for f in hf_families().values() if f.describes(cfg)), None)


def _family_to_export(cfg: LlamaConfig | MoEConfig) -> HFFamily:
    family = family_of_config(cfg)
    if family is None:
        raise UserError(f"dtrain exports {', '.join(f.title for f in hf_families().values())} models; this "
                        f"{type(cfg).__name__} is none of them, so it has no Hugging Face equivalent")
    return family


def _family_of_hf(hf: dict[str, Any], source: str) -> HFFamily:
    kind, known = hf.get("model_type"), hf_families()
    if kind not in known:
        *others, last = map(repr, sorted(known))
        raise UserError(f"{source}: model_type {kind!r} is not supported; dtrain imports "
                        f"{', '.join(others)} and {last} checkpoints")
    return known[kind]


def config_from_hf(hf: dict[str, Any], source: str) -> LlamaConfig | MoEConfig:
    """The model config of HF's config.json (any model_type of `hf_families()`)."""
    family = _family_of_hf(hf, source)
    check_config_types(hf, {**CONFIG_TYPES, **family.config_types}, source)
    try:
        return family.config_from_hf(hf, source)
    except KeyError as error:
        raise UserError(f"{source}: config.json has no {error.args[0]!r}; it is not a complete "
                        f"{family.title} config") from None
    except UserError:
        raise
    except (TypeError, ValueError, ArithmeticError, AttributeError) as error:  # a value of a kind not checked above
        raise UserError(f"{source}: config.json cannot be read as a {family.title} config ({type(error).__name__}: "
                        f"{error}); compare it with the model's published config.json") from None


def config_to_hf(cfg: LlamaConfig | MoEConfig, dtype: torch.dtype, base: dict[str, Any] | None = None) -> dict[str, Any]:
    """HF's config.json for `cfg` (a UserError when HF has no equivalent); `base` keeps its other keys."""
    return _family_to_export(cfg).config_to_hf(cfg, dtype, base)


def check_matches(hf_cfg: LlamaConfig | MoEConfig, model_cfg: LlamaConfig | MoEConfig, model_name: str,
                  source: str) -> None:
    """The run's model must have the checkpoint's shape; the message gives the flags that fix it."""
    family = family_of_config(hf_cfg)
    if not family.describes(model_cfg):
        raise UserError(f"{source} is a {family.title} checkpoint but --model {model_name} is not; "
                        f"choose {family.preset_hint}")
    # By the constructor's names, whose values are what the model reads (`head_dim` whether set or
    # dim / num_heads).
    differ = [f.alias for f in attrs.fields(type(hf_cfg))
              if f.alias not in family.free_fields and getattr(hf_cfg, f.alias) != getattr(model_cfg, f.alias)]
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
    """A Hugging Face checkpoint directory of a family here, read one parameter at a time (a rank
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
        if not isinstance(self.raw_config, dict):
            raise UserError(f"{config_path} holds a {type(self.raw_config).__name__}, not an object of model "
                            f"settings; pass a Hugging Face model directory")
        self.family = _family_of_hf(self.raw_config, str(self.path))
        self.config = config_from_hf(self.raw_config, str(self.path))
        self.files = self._hf_files()  # HF name -> file
        present = [name for name in self.files if not _IGNORED.search(name)]
        unknown = [name for name in present if not self.family.known(name)]
        if unknown:
            raise UserError(f"{self.path}: unexpected tensor {unknown[0]}; it is not part of a {self.family.title} model")
        self.config = self.family.with_tensors(self.config, present)
        present = [name for name in present if not self.family.ignored(name, self.config)]
        self.layout = self.family.layout(present, self.raw_config)
        self.shapes = param_shapes(self.config)
        self.pieces = {name: self.family.pieces(name, self.config, self.layout) for name in self.shapes}
        expected = list(dict.fromkeys(name for pieces in self.pieces.values() for p in pieces for name in p.hf_names()))
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
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as error:
                raise UserError(f"{index} is not a safetensors index (no readable weight_map: {error}); "
                                f"re-download or re-save the checkpoint") from None
            if not isinstance(weight_map, dict):
                raise UserError(f"{index}: weight_map is not an object of tensor names to files; re-download or "
                                f"re-save the checkpoint")
            for name, file in weight_map.items():
                if not isinstance(file, str):
                    raise UserError(f"{index} names {file!r} for {name}, not a file name; re-download or re-save "
                                    f"the checkpoint")
                # By the names alone (symbolic links stay allowed: a hub cache links to its blobs).
                if Path(file).is_absolute() or ".." in Path(file).parts:
                    raise UserError(f"{index} names {file!r}, outside {self.path}: every shard must be a file in "
                                    f"the checkpoint's own directory; re-download it from a source you trust")
            for file in sorted(set(weight_map.values())):
                if not (self.path / file).is_file():
                    raise UserError(f"{self.path}: shard {file} named in {INDEX_FILE} is missing")
            return {name: self.path / file for name, file in weight_map.items()}
        if single.is_file():
            with _open_safetensors(single) as f:
                return {name: single for name in f.keys()}
        raise UserError(f"{self.path}: neither {SINGLE_FILE} nor {INDEX_FILE}; pass a directory saved "
                        f"with safetensors (save_pretrained(..., safe_serialization=True))")

    def _read(self, piece: Piece, shape: tuple[int, ...]) -> torch.Tensor:
        """The whole HF tensor of `piece` (dequantized where it is MXFP4), its shape and values checked."""
        file = self.files[piece.hf_name]
        value = self._read_stored(piece.hf_name)
        if piece.scales is not None:
            value = mxfp4.dequantize(value, self._read_stored(piece.scales), name=f"{file}: {piece.hf_name}")
        expected = piece.hf_shape(shape)
        if tuple(value.shape) != expected:
            raise UserError(f"{file}: {piece.hf_name} has shape {list(value.shape)} but config.json implies "
                            f"{list(expected)}{self._fields_setting(value.shape, expected)}")
        _check_values(value, piece.hf_name, file)
        return value

    def _fields_setting(self, found: tuple[int, ...], expected: tuple[int, ...]) -> str:
        """The config.json fields whose value is a size that differs (the fields to correct, or
        the sign that the weights belong to another config.json)."""
        hints = []
        for got, want in zip(found, expected):
            if got != want:
                keys = [k for k, v in self.raw_config.items() if type(v) is int and v in (want, got)]
                hints.append(f"{want} (config.json's {' or '.join(keys)})" if keys else str(want))
        if len(found) != len(expected) or not hints:
            return ""
        return f": the size {', '.join(hints)} differs; correct that field or use the config.json of these weights"

    def _read_stored(self, hf_name: str) -> torch.Tensor:
        file = self.files[hf_name]
        with _open_safetensors(file) as f:
            try:
                return f.get_tensor(hf_name)
            except Exception:  # safetensors' error for a name the file does not hold
                raise UserError(f"{self.path / INDEX_FILE} places {hf_name} in {file.name}, which does not "
                                f"hold it; re-download or re-save the checkpoint") from None

    def tensor(self, name: str) -> torch.Tensor:
        """One parameter by dtrain name, in the checkpoint's dtype (experts stacked as dtrain keeps them)."""
        shape, pieces = self.shapes[name], self.pieces[name]
        values = [piece.to_dtrain(self._read(piece, shape)) for piece in pieces]
        return torch.stack(values) if pieces[0].expert is not None else values[0].contiguous()

    def load_all(self) -> dict[str, torch.Tensor]:
        """Every parameter, by dtrain name, in the checkpoint's dtype."""
        return {name: self.tensor(name) for name in self.shapes}


# What a weight may be stored as; a cast from anything else (integers, booleans, float8 without its
# scales) would import numbers that were never the model's.
FLOAT_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64)


def _check_values(value: torch.Tensor, hf_name: str, file: Path) -> None:
    if value.dtype not in FLOAT_DTYPES:
        raise UserError(f"{file}: {hf_name} holds {str(value.dtype).removeprefix('torch.')} values; dtrain imports "
                        f"floating-point weights (float32, bfloat16, float16, float64): convert the checkpoint to "
                        f"one of those")
    bad = int(value.numel() - torch.isfinite(value).sum())
    if bad:
        raise UserError(f"{file}: {hf_name} holds {bad} NaN or infinite value{'s' if bad > 1 else ''}; the "
                        f"checkpoint is damaged: re-download it or import another")


def _open_safetensors(file: Path):
    """The file opened by safetensors, which checks its header and that the data covers it; a
    truncated or damaged file is a one-line error that names it."""
    from safetensors import SafetensorError, safe_open

    try:
        return safe_open(file, "pt")
    except (SafetensorError, OSError) as error:
        raise UserError(f"{file} is not a whole safetensors file ({error}); re-download or re-save "
                        f"it") from None


def save_hf(params: dict[str, torch.Tensor], cfg: LlamaConfig | MoEConfig, out_dir: str | Path, dtype: torch.dtype,
            base_config: dict[str, Any] | None = None, max_shard_bytes: int = 5 * 2**30) -> None:
    """Writes `params` (dtrain names, full tensors) as HF safetensors in the hub's layout (Mixtral:
    one tensor per expert), split into shards with an index when larger than `max_shard_bytes`,
    and config.json. The files are written into a new directory beside `out_dir` and renamed into
    place, replacing an earlier export whole (see `check_export_target`)."""
    from safetensors.torch import save_file

    family = _family_to_export(cfg)
    config = family.config_to_hf(cfg, dtype, base_config)  # refuses a model HF has no equivalent of
    layout = family.export_layout_of(base_config)
    out = Path(out_dir)
    check_export_target(out)
    tmp = new_directory_beside(out, ".export")
    try:
        shards: list[dict[str, torch.Tensor]] = [{}]
        size = 0
        halves: dict[str, dict[int, torch.Tensor]] = {}  # fused HF tensors waiting for their other half
        for name, value in params.items():
            value = value.detach().to("cpu", dtype)
            for index, piece in enumerate(family.pieces(name, cfg, layout)):
                # A clone per expert, and per copy of a shared weight: safetensors refuses tensors that share memory.
                part = value[piece.expert].clone() if piece.expert is not None else value.contiguous()
                part = piece.to_hf(part.clone() if index else part)
                if piece.half is not None:
                    halves.setdefault(piece.hf_name, {})[piece.half] = part
                    if len(halves[piece.hf_name]) < 2:
                        continue
                    both = halves.pop(piece.hf_name)
                    part = join_halves(both[0], both[1], piece)
                nbytes = part.numel() * part.element_size()
                if shards[-1] and size + nbytes > max_shard_bytes:
                    shards.append({})
                    size = 0
                shards[-1][piece.hf_name] = part
                size += nbytes
        assert not halves, f"fused tensors with one half only: {sorted(halves)}"
        if len(shards) == 1:
            save_file(shards[0], tmp / SINGLE_FILE, metadata=EXPORT_METADATA)
        else:
            weight_map, total = {}, 0
            for i, shard in enumerate(shards, 1):
                file = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
                save_file(shard, tmp / file, metadata=EXPORT_METADATA)
                weight_map.update({name: file for name in shard})
                total += sum(t.numel() * t.element_size() for t in shard.values())
            index = {"metadata": {"total_size": total}, "weight_map": weight_map}
            (tmp / INDEX_FILE).write_text(json.dumps(index, indent=2))
        (tmp / "config.json").write_text(json.dumps(config, indent=2))
        check_export_target(out)  # again: the directory may have changed while the files were written
        _replace_dir(tmp, out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once renamed


def check_export_target(out: Path) -> None:
    """An export writes a directory that does not exist yet, an empty one, or one that holds an
    earlier export of dtrain and nothing else (its safetensors files say they were written by
    dtrain); anything else is refused and left as it is."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file; pass a directory to write the Hugging Face checkpoint into")
    entries = sorted(out.iterdir()) if out.is_dir() else []
    foreign = [p.name for p in entries if not _written_by_export(p)]
    if foreign:
        listed = ", ".join(foreign[:3]) + (", ..." if len(foreign) > 3 else "")
        raise UserError(f"{out} holds files that no export of dtrain wrote ({listed}); pass a new directory "
                        f"(an export replaces only an earlier export of its own)")


def new_directory_beside(out: Path, suffix: str) -> Path:
    """An empty directory of a name no one else uses, beside `out` (its parents made as needed)."""
    try:
        out.parent.mkdir(parents=True, exist_ok=True)
        return Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=suffix))
    except OSError as error:
        raise UserError(f"cannot write beside {out} ({error.strerror}: {error.filename}); pass a path in a directory "
                        f"you can write") from None


def _written_by_export(path: Path) -> bool:
    if path.name in ("config.json", INDEX_FILE):
        return path.is_file()
    if not (path.name == SINGLE_FILE or _SHARD_NAME.match(path.name)) or not path.is_file():
        return False
    try:
        with _open_safetensors(path) as f:
            return (f.metadata() or {}).get("writer") == EXPORT_METADATA["writer"]
    except UserError:
        return False


def _replace_dir(new: Path, out: Path) -> None:
    """`new` renamed to `out`; an `out` already there (checked to be an earlier export, or empty)
    is renamed aside first and then deleted."""
    if out.is_dir() and not any(out.iterdir()):
        out.rmdir()
    if not out.exists():
        new.rename(out)
        return
    old = Path(tempfile.mkdtemp(dir=out.parent, prefix=f".{out.name}.", suffix=".old"))
    old.rmdir()  # the name alone: rename needs the destination free
    out.rename(old)
    new.rename(out)
    shutil.rmtree(old, ignore_errors=True)
