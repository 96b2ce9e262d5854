"""Training data: the bundled corpus, a local text file (tokenized once into the data cache, see
dtrain/data/text.py), synthetic tokens, or indexed data in Megatron's format (`--data PREFIX` or a
blend `--data "0.7 PREFIX_A 0.3 PREFIX_B"`, see dtrain/data/blend.py).

A batch is a pure function of (seed, step), so a run is reproducible and sees the same
global batches whatever its data-parallel layout.
"""

from __future__ import annotations

import operator
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import torch

from dtrain.data import text
from dtrain.data.blend import DEFAULT_SPLIT, IndexedBlend, parse_blend, parse_split
from dtrain.data.indexed import check_files, is_indexed_prefix
from dtrain.data.packed import PARTS, default_cache_dir
from models.errors import UserError

BUNDLED = "bundled"      # the default --data value: dtrain/assets/corpus.txt + tokenizer.json
SYNTHETIC = "synthetic"  # random tokens, for benchmarks

ASSETS_DIR = Path(__file__).resolve().parent.parent / "assets"
BUNDLED_CORPUS = ASSETS_DIR / "corpus.txt"
BUNDLED_TOKENIZER = ASSETS_DIR / "tokenizer.json"
END_OF_TEXT = text.END_OF_TEXT
TEXT, INDEXED = "text", "indexed"


def data_kind(data: str) -> str:
    """BUNDLED, SYNTHETIC, TEXT (a text file) or INDEXED (a .bin/.idx prefix or a blend of them)."""
    if data in (BUNDLED, SYNTHETIC):
        return data
    if data.endswith((".bin", ".idx")) or is_indexed_prefix(data):
        return INDEXED
    if os.path.isfile(data) and data.endswith((".jsonl", ".json")):
        # Read as text it would train on the JSON's quotes and keys.
        prefix = data.rsplit(".", 1)[0]
        raise UserError(f"--data {data!r} is JSON: tokenize it first with python -m tools.preprocess_data --input "
                        f"{data} --output-prefix {prefix}, then pass --data {prefix}")
    if os.path.isfile(data):
        return TEXT
    if len(data.split()) > 1:
        return INDEXED  # a blend: its syntax and files are checked by validate_data_args
    raise UserError(
        f"--data {data!r} is neither {BUNDLED!r}, {SYNTHETIC!r}, an existing text file nor an indexed "
        f"dataset ({data}.bin + {data}.idx): pass one of those, or a blend such as \"0.7 PREFIX_A 0.3 PREFIX_B\""
    )


def validate_data_args(data: str, tokenizer: str | None, split: str | None = None,
                       synthetic_document_length: int = 0) -> None:
    """Cheap checks before any model memory is allocated: raise UserError (one line, says what to change)
    when `data` is neither BUNDLED, SYNTHETIC, an existing text file nor indexed data whose files exist
    and whose blend weights parse, when `split` does not parse, when `tokenizer` is given and is not an
    existing file, or when synthetic documents are asked of other data or with a negative length."""
    if synthetic_document_length < 0:
        raise UserError(f"--synthetic-document-length {synthetic_document_length} must be >= 0 (0: one "
                        f"document per sample)")
    if synthetic_document_length and data != SYNTHETIC:
        raise UserError(f"--synthetic-document-length packs documents into synthetic samples; use it with "
                        f"--data synthetic (--data {data!r} has its own documents)")
    if data_kind(data) == INDEXED:
        for _, prefix in parse_blend(data):
            check_files(prefix)
    if split is not None:
        parse_split(split)
    if tokenizer is not None and not os.path.isfile(tokenizer):
        raise UserError(
            f"--tokenizer {tokenizer!r} is not an existing file: pass the path of a Hugging Face "
            f"tokenizer.json, or leave it out to use the bundled tokenizer"
        )


