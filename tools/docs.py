"""Writes every generated part of README.md and docs/ again, so that no figure or sample output in
them is typed by hand:

    python -m tools.docs --refresh              # everything below
    python -m tools.docs --refresh --no-outputs # the tables and the chart only (no runs: seconds)

- the benchmark tables, between their markers (tools/bench_tables.py), from benchmarks/*.jsonl;
- the headline table and docs/benchmarks.png (tools/bench_page.py);
- the planner's answers, between `<!-- python -m dtrain.planner ARGS -->` markers, by running each;
- the output shown under each cpu block marked `output`, by running the page's cpu blocks in
  order in a temporary directory (tools/doc_blocks.py).
"""

from __future__ import annotations

import argparse
import contextlib
import io
import re
import shlex
import sys
import tempfile
from pathlib import Path

from tools import bench_page, bench_tables, doc_blocks

RESULTS = doc_blocks.REPO / "benchmarks" / "results.jsonl"
_PLANNER_MARKER = re.compile(r"<!-- python -m dtrain\.planner (.*?) -->")


def refresh_tables(page: Path) -> list[str]:
    """The benchmark tables and the headline table that `page` has markers for; their kinds."""
    text = page.read_text()
    written = []
    for kind, (begin, _) in bench_tables.README_MARKERS.items():
        if begin in text:
            bench_tables.write_into_readme(page, kind, bench_tables.render(kind, RESULTS))
            written.append(kind)
    return written


def refresh_planner(page: Path) -> list[str]:
    """Each planner command whose marker `page` has, run and written under it."""
    from dtrain.planner import __main__ as planner_cli

    commands = _PLANNER_MARKER.findall(page.read_text())
    # Run from the checkout, so that the paths the markers name (benchmarks/...) resolve.
    with contextlib.chdir(doc_blocks.REPO):
        for args in commands:
            with contextlib.redirect_stdout(io.StringIO()):
                code = planner_cli.main([*shlex.split(args), "--readme", str(page.resolve())])
            if code:
                raise SystemExit(f"error: python -m dtrain.planner {args} (in {page}) failed")
    return commands


def refresh_outputs(page: Path) -> int:
    """Runs the page's cpu blocks in order and writes the output of each one marked `output`
    into the ```text block after it; the number written."""
    page_blocks = doc_blocks.blocks(page)
    outputs = {}
    with tempfile.TemporaryDirectory() as workdir:
        doc_blocks.prepare(Path(workdir))
        for block in page_blocks:
            if not doc_blocks.runs_in_doc_test(block):
                continue
            code, output = doc_blocks.run(block, Path(workdir))
            if code != int(block.options.get("exit", 0)):
                raise SystemExit(f"error: {block.where()} exited with {code}:\n{output}")
            shown = doc_blocks.output_block(page_blocks, block)
            if shown is not None:
                outputs[shown.line] = output.strip()
            elif "output" in block.marks:
                raise SystemExit(f"error: {block.where()} says output but no ```text block follows it")
    lines = page.read_text().splitlines()
    for line in sorted(outputs, reverse=True):  # from the end, so earlier line numbers hold
        end = next(j for j in range(line, len(lines)) if lines[j].startswith("```"))
        lines[line:end] = outputs[line].splitlines()
    page.write_text("\n".join(lines) + "\n")
    return len(outputs)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.docs", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--refresh", action="store_true", required=True,
                        help="write the generated parts of README.md and docs/*.md again")
    parser.add_argument("--no-outputs", action="store_true", help="leave the sample outputs of cpu blocks as they are")
    args = parser.parse_args(argv)
    print(bench_page.write_chart(RESULTS, doc_blocks.REPO / "docs" / bench_page.CHART))
    for page in doc_blocks.pages():
        done = refresh_tables(page) + refresh_planner(page)
        if not args.no_outputs:
            done += [f"{refresh_outputs(page)} outputs"]
        print(f"{page.relative_to(doc_blocks.REPO)}: {', '.join(done) or 'nothing generated'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
