"""The sharding plan: an ordered table from logical axes to mesh axes, resolved into DTensor placements.

The plan is data. Model code names logical axes (on parameters and at a few activation points);
the plan says which mesh axes split each of them. Switching from FSDP to TP+SP is an edit of
this table, never of model code:

    plan = Plan.build(mesh_spec, sequence_parallel=True)
    plan = plan.with_rules(params={"mlp": None})        # keep the MLP replicated over tp
    print(plan.describe(llama.layers(cfg)))

Parameters are additionally sharded on dim 0 over the data-parallel axes (FSDP; HSDP when
dp_replicate > 1), as `data_parallel_axes` says.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any, Union

import attrs
from torch.distributed.tensor import Placement, Replicate, Shard

from models import spec
from models.errors import UserError
from parallel.mesh import DATA_PARALLEL_DIMS, MESH_DIMS, MeshSpec

MeshAxes = Union[str, tuple[str, ...], None]
Rules = Mapping[str, MeshAxes]

# Megatron-style tensor parallelism: attention heads and the MLP hidden dim split column-then-row,
# the vocabulary split in the embedding and the output head.
DEFAULT_PARAM_RULES: dict[str, MeshAxes] = {
    "vocab": "tp", "heads": "tp", "kv_heads": "tp", "mlp": "tp", "embed": None,
    # Expert parallelism: whole experts per rank over ep; the router stays whole on every rank.
    "expert": "ep", "expert_mlp": None, "router": None,
    # MLA's latent projections and norms: small, and needed whole by every head.
    "latent": None,
    # A vector over one head's dims that every head shares (qk-norm's weights): whole on every tp
    # rank, whose heads each give a partial gradient that DTensor sums over tp.
    "head_dim": None,
}

# Activation layouts per region of the forward. Axes not named stay unsplit (over tp and cp);
# the batch is always split over the data-parallel ranks, which each load their own rows.
DEFAULT_ACTIVATION_RULES: dict[str, dict[str, MeshAxes]] = {
    "input": {},                       # token ids, replicated over tp
    "residual": {},                    # residual stream and norms
    "block_input": {},                 # normed input of the column-parallel matmuls: gathered over tp,
                                       # or left on sequence shards for matmuls that gather it themselves
    "attention": {"heads": "tp", "kv_heads": "tp"},
    "logits": {"vocab": "tp"},         # vocab-parallel logits and loss
}


def resolve(axes: tuple[str | None, ...], rules: Rules, mesh_dims: tuple[str, ...]) -> tuple[Placement, ...]:
    """Placements on a mesh with `mesh_dims` for a tensor whose dims carry logical `axes`."""
    placements: list[Placement] = [Replicate() for _ in mesh_dims]
    for tensor_dim, axis in enumerate(axes):
        mapped = rules.get(axis) if axis is not None else None
        mapped = (mapped,) if isinstance(mapped, str) else (mapped or ())
        for mesh_axis in mapped:
            if mesh_axis not in mesh_dims:
                continue  # a mesh axis of size 1, or one this tensor does not live on
            index = mesh_dims.index(mesh_axis)
            if placements[index] != Replicate():
                raise UserError(
                    f"mesh axis {mesh_axis!r} splits two dims of a tensor with axes {axes}; "
                    f"map only one of them to {mesh_axis!r} in the plan"
                )
            placements[index] = Shard(tensor_dim)
    return tuple(placements)


# Parameters are split by rules over the model-parallel axes only: the data axes (and cp, whose
# ranks hold other tokens of the same samples) shard them through FSDP. Activations are split by
# rules over tp only; over cp each rank holds its own load-balanced tokens.
RULE_MESH_AXES = {"parameter": ("tp", "ep"), "activation": ("tp",)}


def _check_rules(rules: Rules, known_axes: tuple[str, ...], what: str) -> None:
    for axis, mapped in rules.items():
        if axis not in known_axes:
            raise UserError(f"unknown logical axis {axis!r} in the {what} rules; known: {', '.join(known_axes)}")
        mapped = (mapped,) if isinstance(mapped, str) else (mapped or ())
        allowed = RULE_MESH_AXES["parameter" if what == "parameter" else "activation"]
        for mesh_axis in mapped:
            if mesh_axis not in (*MESH_DIMS, "ep"):
                raise UserError(
                    f"the plan maps {axis!r} to unknown mesh axis {mesh_axis!r}; use one of {', '.join(MESH_DIMS)}"
                )
            if mesh_axis not in allowed:
                raise UserError(
                    f"the {what} rules map {axis!r} to {mesh_axis!r}; they may use only {', '.join(allowed)} "
                    f"(data and context axes split parameters through FSDP, and activations by the data layout)"
                )
        if list(mapped) != sorted(mapped, key=lambda m: (*MESH_DIMS, "ep").index(m)):
            raise UserError(f"the plan maps {axis!r} to {mapped}: list mesh axes outermost first ({', '.join(MESH_DIMS)})")


@attrs.frozen
class Plan:
    """Rules from logical axes to mesh axes, for parameters and for each activation region."""

    mesh_spec: MeshSpec
    param_rules: dict[str, MeshAxes] = attrs.field(factory=lambda: dict(DEFAULT_PARAM_RULES))
    activation_rules: dict[str, dict[str, MeshAxes]] = attrs.field(
        factory=lambda: {k: dict(v) for k, v in DEFAULT_ACTIVATION_RULES.items()}
    )
    data_parallel_axes: tuple[str, ...] = DATA_PARALLEL_DIMS

    @classmethod
    def build(cls, mesh_spec: MeshSpec, *, sequence_parallel: bool = False,
              num_kv_heads: int | None = None, tp_overlap: bool = False) -> Plan:
        plan = cls(mesh_spec)
        if num_kv_heads is not None and mesh_spec.tp > num_kv_heads:
            # Fewer KV heads than tp ranks: keep K/V projections whole on every rank; attention
            # then takes the KV head that each rank's query heads share (as Megatron does).
            plan = plan.with_rules(params={"kv_heads": None}, activations={"attention": {"kv_heads": None}})
        if sequence_parallel:
            # Megatron SP: norms and residuals run on sequence shards; all-gather into the TP
            # regions and reduce-scatter out of them instead of one all-reduce.
            plan = plan.with_rules(activations={"residual": {"seq": "tp"}})
            if tp_overlap:
                # The column-parallel matmuls gather their input while they multiply, and the
                # row-parallel ones scatter their output as it is produced (tensor_parallel.py).
                plan = plan.with_rules(activations={"block_input": {"seq": "tp"}})
        return plan

    def with_rules(self, *, params: Rules | None = None,
                   activations: Mapping[str, Rules] | None = None) -> Plan:
        """A copy with some rules replaced; a rule mapped to None keeps that axis unsplit."""
        param_rules = {**self.param_rules, **(params or {})}
        _check_rules(param_rules, spec.PARAM_AXES, "parameter")
        activation_rules = {k: dict(v) for k, v in self.activation_rules.items()}
        for region, rules in (activations or {}).items():
            if region not in activation_rules:
                raise UserError(f"unknown activation region {region!r}; known: {', '.join(activation_rules)}")
            _check_rules(rules, spec.ACTIVATION_AXES, f"{region!r} activation")
            activation_rules[region].update(rules)
        return attrs.evolve(self, param_rules=param_rules, activation_rules=activation_rules)

    @property
    def sequence_parallel(self) -> bool:
        return self.activation_rules["residual"].get("seq") is not None and self.mesh_spec.tp > 1

    @property
    def overlaps_tp(self) -> bool:
        """Whether the matmuls' inputs stay sequence-sharded for matmuls that gather them."""
        return self.sequence_parallel and self.activation_rules["block_input"].get("seq") is not None

    def _active(self, dims: tuple[str, ...]) -> tuple[str, ...]:
        """The dims of `dims` that have more than one rank, in mesh order."""
        sizes = self.mesh_spec.sizes()
        return tuple(d for d in MESH_DIMS if d in dims and sizes[d] > 1)

    @property
    def param_mesh_dims(self) -> tuple[str, ...]:
        """Model-parallel mesh dims that parameters are split over before data parallelism."""
        used = {m for v in self.param_rules.values() for m in ((v,) if isinstance(v, str) else (v or ()))}
        return self._active(tuple(used - set(self.data_parallel_axes)))

    @staticmethod
    def is_expert(axes: tuple[str, ...]) -> bool:
        return "expert" in axes

    def expert_placements(self, axes: tuple[str, ...]) -> tuple[Placement, ...]:
        """Placements of an expert weight on the expert mesh's `ep` dim."""
        return resolve(axes, self.param_rules, ("ep",))

    @property
    def activation_mesh_dims(self) -> tuple[str, ...]:
        # Over cp each rank holds its own load-balanced chunks of every sequence (not a contiguous
        # shard DTensor could describe): activations are local there, and only attention talks.
        return self._active(("tp",))

    def param_placements(self, axes: tuple[str, ...]) -> tuple[Placement, ...]:
        return resolve(axes, self.param_rules, self.param_mesh_dims)

    def activation_placements(self, axes: tuple[str | None, ...], region: str) -> tuple[Placement, ...]:
        if region not in self.activation_rules:
            raise KeyError(f"model code names unknown activation region {region!r}")
        return resolve(axes, self.activation_rules[region], self.activation_mesh_dims)

    def expert_fsdp_dim(self, shape: tuple[int, ...]) -> int:
        """The dim FSDP shards an expert weight over edp (the ranks that hold the same experts):
        the experts' own (dim 0) where each edp rank gets the same whole experts, else dim 1 (the
        expert's expert_mlp or embed dim): with fewer local experts than edp ranks, a dim-0 split
        would leave the first ranks every expert and the others padding of the same size."""
        spec = self.mesh_spec
        return 0 if -(-shape[0] // spec.ep) % spec.edp == 0 else 1

    def full_placements(self, axes: tuple[str, ...], shape: tuple[int, ...] | None = None) -> dict[str, str]:
        """Each active mesh dim -> placement of one parameter (of global `shape`, which decides an
        expert weight's FSDP dim) once data parallelism is applied."""
        if self.is_expert(axes) and self.mesh_spec.ep > 1:
            layout = {"dp_replicate": "R"} if self.mesh_spec.dp_replicate > 1 else {}
            if self.mesh_spec.edp > 1:
                layout["edp"] = f"S({self.expert_fsdp_dim(shape) if shape else 0})"
            layout["ep"] = _short(self.expert_placements(axes)[0])
            if self.mesh_spec.tp > 1 and not self.mesh_spec.experts_fold_tp:
                layout["tp"] = "R"  # every tp rank runs the experts on its own share of the tokens
            return layout
        layout = dict(zip(self.param_mesh_dims, map(_short, self.param_placements(axes))))
        for dim in self._active((*self.data_parallel_axes, "cp")):
            # FSDP shards dim 0 over dp_shard x cp; HSDP replicates those shards over dp_replicate.
            layout[dim] = "R" if dim == "dp_replicate" else "S(0)"
        return {dim: layout[dim] for dim in MESH_DIMS if dim in layout}

    def gathered_shape(self, shape: tuple[int, ...], axes: tuple[str, ...]) -> tuple[int, ...]:
        """The shape FSDP all-gathers for compute on the first rank: split over the model-parallel
        dims (tp, or ep for expert weights) only (uneven splits round up, like torch.chunk)."""
        gathered = list(shape)
        if self.is_expert(axes) and self.mesh_spec.ep > 1:
            dims_and_placements = [("ep", p) for p in self.expert_placements(axes)]
        else:
            dims_and_placements = zip(self.param_mesh_dims, self.param_placements(axes))
        sizes = {**self.mesh_spec.sizes(), "ep": self.mesh_spec.ep}
        for dim, placement in dims_and_placements:
            if isinstance(placement, Shard):
                gathered[placement.dim] = math.ceil(gathered[placement.dim] / sizes[dim])
        return tuple(gathered)

    def fsdp_shards(self, axes: tuple[str, ...]) -> int:
        """How many ranks FSDP splits dim 0 of a parameter over (1: it is whole after gathering)."""
        spec = self.mesh_spec
        if self.is_expert(axes) and spec.ep > 1:
            return spec.edp
        return spec.dp_shard * spec.cp

    def local_shape(self, shape: tuple[int, ...], axes: tuple[str, ...],
                    coordinates: Mapping[str, int] | None = None) -> tuple[int, ...]:
        """The shard shape on the rank at `coordinates` (`MeshSpec.coordinates`; default: the first
        rank). Splits follow torch.chunk: uneven ones leave the last ranks less, or nothing."""
        at = coordinates or {}
        local = list(shape)
        sizes = self.mesh_spec.sizes()

        def split(dim: int, parts: int, index: int) -> None:
            chunk = -(-local[dim] // parts)
            local[dim] = max(0, min(chunk, local[dim] - chunk * index))

        if self.is_expert(axes) and self.mesh_spec.ep > 1:
            for placement in self.expert_placements(axes):
                if isinstance(placement, Shard):
                    split(placement.dim, self.mesh_spec.ep, at.get("ep", 0))
            split(self.expert_fsdp_dim(shape), self.mesh_spec.edp, at.get("edp", 0))
            return tuple(local)
        for dim, placement in zip(self.param_mesh_dims, self.param_placements(axes)):
            if isinstance(placement, Shard):
                split(placement.dim, sizes[dim], at.get(dim, 0))
        # FSDP shards dim 0 over dp_shard x cp, one flattened dim (dp_shard outer).
        split(0, sizes["dp_shard"] * sizes["cp"], at.get("dp_shard", 0) * sizes["cp"] + at.get("cp", 0))
        return tuple(local)

    def describe(self, layers: list[spec.Layer]) -> str:
        """A table of every parameter: logical axes, placements per mesh dim, local shard shape."""
        rows = [("parameter", "logical axes", "placements", "global shape", "local shape")]
        for layer in layers:
            for path, param in spec.flatten(layer.params):
                placements = " ".join(f"{d}:{p}" for d, p in self.full_placements(param.axes, param.shape).items())
                rows.append((
                    f"{layer.name}.{path}", ",".join(param.axes), placements or "replicated",
                    "x".join(map(str, param.shape)),
                    "x".join(map(str, self.local_shape(param.shape, param.axes))),
                ))
            rows.extend((f"{layer.name}.{path}", "tied to", source, "", "") for path, source in layer.tied.items())
        widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
        lines = [f"mesh: {self.mesh_spec} (world size {self.mesh_spec.world_size})",
                 "rules: " + ", ".join(f"{a}->{_axes_text(m)}" for a, m in self.param_rules.items())]
        if self.sequence_parallel:
            lines.append("sequence parallel: residual stream split over tp along seq" + (
                "; all-gathers and reduce-scatters fused with the matmuls" if self.overlaps_tp else ""))
        lines += ["  ".join(cell.ljust(w) for cell, w in zip(row, widths)).rstrip() for row in rows]
        return "\n".join(lines)


def _short(placement: Placement) -> str:
    return f"S({placement.dim})" if isinstance(placement, Shard) else "R"


def _axes_text(mapped: Any) -> str:
    if mapped is None:
        return "-"
    return mapped if isinstance(mapped, str) else "(" + ",".join(mapped) + ")"
