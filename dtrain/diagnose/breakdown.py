"""Where a profiled step's time goes: every GPU kernel (on a CPU run, every CPU op) put in one
category, and each category's time over the profiled wall time.

    activities = profile_activities(prof.profiler.kineto_results.events())
    result = breakdown(activities, steps=3)
    print(result.table())
    activities = trace_activities(json.load(open(PATH)))   # a trace prof.export_chrome_trace(PATH) wrote

A kernel's category comes from its name where the name tells (cuBLAS, CUTLASS and nvjet GEMMs,
cuDNN, flash and flex attention, inductor's triton kernels, NCCL), else from the `record_function`
range its launching op ran in: the loss (`parallel.modules.LOSS_RANGE`), the optimizer step and
the gradient clip (`dtrain.trainer`'s ranges), FSDP's own ranges, symmetric memory's ops. A
backward kernel belongs to the range its forward op ran in: autograd gives each backward node the
sequence number of the forward op that made it. On a CPU run the ops themselves are the work: an
op named as a GEMM, attention, the loss or the optimizer counts with everything it calls, other
ops where they call no other op.

Overlap is counted once. `busy` is the union of each category's own intervals; `exclusive`
gives each instant to the first category of CATEGORIES running then, so that the exclusive times
and the idle time (no kernel running) add up to the wall time, and exclusive communication is the
communication no other kernel hid.
"""

from __future__ import annotations

import re
from collections import defaultdict

import attrs

from dtrain.trainer import CLIP_RANGE, OPTIMIZER_RANGE
from parallel.modules import LOSS_RANGE

# In the order that takes an instant where several categories run at once (communication last:
# what runs beside a collective hides it). With what each covers, as the tables print it.
CATEGORIES = {
    "gemm": "GEMMs",
    "attention": "attention",
    "loss": "loss (the head's element-wise work)",
    "routing": "routing and token permutation (top-k, sorts, gathers and scatters by index)",
    "elementwise": "element-wise and norms",
    "optimizer": "optimizer (clip and AdamW)",
    "fsdp": "FSDP's copies and casts",
    "other": "other kernels",
    "communication": "communication",
}

# record_function ranges and ops (by name prefix) whose kernels take the range's category, unless
# their name says otherwise (a GEMM in the loss's range is the head's GEMM): symmetric memory's
# fused collective matmuls move their shards with copies that are communication.
RANGES = {LOSS_RANGE: "loss", CLIP_RANGE: "optimizer", OPTIMIZER_RANGE: "optimizer", "FSDP::": "fsdp",
          "symm_mem::": "communication"}

# By name, first match wins: attention before GEMMs (flash kernels' template names hold "gemm"),
# the loss before the element-wise kernels (inductor names a fused kernel after its aten ops).
_BY_NAME = [
    ("communication", re.compile(r"nccl|^memcpy ptop|^(c10d|gloo)[:_]", re.I)),
    ("attention", re.compile(r"flash|fmha|cudnn|sdpa|flex_attention|attention", re.I)),
    ("gemm", re.compile(r"gemm|gemv|nvjet|cutlass|cublas|splitkreduce|scaled_mm|grouped_mm|^triton_tem_|"
                        r"^aten::(mm|addmm|bmm|baddbmm|matmul|linear|_grouped_mm|_scaled_mm)$", re.I)),
    ("optimizer", re.compile(r"adam", re.I)),
    ("loss", re.compile(r"log_?softmax|nll_?loss|cross_?entropy", re.I)),
]
_ELEMENTWISE = re.compile(r"^triton_(poi|red|per)_|elementwise|reduce_kernel|norm|softmax|silu|rotary|copy|"
                          r"cat_|catarray|fill|amax|multi_tensor_apply|cast_transpose|transformer_engine::|^aten::",
                          re.I)
