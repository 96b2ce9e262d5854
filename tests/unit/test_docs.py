"""README.md and docs/ as a newcomer runs them: every command block says where it runs, the cpu
blocks run as written (each page's in order, in a temporary directory) and print what the page
shows, the generated tables are what `python -m tools.docs --refresh` writes now, the commands
for GPUs and clusters take their flags, the install lines match pyproject.toml and CI, and every
link between pages and to files of the checkout resolves."""

from __future__ import annotations

import re
import shlex
import tomllib
from pathlib import Path

import pytest

from tools import bench_page, bench_tables, doc_blocks
from tools.doc_blocks import REPO


PAGES = doc_blocks.pages()


RESULTS = REPO / "benchmarks" / "results.jsonl"


def _page_id(page: Path) -> str:
    return str(page.relative_to(REPO))


def _all_blocks() -> list[doc_blocks.Block]:
    return [b for page in PAGES for b in doc_blocks.blocks(page)]


def test_every_command_block_says_where_it_runs():
    unmarked = [b.where() for b in _all_blocks()
                if (b.language in doc_blocks.COMMAND_LANGUAGES and b.place is None) or not b.language]
    assert not unmarked, f"blocks without one of {doc_blocks.PLACES} (or without a language): {unmarked}"


def test_the_readme_fits_a_short_read():
    assert len((REPO / "README.md").read_text().splitlines()) <= 200


def test_ci_runs_the_readmes_install_and_test_commands():
    readme = doc_blocks.blocks(REPO / "README.md")
    ci = (REPO / ".ci" / "run").read_text()
    tests = [b for b in readme if "ci" in b.marks]
    assert len(tests) == 1 and tests[0].place == "cpu"
    for command in doc_blocks.one_line_commands(tests[0].text):
        assert command in ci, command
    laptop = [b for b in readme if b.place == "install" and "download.pytorch.org/whl/cpu" in b.text]
    assert laptop, "the README installs the CPU build of torch first"
    for command in doc_blocks.one_line_commands(laptop[0].text):
        assert command.replace("pip install", "python -m pip install -q") in ci, command


def test_install_lines_name_the_torch_and_extras_that_pyproject_has():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    torch_floor = next(d for d in project["dependencies"] if d.startswith("torch"))
    for block in _all_blocks():
        if block.place != "install":
            continue
        for extra_list in re.findall(r"\.\[([\w,]+)\]", block.text):
            assert set(extra_list.split(",")) <= extras, (block.where(), extra_list)
        for version in re.findall(r"torch==([\d.]+)", block.text):
            floor = torch_floor.split(">=")[1]
            assert tuple(map(int, version.split("."))) >= tuple(map(int, floor.split("."))), (block.where(), version)


def _dtrain_run_argv(command: str) -> list[str] | None:
    """The dtrain.run flags of a command line, or None where it runs something else or elides."""
    if "-m dtrain.run" not in command or "..." in command:
        return None
    words = shlex.split(command.split("|")[0])
    return words[words.index("dtrain.run") + 1:]


def test_gpu_and_cluster_commands_take_their_flags():
    from dtrain.config import load_config

    checked = 0
    for block in _all_blocks():
        if block.place not in ("gpu", "cluster"):
            continue
        for command in doc_blocks.one_line_commands(block.text):
            argv = _dtrain_run_argv(command)
            if argv is not None:
                load_config(argv)  # an unknown flag or value exits with argparse's message
                checked += 1
    assert checked >= 10


def test_generated_tables_are_what_the_benchmark_files_give():
    for page in PAGES:
        text = page.read_text()
        for kind, (begin, end) in bench_tables.README_MARKERS.items():
            if begin in text:
                shown = text.split(begin, 1)[1].split(end, 1)[0].strip()
                assert shown == bench_tables.render(kind, RESULTS), (
                    f"{_page_id(page)}: the {kind} table is stale: python -m tools.docs --refresh --no-outputs")


def test_the_benchmarks_page_has_the_headline_and_its_chart():
    text = (REPO / "docs" / "benchmarks.md").read_text()
    assert bench_tables.README_MARKERS["headline"][0] in text and f"({bench_page.CHART})" in text
    assert (REPO / "docs" / bench_page.CHART).stat().st_size > 0
    assert len(bench_page.headline_rows(RESULTS)) <= bench_page.MAX_ROWS


def test_the_chart_is_drawn_from_the_results(tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / bench_page.CHART
    bench_page.write_chart(RESULTS, out)
    assert out.read_bytes().startswith(b"\x89PNG")


def _anchors(page: Path) -> set[str]:
    """GitHub's anchors of a page's headings."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", page.read_text(), flags=re.S), flags=re.M)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


def test_links_between_pages_and_to_files_resolve():
    broken = []
    for page in PAGES:
        text = re.sub(r"```.*?```", "", page.read_text(), flags=re.S)
        for target in doc_blocks.LINK.findall(text):
            if re.match(r"[a-z]+:", target):
                continue  # a web address
            path, _, anchor = target.partition("#")
            resolved = (page.parent / path).resolve() if path else page
            if not resolved.exists():
                broken.append(f"{_page_id(page)}: {target}")
            elif anchor and resolved.suffix == ".md" and anchor not in _anchors(resolved):
                broken.append(f"{_page_id(page)}: {target} (no such heading)")
    assert not broken, broken


def test_every_docs_page_is_linked_from_the_readme():
    readme = (REPO / "README.md").read_text()
    unlinked = [p.name for p in PAGES[1:] if f"docs/{p.name}" not in readme]
    assert not unlinked, unlinked
