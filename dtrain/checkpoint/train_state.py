"""A rank's share of the train state in a checkpoint: parameters and optimizer state through torch
DCP (keyed by parameter name, so a load on another mesh reshards), the RNG states, and FP8 delayed
scaling's state. Where the files go and how a save is committed: `dtrain.checkpoint.storage`."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions, get_model_state_dict, get_state_dict, set_model_state_dict, set_state_dict,
)

from dtrain.checkpoint import reader
from dtrain.checkpoint.storage import FP8, CorruptCheckpoint


def rng_state() -> dict[str, torch.Tensor]:
    state = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: dict[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["cpu"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _upload_future(response: Any) -> Any:
    # async_save returns a Future, or with newer stagers a response holding one.
    return getattr(response, "upload_completion", response)


# Optimizer state keyed per parameter (`optim.state.blocks.3.attn.wq.exp_avg`, and the same for
# the param-group hyperparameters): a pipeline rank holds only its stages' parameters, and keys
# shared by all ranks would be written by rank 0 alone.
OPTIONS = StateDictOptions(flatten_optimizer_state_dict=True)


class WholeModel(nn.Module):
    """A rank's pipeline stages as one module with the global parameter names (`blocks.5.attn.wq`),
    so a checkpoint does not depend on how the layers were split into stages."""

    def __init__(self, parts: list[nn.Module]):
        super().__init__()
        self.blocks = nn.ModuleDict()
        for part in parts:
            for name, child in part.named_children():
                if name == "blocks":
                    self.blocks.update(child)
                elif name not in self._modules:
                    self.add_module(name, child)


def as_one_module(parts: list[nn.Module]) -> nn.Module:
    return parts[0] if len(parts) == 1 else WholeModel(parts)


def save_train_state(model, optimizer, path: Path, *, rank: int, async_group=None,
                     fp8_state: dict[str, torch.Tensor] | None = None) -> Any:
    """Every rank writes its shards into `path`; with `async_group` the write runs in the
    background (after a copy to host memory) and the future is returned. `fp8_state` (the same
    on every rank of a pipeline stage) is written once."""
    (path / "rng").mkdir(parents=True, exist_ok=True)
    torch.save(rng_state(), path / "rng" / f"rank_{rank:05d}.pt")
    model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
    state = {"model": model_sd, "optim": optim_sd}
    if fp8_state:
        state[FP8] = fp8_state
    if async_group is not None:
        return _upload_future(dcp.async_save(state, checkpoint_id=str(path), process_group=async_group))
    dcp.save(state, checkpoint_id=str(path))
    return None


def load_train_state(model, optimizer, path: Path, *, rank: int, has_optim: bool) -> None:
    """Loads parameters (and optimizer state) into this rank's shards, resharding as needed."""
    try:
        if has_optim:
            model_sd, optim_sd = get_state_dict(model, optimizer, options=OPTIONS)
            state = {"model": model_sd, "optim": optim_sd}
            reader.load(state, path)
            set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"],
                           options=OPTIONS)
        else:  # an imported checkpoint: weights only, at step 0 where AdamW has no state yet
            state = {"model": get_model_state_dict(model)}
            reader.load(state, path)
            set_model_state_dict(model, state["model"])
    except dcp.api.CheckpointException as error:
        first = str(error).strip().splitlines()[0][:200]
        raise CorruptCheckpoint(f"checkpoint {path} could not be read ({first}); it is corrupt: resume from an "
                                f"earlier checkpoint") from error
    rng_dir = path / "rng"
    own = rng_dir / f"rank_{rank:05d}.pt"
    # A resumed run with more ranks than the saved one gives the new ranks rank 0's states.
    source = own if own.is_file() else rng_dir / "rank_00000.pt"
    if source.is_file():
        try:
            states = torch.load(source, weights_only=True)
        except Exception as error:  # damaged bytes: the unpickler can raise almost anything
            raise CorruptCheckpoint(f"checkpoint {path}: {source.name} is not readable ({type(error).__name__}); "
                                    f"it is corrupt: resume from an earlier checkpoint") from None
        set_rng_state(states)


def load_fp8_state(path: Path, names: list[str]) -> dict[str, torch.Tensor]:
    """The FP8 scaling entries among `names` that the checkpoint holds, in their saved shapes
    (the caller adapts them); none for a checkpoint of a run without FP8 delayed scaling."""
    saved = reader.read_metadata(path).state_dict_metadata
    state = {}
    for name in names:
        entry = saved.get(f"{FP8}.{name}")
        if entry is not None and hasattr(entry, "size"):
            state[name] = torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
    if state:
        reader.load({FP8: state}, path)
    return state