# Kernels (and CPU ops) of an MoE block's routing and of moving rows to their experts and back, by
# name where no range claims them: top-k, sorts (cub's radix sorts), gathers and scatters by index
# (inductor names a fused kernel after its aten ops, `index` for an indexed load), searches and
# cumulative sums of the counts. A dense model's embedding lookup counts here too.
_ROUTING = re.compile(r"topk|sort|scatter|gather|index|searchsorted|cumsum|repeat_interleave|bincount", re.I)
# CPU ops that move no data: views and allocations.
_NO_WORK = re.compile(r"^aten::(empty|empty_strided|empty_like|view|_unsafe_view|as_strided|t|transpose|"
                      r"reshape|expand|slice|select|squeeze|unsqueeze|permute|alias|detach|resolve_conj|"
                      r"resolve_neg|lift_fresh|split|chunk|unbind|narrow|contiguous|to)$")
# Device-side records that are not kernels: synchronisations the profiler draws on the GPU.
_NOT_KERNELS = {"Event Sync", "Stream Sync", "Stream Wait Event", "Context Sync", "Device Sync"}


def named_category(name: str) -> str | None:
    """The category a kernel's (or CPU op's) name alone gives, if it gives one."""
    return next((category for category, pattern in _BY_NAME if pattern.search(name)), None)


def classify(name: str, range_category: str | None = None) -> str:
    """The category of a kernel named `name` launched inside a range of `range_category`."""
    if category := named_category(name):
        return category
    if _NO_WORK.match(name):
        return "other"
    if range_category is not None:
        return range_category
    if _ROUTING.search(name):
        return "routing"
    if _ELEMENTWISE.search(name) and not name.startswith(("Memcpy", "Memset")):
        return "elementwise"
    return "other"


def range_category(name: str) -> str | None:
    return next((category for prefix, category in RANGES.items() if name.startswith(prefix)), None)


@attrs.frozen
class Activity:
    """A kernel (or a CPU op of a CPU run) in the profile, in microseconds."""

    name: str
    start: float
    end: float
    category: str


class _Op:
    """A CPU op or record_function range, and what encloses it on its thread."""

    __slots__ = ("name", "id", "thread", "start", "end", "sequence", "forward_thread", "is_range", "range",
                 "node", "named", "claimed_above", "has_child")

    def __init__(self, event):
        self.name, self.id, self.thread = event.name(), event.correlation_id(), event.start_thread_id()
        self.start, self.end = _times_us(event)
        self.sequence, self.forward_thread = event.sequence_nr(), event.fwd_thread_id()
        self.range: str | None = range_category(self.name)  # its own, then the innermost around it
        self.is_range = self.range is not None
        self.named = None if self.is_range else named_category(self.name)
        self.node: _Op | None = None
        self.claimed_above: str | None = None  # an enclosing op's named category
        self.has_child = False

    @property
    def is_backward_node(self) -> bool:
        """An autograd node's backward: it carries the sequence number of the forward op that made it."""
        return self.forward_thread != 0 and self.sequence >= 0

    @property
    def is_forward(self) -> bool:
        return self.forward_thread == 0 and self.sequence >= 0

    def does_work(self) -> bool:
        """On a CPU run: an op named as its category with all it calls, or an op that calls no other."""
        return not self.is_range and self.claimed_above is None and (self.named is not None or not self.has_child)


def _times_us(event) -> tuple[float, float]:
    start = event.start_ns()
    end = event.end_ns() if hasattr(event, "end_ns") else start + event.duration_ns()
    return start / 1e3, end / 1e3


def profile_activities(events) -> list[Activity]:
    """The kernels of a profile (torch.profiler's raw events: `prof.profiler.kineto_results.events()`),
    each with its category; where no kernel ran (a CPU run), the CPU ops that did the work."""
    from torch.autograd import DeviceType

    ops, device_events = [], []
    for event in events:
        if event.device_type() == DeviceType.CPU:
            # Torch ops and ranges only: the CUDA runtime's calls are linked to the op that made them.
            synchronous = not event.is_async() and event.start_thread_id() == event.end_thread_id()
            if event.linked_correlation_id() == 0 and synchronous and not event.name().startswith("["):
                ops.append(_Op(event))
        else:
            device_events.append(event)
    _nest(ops)
    forward = {(op.thread, op.sequence): op for op in sorted(ops, key=lambda op: op.start) if op.is_forward}
    if not device_events:
        return [Activity(op.name, op.start, op.end, op.named or classify(op.name, _range_of(op, forward)))
                for op in ops if op.does_work()]
    by_id = {op.id: op for op in ops}
    activities = []
    for event in device_events:
        name = event.name()
        # The GPU's copies of record_function ranges are user annotations, not kernels. A name shared
        # with a CPU op says nothing: inductor records each triton launch under its kernel's name.
        if event.is_user_annotation() or name in _NOT_KERNELS:
            continue
        launched_by = by_id.get(event.linked_correlation_id())
        activities.append(Activity(name, *_times_us(event), classify(name, _range_of(launched_by, forward))))
    return activities


