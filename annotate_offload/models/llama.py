"""A built-in Llama architecture: RMSNorm, rotary embeddings, SwiGLU MLP, grouped-query attention.

The shape follows Meta's Llama (and Hugging Face's ``LlamaForCausalLM``): pre-RMSNorm blocks ::

    h = x + o_proj(sdpa_causal(rope(q_proj(n1(x))), rope(k_proj(n1(x))), v_proj(n1(x))))
    y = h + down_proj(silu(gate_proj(n2(h))) * up_proj(n2(h)))

with ``num_key_value_heads`` key/value heads shared by groups of query heads (GQA). The decoder
layers live in ``model.layers`` and the forward is a plain loop over them, so ``torch.fx`` traces it
with the layers as leaves. Weights come from an explicit seed through a CPU ``torch.Generator``, so
the same seed gives the same weights on every device.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from annotate_offload.annotate._decorators import offload_layer

__all__ = ["LlamaConfig", "Llama", "LlamaDecoderLayer", "LLAMA_PRESETS"]


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape of a :class:`Llama`.

    Attributes:
        hidden_size (int): model width ``H``, divisible by ``num_attention_heads``.
        intermediate_size (int): SwiGLU hidden width.
        num_layers (int): decoder layers ``L``.
        num_attention_heads (int): query heads; head dim ``H // num_attention_heads`` must be even.
        num_key_value_heads (int): key/value heads, dividing ``num_attention_heads``.
        vocab_size (int): token ids are in ``[0, vocab_size)``. Default: ``256`` (bytes).
        max_seq_len (int): longest sequence the rotary table covers. Default: ``2048``.
        rope_theta (float): rotary base. Default: ``10000.0``.
        rms_norm_eps (float): RMSNorm epsilon. Default: ``1e-5``.
        tie_word_embeddings (bool): LM head shares the embedding matrix. Default: ``False``.
        init_std (float): std of the normal init. Default: ``0.02``.

    Raises:
        ValueError: a non-positive size or an inconsistent head layout.
    """

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    vocab_size: int = 256
    max_seq_len: int = 2048
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    tie_word_embeddings: bool = False
    init_std: float = 0.02

    def __post_init__(self) -> None:
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.type in ("int", int) and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"LlamaConfig: {f.name} must be a positive int, got {value!r}.")
        for name in ("rope_theta", "rms_norm_eps", "init_std"):
            if not getattr(self, name) > 0:
                raise ValueError(f"LlamaConfig: {name} must be > 0, got {getattr(self, name)!r}.")
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"LlamaConfig: hidden_size={self.hidden_size} is not divisible by "
                f"num_attention_heads={self.num_attention_heads}; choose heads dividing hidden_size.")
        if self.head_dim % 2:
            raise ValueError(
                f"LlamaConfig: head dim hidden_size/num_attention_heads={self.head_dim} must be even for "
                f"rotary embeddings; change num_attention_heads.")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"LlamaConfig: num_attention_heads={self.num_attention_heads} is not divisible by "
                f"num_key_value_heads={self.num_key_value_heads}; use a divisor (1 = multi-query, "
                f"{self.num_attention_heads} = multi-head).")

    @property
    def head_dim(self) -> int:
        """``hidden_size // num_attention_heads``."""
        return self.hidden_size // self.num_attention_heads

    @classmethod
    def from_preset(cls, name: str, **changes) -> "LlamaConfig":
        """A named shape from :data:`LLAMA_PRESETS`, optionally with fields changed.

        Raises:
            ValueError: unknown ``name`` (the message lists the presets).
        """
        if name not in LLAMA_PRESETS:
            raise ValueError(f"LlamaConfig: unknown preset {name!r}; valid: {', '.join(sorted(LLAMA_PRESETS))}.")
        return dataclasses.replace(LLAMA_PRESETS[name], **changes)

    def num_parameters(self) -> int:
        """Parameter count of the :class:`Llama` built from this config (tied head counted once)."""
        h, f, hd = self.hidden_size, self.intermediate_size, self.head_dim
        kv = self.num_key_value_heads * hd
        per_layer = 2 * h + h * h + 2 * h * kv + h * h + 3 * h * f
        head = 0 if self.tie_word_embeddings else self.vocab_size * h
        return self.num_layers * per_layer + self.vocab_size * h + h + head


