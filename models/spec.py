"""Parameter specs: shape, logical axes and initialisation of every parameter, before any memory exists.

A model is described as a sequence of layers (embedding, blocks, head), each with a tree of
`ParamSpec`s. The parallel backend reads the logical axes to place each parameter on the mesh;
the initialiser draws each parameter's full value from a generator seeded by its name, so every
mesh gets the same global values.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from typing import Any

import attrs
import torch

# The logical axes that parameters and activations may name. The sharding plan maps them to mesh axes.
PARAM_AXES = ("vocab", "embed", "heads", "kv_heads", "mlp", "expert", "expert_mlp", "router", "latent",
              "head_dim")
ACTIVATION_AXES = ("batch", "seq", "embed", "heads", "kv_heads", "mlp", "vocab", "head_dim")


@attrs.frozen
class ParamSpec:
    """One parameter: its global shape, one logical axis name per dimension, and how to initialise it."""

    shape: tuple[int, ...]
    axes: tuple[str, ...]
    init: str = "normal"  # "normal" (with std) or "ones"
    std: float = 0.02
    weight_decay: bool = True
    trainable: bool = True  # False: no gradient, no optimizer state (e.g. a router's balancing bias)

    def __attrs_post_init__(self) -> None:
        assert len(self.shape) == len(self.axes), (self.shape, self.axes)
        assert all(a in PARAM_AXES for a in self.axes), self.axes


def normal(shape: tuple[int, ...], axes: tuple[str, ...], std: float) -> ParamSpec:
    return ParamSpec(tuple(shape), tuple(axes), "normal", std, weight_decay=True)


def ones(shape: tuple[int, ...], axes: tuple[str, ...]) -> ParamSpec:
    return ParamSpec(tuple(shape), tuple(axes), "ones", 0.0, weight_decay=False)


def is_matmul_weight(param: ParamSpec) -> bool:
    """A matrix that tokens are multiplied by: 2-D, or 3-D with one per routed expert; biases
    (also the experts' [expert, width] ones), norms and sinks are not."""
    return len(param.shape) - (param.axes[0] == "expert") == 2


def zeros(shape: tuple[int, ...], axes: tuple[str, ...]) -> ParamSpec:
    """Zeros (a normal of std 0), never decayed: a bias."""
    return ParamSpec(tuple(shape), tuple(axes), "normal", 0.0, weight_decay=False)


@attrs.frozen
class Layer:
    """One entry of the model's layer sequence.

    `forward(params, x, aux, ctx)` maps the activation of the previous layer (token ids for the
    first layer) to the next one (the summed loss for the last layer; multi-token prediction's
    layer, which reads the head's input too, to a term of that loss). `aux` holds what every layer
    of a micro-batch shares: positions, RoPE tables, labels. `tied` maps a parameter path of this
    layer to the path of the parameter it shares (tied input and output embeddings, the weights
    multi-token prediction shares). `run=False` marks a layer that another pipeline stage runs,
    held by this one only for the parameters its layers share with it.
    """

    name: str
    params: dict[str, Any]
    forward: Callable[..., torch.Tensor]
    tied: dict[str, str] = attrs.field(factory=dict)
    run: bool = True


def flatten(tree: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    """Yields (dotted path, leaf) pairs of a nested dict, in insertion order."""
    for key, value in tree.items():
        path = f"{prefix}.{key}" if prefix else key
        if isinstance(value, dict):
            yield from flatten(value, path)
        else:
            yield path, value


def unflatten(items: Iterator[tuple[str, Any]] | dict[str, Any]) -> dict[str, Any]:
    """Inverse of `flatten`."""
    if isinstance(items, dict):
        items = items.items()
    tree: dict[str, Any] = {}
    for path, value in items:
        node = tree
        *parents, leaf = path.split(".")
        for key in parents:
            node = node.setdefault(key, {})
        node[leaf] = value
    return tree


def param_seed(seed: int, path: str) -> int:
    """A seed for one parameter that depends only on the run seed and the parameter's full path."""
    digest = hashlib.blake2b(f"{seed}:{path}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def init_value(spec: ParamSpec, seed: int, path: str, device: torch.device | str = "cpu",
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """The full (global) initial value of one parameter; identical on every mesh."""
    if spec.init == "ones":
        return torch.ones(spec.shape, device=device, dtype=dtype)
    generator = torch.Generator(device=device)
    generator.manual_seed(param_seed(seed, path))
    value = torch.empty(spec.shape, device=device, dtype=torch.float32)
    value.normal_(0.0, spec.std, generator=generator)
    return value.to(dtype)


def count_params(layers: list[Layer]) -> int:
    return sum(math.prod(spec.shape) for layer in layers for _, spec in flatten(layer.params))
