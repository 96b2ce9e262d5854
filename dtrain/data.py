"""Training data: the bundled corpus, a local text file, or synthetic tokens.

A batch is a pure function of (seed, step), so a run is reproducible and sees the same
global batches whatever its data-parallel layout.
"""

from __future__ import annotations

import functools
import operator
import os
from pathlib import Path

import torch
from tokenizers import Tokenizer

from models.errors import UserError

BUNDLED = "bundled"      # the default --data value: dtrain/assets/corpus.txt + tokenizer.json
SYNTHETIC = "synthetic"  # random tokens, for benchmarks

ASSETS_DIR = Path(__file__).resolve().parent / "assets"
BUNDLED_CORPUS = ASSETS_DIR / "corpus.txt"
BUNDLED_TOKENIZER = ASSETS_DIR / "tokenizer.json"
END_OF_TEXT = "<|endoftext|>"


def validate_data_args(data: str, tokenizer: str | None) -> None:
    """Cheap checks before any model memory is allocated: raise UserError (one line, says what to change)
    when `data` is neither BUNDLED, SYNTHETIC nor an existing text file path, or when `tokenizer` is given
    and is not an existing file."""
    if data not in (BUNDLED, SYNTHETIC) and not os.path.isfile(data):
        raise UserError(
            f"--data {data!r} is neither {BUNDLED!r}, {SYNTHETIC!r} nor an existing text file: "
            f"pass one of those"
        )
    if tokenizer is not None and not os.path.isfile(tokenizer):
        raise UserError(
            f"--tokenizer {tokenizer!r} is not an existing file: pass the path of a Hugging Face "
            f"tokenizer.json, or leave it out to use the bundled tokenizer"
        )


def _load_tokenizer(path: str) -> Tokenizer:
    try:
        return Tokenizer.from_file(path)
    except Exception as error:  # tokenizers raises a bare Exception for malformed files
        reason = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise UserError(f"--tokenizer {path!r} is not a Hugging Face tokenizer.json ({reason}): "
                        f"pass a file saved by tokenizers.Tokenizer.save") from None


@functools.lru_cache(maxsize=4)
def _tokenize(text_path: str, tokenizer_path: str, mtimes: tuple[int, int]) -> tuple[torch.Tensor, int]:
    """Token ids of the whole file (int32, end-of-text appended) and the tokenizer's vocab size.

    Cached because every TokenDataset in a process would otherwise re-tokenize the same file;
    `mtimes` is part of the key so an edited file is tokenized again.
    """
    tokenizer = _load_tokenizer(tokenizer_path)
    try:
        text = Path(text_path).read_text(encoding="utf-8")
    except UnicodeDecodeError as error:
        raise UserError(f"--data {text_path!r} is not UTF-8 text ({error.reason} at byte {error.start}): "
                        f"convert it to UTF-8") from None
    # The file is one document; a literal <|endoftext|> inside it is encoded as the special
    # token, so a file can also hold several documents separated that way.
    ids = tokenizer.encode(text, add_special_tokens=False).ids
    end_of_text = tokenizer.token_to_id(END_OF_TEXT)
    if end_of_text is not None:
        ids.append(end_of_text)
    # int32 halves the memory of a large corpus; rows are widened to int64 when gathered.
    return torch.tensor(ids, dtype=torch.int32), tokenizer.get_vocab_size(with_added_tokens=True)


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


