"""torch.compile (backend="aot_eager") of a transformed model: exact and offloading, in any order.

Dynamo traces the layer wrappers and the fx pass in ``annotate_offload.compile`` offloads the saved
activations of the partitioned graph (tests/compile has the rest). Whether the model, or another model
of the same classes, was compiled before the transform does not matter: Dynamo's guards see the
layers' instance forwards.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.nn as nn

from annotate_offload.annotate import offload_transform

from ._models import assert_same_step, cfg, sync_of

pytest.importorskip("torch._dynamo")


class _Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class _Stack(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_Block() for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _step(m, x, compiled=None):
    """run_step through ``compiled`` (``torch.compile(m)``) or ``m``."""
    x = x.detach().clone().requires_grad_(True)
    loss = (m if compiled is None else compiled)(x).square().mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    return loss.detach(), grads, x.grad


@pytest.mark.parametrize("order", ["transform_then_compile", "compile_then_transform", "class_compiled_before"])
def test_compiled_transformed_model_trains_exactly_and_offloads(order):
    x = torch.randn(8, 64)
    if order == "class_compiled_before":  # a baseline of the same classes compiled first
        base = _Stack()
        _step(base, x, torch.compile(base, backend="aot_eager"))
    m = _Stack()
    ref = copy.deepcopy(m)
    compiled = torch.compile(m, backend="aot_eager")
    if order == "compile_then_transform":
        _step(m, x, compiled)
    offload_transform(m, 2, config=cfg())
    for _ in range(2):
        assert_same_step(_step(m, x, compiled), _step(ref, x))
        assert sync_of(m).stats.bytes_offloaded_per_layer.keys() == {0, 1}
