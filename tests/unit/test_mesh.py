"""MeshSpec.parse (the --mesh string) and the named DeviceMesh built from it."""

from __future__ import annotations

import pytest
import torch

from models.errors import UserError
from parallel.mesh import MESH_DIMS, MeshSpec, build_device_mesh


@pytest.mark.parametrize(
    "text, world, expected",
    [
        ("tp=8,pp=8,cp=2", 128, dict(tp=8, pp=8, cp=2)),
        ("dp=4,tp=2", 8, dict(dp_shard=4, tp=2)),
        ("dp_replicate=2,dp_shard=4", 8, dict(dp_replicate=2, dp_shard=4)),
        ("dp=2,ep=2", 2, dict(dp_shard=2, ep=2)),
        ("dp=2,tp=2,ep=4,etp=1", 4, dict(dp_shard=2, tp=2, ep=4, etp=1)),
        ("", 8, dict(dp_shard=8)),                  # dp_shard takes the whole world
        ("tp=2", 8, dict(dp_shard=4, tp=2)),        # dp_shard filled from the remainder
        ("pp=2,cp=2", 16, dict(pp=2, cp=2, dp_shard=4)),
        (" tp = 2 , dp = 4 ,", 8, dict(dp_shard=4, tp=2)),  # spaces and a trailing comma
    ],
)
def test_parse_valid(text, world, expected):
    spec = MeshSpec.parse(text, world)
    assert spec == MeshSpec(**expected)
    assert spec.world_size == world


def test_parse_default_sizes_are_one():
    spec = MeshSpec.parse("tp=8,pp=8,cp=2", 128)
    assert (spec.pp, spec.dp_replicate, spec.dp_shard, spec.cp, spec.tp, spec.ep) == (8, 1, 1, 2, 8, 1)
    assert spec.sizes() == {"pp": 8, "dp_replicate": 1, "dp_shard": 1, "cp": 2, "tp": 8}
    assert list(spec.sizes()) == list(MESH_DIMS)


def test_ep_does_not_multiply_world_size():
    spec = MeshSpec.parse("dp=2,ep=2", 2)
    assert spec.world_size == 2
    assert spec.dp_size == 2


def test_dp_alias_is_dp_shard():
    assert MeshSpec.parse("dp=4,tp=2", 8) == MeshSpec.parse("dp_shard=4,tp=2", 8)
    assert MeshSpec.parse("dp=4", None).dp_shard == 4


@pytest.mark.parametrize(
    "text, expected_world, expected",
    [
        ("tp=2,pp=4", 8, dict(tp=2, pp=4, dp_shard=1)),
        ("dp=3,tp=2", 6, dict(dp_shard=3, tp=2)),
        ("dp_replicate=2,dp_shard=2,cp=2", 8, dict(dp_replicate=2, dp_shard=2, cp=2)),
        ("", 1, dict()),
    ],
)
def test_world_size_none_is_product(text, expected_world, expected):
    spec = MeshSpec.parse(text, None)
    assert spec == MeshSpec(**expected)
    assert spec.world_size == expected_world


def test_dp_size_counts_replicate_and_shard():
    assert MeshSpec.parse("dp_replicate=2,dp_shard=4", 8).dp_size == 8


