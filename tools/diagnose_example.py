"""The examples of docs/troubleshooting.md, made by running them:

    python -m tools.diagnose_example cpu [--readme docs/troubleshooting.md]
    python -m tools.diagnose_example gpu [--steps 20] [--readme docs/troubleshooting.md]
    python -m tools.diagnose_example thresholds [--readme docs/troubleshooting.md]

`cpu` trains the tiny model for 14 steps at micro-batch 2 with a NaN (step 5) and
a loss spike (step 12) planted (DTRAIN_FAULT), and prints what `python -m dtrain.diagnose` says of it.

`gpu` (one GPU) trains llama-1b at a poor layout (micro-batch 1 of 8, --recompute full), diagnoses
it, applies diagnose's top suggestion, trains again, and prints the gain the planner predicted
beside the gain measured (each run's median tokens/s/GPU after its first steps), and whether they
agree within 15%.

`thresholds` prints the table of what diagnose names and from what size on (its constants).

With --readme each writes its output into the page between its markers (`<!-- python -m
tools.diagnose_example cpu -->` ... `<!-- end of python -m tools.diagnose_example -->`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from dtrain.planner.report import write_into_readme
from dtrain.resilience.faults import ENV as FAULT_ENV

END_MARKER = "<!-- end of python -m tools.diagnose_example -->"
REPO = Path(__file__).resolve().parent.parent

CPU_ARGS = ["--model", "tiny", "--seed", "0", "--precision", "fp32", "--seq-len", "64", "--global-batch", "8",
            "--micro-batch", "2", "--lr", "1e-3", "--warmup-steps", "2", "--steps", "14"]
CPU_FAULTS = "nan@step5,spike@step12"
CPU_RUN_DIR = "runs/diagnose-cpu"  # as the page shows it

GPU_ARGS = ["--model", "llama-1b", "--seq-len", "4096", "--global-batch", "8", "--micro-batch", "1",
            "--recompute", "full", "--compile", "--data", "synthetic", "--lr", "3e-4", "--warmup-steps", "5",
            "--no-final-checkpoint"]  # two 1B checkpoints would only fill the disk
# The bar the GPU example is held to: the gain measured within this much of the gain predicted.
AGREEMENT = 0.15


def cpu_text(run_dir: Path) -> str:
    """The commands and diagnose's output of the CPU example trained into `run_dir`, which is
    shown as CPU_RUN_DIR."""
    from dtrain.diagnose.__main__ import diagnose
    from dtrain.diagnose.record import load

    text = diagnose(load(run_dir)).text().replace(str(run_dir), CPU_RUN_DIR)
    return (f"$ {FAULT_ENV}={CPU_FAULTS} python -m dtrain.run {' '.join(CPU_ARGS)} --run-dir {CPU_RUN_DIR}\n"
            f"$ python -m dtrain.diagnose {CPU_RUN_DIR}\n{text}")


def _train(args: list[str], run_dir: Path, env: dict[str, str] | None = None, check: bool = True) -> bool:
    """Trains into `run_dir` (its console output in RUN_DIR.log beside it); whether it succeeded."""
    command = [sys.executable, "-m", "dtrain.run", *args, "--run-dir", str(run_dir)]
    result = subprocess.run(command, cwd=REPO, capture_output=True, text=True, env={**os.environ, **(env or {})})
    (run_dir.parent / f"{run_dir.name}.log").write_text(result.stdout + result.stderr)
    if result.returncode != 0 and check:
        raise SystemExit(f"error: {' '.join(command)} failed ({result.returncode}):\n{result.stderr[-3000:]}")
    return result.returncode == 0


def _diagnose(run_dir: Path) -> tuple[str, dict]:
    """diagnose's text and JSON, each from its own process (this one keeps off the GPU)."""
    outputs = []
    for extra in ([], ["--json"]):
        result = subprocess.run([sys.executable, "-m", "dtrain.diagnose", str(run_dir), *extra], cwd=REPO,
                                capture_output=True, text=True)
        if result.returncode != 0:
            raise SystemExit(f"error: python -m dtrain.diagnose {run_dir} failed:\n{result.stderr[-3000:]}")
        outputs.append(result.stdout.strip())
    return outputs[0], json.loads(outputs[1])