def _check_positive(**values: int) -> None:
    for name, value in values.items():
        try:
            valid = operator.index(value) >= 1
        except TypeError:
            valid = False
        if not valid:
            raise UserError(f"{name} = {value!r} must be a positive integer: pass a value >= 1")


def _synthetic_seed(seed: int, step: int, row: int) -> int:
    """A 64-bit mix of (seed, step, row) (splitmix64), the same in every process.

    Python's hash() is avoided on purpose: it is salted per process for str and not
    specified to be stable across versions.
    """
    mask = (1 << 64) - 1
    seed, step, row = int(seed), int(step), int(row)  # Python ints: numpy ones would overflow
    x = (seed * 0x9E3779B97F4A7C15 + step * 0xD1B54A32D192ED03 + row * 0x8CB92BA72F3D8DD7) & mask
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & mask
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & mask
    return x ^ (x >> 31)


class MicroBatch(tuple):
    """`(inputs, labels)`, each [micro_batch, seq_len] int64, unpacking as the plain pair always did.

    When the dataset was built with `documents=True` it also carries, per sample, `position_ids`
    (position of each input token within its document: 0 at the row start and after every document
    boundary) and `document_ids` (0 for the row's first document, +1 at each boundary), both
    [micro_batch, seq_len] int64: attention from token q to token k is allowed when k <= q and
    document_ids[q] == document_ids[k]. Otherwise both are None.

    Boundaries: for indexed data, where one sequence of the index ends and the next begins (so after
    the end-of-document token when preprocessing appended one, and without relying on one); for a
    text corpus, after each <|endoftext|> token, as Megatron resets at its EOD token.
    """

    position_ids: torch.Tensor | None
    document_ids: torch.Tensor | None

    def __new__(cls, inputs: torch.Tensor, labels: torch.Tensor, position_ids: torch.Tensor | None = None,
                document_ids: torch.Tensor | None = None):
        batch = super().__new__(cls, (inputs, labels))
        batch.position_ids, batch.document_ids = position_ids, document_ids
        return batch

    @property
    def inputs(self) -> torch.Tensor:
        return self[0]

    @property
    def labels(self) -> torch.Tensor:
        return self[1]


def positions_from_documents(document_ids: torch.Tensor) -> torch.Tensor:
    """Position ids [n, s] that restart at 0 wherever the document id changes along a row."""
    steps = torch.arange(document_ids.shape[1], dtype=torch.int64).expand_as(document_ids)
    starts_here = torch.ones_like(document_ids, dtype=torch.bool)
    starts_here[:, 1:] = document_ids[:, 1:] != document_ids[:, :-1]
    document_start = torch.where(starts_here, steps, torch.zeros_like(steps)).cummax(dim=1).values
    return steps - document_start


