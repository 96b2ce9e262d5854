"""`--dry-run`: one training step of the real program of every distinct rank of a world of any
size, on fake tensors over a fake process group, in this one process.

    python -m dtrain.run --dry-run --world-size 128 --model llama3-70b --mesh tp=8,pp=8,cp=2

The configuration is checked as a real run checks it (the same one-line errors), the ranks are
grouped into roles (`roles.py`), and for each program one rank of it builds its model with the
trainer's own code (`dtrain.rank_model`: parallelize, pipeline split, FSDP), materializes it, and runs
forward, backward, gradient clipping and the AdamW step as on GPUs (the fused kernel), while
`accounting.py` counts its live bytes and its collectives.

A pipeline schedule needs its peers, so a pipelined rank runs its stages' own forward and
backward, as torch's PipelineStage drives them (gradient sync off until the schedule's final
reduce, which is torch's own `perform_reduce_grad`): one micro-batch that gathers the parameters,
then one in steady state, counted m - 1 times for the m micro-batches of a step. The schedule's
order (`pipeline.activations_held`) says how many micro-batches' activations each stage holds at
once; the peak is then what stays through the step (parameters, gathered parameters, gradients)
+ the activations held at the fullest point + the largest working memory of one backward beyond
its own activations. The sends and receives between stages are counted from the activation each
stage passes on. What is measured, and the text printed of it: `dry_run_report.py`.

Fake tensors hold no values, so what a real step reads from its tokens is taken as a GPU step at
its planned balance: routed experts run the grouped GEMM (`models.context.grouped_mm_supported`)
and ep's all-to-all sends each rank an even share of the rows (`parallel.expert_parallel`); every
layer attends causally, windows, chunks and document masks left out.
"""

from __future__ import annotations

import time

import attrs
import torch
import torch.distributed as dist
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor._redistribute import clear_redistribute_planner_cache
from torch.distributed.tensor.debug import _clear_sharding_prop_cache

from dtrain import distributed, rank_model
from dtrain.inspect.accounting import Accounting, CollectiveTally
from dtrain.inspect.dry_run_report import ProgramReport, StageCost, header_text, role_text
from dtrain.inspect.roles import Role, find_roles
from dtrain.layout import RunLayout
from dtrain.optim import build_optimizer
from models import families, flops, mtp
from models.llama import RESIDUAL
from parallel import context_parallel, pipeline, precision
from parallel.data_parallel import expert_parameters, rescale_expert_grads_, set_micro_batch_sync
from parallel.gradients import clip_grads_
from parallel.mesh import FSDP_SHARD_DIM, MESH_DIMS, Meshes, MeshSpec, build_meshes
from parallel.parallelize import materialize


def dry_run(layout: RunLayout) -> list[tuple[Role, ProgramReport]]:
    """Runs and prints every role of a run's layout (resolved as a real run's, with the dry run's
    own refusals); returns each role with the report of its program."""
    started, cpu_started = time.perf_counter(), time.process_time()
    config, p, world_size = layout.config, layout.config.parallel, layout.world_size
    if set(layout.model_cfg.layer_kinds) - {"full", "nope"} or config.data.document_mask:
        # A mask is built from token values, which fake tensors do not hold; the masked kernels
        # (FlexAttention's, the variable-length one) keep what the causal one keeps.
        print("dry run: every layer attends causally: windows, chunks and document masks are left out (their "
              "kernels keep the same tensors; they skip work)")
    if layout.parallel.compile:
        # Compiling the blocks on fake tensors would take longer than the run; a compiled block's
        # fusions only lower its activations.
        print("dry run: --compile is left out, blocks run eagerly")
        layout = attrs.evolve(layout, parallel=attrs.evolve(layout.parallel, compile=False))
    counts = list(layout.pipeline.blocks_per_stage)
    full, fp8 = layout.parallel.full_recompute, layout.parallel.fp8_layers
    roles = find_roles(layout.plan, layout.model_cfg, counts, schedule=p.pp_schedule, virtual=p.pp_virtual_stages,
                       seq_len=config.data.seq_len, layer_flags=lambda name: (name in full, name in fp8))
    if p.dry_run_rank is not None:
        role = next(r for r in roles if p.dry_run_rank in r.ranks)
        roles = [attrs.evolve(role, ranks=(p.dry_run_rank,))]
    for choice in layout.chosen:
        print(choice.line())
    print(header_text(layout, roles), flush=True)
    programs: dict = {}
    for role in roles:
        if role.program not in programs:
            same = [r.pp_rank for r in roles if r.program == role.program]
            programs[role.program] = _run_program(layout, role, same)
        print(role_text(layout, role, programs[role.program]), flush=True)
    print(f"dry run: {len(roles)} role(s), {len(programs)} program(s) run in {time.process_time() - cpu_started:.0f} "
          f"CPU-seconds, {time.perf_counter() - started:.0f} s")
    return [(role, programs[role.program]) for role in roles]


