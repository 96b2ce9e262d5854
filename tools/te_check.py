"""The GPU check of Transformer Engine FP8 (`--fp8-backend te`) in one command, on a machine with
two GPUs and TE installed (../shared/te/README.md; source `.te/env.sh` before python starts):

    python -m tools.te_check                                  # all three phases
    python -m tools.te_check --phase bench --only llama-1b    # one phase, some setups

tests   python -m pytest -m gpu tests/test_te_gpu.py
bench   per setup, bf16, torchao FP8 and TE FP8 one after another (tools.bench_suite setups, appended
        to --out); prints tok/s/GPU and TE's ratio to torchao's (the target: at least 1)
curves  --curve-steps steps of llama-1b on the bundled corpus in bf16 (twice, the same seed), torchao
        FP8 and TE delayed and current scaling (two runs at a time, one per GPU or both on one);
        prints 10-step mean losses against bf16's, and per curve its difference over the last 20
        steps and its mean absolute per-step difference (the target: within 1%; the second bf16
        run shows how far non-deterministic kernels alone take a curve)

Each phase fits one 10-minute call except `bench` without --only: about 1.5 min per setup.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tools import bench_suite
from tools.compare_runs import read_scalars

# Per setup: bf16, torchao FP8, then TE's recipes; names from tools.bench_suite.SUITE.
BENCH_GROUPS = {
    "llama-1b single": ["llama-1b single", "llama-1b single fp8", "llama-1b single te delayed",
                        "llama-1b single te current"],
    "llama-1b single head": ["llama-1b single fp8 head", "llama-1b single te delayed head"],
    "llama-8b dp=2": ["llama-8b dp=2", "llama-8b dp=2 fp8", "llama-8b dp=2 te delayed", "llama-8b dp=2 te current"],
    "llama-8b tp=2 sp": ["llama-8b tp=2 sp", "llama-8b tp=2 sp fp8", "llama-8b tp=2 sp te delayed"],
    "mixtral-small dp=2,ep=2": ["mixtral-small dp=2,ep=2 allgather", "mixtral-small dp=2,ep=2 allgather fp8",
                                "mixtral-small dp=2,ep=2 allgather te delayed",
                                "mixtral-small dp=2,ep=2 allgather te delayed experts"],
    "mixtral-small single": ["mixtral-small single layers=8", "mixtral-small single layers=8 fp8",
                             "mixtral-small single layers=8 te delayed",
                             "mixtral-small single layers=8 te delayed experts"],
}
CURVES = {"bf16": [], "bf16 again": [], "torchao tensorwise": ["--fp8", "tensorwise"],
          "te delayed": ["--fp8", "delayed", "--fp8-backend", "te"],
          "te current": ["--fp8", "current", "--fp8-backend", "te"]}
CURVE_ARGS = ["--model", "llama-1b", "--data", "bundled", "--seq-len", "2048", "--micro-batch", "4", "--lr", "3e-4",
              "--warmup-steps", "20", "--seed", "0", "--compile"]


def check_te_imports() -> None:
    result = subprocess.run([sys.executable, "-c", "import transformer_engine.pytorch"], capture_output=True, text=True)
    if result.returncode != 0:
        last = (result.stderr.strip().splitlines() or ["?"])[-1]
        raise SystemExit(f"error: Transformer Engine does not import ({last}); install it and source .te/env.sh "
                         f"as ../shared/te/README.md says")


def run_tests() -> bool:
    print("== tests: python -m pytest -m gpu tests/test_te_gpu.py", flush=True)
    return subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "tests/test_te_gpu.py"]).returncode == 0


def run_bench(only: list[str], out: Path, budget: float) -> bool:
    groups = {name: setups for name, setups in BENCH_GROUPS.items() if not only or any(o in name for o in only)}
    names = [setup for setups in groups.values() for setup in setups]
    print(f"== bench: {len(names)} setups, appended to {out}", flush=True)
    outcomes = dict(bench_suite.run_suite(names, out, budget, timeout=600.0))
    for group, setups in groups.items():
        print(f"{group}:")
        speeds = {}
        for setup in setups:
            found = re.match(r"([\d,]+) tok/s/GPU", outcomes[setup])
            speeds[setup] = float(found.group(1).replace(",", "")) if found else None
            print(f"  {setup:<48} {outcomes[setup]}")
        torchao = next((speeds[s] for s in setups if s.endswith("fp8") or s.endswith("fp8 head")), None)
        for setup in setups:
            if " te " in setup and speeds[setup] and torchao:
                print(f"  {setup}: {speeds[setup] / torchao:.3f} x torchao")
    return all("failed" not in outcome for outcome in outcomes.values())


def _curve(name: str, steps: int, gpu: int) -> tuple[str, Path, int]:
    run_dir = Path("runs") / f"te-curve-{name.replace(' ', '-')}"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": str(gpu)}
    args = [*CURVE_ARGS, "--steps", str(steps), "--run-dir", str(run_dir), *CURVES[name]]
    result = subprocess.run([sys.executable, "-m", "dtrain.run", *args], env=env, capture_output=True, text=True)
    if result.returncode != 0:
        print(f"  {name}: failed: {(result.stderr.strip().splitlines() or ['?'])[-1][:300]}", flush=True)
    return name, run_dir, result.returncode


def run_curves(steps: int) -> bool:
    print(f"== curves: {steps} steps of llama-1b on the bundled corpus", flush=True)
    import torch

    gpus = max(1, torch.cuda.device_count())  # two runs at a time, sharing a GPU where there is one
    with ThreadPoolExecutor(max_workers=2) as pool:
        runs = list(pool.map(lambda item: _curve(item[1], steps, item[0] % gpus), enumerate(CURVES)))
    if any(code != 0 for _, _, code in runs):
        return False
    print(curve_report({name: read_scalars(run_dir)["train/loss"] for name, run_dir, _ in runs}))
    return True


def curve_report(losses: dict[str, dict[int, float]], window: int = 10, tail: int = 20) -> str:
    """Each curve against the first ("bf16"): a table of `window`-step mean losses with their
    relative differences, then per curve the mean difference over the last `tail` steps and the
    mean absolute per-step difference from step 11 on. "bf16 again" (the same seed once more) shows
    how far two bf16 runs drift apart through non-deterministic kernels alone."""
    names = list(losses)
    reference = losses[names[0]]
    steps = sorted(set.intersection(*(set(curve) for curve in losses.values())))
    if len(steps) < max(window, tail):
        raise ValueError(f"the curves share {len(steps)} steps; run at least {max(window, tail)}")

    def mean(curve: dict[int, float], chosen: list[int]) -> float:
        return sum(curve[step] for step in chosen) / len(chosen)

    marks = sorted({steps[0], *(s for s in steps if s % 50 == 0 and s >= window), steps[-1]})
    lines = [f"  | steps | {' | '.join(names)} |", "  |" + "---|" * (len(names) + 1)]
    for mark in marks:
        chosen = [s for s in steps if mark - window < s <= mark]
        base = mean(reference, chosen)
        cells = [f"{base:.4f}"]
        for name in names[1:]:
            value = mean(losses[name], chosen)
            cells.append(f"{value:.4f} ({100 * (value / base - 1):+.2f}%)")
        lines.append(f"  | {chosen[0]}-{chosen[-1]} | {' | '.join(cells)} |")
    last, later = steps[-tail:], [s for s in steps if s > 10]
    for name in names[1:]:
        end = 100 * (mean(losses[name], last) / mean(reference, last) - 1)
        per_step = 100 * sum(abs(losses[name][s] / reference[s] - 1) for s in later) / len(later)
        lines.append(f"  {name}: steps {last[0]}-{last[-1]} {end:+.2f}% from {names[0]}; "
                     f"mean |per-step difference| from step 11 {per_step:.2f}%")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.te_check", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phase", nargs="+", choices=("tests", "bench", "curves"), default=["tests", "bench", "curves"])
    parser.add_argument("--only", nargs="*", default=[], help="bench: only the groups whose name contains one of these "
                        f"({', '.join(BENCH_GROUPS)})")
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results.jsonl"))
    parser.add_argument("--budget", type=float, default=float("inf"), help="bench: seconds after which no setup starts")
    parser.add_argument("--curve-steps", type=int, default=200)
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    check_te_imports()
    ok = True
    if "tests" in args.phase:
        ok &= run_tests()
    if "bench" in args.phase:
        ok &= run_bench(args.only, args.out, args.budget)
    if "curves" in args.phase:
        ok &= run_curves(args.curve_steps)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
