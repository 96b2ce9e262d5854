"""What a fake-tensor run of the real program would cost: the bytes of every live storage and
their peak, and each collective it issues, by the mesh dim of its process group.

    with FakeTensorMode(allow_non_fake_inputs=True), Accounting({"tp": tp_group, ...}) as acct:
        loss = model(tokens, aux); loss.backward()
    acct.peak_bytes, acct.collectives["tp"]

Fake tensors have shapes and no data, so a 405B-parameter stage costs nothing to run; their
storages still have sizes, which is what is counted. The mode sees the plain (fake) tensors under
DTensor: it declines ops on tensor subclasses, whose own dispatch then comes back here with their
local tensors, collectives included.
"""

from __future__ import annotations

import weakref
from typing import Any

import attrs
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensor
from torch.distributed.tensor._sharding_prop import ShardingPropagator
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakIdKeyDictionary

_c10d = torch.ops.c10d
_funcol = torch.ops._c10d_functional
_funcol_autograd = torch.ops._c10d_functional_autograd


def _ops(namespace, *names: str) -> set:
    """The ops of `namespace` named here that this torch has (names differ between versions)."""
    return {getattr(namespace, name).default for name in names if hasattr(namespace, name)}


# Each collective: its kind, the argument that holds its process group (a functional collective
# names it by a string, a c10d op takes the ProcessGroup), and where its bytes are counted: the
# whole buffer it moves (an all-gather's output, a reduce-scatter's input, an all-reduce's tensor,
# an all-to-all's input, a send's or receive's tensor), as nccl-tests counts them.
_FUNCTIONAL: dict[Any, tuple[str, int, int | str]] = {}
_FUNCTIONAL.update({op: ("all-gather", 2, "out") for op in _ops(_funcol, "all_gather_into_tensor")
                    | _ops(_funcol_autograd, "all_gather_into_tensor")})
_FUNCTIONAL.update({op: ("reduce-scatter", 3, 0) for op in _ops(_funcol, "reduce_scatter_tensor")
                    | _ops(_funcol_autograd, "reduce_scatter_tensor")})
_FUNCTIONAL.update({op: ("all-reduce", 2, 0) for op in _ops(_funcol, "all_reduce", "all_reduce_")})
_FUNCTIONAL.update({op: ("all-to-all", 3, 0) for op in _ops(_funcol, "all_to_all_single")
                    | _ops(_funcol_autograd, "all_to_all_single")})
_FUNCTIONAL.update({op: ("broadcast", 2, 0) for op in _ops(_funcol, "broadcast", "broadcast_")})
_C10D: dict[Any, tuple[str, int, int | str]] = {}
_C10D.update({op: ("all-gather", 2, 0) for op in _ops(_c10d, "_allgather_base_", "allgather_into_tensor_coalesced_")})
_C10D.update({op: ("reduce-scatter", 2, 1) for op in _ops(_c10d, "_reduce_scatter_base_",
                                                         "reduce_scatter_tensor_coalesced_")})
_C10D.update({op: ("all-reduce", 1, 0) for op in _ops(_c10d, "allreduce_")})
_C10D.update({op: ("all-to-all", 2, 1) for op in _ops(_c10d, "alltoall_base_")})
_C10D.update({op: ("broadcast", 1, 0) for op in _ops(_c10d, "broadcast_")})
_C10D.update({op: ("send/recv", 1, 0) for op in _ops(_c10d, "send", "recv_")})


def _tensor_bytes(value: Any) -> int:
    tensors = [t for t in tree_flatten(value)[0] if isinstance(t, torch.Tensor)]
    return sum(t.numel() * t.element_size() for t in tensors)


@attrs.define
class CollectiveTally:
    count: int = 0
    bytes: int = 0

    def add(self, other: CollectiveTally, times: int = 1) -> None:
        self.count += other.count * times
        self.bytes += other.bytes * times


class Accounting(TorchDispatchMode):
    """Live storage bytes, their peak, and collectives by (mesh dim, kind), while active."""

    def __init__(self, groups: dict[str, dist.ProcessGroup]):
        super().__init__()
        self._dim_of_group = {group.group_name: dim for dim, group in groups.items()}
        self._sizes = WeakIdKeyDictionary()  # storage -> [bytes counted for it]
        self.live_bytes = 0
        self.peak_bytes = 0
        self.collectives: dict[tuple[str, str], CollectiveTally] = {}
        self._resize = None
        self._saved_lock = None
        self._paused = 0

    # --- collectives -------------------------------------------------------------------------

    def take_collectives(self) -> dict[tuple[str, str], CollectiveTally]:
        """The collectives counted since the last call."""
        taken, self.collectives = self.collectives, {}
        return taken

    def _count_collective(self, func, args, out) -> None:
        if func in _FUNCTIONAL:
            kind, group_arg, where = _FUNCTIONAL[func]
            group_name = args[group_arg]
        elif func in _C10D:
            kind, group_arg, where = _C10D[func]
            group_name = dist.ProcessGroup.unbox(args[group_arg]).group_name
        else:
            return
        size = _tensor_bytes(out if where == "out" else args[where])
        dim = self._dim_of_group.get(group_name, "world" if group_name == dist.group.WORLD.group_name else "other")
        tally = self.collectives.setdefault((dim, kind), CollectiveTally())
        tally.count += 1
        tally.bytes += size

    # --- memory --------------------------------------------------------------------------------

    def _track(self, storage: torch.UntypedStorage) -> None:
        held = self._sizes.get(storage)
        if held is not None:
            return
        held = [storage.nbytes()]
        self._sizes[storage] = held
        weakref.finalize(storage, self._release, held)
        self._grow(held[0])

    def _release(self, held: list[int]) -> None:
        self.live_bytes -= held[0]

    def _grow(self, nbytes: int) -> None:
        self.live_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.live_bytes)

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(not issubclass(t, FakeTensor) and t not in (torch.Tensor, torch.nn.Parameter) for t in types):
            # A DTensor (or another wrapper): its own dispatch comes back with its local tensors.
            return NotImplemented
        out = func(*args, **(kwargs or {}))
        if self._paused:
            return out
        self._count_collective(func, args, out)
        for value in tree_flatten(out)[0]:
            # A tensor on `meta` holds no memory.
            if isinstance(value, torch.Tensor) and value.device.type != "meta":
                self._track(value.untyped_storage())
        return out

    def __enter__(self):
        # FSDP frees and re-allocates gathered parameters by resizing their storage, which no op
        # reports.
        self._resize = torch.UntypedStorage.resize_
        accounting, original = self, self._resize

        def resize_(storage, size):
            held = accounting._sizes.get(storage)
            before = held[0] if held is not None else 0
            result = original(storage, size)
            if held is None:
                accounting._track(storage)
            else:
                held[0] = storage.nbytes()
                accounting._grow(held[0] - before)
            return result

        torch.UntypedStorage.resize_ = resize_
        # DTensor infers output shapes by running each new op on global-shape fake tensors in the
        # current fake mode, under this lock (a no-op context by default): nothing it makes is
        # memory of the run.
        self._saved_lock = ShardingPropagator._fake_mode_lock
        ShardingPropagator._fake_mode_lock = _Pause(self)
        return super().__enter__()

    def __exit__(self, *exc):
        torch.UntypedStorage.resize_ = self._resize
        ShardingPropagator._fake_mode_lock = self._saved_lock
        return super().__exit__(*exc)


class _Pause:
    def __init__(self, accounting: Accounting):
        self.accounting = accounting

    def __enter__(self):
        self.accounting._paused += 1

    def __exit__(self, *exc):
        self.accounting._paused -= 1
