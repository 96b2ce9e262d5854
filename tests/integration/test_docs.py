"""README.md and docs/ as a newcomer runs them: every command block says where it runs, the cpu
blocks run as written (each page's in order, in a temporary directory) and print what the page
shows, the generated tables are what `python -m tools.docs --refresh` writes now, the commands
for GPUs and clusters take their flags, the install lines match pyproject.toml and CI, and every
link between pages and to files of the checkout resolves."""

from __future__ import annotations

import pytest

from tools import doc_blocks
from tests.unit.test_docs import PAGES, _page_id


@pytest.mark.parametrize("page", [p for p in PAGES if any(map(doc_blocks.runs_in_doc_test, doc_blocks.blocks(p)))],
                         ids=_page_id)
def test_the_cpu_blocks_of_a_page_run_and_print_what_it_shows(page, tmp_path):
    page_blocks = doc_blocks.blocks(page)
    doc_blocks.prepare(tmp_path)
    for block in page_blocks:
        if not doc_blocks.runs_in_doc_test(block):
            continue
        code, output = doc_blocks.run(block, tmp_path)
        assert code == int(block.options.get("exit", 0)), f"{block.where()} exited with {code}:\n{output}"
        shown = doc_blocks.output_block(page_blocks, block)
        if "output" in block.marks:
            assert shown is not None, f"{block.where()} says output, but no ```text block follows it"
            assert doc_blocks.masked(output) == doc_blocks.masked(shown.text), (
                f"{block.where()} prints other lines than the page shows: python -m tools.docs --refresh")