def gpu_example(work_dir: Path, steps: int) -> tuple[str, bool]:
    """The poor layout, diagnosed; its top suggestion applied; predicted against measured. Returns
    the text and whether the gain measured is within AGREEMENT of the gain predicted."""
    poor, applied = work_dir / "poor", work_dir / "applied"
    args = [*GPU_ARGS, "--steps", str(steps)]
    _train(args, poor)
    text, found = _diagnose(poor)
    lines = [f"$ python -m dtrain.run {' '.join(args)} --run-dir runs/poor", "$ python -m dtrain.diagnose runs/poor",
             text.replace(str(poor), "runs/poor")]
    suggestions = found["speed"].get("suggestions", [])
    if not suggestions:
        return "\n".join(lines + ["diagnose suggests no faster layout: nothing to apply"]), False
    top = suggestions[0]
    lines.append(f"$ python -m dtrain.run {' '.join(args)} {top['flags']} --run-dir runs/applied   # the top suggestion")
    if not _train([*args, *top["flags"].split()], applied, check=False):
        failed, _ = _diagnose(applied)
        return "\n".join(lines + ["the run with the top suggestion failed:", failed.replace(str(applied), "runs/applied")]), False
    _, after = _diagnose(applied)
    predicted = (found["speed"]["predicted"]["tokens_per_sec_per_gpu"], top["tokens_per_sec_per_gpu"])
    measured = (found["speed"]["measured_tokens_per_sec_per_gpu"], after["speed"]["measured_tokens_per_sec_per_gpu"])
    predicted_gain, measured_gain = predicted[1] / predicted[0], measured[1] / measured[0]
    agrees = abs(measured_gain / predicted_gain - 1) <= AGREEMENT
    lines += [
        f"predicted on {found['speed']['predicted']['gpu']}: {predicted[0]:,.0f} -> {predicted[1]:,.0f} "
        f"tokens/s/GPU ({predicted_gain - 1:+.0%})",
        f"measured:  {measured[0]:,.0f} -> {measured[1]:,.0f} tokens/s/GPU ({measured_gain - 1:+.0%}): the gain is "
        f"{100 * measured_gain / predicted_gain:.0f}% of the predicted one, "
        f"{'within' if agrees else 'outside'} {100 * AGREEMENT:.0f}%",
    ]
    return "\n".join(lines), agrees


def thresholds_table() -> str:
    """What diagnose names, and from what size on, from its constants (markdown)."""
    from dtrain.diagnose import loss, memory, speed
    from dtrain.diagnose.record import WARMUP_STEPS
    from dtrain.resilience.stragglers import RATIO_WARN

    rows = [
        ("slower_than_predicted", f"a GPU run's median tokens/s below {speed.SLOWER_THAN_PREDICTED:g} x the planner's "
                                  f"prediction for its layout (never on a CPU run)"),
        ("slow_data", f"the step waits for its batches {100 * speed.DATA_SHARE:g}% of its time or more"),
        ("layout", f"a neighbouring layout predicted {100 * speed.MIN_GAIN:g}% faster or more that fits"),
        ("near_limit", f"a GPU's peak allocated memory above {100 * memory.NEAR_LIMIT:g}% of the GPU's"),
        ("out_of_memory", "a rank's failure record is CUDA's out-of-memory error"),
        ("nan", "a step whose loss or gradient norm is NaN or infinite"),
        ("spike", f"a loss above {loss.SPIKE_RATIO:g} x the median of the last {loss.SPIKE_WINDOW} updated steps "
                  f"(once there are {loss.MIN_HISTORY})"),
        ("rising", f"after warm-up (at least {loss.TREND_STEPS} updated steps), the last quarter's median loss "
                   f"above {loss.RISING:g} x the first quarter's"),
        ("flat", f"after warm-up, the last quarter's median loss less than {100 * loss.FLAT:g}% below the first "
                 f"quarter's, and above {loss.FLAT_NEAR_START:g} x the first step's loss"),
        ("lr_schedule", "the run ends inside its warm-up; the LR rises after warm-up; the LR is 0 before the end"),
        ("straggler", f"a rank above {RATIO_WARN:g} x its stage's median forward time in half of the straggler "
                      f"checks (and two)"),
        ("hang, failure, lost", "a rank's failure record: the watchdog's hang report, another error, a lost peer"),
    ]
    lines = ["| finding | named when |", "|---|---|", *(f"| `{kind}` | {when} |" for kind, when in rows)]
    lines += ["", f"The gradient norm grew before a NaN or a spike when the largest of the {loss.GROWTH_STEPS} norms "
                  f"before it is {loss.GROWTH_RATIO:g} x the median of those before. Speed figures are medians over "
                  f"the steps after the first {WARMUP_STEPS} of each start (compilation, autotuning)."]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.diagnose_example", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("example", choices=("cpu", "gpu", "thresholds"))
    parser.add_argument("--steps", type=int, default=20, help="gpu: steps of each run")
    parser.add_argument("--readme", type=Path, help="also write the output into this page, between its markers")
    parser.add_argument("--work-dir", type=Path, help="where the runs go (default: a temporary directory)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    with tempfile.TemporaryDirectory() as scratch:
        work_dir = args.work_dir or Path(scratch)
        work_dir.mkdir(parents=True, exist_ok=True)
        if args.example == "thresholds":
            text, ok = thresholds_table(), True
        elif args.example == "cpu":
            _train(CPU_ARGS, work_dir / "cpu", env={FAULT_ENV: CPU_FAULTS})
            text, ok = cpu_text(work_dir / "cpu"), True
        else:
            import torch

            if not torch.cuda.is_available():
                parser.error("the gpu example needs a CUDA GPU")
            text, ok = gpu_example(work_dir, args.steps)
    print(text)
    if args.readme:
        write_into_readme(args.readme, f"python -m tools.diagnose_example {args.example}", text, END_MARKER)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