def _mesh_groups(meshes: Meshes, mesh_spec: MeshSpec) -> dict[str, dist.ProcessGroup]:
    groups = {dim: meshes.group(dim) for dim in MESH_DIMS if getattr(mesh_spec, dim) > 1}
    if mesh_spec.dp_shard > 1 and mesh_spec.cp > 1:
        groups[FSDP_SHARD_DIM] = meshes.group(FSDP_SHARD_DIM)
    if mesh_spec.ep > 1:
        groups.update({dim: meshes.group(dim) for dim in ("edp", "ep") if getattr(mesh_spec, dim) > 1})
    return groups


def _fp8_emulated(layout: RunLayout) -> RunLayout:
    """`layout` with FP8's casts emulated (matmuls and experts): they run on fake CPU tensors."""
    par = layout.parallel
    return attrs.evolve(layout, parallel=attrs.evolve(
        par, fp8=par.fp8 and attrs.evolve(par.fp8, emulated=True),
        fp8_experts=par.fp8_experts and attrs.evolve(par.fp8_experts, emulated=True)))


def _run_program(layout: RunLayout, role: Role, pp_ranks: list[int]) -> ProgramReport:
    """One step of the program of `role`'s first rank, on fake tensors; with pipelining also how
    many micro-batches the program's stages hold on each of `pp_ranks`, which run it too."""
    mesh_spec, split = layout.mesh, layout.pipeline
    distributed.init_fake_process_group(layout.world_size, role.first_rank)
    try:
        # Meshes and the model's layout on `meta` first: building meshes reads real tensors.
        meshes = build_meshes(mesh_spec, "cpu")
        layout = _fp8_emulated(layout)
        built = rank_model.build_model_parts(layout, meshes, device=torch.device("meta"),
                                             fp8=precision.fp8_backend(layout.parallel.fp8, torch.device("cpu")))
        with FakeTensorMode(allow_non_fake_inputs=True), Accounting(_mesh_groups(meshes, mesh_spec)) as acct:
            step = _Step(layout, meshes, built, acct, role.first_rank)
            report = step.run()
            if mesh_spec.pp > 1:
                for pp_rank in pp_ranks:
                    report.held[pp_rank] = pipeline.activations_held(step.runner.schedule, pp_rank, mesh_spec.pp,
                                                                     split.stage_ids(pp_rank), step.m)
    finally:
        dist.destroy_process_group()
        # DTensor caches its sharding decisions and redistribution plans by mesh, and a mesh of
        # the next fake world (seen from another rank) compares equal to this one's: it must not
        # be handed these groups.
        _clear_sharding_prop_cache()
        clear_redistribute_planner_cache()
    return report


