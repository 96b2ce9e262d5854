"""Thin nn.Module containers around the functional layers, for the torch APIs that need modules
(FSDP2, pipeline stages, checkpoint state dicts). No math lives here.

Parameter names follow the layer sequence: `embed.weight`, `blocks.3.attn.wq`, `head.output`.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch import nn
from torch.distributed.fsdp import FSDPModule

from models import spec
from models.context import ModelContext
from models.llama import RESIDUAL

MakeParam = Callable[[str, spec.ParamSpec], nn.Parameter]

# The profiler range around the head and its loss: `python -m tools.bench --profile` counts the
# kernels launched in it (and in their backward) that are not GEMMs as the loss's.
LOSS_RANGE = "dtrain::loss"


class ParamNode(nn.Module):
    """One level of a layer's parameter tree. Calling it returns its parameters: a node that is
    its own FSDP unit (expert weights, sharded over other ranks than the rest of the layer) is
    called rather than read, so that FSDP gathers it first."""

    def forward(self) -> dict[str, Any]:
        return _read_tree(self)


def _register_tree(module: nn.Module, params: dict[str, Any], make_param: MakeParam, prefix: str) -> None:
    for key, value in params.items():
        path = f"{prefix}.{key}"
        if isinstance(value, dict):
            child = ParamNode()
            _register_tree(child, value, make_param, path)
            module.add_module(key, child)
        else:
            module.register_parameter(key, make_param(path, value))


def _read_tree(module: nn.Module) -> dict[str, Any]:
    # Read at call time: FSDP swaps the registered parameters between sharded and unsharded ones.
    tree: dict[str, Any] = {name: p for name, p in module.named_parameters(recurse=False)}
    for name, child in module.named_children():
        tree[name] = child() if isinstance(child, FSDPModule) else _read_tree(child)
    return tree


class LayerModule(nn.Module):
    """One layer of the sequence: its parameters, and its forward function called on them."""

    def __init__(self, layer: spec.Layer, make_param: MakeParam, ctx: ModelContext):
        super().__init__()
        _register_tree(self, layer.params, make_param, layer.name)
        self.layer_name = layer.name
        self.ctx = ctx
        self.forward_fn = layer.forward  # recompute and compile wrap this
        self.tied_sources: list[tuple[str, Callable[[], torch.Tensor]]] = []

    def param_tree(self) -> dict[str, Any]:
        tree = _read_tree(self)
        for path, read in self.tied_sources:
            tree[path] = read()
        return tree

    def forward(self, x: torch.Tensor, aux: Any) -> torch.Tensor:
        return self.forward_fn(self.param_tree(), x, aux, self.ctx)


class ModelModule(nn.Module):
    """The layer sequence `embed`, `blocks` (keyed by layer index), `mtp` (multi-token prediction,
    where the model has it), `head`, or a contiguous part of it (a pipeline stage: `embed`, `mtp`
    and `head` are then None where the stage lacks them).

    As a pipeline stage, `forward(x, micro_batch=i)` takes the previous stage's plain local
    activation and micro-batch i's aux from the `stage_aux(i)` the pipeline set (RoPE positions
    and attention masks differ between micro-batches), and returns the blocks' output as a plain
    local tensor: the MTP layer, the head and the loss run in the schedule's loss function
    (`head_loss`), which has the micro-batch's labels. A stage may hold a copy of a layer another
    stage runs (`Layer.run` False: the embedding, which the last stage's MTP layer shares),
    registered under the same name so that checkpoints see one parameter."""

    def __init__(self, layers: list[spec.Layer], make_param: MakeParam, ctx: ModelContext):
        super().__init__()
        self.ctx = ctx
        self.specs = {f"{layer.name}.{path}": s for layer in layers for path, s in spec.flatten(layer.params)}
        modules = {layer.name: LayerModule(layer, make_param, ctx) for layer in layers}
        self.copies = [layer.name for layer in layers if not layer.run]
        assert set(self.copies) <= {"embed"}, self.copies
        self.embed = modules.pop("embed", None)
        self.head = modules.pop("head", None)
        self.mtp = modules.pop("mtp", None)
        self.blocks = nn.ModuleDict({name.split(".", 1)[1]: m for name, m in modules.items()})
        self.runs_embedding = self.embed is not None and not self.copies
        self.pipelined = False
        self.stage_aux: Callable[[int], Any] | None = None  # a pipeline stage's aux by micro-batch, one per call
        # FSDP's units, each with whether it reduces once per step by default (parallel/data_parallel.py).
        self.fsdp_units: list[tuple[nn.Module, bool]] = []
        for layer in layers:
            for path, source in layer.tied.items():
                owner_name, param_name = source.rsplit(".", 1)
                owner = self.get_submodule(owner_name)
                # Not registered twice: the head reads the embedding's current parameter.
                self.get_submodule(layer.name).tied_sources.append(
                    (path, lambda owner=owner, name=param_name: getattr(owner, name))
                )

    @property
    def tied(self) -> bool:
        """Whether some layer reads another's parameters (which must then be gathered throughout)."""
        return any(m is not None and m.tied_sources for m in (self.head, self.mtp))

    def transformer_layers(self) -> list[LayerModule]:
        """The layers that run transformer blocks: the blocks, and the MTP layer."""
        return [*self.blocks.values(), *([self.mtp] if self.mtp is not None else [])]

    def forward(self, x: torch.Tensor, aux: Any = None, micro_batch: torch.Tensor | None = None) -> torch.Tensor:
        if aux is None:
            # The schedule hands each stage its micro-batch's slice of a host index tensor; shape
            # inference may run the stage on a placeholder of it, for which any micro-batch will do.
            index = 0 if micro_batch is None or micro_batch.device.type == "meta" else int(micro_batch)
            aux = self.stage_aux(index)
        if self.runs_embedding:
            x = self.embed(x, aux)
        else:
            x = self.ctx.constrain(x, RESIDUAL, "residual")  # from the previous stage
        for block in self.blocks.values():
            x = block(x, aux)
        if self.pipelined:
            return x.to_local() if hasattr(x, "to_local") else x
        return self._head(x, aux)

    def head_loss(self, x: torch.Tensor, aux: Any) -> torch.Tensor:
        """The last pipeline stage's MTP layer, head and loss on its blocks' (plain) output."""
        return self._head(self.ctx.constrain(x, RESIDUAL, "residual"), aux)

    def _head(self, x: torch.Tensor, aux: Any) -> torch.Tensor:
        with torch.profiler.record_function(LOSS_RANGE):
            loss = self.head(x, aux)
        if self.mtp is not None:
            # Zero in value (the loss stays the next-token loss), with the MTP losses' gradient.
            loss = loss + self.mtp(x, aux)
        return loss
