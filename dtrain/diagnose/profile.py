"""`--profile`: where a profiled step's time went, as shares of the step, from either

- the summary `python -m tools.bench --profile DIR` writes (DIR/profile_rank0.json, or DIR), or
- a trace torch.profiler exported (`prof.export_chrome_trace(PATH)`, or TensorBoard's trace
  handler's `*.pt.trace.json`), classified as dtrain/diagnose/breakdown.py classifies a live profile.
"""

from __future__ import annotations

import json
from pathlib import Path

from models.errors import UserError

SUMMARY = "profile_rank0.json"


def load_profile(path: Path) -> dict[str, float]:
    """Each category's share of the profiled wall time (idle included), largest first."""
    path = Path(path)
    if path.is_dir():
        path = path / SUMMARY
    if not path.is_file():
        raise UserError(f"--profile {path}: no such file; pass a profile_rank<r>.json of python -m tools.bench "
                        f"--profile DIR (or DIR), or a trace exported by torch.profiler")
    try:
        data = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise UserError(f"--profile {path} is not JSON ({error}): pass a profile summary or a Chrome trace") from None
    if isinstance(data, dict) and "ms" in data and data.get("step_ms"):
        shares = {name: ms / data["step_ms"] for name, ms in data["ms"].items()}
        shares["idle"] = data.get("idle_ms", 0.0) / data["step_ms"]
    elif isinstance(data, dict) and "traceEvents" in data:
        shares = _trace_shares(data)
    else:
        raise UserError(f"--profile {path} is neither a python -m tools.bench --profile summary nor a Chrome trace")
    return dict(sorted(shares.items(), key=lambda item: -item[1]))


def _trace_shares(trace: dict) -> dict[str, float]:
    from dtrain.diagnose import breakdown as profile_breakdown

    result = profile_breakdown.breakdown(profile_breakdown.trace_activities(trace), steps=1)
    if not result.wall_us:
        raise UserError("--profile: the trace holds no kernel and no CPU op")
    shares = {name: us / result.wall_us for name, us in result.exclusive_us.items()}
    shares["idle"] = result.idle_us / result.wall_us
    return shares