# The Chrome trace's categories of host records (ops, ranges) and device records (kernels,
# copies, the GPU's view of ranges).
_TRACE_HOST = {"cpu_op", "user_annotation"}
_TRACE_DEVICE = {"kernel", "gpu_memcpy", "gpu_memset", "gpu_user_annotation"}


class _TraceEvent:
    """A record of an exported trace, read through the methods of the profiler's raw events that
    `profile_activities` calls. An op and the kernels it launched share an "External id"."""

    def __init__(self, record: dict, thread: int):
        self.record, self.args, self.thread = record, record.get("args") or {}, thread
        self.on_device = record.get("cat") in _TRACE_DEVICE

    def name(self) -> str:
        return self.record["name"]

    def device_type(self):
        from torch.autograd import DeviceType

        return DeviceType.CUDA if self.on_device else DeviceType.CPU

    def is_async(self) -> bool:
        return False

    def start_thread_id(self) -> int:
        return self.thread

    end_thread_id = start_thread_id

    def correlation_id(self) -> int:
        return 0 if self.on_device else int(self.args.get("External id", 0))

    def linked_correlation_id(self) -> int:
        return int(self.args.get("External id", 0)) if self.on_device else 0

    def sequence_nr(self) -> int:
        return int(self.args.get("Sequence number", -1))

    def fwd_thread_id(self) -> int:
        return int(self.args.get("Fwd thread id", 0))

    def is_user_annotation(self) -> bool:
        return self.record.get("cat") == "gpu_user_annotation"

    def start_ns(self) -> int:
        return round(self.record["ts"] * 1e3)

    def duration_ns(self) -> int:
        return round(self.record["dur"] * 1e3)


def trace_activities(trace: dict) -> list[Activity]:
    """`profile_activities` of a trace torch.profiler exported (`export_chrome_trace`, or
    TensorBoard's trace handler). Its threads are numbered in the order their first op starts,
    as the profiler numbers them (a backward node's "Fwd thread id" names its forward's thread)."""
    records = sorted((r for r in trace.get("traceEvents", []) if r.get("ph") == "X" and "dur" in r
                      and r.get("cat") in _TRACE_HOST | _TRACE_DEVICE), key=lambda r: r["ts"])
    threads: dict = {}
    for record in records:
        if record["cat"] in _TRACE_HOST:
            threads.setdefault(record["tid"], len(threads) + 1)
    return profile_activities([_TraceEvent(r, threads.get(r["tid"], 0)) for r in records])


def _nest(ops: list[_Op]) -> None:
    """Gives each op the innermost range and backward node around it (its own if it is one), and
    the named category of an op around it; marks the ops that call others."""
    by_thread = defaultdict(list)
    for op in ops:
        by_thread[op.thread].append(op)
    for thread_ops in by_thread.values():
        thread_ops.sort(key=lambda op: (op.start, -op.end))
        stack: list[_Op] = []
        for op in thread_ops:
            while stack and stack[-1].end <= op.start:
                stack.pop()
            if stack:
                parent = stack[-1]
                parent.has_child = True
                op.range = op.range or parent.range
                op.node = parent.node
                op.claimed_above = parent.claimed_above or parent.named
            if op.is_backward_node:
                op.node = op
            stack.append(op)


def _range_of(op: _Op | None, forward: dict[tuple[int, int], _Op]) -> str | None:
    """The category of the range `op` ran in; in backward, the range its forward op ran in."""
    if op is None:
        return None
    if op.range is None and op.node is not None:
        made_by = forward.get((op.node.forward_thread, op.node.sequence))
        return made_by.range if made_by is not None else None
    return op.range


