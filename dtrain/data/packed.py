"""Samples of seq_len + 1 tokens packed across the documents of one split part of an indexed
dataset, in Megatron's form: a document index (shuffled document order), a sample index (where each
sample starts and ends in it) and a shuffle index (the order samples are served in).

Unlike Megatron, which sizes one index for the run's total sample count, each epoch gets its own
three indices (a fresh document shuffle, so the packing differs per epoch), built on first use. That
makes the sample stream endless, so a sample is a pure function of (seed, sample number) whatever
the run length, and a resumed run needs no knowledge of how many steps the first one planned.
Indices are cached as files keyed by a hash of everything they depend on; a cached file whose
description, shape or fingerprint does not match is rebuilt, never trusted.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
from pathlib import Path

import numpy as np

from dtrain.data.indexed import IndexedDataset, temporary_path

logger = logging.getLogger("dtrain")

INDEX_FORMAT = 1  # bump when the index layout or its construction changes: old caches then miss
PARTS = ("train", "validation", "test")
CACHE_DIR_NAME = "dtrain_index_cache"
# Counts of index builds and cache loads in this process; tests use them to see a cache reused.
stats = {"built": 0, "loaded": 0}
_warned_dirs: set[str] = set()


def default_cache_dir(prefix: str) -> str:
    """Next to the data, as Megatron does, so that every run on the same files shares one cache."""
    return os.path.join(os.path.dirname(os.path.realpath(prefix)), CACHE_DIR_NAME)


def _key_name(key: dict) -> str:
    return hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:32]


def _seed_words(*values: int) -> list[int]:
    # RandomState's stream is frozen across numpy versions (Generator's is not promised to be), so
    # an index rebuilt after an upgrade equals the cached one and a resumed run sees the same data.
    words = []
    for value in values:
        words += [int(value) & 0xFFFFFFFF, (int(value) >> 32) & 0xFFFFFFFF]
    return words


def fingerprint(array: np.ndarray) -> str:
    """A hash of at most ~2^20 evenly spaced entries (all of them for small indices): reading a
    multi-GB index in full at every start-up would cost about as much as rebuilding it."""
    stride = max(1, len(array) // (1 << 20))
    digest = hashlib.blake2b(np.ascontiguousarray(array[::stride]).tobytes(), digest_size=16)
    digest.update(np.asarray([len(array), array[-1] if len(array) else 0], dtype=np.int64).tobytes())
    return digest.hexdigest()


def write_atomic(path: Path, write) -> None:
    """`write(file)` into a temporary file beside `path`, then renamed into place: a reader never
    sees a half-written file (ranks of one job build the same index at once; a writer stopped
    midway leaves the last whole file)."""
    temporary = Path(temporary_path(path))
    try:
        with open(temporary, "wb") as file:
            write(file)
        os.replace(temporary, path)
    finally:
        if temporary.exists():
            temporary.unlink()


def _save(cache_dir: str, name: str, array: np.ndarray | None, description: dict) -> None:
    try:
        Path(cache_dir).mkdir(parents=True, exist_ok=True)
        if array is not None:
            write_atomic(Path(cache_dir) / f"{name}.npy", lambda file: np.save(file, array))
        # The description goes last: its presence says the array beside it is complete.
        write_atomic(Path(cache_dir) / f"{name}.json", lambda file: file.write(json.dumps(description).encode()))
    except OSError as error:
        if cache_dir not in _warned_dirs:
            _warned_dirs.add(cache_dir)
            logger.warning("cannot write the data index cache in %s (%s); indices are rebuilt each run: "
                           "pass --data-cache-dir with a writable directory", cache_dir, error.strerror)


def _load_description(cache_dir: str, name: str, key: dict) -> dict | None:
    try:
        description = json.loads((Path(cache_dir) / f"{name}.json").read_text())
    except (OSError, ValueError):
        return None
    return description if isinstance(description, dict) and description.get("key") == key else None


def token_range(dataset: IndexedDataset, cache_dir: str) -> tuple[int, int]:
    """(min, max) token id of the dataset, cached beside the indices: a full scan of a large `.bin`
    takes minutes, and the files' identity (size, mtime) says when it must be redone."""
    key = {"format": INDEX_FORMAT, "kind": "token_range", "data": dataset.identity()}
    name = _key_name(key)
    description = _load_description(cache_dir, name, key)
    if description is not None and isinstance(description.get("range"), list):
        low, high = description["range"]
        return int(low), int(high)
    low, high = dataset.token_range()
    _save(cache_dir, name, None, {"key": key, "range": [low, high]})
    return low, high