class TokenDataset:
    """Deterministic source of training batches. Every data-parallel rank builds the same object; the
    global batch of a step is a pure function of (seed, step), and each data-parallel rank takes its own
    contiguous rows of it, so the same global batch is seen whatever the number of data-parallel ranks.

    `part` picks the train, validation or test documents of indexed data (by `split`); synthetic data
    draws an independent stream per part; a text corpus is used whole and has only a train part.
    `cache_dir` holds indexed data's sample indices and a text file's tokens (default: a directory
    beside the data; none for the bundled corpus, which is tokenized in memory).
    `documents=True` makes micro_batches carry position and document ids (see MicroBatch). Synthetic
    rows hold one document each, or with `synthetic_document_length=m` documents of random lengths
    (a boundary after each token with probability 1/m: geometric lengths of mean m), drawn per row
    from (seed, step, row) apart from the tokens, which stay the same."""

    vocab_size: int  # the tokenizer's vocab size (for synthetic and indexed data: the model vocab given)

    def __init__(self, data: str, tokenizer: str | None, seq_len: int, model_vocab_size: int, seed: int, *,
                 part: str = "train", split: str = DEFAULT_SPLIT, cache_dir: str | None = None,
                 documents: bool = False, synthetic_document_length: int = 0):
        validate_data_args(data, tokenizer, synthetic_document_length=synthetic_document_length)
        _check_positive(seq_len=seq_len, model_vocab_size=model_vocab_size)
        if part not in PARTS:
            raise UserError(f"part = {part!r} must be one of {PARTS}")
        self.seq_len = seq_len
        self.seed = seed
        self.part = part
        self.documents = documents
        self.synthetic_document_length = synthetic_document_length
        kind = data_kind(data)
        self._synthetic = kind == SYNTHETIC
        self._indexed: IndexedBlend | None = None
        self._end_of_text: int | None = None
        self._permutations: dict[int, torch.Tensor] = {}
        if self._synthetic:
            if model_vocab_size < 2:
                raise UserError(f"synthetic data needs a model vocab_size >= 2, got {model_vocab_size}: "
                                f"choose a larger vocab_size")
            self.vocab_size = model_vocab_size
            return
        if kind == INDEXED:
            self._indexed = IndexedBlend(data, part, split, seq_len, seed, cache_dir, model_vocab_size)
            self.vocab_size = model_vocab_size
            return
        if part != "train":
            raise UserError(f"--data {data!r} is a text corpus, used whole for training, so it has no {part} "
                            f"part: for evaluation pass indexed data (tools/preprocess_data.py) and --split")

        text_path = str(BUNDLED_CORPUS) if data == BUNDLED else data
        tokenizer_path = str(BUNDLED_TOKENIZER) if tokenizer is None else tokenizer
        # The bundled corpus is small and ships with the package: no cache unless one is asked for.
        if cache_dir is None and data != BUNDLED:
            cache_dir = default_cache_dir(text_path)
        self._text_path, self._text = text_path, text.load(text_path, tokenizer_path, cache_dir)
        self._tokens, self.vocab_size, self._end_of_text = self._text.ids, self._text.vocab_size, self._text.end_of_text
        if len(self._tokens) < seq_len + 1:
            raise UserError(f"{text_path!r} has {len(self._tokens)} tokens, fewer than seq_len + 1 = "
                            f"{seq_len + 1}: use a longer text or a shorter seq_len")
        largest_id = self._text.max_id
        if largest_id >= model_vocab_size:
            raise UserError(f"tokenizer vocab size {self.vocab_size} does not fit the model vocab size "
                            f"{model_vocab_size} (token id {largest_id} found): choose a model whose "
                            f"vocab_size >= {self.vocab_size} or another tokenizer")
        # Non-overlapping windows of seq_len + 1 tokens; neighbours share one boundary token so
        # that every token is a label exactly once per epoch.
        self._num_windows = (len(self._tokens) - 1) // seq_len

    def describe(self) -> str:
        """What the run trains on, in one line: the documents and tokens of the data."""
        if self._synthetic:
            return f"synthetic: random token ids below {self.vocab_size}"
        if self._indexed is not None:
            return self._indexed.describe()
        return (f"{self._text_path}: {len(self._tokens):,} tokens, {self._text.documents:,} documents, "
                f"{self._num_windows:,} samples of {self.seq_len + 1} tokens per epoch")

    @classmethod
    def from_args(cls, data_args, model_vocab_size: int, seed: int, part: str = "train") -> TokenDataset:
        """The dataset that config.DataArgs describes; documents are on when --reset-position-ids or
        --document-mask asks for them."""
        return cls(data_args.data, data_args.tokenizer, data_args.seq_len, model_vocab_size, seed, part=part,
                   split=data_args.split, cache_dir=data_args.data_cache_dir,
                   documents=data_args.reset_position_ids or data_args.document_mask,
                   synthetic_document_length=data_args.synthetic_document_length)

    def global_batch(self, step: int, global_batch_size: int) -> torch.Tensor:
        """int64 tensor [global_batch_size, seq_len + 1] of token ids for this step (CPU)."""
        _check_positive(global_batch_size=global_batch_size)
        return self._rows(step, global_batch_size, 0, global_batch_size)[0]

    def micro_batches(self, step: int, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                      dp_size: int, first_sample: int | None = None) -> list[MicroBatch]:
        """This rank's rows of global_batch(step) (rows [dp_rank*n : (dp_rank+1)*n], n = global_batch_size // dp_size),
        cut into micro-batches of micro_batch_size rows, each a MicroBatch that unpacks as (inputs [mb, seq_len],
        labels [mb, seq_len]) with labels = inputs shifted by one token, and carries position_ids and
        document_ids when the dataset has documents=True. Validates divisibility with a UserError.

        `first_sample` (default step x global_batch_size) is where the batch starts in the sample stream
        of a text corpus or indexed data: a run resumed with another global batch passes the samples
        consumed so far. Synthetic rows are drawn per (step, row) and never repeat either way."""
        _check_positive(global_batch_size=global_batch_size, micro_batch_size=micro_batch_size,
                        dp_size=dp_size)
        if not 0 <= dp_rank < dp_size:
            raise UserError(f"dp_rank = {dp_rank} is outside [0, dp_size = {dp_size}): pass a rank below dp_size")
        if global_batch_size % dp_size:
            raise UserError(f"global batch size {global_batch_size} is not divisible by the data-parallel "
                            f"size {dp_size}: choose a global batch size that is a multiple of {dp_size}")
        rows_per_rank = global_batch_size // dp_size
        if rows_per_rank % micro_batch_size:
            raise UserError(f"the {rows_per_rank} rows per data-parallel rank (global batch size "
                            f"{global_batch_size} / dp size {dp_size}) are not divisible by the micro batch "
                            f"size {micro_batch_size}: choose a micro batch size that divides {rows_per_rank}")
        # Only this rank's rows are built; they equal the matching rows of global_batch(step).
        rows, documents = self._rows(step, global_batch_size, dp_rank * rows_per_rank, rows_per_rank,
                                     self.documents, first_sample)
        batches = []
        for first in range(0, rows_per_rank, micro_batch_size):
            chunk = rows[first : first + micro_batch_size]
            position_ids = document_ids = None
            if documents is not None:
                document_ids = documents[first : first + micro_batch_size, :-1].contiguous()
                position_ids = positions_from_documents(document_ids)
            batches.append(MicroBatch(chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous(), position_ids,
                                      document_ids))
        return batches

    def eval_steps(self, requested: int, global_batch_size: int) -> int:
        """Global batches in one evaluation pass: `requested`, capped so that no sample of this part is
        seen twice in a pass (indexed data). The same on every rank."""
        _check_positive(eval_steps=requested, global_batch_size=global_batch_size)
        if self._indexed is None:
            return requested
        available = self._indexed.samples_before_repeat() // global_batch_size
        if available == 0:
            raise UserError(f"the {self.part} part holds {self._indexed.samples_before_repeat()} samples of "
                            f"seq_len {self.seq_len}, fewer than one global batch of {global_batch_size}: give "
                            f"it a larger share of --split, use more data or a smaller --global-batch")
        return min(requested, available)

    def eval_micro_batches(self, eval_steps: int, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                           dp_size: int) -> Iterator[MicroBatch]:
        """One evaluation pass for this rank: the micro-batches of steps 0 .. eval_steps(eval_steps) - 1
        of this part's stream, so every pass sees the same samples and the losses are comparable."""
        for step in range(self.eval_steps(eval_steps, global_batch_size)):
            yield from self.micro_batches(step, global_batch_size, micro_batch_size, dp_rank, dp_size)

    def _rows(self, step: int, global_batch_size: int, first_row: int, num_rows: int,
              with_documents: bool = False, first_sample: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Rows [first_row, first_row + num_rows) of the global batch of `step`: token ids
        [num_rows, seq_len + 1] and, if asked, the document number of each token in its row."""
        step = operator.index(step)
        if step < 0:
            raise UserError(f"step = {step} must be >= 0")
        if self._synthetic:
            rows = self._synthetic_rows(step, first_row, num_rows)
            return rows, self._synthetic_documents(step, first_row, num_rows) if with_documents else None
        # Global batch `step` is samples [step * G, (step + 1) * G) of the endless sample stream.
        first_sample = step * global_batch_size if first_sample is None else first_sample
        sample_ids = torch.arange(num_rows, dtype=torch.int64) + (first_sample + first_row)
        if self._indexed is not None:
            rows, documents = self._indexed.rows(sample_ids.numpy(), with_documents)
            return torch.from_numpy(rows), None if documents is None else torch.from_numpy(documents)
        starts = self._window_starts(sample_ids)
        offsets = starts[:, None] + torch.arange(self.seq_len + 1, dtype=torch.int64)
        rows = torch.from_numpy(self._tokens[offsets.numpy()].astype(np.int64))
        if not with_documents:
            return rows, None
        if self._end_of_text is None:
            return rows, torch.zeros_like(rows)
        # A new document starts after each end-of-text token, as Megatron resets at its EOD token.
        ends = (rows == self._end_of_text).to(torch.int64)
        return rows, ends.cumsum(dim=1) - ends

    def _window_starts(self, sample_ids: torch.Tensor) -> torch.Tensor:
        """Token offsets of the windows at these positions of the endless stream.

        Epoch e of the stream is a permutation of all windows seeded with seed + e, so
        the stream never ends and no window repeats within an epoch.
        """
        epochs = sample_ids // self._num_windows
        positions = sample_ids % self._num_windows
        windows = torch.empty_like(sample_ids)
        for epoch in epochs.unique().tolist():
            in_epoch = epochs == epoch
            windows[in_epoch] = self._permutation(epoch)[positions[in_epoch]]
        return windows * self.seq_len

    def _permutation(self, epoch: int) -> torch.Tensor:
        if epoch not in self._permutations:
            if len(self._permutations) >= 4:  # training moves forward: keep only recent epochs
                self._permutations.pop(min(self._permutations))
            generator = torch.Generator().manual_seed(self.seed + epoch)
            self._permutations[epoch] = torch.randperm(self._num_windows, generator=generator)
        return self._permutations[epoch]

    def _synthetic_documents(self, step: int, first_row: int, num_rows: int) -> torch.Tensor:
        """Document numbers [num_rows, seq_len + 1] of synthetic rows (see the class docstring)."""
        mean = self.synthetic_document_length
        if mean == 0:
            return torch.zeros(num_rows, self.seq_len + 1, dtype=torch.int64)
        boundaries = torch.empty(num_rows, self.seq_len + 1, dtype=torch.bool)
        generator = torch.Generator()
        step += PARTS.index(self.part) << 48
        for i in range(num_rows):
            # Another stream than the row's tokens (their seed with the top bit flipped).
            generator.manual_seed(_synthetic_seed(self.seed, step, first_row + i) ^ (1 << 63))
            boundaries[i] = torch.rand(self.seq_len + 1, generator=generator) < 1.0 / mean
        boundaries[:, 0] = False
        return boundaries.to(torch.int64).cumsum(dim=1)

    def _synthetic_rows(self, step: int, first_row: int, num_rows: int) -> torch.Tensor:
        # One generator per row, so a rank draws only its own rows and still matches global_batch.
        rows = torch.empty(num_rows, self.seq_len + 1, dtype=torch.int64)
        generator = torch.Generator()
        # Validation and test streams sit far beyond any train step, so they never repeat its rows.
        step += PARTS.index(self.part) << 48
        for i in range(num_rows):
            generator.manual_seed(_synthetic_seed(self.seed, step, first_row + i))
            rows[i] = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=generator)
        return rows