@attrs.frozen
class Breakdown:
    """Each category's time over `steps` profiled steps (microseconds)."""

    wall_us: float
    steps: int
    busy_us: dict[str, float]       # the union of the category's intervals
    exclusive_us: dict[str, float]  # the instants the category is the first of CATEGORIES running
    top: dict[str, list[tuple[str, float, int]]]  # per category: (kernel, microseconds, calls), most first

    @property
    def idle_us(self) -> float:
        return max(0.0, self.wall_us - sum(self.exclusive_us.values()))

    @property
    def exposed_communication_pct(self) -> float:
        return 100 * self.exclusive_us["communication"] / self.wall_us if self.wall_us else 0.0

    def as_dict(self) -> dict:
        """Milliseconds per step, for a benchmark row."""
        def per_step(us: float) -> float:
            return round(us / self.steps / 1e3, 3)
        return {"steps": self.steps, "step_ms": per_step(self.wall_us),
                "ms": {c: per_step(us) for c, us in self.exclusive_us.items()}, "idle_ms": per_step(self.idle_us),
                "busy_ms": {c: per_step(us) for c, us in self.busy_us.items()}}

    def table(self, top: int = 5) -> str:
        wall = self.wall_us or 1.0
        lines = [f"{self.steps} profiled steps: {self.wall_us / 1e3:.1f} ms from the first kernel's start to the "
                 f"last one's end, {self.wall_us / self.steps / 1e3:.1f} ms per step",
                 "each instant counts for the first category running then, in this order; 'running' is all "
                 "the time the category's kernels ran, beside others or not",
                 f"{'':40} {'ms/step':>9} {'share':>7} {'running':>9}"]
        for category, label in CATEGORIES.items():
            exclusive, busy = self.exclusive_us[category], self.busy_us[category]
            lines.append(f"{label:40} {exclusive / self.steps / 1e3:9.2f} {100 * exclusive / wall:6.1f}% "
                         f"{busy / self.steps / 1e3:9.2f}")
        lines.append(f"{'idle (no kernel running)':40} {self.idle_us / self.steps / 1e3:9.2f} "
                     f"{100 * self.idle_us / wall:6.1f}%")
        for category, label in CATEGORIES.items():
            if self.top[category]:
                lines.append(f"\n{label}, the kernels with the most time (ms/step, calls/step):")
                lines += [f"  {us / self.steps / 1e3:9.3f} {calls / self.steps:7.1f}  {name[:150]}"
                          for name, us, calls in self.top[category][:top]]
        return "\n".join(lines) + "\n"


def breakdown(activities: list[Activity], steps: int) -> Breakdown:
    """The time of each category over the span from the first activity's start to the last one's end."""
    if not activities:
        zero = dict.fromkeys(CATEGORIES, 0.0)
        return Breakdown(0.0, steps, zero, dict(zero), {c: [] for c in CATEGORIES})
    start, end = min(a.start for a in activities), max(a.end for a in activities)
    by_category = {c: [(a.start, a.end) for a in activities if a.category == c] for c in CATEGORIES}
    totals: dict[str, dict[str, list]] = {c: defaultdict(lambda: [0.0, 0]) for c in CATEGORIES}
    for a in activities:
        entry = totals[a.category][a.name]
        entry[0] += a.end - a.start
        entry[1] += 1
    top = {c: sorted(((name, us, calls) for name, (us, calls) in names.items()), key=lambda t: -t[1])
           for c, names in totals.items()}
    return Breakdown(end - start, steps, {c: _covered_us(spans) for c, spans in by_category.items()},
                     _exclusive_us(activities), top)


def _covered_us(intervals: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals."""
    covered, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end > reach:
            covered += end - max(start, reach)
            reach = end
    return covered


def _exclusive_us(activities: list[Activity]) -> dict[str, float]:
    """Sweeps the intervals' ends in time order; each stretch goes to the first category running."""
    order = list(CATEGORIES)
    edges = sorted([(a.start, 1, order.index(a.category)) for a in activities]
                   + [(a.end, -1, order.index(a.category)) for a in activities])
    running = [0] * len(order)
    exclusive = [0.0] * len(order)
    previous = edges[0][0]
    for time, change, index in edges:
        if time > previous:
            first = next((i for i, count in enumerate(running) if count), None)
            if first is not None:
                exclusive[first] += time - previous
            previous = time
        running[index] += change
    return dict(zip(order, exclusive))
