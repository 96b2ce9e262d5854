"""The planner's answers as text: a few lines per candidate (the layout, memory per rank, speed,
what bounds the step, the command), and writing them into a page between its markers."""

from __future__ import annotations

from pathlib import Path

from dtrain.planner.candidates import Candidate, Target, fp8_flags
from models.errors import UserError

END_MARKER = "<!-- end of python -m dtrain.planner -->"


def describe(candidate: Candidate, rank: int, gpu_memory_gb: float) -> list[str]:
    """A few lines per candidate: the layout, memory per rank, speed, what bounds it, the command."""
    p, t = candidate.config.parallel, candidate.config.train
    layout = [f"micro-batch {candidate.config.data.micro_batch}", f"recompute {candidate.recompute}"]
    if "pp=" in candidate.mesh:
        layout.append(f"{p.pp_schedule}" + (f" x{p.pp_virtual_stages} stages/rank" if p.pp_virtual_stages > 1 else ""))
    if p.dp_mode != "fsdp":
        layout.append(f"dp-mode {p.dp_mode}")
    elif p.fsdp_reshard_after_forward != "default":
        layout.append(f"reshard {p.fsdp_reshard_after_forward}")
    if p.cpu_offload:
        layout.append("CPU offload")
    if t.fp8:
        layout.append(" ".join(fp8_flags(t)))
    memory_line = candidate.memory.lines()[0]
    step = candidate.step
    fits = "" if candidate.fits else " (does not fit: fits false)"
    return [
        f"{rank}. --mesh {candidate.mesh}: {', '.join(layout)}",
        f"   memory per rank {memory_line.replace(' GB at', f' of {gpu_memory_gb:g} GB at', 1)}{fits}",
        f"   {step.tokens_per_sec_per_gpu:,.0f} tokens/s/GPU, MFU {100 * step.mfu():.1f}%, {step.seconds:.2f} s per step; "
        f"bound by: {step.bound_by()}",
        f"   {candidate.command}",
    ]


def candidates_text(target: Target, candidates: list[Candidate], top: int, seconds: float) -> str:
    nodes = max(1, target.gpus // target.gpus_per_node)
    fp8 = " ".join(fp8_flags(target))
    fitting = sum(c.fits for c in candidates)
    head = (f"{target.model} on {target.gpus} GPUs ({nodes} x {min(target.gpus, target.gpus_per_node)} {target.gpu}, "
            f"{target.memory_gb:g} GB each), seq {target.seq_len}, global batch {target.global_batch}"
            f"{', ' + fp8 if fp8 else ''}: {fitting:,} layouts fit (searched in {seconds:.1f} s)")
    head += f"; the best {min(top, len(candidates))}:" if fitting else "; the nearest:"
    lines = [head, ""]
    for rank, candidate in enumerate(candidates[:top], 1):
        lines += describe(candidate, rank, target.memory_gb) + [""]
    return "\n".join(lines).rstrip()


def write_into_readme(readme: Path, command: str, text: str, end_marker: str = END_MARKER) -> None:
    """Replaces what follows the marker `<!-- COMMAND -->` up to `end_marker` with `text`."""
    begin = f"<!-- {command} -->"
    content = readme.read_text()
    if begin not in content:
        raise UserError(f"{readme} has no marker {begin!r}; add it, and {end_marker!r} after it, where the output goes")
    head, _, rest = content.partition(begin)
    if end_marker not in rest:
        raise UserError(f"{readme}: the marker {begin!r} has no {end_marker!r} after it")
    _, _, tail = rest.partition(end_marker)
    if not text.startswith("|"):
        text = f"```text\n{text}\n```"  # the lines, kept as printed
    readme.write_text(f"{head}{begin}\n{text}\n{end_marker}{tail}")
