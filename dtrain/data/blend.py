"""Indexed data as `--data` names it, in Megatron's syntax: one prefix (`data/web`) or a weighted
blend (`"0.7 data/web 0.3 data/code"`), each dataset split into train/validation/test documents by
`--split 969,30,1`, and the samples of the blend drawn from each dataset in proportion to its weight.
"""

from __future__ import annotations

import functools
import math

import numpy as np

from dtrain.data.indexed import IndexedDataset
from dtrain.data.packed import PARTS, PackedSamples, default_cache_dir, token_range
from models.errors import UserError

DEFAULT_SPLIT = "969,30,1"
# The blend's dataset choice is computed for this many samples and repeated: a pure function of
# the sample number in O(1), with counts within one sample of the weights over every prefix.
BLEND_PERIOD = 1 << 14
BLEND_EXAMPLE = '"0.7 data/web 0.3 data/code"'


def parse_blend(text: str) -> list[tuple[float, str]]:
    """`PREFIX` -> [(1.0, PREFIX)]; `W1 P1 W2 P2 ...` -> [(W1, P1), ...] (weights as given)."""
    items = text.split()
    if not items:
        raise UserError(f"--data {text!r} is empty: pass a dataset prefix or a blend such as {BLEND_EXAMPLE}")
    if len(items) == 1:
        return [(1.0, items[0])]
    if len(items) % 2:
        raise UserError(f"--data {text!r} has {len(items)} items, an odd number: a blend is pairs "
                        f"WEIGHT PREFIX, e.g. {BLEND_EXAMPLE}; give every prefix a weight")
    pairs = []
    for weight_text, prefix in zip(items[::2], items[1::2]):
        try:
            weight = float(weight_text)
        except ValueError:
            raise UserError(f"--data {text!r}: weight {weight_text!r} (of {prefix!r}) is not a number: a "
                            f"blend is pairs WEIGHT PREFIX, e.g. {BLEND_EXAMPLE}") from None
        if not math.isfinite(weight) or weight < 0:
            raise UserError(f"--data {text!r}: weight {weight_text} of {prefix!r} must be a finite number "
                            f">= 0: fix that weight")
        pairs.append((weight, prefix))
    if sum(weight for weight, _ in pairs) == 0:
        raise UserError(f"--data {text!r}: every weight is 0: give at least one dataset a weight > 0")
    return pairs


def parse_split(text: str) -> tuple[float, float, float]:
    """`969,30,1` (or `969/30/1`, or fewer parts, the rest 0) -> train/validation/test fractions."""
    parts = [part.strip() for part in str(text).replace("/", ",").split(",")]
    fix = "write train,validation,test shares, e.g. --split 969,30,1"
    if len(parts) > 3:
        raise UserError(f"--split {text!r} has {len(parts)} parts, more than 3: {fix}")
    try:
        values = [float(part) for part in parts]
    except ValueError:
        raise UserError(f"--split {text!r} is not comma-separated numbers: {fix}") from None
    if any(not math.isfinite(value) or value < 0 for value in values) or sum(values) <= 0:
        raise UserError(f"--split {text!r} needs finite shares >= 0 that do not all equal 0: {fix}")
    values += [0.0] * (3 - len(values))
    total = sum(values)
    return tuple(value / total for value in values)


def split_ranges(fractions: tuple[float, ...], count: int) -> list[tuple[int, int]]:
    """Document ranges of the parts: cumulative shares times the count, rounded, exactly as
    Megatron-Core's dataset builder rounds them, so that a split of the same files holds the same
    documents in both frameworks. (Like Megatron's GPTDataset, a "document" is one sequence of the
    index, which is one document unless the data was preprocessed with sentence splitting.)"""
    bounds, total = [0.0], 0.0
    for fraction in fractions:
        total += fraction  # summed in this order, as Megatron sums, for the same float rounding
        bounds.append(total)
    return [(int(round(low * float(count))), int(round(high * float(count))))
            for low, high in zip(bounds[:-1], bounds[1:])]