class PackedSamples:
    """The packed samples of documents [first, end) of `dataset`: `samples_per_epoch` samples per
    epoch, each epoch a fresh shuffle, sample s of the endless stream in epoch s // samples_per_epoch."""

    def __init__(self, dataset: IndexedDataset, first: int, end: int, seq_len: int, seed: int, part: str,
                 cache_dir: str):
        self.dataset, self.first, self.count = dataset, first, end - first
        self.seq_len, self.seed, self.part, self.cache_dir = seq_len, seed, part, cache_dir
        self.tokens = int(dataset.lengths[first:end].sum(dtype=np.int64))
        # Neighbouring samples share one token (the last label of one is the first input of the
        # next), so every token is a label once per epoch, as in Megatron.
        self.samples_per_epoch = max(0, (self.tokens - 1) // seq_len)
        self._epochs: dict[int, tuple[np.ndarray, ...]] = {}
        if self.samples_per_epoch:
            self._epoch(0)  # built now, so that its cost and any cache trouble show at start-up

    def _key(self, epoch: int) -> dict:
        return {"format": INDEX_FORMAT, "kind": "samples", "data": self.dataset.identity(),
                "part": self.part, "documents": [self.first, self.first + self.count],
                "seq_len": self.seq_len, "seed": self.seed, "epoch": epoch}

    def _epoch(self, epoch: int) -> tuple[np.ndarray, ...]:
        """(document order, sample start document, sample start offset, shuffle) of one epoch."""
        if epoch not in self._epochs:
            if len(self._epochs) >= 4:  # training moves forward: keep only recent epochs
                self._epochs.pop(min(self._epochs))
            key, n = self._key(epoch), self.samples_per_epoch
            name = _key_name(key)
            array = self._load(name, key)
            if array is None:
                array = self._build(epoch)
                stats["built"] += 1
                _save(self.cache_dir, name, array, {"key": key, "length": len(array),
                                                    "fingerprint": fingerprint(array)})
            else:
                stats["loaded"] += 1
            c = self.count
            self._epochs[epoch] = (array[:c], array[c : c + n + 1], array[c + n + 1 : c + 2 * n + 2],
                                   array[c + 2 * n + 2 :])
        return self._epochs[epoch]

    def _load(self, name: str, key: dict) -> np.ndarray | None:
        description = _load_description(self.cache_dir, name, key)
        length = self.count + 3 * self.samples_per_epoch + 2
        if description is None or description.get("length") != length:
            return None
        try:
            array = np.load(Path(self.cache_dir) / f"{name}.npy", mmap_mode="r", allow_pickle=False)
        except (OSError, ValueError, EOFError):
            return None
        if array.dtype != np.int64 or array.shape != (length,) or fingerprint(array) != description.get("fingerprint"):
            logger.warning("data index cache %s/%s.npy does not match its description; rebuilding it",
                           self.cache_dir, name)
            return None
        return array

    def _build(self, epoch: int) -> np.ndarray:
        salt = PARTS.index(self.part)
        generator = np.random.RandomState(_seed_words(self.seed, epoch, salt))
        order = self.first + generator.permutation(self.count).astype(np.int64)
        starts = np.zeros(self.count + 1, dtype=np.int64)
        np.cumsum(self.dataset.lengths[order], out=starts[1:])
        # Sample i spans stream tokens [i * seq_len, (i + 1) * seq_len]; find the document (a
        # position in `order`) and the offset in it of each boundary. side="right" skips empty
        # documents, whose start equals the next one's.
        boundaries = np.arange(self.samples_per_epoch + 1, dtype=np.int64) * self.seq_len
        document = np.searchsorted(starts, boundaries, side="right") - 1
        offset = boundaries - starts[document]
        shuffle = generator.permutation(self.samples_per_epoch).astype(np.int64)
        return np.concatenate([order, document, offset, shuffle])

    def rows(self, sample_ids: np.ndarray, with_documents: bool) -> tuple[np.ndarray, np.ndarray | None]:
        """Token ids [n, seq_len + 1] (int64) of these stream samples and, if asked, the document
        number of each token within its row (0 for the first document, +1 at each boundary)."""
        width = self.seq_len + 1
        tokens = np.empty((len(sample_ids), width), dtype=np.int64)
        documents = np.empty((len(sample_ids), width), dtype=np.int64) if with_documents else None
        for row, sample in enumerate(np.asarray(sample_ids, dtype=np.int64).tolist()):
            order, document, offset, shuffle = self._epoch(sample // self.samples_per_epoch)
            k = int(shuffle[sample % self.samples_per_epoch])
            first, last = int(document[k]), int(document[k + 1])
            filled = number = 0
            for position in range(first, last + 1):
                sequence = int(order[position])
                start = int(offset[k]) if position == first else 0
                stop = int(offset[k + 1]) + 1 if position == last else int(self.dataset.lengths[sequence])
                piece = self.dataset.sequence(sequence, start, stop)
                tokens[row, filled : filled + len(piece)] = piece
                if documents is not None and len(piece):
                    documents[row, filled : filled + len(piece)] = number
                    number += 1
                filled += len(piece)
            assert filled == width, (sample, filled, width)
        return tokens, documents
