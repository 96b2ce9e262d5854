"""A text file as --data: tokenized once, in pieces that keep the tokens of the whole text, into an
indexed dataset in the data cache that every rank reads (one process builds it while the others
wait), keyed by the file and the tokenizer, in bounded memory; the run logs what it trains on."""

from __future__ import annotations

import os
import socket

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer

from dtrain.data import BUNDLED_CORPUS, BUNDLED_TOKENIZER, END_OF_TEXT, TokenDataset
from dtrain.data import text as text_data
from models.errors import UserError


SEQ_LEN = 32


VOCAB = 4096


CORPUS = BUNDLED_CORPUS.read_text(encoding="utf-8")


def whole_text_ids(text: str) -> list[int]:
    """What tokenizing the whole text at once gives (the end-of-text token appended)."""
    tokenizer = Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    return tokenizer.encode(text, add_special_tokens=False).ids + [tokenizer.token_to_id(END_OF_TEXT)]


def text_file(tmp_path, text=CORPUS[:200_000], name="corpus.txt"):
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def text_dataset(path, cache_dir, tokenizer=None, **kwargs):
    return TokenDataset(str(path), tokenizer, SEQ_LEN, VOCAB, 0, cache_dir=None if cache_dir is None else str(cache_dir),
                        **kwargs)


def cache_entries(cache_dir) -> list[str]:
    return sorted(p.name for p in cache_dir.iterdir()) if cache_dir.is_dir() else []


def test_a_text_file_is_tokenized_once_into_the_cache(tmp_path):
    path, cache = text_file(tmp_path), tmp_path / "cache"
    before = dict(text_data.stats)
    first = text_dataset(path, cache)
    assert text_data.stats["built"] == before["built"] + 1
    assert [name.rsplit(".", 1)[-1] for name in cache_entries(cache)] == ["bin", "idx", "json"]
    assert np.array_equal(np.asarray(first._tokens), whole_text_ids(path.read_text()))
    second = text_dataset(path, cache)
    assert text_data.stats["built"] == before["built"] + 1 and text_data.stats["loaded"] == before["loaded"] + 1
    for step in (0, 7):
        assert torch.equal(first.global_batch(step, 8), second.global_batch(step, 8))
    # By default the cache lies beside the text, as indexed data's does.
    text_dataset(path, None)
    assert [name.rsplit(".", 1)[-1] for name in cache_entries(tmp_path / "dtrain_index_cache")] == ["bin", "idx", "json"]


def test_pieces_keep_the_tokens_of_the_whole_text(tmp_path, monkeypatch):
    monkeypatch.setattr(text_data, "PIECE_CHARS", 3000)
    lines_only = "\n".join(["alpha", "beta-gamma", "delta.epsilon", "zeta"] * 3000)  # no spaces to cut at
    for name, text in (("corpus", CORPUS[:300_000]), ("lines", lines_only)):
        path = text_file(tmp_path, text, f"{name}.txt")
        pieces = list(text_data.pieces(str(path), 3000, 10 * 3000))
        assert "".join(pieces) == text and len(pieces) > 30, name
        data = text_dataset(path, tmp_path / "cache")
        assert np.array_equal(np.asarray(data._tokens), whole_text_ids(text)), name
    # A text with nowhere to cut is cut at the longest piece: its memory stays bounded.
    path = text_file(tmp_path, "x" * 100_000, "one_word.txt")
    pieces = list(text_data.pieces(str(path), 3000, 10 * 3000))
    assert "".join(pieces) == "x" * 100_000 and max(map(len, pieces)) <= 10 * 3000 + 3000


def test_the_cache_follows_the_file_and_the_tokenizer(tmp_path):
    path, cache = text_file(tmp_path), tmp_path / "cache"
    first = np.asarray(text_dataset(path, cache)._tokens).copy()
    text = path.read_text()
    path.write_text(text.replace("Hamlet", "Macbet"), encoding="utf-8")  # the same size
    os.utime(path, ns=(1, 1))
    built = text_data.stats["built"]
    changed = text_dataset(path, cache)
    assert text_data.stats["built"] == built + 1 and not np.array_equal(np.asarray(changed._tokens), first)
    other_tokenizer = tmp_path / "tokenizer.json"
    other_tokenizer.write_text(BUNDLED_TOKENIZER.read_text() + "\n")  # the same tokenizer, another file
    text_dataset(path, cache, tokenizer=str(other_tokenizer))
    assert text_data.stats["built"] == built + 2
    # A damaged cache is rebuilt, never read.
    (bin_file,) = sorted(cache.glob("*.bin"), key=os.path.getmtime)[-1:]
    raw = bytearray(bin_file.read_bytes())
    raw[100] ^= 0xFF
    bin_file.write_bytes(bytes(raw))
    text_dataset(path, cache, tokenizer=str(other_tokenizer))
    assert text_data.stats["built"] == built + 3


