"""Pipeline parallelism: which stage runs which layers, and the schedules that drive them.

The model is the layer sequence `embed, blocks.0 .. blocks.{L-1}, head`. The splitter gives each
of the pp x V stages a contiguous run of blocks (the first stage also the embedding, the last
also the head), either balanced by cost or from an explicit layout. Rank r of the pp group runs
stages r, r + pp, ... (interleaved schedules) or r and 2pp-1-r (V-shaped schedules).

`--pp-layout` lists the blocks of each stage in order, e.g. `3,5,5,3` for 16 blocks on 4 stages;
the embedding always goes with the first stage and the head with the last.
"""

from __future__ import annotations

import functools
import math

import attrs
import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
    ScheduleLoopedBFS,
    ScheduleZBVZeroBubble,
)
from torch.distributed.tensor import DTensor

from models import mixtral, spec
from models.errors import UserError

SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved-1f1b": ScheduleInterleaved1F1B,
    "looped-bfs": ScheduleLoopedBFS,
    "zb": ScheduleInterleavedZeroBubble,
    "zbv": ScheduleZBVZeroBubble,
}
SINGLE_STAGE = ("gpipe", "1f1b")
V_SHAPED = ("zbv",)
# Backward in two passes, input gradients then weight gradients, over a retained graph.
SPLIT_BACKWARD = ("zb", "zbv")


def validate_schedule(schedule: str, pp: int, virtual: int, num_blocks: int, layout: str | None,
                      on_gpus: bool = False) -> None:
    """Every check of the pipeline's split and schedule that needs no memory, with what to change
    (the micro-batches: `validate_microbatches`)."""
    if schedule not in SCHEDULES:
        raise UserError(f"unknown --pp-schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}")
    if schedule in SPLIT_BACKWARD and on_gpus:
        # Measured on 2 H200s (torch 2.11, NCCL): the first step of zb and of zbv never ends. They
        # run, and match one process, on CPU processes over gloo.
        raise UserError(f"--pp-schedule {schedule} does not finish a step over NCCL with this torch; use "
                        f"interleaved-1f1b (or 1f1b), or run {schedule} on CPU processes")
    if virtual < 1:
        raise UserError(f"--pp-virtual-stages {virtual} must be >= 1")
    if schedule in SINGLE_STAGE and virtual != 1:
        raise UserError(f"--pp-schedule {schedule} runs one stage per rank; use --pp-virtual-stages 1 "
                        f"or an interleaved schedule")
    if schedule in V_SHAPED and virtual != 2:
        raise UserError(f"--pp-schedule {schedule} needs --pp-virtual-stages 2 (a V of two stages per rank)")
    num_stages = pp * virtual
    if num_blocks < num_stages:
        raise UserError(f"{num_blocks} blocks cannot fill pp={pp} x {virtual} virtual stages = {num_stages} "
                        f"stages; lower pp or --pp-virtual-stages")
    if layout:
        parse_layout(layout, num_blocks, num_stages)


def validate_microbatches(schedule: str, pp: int, num_microbatches: int) -> None:
    """The micro-batches of a step fill the schedule."""
    if num_microbatches < pp:
        raise UserError(f"{num_microbatches} micro-batches per step are fewer than pp={pp} stages; raise "
                        f"--global-batch or lower --micro-batch so each rank runs >= {pp}")
    if schedule not in SINGLE_STAGE and num_microbatches % pp:
        raise UserError(f"--pp-schedule {schedule} needs the micro-batches per step ({num_microbatches}) to "
                        f"be a multiple of pp={pp}; change --global-batch or --micro-batch")


def ideal_bubble(pp: int, virtual: int, num_microbatches: int) -> float:
    """The fraction of a step a stage waits in fill and drain: (p - 1) / (v m + p - 1)."""
    return (pp - 1) / (virtual * num_microbatches + pp - 1)


