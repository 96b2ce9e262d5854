"""Parsing `--mesh` strings, the mesh dims of each role, and building the named device meshes.

    spec = MeshSpec.parse("pp=2,dp=4,tp=8", 64)
    spec.fsdp_dims, spec.loss_dims          # ("dp_shard",), ("dp_shard", "pp"): decisions, not groups
    meshes = build_meshes(spec, "cuda")     # at run time: the DeviceMeshes, once
    meshes.group("tp"), meshes.submesh(spec.fsdp_dims)

Mesh dims run from outermost (slowest links) to innermost: pp, dp_replicate, dp_shard, cp, tp.
Expert parallelism does not add ranks: `ep` borrows them from dp_shard x cp, where each tp rank
holds its ep rank's experts (and runs them on its share of the tokens). `etp=1` (Megatron's
--expert-tensor-parallel-size 1, "parallel folding") lays the experts out apart from attention:
their mesh folds tp's ranks in too, ep over dp_shard x cp x tp with tp innermost, so that the tp
ranks of a block hold different experts.
"""

from __future__ import annotations

import math

import attrs
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from models.errors import UserError

MESH_DIMS = ("pp", "dp_replicate", "dp_shard", "cp", "tp")
MESH_KEYS = (*MESH_DIMS, "ep", "etp")
DATA_PARALLEL_DIMS = ("dp_replicate", "dp_shard")
_ALIASES = {"dp": "dp_shard"}


