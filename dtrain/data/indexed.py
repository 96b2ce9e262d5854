"""Megatron's indexed dataset format (`PREFIX.bin` + `PREFIX.idx`), read with numpy.memmap and
written as Megatron writes it (plus a record of the `.bin` that Megatron's reader skips), so that
either tool reads the other's files.

`PREFIX.idx` (little-endian): magic b"MMIDIDX\\x00\\x00", uint64 version 1, uint8 dtype code, uint64
sequence count S, uint64 document count D, then int32 lengths[S] (tokens per sequence), int64
pointers[S] (byte offset of each sequence in `.bin`) and int64 document_indices[D] (sequence index
where each document starts, first 0, last S). `PREFIX.bin` is the token ids back to back.

dtrain's writer adds a record of the `.bin` after the document indices: magic b"DTRAINBIN", uint8
version 1, uint64 size of `.bin` and a 16-byte BLAKE2b digest of its sampled blocks
(`sampled_digest`). Megatron's reader takes the header's counts and reads the three arrays at
their offsets, so it never reads that far; dtrain's reader checks the `.bin` against it, and
against the arrays (its size must be exactly what they describe) for an index without it. Both
files are written under temporary names and renamed into place, the `.idx` first: a run stopped
at any moment leaves the earlier pair whole, or a new `.idx` whose record refuses the earlier `.bin`.
"""

from __future__ import annotations

import hashlib
import os
import struct
import uuid
from pathlib import Path

import numpy as np

from models.errors import UserError

MAGIC = b"MMIDIDX\x00\x00"
VERSION = 1
HEADER_BYTES = len(MAGIC) + 8 + 1 + 8 + 8
DTYPES = {1: np.uint8, 2: np.int8, 3: np.int16, 4: np.int32, 5: np.int64, 6: np.float64, 7: np.float32,
          8: np.uint16}
DTYPE_CODES = {np.dtype(dtype): code for code, dtype in DTYPES.items()}
# Token ids are scanned for the vocabulary check in chunks of this many, so memory stays flat.
SCAN_CHUNK = 1 << 24
TRAILER_MAGIC = b"DTRAINBIN"
TRAILER_VERSION = 1
TRAILER_BYTES = len(TRAILER_MAGIC) + 1 + 8 + 16
# A file's digest reads this many evenly spaced blocks of this size (all of a smaller file), so
# that checking a pair costs a millisecond whatever the size.
DIGEST_BLOCKS, DIGEST_BLOCK_BYTES = 256, 4096
FIX = "re-run tools/preprocess_data.py (or Megatron's preprocess_data.py) to write it again"


def temporary_path(path: str | Path) -> str:
    """A name beside `path` that no other writer uses, for a file renamed into place once whole."""
    return f"{path}.{os.getpid()}.{uuid.uuid4().hex[:8]}.tmp"