def test_the_dataset_says_what_it_holds(tmp_path, indexed_corpus):
    path = text_file(tmp_path, ("A first document." + END_OF_TEXT + "A second one.\n") * 300)
    data = text_dataset(path, tmp_path / "cache")
    assert data.describe() == (f"{path}: {len(data._tokens):,} tokens, 301 documents, "
                               f"{(len(data._tokens) - 1) // SEQ_LEN:,} samples of {SEQ_LEN + 1} tokens per epoch")
    indexed = TokenDataset(f"0.3 {indexed_corpus} 0.7 {indexed_corpus}", None, SEQ_LEN, VOCAB, 0,
                           cache_dir=str(tmp_path / "cache"))
    source = indexed._indexed.sources[0]
    one = (f"{indexed_corpus}: {len(source.dataset):,} documents, {int(source.dataset.lengths.sum()):,} tokens "
           f"(the train part: {source.count:,} documents, {source.tokens:,} tokens)")
    assert indexed.describe() == f"0.3 x {one}; 0.7 x {one}"
    assert TokenDataset("synthetic", None, SEQ_LEN, 100, 0).describe() == "synthetic: random token ids below 100"


def test_a_lock_left_by_a_dead_process_is_taken_over(tmp_path):
    path, cache = text_file(tmp_path), tmp_path / "cache"
    text_dataset(path, cache)  # its cache, to learn the name
    name = next(p.stem for p in cache.glob("*.json"))
    for suffix in (".bin", ".idx", ".json"):
        (cache / f"{name}{suffix}").unlink()
    (cache / f"{name}.lock").write_text(f"{socket.gethostname()} 999999999\n")  # no such process
    built = text_data.stats["built"]
    text_dataset(path, cache)
    assert text_data.stats["built"] == built + 1 and not (cache / f"{name}.lock").exists()


def _cache_name(path, cache) -> str:
    """The cache's name for `path`, its files removed again (as before a first build)."""
    text_dataset(path, cache)
    name = next(p.stem for p in cache.glob("*.json"))
    for suffix in (".bin", ".idx", ".json"):
        (cache / f"{name}{suffix}").unlink()
    return name


def test_a_lock_that_names_this_very_process_is_taken_over(tmp_path, monkeypatch):
    """A job restarted in a fresh container numbers its processes as before: the lock of the build
    it was killed in names this process's pid, alive, but not the holder (it waited forever)."""
    path, cache = text_file(tmp_path), tmp_path / "cache"
    name = _cache_name(path, cache)
    (cache / f"{name}.lock").write_text(f"{socket.gethostname()} {os.getpid()}\n")

    def wait(seconds):
        raise AssertionError(f"waited for {name}.lock, which no live process holds")

    monkeypatch.setattr(text_data.time, "sleep", wait)
    built = text_data.stats["built"]
    text_dataset(path, cache)
    assert text_data.stats["built"] == built + 1 and not (cache / f"{name}.lock").exists()


def test_an_unwritable_cache_directory_tokenizes_in_memory_and_says_so(tmp_path, caplog):
    path = text_file(tmp_path)
    (tmp_path / "a file").write_text("")
    with caplog.at_level("WARNING", logger="dtrain"):
        data = text_dataset(path, tmp_path / "a file" / "cache")
    assert np.array_equal(np.asarray(data._tokens), whole_text_ids(path.read_text()))
    assert any("cannot write the data cache" in r.getMessage() and "--data-cache-dir" in r.getMessage()
               for r in caplog.records), caplog.text


def test_the_bundled_corpus_writes_nothing_unless_a_cache_directory_is_given(tmp_path):
    assets = sorted(os.listdir(BUNDLED_CORPUS.parent))
    data = TokenDataset("bundled", None, SEQ_LEN, VOCAB, 0)
    assert sorted(os.listdir(BUNDLED_CORPUS.parent)) == assets
    assert np.array_equal(np.asarray(data._tokens), whole_text_ids(CORPUS))
    TokenDataset("bundled", None, SEQ_LEN, VOCAB, 0, cache_dir=str(tmp_path / "cache"))
    assert len(cache_entries(tmp_path / "cache")) == 3


@pytest.mark.parametrize("content,message", [
    (b"", r"empty.txt' is empty: pass a file with text in it"),
    (b"fine text\n" * 5000 + b"\xff bad", r"bad.txt' is not UTF-8 text \(invalid start byte at byte 50000\)"),
])
def test_text_that_is_not_text_is_one_line(tmp_path, content, message):
    path = tmp_path / ("empty.txt" if not content else "bad.txt")
    path.write_bytes(content)
    with pytest.raises(UserError, match=message) as caught:
        text_dataset(path, tmp_path / "cache")
    assert "\n" not in str(caught.value)
    assert not [name for name in cache_entries(tmp_path / "cache") if not name.endswith(".failed")]
