"""Tokenize a JSON-lines or plain-text corpus into Megatron's indexed format: PREFIX.bin + PREFIX.idx.

Each line is one document: in JSON lines (any --input but *.txt) an object whose --json-key
(default "text") holds its text; in a .txt file the line itself (a blank line is an empty
document, skipped). The files are what Megatron's tools/preprocess_data.py writes (one sequence
per document, uint16 ids below a 65,500-token vocabulary, int32 above; dtrain adds a record of the
.bin after the index's arrays, where Megatron's reader does not look), so Megatron reads them and
dtrain reads Megatron's. Both files are written under temporary names and renamed into place once
complete. Tokenizer: the bundled one by default, a local Hugging Face tokenizer.json
(--tokenizer), or GPT-2 BPE files (--vocab-file vocab.json --merge-file merges.txt). A lone
surrogate in a JSON string (an unpaired "\\ud800" escape, which no tokenizer can encode) is
replaced by U+FFFD; the first one is named, and the count given at the end.

    python -m tools.preprocess_data --input corpus.jsonl --output-prefix data/corpus --append-eod --workers 8
    python -m dtrain.run --data data/corpus --split 969,30,1 ...
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import re
import sys
import time

import numpy as np
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

if not __package__:  # run as `python tools/preprocess_data.py` from a checkout that is not installed
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dtrain.data.dataset import BUNDLED_TOKENIZER
from dtrain.data.indexed import IndexedDatasetWriter, token_dtype
from models.errors import UserError

# Tried in order when --eod-token is not given: GPT-2/NeoX, Llama 3, Llama 2/T5, Gemma.
EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>")
LINES_PER_TASK = 256  # large enough that pickling to workers is cheap next to tokenizing
TASK_CHARS = 1 << 24  # and at most about this much text per task, whatever the lines' length
SURROGATE = re.compile("[\ud800-\udfff]")  # in a str, a surrogate is always a lone one

_worker: dict = {}  # per-process state set by _init_worker: the tokenizer and the options


def load_tokenizer(tokenizer: str | None, vocab_file: str | None, merge_file: str | None) -> Tokenizer:
    """--tokenizer's file, else GPT-2 BPE files, else the bundled tokenizer."""
    if tokenizer is None and not (vocab_file or merge_file):
        tokenizer = str(BUNDLED_TOKENIZER)
    if tokenizer is not None:
        if vocab_file or merge_file:
            raise UserError("pass either --tokenizer or --vocab-file and --merge-file, not both")
        if not os.path.isfile(tokenizer):
            raise UserError(f"--tokenizer {tokenizer!r} is not an existing file: pass the path of a Hugging Face "
                            f"tokenizer.json, or leave --tokenizer out for the bundled one ({BUNDLED_TOKENIZER})")
        try:
            return Tokenizer.from_file(tokenizer)
        except Exception as error:  # tokenizers raises a bare Exception for malformed files
            raise UserError(f"--tokenizer {tokenizer!r} is not a Hugging Face tokenizer.json "
                            f"({str(error).splitlines()[0] if str(error) else type(error).__name__})") from None
    if not (vocab_file and merge_file):
        raise UserError("GPT-2 BPE needs both --vocab-file vocab.json and --merge-file merges.txt")
    for flag, path in (("--vocab-file", vocab_file), ("--merge-file", merge_file)):
        if not os.path.isfile(path):
            raise UserError(f"{flag} {path!r} is not an existing file")
    try:
        bpe = models.BPE.from_file(vocab_file, merge_file)
    except Exception as error:
        raise UserError(f"--vocab-file {vocab_file!r} / --merge-file {merge_file!r} are not GPT-2 BPE files "
                        f"({str(error).splitlines()[0]})") from None
    # GPT-2's tokenizer: byte-level BPE over its regex pre-tokenization, no prefix space.
    result = Tokenizer(bpe)
    result.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    result.decoder = decoders.ByteLevel()
    return result


def find_eod(tokenizer: Tokenizer, eod_token: str | None) -> int:
    candidates = (eod_token,) if eod_token else EOD_CANDIDATES
    for token in candidates:
        token_id = tokenizer.token_to_id(token)
        if token_id is not None:
            return token_id
    raise UserError(f"the tokenizer has no end-of-document token {' or '.join(candidates)}: pass --eod-token "
                    f"with one of its special tokens, or leave out --append-eod")


