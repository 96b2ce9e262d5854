"""How `python -m dtrain.run`'s flags read: `--help` in sections by task (the TOML tables stay the
config's groups), a mistyped flag answered in one line with the flag it was close to,
`--list-models`, and the launch flags that start the ranks of one machine."""

from __future__ import annotations

import argparse
import difflib

from models.errors import UserError

# `python -m dtrain.run`'s own flags, read by dtrain.launch.local before the training config
# (which never holds them): flag -> (metavar, help).
LAUNCH_FLAGS = {
    "--nproc-per-node": ("N", "start N ranks on this machine and watch them: a failed run ends in one line "
                              "(torchrun --nproc_per_node N -m dtrain.run works too, with torchrun's own report)"),
    "--max-restarts": ("R", "with --nproc-per-node: times every rank starts again after one fails (with --resume "
                            "auto, from the latest checkpoint); default 0"),
}
LAUNCH_SECTION = "launch (the ranks of one machine)"

# --help's sections in order; a field is in its config group's section (`DEFAULT_SECTION`) unless
# listed here.
SECTIONS = {
    "model": ("model", "model_overrides", "init_from_hf"),
    "training": ("steps", "seed", "compile", "recompute", "recompute_layers", "attention_kernel",
                 "fuse_projections", "loss_chunk_tokens"),
    LAUNCH_SECTION: (),
    "parallel": (),
    "precision": ("precision", "fp8", "fp8_backend", "fp8_amax_history", "fp8_keep_ends", "fp8_head",
                  "fp8_experts", "fp8_all_gather"),
    "data": (),
    "checkpoint": ("checkpoint_every", "final_checkpoint", "keep_last", "async_checkpoint", "resume", "start_over",
                   "overwrite"),
    "resilience": ("init_timeout", "step_timeout", "straggler_every", "max_skipped_steps", "skip_spikes",
                   "spike_window"),
    "logging": ("run_dir", "log_every", "eval_every", "eval_steps"),
    "planning (print, dry-run, list; no training)": ("print_plan", "json", "dry_run", "dry_run_rank", "world_size",
                                                     "gpu_memory_gb"),
}
DEFAULT_SECTION = {"model": "model", "parallel": "parallel", "data": "data", "optim": "training",
                   "train": "training"}


def section_of(group_name: str, field_name: str) -> str:
    for section, names in SECTIONS.items():
        if field_name in names:
            return section
    return DEFAULT_SECTION[group_name]


class Parser(argparse.ArgumentParser):
    """A flag it cannot parse is a one-line UserError (with the closest flag for a typo), not the
    whole usage."""

    def error(self, message: str):
        unknown = message.split("unrecognized arguments: ", 1)
        if len(unknown) == 2:
            flags = [word.split("=", 1)[0] for word in unknown[1].split() if word.startswith("-")]
            known = [option for action in self._actions for option in action.option_strings]
            for flag in flags:
                close = difflib.get_close_matches(flag, known, n=1, cutoff=0.6)
                if close:
                    raise UserError(f"unknown flag {flag}: did you mean {close[0]}? (python -m dtrain.run --help "
                                    f"lists the flags)")
            message = f"unknown {'flag' if len(flags) == 1 else 'flags'} {' '.join(flags) or unknown[1]}"
        raise UserError(f"{message} (python -m dtrain.run --help lists the flags)")


class ListModels(argparse.Action):
    """`--list-models`: prints every preset (name, family, parameters) and exits."""

    def __init__(self, option_strings, dest, **kwargs):
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the model presets (name, family, parameters) and exit")

    def __call__(self, parser, namespace, values, option_string=None):
        print(presets_table())
        parser.exit()


def presets_table() -> str:
    from dtrain.interop.hf import family_of_config
    from models import families, flops, spec
    from models.presets import PRESETS

    rows = [("model", "family", "parameters", "active")]
    for name, cfg in PRESETS.items():
        family = family_of_config(cfg)
        total, active = spec.count_params(families.layers(cfg)), flops.active_params(cfg)
        rows.append((name, family.title if family else type(cfg).__name__, _count(total),
                     _count(active) if active != total else "all"))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(cell.ljust(w) if i < 2 else cell.rjust(w) for i, (cell, w) in
                               enumerate(zip(row, widths))).rstrip() for row in rows)


def _count(n: int) -> str:
    return f"{n / 1e9:.1f}B" if n >= 1e9 else f"{n / 1e6:.1f}M" if n >= 1e6 else f"{n / 1e3:.0f}K"


def wants_help(argv: list[str]) -> bool:
    return "-h" in argv or "--help" in argv or "--list-models" in argv
