"""Hugging Face Llama, Mixtral, DeepSeek-V3, gpt-oss and Llama 4 checkpoints <-> dtrain checkpoints.

    python -m tools.hf_convert import HF_DIR RUN_DIR/checkpoints/step_000000
    python -m tools.hf_convert export RUN_DIR_OR_CHECKPOINT OUT_DIR [--dtype bf16]

`import` writes a weights-only dtrain checkpoint at step 0 (AdamW has no state before its first
step, so nothing is lost): `--resume` from it on any mesh, and each rank reads only its shards,
which `--init-from-hf` (every rank reads every full tensor) cannot do for the largest models.
`export` writes safetensors (sharded above --max-shard-gb, with an index) and config.json; Mixtral
experts in the hub's layout, one tensor per expert. A round trip HF -> dtrain -> HF with the
source's dtype gives the same tensors bit for bit (DeepSeek-V3: in DeepSeek's layout, MTP module included).
Neither replaces what it did not write: `import` needs a new (or empty) directory, and `export`
replaces only an earlier export of its own, whole.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import shutil
import sys
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp

from dtrain.checkpoint import reader
from dtrain.checkpoint import storage as ckpt
from dtrain.interop import hf
from models.config import DeepSeekConfig, LlamaConfig, MoEConfig, RopeScaling, YarnScaling
from models.family_configs import GptOssConfig, Llama4Config
from models.errors import UserError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@contextlib.contextmanager
def _one_process():
    """This tool reads and writes checkpoints in one process on purpose; DCP warns about it each time."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        yield


def load_hf_params(hf_dir: str | Path) -> tuple[LlamaConfig | MoEConfig, dict[str, torch.Tensor]]:
    """The model config and every parameter (dtrain names, the checkpoint's dtype) of an HF checkpoint."""
    source = hf.HFCheckpoint(hf_dir)
    return source.config, source.load_all()


def import_hf(hf_dir: str | Path, out_dir: str | Path) -> Path:
    """Writes the HF checkpoint as a committed dtrain checkpoint at step 0 (fp32 master weights),
    into `out_dir`, which must not exist yet or be empty: nothing already there is replaced."""
    source = hf.HFCheckpoint(hf_dir)
    out = Path(out_dir)
    _check_import_target(out)
    # A name of its own beside the target: nothing of the user's can be mistaken for a leftover.
    tmp = hf.new_directory_beside(out, ".import")
    try:
        state = {"model": {name: source.tensor(name).float() for name in source.shapes}}
        # Remembered so that `export` writes the source's dtype back by default (a lossless round trip).
        hf_dtype = str(source.tensor("embed.weight").dtype).removeprefix("torch.")
        with _one_process():
            dcp.save(state, checkpoint_id=str(tmp), no_dist=True)
        meta = {"format": ckpt.FORMAT_VERSION, "step": 0, "consumed_samples": 0,
                "model": ckpt.model_shape(source.config), "mesh": "single", "world_size": 1,
                "scheduler": None, "config": "", "hf_config": source.raw_config,
                "hf_dtype": hf_dtype}
        _check_import_target(out)  # again: the directory may have changed while the tensors were read
        ckpt.commit(tmp, out, meta)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # gone already once committed
    return out


def _check_import_target(out: Path) -> None:
    """An import writes a new checkpoint directory; a run directory or any directory with files in
    it is refused, and left as it is."""
    if out.exists() and not out.is_dir():
        raise UserError(f"{out} is a file; pass a directory to write the checkpoint into")
    if (out / ckpt.COMPLETE).exists():
        raise UserError(f"{out} already holds a checkpoint; pass a new directory")
    entries = sorted(p.name for p in out.iterdir()) if out.is_dir() else []
    if not entries:
        return
    if {ckpt.CHECKPOINTS, "config.toml", "train.log"} & set(entries):
        suggestion = out / ckpt.CHECKPOINTS / ckpt.checkpoint_name(0)
        if suggestion.exists():
            suggestion = out.with_name(out.name + "-imported") / ckpt.CHECKPOINTS / ckpt.checkpoint_name(0)
        raise UserError(f"{out} is a run directory; an import writes one checkpoint directory: pass a path that "
                        f"does not exist yet, such as {suggestion}")
    listed = ", ".join(entries[:3]) + (", ..." if len(entries) > 3 else "")
    raise UserError(f"{out} is not empty (it holds {listed}); an import writes a new checkpoint directory: pass "
                    f"a path that does not exist yet, or an empty directory")


def _model_config(shape: dict[str, Any]) -> LlamaConfig | MoEConfig | DeepSeekConfig:
    shape = dict(shape)
    scaling = shape.get("rope_scaling")
    if scaling is not None:
        shape["rope_scaling"] = (YarnScaling if "beta_fast" in scaling else RopeScaling)(**scaling)
    # Each class by a field only it has (its subclasses' first).
    kinds = [(DeepSeekConfig, "kv_lora_rank"), (GptOssConfig, "swiglu_limit"), (Llama4Config, "qk_l2_norm"),
             (MoEConfig, "num_experts")]
    kind = next((cls for cls, field in kinds if field in shape), LlamaConfig)
    try:
        return kind(**shape)
    except TypeError:
        raise UserError(f"a checkpoint of model shape {sorted(shape)} is none of dtrain's model families (Llama, "
                        f"MoE, DeepSeek, gpt-oss, Llama 4); it cannot be exported") from None


