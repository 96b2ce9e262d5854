"""Tests for Megatron indexed data: format, preprocessing, splits, blends, document ids, the cached
sample index, resume and data-parallel determinism, validation passes and input errors."""

import json
import os
import struct

import numpy as np
import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dtrain.data import packed
from dtrain.data.blend import parse_blend, parse_split, split_ranges
from dtrain.config import DataArgs
from dtrain.data import BUNDLED, BUNDLED_TOKENIZER, SYNTHETIC, TokenDataset, validate_data_args
from dtrain.data.indexed import IndexedDataset
from models.errors import UserError
from tools.preprocess_data import preprocess


SEQ_LEN = 16
CODES = {np.uint8: 1, np.int8: 2, np.int16: 3, np.int32: 4, np.int64: 5, np.float64: 6, np.float32: 7,
         np.uint16: 8}


def write_megatron(prefix, documents, dtype=np.int32, document_indices=None, magic=b"MMIDIDX\x00\x00", version=1):
    """A minimal MMIDIDX writer that follows the format description, independent of dtrain's."""
    lengths = np.asarray([len(d) for d in documents], "<i4")
    with open(f"{prefix}.bin", "wb") as file:
        for document in documents:
            file.write(np.asarray(document, dtype).tobytes())
    pointers = np.concatenate([[0], np.cumsum(lengths, dtype=np.int64)[:-1]]) * np.dtype(dtype).itemsize
    indices = np.arange(len(documents) + 1) if document_indices is None else np.asarray(document_indices)
    with open(f"{prefix}.idx", "wb") as file:
        file.write(magic + struct.pack("<QBQQ", version, CODES[dtype], len(lengths), len(indices)))
        file.write(lengths.tobytes() + pointers.astype("<i8").tobytes() + indices.astype("<i8").tobytes())
    return str(prefix)


def unique_documents(count, seed, offset=0):
    """Documents whose token ids are all distinct (id = position in the file + offset)."""
    lengths = np.random.RandomState(seed).randint(1, 80, size=count)
    starts = np.concatenate([[0], np.cumsum(lengths)[:-1]]) + offset
    return [list(range(start, start + length)) for start, length in zip(starts, lengths)]


def dataset(data, tmp_path, vocab=1 << 16, seed=0, **kwargs):
    return TokenDataset(data, None, SEQ_LEN, vocab, seed, cache_dir=str(tmp_path / "cache"), **kwargs)


@pytest.fixture
def unique(tmp_path):
    documents = unique_documents(300, seed=1)
    return write_megatron(tmp_path / "unique", documents), documents


@pytest.fixture(scope="module")
def jsonl(tmp_path_factory):
    path = tmp_path_factory.mktemp("jsonl") / "docs.jsonl"
    texts = [f"Document {i}: the quick brown fox jumps over the lazy dog {i % 7} times." * (1 + i % 3)
             for i in range(120)]
    lines = [json.dumps({"text": text, "id": i}) for i, text in enumerate(texts)]
    lines[5] = json.dumps({"text": ""})  # empty documents are skipped, as Megatron skips them
    path.write_text("\n".join(lines) + "\n\n", encoding="utf-8")
    return path, [text for i, text in enumerate(texts) if i != 5]


def test_preprocess_gpt2_vocab_and_merges(tmp_path, jsonl):
    path, texts = jsonl
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=400, special_tokens=["<|endoftext|>"], show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tokenizer.train_from_iterator(texts, trainer)
    vocab, merges = tokenizer.model.save(str(tmp_path))
    preprocess(str(path), str(tmp_path / "gpt2"), vocab_file=vocab, merge_file=merges, append_eod=True)
    eod = tokenizer.token_to_id("<|endoftext|>")
    read = IndexedDataset(str(tmp_path / "gpt2"))
    assert [read.sequence(i).tolist() for i in range(len(read))] == [tokenizer.encode(t).ids + [eod] for t in texts]