def _init_worker(options: dict) -> None:
    _worker.update(options)
    _worker["tokenizer"] = load_tokenizer(options["tokenizer"], options["vocab_file"], options["merge_file"])


def _encode(task: tuple[int, list[str]]) -> tuple[list[np.ndarray], int, int, int, list[int]]:
    """(token arrays of the chunk's non-empty documents, bytes read, lines read, empty documents
    skipped, the lines whose lone surrogates were replaced)."""
    first_line, lines = task
    texts, numbers = [], []
    for number, line in enumerate(lines, first_line):
        text = _document(line, number) if _worker["jsonl"] else line.rstrip("\n")
        if text is not None:
            texts.append(text)
            numbers.append(number)
    tokenizer, replaced = _worker["tokenizer"], []
    try:
        encodings = tokenizer.encode_batch(texts, add_special_tokens=False)
    except TypeError:  # tokenizers cannot take a str that holds a lone surrogate
        replaced = [number for number, text in zip(numbers, texts) if SURROGATE.search(text)]
        encodings = tokenizer.encode_batch([SURROGATE.sub("\ufffd", text) for text in texts], add_special_tokens=False)
    documents, empty = [], 0
    for encoding in encodings:
        ids = encoding.ids
        if not ids:
            empty += 1  # as Megatron does: an empty text gets no tokens, not even the EOD
            continue
        if _worker["eod"] is not None:
            ids.append(_worker["eod"])
        documents.append(np.asarray(ids, dtype=_worker["dtype"]))
    size = sum(len(line.encode("utf-8", "surrogatepass")) for line in lines)
    return documents, size, len(lines), empty, replaced


def _document(line: str, number: int) -> str | None:
    """The text of one JSON line (None for a blank line)."""
    key, where = _worker["json_key"], _worker["input"]
    if not line.strip():
        return None
    try:
        record = json.loads(line)
    except json.JSONDecodeError as error:
        raise UserError(f"{where}:{number} is not JSON ({error.msg}): each line must be an object "
                        f'such as {{"{key}": "..."}}') from None
    if not isinstance(record, dict):
        raise UserError(f"{where}:{number} is {_json_kind(record)}, not an object: each line must be an object "
                        f'such as {{"{key}": "..."}}')
    if key not in record:
        raise UserError(f"{where}:{number} has no key {key!r} (it has {sorted(record)}): pass --json-key with the "
                        f"key that holds the text")
    if not isinstance(record[key], str):
        raise UserError(f"{where}:{number}: {key!r} holds {_json_kind(record[key])}, not a string: pass --json-key "
                        f"with the key that holds the text")
    return record[key]


def _json_kind(value) -> str:
    kinds = ((bool, "a boolean"), ((int, float), "a number"), (list, "an array"), (dict, "an object"),
             (str, "a string"))
    return "null" if value is None else next(name for kind, name in kinds if isinstance(value, kind))


def _tasks(path: str):
    """(first line number, lines) of at most LINES_PER_TASK lines or TASK_CHARS characters (a
    longer line alone), so that a worker never holds much more than one long line."""
    first = 1
    try:
        # utf-8-sig: a byte order mark at the start is not part of the first document.
        with open(path, encoding="utf-8-sig") as file:
            lines, size = [], 0
            for line in file:
                lines.append(line)
                size += len(line)
                if len(lines) == LINES_PER_TASK or size >= TASK_CHARS:
                    yield first, lines
                    first += len(lines)
                    lines, size = [], 0
            if lines:
                yield first, lines
    except UnicodeDecodeError as error:
        raise UserError(f"--input {path!r} is not UTF-8 ({error.reason} in the lines from line {first}): convert it "
                        f"to UTF-8") from None


