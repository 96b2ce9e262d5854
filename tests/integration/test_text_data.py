"""A text file as --data: tokenized once, in pieces that keep the tokens of the whole text, into an
indexed dataset in the data cache that every rank reads (one process builds it while the others
wait), keyed by the file and the tokenizer, in bounded memory; the run logs what it trains on."""

from __future__ import annotations

import json
import multiprocessing
import socket
import subprocess
import sys

import pytest

from dtrain.data import text as text_data
from tests.launch import REPO, cli_env, train_scalars
from tests.unit.test_text_data import CORPUS, text_file, text_dataset, cache_entries, _cache_name


def _open_in_child(path: str, cache: str, queue) -> None:
    text_dataset(path, cache)
    queue.put(dict(text_data.stats))


def test_concurrent_processes_tokenize_once(tmp_path):
    path, cache = text_file(tmp_path, CORPUS[:500_000]), tmp_path / "cache"
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    children = [context.Process(target=_open_in_child, args=(str(path), str(cache), queue)) for _ in range(2)]
    for child in children:
        child.start()
    results = [queue.get(timeout=240) for _ in children]
    for child in children:
        child.join(timeout=60)
        assert child.exitcode == 0
    assert sorted(r["built"] for r in results) == [0, 1], results
    assert not [name for name in cache_entries(cache) if name.endswith((".lock", ".tmp"))]


def test_what_a_killed_build_left_is_removed_by_the_build_that_takes_over(tmp_path):
    """A build killed (kill -9) midway leaves its lock and its half-written temporaries; the
    process that takes the lock over removes them, and only them."""
    path, cache = text_file(tmp_path), tmp_path / "cache"
    name = _cache_name(path, cache)
    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    with subprocess.Popen(["sleep", "60"]) as live:
        (cache / f"{name}.lock").write_text(f"{socket.gethostname()} {dead}\n")
        left = [cache / f"{name}.bin.{dead}.0123abcd.tmp", cache / f"{name}.idx.{dead}.4567cdef.tmp"]
        for temporary in left:
            temporary.write_bytes(b"half a build")
        others = cache / f"{name}.bin.{live.pid}.89abcdef.tmp"  # a live process's: not ours to remove
        others.write_bytes(b"being written")
        text_dataset(path, cache)
        live.kill()
    assert cache_entries(cache) == sorted([f"{name}.bin", f"{name}.idx", f"{name}.json", others.name])


MEMORY_PROBE = """
import resource, sys
from dtrain.data import TokenDataset
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
TokenDataset(sys.argv[1], None, 64, 4096, 0, cache_dir=sys.argv[2])
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


def test_tokenizing_a_text_file_takes_bounded_memory(tmp_path):
    path = text_file(tmp_path, CORPUS * 2)  # 1.9 MB: tokenized whole, it took 190 MB per MB of text
    result = subprocess.run([sys.executable, "-c", MEMORY_PROBE, str(path), str(tmp_path / "cache")], cwd=REPO,
                            env=cli_env(), capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-3000:]
    grown_mb = int(result.stdout.strip().splitlines()[-1])
    assert grown_mb < 100, f"tokenizing {path.stat().st_size / 1e6:.1f} MB of text grew the process by {grown_mb} MB"


@pytest.mark.slow
def test_two_ranks_train_on_one_cache_and_the_run_logs_its_data(tmp_path):
    (tmp_path / "data").mkdir()
    path = text_file(tmp_path / "data", CORPUS[:400_000])
    run = tmp_path / "run"
    scalars = train_scalars(run, ["--data", str(path), "--steps", "2"], nproc=2)
    assert len(scalars["train/loss"]) == 2
    cache = path.parent / "dtrain_index_cache"
    assert [name.rsplit(".", 1)[-1] for name in cache_entries(cache)] == ["bin", "idx", "json"]
    description = json.loads(next(cache.glob("*.json")).read_text())
    log = (run / "train.log").read_text()
    lines = [line for line in log.splitlines() if "data: " in line]
    assert len(lines) == 1, log
    assert f"{path}: {description['tokens']:,} tokens" in lines[0] and "documents" in lines[0], lines[0]