def _find_checkpoint(path: str | Path) -> tuple[Path, bool]:
    """The newest checkpoint `path` names, and whether `path` is that checkpoint itself."""
    candidates, named = ckpt.checkpoints_at(Path(path)) if Path(path).is_dir() else ([], False)
    if not candidates:
        raise UserError(f"{path} is neither a dtrain checkpoint (a step_NNNNNN directory with a {ckpt.COMPLETE} "
                        f"file) nor a run directory that holds one; pass one of those")
    return candidates[0], named


def _read_newest(path: str | Path, before_load=lambda cfg, meta: None):
    """(checkpoint, model config, parameters, meta) of the newest checkpoint `path` names. A run
    that writes there with --keep-last prunes its older checkpoints as it commits newer ones: one
    that vanishes while it is read is read again as the then newest (a named one is an error)."""
    for _ in range(ckpt.MAX_REREADS):
        found, named = _find_checkpoint(path)
        try:
            meta = ckpt.read_meta(found)
            cfg = _model_config(meta["model"])
            before_load(cfg, meta)
            params, meta = _load_params(found, cfg)
            return found, cfg, params, meta
        except (UserError, OSError, dcp.api.CheckpointException) as error:
            if found.exists():
                if isinstance(error, UserError):
                    raise
                first = (str(error).strip().splitlines() or [type(error).__name__])[0][:200]
                raise UserError(f"checkpoint {found} could not be read ({first})") from None
            if named:
                raise UserError(f"checkpoint {found} was deleted while it was read (a run writing there with "
                                f"--keep-last pruned it); pass its run directory to take the newest") from None
    raise UserError(f"{path}: its newest checkpoint was pruned {ckpt.MAX_REREADS} times while it was read; export "
                    f"it once the run that writes there has stopped")


def _load_params(found: Path, cfg: LlamaConfig | MoEConfig) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
    expected = hf.param_shapes(cfg)
    meta, _ = ckpt.check_checkpoint(found, cfg, expected)
    metadata = reader.read_metadata(found)
    state = {"model": {name: torch.empty(shape, dtype=metadata.state_dict_metadata[f"model.{name}"].properties.dtype)
                       for name, shape in expected.items()}}
    with _one_process():
        reader.load(state, found, no_dist=True)
    return state["model"], meta


def export_hf(path: str | Path, out_dir: str | Path, dtype: torch.dtype | None = None,
              max_shard_bytes: int = 5 * 2**30) -> Path:
    """Writes a dtrain checkpoint as an HF checkpoint; by default in the dtype it was imported
    from (fp32 for a model trained from scratch)."""
    hf.check_export_target(Path(out_dir))  # before the checkpoint is read: refused at once
    # A model HF has no equivalent of fails before the read.
    _, cfg, params, meta = _read_newest(path, lambda cfg, meta: hf.config_to_hf(cfg, torch.float32,
                                                                                meta.get("hf_config")))
    if dtype is None:
        dtype = DTYPES.get({"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}.get(
            meta.get("hf_dtype", "float32"), "fp32"))
    hf.save_hf(params, cfg, out_dir, dtype, base_config=meta.get("hf_config"), max_shard_bytes=max_shard_bytes)
    return Path(out_dir)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.hf_convert", description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    p_import = sub.add_parser("import", help="HF checkpoint directory -> dtrain checkpoint (step 0)")
    p_import.add_argument("hf_dir")
    p_import.add_argument("out", help="the checkpoint directory to create, e.g. runs/x/checkpoints/step_000000")
    p_export = sub.add_parser("export", help="dtrain checkpoint (or run directory: its latest) -> HF directory")
    p_export.add_argument("checkpoint")
    p_export.add_argument("out")
    p_export.add_argument("--dtype", choices=tuple(DTYPES), default=None,
                          help="tensor dtype (default: the imported checkpoint's, else fp32)")
    p_export.add_argument("--max-shard-gb", type=float, default=5.0, help="split the safetensors above this size")
    args = parser.parse_args(argv)
    try:
        if args.command == "export" and not (math.isfinite(args.max_shard_gb) and args.max_shard_gb > 0):
            raise UserError(f"--max-shard-gb {args.max_shard_gb} must be a positive number of GB")
        if args.command == "import":
            out = import_hf(args.hf_dir, args.out)
        else:
            out = export_hf(args.checkpoint, args.out, DTYPES[args.dtype] if args.dtype else None,
                            int(args.max_shard_gb * 2**30))
    except UserError as error:
        print(f"hf_convert: error: {error}", file=sys.stderr)
        return 2
    print(f"wrote {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
