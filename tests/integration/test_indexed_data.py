"""Tests for Megatron indexed data: format, preprocessing, splits, blends, document ids, the cached
sample index, resume and data-parallel determinism, validation passes and input errors."""

import os
import struct

import numpy as np
import pytest
from tokenizers import Tokenizer

from dtrain.data import BUNDLED_TOKENIZER
from dtrain.data.indexed import IndexedDataset
from tools.preprocess_data import preprocess
from tests.unit.test_indexed_data import jsonl  # noqa: F401  (a fixture of these tests)


@pytest.mark.parametrize("workers", [1, 2])
def test_preprocess_reads_back_token_for_token(tmp_path, jsonl, workers):
    path, texts = jsonl
    prefix = str(tmp_path / "out")
    counts = preprocess(str(path), prefix, tokenizer=str(BUNDLED_TOKENIZER), append_eod=True, workers=workers)
    tokenizer = Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    eod = tokenizer.token_to_id("<|endoftext|>")
    expected = [tokenizer.encode(text, add_special_tokens=False).ids + [eod] for text in texts]
    read = IndexedDataset(prefix)
    assert counts["documents"] == len(read) == read.num_documents == len(expected) and counts["empty"] == 1
    assert [read.sequence(i).tolist() for i in range(len(read))] == expected
    # The bytes are Megatron's: header, uint16 (code 8) below 65,500 tokens, pointers, document indices.
    raw = open(prefix + ".idx", "rb").read()
    assert raw[:9] == b"MMIDIDX\x00\x00" and struct.unpack("<QBQQ", raw[9:34]) == (1, 8, len(expected), len(expected) + 1)
    lengths = np.frombuffer(raw, "<i4", len(expected), 34)
    pointers = np.frombuffer(raw, "<i8", len(expected), 34 + 4 * len(expected))
    assert lengths.tolist() == [len(ids) for ids in expected]
    assert pointers.tolist() == (np.concatenate([[0], np.cumsum(lengths)[:-1]]) * 2).tolist()
    assert os.path.getsize(prefix + ".bin") == 2 * sum(map(len, expected))
