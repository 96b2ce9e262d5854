"""Hugging Face files as a hostile source would hand them over: import and export never delete
what they did not write, an export replaces only its own earlier export, an index cannot name
files outside its directory, and a tensor or config.json that is not what a model needs is a
one-line error naming it, before anything is written."""

from __future__ import annotations

from tools import hf_convert
from tests.unit.test_hf_inputs import _tree, _refused
from tests.unit.test_hf_inputs import hf_dir  # noqa: F401  (a fixture of these tests)


def test_import_into_a_run_directory_is_refused_and_deletes_nothing(hf_dir, tmp_path, capsys):
    run = tmp_path / "run"
    hf_convert.import_hf(hf_dir, run / "checkpoints" / "step_000000")
    (run / "train.log").write_text("step 1 | loss 4.1\n")
    (run / "events.out.tfevents.1.host").write_bytes(b"\x00tb")
    (run / "notes.txt").write_text("keep me")
    before = _tree(run)
    # Its step_000000 is taken: the suggestion is a new run's.
    _refused(["import", str(hf_dir), str(run)], capsys, f"{run} is a run directory",
             f"such as {tmp_path / 'run-imported' / 'checkpoints' / 'step_000000'}")
    assert _tree(run) == before
    # Any other directory with files in it is not the import's to replace either.
    other = tmp_path / "other"
    other.mkdir()
    (other / "mine.txt").write_text("keep me")
    _refused(["import", str(hf_dir), str(other)], capsys, f"{other} is not empty", "mine.txt")
    assert _tree(other) == {"mine.txt": b"keep me"}
