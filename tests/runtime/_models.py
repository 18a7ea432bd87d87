"""Small models shared by the runtime tests."""

from __future__ import annotations

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint


class Block(nn.Module):
    """A pre-norm transformer block: LayerNorm, fused QKV, causal SDPA, GELU MLP, residuals."""

    def __init__(self, hidden: int = 64, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(hidden)
        self.qkv = nn.Linear(hidden, 3 * hidden)
        self.proj = nn.Linear(hidden, hidden)
        self.ln2 = nn.LayerNorm(hidden)
        self.fc1 = nn.Linear(hidden, 4 * hidden)
        self.fc2 = nn.Linear(4 * hidden, hidden)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, h = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, s, 3, self.heads, h // self.heads).permute(
            2, 0, 3, 1, 4
        )
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(a.transpose(1, 2).reshape(b, s, h))
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


def make_stack(layers: int = 4, hidden: int = 64, heads: int = 4, device: str = "cpu", dtype=None):
    torch.manual_seed(1234)
    blocks = nn.ModuleList([Block(hidden, heads) for _ in range(layers)])
    return blocks.to(device=device, dtype=dtype)


def clone(module: nn.Module) -> nn.Module:
    return copy.deepcopy(module)


def run_plain(blocks, x):
    for blk in blocks:
        x = blk(x)
    return x


def run_offloaded(blocks, x, ctx, sync):
    for blk in blocks:
        with ctx:
            x = blk(x)
        x = sync(x)
    return x


# Two offload layers: a non-reentrant checkpoint of tanh (it saves an empty CPU tensor before its
# input), then a sum.
CHECKPOINTED_TANH_THEN_SUM = (lambda t: torch.utils.checkpoint.checkpoint(torch.tanh, t, use_reentrant=False),
                              torch.sum)


def grads(module: nn.Module) -> list:
    return [p.grad.detach().clone() for p in module.parameters()]


def assert_bit_identical(a: list, b: list) -> None:
    assert len(a) == len(b)
    for i, (x, y) in enumerate(zip(a, b)):
        torch.testing.assert_close(x, y, rtol=0, atol=0, msg=lambda m: f"tensor {i}: {m}")