@attrs.frozen
class MeshSpec:
    """Sizes of each mesh dim; their product (without ep) is the world size."""

    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    cp: int = 1
    tp: int = 1
    ep: int = 1
    # Megatron's expert tensor parallel size: None (unset) keeps the experts whole on every tp rank
    # of their ep rank; 1 folds tp's ranks into the experts' mesh (`experts_fold_tp`).
    etp: int | None = None

    @classmethod
    def parse(cls, text: str, world_size: int | None) -> MeshSpec:
        """`tp=8,pp=8,cp=2` -> MeshSpec; dp_shard (alias dp) takes whatever the world size leaves
        (with `world_size=None`, the world is the product of the sizes given, dp_shard 1 if absent)."""
        sizes: dict[str, int] = {}
        for item in filter(None, (part.strip() for part in (text or "").split(","))):
            key, sep, value = item.partition("=")
            key = _ALIASES.get(key.strip(), key.strip())
            if not sep or key not in MESH_KEYS:
                raise UserError(
                    f"bad mesh entry {item!r} in --mesh {text!r}; use KEY=SIZE with KEY one of "
                    f"{', '.join(MESH_KEYS)} (dp is short for dp_shard), e.g. --mesh dp=2,tp=4"
                )
            if key in sizes:
                raise UserError(f"mesh key {key!r} is given twice in --mesh {text!r}")
            try:
                sizes[key] = int(value)
            except ValueError:
                raise UserError(f"mesh size {value!r} for {key!r} is not an integer") from None
            if sizes[key] < 1:
                raise UserError(f"mesh size {key}={sizes[key]} must be >= 1")
        fixed = math.prod(size for key, size in sizes.items() if key not in ("dp_shard", "ep", "etp"))
        if world_size is None:
            world_size = fixed * sizes.get("dp_shard", 1)
        if "dp_shard" not in sizes:
            if world_size % fixed:
                raise UserError(
                    f"--mesh {text!r} needs a multiple of {fixed} ranks but the world size is "
                    f"{world_size}; change the mesh or the number of processes"
                )
            sizes["dp_shard"] = world_size // fixed
        spec = cls(**sizes)
        if spec.world_size != world_size:
            raise UserError(
                f"--mesh {text!r} spans {spec.world_size} ranks but the world size is {world_size}; "
                f"make the product of the mesh sizes equal the number of processes"
            )
        if spec.etp not in (None, 1):
            raise UserError(
                f"etp={spec.etp} in --mesh {text!r}: dtrain keeps every expert whole on one rank; etp=1 folds tp's "
                f"ranks into expert parallelism (ep over dp_shard x cp x tp), and without etp the tp ranks hold "
                f"their ep rank's experts"
            )
        if spec.experts_fold_tp and (spec.dp_shard * spec.cp * spec.tp) % spec.ep:
            raise UserError(
                f"ep={spec.ep} must divide dp_shard x cp x tp = {spec.dp_shard} x {spec.cp} x {spec.tp}, the ranks "
                f"expert parallelism folds with etp=1; change ep or the data/context/tensor sizes"
            )
        if not spec.experts_fold_tp and (spec.dp_shard * spec.cp) % spec.ep:
            folding = (f", or add etp=1 to fold tp's {spec.tp} ranks in"
                       if spec.tp > 1 and (spec.dp_shard * spec.cp * spec.tp) % spec.ep == 0 else "")
            raise UserError(
                f"ep={spec.ep} must divide dp_shard x cp = {spec.dp_shard} x {spec.cp}, the ranks "
                f"expert parallelism borrows; change ep or the data/context sizes{folding}"
            )
        return spec

    @property
    def world_size(self) -> int:
        return math.prod(getattr(self, dim) for dim in MESH_DIMS)

    @property
    def dp_size(self) -> int:
        return self.dp_replicate * self.dp_shard

    @property
    def experts_fold_tp(self) -> bool:
        """The experts' mesh takes tp's ranks too (etp=1 with tp > 1)."""
        return self.etp == 1 and self.tp > 1

    @property
    def expert_ranks(self) -> int:
        """The ranks of one data-parallel replica that expert parallelism spreads experts over:
        dp_shard x cp, times tp when the experts fold tp in."""
        return self.dp_shard * self.cp * (self.tp if self.experts_fold_tp else 1)

    @property
    def edp(self) -> int:
        """How many ranks of `expert_ranks` hold the same experts (the expert mesh's `edp` dim,
        which FSDP shards them over)."""
        return self.expert_ranks // self.ep

    # Each role's mesh dims: the only place that says which ranks a role spans.

    @property
    def fsdp_shard_dim(self) -> str:
        """The mesh dim FSDP shards over: dp_shard x cp. A plain dim where one of them is 1: torch
        deprecates slicing a flattened dim from the root mesh, so only dp_shard x cp needs it."""
        if self.cp == 1:
            return "dp_shard"
        return "cp" if self.dp_shard == 1 else FSDP_SHARD_DIM

    @property
    def fsdp_dims(self) -> tuple[str, ...]:
        """Where FSDP keeps parameters: sharded over dp_shard x cp, with dp_replicate in front for HSDP."""
        return ("dp_replicate",) * (self.dp_replicate > 1) + (self.fsdp_shard_dim,)

    @property
    def expert_fsdp_dims(self) -> tuple[str, ...]:
        """Where FSDP keeps the expert weights (ep > 1): sharded over edp, HSDP's dp_replicate in front."""
        return ("dp_replicate",) * (self.dp_replicate > 1) + ("edp",)

    @property
    def expert_grad_sum_dims(self) -> tuple[str, ...]:
        """The dims whose ranks hold the same experts and ran them on other tokens, without FSDP
        reducing over them: tp (each tp rank runs its ep rank's experts on its share of the
        tokens), unless the experts fold tp's ranks into ep."""
        return ("tp",) if self.ep > 1 and self.tp > 1 and not self.experts_fold_tp else ()

    @property
    def expert_grad_scale(self) -> float:
        """What the expert gradients are multiplied by so that they average over every data and
        context rank like all other gradients: FSDP averages them over the edp (x dp_replicate)
        ranks that hold the same experts, but each already sums the tokens of its whole ep group
        (the all-to-all backward brings them home). 1 / ep where tp's ranks each hold their ep
        rank's experts; tp / ep with the experts folding tp in (every token went through one
        expert rank)."""
        return self.edp / (self.dp_shard * self.cp)

    @property
    def loss_dims(self) -> tuple[str, ...]:
        """The dims a step's loss is summed over: the ranks holding other rows or tokens, and the
        pipeline ranks (the loss comes from the last stage)."""
        return tuple(dim for dim in ("dp_shard", "dp_replicate", "cp", "pp") if getattr(self, dim) > 1)

    @property
    def router_stats_dims(self) -> tuple[str, ...]:
        """The dims the MoE routers' statistics are summed over: every rank counts its own tokens
        (tp ranks each route their share of them); pipeline stages hold other layers."""
        return tuple(dim for dim in self.loss_dims if dim != "pp") + ("tp",) * (self.tp > 1)

    @property
    def token_shard_dims(self) -> tuple[str, ...]:
        """Ranks holding other tokens of the same samples: cp always, tp where it splits them."""
        return tuple(dim for dim in ("cp", "tp") if getattr(self, dim) > 1)

    def roles(self) -> dict[str, list[str]]:
        """Each role's mesh dims by name (what --print-plan shows)."""
        roles = {"loss": list(self.loss_dims), "fsdp": list(self.fsdp_dims),
                 **{dim: [dim] for dim in ("tp", "cp", "pp") if getattr(self, dim) > 1}}
        if self.ep > 1:
            roles.update(ep=["ep"], expert_fsdp=list(self.expert_fsdp_dims))
            if self.expert_grad_sum_dims:
                roles.update(expert_grad_sum=list(self.expert_grad_sum_dims))
        return roles

    def sizes(self) -> dict[str, int]:
        return {dim: getattr(self, dim) for dim in MESH_DIMS}

    def coordinates(self, rank: int) -> dict[str, int]:
        """The place of `rank` on each mesh dim, as `build_device_mesh` lays the ranks out (row-major
        over MESH_DIMS); with ep > 1 also on the expert mesh's `edp` and `ep` dims."""
        coords, rest = {}, rank
        for dim in reversed(MESH_DIMS):
            rest, coords[dim] = divmod(rest, getattr(self, dim))
        if self.ep > 1:
            # The expert mesh sees the expert ranks as edp x ep (see build_expert_mesh).
            index = coords["dp_shard"] * self.cp + coords["cp"]
            if self.experts_fold_tp:
                index = index * self.tp + coords["tp"]
            coords["edp"], coords["ep"] = divmod(index, self.ep)
        return coords

    def __str__(self) -> str:
        sizes = [f"{key}={getattr(self, key)}" for key in MESH_KEYS[:-1] if getattr(self, key) > 1]
        if self.etp is not None:
            sizes.append(f"etp={self.etp}")
        return ",".join(sizes) or "single"