def parse_layout(layout: str, num_blocks: int, num_stages: int) -> list[int]:
    try:
        counts = [int(part) for part in layout.split(",")]
    except ValueError:
        raise UserError(f"--pp-layout {layout!r} must be comma-separated block counts, e.g. 3,5,5,3") from None
    if len(counts) != num_stages:
        raise UserError(f"--pp-layout {layout!r} names {len(counts)} stages but the mesh has {num_stages} "
                        f"(pp x --pp-virtual-stages)")
    if min(counts) < 1:
        raise UserError(f"--pp-layout {layout!r}: every stage needs at least one block")
    if sum(counts) != num_blocks:
        raise UserError(f"--pp-layout {layout!r} places {sum(counts)} blocks but the model has {num_blocks}")
    return counts


def balanced_layout(num_blocks: int, num_stages: int, embed_cost: float, head_cost: float,
                    block_costs: list[float] | None = None) -> list[int]:
    """Blocks per stage so that each stage's cost is as close as possible to an equal share,
    counting the embedding (first stage) and the head (last stage) in units of one block, and
    each block by `block_costs` (in those units; None: 1 each), so that dense and MoE blocks of
    one model weigh what they cost. A boundary lands where the running cost crosses the stage's
    share, rounded to the nearer block edge."""
    costs = block_costs or [1.0] * num_blocks
    assert len(costs) == num_blocks, (len(costs), num_blocks)
    total = embed_cost + sum(costs) + head_cost
    boundaries, previous = [], 0
    for stage in range(num_stages - 1):
        ideal = round(_blocks_before((stage + 1) * total / num_stages - embed_cost, costs))
        # At least one block per stage, and enough blocks left for the stages after this one.
        boundary = min(max(ideal, previous + 1), num_blocks - (num_stages - 1 - stage))
        boundaries.append(boundary)
        previous = boundary
    edges = [0, *boundaries, num_blocks]
    return [end - start for start, end in zip(edges, edges[1:])]


def _blocks_before(cost: float, costs: list[float]) -> float:
    """Where along the blocks (a fractional block index) their running cost reaches `cost`."""
    for index, block in enumerate(costs):
        if cost <= block:
            return index + max(cost, 0.0) / block
        cost -= block
    return float(len(costs))


def block_counts(layers: list[spec.Layer], num_stages: int, layout: str | None = None,
                 expert_share: float = 1.0) -> list[int]:
    """Blocks per stage: as `layout` (--pp-layout) lists them, else balanced by cost (see
    `layer_costs`). Blocks are the transformer layers; the embedding, multi-token prediction and
    head ride with the first and last stage."""
    num_blocks = sum(layer.name.startswith("blocks.") for layer in layers)
    if layout:
        return parse_layout(layout, num_blocks, num_stages)
    return balanced_layout(num_blocks, num_stages, *layer_costs(layers, expert_share),
                           block_costs=block_costs(layers, expert_share))


def stage_ids(pp_rank: int, pp: int, virtual: int, schedule: str) -> list[int]:
    if schedule in V_SHAPED:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(virtual)]


