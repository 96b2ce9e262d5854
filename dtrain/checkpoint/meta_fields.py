"""What each field of a checkpoint's meta.json must hold for a resume or an export to use it.

meta.json is as untrusted as the rest of a checkpoint: whoever can write it can also recompute the
checksum that COMPLETE keeps of it. Each field the readers take is checked here, so that one of
the wrong kind is one line naming it, never a traceback at whichever reader meets it first.

    problem = field_problem(json.loads(text))  # None, or what is wrong, as a phrase
"""

from __future__ import annotations

from typing import Any, Callable


def _whole(value: Any, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _strings_to(check: Callable[[Any], bool]) -> Callable[[Any], bool]:
    return lambda value: isinstance(value, dict) and all(isinstance(k, str) and check(v) for k, v in value.items())


def _file_entry(entry: Any) -> bool:
    return isinstance(entry, dict) and _whole(entry.get("size")) and isinstance(entry.get("crc32"), str)


def _scheduler(state: Any) -> bool:
    return state is None or (isinstance(state, dict) and _whole(state.get("last_epoch", 0), -1)
                             and _whole(state.get("_step_count", 0)))


def _skips(state: Any) -> bool:
    if state is None:
        return True
    if not isinstance(state, dict):
        return False
    steps, losses = state.get("skipped_steps", []), state.get("recent_losses", [])
    return (isinstance(steps, list) and all(_whole(s) for s in steps) and _whole(state.get("in_a_row", 0))
            and isinstance(losses, list) and all(_number(x) for x in losses))


# field -> (what it must be, its test); only the step and the model are always there (older formats
# and imports lack some of the others).
FIELDS: dict[str, tuple[str, Callable[[Any], bool]]] = {
    "step": ("a whole number >= 0", _whole),
    "model": ("an object of the model's settings", _strings_to(lambda _: True)),
    "files": ("an object of file names to their size and crc32", _strings_to(_file_entry)),
    "scheduler": ("null or the LR schedule's state, with a whole last_epoch", _scheduler),
    "consumed_samples": ("a whole number >= 0", _whole),
    "global_batch": ("a whole number >= 1", lambda v: _whole(v, 1)),
    "world_size": ("a whole number >= 1", lambda v: _whole(v, 1)),
    "mesh": ("a string", lambda v: isinstance(v, str)),
    "config": ("a string (the run's TOML)", lambda v: isinstance(v, str)),
    "skips": ("null or the skipped steps' record", _skips),
    "hf_config": ("null or an object (the imported config.json)", lambda v: v is None or isinstance(v, dict)),
    "hf_dtype": ("a string", lambda v: isinstance(v, str)),
}


def field_problem(meta: Any) -> str | None:
    """What makes `meta` (meta.json, parsed) unusable, as a phrase; None when the step and the
    model's shape are there and every field it holds is of its kind."""
    if not isinstance(meta, dict):
        return f"it holds a {type(meta).__name__}, not an object"
    missing = [name for name in ("step", "model") if name not in meta]
    if missing:
        return f"it has no {missing[0]}"
    for name, (kind, test) in FIELDS.items():
        if name in meta and not test(meta[name]):
            where, value = name, meta[name]
            if name == "files" and isinstance(value, dict):  # the entry at fault, not the whole list
                where, value = next((f"files entry {file!r}", entry) for file, entry in value.items()
                                    if not (isinstance(file, str) and _file_entry(entry)))
                kind = "an object of the file's size and crc32"
            shown = repr(value)
            return f"its {where} is {shown[:60] + '...' if len(shown) > 60 else shown}, not {kind}"
    return None