LLAMA_PRESETS: dict[str, LlamaConfig] = {
    # ~0.8M parameters: a few hundred steps of 8 x 128 bytes train in about a minute on 2 CPU cores.
    "llama-tiny": LlamaConfig(hidden_size=128, intermediate_size=352, num_layers=4, num_attention_heads=4,
                              num_key_value_heads=2, max_seq_len=512),
    # Llama 3.2 1B's decoder (hidden 2048, 16 layers, 32 heads, 8 KV heads, SwiGLU 8192, tied head,
    # rope_theta 5e5) with a byte vocabulary: 0.97B parameters. Source: the model's public config.json.
    "llama-1b": LlamaConfig(hidden_size=2048, intermediate_size=8192, num_layers=16, num_attention_heads=32,
                            num_key_value_heads=8, max_seq_len=8192, rope_theta=500000.0,
                            tie_word_embeddings=True),
}


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dim, computed in (at least) fp32, cast back, then scaled."""

    def __init__(self, dim: int, eps: float, *, device=None, dtype=None) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, device=device, dtype=dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # at least fp32 (bf16/fp16 go up; fp64 stays), traced as data, not as Python control flow
        x32 = x.to(torch.promote_types(x.dtype, torch.float32))
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x`` (``B, heads, T, head_dim``) by angles whose ``cos``/``sin`` are ``(T, head_dim)``."""
    cos, sin = cos.to(x.dtype), sin.to(x.dtype)
    return x * cos + _rotate_half(x) * sin