@pytest.mark.parametrize("dtype", [np.int32, np.uint16, np.int64, np.uint8])
def test_independent_writer_reads_back(tmp_path, dtype):
    documents = [list(range(i, i + 3 + i % 5)) for i in range(40)]
    # Two sequences per document (Megatron's sentence split): document indices every other sequence.
    prefix = write_megatron(tmp_path / "plain", documents, dtype, document_indices=np.arange(0, 41, 2))
    read = IndexedDataset(prefix + ".bin")  # a file name is taken as its prefix
    assert read.dtype == np.dtype(dtype) and len(read) == 40 and read.num_documents == 20
    assert [read.sequence(i).tolist() for i in range(40)] == documents
    rows = dataset(prefix, tmp_path, vocab=256, split="1").global_batch(0, 8)
    assert rows.dtype == torch.int64 and rows.shape == (8, SEQ_LEN + 1)


def test_epoch_packs_every_train_token_once(unique, tmp_path):
    prefix, documents = unique
    train_end = split_ranges(parse_split("969,30,1"), len(documents))[0][1]
    train_tokens = {token for document in documents[:train_end] for token in document}
    data = dataset(prefix, tmp_path)
    per_epoch = data._indexed.sources[0].samples_per_epoch
    assert per_epoch == (len(train_tokens) - 1) // SEQ_LEN
    rows = data.global_batch(0, per_epoch)
    labels = rows[:, 1:].flatten().tolist()
    assert len(set(labels)) == len(labels) and set(labels) <= train_tokens  # each train token once at most
    # Consecutive samples of the (unshuffled) stream share a boundary token: rows chain end to start.
    assert len(set(rows[:, 0].tolist()) & set(rows[:, -1].tolist())) == per_epoch - 1
    validation = dataset(prefix, tmp_path, part="validation").global_batch(0, 4)
    assert not set(validation.flatten().tolist()) & train_tokens  # document-level split


def test_split_matches_megatron_rounding():
    assert split_ranges(parse_split("969,30,1"), 1000) == [(0, 969), (969, 999), (999, 1000)]
    assert split_ranges(parse_split("98/2"), 10) == [(0, 10), (10, 10), (10, 10)]
    # Each bound is its cumulative share rounded: 3.33 -> 3, 6.67 -> 7.
    assert split_ranges(parse_split("1,1,1"), 10) == [(0, 3), (3, 7), (7, 10)]


def test_documents_positions_restart_at_boundaries(unique, tmp_path):
    prefix, documents = unique
    starts = {document[0] for document in documents}
    data = dataset(prefix, tmp_path, documents=True)
    boundaries = 0
    for batch in data.micro_batches(3, 16, 4, 0, 1):
        inputs, labels = batch  # still unpacks as a pair
        assert batch.position_ids.shape == batch.document_ids.shape == inputs.shape == (4, SEQ_LEN)
        for tokens, positions, ids in zip(inputs.tolist(), batch.position_ids.tolist(), batch.document_ids.tolist()):
            assert positions[0] == 0 and ids[0] == 0
            for t in range(1, SEQ_LEN):
                new_document = tokens[t] in starts
                boundaries += new_document
                assert ids[t] == ids[t - 1] + new_document
                assert positions[t] == (0 if new_document else positions[t - 1] + 1)
    assert boundaries > 0
    assert dataset(prefix, tmp_path).micro_batches(3, 16, 4, 0, 1)[0].document_ids is None


def test_documents_from_preprocessed_eod(tmp_path, jsonl):
    prefix = str(tmp_path / "eod")
    preprocess(str(jsonl[0]), prefix, tokenizer=str(BUNDLED_TOKENIZER), append_eod=True)
    eod = Tokenizer.from_file(str(BUNDLED_TOKENIZER)).token_to_id("<|endoftext|>")
    for batch in dataset(prefix, tmp_path, vocab=4096, split="1", documents=True).micro_batches(0, 8, 8, 0, 1):
        after_eod = torch.zeros_like(batch.inputs, dtype=torch.bool)
        after_eod[:, 1:] = batch.inputs[:, :-1] == eod
        assert after_eod.any()
        assert torch.equal(batch.position_ids == 0, after_eod | (torch.arange(SEQ_LEN) == 0))
        assert torch.equal(batch.document_ids, after_eod.long().cumsum(1))