# Parameters are replicated over cp (each cp rank holds different tokens of the same samples), so
# FSDP shards them, and averages their gradients, over dp_shard x cp as one flattened dim.
FSDP_SHARD_DIM = "dp_shard_cp"


def build_device_mesh(spec: MeshSpec, device_type: str) -> DeviceMesh:
    """The named mesh over the default process group, every dim present (size-1 dims included).
    When dp_shard and cp both split, also the flattened dim `dp_shard_cp` that FSDP shards over."""
    mesh = init_device_mesh(device_type, tuple(spec.sizes().values()), mesh_dim_names=MESH_DIMS)
    if spec.dp_shard > 1 and spec.cp > 1:
        mesh["dp_shard", "cp"]._flatten(FSDP_SHARD_DIM)
    return mesh


# Expert parallelism borrows ranks from dp_shard x cp (x tp with etp=1): the same ranks seen as
# (edp, ep), ep innermost, so that each group of ep consecutive ranks shares one set of experts.
EXPERT_MESH_DIMS = ("pp", "dp_replicate", "edp", "ep", "tp")


def build_expert_mesh(spec: MeshSpec, device_type: str) -> DeviceMesh | None:
    """The mesh expert weights live on (None when ep=1): `ep` splits the experts, `edp` (with
    dp_replicate) holds copies of the same experts, which FSDP shards and reduces over; `tp` holds
    copies that run other tokens (size 1 where the experts fold tp in)."""
    if spec.ep == 1:
        return None
    shape = (spec.pp, spec.dp_replicate, spec.edp, spec.ep, 1 if spec.experts_fold_tp else spec.tp)
    return init_device_mesh(device_type, shape, mesh_dim_names=EXPERT_MESH_DIMS)


EXPERT_DIMS = ("edp", "ep")


@attrs.frozen(eq=False)
class Meshes:
    """A run's device meshes: `world` (MESH_DIMS) and, with ep > 1, `experts` (EXPERT_MESH_DIMS,
    the same ranks). Roles name their dims (MeshSpec's `*_dims`); this finds their groups."""

    world: DeviceMesh
    experts: DeviceMesh | None = None

    def _holder(self, dims: tuple[str, ...]) -> DeviceMesh:
        return self.experts if any(dim in EXPERT_DIMS for dim in dims) else self.world

    def group(self, dim: str):
        return self._holder((dim,)).get_group(dim)

    def groups(self, dims: tuple[str, ...]) -> list:
        return [self.group(dim) for dim in dims]

    def submesh(self, dims: tuple[str, ...]) -> DeviceMesh:
        return self._holder(dims)[dims if len(dims) > 1 else dims[0]]

    def local_rank(self, dim: str) -> int:
        return self._holder((dim,)).get_local_rank(dim)


def build_meshes(spec: MeshSpec, device_type: str) -> Meshes:
    """The device meshes of a run, built once over the default process group."""
    return Meshes(build_device_mesh(spec, device_type), build_expert_mesh(spec, device_type))