class TokenDataset:
    """Deterministic source of training batches. Every data-parallel rank builds the same object; the
    global batch of a step is a pure function of (seed, step), and each data-parallel rank takes its own
    contiguous rows of it, so the same global batch is seen whatever the number of data-parallel ranks."""

    vocab_size: int  # the tokenizer's vocab size (for synthetic: the model vocab given)

    def __init__(self, data: str, tokenizer: str | None, seq_len: int, model_vocab_size: int, seed: int):
        validate_data_args(data, tokenizer)
        _check_positive(seq_len=seq_len, model_vocab_size=model_vocab_size)
        self.seq_len = seq_len
        self.seed = seed
        self._synthetic = data == SYNTHETIC
        self._permutations: dict[int, torch.Tensor] = {}
        if self._synthetic:
            if model_vocab_size < 2:
                raise UserError(f"synthetic data needs a model vocab_size >= 2, got {model_vocab_size}: "
                                f"choose a larger vocab_size")
            self.vocab_size = model_vocab_size
            return

        text_path = str(BUNDLED_CORPUS) if data == BUNDLED else data
        tokenizer_path = str(BUNDLED_TOKENIZER) if tokenizer is None else tokenizer
        mtimes = (os.stat(text_path).st_mtime_ns, os.stat(tokenizer_path).st_mtime_ns)
        self._tokens, self.vocab_size = _tokenize(text_path, tokenizer_path, mtimes)

        if len(self._tokens) < seq_len + 1:
            raise UserError(f"{text_path!r} has {len(self._tokens)} tokens, fewer than seq_len + 1 = "
                            f"{seq_len + 1}: use a longer text or a shorter seq_len")
        largest_id = int(self._tokens.max())
        if largest_id >= model_vocab_size:
            raise UserError(f"tokenizer vocab size {self.vocab_size} does not fit the model vocab size "
                            f"{model_vocab_size} (token id {largest_id} found): choose a model whose "
                            f"vocab_size >= {self.vocab_size} or another tokenizer")
        # Non-overlapping windows of seq_len + 1 tokens; neighbours share one boundary token so
        # that every token is a label exactly once per epoch.
        self._num_windows = (len(self._tokens) - 1) // seq_len

    def global_batch(self, step: int, global_batch_size: int) -> torch.Tensor:
        """int64 tensor [global_batch_size, seq_len + 1] of token ids for this step (CPU)."""
        _check_positive(global_batch_size=global_batch_size)
        return self._rows(step, global_batch_size, 0, global_batch_size)

    def micro_batches(self, step: int, global_batch_size: int, micro_batch_size: int, dp_rank: int,
                      dp_size: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """This rank's rows of global_batch(step) (rows [dp_rank*n : (dp_rank+1)*n], n = global_batch_size // dp_size),
        cut into micro-batches of micro_batch_size rows, each as (inputs [mb, seq_len], labels [mb, seq_len])
        with labels = inputs shifted by one token. Validates divisibility with a UserError."""
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
        rows = self._rows(step, global_batch_size, dp_rank * rows_per_rank, rows_per_rank)
        return [(chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous())
                for chunk in rows.split(micro_batch_size)]

    def _rows(self, step: int, global_batch_size: int, first_row: int, num_rows: int) -> torch.Tensor:
        """Rows [first_row, first_row + num_rows) of the global batch of `step`."""
        step = operator.index(step)
        if step < 0:
            raise UserError(f"step = {step} must be >= 0")
        if self._synthetic:
            return self._synthetic_rows(step, first_row, num_rows)
        # Global batch `step` is samples [step * G, (step + 1) * G) of the endless sample stream.
        sample_ids = torch.arange(num_rows, dtype=torch.int64) + (step * global_batch_size + first_row)
        starts = self._window_starts(sample_ids)
        offsets = starts[:, None] + torch.arange(self.seq_len + 1, dtype=torch.int64)
        return self._tokens[offsets].to(torch.int64)

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

    def _synthetic_rows(self, step: int, first_row: int, num_rows: int) -> torch.Tensor:
        # One generator per row, so a rank draws only its own rows and still matches global_batch.
        rows = torch.empty(num_rows, self.seq_len + 1, dtype=torch.int64)
        generator = torch.Generator()
        for i in range(num_rows):
            generator.manual_seed(_synthetic_seed(self.seed, step, first_row + i))
            rows[i] = torch.randint(0, self.vocab_size, (self.seq_len + 1,), generator=generator)
        return rows