def test_documents_for_text_and_synthetic(tmp_path):
    path = tmp_path / "docs.txt"
    path.write_text("one two three<|endoftext|>four five six seven<|endoftext|>eight nine" * 20, encoding="utf-8")
    text = TokenDataset(str(path), None, SEQ_LEN, 4096, 0, documents=True)
    batch = text.micro_batches(0, 4, 4, 0, 1)[0]
    eod = Tokenizer.from_file(str(BUNDLED_TOKENIZER)).token_to_id("<|endoftext|>")
    assert torch.equal(batch.document_ids[:, 1:] - batch.document_ids[:, :-1], (batch.inputs[:, :-1] == eod).long())
    synthetic = TokenDataset(SYNTHETIC, None, SEQ_LEN, 100, 0, documents=True).micro_batches(0, 2, 2, 0, 1)[0]
    assert not synthetic.document_ids.any() and torch.equal(synthetic.position_ids[1], torch.arange(SEQ_LEN))


def blend_files(tmp_path):
    return [write_megatron(tmp_path / name, unique_documents(500, seed=i, offset=20000 * i))
            for i, name in enumerate("abc")]


def test_blend_counts_follow_weights(tmp_path):
    a, b, c = blend_files(tmp_path)
    data = dataset(f"0.5 {a} 0.3 {b} 0.2 {c}", tmp_path)
    rows = data.global_batch(0, 10_000)
    source = rows[:, 0] // 20000
    assert torch.equal(rows.max(dim=1).values // 20000, source)  # a sample never mixes datasets
    counts = torch.bincount(source, minlength=3).tolist()
    for count, weight in zip(counts, (0.5, 0.3, 0.2)):
        assert abs(count - weight * 10_000) <= 0.02 * weight * 10_000
    # Weights need not sum to 1, and a zero weight leaves its dataset out.
    assert torch.equal(dataset(f"5 {a} 3 {b} 2 {c}", tmp_path).global_batch(7, 64), data.global_batch(7, 64))
    assert (dataset(f"1 {a} 0 {b}", tmp_path).global_batch(0, 200) < 20000).all()


@pytest.mark.parametrize("blend", [False, True], ids=["single", "blend"])
def test_resume_and_data_parallel_see_the_same_stream(tmp_path, blend):
    files = blend_files(tmp_path)
    data_arg = f"0.6 {files[0]} 0.4 {files[1]}" if blend else files[0]
    global_batch, step = 32, 150  # step 150 is several epochs into the 500-document datasets
    reader = dataset(data_arg, tmp_path, documents=True)
    for earlier in range(0, step, 7):
        reader.global_batch(earlier, global_batch)
    expected = reader.micro_batches(step, global_batch, global_batch, 0, 1)[0]
    fresh = dataset(data_arg, tmp_path, documents=True)
    assert torch.equal(fresh.global_batch(step, global_batch)[:, :-1], expected.inputs)
    for dp_size in (1, 2, 4):
        parts = [b for rank in range(dp_size) for b in fresh.micro_batches(step, global_batch, 4, rank, dp_size)]
        for field in ("inputs", "labels", "position_ids", "document_ids"):
            assert torch.equal(torch.cat([getattr(b, field) for b in parts]), getattr(expected, field))
    assert not torch.equal(dataset(data_arg, tmp_path, seed=1).global_batch(step, global_batch),
                           fresh.global_batch(step, global_batch))


def test_cache_is_reused_and_corrupt_cache_rebuilt(unique, tmp_path):
    prefix, _ = unique
    before = dict(packed.stats)
    expected = dataset(prefix, tmp_path).global_batch(5, 16)
    assert packed.stats["built"] == before["built"] + 1
    (index,) = (tmp_path / "cache").glob("*.npy")
    mtime = index.stat().st_mtime_ns
    assert torch.equal(dataset(prefix, tmp_path).global_batch(5, 16), expected)
    assert packed.stats["built"] == before["built"] + 1 and packed.stats["loaded"] == before["loaded"] + 1
    assert index.stat().st_mtime_ns == mtime
    size = index.stat().st_size
    for corrupt in (lambda raw: raw[: size - 64] + bytes(64), lambda raw: raw[:100], lambda raw: b"garbage"):
        index.write_bytes(corrupt(index.read_bytes()))
        built = packed.stats["built"]
        assert torch.equal(dataset(prefix, tmp_path).global_batch(5, 16), expected)
        assert packed.stats["built"] == built + 1 and index.stat().st_size == size
    index.with_suffix(".json").write_text("{not json")
    built = packed.stats["built"]
    dataset(prefix, tmp_path)
    assert packed.stats["built"] == built + 1
    # Default location: a cache directory beside the data.
    TokenDataset(prefix, None, SEQ_LEN, 1 << 16, 0)
    assert list((tmp_path / packed.CACHE_DIR_NAME).glob("*.npy"))


def test_cache_of_changed_data_is_not_reused(tmp_path):
    prefix = write_megatron(tmp_path / "x", unique_documents(100, seed=0))
    first = dataset(prefix, tmp_path).global_batch(0, 8)
    write_megatron(tmp_path / "x", unique_documents(100, seed=0, offset=1000))
    os.utime(prefix + ".bin", ns=(1, 1))  # the same size: the mtime tells the files apart
    built = packed.stats["built"]
    assert torch.equal(dataset(prefix, tmp_path).global_batch(0, 8), first + 1000)
    assert packed.stats["built"] == built + 1


def test_validation_pass(unique, tmp_path):
    prefix, _ = unique
    args = DataArgs(data=prefix, seq_len=SEQ_LEN, split="80,20,0", data_cache_dir=str(tmp_path / "cache"),
                    document_mask=True)
    validation = TokenDataset.from_args(args, 1 << 16, seed=0, part="validation")
    available = validation._indexed.samples_before_repeat()
    assert validation.eval_steps(1000, 8) == available // 8 and validation.eval_steps(2, 8) == 2
    passes = [list(validation.eval_micro_batches(3, 8, 2, rank, 2)) for rank in (0, 1)]
    assert len(passes[0]) == len(passes[1]) == 3 * 8 // 2 // 2 and passes[0][0].document_ids is not None
    again = list(validation.eval_micro_batches(3, 8, 2, 0, 2))
    assert all(torch.equal(x.inputs, y.inputs) for x, y in zip(passes[0], again))  # the same samples each pass
    train = TokenDataset.from_args(args, 1 << 16, seed=0)
    assert not set(train.global_batch(0, 64).flatten().tolist()) & set(validation.global_batch(0, 8).flatten().tolist())
    synthetic = TokenDataset(SYNTHETIC, None, SEQ_LEN, 100, 0, part="validation")
    assert synthetic.eval_steps(5, 4) == 5
    assert not torch.equal(synthetic.global_batch(0, 4), TokenDataset(SYNTHETIC, None, SEQ_LEN, 100, 0).global_batch(0, 4))


def corrupt_index(tmp_path, edit):
    prefix = write_megatron(tmp_path / "bad", [[1, 2, 3], [4, 5]])
    raw = bytearray(open(prefix + ".idx", "rb").read())
    open(prefix + ".idx", "wb").write(edit(raw))
    return prefix


@pytest.mark.parametrize("edit, message", [
    (lambda raw: b"NOTANIDX\x00" + raw[9:], "not the MMIDIDX magic"),
    (lambda raw: raw[:9] + struct.pack("<Q", 2) + raw[17:], "index version 2"),
    (lambda raw: raw[:-8], "shorter than the .* its header promises"),
    (lambda raw: raw[:20], "shorter than the 34-byte header"),
    (lambda raw: raw[:17] + bytes([42]) + raw[18:], "dtype code 42"),
])
def test_bad_index(tmp_path, edit, message):
    with pytest.raises(UserError, match=message) as caught:
        dataset(corrupt_index(tmp_path, edit), tmp_path)
    assert "\n" not in str(caught.value)


def test_missing_and_truncated_files(tmp_path):
    prefix = write_megatron(tmp_path / "pair", [[1, 2, 3], [4, 5]] * 20)
    with open(prefix + ".bin", "r+b") as file:
        file.truncate(8)
    with pytest.raises(UserError, match=r"pair.bin is 8 bytes"):
        dataset(prefix, tmp_path)
    os.remove(prefix + ".bin")
    with pytest.raises(UserError, match=r"pair.bin is missing \(.*pair.idx exists\)"):
        validate_data_args(prefix, None)
    os.remove(prefix + ".idx")
    with pytest.raises(UserError, match="neither.*pair.bin"):
        dataset(prefix, tmp_path)
    good = write_megatron(tmp_path / "good", [[1, 2, 3], [4, 5]] * 20)
    write_megatron(tmp_path / "only", [[1, 2]])
    os.remove(tmp_path / "only.idx")
    with pytest.raises(UserError, match=r"only.idx is missing"):
        dataset(f"0.5 {good} 0.5 {tmp_path / 'only'}", tmp_path)


def test_token_ids_outside_the_vocabulary(tmp_path):
    big = write_megatron(tmp_path / "big", [list(range(100)), [5000, 7]] * 10)
    with pytest.raises(UserError, match=r"ids from 0 to 5000, outside the model vocabulary \[0, 4096\)"):
        dataset(big, tmp_path, vocab=4096)
    dataset(big, tmp_path, vocab=5001)
    negative = write_megatron(tmp_path / "negative", [list(range(100)), [-3]] * 10)
    with pytest.raises(UserError, match="ids from -3"):
        dataset(negative, tmp_path, vocab=4096)


@pytest.mark.parametrize("blend, message", [
    ("0.5 {a} 0.5", "odd number"),
    ("half {a} 0.5 {a}", "'half' .* is not a number"),
    ("-1 {a} 2 {a}", "must be a finite number >= 0"),
    ("0 {a} 0 {a}", "every weight is 0"),
])
def test_bad_blend(unique, tmp_path, blend, message):
    with pytest.raises(UserError, match=message):
        dataset(blend.format(a=unique[0]), tmp_path)
    with pytest.raises(UserError, match=message):
        parse_blend(blend.format(a="x"))


@pytest.mark.parametrize("split, message", [
    ("a,b,c", "not comma-separated numbers"), ("1,2,3,4", "more than 3"), ("0,0,0", "do not all equal 0"),
    ("-1,2,3", "finite shares >= 0"), ("", "not comma-separated numbers"),
])
def test_bad_split(unique, tmp_path, split, message):
    with pytest.raises(UserError, match=message):
        dataset(unique[0], tmp_path, split=split)
    with pytest.raises(UserError, match=message):
        validate_data_args(BUNDLED, None, split)


def test_parts_without_data(unique, tmp_path):
    with pytest.raises(UserError, match="gives the validation part no share"):
        dataset(unique[0], tmp_path, split="100,0,0", part="validation")
    with pytest.raises(UserError, match="the test part .* fewer than seq_len \\+ 1"):
        dataset(unique[0], tmp_path, split="999,0,1", part="test")
    with pytest.raises(UserError, match="fewer than one global batch"):
        dataset(unique[0], tmp_path, split="98,2,0", part="validation").eval_steps(1, 4096)
    with pytest.raises(UserError, match="has no validation part"):
        TokenDataset(BUNDLED, None, SEQ_LEN, 4096, 0, part="validation")


def test_preprocess_errors(tmp_path, jsonl):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"text": "fine"}\n{"body": "no text key"}\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"bad.jsonl:2 has no key 'text' \(it has \['body'\]\)"):
        preprocess(str(bad), str(tmp_path / "out"), tokenizer=str(BUNDLED_TOKENIZER))
    assert not (tmp_path / "out.bin").exists()  # no half-written pair is left behind
    bad.write_text('{"text": "fine"}\nnot json\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"bad.jsonl:2 is not JSON"):
        preprocess(str(bad), str(tmp_path / "out"), tokenizer=str(BUNDLED_TOKENIZER))
    with pytest.raises(UserError, match="GPT-2 BPE needs both --vocab-file vocab.json and --merge-file"):
        preprocess(str(jsonl[0]), str(tmp_path / "out"), vocab_file=str(BUNDLED_TOKENIZER))
    with pytest.raises(UserError, match="no end-of-document token <missing>"):
        preprocess(str(jsonl[0]), str(tmp_path / "out"), tokenizer=str(BUNDLED_TOKENIZER), append_eod=True,
                   eod_token="<missing>")
