"""A text file as training data (`--data FILE.txt`): its token ids, the end-of-text id appended,
tokenized once into an indexed dataset (PREFIX.bin/.idx, dtrain/data/indexed.py) in the data cache
and read from there through a memory map by every rank and every later run.

    tokens = text.load("corpus.txt", "tokenizer.json", cache_dir="data/dtrain_index_cache")
    tokens.ids[:10], tokens.vocab_size, tokens.end_of_text

The text is streamed in pieces of about PIECE_CHARS characters, so memory stays bounded whatever
the file's size. A piece ends before a space that stands between two non-space characters (else
after such a newline; a text with neither is cut at MAX_PIECE_CHARS): byte-level BPE tokenizers
(GPT-2's, Llama 3's) split the text there anyway, so their ids are those of the whole text at once.

The cache is keyed by the file (path, size, mtime and a digest of its sampled blocks), the
tokenizer file's bytes and the piece sizes. One process builds it (a lock file beside it; the
process that finds the lock waits, and takes over a lock whose holder died) and renames it into
place; a cache that does not match its description is rebuilt, never trusted. Where the cache
directory cannot be written, the text is tokenized in memory (its ids as a numpy array), with a
warning that names --data-cache-dir.
"""

from __future__ import annotations

import codecs
import functools
import hashlib
import json
import logging
import os
import re
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import attrs
import numpy as np
from tokenizers import Tokenizer

from dtrain.data.indexed import IndexedDataset, IndexedDatasetWriter, sampled_digest, token_dtype
from dtrain.data.packed import write_atomic
from dtrain.resilience.run_lock import process_alive, process_start_time
from models.errors import UserError

logger = logging.getLogger("dtrain")

END_OF_TEXT = "<|endoftext|>"
TEXT_FORMAT = 1  # bump when the tokenization or the cache's layout changes: old caches then miss
PIECE_CHARS = 1 << 16  # the tokenizer takes ~200 bytes per character of a piece while it works on it
MAX_PIECE_CHARS = 1 << 18
_BETWEEN_WORDS = re.compile(r"(?<=\S) (?=\S)")  # a piece starts with this space
_BETWEEN_LINES = re.compile(r"(?<=\S)\n(?=\S)")  # a piece ends with this newline
STALE_LOCK_S = 120.0  # a lock of another host not refreshed for this long belongs to a dead process
# Counts of caches built and loaded in this process; tests use them to see a cache reused.
stats = {"built": 0, "loaded": 0}


@attrs.frozen
class TextTokens:
    ids: np.ndarray  # every token id of the text, end-of-text appended (a memory map of the cache)
    vocab_size: int  # the tokenizer's, with its added tokens
    end_of_text: int | None  # the tokenizer's <|endoftext|> id (None: it has none)
    max_id: int
    documents: int  # texts separated by <|endoftext|> (the end of the file ends the last)


def load_tokenizer(path: str) -> Tokenizer:
    try:
        return Tokenizer.from_file(path)
    except Exception as error:  # tokenizers raises a bare Exception for malformed files
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(f"--tokenizer {path!r} is not a Hugging Face tokenizer.json ({reason}): "
                        f"pass a file saved by tokenizers.Tokenizer.save") from None


def load(text_path: str, tokenizer_path: str, cache_dir: str | None) -> TextTokens:
    """The text's tokens: from the cache in `cache_dir` (built there first if missing), or, with
    no `cache_dir`, tokenized in this process (once per process for the same files)."""
    if os.path.getsize(text_path) == 0:
        raise UserError(f"--data {text_path!r} is empty: pass a file with text in it")
    key = {"format": TEXT_FORMAT, "kind": "text", "pieces": [PIECE_CHARS, MAX_PIECE_CHARS],
           "text": _file_identity(text_path),
           "tokenizer": hashlib.sha256(Path(tokenizer_path).read_bytes()).hexdigest()}
    if cache_dir is None:
        return _in_memory(text_path, tokenizer_path, json.dumps(key, sort_keys=True))
    name = "text-" + hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]
    try:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        return _build_once(Path(cache_dir), name, key, text_path, tokenizer_path)
    except OSError as error:
        logger.warning("cannot write the data cache in %s (%s); %s is tokenized in memory by every process: pass "
                       "--data-cache-dir with a writable directory", cache_dir, error.strerror or error, text_path)
        return _in_memory(text_path, tokenizer_path, json.dumps(key, sort_keys=True))


