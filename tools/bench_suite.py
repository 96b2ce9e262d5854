"""Runs the benchmark setups behind the README table, one `tools.bench` process each, and appends
their JSON lines to a results file:

    python -m tools.bench_suite --gpus 2 --out benchmarks/results.jsonl [--only cp= pp=] [--budget 540]
    python -m tools.bench --table benchmarks/results.jsonl --readme README.md

`--list` shows the setups. A setup runs when the machine has the GPUs it needs (`--gpus`); with
`--only`, when its name contains one of the given strings; with `--group`, when it belongs to that
comparison (`GROUPS`), in the group's order. `--group targets` runs the setups behind the 2-GPU
performance targets (`GROUPS`), most needed first, so that a call with `--budget` measures the most
needed ones it has time for. `--profile DIR` profiles every setup that runs (DIR/<setup>/), and adds
where its steps' time went to the results (`--group breakdown --profile DIR` for the README's
breakdown of llama-1b and llama-8b). `--budget` stops starting new setups after that many
seconds, so a time-limited machine returns what it measured.

`--group moe-one-gpu` measures MoE on one GPU beside the dense llama-1b row: mixtral-small's and
DeepSeek-V2-Lite's layers with bf16 and FP8 experts, the experts alone, and a 50-step loss check.
With `--baseline DIR` (another checkout, e.g. `git archive REV | tar -x -C DIR`) every loss check
also runs there, with that checkout's own code, and the suite prints how far the losses of the
two are apart step by step, beside those of the check's second run (the run-to-run spread).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from tools import suite_dense
from tools.bench import CALL_ENV
from tools.bench_tables import ATTENTION_FILE, EXPERTS_FILE

# Where the suite appends the JSON lines of the benchmarks of parts of a step, by their kind.
SIDE_FILES = {"attention": ATTENTION_FILE, "experts": EXPERTS_FILE}

STEPS = ["--steps", "14", "--warmup", "4"]
LONG = ["--seq-len", "32768", "--micro-batch", "1"]
PP = ["--mesh", "pp=2", "--micro-batch", "1"]
# Packed documents: synthetic documents of random lengths, attention within each.
DOCUMENTS = ["--document-mask", "--synthetic-document-length"]
TE = ["--fp8-backend", "te", "--fp8"]
# A loss check run a second time: its losses against the first run's give the run-to-run spread.
REPEAT = " again"

# name -> (processes, tools.bench arguments); "cpu" setups run without GPUs (a smoke test).
# MoE on 2 GPUs: each mesh (and expert dispatch) with each way of accumulating 4 micro-batches,
# routed by the router or, as the peers benchmark, with every expert given the same load.
_MOE_MESHES = {"dp=2": ["--mesh", "dp=2"],
               **{f"dp=2,ep=2 {dispatch}": ["--mesh", "dp=2,ep=2", "--ep-dispatch", dispatch]
                  for dispatch in ("alltoall", "allgather")}}
_MOE_OPTIONS = {"": [], " reduce-once": ["--fsdp-reduce-once"],
                " reduce-once no-reshard": ["--fsdp-reduce-once", "--fsdp-reshard-after-forward", "never"]}
_MOE_ROUTING = {"": [], " balanced": ["--model-overrides", "force_load_balance=true"]}

def _overrides(*groups: list[str]) -> list[str]:
    items = [item for group in groups for item in group]
    return ["--model-overrides", ",".join(items)] if items else []


SUITE: dict[str, tuple[int, list[str]]] = {
    "cpu tiny": (1, ["--shape", "tiny", "--steps", "3", "--warmup", "1", "--", "--precision", "fp32"]),
    **{f"cpu {shape}": (1, ["--shape", shape, "--steps", "3", "--warmup", "1", "--", "--precision", "fp32"])
       for shape in ("tiny-qwen3", "tiny-gpt-oss", "tiny-llama4")},
    "llama-1b single": (1, ["--shape", "llama-1b", *STEPS, "--", "--compile"]),
    "llama-1b single fp8": (1, ["--shape", "llama-1b", *STEPS, "--", "--compile", "--fp8", "tensorwise"]),
    "llama-1b single fp8 head": (1, ["--shape", "llama-1b", *STEPS, "--", "--compile", "--fp8", "tensorwise",
                                     "--fp8-head"]),
    "llama-1b single seq 32768": (1, ["--shape", "llama-1b", *STEPS, "--", "--compile", *LONG]),
    "llama-1b dp=2": (2, ["--shape", "llama-1b", *STEPS, "--", "--compile", "--mesh", "dp=2"]),
    "llama-1b tp=2": (2, ["--shape", "llama-1b", *STEPS, "--", "--compile", "--mesh", "tp=2"]),
    "llama-1b tp=2 sp": (2, ["--shape", "llama-1b", *STEPS, "--", "--compile", "--mesh", "tp=2", "--sequence-parallel"]),
    **{f"llama-1b pp=2 {schedule} m={m}": (2, ["--shape", "llama-1b", *STEPS, "--", "--compile", *PP,
                                               "--global-batch", str(m), "--pp-schedule", schedule,
                                               *(["--pp-virtual-stages", "2"] if schedule in ("interleaved-1f1b",
                                                                                            "looped-bfs") else [])])
       for schedule in ("1f1b", "gpipe", "interleaved-1f1b", "looped-bfs") for m in (8, 16)},
    **{f"llama-1b cp=2 {method} seq 32768": (2, ["--shape", "llama-1b", *STEPS, "--", "--compile",
                                                 "--mesh", "cp=2", "--cp-comm", method, *LONG])
       for method in ("allgather", "ring", "a2a")},
    # Packed documents against the same shape without them; each masked kernel on its own.
    "llama-3b single": (1, ["--shape", "llama-3b", *STEPS, "--", "--compile"]),
    **{f"llama-3b single documents{name}": (1, ["--shape", "llama-3b", *STEPS, "--", "--compile", *DOCUMENTS, "2048",
                                                  *kernel])
       for name, kernel in (("", []), (" flex", ["--attention-kernel", "flex"]),
                            (" varlen", ["--attention-kernel", "varlen"]))},
    **{f"llama-1b cp=2 {method} seq 32768 documents": (2, ["--shape", "llama-1b", *STEPS, "--", "--compile",
                                                           "--mesh", "cp=2", "--cp-comm", method, *LONG,
                                                           *DOCUMENTS, "8192"])
       for method in ("allgather", "ring", "a2a")},
    "llama-1b single seq 32768 window 4096": (1, ["--shape", "llama-1b", *STEPS, "--", "--compile", *LONG,
                                                  "--model-overrides", "sliding_window=4096"]),
    "llama-8b dp=2": (2, ["--shape", "llama-8b", *STEPS, "--", "--compile", "--mesh", "dp=2"]),
    "llama-8b dp=2 fp8": (2, ["--shape", "llama-8b", *STEPS, "--", "--compile", "--mesh", "dp=2", "--fp8", "tensorwise"]),
    "llama-8b dp=2 fp8 head": (2, ["--shape", "llama-8b", *STEPS, "--", "--compile", "--mesh", "dp=2",
                                   "--fp8", "tensorwise", "--fp8-head"]),
    "llama-8b dp=2 fp8 head no-reshard": (2, ["--shape", "llama-8b", *STEPS, "--", "--compile", "--mesh", "dp=2",
                                              "--fp8", "tensorwise", "--fp8-head",
                                              "--fsdp-reshard-after-forward", "never"]),
    "llama-8b tp=2 sp": (2, ["--shape", "llama-8b", *STEPS, "--", "--compile", "--mesh", "tp=2", "--sequence-parallel",
                             "--recompute", "selective"]),
    "llama-8b tp=2 sp fp8": (2, ["--shape", "llama-8b", *STEPS, "--", "--compile", "--mesh", "tp=2",
                                 "--sequence-parallel", "--recompute", "selective", "--fp8", "tensorwise"]),
    # Transformer Engine's recipes beside the bf16 and torchao rows of the same setups.
    **{f"llama-1b single te {recipe}": (1, ["--shape", "llama-1b", *STEPS, "--", "--compile", *TE, recipe])
       for recipe in ("delayed", "current")},
    "llama-1b single te delayed head": (1, ["--shape", "llama-1b", *STEPS, "--", "--compile", *TE, "delayed",
                                            "--fp8-head"]),
    **{f"llama-8b dp=2 te {recipe}": (2, ["--shape", "llama-8b", *STEPS, "--", "--compile", "--mesh", "dp=2",
                                          *TE, recipe]) for recipe in ("delayed", "current")},
    "llama-8b tp=2 sp te delayed": (2, ["--shape", "llama-8b", *STEPS, "--", "--compile", "--mesh", "tp=2",
                                        "--sequence-parallel", "--recompute", "selective", *TE, "delayed"]),
    **{f"mixtral-small dp=2,ep=2 allgather {name}": (2, ["--shape", "mixtral-small", *STEPS, "--", "--compile",
                                                         "--mesh", "dp=2,ep=2", "--ep-dispatch", "allgather",
                                                         "--global-batch", "16", *fp8])
       for name, fp8 in (("fp8", ["--fp8", "tensorwise"]), ("te delayed", [*TE, "delayed"]),
                         ("te delayed experts", [*TE, "delayed", "--fp8-experts"]))},
    # The routed experts in TE's FP8 grouped GEMM (--fp8-experts) on one GPU: half of mixtral-small's
    # layers (its optimizer states for all 16 would not leave room for activations).
    **{f"mixtral-small single layers=8{name}": (1, ["--shape", "mixtral-small", *STEPS, "--", "--compile",
                                                    "--model-overrides", "num_layers=8", *fp8])
       for name, fp8 in (("", []), (" fp8", ["--fp8", "tensorwise"]), (" te delayed", [*TE, "delayed"]),
                         (" te delayed experts", [*TE, "delayed", "--fp8-experts"]))},
    # Tensor parallelism against FSDP: without SP, with SP and its collectives fused
    # into the matmuls (the default), and with SP's separate collectives (--tp-overlap none).
    "llama-1b tp=2 sp unfused": (2, ["--shape", "llama-1b", *STEPS, "--", "--compile", "--mesh", "tp=2",
                                     "--sequence-parallel", "--tp-overlap", "none"]),
    "llama-8b tp=2": (2, ["--shape", "llama-8b", *STEPS, "--", "--compile", "--mesh", "tp=2", "--recompute", "selective"]),
    "llama-8b tp=2 sp unfused": (2, ["--shape", "llama-8b", *STEPS, "--", "--compile", "--mesh", "tp=2",
                                     "--sequence-parallel", "--recompute", "selective", "--tp-overlap", "none"]),
    **{f"llama-70b-4l {name}": (2, ["--shape", "llama-70b-4l", *STEPS, "--", "--compile", *flags])
       for name, flags in (("dp=2", ["--mesh", "dp=2"]), ("tp=2", ["--mesh", "tp=2"]),
                           ("tp=2 sp", ["--mesh", "tp=2", "--sequence-parallel"]),
                           ("tp=2 sp unfused", ["--mesh", "tp=2", "--sequence-parallel", "--tp-overlap", "none"]))},
    **{f"mixtral-small {mesh}{name}{routing}": (2, ["--shape", "mixtral-small", *STEPS, "--", "--compile",
                                                      *mesh_args, "--global-batch", "16", *options, *balance])
       for mesh, mesh_args in _MOE_MESHES.items() for name, options in _MOE_OPTIONS.items()
       for routing, balance in _MOE_ROUTING.items()},
    # DeepSeek-V2-Lite (MLA, 64 fine-grained experts top-6, 2 shared) on ep=2: half its depth without
    # activation recompute, and all 27 layers with it (the optimizer states alone take ~126 GB a GPU).
    **{f"deepseek-v2-lite dp=2,ep=2{depth}{routing}": (2, ["--shape", "deepseek-v2-lite", *STEPS, "--", "--compile",
                                                          "--mesh", "dp=2,ep=2", "--global-batch", "16", *options,
                                                          *_overrides(depth_overrides, balance)])
       for depth, depth_overrides, options in ((" layers=14", ["num_layers=14"], ["--micro-batch", "2"]),
                                               (" layers=14 reduce-once", ["num_layers=14"],
                                                ["--micro-batch", "2", "--fsdp-reduce-once"]),
                                               ("", [], ["--recompute", "full"]))
       for routing, balance in (("", []), (" balanced", ["force_load_balance=true"]))},
    # MLA within packed documents (its value head dim on the masked kernels).
    "deepseek-v2-lite dp=2,ep=2 layers=14 documents": (2, ["--shape", "deepseek-v2-lite", *STEPS, "--", "--compile",
                                                           "--mesh", "dp=2,ep=2", "--global-batch", "16",
                                                           "--micro-batch", "2", *_overrides(["num_layers=14"]),
                                                           *DOCUMENTS, "2048"]),
    # The output projection and loss a chunk of tokens at a time, beside the unfused rows
    # above, and with the larger micro-batch that the memory it saves may allow.
    **{f"llama-1b single loss-chunks {chunk}{name}": (1, ["--shape", "llama-1b", *STEPS, "--", "--compile",
                                                           "--loss-chunk-tokens", str(chunk), *flags])
       for chunk in (2048, 4096) for name, flags in (("", []), (" fp8", ["--fp8", "tensorwise"]))},
    **{f"llama-1b single micro-batch 8{name}": (1, ["--shape", "llama-1b", *STEPS, "--", "--compile",
                                                     "--micro-batch", "8", *flags])
       for name, flags in (("", []), (" loss-chunks 2048", ["--loss-chunk-tokens", "2048"]))},
    **{f"llama-8b dp=2 loss-chunks 2048{name}": (2, ["--shape", "llama-8b", *STEPS, "--", "--compile", "--mesh", "dp=2",
                                                      "--loss-chunk-tokens", "2048", *flags])
       for name, flags in (("", []), (" fp8", ["--fp8", "tensorwise"]))},
    **{f"llama-8b dp=2 micro-batch 2{name}": (2, ["--shape", "llama-8b", *STEPS, "--", "--compile", "--mesh", "dp=2",
                                                   "--micro-batch", "2", "--global-batch", "4", *flags])
       for name, flags in (("", []), (" loss-chunks 2048", ["--loss-chunk-tokens", "2048"]))},
    # Attention sub-blocks alone: llama-1b's GQA beside DeepSeek's MLA (to attention.jsonl beside --out).
    "attention gqa and mla": (1, ["--attention", "all", "--compile", "--steps", "20"]),
    # Seven of DeepSeek-V2-Lite's 27 layers fit one H200 (its fp32 state at full depth needs two):
    # its MLA and 64 narrow experts per GPU, 4 and 2 micro-batches per step.
    **{f"deepseek-v2-lite single layers=7{routing} micro-batch {mb}": (
        1, ["--shape", "deepseek-v2-lite", *STEPS, "--", "--compile", "--global-batch", "8", "--micro-batch", str(mb),
            *_overrides(["num_layers=7"], balance)])
       for mb in (2, 4) for routing, balance in (("", []), (" balanced", ["force_load_balance=true"]))},
    # Today's families on one H200, bf16 and FP8 (torchao's, on the attention; experts stay bf16):
    # Qwen3-8B's first 8 layers; gpt-oss-20b's first 4 (all 32 experts: its 8 layers' fp32 weights
    # and AdamW state alone are ~125 GB) and Llama-4-Scout's first 2 (all 16 experts, ~35 GB of
    # state a layer), routed by their routers and with every expert given the same load.
    **{f"qwen3-8b single layers=8{name}": (1, ["--shape", "qwen3-8b", *STEPS, "--", "--compile",
                                               "--model-overrides", "num_layers=8", *fp8])
       for name, fp8 in (("", []), (" fp8", ["--fp8", "tensorwise"]))},
    **{f"{shape} single layers={layers}{name}": (1, ["--shape", shape, *STEPS, "--", "--compile",
                                                     *_overrides([f"num_layers={layers}"], balance), *fp8])
       for shape, layers in (("gpt-oss-20b", 4), ("llama4-scout", 2))
       for name, balance, fp8 in (("", [], []), (" balanced", ["force_load_balance=true"], []),
                                  (" balanced fp8", ["force_load_balance=true"], ["--fp8", "tensorwise"]))},
    # MoE on one GPU: 8 of mixtral-small's layers and 7 of DeepSeek-V2-Lite's at micro-batch 2, 8
    # micro-batches a step (the optimizer's and FSDP's per-step passes over every expert's weights
    # amortised as a multi-GPU run's larger batch would), bf16 experts and torchao's FP8 ones.
    **{f"{model} single layers={layers} micro-batches=8{routing}{name}": (
        1, ["--shape", model, "--steps", "12", "--warmup", "4", "--", "--compile", "--micro-batch", "2",
            "--global-batch", "16", *_overrides([f"num_layers={layers}"], balance), *flags])
       for model, layers in (("mixtral-small", 8), ("deepseek-v2-lite", 7))
       for routing, balance in (("", []), (" balanced", ["force_load_balance=true"]))
       for name, flags in (("", []), (" fp8-experts", ["--fp8-experts"]))},
    # 50 bf16 steps of the earlier rows' setup (real routing, 2 micro-batches a step), seed 0: its
    # losses against another checkout's (--baseline) and against a second run of this one.
    **{f"mixtral-small single layers=8 loss check{again}": (1, ["--shape", "mixtral-small", "--steps", "50", "--warmup",
                                                                "10", "--", "--compile", "--model-overrides",
                                                                "num_layers=8", "--global-batch", "4"])
       for again in ("", REPEAT)},
    "experts alone": (1, ["--experts", "torch", "torchao", "--steps", "20"]),
    # The same plumbing on a CPU: MoE flags, FP8 experts emulated, a loss check (a smoke test).
    **{f"cpu moe loss check{again}": (1, ["--shape", "tiny-moe", "--steps", "3", "--warmup", "1", "--",
                                          "--precision", "fp32", "--fp8-experts", "--global-batch", "8",
                                          "--model-overrides", "force_load_balance=true"])
       for again in ("", REPEAT)},
}

SUITE.update(suite_dense.SETUPS)

# Setups measured side by side, each group in one `--group` run.
GROUPS: dict[str, list[str]] = {
    **suite_dense.GROUPS,
    "tp-overlap": [f"{shape} {mesh}" for shape in ("llama-1b", "llama-8b", "llama-70b-4l")
                   for mesh in ("dp=2", "tp=2", "tp=2 sp", "tp=2 sp unfused")],
    # Where the steps of the one- and two-GPU targets go (with --profile): bf16 and the fastest FP8 setup of each.
    "breakdown": ["llama-1b single", "llama-1b single fp8 head", "llama-8b dp=2", "llama-8b dp=2 fp8 head no-reshard"],
    # The 2-GPU targets: llama-8b dp=2 bf16 (60% MFU) beside tp=2 with SP (95% of it), FP8
    # (13,000 tok/s/GPU); llama-1b tp=2 with SP (90% of dp=2, never slower than without SP);
    # DeepSeek-V2-Lite at ep=2 (35% MFU); Transformer Engine at least torchao.
    "targets": ["llama-8b dp=2", "llama-8b tp=2 sp", "llama-8b dp=2 fp8 head no-reshard", "llama-1b dp=2",
                "llama-1b tp=2 sp", "llama-1b tp=2", "deepseek-v2-lite dp=2,ep=2",
                "deepseek-v2-lite dp=2,ep=2 layers=14 reduce-once balanced", "llama-8b dp=2 fp8",
                "llama-8b dp=2 te delayed", "mixtral-small dp=2,ep=2 allgather fp8",
                "mixtral-small dp=2,ep=2 allgather te delayed", "llama-8b tp=2 sp fp8", "llama-8b tp=2 sp te delayed"],
    # What one H200 measures of DeepSeek: MLA beside GQA, and DeepSeek layers.
    "deepseek-one-gpu": ["attention gqa and mla", *(name for name in SUITE if name.startswith("deepseek-v2-lite single")
                                                                and "micro-batch " in name)],
    # Qwen3, gpt-oss and Llama 4 on one H200 (`--gpus 0`: their tiny presets on the CPU, a smoke test).
    "families": [*(name for name in SUITE if name.startswith(("cpu tiny-", "qwen3-", "gpt-oss-", "llama4-")))],
    "loss-chunks": ["llama-1b single", "llama-1b single fp8 head", "llama-8b dp=2", "llama-8b dp=2 fp8 head",
                    *(name for name in SUITE if "loss-chunks" in name or "micro-batch " in name)],
    # MoE on one H200 beside the dense llama-1b row (with --profile, where each step goes; with
    # --baseline, the loss check of another checkout too), most needed first for --budget.
    "moe-one-gpu": ["llama-1b single",
                    *(f"{model} micro-batches=8 balanced{fp8}" for model in ("mixtral-small single layers=8",
                                                                            "deepseek-v2-lite single layers=7")
                      for fp8 in ("", " fp8-experts")),
                    "mixtral-small single layers=8 loss check", "experts alone",
                    *(f"mixtral-small single layers=8 micro-batches=8{fp8}" for fp8 in ("", " fp8-experts")),
                    f"mixtral-small single layers=8 loss check{REPEAT}",
                    *(f"deepseek-v2-lite single layers=7 micro-batches=8{fp8}" for fp8 in ("", " fp8-experts"))],
}


def command(processes: int, bench_args: list[str]) -> list[str]:
    if processes == 1:
        return [sys.executable, "-m", "tools.bench", *bench_args]
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(processes),
            "-m", "tools.bench", *bench_args]


def selected(gpus: int, only: list[str], group: str | None = None) -> list[str]:
    names = []
    for name in SUITE if group is None else GROUPS[group]:
        processes = SUITE[name][0]
        runs_here = name.startswith("cpu") if gpus == 0 else (not name.startswith("cpu") and processes <= gpus)
        if runs_here and (not only or any(part in name for part in only)):
            names.append(name)
    return names


def run_suite(names: list[str], out: Path, budget: float, timeout: float, profile: Path | None = None,
              baseline: Path | None = None, baseline_commit: str = "baseline",
              runs_dir: Path = Path("runs")) -> list[tuple[str, str]]:
    """Runs each setup (profiled into `profile`/<setup>/ if given, its run directory
    `runs_dir`/suite-<setup>); appends its JSON line to `out`; returns (name, outcome) pairs. A
    loss check runs again in the checkout at `baseline` (its own code, launched there), and the
    suite compares the two runs' losses step by step, as it compares a check run `REPEAT` with its
    first run."""
    start, outcomes = time.monotonic(), []
    # One id for the rows of this call (or of the calls a caller gave one id to share).
    call = os.environ.get(CALL_ENV) or f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
    env = {**os.environ, "PYTHONUNBUFFERED": "1", CALL_ENV: call}
    run_dirs: dict[str, Path] = {}
    for name in names:
        if time.monotonic() - start > budget:
            outcomes.append((name, "not started: over --budget"))
            continue
        outcome, run_dirs[name] = _run_setup(name, out, timeout, profile, Path.cwd(), env, runs_dir)
        if name.endswith(REPEAT) and name[:-len(REPEAT)] in run_dirs:
            outcome += "; losses " + _loss_difference(run_dirs[name[:-len(REPEAT)]], run_dirs[name], "the first run")
        outcomes.append((name, outcome))
        if "loss check" in name and not name.endswith(REPEAT) and baseline is not None:
            there = {**env, "PYTHONPATH": str(baseline.resolve()), "DTRAIN_COMMIT": baseline_commit}
            outcome, baseline_dir = _run_setup(name, out, timeout, None, baseline.resolve(), there, runs_dir,
                                               "-baseline")
            outcome += "; losses " + _loss_difference(baseline_dir, run_dirs[name], "the baseline's")
            outcomes.append((f"{name} (baseline {baseline_commit})", outcome))
    return outcomes


def _run_setup(name: str, out: Path, timeout: float, profile: Path | None, cwd: Path, env: dict[str, str],
               runs_dir: Path, suffix: str = "") -> tuple[str, Path]:
    """One setup's process in `cwd` (a checkout): its outcome, and its run directory (emptied
    first: a loss check reads every step logged there)."""
    processes, bench_args = SUITE[name]
    bench_args = [arg.replace("{out_dir}", str(out.parent.resolve())) for arg in bench_args]
    slug = name.replace(" ", "-").replace("=", "")
    if profile is not None:
        bench_args = ["--profile", str(profile / slug), *bench_args]
    run_dir = cwd / runs_dir / f"suite-{slug}{suffix}"  # an absolute runs_dir stays as it is
    shutil.rmtree(run_dir, ignore_errors=True)
    # A training run's directory (after `--`, among dtrain's flags); the benchmarks of parts of a step have none.
    to_run_dir = ["--run-dir", str(run_dir)] if "--" in bench_args else []
    try:
        result = subprocess.run(command(processes, [*bench_args, *to_run_dir]), capture_output=True, text=True,
                                timeout=timeout, env=env, cwd=cwd)
    except subprocess.TimeoutExpired:
        return f"stopped after {timeout:.0f} s", run_dir
    lines = [line for line in result.stdout.splitlines() if line.startswith("{")]
    if result.returncode != 0 or not lines:
        last = (result.stderr.strip().splitlines() or ["no output"])[-1]
        return f"failed (exit {result.returncode}): {last[:200]}", run_dir
    kind = json.loads(lines[-1]).get("kind")
    if kind in SIDE_FILES:
        with out.with_name(SIDE_FILES[kind]).open("a") as f:
            f.write("".join(line + "\n" for line in lines))
        rows = [json.loads(line) for line in lines]
        if kind == "attention":
            return "; ".join(f"{r['setup']} {r['model_tflops']} TFLOP/s" for r in rows), run_dir
        return "; ".join(f"{r['shape']} {r['way']} {r.get('tflops', r.get('error'))}" for r in rows), run_dir
    with out.open("a") as f:
        f.write(lines[-1] + "\n")
    row = json.loads(lines[-1])
    mfu = f"{row['mfu_pct']}% MFU, " if row["mfu_pct"] is not None else ""
    exposed = row.get("exposed_communication_pct")
    exposed = f", {exposed}% exposed communication" if exposed is not None else ""
    return f"{row['tokens_per_sec_per_gpu']:,.0f} tok/s/GPU, {mfu}{row['peak_mem_gb']} GB{exposed}", run_dir


def _loss_difference(reference: Path, other: Path, label: str) -> str:
    """How far `other`'s losses are from `reference`'s, step by step, in words."""
    from tools.compare_runs import compare, read_scalars

    try:
        diff = compare(read_scalars(reference), read_scalars(other), ["train/loss"])["train/loss"]
    except SystemExit as error:
        return f"not compared with {label}: {error}"
    return (f"against {label} over {diff['steps']} steps: largest relative difference {diff['max_rel_diff']:.2e} "
            f"(step {diff['at_step']}), mean {diff['mean_rel_diff']:.2e}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.bench_suite", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gpus", type=int, default=None, help="GPUs on this machine (default: as torch sees)")
    parser.add_argument("--only", nargs="*", default=[], help="run only setups whose name contains one of these")
    parser.add_argument("--group", choices=sorted(GROUPS), help="run only the setups of this comparison")
    parser.add_argument("--profile", type=Path, metavar="DIR", help="profile each setup into DIR/<setup>/")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results.jsonl"))
    parser.add_argument("--budget", type=float, default=float("inf"), help="seconds after which no setup starts")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds one setup may run")
    parser.add_argument("--baseline", type=Path, metavar="DIR", help="another checkout (e.g. `git archive REV | "
                        "tar -x -C DIR`): each loss check runs there too, and the suite compares the losses")
    parser.add_argument("--baseline-commit", default="baseline", help="the commit the --baseline checkout holds, "
                        "for its rows")
    parser.add_argument("--runs-dir", type=Path, default=Path("runs"),
                        help="where each setup's run directory (suite-<setup>) goes")
    parser.add_argument("--list", action="store_true", help="print the setups that would run, and exit")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    gpus = args.gpus
    if gpus is None:
        import torch

        gpus = torch.cuda.device_count()
    names = selected(gpus, args.only, args.group)
    if not names:
        raise SystemExit(f"error: no setup matches --gpus {gpus}, --only {' '.join(args.only) or '(all)'} and "
                         f"--group {args.group or '(all)'}; "
                         f"see --list with --gpus 2")
    if args.list:
        for name in names:
            processes, bench_args = SUITE[name]
            print(f"{name}: {' '.join(command(processes, bench_args)[1:])}")
        return 0
    if args.baseline is not None and not (args.baseline / "tools" / "bench.py").is_file():
        parser.error(f"--baseline {args.baseline}: not a dtrain checkout (no tools/bench.py there)")
    outcomes = run_suite(names, args.out, args.budget, args.timeout, args.profile, args.baseline,
                         args.baseline_commit, args.runs_dir)
    width = max(len(name) for name, _ in outcomes)
    for name, outcome in outcomes:
        print(f"{name:<{width}}  {outcome}")
    return 0 if all("failed" not in outcome for _, outcome in outcomes) else 1


if __name__ == "__main__":
    sys.exit(main())
