"""Training text and byte batches (annotate_offload.data), used by the CLI recipes."""

from __future__ import annotations

import pytest
import torch

from annotate_offload.data import VOCAB_SIZE, ByteBatches, encode, load_text


def test_builtin_text_is_cpython_documentation():
    text = load_text()
    assert len(text) > 100_000
    assert b"The \"if\" statement" in text or b"if_stmt" in text
    assert text == load_text()  # same order every time
    assert text.decode("utf-8")  # real UTF-8 English text


def test_encode_is_bytes():
    tokens = encode("héllo".encode("utf-8"))
    assert tokens.dtype == torch.int64 and tokens.tolist() == list("héllo".encode("utf-8"))
    assert int(encode(load_text()).max()) < VOCAB_SIZE


def test_batches_are_deterministic_shifted_windows():
    tokens = encode(load_text())
    batches = ByteBatches(tokens, micro_batch_size=4, seq_length=32, seed=5)
    x, y = batches[3]
    assert x.shape == y.shape == (4, 32) and x.dtype == y.dtype == torch.int64
    assert torch.equal(x[:, 1:], y[:, :-1])
    x2, y2 = ByteBatches(tokens, micro_batch_size=4, seq_length=32, seed=5)[3]
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert not torch.equal(x, batches[4][0])
    assert not torch.equal(x, ByteBatches(tokens, micro_batch_size=4, seq_length=32, seed=6)[3][0])
    # each row is a contiguous window of the corpus
    row = x[0].tolist() + [y[0, -1].item()]
    assert bytes(row) in load_text()


def test_user_file(tmp_path):
    path = tmp_path / "mine.txt"
    path.write_text("abcdefghij" * 10)
    tokens = encode(load_text(path))
    x, y = ByteBatches(tokens, micro_batch_size=2, seq_length=8)[0]
    assert set(x.flatten().tolist()) <= set(b"abcdefghij")


def test_missing_file(tmp_path):
    with pytest.raises(ValueError, match=r"data file '.*nope\.txt' does not exist; pass --data"):
        load_text(tmp_path / "nope.txt")


def test_directory(tmp_path):
    with pytest.raises(ValueError, match=r"is not a regular file"):
        load_text(tmp_path)


def test_empty_file(tmp_path):
    path = tmp_path / "empty.txt"
    path.write_bytes(b"")
    with pytest.raises(ValueError, match=r"data file '.*empty\.txt' is empty"):
        load_text(path)


def test_too_short_for_one_window():
    with pytest.raises(ValueError, match=r"the text has 5 bytes, fewer than seq_length \+ 1 = 9"):
        ByteBatches(encode(b"hello"), micro_batch_size=1, seq_length=8)
    with pytest.raises(ValueError, match=r"micro_batch_size=0"):
        ByteBatches(encode(b"hello"), micro_batch_size=0, seq_length=2)