def chunks_in_flight(schedule: str, pp: int, pp_rank: int, virtual: int, num_microbatches: int) -> list[int]:
    """The local stage (0 .. virtual-1) of each micro-batch whose activations rank `pp_rank` holds
    at once at the peak of a schedule. GPipe and looped BFS run every forward before any backward;
    1F1B holds pp - rank; the interleaved schedules hold torch's warm-up forwards (as its
    `_get_warmup_ops` counts them) and one more, in rounds of pp micro-batches per local stage.
    The V schedule (zbv) is approximated by the warm-up of its two stages."""
    m = num_microbatches
    if schedule == "gpipe":
        return [0] * m
    if schedule == "looped-bfs":
        return [stage for stage in range(virtual) for _ in range(m)]
    if schedule == "1f1b":
        return [0] * min(m, pp - pp_rank)
    if schedule in V_SHAPED:
        return [0] * min(m, pp - pp_rank) + [1] * min(m, pp - pp_rank)
    warmup = (virtual - 1) * pp + (1 if schedule == "zb" else 2) * (pp - 1 - pp_rank)
    return [(i // pp) % virtual for i in range(min(warmup + 1, m * virtual))]


def bubble_fraction(schedule: str, pp: int, virtual: int, num_microbatches: int) -> float:
    """The idle share of a pipelined step in the ideal schedule: (pp-1) / (m + pp-1) when each
    rank runs its stages one micro-batch round after another, (pp-1) / (v m + pp-1) when they
    interleave; the zero-bubble schedules fill most of it with weight-gradient work."""
    if pp == 1:
        return 0.0
    m, v = num_microbatches, virtual
    if schedule in SPLIT_BACKWARD:
        return (pp - 1) / (3 * v * m + pp - 1)
    if schedule == "interleaved-1f1b":
        return (pp - 1) / (v * m + pp - 1)
    return (pp - 1) / (m + pp - 1)


def stage_layers(layers: list[spec.Layer], counts: list[int], stage: int) -> list[spec.Layer]:
    """The layers of one stage: its blocks, with the embedding first / the layers after the blocks
    (multi-token prediction, the head) last; and a copy (`Layer.run` False) of any layer another
    stage runs whose parameters this stage's layers share (the embedding, for the MTP layer)."""
    blocks = [layer for layer in layers if layer.name.startswith("blocks.")]
    start = sum(counts[:stage])
    chosen = blocks[start:start + counts[stage]]
    if stage == 0:
        chosen = [layers[0], *chosen]
    if stage == len(counts) - 1:
        chosen = [*chosen, *layers[layers.index(blocks[-1]) + 1:]]
    held = {layer.name for layer in chosen}
    shared = {source.rsplit(".", 1)[0] for layer in chosen for source in layer.tied.values()}
    return chosen + [attrs.evolve(layer, run=False) for layer in layers if layer.name in shared - held]


def _matmul_params(layer: spec.Layer, expert_share: float) -> float:
    return sum(math.prod(s.shape) * (expert_share if mixtral.is_expert_weight(s) else 1.0)
               for _, s in spec.flatten(layer.params) if spec.is_matmul_weight(s))


def block_costs(layers: list[spec.Layer], expert_share: float = 1.0) -> list[float]:
    """Each block's cost in units of the mean block, by the matmul parameters a token runs through
    (of routed experts' stacked weights, `expert_share`): a dense block and an MoE block, or
    blocks of another attention, differ."""
    params = [_matmul_params(layer, expert_share) for layer in layers if layer.name.startswith("blocks.")]
    mean = sum(params) / len(params)
    return [p / mean for p in params]


def layer_costs(layers: list[spec.Layer], expert_share: float = 1.0) -> tuple[float, float]:
    """Embedding and last-stage (MTP and head) cost in blocks, by the matmul parameters a token
    runs through (the lookup costs little): of routed experts' stacked weights, `expert_share`
    (top_k / num_experts), since a step's time follows the active experts, not all of them; a
    shared output projection counts for each layer that runs it."""
    specs = {f"{layer.name}.{path}": s for layer in layers for path, s in spec.flatten(layer.params)}
    blocks = [layer for layer in layers if layer.name.startswith("blocks.")]
    tail = layers[layers.index(blocks[-1]) + 1:]
    block = sum(_matmul_params(layer, expert_share) for layer in blocks) / len(blocks)
    shared_outputs = sum(math.prod(specs[source].shape) for layer in tail for path, source in layer.tied.items()
                         if path == "output")
    return 0.0, (sum(_matmul_params(layer, expert_share) for layer in tail) + shared_outputs) / block


def stage_rank(stage: int, pp: int, schedule: str) -> int:
    """The pp rank that runs `stage` (the inverse of `stage_ids`)."""
    if schedule in V_SHAPED and stage >= pp:
        return 2 * pp - 1 - stage
    return stage % pp


class TiedCopies:
    """Parameters that two pipeline stages hold (the embedding, which the last stage's MTP layer
    reads), as Megatron shares its embedding between the first and last stage: after backward each
    copy's gradient becomes the sum of both, so the same optimizer step keeps them equal; the
    gradient norm counts one of them (`copies` lists the other)."""

    def __init__(self, layers: list[spec.Layer], counts: list[int], parts, mesh, schedule: str):
        pp = mesh.size(mesh.mesh_dim_names.index("pp"))
        runs = {layer.name: stage for stage in range(len(counts))
                for layer in stage_layers(layers, counts, stage) if layer.run}
        # parameter -> the pp ranks of its owner's stage and of the stage that reads it
        ranks = {source: tuple(sorted({stage_rank(runs[source.rsplit(".", 1)[0]], pp, schedule),
                                       stage_rank(runs[layer.name], pp, schedule)}))
                 for layer in layers for source in layer.tied.values()
                 if runs[source.rsplit(".", 1)[0]] != runs[layer.name]}
        self.params = {name: [p for part in parts for n, p in part.named_parameters() if n == name] for name in ranks}
        self.copies = [p for part in parts for n, p in part.named_parameters()
                       if n in ranks and n.split(".", 1)[0] in part.copies]
        self.groups = {name: self._group(mesh, pp, pair) for name, pair in ranks.items()}

    @staticmethod
    def _group(mesh, pp: int, pp_ranks: tuple[int, ...]):
        """This rank's group of the ranks along pp at `pp_ranks` (None where both are this rank)."""
        if len(pp_ranks) == 1:
            return None
        if pp == 2:
            return mesh.get_group("pp")
        mine = None
        # Every rank creates every line's group, in the same order, as new_group requires.
        for line in mesh.mesh.reshape(pp, -1).t().tolist():
            group = dist.new_group([line[r] for r in pp_ranks])
            if dist.get_rank() in (line[r] for r in pp_ranks):
                mine = group
        return mine

    @torch.no_grad()
    def sum_grads(self) -> None:
        """After backward (and FSDP's reduction), before clipping."""
        for name, params in self.params.items():
            if not params:  # a stage between the two
                continue
            grads = [p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad for p in params]
            total = torch.stack(grads).sum(0)
            if self.groups[name] is not None:
                dist.all_reduce(total, group=self.groups[name])
            for grad in grads:
                grad.copy_(total)


def build_schedule(stages: list[PipelineStage], schedule: str, num_microbatches: int, loss_fn):
    schedule_cls = SCHEDULES[schedule]
    # The loss function already scales each micro-batch's loss to the global batch.
    if schedule in SINGLE_STAGE:
        return schedule_cls(stages[0], n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule_cls(stages, n_microbatches=num_microbatches, loss_fn=loss_fn, scale_grads=False)


def activations_held(schedule, pp_rank: int, pp: int, stage_ids: list[int],
                     num_microbatches: int) -> list[dict[int, int]]:
    """How many micro-batches' activations each of this rank's stages holds after each step of
    the schedule's order for this rank: a forward adds one, a full backward (or, in the
    zero-bubble schedules, the weight pass after the input pass) frees one. Schedules without an
    order table (single-stage ones on some torch versions) follow their definition: GPipe runs
    every forward first; 1F1B runs pp - stage forwards before its first backward."""
    order = getattr(schedule, "pipeline_order", None)
    if order is None:
        most = num_microbatches if isinstance(schedule, ScheduleGPipe) else min(pp - pp_rank, num_microbatches)
        return [{stage_ids[0]: k} for k in range(1, most + 1)]
    held = dict.fromkeys(stage_ids, 0)
    profile = []
    actions = [a for action in order.get(pp_rank, []) if action is not None
               for a in (action.sub_actions or (action,))]
    for action in actions:
        kind = action.computation_type.value
        if kind == "F":
            held[action.stage_index] += 1
        elif kind in ("B", "W"):
            held[action.stage_index] -= 1
        else:
            continue
        profile.append(dict(held))
    return profile


class PipelineRunner:
    """Drives this rank's stages through one schedule step per optimizer step."""

    def __init__(self, parts, stage_indices: list[int], num_stages: int, schedule: str,
                 num_microbatches: int, device, group, loss_scale: float, with_targets=None):
        """`with_targets(aux, target)`: the micro-batch's aux for one micro-batch's part of the
        `labels` given to `step` (default: those are the labels). Targets that are not plain labels
        (multi-token prediction's tokens ahead) travel packed in that one tensor, which the schedule
        splits into micro-batches."""
        self.parts = parts
        self.has_first = 0 in stage_indices
        self.has_last = num_stages - 1 in stage_indices
        last = parts[stage_indices.index(num_stages - 1)] if self.has_last else None
        self.auxes: list = []
        self.last_index = None if last is None else parts.index(last)
        self.last_micro_batch = 0  # of the last stage's latest forward, whose loss comes next
        with_targets = with_targets or (lambda aux, labels: attrs.evolve(aux, labels=labels))
        for part in parts:
            part.pipelined = True

        def loss_fn(hidden, labels):
            # Runs on the last stage, right after its forward of the same micro-batch: MTP (whose
            # block reads that micro-batch's positions and mask), head, loss, and the scale to the
            # global batch.
            aux = self._call_aux("loss", self.last_micro_batch)
            return last.head_loss(hidden, with_targets(aux, labels)) * self.loss_scale

        self.loss_scale = loss_scale
        self.num_microbatches = num_microbatches
        # A compiled block's backward may not free ("donate") its saved buffers when the graph is
        # retained for a second pass; without this the weight-gradient pass fails under --compile.
        # Set while this runner's schedule runs (the blocks compile in its first step), not for the process.
        self._compile_settings = ({"donated_buffer": False} if schedule in SPLIT_BACKWARD else {})
        self._calls: dict = {}
        self.stages = [PipelineStage(module, index, num_stages, device, group=group)
                       for module, index in zip(parts, stage_indices)]
        self.schedule = build_schedule(self.stages, schedule, num_microbatches, loss_fn)

    def step(self, inputs, labels, auxes: list, loss_factor: float = 1.0) -> torch.Tensor:
        """Forward and backward of all micro-batches (`auxes`: each one's aux, in order); the summed
        (unscaled) loss of this rank's last stage, zero on ranks without it. `loss_factor`
        multiplies the loss before backward."""
        if loss_factor == 1.0:
            return self._run(self.schedule.step, inputs, labels, auxes)
        scale, self.loss_scale = self.loss_scale, self.loss_scale * loss_factor
        try:
            return self._run(self.schedule.step, inputs, labels, auxes) * loss_factor
        finally:
            self.loss_scale = scale

    def evaluate(self, inputs, labels, auxes: list) -> torch.Tensor:
        """Forward only, same result as `step`."""
        return self._run(self.schedule.eval, inputs, labels, auxes)

    def _run(self, run, inputs, labels, auxes: list) -> torch.Tensor:
        assert len(auxes) == self.num_microbatches, (len(auxes), self.num_microbatches)
        self.auxes, self._calls = auxes, {}
        for index, part in enumerate(self.parts):
            part.stage_aux = functools.partial(self._call_aux, index)
        losses: list[torch.Tensor] = []
        args = (inputs,) if self.has_first else ()
        target = labels if self.has_last else None
        # Split like the inputs, one entry per micro-batch, and given to every stage: the index of
        # the micro-batch a stage runs, so that it reads that micro-batch's aux.
        micro_batch = torch.arange(self.num_microbatches)
        with torch._functorch.config.patch(**self._compile_settings):
            run(*args, target=target, losses=losses, micro_batch=micro_batch)
        self._count_last_calls()
        if not losses:
            return torch.zeros((), device=labels.device)
        return torch.stack([loss.detach().float() for loss in losses]).sum() / self.loss_scale

    def _call_aux(self, key, micro_batch: int):
        """Micro-batch `micro_batch`'s aux for one call of a stage (or of the loss function), with
        statistics sinks (router and MTP statistics) of its own. torch's stages run a first
        micro-batch once more before the schedule to learn its shapes (at the first step, and after
        each switch between training and evaluation; torch 2.13 on uninitialised activations): only
        the schedule's calls may count, which are the last `num_microbatches` calls of each stage
        (`_count_last_calls`)."""
        aux = self.auxes[micro_batch]
        if key == self.last_index:
            self.last_micro_batch = micro_batch
        sinks = {f.name: value.fresh() for f in attrs.fields(type(aux))
                 if hasattr(value := getattr(aux, f.name), "absorb")}
        self._calls.setdefault(key, []).append(sinks)
        return attrs.evolve(aux, **sinks)

    def _count_last_calls(self) -> None:
        # Every micro-batch's aux shares the step's statistics objects (evolved from one aux).
        for calls in self._calls.values():
            for sinks in calls[-self.num_microbatches:]:
                for name, sink in sinks.items():
                    getattr(self.auxes[0], name).absorb(sink)
