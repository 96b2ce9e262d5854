"""The GPU check of Transformer Engine FP8 (`--fp8-backend te`) in one command, on a machine with
two GPUs and TE installed (`pip install -e '.[te]'`; a hand-built install sources its `.te/env.sh`,
which points TE at torch's cuDNN, before python starts):

    python -m tools.te_check                                  # all three phases
    python -m tools.te_check --phase bench --only llama-1b    # one phase, some setups

tests   python -m pytest -m gpu tests/integration/test_te_gpu.py
bench   per setup, bf16, torchao FP8 and TE FP8 one after another (tools.bench_suite setups, appended
        to --out); prints tok/s/GPU and TE's ratio to torchao's (the target: at least 1)
curves  --curve-steps steps of llama-1b on the bundled corpus in bf16 (twice, the same seed), torchao
        FP8 and TE delayed and current scaling (two runs at a time, one per GPU or both on one);
        records each curve in fp8_curves.json beside --out as it finishes, and prints 10-step mean
        losses against bf16's, and per curve its difference over the last 20 steps and its mean
        absolute per-step difference (the target: within 1%; the second bf16 run shows how far
        non-deterministic kernels alone take a curve); `python -m tools.bench --table
        benchmarks/results.jsonl --readme README.md` writes that table into the README

Each phase fits one 10-minute call except `bench` without --only: about 1.5 min per setup.
"""

from __future__ import annotations

import argparse
import datetime
import importlib.metadata
import os
import re
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from tools import bench_suite, fp8_tables
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
        raise SystemExit(f"error: Transformer Engine does not import ({last}); install it (pip install -e '.[te]') "
                         f"and, for a hand-built install, source .te/env.sh first")


def run_tests() -> bool:
    print("== tests: python -m pytest -m gpu tests/integration/test_te_gpu.py", flush=True)
    return subprocess.run([sys.executable, "-m", "pytest", "-m", "gpu", "-q", "tests/integration/test_te_gpu.py"]).returncode == 0


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


def run_curves(steps: int, out: Path) -> bool:
    print(f"== curves: {steps} steps of llama-1b on the bundled corpus, recorded in {out}", flush=True)
    import torch

    from tools.commit import commit_hash

    about = {"curves": list(CURVES), "args": [*CURVE_ARGS, "--steps", str(steps)], "commit": commit_hash(),
             "date": datetime.date.today().isoformat(), "device": torch.cuda.get_device_name(),
             "torch": torch.__version__, "te": _te_version()}
    out.unlink(missing_ok=True)  # one session's curves, recorded one by one as they finish
    gpus = max(1, torch.cuda.device_count())  # two runs at a time, sharing a GPU where there is one

    def curve(item: tuple[int, str]) -> int:
        name, run_dir, code = _curve(item[1], steps, item[0] % gpus)
        if code == 0:
            fp8_tables.record_curves(out, name, read_scalars(run_dir)["train/loss"], about)
        return code

    with ThreadPoolExecutor(max_workers=2) as pool:
        codes = list(pool.map(curve, enumerate(CURVES)))
    if any(code != 0 for code in codes):
        return False
    print(fp8_tables.curves_table(out))
    return True


def _te_version() -> str:
    try:
        return f"TE {importlib.metadata.version('transformer_engine')}"
    except importlib.metadata.PackageNotFoundError:
        return "TE (version unknown)"


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
        ok &= run_curves(args.curve_steps, args.out.parent / fp8_tables.CURVES_FILE)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
