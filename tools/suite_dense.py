"""The one-GPU dense setups that tools.bench_suite runs as the group `dense-one-gpu`: llama-1b,
a 3B shape at seq 8192 and eight llama3-8b layers on one H200 with their defaults, each beside
the plain PyTorch baseline (tools/baseline.py) of the same model, shape, batch and precision,
timed in the same process, within one short call:

    python -m tools.bench_suite --group dense-one-gpu --out $OUT/results.jsonl --budget 500

Most needed first, so that a call cut short by --budget has measured those:
- llama-1b with `--compile` and no other flag (the micro-batch its defaults choose), profiled
  (`{out_dir}` is the results file's folder: `profiles/llama-1b-defaults/` beside it), with the
  FP8 tensorwise run with the head in FP8 and the best bf16 flags (`--global-batch 32`: four
  micro-batches of the size chosen per step) after it;
- llama3.2-3b at seq 8192 and eight layers of llama3-8b at seq 4096, with their defaults;
- GQA attention alone with the KV heads as dtrain passes them and expanded to the query heads.

The group `dense-compile-options` measures llama-1b (FP8 with the head, and bf16) with inductor's
settings as they are, with kernels launched from C++ (cpp_wrapper) and with independent kernels
launched together (combo_kernels): the FP8 steps leave the GPU idle while the host launches.

The group `te-one-gpu` measures Transformer Engine beside torchao in one call (TE installed first),
each FP8 setup of llama-1b, blocks only and with the head; torchao and TE's delayed recipe each
run early and again later, so that an order effect shows; TE's delayed run is profiled, where
host-bound gaps show as idle time; and TE with --fuse-projections (four TE calls per block).
"""

from __future__ import annotations

STEPS = ["--steps", "12", "--warmup", "4"]
TE = ["--fp8-backend", "te", "--fp8"]
FP8_HEAD = ["--fp8", "tensorwise", "--fp8-head"]
BEST_BF16 = ["--global-batch", "32"]

# name -> (processes, tools.bench arguments)
SETUPS: dict[str, tuple[int, list[str]]] = {
    "llama-1b defaults": (1, ["--shape", "llama-1b-defaults", "--baseline", "--profile",
                              "{out_dir}/profiles/llama-1b-defaults", *STEPS, "--", "--compile"]),
    "llama-1b defaults fp8 head gb32": (1, ["--shape", "llama-1b-defaults", "--baseline", *STEPS, "--", "--compile",
                                            *FP8_HEAD, *BEST_BF16]),
    "llama-1b defaults gb32": (1, ["--shape", "llama-1b-defaults", "--baseline", *STEPS, "--", "--compile",
                                   *BEST_BF16]),
    "llama-3b defaults": (1, ["--shape", "llama-3b-defaults", "--baseline", *STEPS, "--", "--compile"]),
    "llama-8b-8l defaults": (1, ["--shape", "llama-8b-4k-defaults", "--baseline", *STEPS, "--", "--compile",
                                 "--model-overrides", "num_layers=8"]),
    "attention gqa layouts": (1, ["--attention", "gqa-llama-1b,gqa-llama-1b-expanded", "--compile", "--steps", "20"]),
    # Transformer Engine beside torchao, micro-batch 4 as the README's FP8 table (one call: TE installed).
    **{f"llama-1b te-check {name}": (1, ["--shape", "llama-1b", *STEPS, *profile, "--", "--compile", *flags])
       for name, flags, profile in (
           ("torchao", ["--fp8", "tensorwise"], []),
           ("te delayed", [*TE, "delayed"], ["--profile", "{out_dir}/profiles/llama-1b-te-delayed"]),
           ("torchao head", FP8_HEAD, []),
           ("te delayed head", [*TE, "delayed", "--fp8-head"], []),
           ("te delayed fused", [*TE, "delayed", "--fuse-projections"], []),
           ("te current", [*TE, "current"], []),
           ("te current head", [*TE, "current", "--fp8-head"], []),
           ("torchao again", ["--fp8", "tensorwise"], []),
           ("te delayed again", [*TE, "delayed"], []),
       )},
}

# Compiler settings that launch fewer kernels from Python (the host-bound gaps of FP8 steps):
# kernels launched from C++, independent kernels launched together; beside the settings as they are.
COMPILE_OPTIONS = {"as they are": [], "cpp-wrapper": ["--inductor", "cpp_wrapper=True"],
                   "combo-kernels": ["--inductor", "combo_kernels=True"]}
SETUPS.update({f"llama-1b compile {precision} {name}": (1, ["--shape", "llama-1b-defaults", *options, *STEPS, "--",
                                                            "--compile", *flags])
               for precision, flags in (("fp8 head", FP8_HEAD), ("bf16", []))
               for name, options in COMPILE_OPTIONS.items()})

GROUPS: dict[str, list[str]] = {
    "dense-one-gpu": ["llama-1b defaults", "llama-1b defaults fp8 head gb32", "llama-1b defaults gb32",
                      "llama-3b defaults", "llama-8b-8l defaults", "attention gqa layouts"],
    "te-one-gpu": [name for name in SETUPS if "te-check" in name],
    "dense-compile-options": [name for name in SETUPS if name.startswith("llama-1b compile ")],
}
