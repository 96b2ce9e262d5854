"""Token data as a hostile or unlucky user hands it over: a .bin that does not belong to its .idx,
a preprocessor stopped while it overwrites a dataset, token ids that are not integers or do not
fit, text that is not text, and input files of the wrong shape: each is a one-line error that
says what to change (or, where stated, repaired and reported once), never silent wrong data."""

from __future__ import annotations

import io
import json
import os
import shutil
import struct

import numpy as np
import pytest
from tokenizers import Tokenizer

from dtrain.data import BUNDLED_TOKENIZER, TokenDataset
from dtrain.data.indexed import HEADER_BYTES, IndexedDataset, IndexedDatasetWriter
from models.errors import UserError
from tests.unit.test_indexed_data import write_megatron
from tools.preprocess_data import main as preprocess_main, preprocess


SEQ_LEN = 16


TOKENIZER = str(BUNDLED_TOKENIZER)


def dataset(data, tmp_path, vocab=1 << 16, **kwargs):
    return TokenDataset(str(data), None, SEQ_LEN, vocab, 0, cache_dir=str(tmp_path / "cache"), **kwargs)


def one_line(caught) -> str:
    message = str(caught.value)
    assert "\n" not in message, message
    return message


def documents(count: int, seed: int) -> list[list[int]]:
    lengths = np.random.RandomState(seed).randint(20, 60, size=count)
    return [list(range(i, i + length)) for i, length in enumerate(lengths)]


def write_jsonl(path, texts) -> str:
    path.write_text("".join(json.dumps({"text": text}) + "\n" for text in texts), encoding="utf-8")
    return str(path)


TEXTS = [f"Document {i}: the quick brown fox jumps over the lazy dog {i % 7} times." for i in range(200)]


@pytest.mark.parametrize("extra", [2, 400], ids=["one-token", "many"])
def test_a_bin_longer_than_its_index_is_refused(tmp_path, extra):
    prefix = write_megatron(tmp_path / "pair", documents(30, seed=0))
    with open(prefix + ".bin", "ab") as file:
        file.write(b"\x01" * extra)
    with pytest.raises(UserError) as caught:
        dataset(prefix, tmp_path)
    assert f"pair.bin is {os.path.getsize(prefix + '.bin')} bytes but" in one_line(caught)
    assert "describes" in one_line(caught) and "belong together" in one_line(caught)


def test_an_index_from_another_preprocessing_run_is_refused(tmp_path):
    """The same documents in another order: a .bin of exactly the size the .idx expects, with
    other contents. The .idx dtrain writes records the .bin it describes."""
    old, new = tmp_path / "old.jsonl", tmp_path / "new.jsonl"
    preprocess(write_jsonl(old, TEXTS), str(tmp_path / "a"), append_eod=True, tokenizer=TOKENIZER, log=io.StringIO())
    preprocess(write_jsonl(new, TEXTS[::-1]), str(tmp_path / "b"), append_eod=True, tokenizer=TOKENIZER, log=io.StringIO())
    assert os.path.getsize(tmp_path / "a.bin") == os.path.getsize(tmp_path / "b.bin")
    shutil.copy(tmp_path / "b.idx", tmp_path / "a.idx")  # b's index beside a's tokens
    with pytest.raises(UserError, match=r"a.bin is not the file a.idx was written with") as caught:
        IndexedDataset(str(tmp_path / "a"))
    one_line(caught)


def test_the_index_stays_readable_as_megatron_reads_it(tmp_path):
    """Megatron's reader takes the header's counts and reads the three arrays at their offsets,
    ignoring what follows them: the record of the .bin after them changes nothing it reads."""
    prefix = str(tmp_path / "d")
    preprocess(write_jsonl(tmp_path / "d.jsonl", TEXTS), prefix, append_eod=True, tokenizer=TOKENIZER, log=io.StringIO())
    raw = np.memmap(prefix + ".idx", mode="r", order="C")
    assert bytes(raw[:9]) == b"MMIDIDX\x00\x00"
    version, code, sequences, count = struct.unpack("<QBQQ", bytes(raw[9:HEADER_BYTES]))
    buffer = memoryview(raw)
    lengths = np.frombuffer(buffer, np.int32, sequences, HEADER_BYTES)
    pointers = np.frombuffer(buffer, np.int64, sequences, HEADER_BYTES + lengths.nbytes)
    document_indices = np.frombuffer(buffer, np.int64, count, HEADER_BYTES + lengths.nbytes + pointers.nbytes)
    read = IndexedDataset(prefix)
    assert (version, code) == (1, 8)
    assert np.array_equal(lengths, read.lengths) and np.array_equal(pointers, read.pointers)
    assert np.array_equal(document_indices, read.document_indices) and document_indices[-1] == sequences
    assert os.path.getsize(prefix + ".bin") == 2 * int(lengths.sum())