class _Step:
    """The trainer's step, phase by phase, with what each phase costs."""

    def __init__(self, layout: RunLayout, meshes: Meshes, built: rank_model.ModelParts, acct: Accounting, rank: int):
        self.layout, self.config, self.meshes = layout, layout.config, meshes
        self.mesh_spec, self.model_cfg, self.plan = layout.mesh, layout.model_cfg, layout.plan
        self.built, self.acct = built, acct
        self.report = ProgramReport(rank)
        self.runner = None
        self.m = layout.num_microbatches

    def run(self) -> ProgramReport:
        config, acct, parts = self.config, self.acct, self.built.parts
        for part in parts:
            materialize(part, torch.device("cpu"), self.layout.parallel.seed,
                        cpu_offload=self.layout.parallel.fsdp.cpu_offload)
        # The fused AdamW kernel, as on GPUs (foreach would add its temporaries).
        optimizer = build_optimizer(parts, config.optim)
        _create_state(optimizer)
        self._phase_done("initialization", times=1)
        self.report.param_bytes = _local_bytes(p for part in parts for p in part.parameters())
        if self.mesh_spec.pp > 1:
            self._pipelined_micro_batches()
        else:
            self._micro_batches()
        params = [p for part in parts for p in part.parameters()]
        self.report.grad_bytes = _local_bytes(p.grad for p in params if p.grad is not None)
        acct.reset_peak()
        rescale_expert_grads_(expert_parameters(parts, self.plan), self.mesh_spec,
                              self.meshes.groups(self.mesh_spec.expert_grad_sum_dims))
        pp_group = self.meshes.group("pp") if self.mesh_spec.pp > 1 else None
        clip_grads_(params, config.optim.grad_clip, pp_group, optimizer)
        optimizer.step()
        loss = torch.zeros(())
        for group in self.meshes.groups(self.mesh_spec.loss_dims):
            dist.all_reduce(loss, group=group)
        self.report.optimizer_bytes = _local_bytes(t for state in optimizer.state.values() for t in state.values()
                                                   if isinstance(t, torch.Tensor))
        self._phase_done("optimizer step", times=1)
        optimizer.zero_grad(set_to_none=True)
        return self.report

    def _phase_done(self, phase: str, times: int) -> None:
        for key, tally in self.acct.take_collectives().items():
            self.report.collectives[key].add(tally, times)
        peaks = self.report.phase_peaks
        peaks[phase] = max(peaks.get(phase, 0), self.acct.peak_bytes)

    def _inputs(self):
        """One micro-batch's token ids and its aux (RoPE, labels) as this rank holds them."""
        d, cp = self.config.data, self.mesh_spec.cp
        tokens = torch.randint(0, self.model_cfg.vocab_size, (d.micro_batch, d.seq_len))
        cp_rank = self.meshes.local_rank("cp")
        positions = context_parallel.load_balance_indices(d.seq_len, cp, cp_rank) if cp > 1 else torch.arange(d.seq_len)
        depth = flops.mtp_depth(self.model_cfg)
        # The tokens ahead that multi-token prediction reads, made from whole sequences.
        future = {"mtp_targets": mtp.future_targets(tokens, depth)} if depth else {}
        if cp > 1:
            tokens = context_parallel.shard_sequence(tokens, cp, cp_rank)
            future = {name: context_parallel.shard_sequence(t, cp, cp_rank) for name, t in future.items()}
        aux = families.make_aux(self.model_cfg, positions)
        return tokens, attrs.evolve(aux, labels=tokens.clone(), **future)

    def _measure(self, run) -> tuple[int, int]:
        """Runs `run()` (forward, then a function that runs the backward); returns the bytes the
        forward kept and the backward's working memory beyond them."""
        acct = self.acct
        acct.reset_peak()
        before = acct.live_bytes
        backward = run()
        kept = acct.live_bytes - before
        backward()
        return kept, acct.peak_bytes - before - kept

    def _micro_batches(self) -> None:
        """The trainer's loop: the first micro-batch, one in steady state, the last (those that
        exist), the steady one counted for all the middle ones."""
        model, ctx = self.built.parts[0], self.built.ctx
        kinds = [("last", 1)] if self.m == 1 else [("first", 1), ("steady", self.m - 2), ("last", 1)]
        for kind, times in kinds:
            if times == 0:
                continue
            tokens, aux = self._inputs()

            def forward():
                set_micro_batch_sync(model, last=kind == "last")
                loss = model(tokens, aux)
                return loss.backward

            with ctx.kernel_scope():
                kept, extra = self._measure(forward)
            self.report.stages = [StageCost(kept, extra, 0, 0)]
            self._phase_done("micro-batches", times)

    def _pipelined_micro_batches(self) -> None:
        """This rank's stages as torch's PipelineStage runs them, without peers."""
        built, split = self.built, self.layout.pipeline
        num_stages = split.num_stages
        runner = pipeline.PipelineRunner(built.parts, built.stage_ids, num_stages, split.schedule, self.m,
                                         torch.device("cpu"), self.meshes.group("pp"), 1.0)
        self.runner = runner
        for kind, times in (("first", 1), ("steady", self.m - 1)):
            if kind == "steady":
                self.report.kept_bytes = self.acct.live_bytes
            costs = []
            for part, stage_id in zip(built.parts, built.stage_ids):
                with built.ctx.kernel_scope():
                    costs.append(self._stage_micro_batch(part, stage_id, num_stages))
            self.report.stages = costs
            self._phase_done("micro-batches", times)
        self.acct.reset_peak()
        for stage in runner.stages:
            stage.perform_reduce_grad(1)
        self._phase_done("gradient reduction", times=1)
        for cost in self.report.stages:
            sends = (cost.input_bytes > 0) + (cost.output_bytes > 0)
            self.report.collectives["pp", "send/recv"].add(
                CollectiveTally(2 * sends, 2 * (cost.input_bytes + cost.output_bytes)), self.m)

    def _stage_micro_batch(self, part, stage_id: int, num_stages: int) -> StageCost:
        tokens, aux = self._inputs()
        part.stage_aux = lambda index: aux  # every micro-batch of the dry run has the same aux
        received = tokens if stage_id == 0 else self._received_activation(tokens).requires_grad_()
        # As torch's PipelineStage: gradient sync off for every micro-batch; the schedule's final
        # reduce (`perform_reduce_grad`) reduce-scatters them once.
        part.set_is_last_backward(False)
        part.set_reshard_after_backward(False)
        part.set_requires_gradient_sync(False)
        outputs = {}

        def forward():
            out = outputs["out"] = part(received)
            if stage_id == num_stages - 1:
                return part.head_loss(out, aux).backward
            return lambda: out.backward(torch.empty_like(out))

        kept, extra = self._measure(forward)
        out = outputs["out"]
        input_bytes = 0 if stage_id == 0 else received.numel() * received.element_size()
        output_bytes = 0 if stage_id == num_stages - 1 else out.numel() * out.element_size()
        return StageCost(kept, extra, input_bytes, output_bytes)

    def _received_activation(self, tokens: torch.Tensor) -> torch.Tensor:
        """The previous stage's output as this stage receives it: this rank's shard of the
        residual stream, in the compute dtype."""
        batch, seq = tokens.shape
        dtype = self.layout.parallel.compute_dtype
        full = torch.empty(batch, seq, self.model_cfg.dim, dtype=dtype)
        ctx = self.built.ctx
        if ctx.activation_mesh is None:
            return full
        replicated = DTensor.from_local(full, ctx.activation_mesh, [Replicate()] * ctx.activation_mesh.ndim,
                                        run_check=False)
        return ctx.constrain(replicated, RESIDUAL, "residual").to_local().contiguous()


def _create_state(optimizer: torch.optim.Optimizer) -> None:
    """AdamW's moments, which exist from the first optimizer step on: the step measured is a later
    one, whose micro-batches run with them in memory."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    for p in params:
        p.grad = torch.zeros_like(p)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)


def _local_bytes(tensors) -> int:
    total = 0
    for t in tensors:
        local = t.to_local() if isinstance(t, DTensor) else t
        total += local.numel() * local.element_size()
    return total