def sampled_digest(path: str, size: int) -> bytes:
    """BLAKE2b of the size and DIGEST_BLOCKS evenly spaced blocks of the file (all of it when small)."""
    digest = hashlib.blake2b(struct.pack("<Q", size), digest_size=16)
    with open(path, "rb") as file:
        if size <= DIGEST_BLOCKS * DIGEST_BLOCK_BYTES:
            digest.update(file.read())
        else:
            for block in range(DIGEST_BLOCKS):
                file.seek(block * (size - DIGEST_BLOCK_BYTES) // (DIGEST_BLOCKS - 1))
                digest.update(file.read(DIGEST_BLOCK_BYTES))
    return digest.digest()


def token_dtype(vocab_size: int) -> np.dtype:
    """The dtype Megatron's preprocessing picks: uint16 while every id fits with room, else int32."""
    return np.dtype(np.uint16 if vocab_size < 65500 else np.int32)


def split_prefix(path: str) -> str:
    """`data/x.bin` or `data/x.idx` -> `data/x`: users often paste one of the two file names."""
    return path[:-4] if path.endswith((".bin", ".idx")) else path


def is_indexed_prefix(path: str) -> bool:
    prefix = split_prefix(path)
    return os.path.exists(prefix + ".idx") or os.path.exists(prefix + ".bin")


def check_files(path: str) -> str:
    """The prefix of `path`, once both of its files are known to exist."""
    prefix = split_prefix(path)
    idx_path, bin_path = prefix + ".idx", prefix + ".bin"
    for missing, other in ((idx_path, bin_path), (bin_path, idx_path)):
        if not os.path.isfile(missing):
            raise UserError(f"indexed dataset {prefix!r}: {missing} is missing ({other} "
                            f"{'exists' if os.path.isfile(other) else 'is missing too'}): pass the prefix "
                            f"of a .bin/.idx pair written by tools/preprocess_data.py or Megatron")
    return prefix


class IndexedDataset:
    """A read-only view of one PREFIX.bin/.idx pair. Sequence i is `sequence(i)`; nothing is read
    from `.bin` until asked, so opening a dataset of any size is cheap."""

    def __init__(self, prefix: str):
        self.prefix = check_files(prefix)
        self.idx_path, self.bin_path = self.prefix + ".idx", self.prefix + ".bin"
        self._read_index()
        count = self.bin_bytes // self.dtype.itemsize  # exact: _check_consistent compared the sizes
        self.tokens = (np.memmap(self.bin_path, dtype=self.dtype, mode="r", shape=(count,)) if count
                       else np.zeros(0, dtype=self.dtype))  # numpy cannot map an empty file

    def _read_index(self) -> None:
        idx_bytes = os.path.getsize(self.idx_path)
        fix = FIX
        with open(self.idx_path, "rb") as file:
            header = file.read(HEADER_BYTES)
        if header[: len(MAGIC)] != MAGIC:
            raise UserError(f"{self.idx_path} starts with {header[:len(MAGIC)]!r}, not the MMIDIDX magic "
                            f"{MAGIC!r}: it is not a Megatron index; {fix}")
        if len(header) < HEADER_BYTES:
            raise UserError(f"{self.idx_path} is {idx_bytes} bytes, shorter than the {HEADER_BYTES}-byte "
                            f"header: the file is truncated; {fix}")
        version, code, sequences, documents = struct.unpack("<QBQQ", header[len(MAGIC):])
        if version != VERSION:
            raise UserError(f"{self.idx_path} has index version {version}; dtrain reads version {VERSION} "
                            f"(Megatron's MMIDIDX): {fix}")
        if code not in DTYPES:
            raise UserError(f"{self.idx_path} has dtype code {code}, not one of {sorted(DTYPES)}: {fix}")
        if np.dtype(DTYPES[code]).kind == "f":
            # A cast would truncate 1.5 to 1 and fail on a NaN: such a file holds no token ids.
            raise UserError(f"{self.idx_path} stores token ids as {np.dtype(DTYPES[code])}; token ids are integers: "
                            f"{fix} from the text")
        expected = HEADER_BYTES + sequences * (4 + 8) + documents * 8
        if idx_bytes < expected:
            raise UserError(f"{self.idx_path} is {idx_bytes} bytes, shorter than the {expected} its header "
                            f"promises ({sequences} sequences, {documents} document indices): the file is "
                            f"truncated; {fix}")
        self.dtype = np.dtype(DTYPES[code])
        index = np.memmap(self.idx_path, dtype=np.uint8, mode="r", offset=0, shape=(expected,))
        offset = HEADER_BYTES
        self.lengths = np.frombuffer(index, np.int32, sequences, offset)
        offset += 4 * sequences
        self.pointers = np.frombuffer(index, np.int64, sequences, offset)
        offset += 8 * sequences
        self.document_indices = np.frombuffer(index, np.int64, documents, offset)
        self.bin_bytes = os.path.getsize(self.bin_path)
        self._check_consistent(fix)
        with open(self.idx_path, "rb") as file:
            file.seek(expected)
            trailer = file.read(TRAILER_BYTES)
        if len(trailer) == TRAILER_BYTES and trailer.startswith(TRAILER_MAGIC):
            self._check_recorded_bin(trailer, fix)

    def _check_consistent(self, fix: str) -> None:
        # One vectorised pass: a wrong pointer would otherwise surface as garbage tokens mid-run.
        item = self.dtype.itemsize
        ends = self.pointers + self.lengths.astype(np.int64) * item
        if len(self.lengths) and (self.lengths.min() < 0 or self.pointers.min() < 0
                                  or (self.pointers % item).any()):
            raise UserError(f"{self.idx_path} holds negative lengths or misaligned pointers: {fix}")
        described = int(ends.max()) if len(ends) else 0
        if described != self.bin_bytes:
            what = "shorter" if self.bin_bytes < described else "longer"
            raise UserError(f"{self.bin_path} is {self.bin_bytes} bytes but {self.idx_path} describes {described} "
                            f"(the .bin is {what}): the two files do not belong together (a preprocessing run "
                            f"that stopped midway, or files of two runs); {fix}")
        docs = self.document_indices
        if len(docs) < 1 or docs[0] != 0 or docs[-1] != len(self.lengths) or (np.diff(docs) < 0).any():
            raise UserError(f"{self.idx_path} has document indices that do not run from 0 to its "
                            f"{len(self.lengths)} sequences in order: {fix}")

    def _check_recorded_bin(self, trailer: bytes, fix: str) -> None:
        version, size = struct.unpack("<BQ", trailer[len(TRAILER_MAGIC):len(TRAILER_MAGIC) + 9])
        recorded = trailer[-16:]
        if version == TRAILER_VERSION and (size != self.bin_bytes or sampled_digest(self.bin_path, size) != recorded):
            raise UserError(f"{self.bin_path} is not the file {Path(self.idx_path).name} was written with (its "
                            f"contents differ from those the index records): the two files do not belong together; "
                            f"{fix}")

    def __len__(self) -> int:
        return len(self.lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    def sequence(self, i: int, start: int = 0, stop: int | None = None) -> np.ndarray:
        """Tokens [start, stop) of sequence i (a view into the memory map)."""
        first = int(self.pointers[i]) // self.dtype.itemsize
        length = int(self.lengths[i])
        stop = length if stop is None else stop
        return self.tokens[first + start : first + stop]

    def token_range(self) -> tuple[int, int]:
        """(smallest, largest) token id in `.bin`, scanned in chunks; (0, -1) when empty."""
        low = high = None
        for begin in range(0, len(self.tokens), SCAN_CHUNK):
            chunk = self.tokens[begin : begin + SCAN_CHUNK]
            chunk_low, chunk_high = int(chunk.min()), int(chunk.max())
            low = chunk_low if low is None else min(low, chunk_low)
            high = chunk_high if high is None else max(high, chunk_high)
        return (0, -1) if low is None else (low, high)

    def identity(self) -> dict:
        """What makes the files these files: cached indices and checks are keyed by it."""
        return {"prefix": os.path.realpath(self.prefix), "idx_bytes": os.path.getsize(self.idx_path),
                "bin_bytes": self.bin_bytes, "idx_mtime_ns": os.stat(self.idx_path).st_mtime_ns,
                "bin_mtime_ns": os.stat(self.bin_path).st_mtime_ns}


class IndexedDatasetWriter:
    """Writes PREFIX.bin/.idx as Megatron's IndexedDatasetBuilder does (one sequence per document),
    plus the record of the `.bin` (module docstring), under temporary names renamed into place by
    `finalize`; an error inside `with` removes them and leaves any earlier PREFIX.bin/.idx as they were."""

    def __init__(self, prefix: str, dtype: np.dtype):
        self.prefix = prefix
        self.dtype = np.dtype(dtype)
        if self.dtype not in DTYPE_CODES or self.dtype.kind not in "iu":
            raise UserError(f"dtype {self.dtype} cannot store token ids (token ids are integers); use one of "
                            f"{sorted(str(np.dtype(d)) for d in DTYPES.values() if np.dtype(d).kind in 'iu')}")
        self._limits = np.iinfo(self.dtype)
        Path(prefix).parent.mkdir(parents=True, exist_ok=True)
        self._tmp_bin, self._tmp_idx = temporary_path(prefix + ".bin"), temporary_path(prefix + ".idx")
        self._bin = open(self._tmp_bin, "wb")
        self._lengths: list[int] = []

    def add_document(self, ids) -> None:
        array = np.asarray(ids)
        if array.size > np.iinfo(np.int32).max:  # before a scan of it: lengths are int32 in the index
            raise UserError(f"{self.prefix}: a document of {array.size:,} tokens; the index holds at most "
                            f"{np.iinfo(np.int32).max:,} per document: split it")
        if array.size:
            if array.dtype.kind not in "iu":
                raise UserError(f"{self.prefix}: a document of {array.dtype} token ids; token ids are integers: "
                                f"pass the tokenizer's ids")
            low, high = int(array.min()), int(array.max())
            if low < self._limits.min or high > self._limits.max:
                bad = low if low < self._limits.min else high
                raise UserError(f"{self.prefix}: token id {bad} does not fit {self.dtype} "
                                f"[{self._limits.min}, {self._limits.max}]: write the dataset with a wider dtype")
        array = array.astype(self.dtype, copy=False)
        self._bin.write(array.tobytes(order="C"))
        self._lengths.append(len(array))

    def finalize(self) -> None:
        self._bin.close()
        lengths = np.asarray(self._lengths, dtype=np.int32)
        pointers = np.zeros(len(lengths), dtype=np.int64)
        np.cumsum(lengths[:-1].astype(np.int64) * self.dtype.itemsize, out=pointers[1:])
        document_indices = np.arange(len(lengths) + 1, dtype=np.int64)
        bin_bytes = os.path.getsize(self._tmp_bin)
        with open(self._tmp_idx, "wb") as file:
            file.write(MAGIC)
            file.write(struct.pack("<Q", VERSION))
            file.write(struct.pack("<B", DTYPE_CODES[self.dtype]))
            file.write(struct.pack("<Q", len(lengths)))
            file.write(struct.pack("<Q", len(document_indices)))
            file.write(lengths.tobytes(order="C"))
            file.write(pointers.tobytes(order="C"))
            file.write(document_indices.tobytes(order="C"))
            file.write(TRAILER_MAGIC + struct.pack("<BQ", TRAILER_VERSION, bin_bytes)
                       + sampled_digest(self._tmp_bin, bin_bytes))
        # The .idx first: stopped between the two, the new .idx refuses the old .bin by its record.
        os.replace(self._tmp_idx, self.prefix + ".idx")
        os.replace(self._tmp_bin, self.prefix + ".bin")

    def __enter__(self) -> IndexedDatasetWriter:
        return self

    def __exit__(self, kind, value, traceback) -> None:
        if kind is None:
            self.finalize()
            return
        self._bin.close()
        for path in (self._tmp_bin, self._tmp_idx):
            if os.path.exists(path):
                os.remove(path)
