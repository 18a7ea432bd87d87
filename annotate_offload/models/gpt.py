"""A plain GPT stack: the benchmark workloads' model and a small trainable LM for tests.

Each :class:`GPTBlock` is pre-LayerNorm attention then a pre-LayerNorm MLP::

    x = x + proj(causal_sdpa(qkv(ln1(x))))
    x = x + fc2(gelu(fc1(ln2(x))))          # fc1: hidden -> 4*hidden

:class:`GPTStack` holds the blocks in ``self.layers`` and its forward is a plain loop over them,
so ``torch.fx`` traces it with the blocks as leaves (and the blocks too).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from annotate_offload.annotate._decorators import offload_layer

__all__ = ["GPTConfig", "GPTBlock", "GPTStack"]


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPTStack`.

    Attributes:
        hidden (int): model width ``H``; must be divisible by ``heads``.
        heads (int): attention heads; head dim is ``hidden // heads``.
        layers (int): number of :class:`GPTBlock` layers ``L``.
        vocab (int | None): if given, the stack embeds token ids (``B, S`` int64) and returns
            logits (``B, S, vocab``); if ``None`` it maps hidden states (``B, S, H``) to hidden
            states. Default: ``None``.
        max_seq (int): length of the learned position table (only with ``vocab``). Default: ``2048``.
        mlp_ratio (int): MLP hidden size is ``mlp_ratio * hidden``. Default: ``4``.
        bias (bool): biases in the Linear layers. Default: ``True``.
        eps (float): LayerNorm epsilon. Default: ``1e-5``.

    Raises:
        ValueError: a non-positive size, or ``hidden`` not divisible by ``heads``.
    """

    hidden: int
    heads: int
    layers: int
    vocab: int | None = None
    max_seq: int = 2048
    mlp_ratio: int = 4
    bias: bool = True
    eps: float = 1e-5

    def __post_init__(self) -> None:
        for name in ("hidden", "heads", "layers", "max_seq", "mlp_ratio"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"GPTConfig: {name} must be a positive int, got {value!r}; pass e.g. {name}=8.")
        if self.vocab is not None and (isinstance(self.vocab, bool) or not isinstance(self.vocab, int) or self.vocab < 1):
            raise ValueError(f"GPTConfig: vocab must be None or a positive int, got {self.vocab!r}.")
        if self.hidden % self.heads:
            raise ValueError(
                f"GPTConfig: hidden={self.hidden} is not divisible by heads={self.heads}; "
                f"choose heads dividing hidden (e.g. heads={_largest_divisor(self.hidden, self.heads)})."
            )

    @property
    def head_dim(self) -> int:
        """``hidden // heads``."""
        return self.hidden // self.heads

    def num_parameters(self) -> int:
        """Parameter count of the :class:`GPTStack` this config builds (biases included)."""
        h, f, b = self.hidden, self.mlp_ratio * self.hidden, int(self.bias)
        per_layer = 4 * h  # two LayerNorms (weight + bias)
        per_layer += 3 * h * h + b * 3 * h  # qkv
        per_layer += h * h + b * h  # proj
        per_layer += 2 * h * f + b * (f + h)  # fc1 + fc2
        total = self.layers * per_layer
        if self.vocab is not None:
            total += self.vocab * h + self.max_seq * h + 2 * h + self.vocab * h
        return total


def _largest_divisor(n: int, at_most: int) -> int:
    for d in range(min(n, at_most), 0, -1):
        if n % d == 0:
            return d
    return 1


@offload_layer  # declared, so a one-layer model is found too (discovery needs repeated blocks)
class GPTBlock(nn.Module):
    """One pre-LayerNorm transformer block with causal attention.

    Args:
        config (GPTConfig): sizes.
        device, dtype: forwarded to the parameter factories (e.g. ``dtype=torch.bfloat16``).

    Shapes: input and output ``(B, S, H)``.
    """

    def __init__(self, config: GPTConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        h, f = config.hidden, config.mlp_ratio * config.hidden
        kw = {"device": device, "dtype": dtype}
        self.heads = config.heads
        self.head_dim = config.head_dim
        self.ln1 = nn.LayerNorm(h, eps=config.eps, **kw)
        self.qkv = nn.Linear(h, 3 * h, bias=config.bias, **kw)
        self.proj = nn.Linear(h, h, bias=config.bias, **kw)
        self.ln2 = nn.LayerNorm(h, eps=config.eps, **kw)
        self.fc1 = nn.Linear(h, f, bias=config.bias, **kw)
        self.fc2 = nn.Linear(f, h, bias=config.bias, **kw)

    def attention(self, x: torch.Tensor) -> torch.Tensor:
        """Causal self-attention of ``x`` (``B, S, H``) → ``(B, S, H)``."""
        qkv = self.qkv(x).unflatten(-1, (3, self.heads, self.head_dim))  # B, S, 3, nh, hd
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each B, nh, S, hd
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).flatten(2))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.ln1(x))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPTStack(nn.Module):
    """``config.layers`` :class:`GPTBlock` s in ``self.layers``, optionally with embedding and LM head.

    Args:
        config (GPTConfig): sizes.
        device, dtype: forwarded to every parameter (e.g. ``device="cuda", dtype=torch.bfloat16``).

    Forward: hidden states ``(B, S, H)`` (float) → ``(B, S, H)``, or with ``config.vocab`` token ids
    ``(B, S)`` (int64, ``S <= max_seq``) → logits ``(B, S, vocab)``.
    """

    def __init__(self, config: GPTConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        if not isinstance(config, GPTConfig):
            raise TypeError(f"GPTStack: config must be a GPTConfig, got {type(config).__name__}.")
        self.config = config
        kw = {"device": device, "dtype": dtype}
        if config.vocab is not None:
            self.embed = nn.Embedding(config.vocab, config.hidden, **kw)
            self.pos = nn.Parameter(torch.zeros(config.max_seq, config.hidden, **kw))
            nn.init.normal_(self.pos, std=0.02)
        self.layers = nn.ModuleList([GPTBlock(config, **kw) for _ in range(config.layers)])
        if config.vocab is not None:
            self.ln_f = nn.LayerNorm(config.hidden, eps=config.eps, **kw)
            self.head = nn.Linear(config.hidden, config.vocab, bias=False, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.config.vocab is not None:
            x = self.embed(x) + self.pos[: x.size(1)]
        for layer in self.layers:
            x = layer(x)
        if self.config.vocab is not None:
            x = self.head(self.ln_f(x))
        return x
