"""Training text and byte-level batches for the CLI recipes.

The default corpus ships with every CPython: the documentation topics of ``pydoc_data.topics``
(the text behind ``help("if")``, about 0.45 MB), joined in sorted-key order. Tokens are bytes
(vocabulary 256), and batch ``i`` depends only on ``(seed, i)``, so an offloaded run and its
baseline see the same data in the same order.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Union

import torch

__all__ = ["VOCAB_SIZE", "load_text", "encode", "ByteBatches"]

VOCAB_SIZE = 256


def _builtin_text() -> bytes:
    from pydoc_data.topics import topics  # stdlib; imported lazily (about 0.5 MB of strings)

    return "\n\n".join(topics[key] for key in sorted(topics)).encode("utf-8")


def load_text(path: Optional[Union[str, os.PathLike]] = None) -> bytes:
    """The training corpus as raw bytes.

    Args:
        path (str | os.PathLike | None): a text file (any encoding: bytes are the tokens).
            ``None``: the CPython documentation topics (``pydoc_data.topics``). Default: ``None``.

    Raises:
        ValueError: ``path`` does not exist, is not a regular file, cannot be read, or is empty.
    """
    if path is None:
        return _builtin_text()
    p = Path(path)
    if not p.exists():
        raise ValueError(f"data file {str(p)!r} does not exist; pass --data with the path of a text file, "
                         f"or omit --data to train on the bundled CPython documentation text.")
    if not p.is_file():
        raise ValueError(f"data path {str(p)!r} is not a regular file; pass --data with the path of a text file.")
    try:
        data = p.read_bytes()
    except OSError as exc:
        raise ValueError(f"data file {str(p)!r} cannot be read ({exc.strerror}); check its permissions.") from None
    if not data:
        raise ValueError(f"data file {str(p)!r} is empty; pass a text file with at least seq_length + 1 bytes.")
    return data


def encode(data: bytes) -> torch.Tensor:
    """Byte-level tokens: ``(len(data),)`` int64 in ``[0, 256)``."""
    return torch.frombuffer(bytearray(data), dtype=torch.uint8).to(torch.int64)


class ByteBatches:
    """Deterministic ``(input, target)`` windows of a token stream for next-token prediction.

    Batch ``i`` holds ``micro_batch_size`` windows starting at offsets drawn from a CPU
    generator seeded with ``seed * 1_000_003 + i``; ``target`` is ``input`` shifted by one token.

    Args:
        tokens (torch.Tensor): ``(N,)`` int64 token ids.
        micro_batch_size (int): windows per batch ``B``.
        seq_length (int): tokens per window ``T``; needs ``N >= T + 1``.
        seed (int): data-order seed. Default: ``0``.

    Raises:
        ValueError: too few tokens for one window, or a non-positive size.
    """

    def __init__(self, tokens: torch.Tensor, *, micro_batch_size: int, seq_length: int, seed: int = 0) -> None:
        if micro_batch_size < 1 or seq_length < 1:
            raise ValueError(f"ByteBatches: micro_batch_size={micro_batch_size} and seq_length={seq_length} "
                             f"must be positive.")
        if tokens.dim() != 1 or tokens.dtype != torch.int64:
            raise ValueError(f"ByteBatches: tokens must be a 1-D int64 tensor, got {tuple(tokens.shape)} {tokens.dtype}.")
        if tokens.numel() < seq_length + 1:
            raise ValueError(f"the text has {tokens.numel()} bytes, fewer than seq_length + 1 = {seq_length + 1}; "
                             f"use a longer file or a smaller model.seq_length.")
        self.tokens = tokens
        self.micro_batch_size = micro_batch_size
        self.seq_length = seq_length
        self.seed = seed

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(input, target)``, each ``(micro_batch_size, seq_length)`` int64 on the CPU."""
        gen = torch.Generator().manual_seed(self.seed * 1_000_003 + index)
        starts = torch.randint(0, self.tokens.numel() - self.seq_length, (self.micro_batch_size,), generator=gen)
        chunk = self.tokens[starts[:, None] + torch.arange(self.seq_length + 1)]
        return chunk[:, :-1].contiguous(), chunk[:, 1:].contiguous()

    def __repr__(self) -> str:
        return (f"ByteBatches(tokens={self.tokens.numel()}, micro_batch_size={self.micro_batch_size}, "
                f"seq_length={self.seq_length}, seed={self.seed})")
