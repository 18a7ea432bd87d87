"""Small models and a reference-comparison helper for the annotation tests."""

from __future__ import annotations


import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from annotate_offload.config import ModelConfig
from annotate_offload.models import GPTConfig, GPTStack


class MLPBlock(nn.Module):
    """Attention-free block (the meta estimate and the real run save the same tensors)."""

    def __init__(self, h: int = 64) -> None:
        super().__init__()
        self.fc1 = nn.Linear(h, 2 * h)
        self.fc2 = nn.Linear(2 * h, h)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(x)))


class CkptInside(nn.Module):
    """A block that checkpoints its own MLP (checkpoint *inside* the layer)."""

    def __init__(self, h: int = 64, reentrant: bool = False) -> None:
        super().__init__()
        self.inner = MLPBlock(h)
        self.reentrant = reentrant

    def forward(self, x):
        return checkpoint(self.inner, x, use_reentrant=self.reentrant)


class Stack(nn.Module):
    """``layers`` blocks in a ModuleList with an input and output projection.

    ``around``: None, "reentrant" or "non_reentrant" — checkpoint *around* every layer call.
    """

    def __init__(self, n: int = 4, h: int = 64, block=MLPBlock, around: str | None = None) -> None:
        super().__init__()
        self.inp = nn.Linear(h, h)
        self.layers = nn.ModuleList([block(h) for _ in range(n)])
        self.out = nn.Linear(h, h)
        self.around = around

    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            if self.around is None:
                x = layer(x)
            else:
                x = checkpoint(layer, x, use_reentrant=self.around == "reentrant")
        return self.out(x)


def gpt(n: int = 4, h: int = 64) -> GPTStack:
    return GPTStack(GPTConfig(hidden=h, heads=4, layers=n))


def run_step(model: nn.Module, x: torch.Tensor):
    """One forward/backward; returns (loss, {name: grad}, input grad)."""
    x = x.detach().clone().requires_grad_(True)
    loss = model(x).square().mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return loss.detach(), grads, x.grad


def assert_same_step(a, b) -> None:
    """Loss, every parameter gradient and the input gradient bit-identical (rtol=atol=0)."""
    (la, ga, xa), (lb, gb, xb) = a, b
    assert torch.equal(la, lb), (la, lb)
    assert ga.keys() == gb.keys()
    for name in ga:
        assert torch.equal(ga[name], gb[name]), f"grad of {name} differs"
    assert torch.equal(xa, xb)


def sync_of(model):
    """The runtime engine the transformed model drives (public: ``model.offload_plan.runtime``)."""
    sync = model.offload_plan.runtime
    assert sync is model.__dict__["_annotate_offload_state"].sync
    return sync


def cfg(**kw) -> ModelConfig:
    """An offload config for the tiny test models: every saved tensor is large enough."""
    return ModelConfig(cpu_offloading=True, **{"min_offload_numel": 0, **kw})