def _file_identity(path: str) -> dict:
    info = os.stat(path)
    return {"path": os.path.realpath(path), "bytes": info.st_size, "mtime_ns": info.st_mtime_ns,
            "digest": sampled_digest(path, info.st_size).hex()}


@functools.lru_cache(maxsize=4)
def _in_memory(text_path: str, tokenizer_path: str, key: str) -> TextTokens:
    """`key` (the files' identity) makes an edited file a new entry of the cache."""
    tokenizer = load_tokenizer(tokenizer_path)
    dtype = token_dtype(tokenizer.get_vocab_size(with_added_tokens=True))
    ids = np.concatenate([np.zeros(0, dtype), *_token_pieces(text_path, tokenizer, dtype)])
    return _described(ids, tokenizer)


def _described(ids: np.ndarray, tokenizer: Tokenizer) -> TextTokens:
    end_of_text = tokenizer.token_to_id(END_OF_TEXT)
    documents = int(np.count_nonzero(ids == end_of_text)) if end_of_text is not None else 1
    return TextTokens(ids, tokenizer.get_vocab_size(with_added_tokens=True), end_of_text,
                      int(ids.max()) if len(ids) else 0, documents)


def _token_pieces(text_path: str, tokenizer: Tokenizer, dtype: np.dtype) -> Iterator[np.ndarray]:
    """The ids of each piece of the text; the end-of-text id, when the tokenizer has one, last.
    A literal <|endoftext|> in the text is encoded as that token, so a file can hold several
    documents separated that way."""
    for piece in pieces(text_path, PIECE_CHARS, MAX_PIECE_CHARS):
        yield np.asarray(tokenizer.encode(piece, add_special_tokens=False).ids, dtype=dtype)
    end_of_text = tokenizer.token_to_id(END_OF_TEXT)
    if end_of_text is not None:
        yield np.asarray([end_of_text], dtype=dtype)


def pieces(text_path: str, piece_chars: int, max_chars: int) -> Iterator[str]:
    """The text of the file (UTF-8, newlines as Python reads them, a byte order mark left out) in
    pieces cut where tokenization is unchanged (the module docstring)."""
    buffer = ""
    try:
        with open(text_path, encoding="utf-8-sig") as file:
            while block := file.read(piece_chars):
                buffer += block
                if len(buffer) < piece_chars:
                    continue
                cut = _cut(buffer, max_chars)
                if cut:
                    yield buffer[:cut]
                    buffer = buffer[cut:]
    except UnicodeDecodeError as error:
        raise UserError(f"--data {text_path!r} is not UTF-8 text ({error.reason} at byte {_first_bad_byte(text_path)}): "
                        f"convert it to UTF-8") from None
    if buffer:
        yield buffer


def _cut(buffer: str, max_chars: int) -> int:
    """Where to end a piece of `buffer` (0: read more first). The character after a cut must be in
    the buffer already, so its end is never one (a later block could continue the word)."""
    for pattern, after in ((_BETWEEN_WORDS, 0), (_BETWEEN_LINES, 1)):
        # The last such place, looked for near the end first: a text of short words has one there.
        for start in (max(0, len(buffer) - 4096), 0):
            last = None
            for last in pattern.finditer(buffer, start):
                pass
            if last is not None:
                return last.start() + after
    return len(buffer) if len(buffer) >= max_chars else 0


def _first_bad_byte(path: str) -> int:
    decoder = codecs.getincrementaldecoder("utf-8")()
    consumed = 0
    with open(path, "rb") as file:
        while block := file.read(1 << 20):
            pending = len(decoder.getstate()[0])
            try:
                decoder.decode(block)
            except UnicodeDecodeError as error:
                return consumed - pending + error.start
            consumed += len(block)
    return consumed


