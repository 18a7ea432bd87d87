"""Shared helpers (not a conftest, to keep fixtures local) for the HybridDeviceOptimizer tests: a tiny two-group model and its torch AdamW twin, seeded inputs, a host class that fails once."""

from __future__ import annotations

import copy

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


def inputs(n, seed):
    """``n`` seeded ``5 x 8`` inputs of the Tiny model."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(5, 8, generator=g) for _ in range(n)]


class FailsOnce:
    """Mixin for a torch optimizer class: an instance marked ``fail_next`` raises at its next step (a host
    chunk that fails once)."""

    def step(self, closure=None):
        if getattr(self, "fail_next", False):
            self.fail_next = False
            raise RuntimeError("host chunk failed")
        return super().step(closure)


class FailOnce(FailsOnce, torch.optim.AdamW):
    """AdamW that fails once when marked."""


def loss_of(model, x):
    return model(x.to(next(model.parameters()).dtype)).float().square().mean()


def pair(dtype=torch.float32, device="cpu"):
    """``(model, twin)``: two identical models."""
    m = Tiny(dtype=dtype, device=device)
    return m, copy.deepcopy(m)


def train(model, opt, xs, *, sched=None, clip=None, micro=1, zero=True):
    """Run ``len(xs)`` steps; ``clip``: ``None`` | ``"torch"`` | ``"opt"``."""
    for x in xs:
        for _ in range(micro):
            loss_of(model, x).backward()
        if clip == "torch":
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.05)
        elif clip == "opt":
            opt.clip_grad_norm_(0.05)
        opt.step()
        if sched is not None:
            sched.step()
        if zero:
            opt.zero_grad()


def assert_same(a, b, rtol=0.0, atol=0.0):
    for (n, p), q in zip(a.named_parameters(), b.parameters()):
        torch.testing.assert_close(p, q, rtol=rtol, atol=atol, msg=lambda m: f"{n}: {m}")