def preprocess(input_path: str, output_prefix: str, tokenizer: str | None = None, vocab_file: str | None = None,
               merge_file: str | None = None, json_key: str = "text", append_eod: bool = False,
               eod_token: str | None = None, workers: int = 1, log=sys.stderr) -> dict:
    """Writes output_prefix.bin/.idx; returns counts (documents, tokens, skipped empty, lone
    surrogates replaced, lines, dtype)."""
    if not os.path.isfile(input_path):
        raise UserError(f"--input {input_path!r} is not an existing file: pass a JSON-lines or .txt file")
    if workers < 1:
        raise UserError(f"--workers {workers} must be >= 1")
    if output_prefix.endswith(("/", os.sep)) or os.path.isdir(output_prefix):
        # The files would be the hidden DIR/.bin and DIR/.idx.
        raise UserError(f"--output-prefix {output_prefix} names a directory; pass a prefix inside it, such as "
                        f"{os.path.join(output_prefix, 'corpus')}")
    parent_tokenizer = load_tokenizer(tokenizer, vocab_file, merge_file)
    dtype = token_dtype(parent_tokenizer.get_vocab_size(with_added_tokens=True))
    options = dict(tokenizer=tokenizer, vocab_file=vocab_file, merge_file=merge_file, json_key=json_key,
                   input=input_path, dtype=dtype.str, jsonl=not input_path.endswith(".txt"),
                   eod=find_eod(parent_tokenizer, eod_token) if append_eod else None)
    counts = {"documents": 0, "tokens": 0, "empty": 0, "replaced": 0, "lines": 0, "dtype": str(dtype)}
    start = last_report = time.perf_counter()
    read = 0
    pool = None
    if workers == 1:
        _init_worker(options)
        results = map(_encode, _tasks(input_path))
    else:
        # Each worker tokenizes serially; the processes are the parallelism, not Rust threads.
        os.environ["TOKENIZERS_PARALLELISM"] = "false"
        pool = multiprocessing.get_context("spawn").Pool(workers, _init_worker, (options,))
        results = pool.imap(_encode, _tasks(input_path))  # imap keeps the input's document order
    try:
        with IndexedDatasetWriter(output_prefix, dtype) as writer:
            for documents, size, lines, empty, replaced in results:
                for ids in documents:
                    writer.add_document(ids)
                    counts["tokens"] += len(ids)
                counts["documents"] += len(documents)
                counts["empty"] += empty
                if replaced and not counts["replaced"]:
                    print(f"{input_path}:{replaced[0]} holds a lone surrogate (an unpaired \\ud800-\\udfff escape, "
                          f"which is no character); it is replaced by U+FFFD, as are later ones", file=log)
                counts["replaced"] += len(replaced)
                counts["lines"] += lines
                read += size
                now = time.perf_counter()
                if now - last_report >= 1.0:
                    last_report = now
                    _progress(log, counts, read, now - start)
            if not counts["documents"]:
                raise UserError(f"--input {input_path} holds no documents ({counts['lines']} lines, all empty): pass a "
                                f"file with text in it")
    finally:
        if pool is not None:
            pool.terminate()
    _progress(log, counts, read, time.perf_counter() - start)
    replaced = f", {counts['replaced']:,} documents with lone surrogates replaced" if counts["replaced"] else ""
    print(f"wrote {output_prefix}.bin and {output_prefix}.idx: {counts['documents']:,} documents, "
          f"{counts['tokens']:,} tokens ({dtype}), {counts['empty']:,} empty documents skipped{replaced}", file=log)
    return counts


def _progress(log, counts: dict, read: int, elapsed: float) -> None:
    elapsed = max(elapsed, 1e-9)
    print(f"processed {counts['documents']:,} documents, {counts['tokens']:,} tokens, {read / 2**20:,.1f} MiB "
          f"({counts['documents'] / elapsed:,.0f} docs/s, {read / 2**20 / elapsed:,.2f} MiB/s)", file=log, flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tools.preprocess_data", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True, help="JSON-lines or .txt file, one document per line")
    parser.add_argument("--output-prefix", required=True, help="writes OUTPUT_PREFIX.bin and .idx")
    parser.add_argument("--json-key", default="text", help="key of the text in each line's object")
    parser.add_argument("--tokenizer", default=None, help="a local Hugging Face tokenizer.json (default: the "
                                                          "bundled one)")
    parser.add_argument("--vocab-file", default=None, help="GPT-2 BPE vocab.json (with --merge-file)")
    parser.add_argument("--merge-file", default=None, help="GPT-2 BPE merges.txt (with --vocab-file)")
    parser.add_argument("--append-eod", action="store_true", help="end every document with the EOD token")
    parser.add_argument("--eod-token", default=None, help=f"EOD token (default: the first of {EOD_CANDIDATES} "
                                                         f"the tokenizer has)")
    parser.add_argument("--workers", type=int, default=1, help="tokenizing processes")
    args = parser.parse_args(argv)
    try:
        preprocess(args.input, args.output_prefix, args.tokenizer, args.vocab_file, args.merge_file,
                   args.json_key, args.append_eod, args.eod_token, args.workers)
    except UserError as error:
        print(f"preprocess_data: error: {error}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