def _build_once(cache_dir: Path, name: str, key: dict, text_path: str, tokenizer_path: str) -> TextTokens:
    """The cache `name`, built here if no other process builds it; else waited for."""
    lock, failed = cache_dir / f"{name}.lock", cache_dir / f"{name}.failed"
    told = False
    while True:
        found = _cached(cache_dir, name, key)
        if found is not None:
            stats["loaded"] += 1
            return found
        if failed.is_file():
            raise UserError(failed.read_text().strip())
        try:
            descriptor = os.open(lock, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
        except FileExistsError:
            dead = _stale(lock)
            if dead is not None:
                # Two processes that both find it stale may both build: a second build, never a
                # wrong cache, as each file is renamed into place whole.
                _remove(lock)
                _remove_temporaries(cache_dir, name, dead)
                continue
            if not told:
                told = True
                logger.info("waiting for %s, which tokenizes %s into %s", _holder(lock), text_path, cache_dir)
            time.sleep(0.2)
            continue
        with os.fdopen(descriptor, "w") as file:
            file.write(f"{socket.gethostname()} {os.getpid()} {process_start_time(os.getpid())}\n")
        try:
            found = _cached(cache_dir, name, key)  # finished by another process between the look and the lock
            if found is None:
                found = _build(cache_dir, name, key, text_path, tokenizer_path, lambda: os.utime(lock))
                stats["built"] += 1
            else:
                stats["loaded"] += 1
            return found
        except UserError as error:  # the same for every process: the others read it instead
            write_atomic(failed, lambda file: file.write(f"{error}\n".encode()))
            raise
        finally:
            _remove(lock)


def _build(cache_dir: Path, name: str, key: dict, text_path: str, tokenizer_path: str,
           alive: Callable[[], None]) -> TextTokens:
    start = time.perf_counter()
    tokenizer = load_tokenizer(tokenizer_path)
    dtype = token_dtype(tokenizer.get_vocab_size(with_added_tokens=True))
    tokens = max_id = 0
    end_of_text, documents = tokenizer.token_to_id(END_OF_TEXT), 0
    with IndexedDatasetWriter(str(cache_dir / name), dtype) as writer:
        for ids in _token_pieces(text_path, tokenizer, dtype):
            writer.add_document(ids)  # one sequence per piece: one document, as the file is one text
            tokens += len(ids)
            max_id = max(max_id, int(ids.max()) if len(ids) else 0)
            documents += int(np.count_nonzero(ids == end_of_text)) if end_of_text is not None else 0
            alive()
    description = {"key": key, "tokens": tokens, "max_id": max_id, "documents": max(documents, 1),
                   "vocab_size": tokenizer.get_vocab_size(with_added_tokens=True), "end_of_text": end_of_text}
    # The description goes last: its presence says the files beside it are complete.
    write_atomic(cache_dir / f"{name}.json", lambda file: file.write(json.dumps(description).encode()))
    logger.info("tokenized %s into %s: %s tokens in %.1f s", text_path, cache_dir / name, f"{tokens:,}",
                time.perf_counter() - start)
    return _cached(cache_dir, name, key)


def _cached(cache_dir: Path, name: str, key: dict) -> TextTokens | None:
    try:
        description = json.loads((cache_dir / f"{name}.json").read_text())
        if description.get("key") != key:
            return None
    except (OSError, ValueError, AttributeError):  # not built yet, or half-written
        return None
    try:
        ids = IndexedDataset(str(cache_dir / name)).tokens
        if len(ids) != description["tokens"]:
            raise ValueError(f"{len(ids)} tokens, not {description['tokens']}")
        return TextTokens(ids, int(description["vocab_size"]), description["end_of_text"],
                          int(description["max_id"]), int(description["documents"]))
    except (OSError, ValueError, KeyError, TypeError) as error:
        logger.warning("the data cache %s does not match its description (%s); rebuilding it", cache_dir / name, error)
        _remove(cache_dir / f"{name}.json")
        return None


def _holder(lock: Path) -> str:
    try:
        host, pid = lock.read_text().split()[:2]
    except (OSError, ValueError):
        return "another process"
    return f"process {pid} on {host}"


def _stale(lock: Path) -> str | None:
    """The pid of the lock's holder where it is gone ("" where it wrote none), else None: a process
    of this host that no longer runs (or whose pid another process has now, this one included: a
    restarted container numbers its processes alike), or a lock of another host that its holder
    stopped refreshing."""
    try:
        age = time.time() - lock.stat().st_mtime
        host, pid, *started = lock.read_text().split()
        if host == socket.gethostname():
            return pid if int(pid) == os.getpid() or not process_alive(int(pid), (started or [None])[0]) else None
        return pid if age > STALE_LOCK_S else None
    except ValueError:  # no holder written: just created, or its creator died at once
        return "" if age > 10.0 else None
    except OSError:  # removed meanwhile
        return None


def _remove_temporaries(cache_dir: Path, name: str, pid: str) -> None:
    """What a build of `name` by the dead process `pid` left half written (temporary_path's names)."""
    for path in cache_dir.glob(f"{name}.*.{pid}.*.tmp") if pid else ():
        _remove(path)


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except FileNotFoundError:
        pass