def test_a_failed_preprocessing_run_leaves_the_earlier_dataset_whole(tmp_path):
    prefix = str(tmp_path / "data")
    preprocess(write_jsonl(tmp_path / "good.jsonl", TEXTS), prefix, tokenizer=TOKENIZER, log=io.StringIO())
    before = {suffix: open(prefix + suffix, "rb").read() for suffix in (".bin", ".idx")}
    bad = tmp_path / "bad.jsonl"
    write_jsonl(bad, TEXTS[::-1])
    with open(bad, "a") as file:
        file.write("not json\n")
    with pytest.raises(UserError, match="is not JSON"):
        preprocess(str(bad), prefix, tokenizer=TOKENIZER, log=io.StringIO())
    assert {suffix: open(prefix + suffix, "rb").read() for suffix in (".bin", ".idx")} == before
    assert sorted(os.listdir(tmp_path)) == ["bad.jsonl", "data.bin", "data.idx", "good.jsonl"]


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_float_token_ids_are_refused(tmp_path, dtype):
    tokens = [[1.5, 2.0, float("nan")] + list(range(40))] * 4
    prefix = write_megatron(tmp_path / "floats", tokens, dtype=dtype)
    with pytest.raises(UserError, match=rf"floats.idx stores token ids as {np.dtype(dtype)}; token ids are "
                                        rf"integers") as caught:
        dataset(prefix, tmp_path)
    one_line(caught)


def test_the_writer_refuses_ids_that_are_not_integers_or_do_not_fit(tmp_path):
    with pytest.raises(UserError, match="token ids are integers"):
        IndexedDatasetWriter(str(tmp_path / "f"), np.float32)
    for ids, message in (([1.7, 2.2], r"float64 token ids; token ids are integers"),
                         ([5, 70000], r"token id 70000 does not fit uint16"),
                         ([-1, 5], r"token id -1 does not fit uint16")):
        with pytest.raises(UserError, match=message):
            with IndexedDatasetWriter(str(tmp_path / "w"), np.uint16) as writer:
                writer.add_document([3, 4])
                writer.add_document(ids)
        assert not os.listdir(tmp_path), os.listdir(tmp_path)  # nothing left behind


def test_a_lone_surrogate_is_replaced_and_reported_once(tmp_path):
    texts = ["fine", "broken \ud800 here", "also \udfff broken", "fine again"]
    path = tmp_path / "surrogates.jsonl"
    path.write_text("".join(json.dumps({"text": t}) + "\n" for t in texts), encoding="utf-8")  # \ud800 escaped
    log = io.StringIO()
    counts = preprocess(str(path), str(tmp_path / "out"), tokenizer=TOKENIZER, log=log)
    tokenizer = Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    read = IndexedDataset(str(tmp_path / "out"))
    expected = [tokenizer.encode(t.replace("\ud800", "\ufffd").replace("\udfff", "\ufffd"),
                                 add_special_tokens=False).ids for t in texts]
    assert [read.sequence(i).tolist() for i in range(len(read))] == expected
    named = [line for line in log.getvalue().splitlines() if f"{path}:" in line]
    assert len(named) == 1 and f"{path}:2 " in named[0] and "U+FFFD" in named[0], log.getvalue()
    assert counts["replaced"] == 2 and "2 documents with lone surrogates replaced" in log.getvalue()


def test_a_document_too_long_for_the_index_is_refused_before_it_is_read(tmp_path):
    huge = np.broadcast_to(np.uint16(1), (2**31,))  # 2^31 ids, no memory: lengths are int32
    with pytest.raises(UserError, match=r"a document of 2,147,483,648 tokens; the index holds at most "
                                        r"2,147,483,647 per document"):
        with IndexedDatasetWriter(str(tmp_path / "w"), np.uint16) as writer:
            writer.add_document(huge)
    assert not os.listdir(tmp_path)


