"""A CPU run checks its hosts' memory against the memory model before it allocates its model: a
model too large for the host is one line that says what it needs and what the host has (a 70B
model allocated until the kernel's out-of-memory killer ended it, minutes later, without a word).
Nothing here allocates a large model: the hosts' readings are stated."""

from __future__ import annotations

from dtrain.config import load_config
from dtrain.layout import host_memory
from dtrain.layout.host_memory import GB, RankNeed
from dtrain.run import main
from tests.launch import TINY_ARGS
from tests.layouts import resolved


def test_available_memory_is_the_hosts_or_its_containers_limit_if_lower(tmp_path):
    proc, cgroup = tmp_path / "proc", tmp_path / "cgroup"
    proc.mkdir()
    (proc / "meminfo").write_text("MemTotal:       32000000 kB\nMemAvailable:   20000000 kB\n"
                                  "SwapFree:        1000000 kB\n")
    assert host_memory.available_bytes(proc, cgroup) == 21_000_000 * 1024
    (cgroup / "memory").mkdir(parents=True)  # cgroup v1: a limit of 8 GB, 3 GB of it used
    (cgroup / "memory" / "memory.limit_in_bytes").write_text("8000000000\n")
    (cgroup / "memory" / "memory.usage_in_bytes").write_text("3000000000\n")
    assert host_memory.available_bytes(proc, cgroup) == 5e9
    (cgroup / "memory.max").write_text("max\n")  # cgroup v2 without a limit: the host's
    (cgroup / "memory.current").write_text("1000\n")
    assert host_memory.available_bytes(proc, cgroup) == 21_000_000 * 1024
    assert host_memory.available_bytes(tmp_path / "none", tmp_path / "none") == float("inf")


def test_the_ranks_of_a_host_share_it_and_the_host_short_of_memory_is_named():
    config = load_config(["--model", "llama3-70b"])
    needs = [RankNeed("a", 10 * GB, 50 * GB), RankNeed("b", 30 * GB, 40 * GB), RankNeed("b", 30 * GB, 45 * GB),
             RankNeed("a", 10 * GB, 60 * GB)]
    problem = host_memory.host_memory_problem(config, needs)
    assert problem.startswith("--model llama3-70b needs 60.0 GB of host memory on b (2 processes: ") and \
        "but it has 40.0 GB available; choose a smaller --model" in problem and "--dry-run" in problem, problem
    assert host_memory.host_memory_problem(config, needs[:1] + needs[3:]) is None


def test_the_need_is_the_memory_models_and_grows_with_the_model():
    tiny, big = (resolved(["--model", name, "--precision", "fp32"]) for name in ("tiny", "llama3-70b"))
    small = host_memory.rank_need_bytes(tiny, 0)
    large = host_memory.rank_need_bytes(big, 0)
    assert 0 < small < 0.1 * GB
    # 70B fp32 weights with their gradients and AdamW's two moments are 16 bytes a parameter at least.
    assert large > 16 * 70e9


def test_a_cpu_run_too_large_for_its_host_stops_before_it_builds_the_model(tmp_path, capsys, monkeypatch):
    need = host_memory.rank_need_bytes(resolved([*TINY_ARGS, "--run-dir", str(tmp_path)]), 0)
    monkeypatch.setattr(host_memory, "available_bytes", lambda: need / 2)
    code = main([*TINY_ARGS, "--run-dir", str(tmp_path / "run")])
    err = capsys.readouterr().err.strip()
    assert code == 2 and err.startswith("dtrain: error: --model tiny needs ") and "\n" not in err, err
    assert f"needs {host_memory.readable(need)} of host memory" in err, err
    assert f"has {host_memory.readable(need / 2)} available" in err, err
    assert not (tmp_path / "run" / "tensorboard").exists()
    monkeypatch.setattr(host_memory, "available_bytes", lambda: need * 2)
    assert main([*TINY_ARGS, "--run-dir", str(tmp_path / "fits"), "--steps", "1"]) == 0
