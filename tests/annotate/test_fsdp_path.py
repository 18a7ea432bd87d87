"""FSDP2-managed models take the hook path without tracing (tracing would run FSDP's lazy init)."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from annotate_offload import OffloadError
from annotate_offload.annotate import offload_transform, remove_offload


class FSDPModule:  # stands in for torch.distributed.fsdp.FSDPModule (matched by class name)
    pass


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class ShardedBlock(Block, FSDPModule):
    pass


class Stack(nn.Module):
    def __init__(self, cls):
        super().__init__()
        self.layers = nn.ModuleList([cls() for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


def test_fsdp_managed_model_uses_hooks_and_says_why():
    model = Stack(ShardedBlock)
    offload_transform(model, num_layers=2, min_offload_numel=0)
    plan = model.offload_plan
    assert plan.path == "hooks" and "FSDP2" in plan.fx_failure
    x = torch.randn(4, 16, requires_grad=True)
    model(x).sum().backward()
    remove_offload(model)


def test_fsdp_managed_model_refuses_forced_fx():
    model = Stack(ShardedBlock)
    with pytest.raises(OffloadError, match="managed by FSDP2"):
        offload_transform(model, num_layers=2, path="fx")
    assert "forward" not in model.__dict__  # nothing half-applied


def test_plain_model_still_traced():
    model = Stack(Block)
    offload_transform(model, num_layers=2)
    assert model.offload_plan.path == "fx"


def test_remove_offload_on_a_non_module_is_a_type_error():
    with pytest.raises(TypeError, match="remove_offload: model must be the nn.Module"):
        remove_offload("hello")
