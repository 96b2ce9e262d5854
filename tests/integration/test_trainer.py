"""The training loop reads a step's loss back only after queuing the next step: the scalars,
evaluations and checkpoints must be those of reading every step back at once."""

from __future__ import annotations

from tests.unit.test_trainer import _fit


def test_deferred_read_back_logs_evaluates_and_saves_like_reading_at_once(tmp_path, indexed_corpus):
    at_once = _fit(tmp_path / "at_once", indexed_corpus, overlap=False)
    deferred = _fit(tmp_path / "deferred", indexed_corpus, overlap=True)
    assert len(deferred) == len(at_once) == 10
    for step, (a, b) in enumerate(zip(at_once, deferred), start=1):
        assert b["train/loss"] == a["train/loss"] and b["train/grad_norm"] == a["train/grad_norm"], step
        assert ("val/loss" in b) == ("val/loss" in a) == (step % 4 == 0 or step == 10), step
        if "val/loss" in a:
            assert b["val/loss"] == a["val/loss"]
    for name in ("at_once", "deferred"):
        saved = sorted(p.name for p in (tmp_path / name / "checkpoints").iterdir())
        assert saved == ["step_000003", "step_000006", "step_000009", "step_000010"], saved