@pytest.mark.parametrize(
    "text, world, must_name",
    [
        ("tq=2", 8, ["tq"]),                          # unknown key
        ("tp", 8, ["tp"]),                            # missing '='
        ("tp2", 8, ["tp2"]),
        ("tp=two", 8, ["two", "tp"]),                 # non-integer
        ("tp=2.0", 8, ["2.0", "tp"]),
        ("tp=", 8, ["tp"]),
        ("tp=0", 8, ["tp=0"]),                        # zero size
        ("tp=-2", 8, ["tp=-2"]),                      # negative size
        ("tp=2,tp=4", 8, ["tp"]),                     # duplicate key
        ("dp=2,dp_shard=2", 4, ["dp_shard"]),         # duplicate through the alias
        ("dp_shard=2,tp=2", 8, ["4", "8"]),           # product does not match the world
        ("dp_replicate=2,dp_shard=2,tp=4", 8, ["16", "8"]),
        ("tp=3", 8, ["3", "8"]),                      # world size not a multiple
        ("tp=2,pp=2", 6, ["4", "6"]),
        ("dp=2,ep=4", 2, ["ep=4", "2"]),              # ep does not divide dp_shard x cp
        ("dp=3,cp=2,ep=4", 6, ["ep=4", "3", "2"]),
    ],
)
def test_parse_errors_name_the_values(text, world, must_name):
    with pytest.raises(UserError) as info:
        MeshSpec.parse(text, world)
    message = str(info.value)
    for piece in must_name:
        assert piece in message, (piece, message)


def test_user_error_is_value_error():
    with pytest.raises(ValueError):
        MeshSpec.parse("tp=0", 8)


def test_ep_dividing_dp_shard_times_cp_is_accepted():
    spec = MeshSpec.parse("dp=2,cp=2,ep=4", 4)
    assert (spec.dp_shard, spec.cp, spec.ep) == (2, 2, 4)


def test_str_names_only_dims_above_one():
    assert str(MeshSpec.parse("dp=4,tp=2", 8)) == "dp_shard=4,tp=2"
    assert str(MeshSpec.parse("", 1)) == "single"


def test_build_device_mesh_order_tp_innermost(fake_world):
    with fake_world(8):
        spec = MeshSpec.parse("dp=2,tp=2,pp=2", 8)
        mesh = build_device_mesh(spec, "cpu")
        assert mesh.mesh_dim_names == ("pp", "dp_replicate", "dp_shard", "cp", "tp")
        layout = mesh.mesh
        assert tuple(layout.shape) == (2, 1, 2, 1, 2)
        # Ranks are laid out row-major with tp fastest: rank = ((pp*1 + dpr)*2 + dps)*1*2 + cp*2 + tp.
        expected = torch.arange(8, dtype=layout.dtype).reshape(2, 1, 2, 1, 2)
        assert torch.equal(layout, expected)

        def coords(rank):
            return [int(c) for c in (layout == rank).nonzero()[0]]

        c0, c1 = coords(0), coords(1)
        differing = [name for name, a, b in zip(mesh.mesh_dim_names, c0, c1) if a != b]
        assert differing == ["tp"]
        # pp is outermost: ranks 0 and 4 differ only in pp.
        c4 = coords(4)
        assert [name for name, a, b in zip(mesh.mesh_dim_names, c0, c4) if a != b] == ["pp"]
        assert mesh["tp"].size() == 2 and mesh["pp"].size() == 2 and mesh["dp_shard"].size() == 2
        assert mesh["cp"].size() == 1 and mesh["dp_replicate"].size() == 1


@pytest.mark.parametrize("text,names,sizes", [
    ("dp=4", ("dp_shard",), (4,)),
    ("cp=4", ("cp",), (4,)),
    ("dp=2,cp=2", ("dp_shard_cp",), (4,)),
    ("dp_replicate=2,dp_shard=2", ("dp_replicate", "dp_shard"), (2, 2)),
    ("dp_replicate=2,cp=2", ("dp_replicate", "cp"), (2, 2)),
])
def test_fsdp_mesh_is_dp_shard_times_cp(fake_world, recwarn, text, names, sizes):
    from parallel.mesh import build_meshes

    with fake_world(4):
        spec = MeshSpec.parse(text, 4)
        dp_mesh = build_meshes(spec, "cpu").submesh(spec.fsdp_dims)
        assert dp_mesh.mesh_dim_names == names and tuple(dp_mesh.mesh.shape) == sizes
    # Only a mesh that splits both dp_shard and cp slices the flattened dim (which torch deprecates).
    flattened = [w for w in recwarn if "flattened dim" in str(w.message)]
    assert bool(flattened) == (names == ("dp_shard_cp",))
