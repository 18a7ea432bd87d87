"""Helpers for the HybridDeviceOptimizer tests: a tiny two-group model and its torch AdamW twin."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn


class Tiny(nn.Module):
    """Three Linear layers and a LayerNorm; ``groups()`` gives two param groups (weights / rest)."""

    def __init__(self, dtype=torch.float32, device="cpu") -> None:
        super().__init__()
        self.l1 = nn.Linear(8, 32, device=device, dtype=dtype)
        self.l2 = nn.Linear(32, 32, device=device, dtype=dtype)
        self.norm = nn.LayerNorm(32, device=device, dtype=dtype)
        self.l3 = nn.Linear(32, 4, device=device, dtype=dtype)

    def forward(self, x):
        return self.l3(self.norm(torch.relu(self.l2(torch.relu(self.l1(x))))))

    def groups(self, lr=1e-2):
        w = [p for n, p in self.named_parameters() if n.endswith("weight") and p.dim() == 2]
        rest = [p for n, p in self.named_parameters() if not (n.endswith("weight") and p.dim() == 2)]
        return [{"params": w, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0, "lr": lr * 0.5}]


def loss_of(model, x):
    return model(x.to(next(model.parameters()).dtype)).float().square().mean()


@pytest.fixture
def pair():
    """``(model, twin)``: identical fp32 models on the CPU."""

    def make(dtype=torch.float32, device="cpu"):
        m = Tiny(dtype=dtype, device=device)
        return m, copy.deepcopy(m)

    return make


def assert_same(a, b, rtol=0.0, atol=0.0):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m: f"{n}: {m}")