def test_preprocess_takes_plain_text_and_the_bundled_tokenizer_by_default(tmp_path):
    path = tmp_path / "lines.txt"
    lines = ["First document, one line.", "", "Second one: the quick brown fox.", "  indented third  "]
    path.write_text("\r\n".join(lines) + "\r\n", encoding="utf-8")
    counts = preprocess(str(path), str(tmp_path / "out"), append_eod=True, log=io.StringIO())
    tokenizer = Tokenizer.from_file(TOKENIZER)
    eod = tokenizer.token_to_id("<|endoftext|>")
    read = IndexedDataset(str(tmp_path / "out"))
    expected = [tokenizer.encode(line, add_special_tokens=False).ids + [eod] for line in lines if line]
    assert [read.sequence(i).tolist() for i in range(len(read))] == expected
    assert counts["documents"] == 3 and counts["empty"] == 1


def test_a_missing_tokenizer_names_the_bundled_one(tmp_path, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", TEXTS[:3])
    assert preprocess_main(["--input", path, "--output-prefix", str(tmp_path / "o"), "--tokenizer",
                            "tokenizer.json"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.startswith("preprocess_data: error: --tokenizer 'tokenizer.json' is not an existing file") and \
        "\n" not in err and "leave --tokenizer out" in err and str(BUNDLED_TOKENIZER) in err, err


@pytest.mark.parametrize("content,message", [
    ('{"text": 5}\n', r"d.jsonl:1: 'text' holds a number, not a string: pass --json-key with the key that holds"),
    ('["text", "x"]\n', r"d.jsonl:1 is an array, not an object"),
    ("\n\n  \n", r"d.jsonl holds no documents \(3 lines, all empty\)"),
    ("", r"d.jsonl holds no documents \(0 lines"),
])
def test_preprocess_input_of_the_wrong_shape_is_one_line(tmp_path, content, message):
    (tmp_path / "d.jsonl").write_text(content, encoding="utf-8")
    with pytest.raises(UserError, match=message) as caught:
        preprocess(str(tmp_path / "d.jsonl"), str(tmp_path / "out"), tokenizer=TOKENIZER, log=io.StringIO())
    one_line(caught)
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl"]


def test_preprocess_skips_a_byte_order_mark(tmp_path):
    (tmp_path / "bom.jsonl").write_bytes(b"\xef\xbb\xbf" + json.dumps({"text": "with a BOM"}).encode() + b"\n")
    preprocess(str(tmp_path / "bom.jsonl"), str(tmp_path / "out"), tokenizer=TOKENIZER, log=io.StringIO())
    tokenizer = Tokenizer.from_file(TOKENIZER)
    assert IndexedDataset(str(tmp_path / "out")).sequence(0).tolist() == tokenizer.encode("with a BOM").ids


def test_an_output_prefix_that_is_a_directory_is_refused(tmp_path):
    path = write_jsonl(tmp_path / "d.jsonl", TEXTS[:3])
    (tmp_path / "out").mkdir()
    for prefix in (str(tmp_path / "out"), str(tmp_path / "out") + "/", str(tmp_path / "new") + "/"):
        with pytest.raises(UserError, match=r"--output-prefix .* names a directory; pass a prefix inside it, such "
                                            r"as .*/corpus") as caught:
            preprocess(path, prefix, tokenizer=TOKENIZER, log=io.StringIO())
        one_line(caught)
    assert sorted(os.listdir(tmp_path)) == ["d.jsonl", "out"] and not os.listdir(tmp_path / "out")


@pytest.mark.parametrize("name", ["docs.jsonl", "docs.json"])
def test_json_lines_as_data_are_refused_with_the_preprocessing_command(tmp_path, name):
    path = write_jsonl(tmp_path / name, TEXTS)
    with pytest.raises(UserError, match=rf"--data {path!r} is JSON: tokenize it first with python -m "
                                        rf"tools.preprocess_data --input {path} --output-prefix ") as caught:
        dataset(path, tmp_path)
    one_line(caught)