def rotary_tables(head_dim: int, max_seq_len: int, theta: float, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """fp32 ``cos, sin`` of shape ``(max_seq_len, head_dim)`` (the two halves repeat, HF layout)."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64, device=device) / head_dim))
    angles = torch.outer(torch.arange(max_seq_len, dtype=torch.float64, device=device), inv_freq)
    angles = torch.cat((angles, angles), dim=-1)
    return angles.cos().float(), angles.sin().float()


class LlamaAttention(nn.Module):
    """Causal grouped-query self-attention with rotary positions, through ``F.scaled_dot_product_attention``.

    Shapes: ``x`` ``(B, T, H)``, ``cos``/``sin`` ``(T, head_dim)`` → ``(B, T, H)``.
    """

    def __init__(self, config: LlamaConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype, "bias": False}
        h, hd = config.hidden_size, config.head_dim
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = hd
        self.q_proj = nn.Linear(h, self.num_heads * hd, **kw)
        self.k_proj = nn.Linear(h, self.num_kv_heads * hd, **kw)
        self.v_proj = nn.Linear(h, self.num_kv_heads * hd, **kw)
        self.o_proj = nn.Linear(self.num_heads * hd, h, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        q = self.q_proj(x).unflatten(-1, (self.num_heads, self.head_dim)).transpose(1, 2)
        k = self.k_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).unflatten(-1, (self.num_kv_heads, self.head_dim)).transpose(1, 2)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        groups = self.num_heads // self.num_kv_heads
        if groups > 1:
            # Explicit repeat instead of SDPA's enable_gqa: every backend (math, memory-efficient,
            # flash) accepts it, so exactness tests can pin a bit-reproducible one.
            k = k.repeat_interleave(groups, dim=1)
            v = v.repeat_interleave(groups, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).flatten(2))


class LlamaMLP(nn.Module):
    """SwiGLU: ``down_proj(silu(gate_proj(x)) * up_proj(x))``, ``(B, T, H)`` → ``(B, T, H)``."""

    def __init__(self, config: LlamaConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype, "bias": False}
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, **kw)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, **kw)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, **kw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


@offload_layer  # declared, so a one-layer model is found too (discovery needs repeated blocks)
class LlamaDecoderLayer(nn.Module):
    """One pre-RMSNorm block: attention then SwiGLU MLP, each with a residual.

    Shapes: ``x`` ``(B, T, H)``, ``cos``/``sin`` ``(T, head_dim)`` fp32 → ``(B, T, H)``.
    """

    def __init__(self, config: LlamaConfig, *, device=None, dtype=None) -> None:
        super().__init__()
        kw = {"device": device, "dtype": dtype}
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.self_attn = LlamaAttention(config, **kw)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.mlp = LlamaMLP(config, **kw)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.self_attn(self.input_layernorm(x), cos, sin)
        return h + self.mlp(self.post_attention_layernorm(h))


class Llama(nn.Module):
    """Decoder-only Llama language model.

    Args:
        config (LlamaConfig): shape.
        seed (int): seed of the weight init (CPU generator; same weights on every device).
            Default: ``0``.
        device (torch.device | str | None): where the parameters live. Default: CPU.
        dtype (torch.dtype | None): parameter dtype (init happens in fp32, then casts).
            Default: ``torch.float32``.

    Forward: ``input_ids`` ``(B, T)`` int64, ``T <= config.max_seq_len`` → logits ``(B, T, vocab_size)``.
    """

    def __init__(self, config: LlamaConfig, *, seed: int = 0, device=None, dtype=None) -> None:
        super().__init__()
        if not isinstance(config, LlamaConfig):
            raise TypeError(f"Llama: config must be a LlamaConfig, got {type(config).__name__}.")
        self.config = config
        kw = {"device": "meta", "dtype": torch.float32}  # built empty, then initialised from `seed`
        self.embed_tokens = nn.Embedding(config.vocab_size, config.hidden_size, **kw)
        self.layers = nn.ModuleList([LlamaDecoderLayer(config, **kw) for _ in range(config.num_layers)])
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, **kw)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, **kw)
        cos, sin = rotary_tables(config.head_dim, config.max_seq_len, config.rope_theta, device="meta")
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.to_empty(device="cpu")
        self.reset_parameters(seed)
        if device is not None or dtype is not None:
            self.to(device=device, dtype=dtype)
            if config.tie_word_embeddings:
                self.lm_head.weight = self.embed_tokens.weight
            # the rotary tables stay fp32 whatever the parameter dtype (they are cast at use)
            cos, sin = rotary_tables(config.head_dim, config.max_seq_len, config.rope_theta)
            self.rope_cos = cos.to(self.rope_cos.device)
            self.rope_sin = sin.to(self.rope_sin.device)

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Re-initialise every weight from ``seed`` (normal ``init_std``; ``o_proj``/``down_proj``
        scaled by ``1/sqrt(2L)``; norms to one) and recompute the rotary tables."""
        cfg = self.config
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.embed_tokens.weight  # before the loop: initialised once
        gen = torch.Generator(device="cpu").manual_seed(seed)
        out_std = cfg.init_std / math.sqrt(2 * cfg.num_layers)
        for name, param in self.named_parameters():
            if name.endswith("layernorm.weight") or name == "norm.weight":
                cpu = torch.ones(param.shape)
            else:
                std = out_std if name.endswith(("o_proj.weight", "down_proj.weight")) else cfg.init_std
                cpu = torch.empty(param.shape).normal_(0.0, std, generator=gen)
            param.copy_(cpu)
        cos, sin = rotary_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta)
        self.rope_cos = cos.to(self.rope_cos.device)
        self.rope_sin = sin.to(self.rope_sin.device)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        seq_len = input_ids.size(1)
        # narrow, not slicing: fx sees a Proxy length through torch.narrow but not inside a slice
        cos, sin = self.rope_cos.narrow(0, 0, seq_len), self.rope_sin.narrow(0, 0, seq_len)
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x, cos, sin)
        return self.lm_head(self.norm(x))