@functools.lru_cache(maxsize=16)
def blend_pattern(weights: tuple[float, ...]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Megatron's deterministic blending over one period: sample s goes to the dataset whose count
    is furthest below its share (weight x s). Returns (dataset of each sample, its number within
    that dataset, samples per dataset in the period)."""
    share = np.asarray(weights, dtype=np.float64) / sum(weights)
    period = 1 if len(weights) == 1 else BLEND_PERIOD
    counts = np.zeros(len(weights), dtype=np.int64)
    which = np.empty(period, dtype=np.int64)
    within = np.empty(period, dtype=np.int64)
    for sample in range(period):
        dataset = int(np.argmax(share * max(sample, 1) - counts))
        which[sample], within[sample] = dataset, counts[dataset]
        counts[dataset] += 1
    return which, within, counts


class IndexedBlend:
    """The endless sample stream of one split part of a blend of indexed datasets."""

    def __init__(self, data: str, part: str, split: str, seq_len: int, seed: int, cache_dir: str | None,
                 model_vocab_size: int):
        if part not in PARTS:
            raise UserError(f"split part {part!r} is not one of {PARTS}")
        pairs = parse_blend(data)
        fractions = parse_split(split)
        if fractions[PARTS.index(part)] == 0:
            raise UserError(f"--split {split} gives the {part} part no share: give it one, e.g. 969,30,1")
        self.seq_len = seq_len
        self.sources: list[PackedSamples] = []
        for weight, prefix in pairs:
            dataset = IndexedDataset(prefix)
            directory = cache_dir or default_cache_dir(dataset.prefix)
            _check_vocab(dataset, directory, model_vocab_size)
            first, end = split_ranges(fractions, len(dataset))[PARTS.index(part)]
            source = PackedSamples(dataset, first, end, seq_len, seed, part, directory)
            if weight > 0 and source.samples_per_epoch == 0:
                raise UserError(
                    f"the {part} part of {dataset.prefix} (documents {first}..{end} of {len(dataset)} by "
                    f"--split {split}) holds {source.tokens} tokens, fewer than seq_len + 1 = {seq_len + 1}: "
                    f"use more data, a shorter --seq-len or a larger {part} share of --split")
            self.sources.append(source)
        self.weights = tuple(weight for weight, _ in pairs)
        self._which, self._within, self._counts = blend_pattern(self.weights)

    def locate(self, sample_ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(dataset, sample number within that dataset's stream) of each blend sample."""
        block, position = np.divmod(np.asarray(sample_ids, dtype=np.int64), len(self._which))
        which = self._which[position]
        return which, block * self._counts[which] + self._within[position]

    def rows(self, sample_ids: np.ndarray, with_documents: bool) -> tuple[np.ndarray, np.ndarray | None]:
        which, within = self.locate(sample_ids)
        tokens = np.empty((len(which), self.seq_len + 1), dtype=np.int64)
        documents = np.empty_like(tokens) if with_documents else None
        for dataset in np.unique(which).tolist():
            chosen = which == dataset
            part_tokens, part_documents = self.sources[dataset].rows(within[chosen], with_documents)
            tokens[chosen] = part_tokens
            if documents is not None:
                documents[chosen] = part_documents
        return tokens, documents

    def describe(self) -> str:
        """Each dataset's documents and tokens, and those of this part (one line)."""
        lines = []
        for weight, source in zip(self.weights, self.sources):
            dataset = source.dataset
            total = int(dataset.lengths.sum(dtype=np.int64))
            share = f"{weight:g} x " if len(self.sources) > 1 else ""
            lines.append(f"{share}{dataset.prefix}: {len(dataset):,} documents, {total:,} tokens (the {source.part} "
                         f"part: {source.count:,} documents, {source.tokens:,} tokens)")
        return "; ".join(lines)

    def samples_before_repeat(self) -> int:
        """Blend samples served before any dataset starts its second epoch (one validation pass)."""
        first_repeat = []
        for dataset, source in enumerate(self.sources):
            if self._counts[dataset]:
                block, remainder = divmod(source.samples_per_epoch, int(self._counts[dataset]))
                hits = np.flatnonzero((self._which == dataset) & (self._within == remainder))
                first_repeat.append(block * len(self._which) + int(hits[0]))
        return min(first_repeat)


def _check_vocab(dataset: IndexedDataset, cache_dir: str, model_vocab_size: int) -> None:
    # An id outside the embedding table would crash on the GPU mid-run, or silently read another
    # rank's shard under a vocab-parallel embedding: refuse it before training starts.
    if dataset.dtype.kind == "u" and np.iinfo(dataset.dtype).max < model_vocab_size:
        return  # every value the dtype can hold is a valid id: no scan needed
    low, high = token_range(dataset, cache_dir)
    if low < 0 or high >= model_vocab_size:
        raise UserError(f"{dataset.bin_path} holds token ids from {low} to {high}, outside the model "
                        f"vocabulary [0, {model_vocab_size}): choose a model with vocab_size > {high} "
                        f"(e.g. --model-overrides vocab_size={high + 1}) or tokenize the data with the "
                        f"model's tokenizer")
