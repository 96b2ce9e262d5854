"""The command blocks of README.md and docs/*.md, and how to run them.

Every fenced block of commands or code names where it can run in its info string, after the
language:

    ```bash cpu                 runs on a CPU: the doc test runs it (tests/unit/test_docs.py)
    ```bash gpu                 needs GPUs
    ```bash cluster             needs several nodes or a scheduler
    ```bash install             changes the Python environment (checked against pyproject.toml)

and a cpu block may say more, as `key=value` words (shell quoting):

    steps=N        the doc test gives every `dtrain.run` of the block `--steps N` (a block that
                   shows a long run stays cheap to test)
    exit=N         the block's last command is meant to fail with this exit status
    file=NAME      the block is a file's text (a Python script the next blocks run), not commands
    test="CMD"     the doc test runs CMD instead (a server such as TensorBoard, which would not stop)
    ci             the block is the test suite, which CI runs (.ci/run); the doc test checks that
                   CI runs it as written rather than running it again
    output         the ```text block right after it is this block's output, written by
                   `python -m tools.docs --refresh` and checked by the doc test, digits aside

The cpu blocks of one page run in order in one temporary directory that holds links to the
checkout's top-level files, so that `tools/...` and `benchmarks/...` resolve as in a checkout and
what a block writes (`runs/...`) stays in the temporary directory.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import attrs

REPO = Path(__file__).resolve().parent.parent
PLACES = ("cpu", "gpu", "cluster", "install")
COMMAND_LANGUAGES = ("bash", "sh", "shell", "console", "python")
_FENCE = re.compile(r"^```(\S*)(.*)$")
# A link in markdown: [text](target), the target without a title.
LINK = re.compile(r"\[[^\]]*\]\(([^)\s]+)\)")


@attrs.frozen
class Block:
    page: Path
    line: int                   # of the opening fence, from 1
    language: str
    marks: frozenset[str]
    options: dict
    text: str

    @property
    def place(self) -> str | None:
        places = self.marks & set(PLACES)
        return next(iter(places)) if len(places) == 1 else None

    def where(self) -> str:
        return f"{self.page.relative_to(REPO) if self.page.is_relative_to(REPO) else self.page}:{self.line}"


def pages() -> list[Path]:
    """README.md and every page of docs/."""
    return [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]


def blocks(page: Path) -> list[Block]:
    found, lines = [], page.read_text().splitlines()
    i = 0
    while i < len(lines):
        match = _FENCE.match(lines[i])
        if not match:
            i += 1
            continue
        words = shlex.split(match.group(2))
        end = next((j for j in range(i + 1, len(lines)) if lines[j].startswith("```")), len(lines))
        found.append(Block(page, i + 1, match.group(1), frozenset(w for w in words if "=" not in w),
                           dict(w.split("=", 1) for w in words if "=" in w), "\n".join(lines[i + 1:end])))
        i = end + 1
    return found


def one_line_commands(text: str) -> list[str]:
    """The block's commands, each with its continuation lines joined, comments dropped."""
    joined = re.sub(r"\\\n\s*", "", text)
    commands = []
    for line in joined.splitlines():
        line = re.sub(r"(^|\s)#.*$", "", line).strip()
        if line:
            commands.append(line)
    return commands


def runs_in_doc_test(block: Block) -> bool:
    return block.place == "cpu" and "ci" not in block.marks


def test_script(block: Block) -> str:
    """What the doc test runs for a cpu block of commands."""
    if "test" in block.options:
        return block.options["test"]
    commands = one_line_commands(block.text)
    if "steps" in block.options:
        commands = [f"{c} --steps {block.options['steps']}" if "-m dtrain.run" in c else c for c in commands]
    return "\n".join(commands)


def prepare(workdir: Path) -> None:
    """A directory in which a page's blocks run: links to the checkout's top-level files."""
    workdir.mkdir(parents=True, exist_ok=True)
    for entry in REPO.iterdir():
        if entry.name not in (".git", "runs", ".venv") and not (workdir / entry.name).exists():
            (workdir / entry.name).symlink_to(entry)


def environment() -> dict:
    """This interpreter's `python` and `torchrun` first on the PATH, the checkout's packages first
    on the import path, and one thread per process (two processes share a small CI machine)."""
    env = dict(os.environ)
    env["PATH"] = f"{Path(sys.executable).parent}{os.pathsep}{env.get('PATH', '')}"
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), *filter(None, [env.get("PYTHONPATH")])])
    env["OMP_NUM_THREADS"] = "1"
    # FSDP2's warning about a view returned by a wrapped module prints the interpreter's install
    # path, which differs per machine; a page's output would never match elsewhere.
    env["PYTHONWARNINGS"] = "ignore::UserWarning:torch.distributed.fsdp._fully_shard._fsdp_state"
    env.pop("DTRAIN_FAULT", None)
    return env


def run(block: Block, workdir: Path, timeout: float = 300) -> tuple[int, str]:
    """Runs a cpu block in `workdir` (a file block is written there); its exit status and output
    (stdout and stderr together, the checkout's path shown as `.`)."""
    assert block.place == "cpu", block.where()
    if "file" in block.options:
        (workdir / block.options["file"]).write_text(block.text + "\n")
        return 0, ""
    if block.language == "python":
        args = [sys.executable, "-c", block.text]
    else:
        args = ["bash", "-o", "pipefail", "-c", test_script(block)]
    done = subprocess.run(args, cwd=workdir, env=environment(), capture_output=True, text=True, timeout=timeout)
    output = (done.stdout + done.stderr).replace(f"{REPO}/", "").replace(str(REPO), ".")
    return done.returncode, output


def masked(text: str) -> list[str]:
    """Output lines with numbers, times and sizes reduced to one token: what the doc test compares."""
    return [re.sub(r"\d[\d,.:]*", "N", line).rstrip() for line in text.strip().splitlines()]


def output_block(page_blocks: list[Block], block: Block) -> Block | None:
    """The ```text block that shows `block`'s output, where it says `output`."""
    if "output" not in block.marks:
        return None
    following = page_blocks[page_blocks.index(block) + 1:]
    return following[0] if following and following[0].language == "text" else None
