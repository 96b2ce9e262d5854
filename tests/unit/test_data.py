"""Tests for dtrain.data: determinism, data-parallel slicing, tokenizers and input errors."""

import pytest
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from dtrain.data import (
    BUNDLED,
    BUNDLED_CORPUS,
    BUNDLED_TOKENIZER,
    END_OF_TEXT,
    SYNTHETIC,
    TokenDataset,
    validate_data_args,
)
from models.errors import UserError


SEQ_LEN = 32
MODEL_VOCAB = 4096


def bundled(seed=0, seq_len=SEQ_LEN):
    return TokenDataset(BUNDLED, None, seq_len=seq_len, model_vocab_size=MODEL_VOCAB, seed=seed)


def synthetic(seed=0, seq_len=SEQ_LEN, vocab=1000):
    return TokenDataset(SYNTHETIC, None, seq_len=seq_len, model_vocab_size=vocab, seed=seed)


@pytest.fixture(scope="module")
def small_text(tmp_path_factory):
    path = tmp_path_factory.mktemp("text") / "small.txt"
    lines = [f"Line {i}: the quick brown fox jumps over the lazy dog number {i % 7}." for i in range(300)]
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def small_tokenizer(small_text, tmp_path_factory):
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=300, special_tokens=[END_OF_TEXT],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train([str(small_text)], trainer)
    path = tmp_path_factory.mktemp("tok") / "tokenizer.json"
    tokenizer.save(str(path))
    return path


def test_bundled_assets():
    assert 300_000 <= BUNDLED_CORPUS.stat().st_size <= 1_100_000
    tokenizer = Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    assert tokenizer.get_vocab_size() == 2048
    assert tokenizer.token_to_id(END_OF_TEXT) is not None
    assert bundled().vocab_size == 2048


@pytest.mark.parametrize("make", [bundled, synthetic], ids=["bundled", "synthetic"])
def test_same_seed_same_batches(make):
    first, second = make(seed=3), make(seed=3)
    for step in (0, 1, 1000):
        batch = first.global_batch(step, 8)
        assert batch.dtype == torch.int64 and batch.shape == (8, SEQ_LEN + 1)
        assert torch.equal(batch, second.global_batch(step, 8))
    assert not torch.equal(first.global_batch(0, 8), first.global_batch(1, 8))
    assert not torch.equal(first.global_batch(0, 8), make(seed=4).global_batch(0, 8))


def test_bundled_epoch_covers_every_window_once():
    seq_len = 512
    tokenizer = Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    ids = tokenizer.encode(BUNDLED_CORPUS.read_text(encoding="utf-8")).ids + [tokenizer.token_to_id(END_OF_TEXT)]
    num_windows = (len(ids) - 1) // seq_len
    dataset = bundled(seq_len=seq_len)
    rows = dataset.global_batch(0, num_windows)
    assert len({tuple(row) for row in rows.tolist()}) == num_windows  # no window repeats within the epoch
    # Non-overlapping windows: every token after the first is a label exactly once per epoch.
    labels = torch.tensor(ids[1 : num_windows * seq_len + 1])
    assert torch.equal(rows[:, 1:].flatten().sort().values, labels.sort().values)
    # The next epoch is a different order of the same windows, and the stream goes on.
    next_epoch = dataset.global_batch(1, num_windows)
    assert not torch.equal(rows, next_epoch)
    assert sorted(map(tuple, rows.tolist())) == sorted(map(tuple, next_epoch.tolist()))


@pytest.mark.parametrize("make", [bundled, synthetic], ids=["bundled", "synthetic"])
def test_data_parallel_ranks_see_the_global_batch(make):
    dataset = make()
    global_batch_size, micro_batch_size = 8, 2
    for step in (0, 5):
        expected = dataset.global_batch(step, global_batch_size)
        for dp_size in (1, 2, 4):
            rows = []
            for dp_rank in range(dp_size):
                for inputs, labels in dataset.micro_batches(step, global_batch_size, micro_batch_size,
                                                            dp_rank, dp_size):
                    assert inputs.shape == labels.shape == (micro_batch_size, SEQ_LEN)
                    rows.append(torch.cat([inputs, labels[:, -1:]], dim=1))
            assert torch.equal(torch.cat(rows), expected)


def test_labels_are_inputs_shifted_by_one():
    for inputs, labels in bundled().micro_batches(2, 4, 2, 0, 1):
        assert torch.equal(inputs[:, 1:], labels[:, :-1])
        assert inputs.is_contiguous() and labels.is_contiguous()


def test_synthetic_in_range_and_not_zero():
    dataset = synthetic(vocab=50)
    assert dataset.vocab_size == 50
    for step in range(3):
        batch = dataset.global_batch(step, 4)
        assert batch.min() >= 0 and batch.max() < 50
        assert batch.any() and all(row.any() for row in batch)


def test_bundled_tokenizer_round_trip():
    tokenizer = Tokenizer.from_file(str(BUNDLED_TOKENIZER))
    sentence = next(line for line in BUNDLED_CORPUS.read_text(encoding="utf-8").splitlines() if len(line) > 40)
    ids = tokenizer.encode(sentence).ids
    assert len(ids) < len(sentence)  # BPE merges compress the text
    assert tokenizer.decode(ids) == sentence


def test_tokenizer_path(small_text, small_tokenizer):
    dataset = TokenDataset(str(small_text), str(small_tokenizer), seq_len=16, model_vocab_size=300, seed=0)
    assert dataset.vocab_size == Tokenizer.from_file(str(small_tokenizer)).get_vocab_size() <= 300
    batch = dataset.global_batch(0, 4)
    assert batch.shape == (4, 17) and batch.max() < dataset.vocab_size
    decoded = Tokenizer.from_file(str(small_tokenizer)).decode(batch[0].tolist())
    assert decoded in small_text.read_text(encoding="utf-8") + END_OF_TEXT


def test_validate_data_args(tmp_path, small_text, small_tokenizer):
    validate_data_args(BUNDLED, None)
    validate_data_args(SYNTHETIC, None)
    validate_data_args(str(small_text), str(small_tokenizer))
    with pytest.raises(UserError, match="missing.txt"):
        validate_data_args(str(tmp_path / "missing.txt"), None)
    with pytest.raises(UserError, match="no_tokenizer.json"):
        validate_data_args(BUNDLED, str(tmp_path / "no_tokenizer.json"))
    with pytest.raises(UserError):
        TokenDataset(str(tmp_path / "missing.txt"), None, seq_len=8, model_vocab_size=MODEL_VOCAB, seed=0)


def test_corpus_too_short(tmp_path):
    path = tmp_path / "short.txt"
    path.write_text("To be, or not to be.", encoding="utf-8")
    with pytest.raises(UserError, match=r"has \d+ tokens.*seq_len \+ 1 = 1025"):
        TokenDataset(str(path), None, seq_len=1024, model_vocab_size=MODEL_VOCAB, seed=0)


def test_model_vocab_too_small():
    with pytest.raises(UserError, match="tokenizer vocab size 2048.*model vocab size 1000.*vocab_size >= 2048"):
        TokenDataset(BUNDLED, None, seq_len=SEQ_LEN, model_vocab_size=1000, seed=0)


@pytest.mark.parametrize("global_batch_size, micro_batch_size, dp_size", [(6, 1, 4), (8, 3, 2)])
def test_indivisible_batch(global_batch_size, micro_batch_size, dp_size):
    with pytest.raises(UserError, match="not divisible"):
        synthetic().micro_batches(0, global_batch_size, micro_batch_size, 0, dp_size)


def test_user_errors_are_one_line(tmp_path):
    with pytest.raises(UserError) as caught:
        TokenDataset(BUNDLED, None, seq_len=SEQ_LEN, model_vocab_size=10, seed=0)
    assert "\n" not in str(caught.value)


def test_synthetic_documents_have_the_mean_length_and_keep_the_tokens():
    plain = TokenDataset("synthetic", None, 512, 1000, seed=3, documents=True)
    packed = TokenDataset("synthetic", None, 512, 1000, seed=3, documents=True, synthetic_document_length=64)
    [one], [many] = plain.micro_batches(2, 8, 8, 0, 1), packed.micro_batches(2, 8, 8, 0, 1)
    assert torch.equal(one.inputs, many.inputs) and not one.document_ids.any()
    ids = many.document_ids
    assert ids[:, 0].eq(0).all() and (ids.diff(dim=1) >= 0).all() and (ids.diff(dim=1) <= 1).all()
    mean_length = ids.numel() / (ids[:, -1] + 1).sum().item()
    assert 48 < mean_length < 80, mean_length  # 4096 tokens: about 64 documents of geometric lengths
    # A pure function of (seed, step, row), whatever the data-parallel split.
    halves = [packed.micro_batches(2, 8, 4, rank, 2)[0].document_ids for rank in (0, 1)]
    assert torch.equal(torch.cat(halves), ids)
    assert not torch.equal(packed.micro_batches(3, 8, 8, 0, 1)[0].document_ids, ids)
    with pytest.raises(UserError, match="use it with --data synthetic"):
        TokenDataset("bundled", None, 64, 2048, seed=0, synthetic_document_length=8)
    with pytest.raises(UserError, match="--synthetic-document-length -1 must be >= 0"):
        TokenDataset("synthetic", None, 64, 2048, seed=0, synthetic_document_length=-1)
