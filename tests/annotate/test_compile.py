"""torch.compile (backend="eager") of a transformed model on the hook path.

Note [Hooks skipped by torch.compile] (annotate_offload/annotate/_forwards.py): Dynamo does not guard
on module hooks by default, so code compiled for a layer class before offload_transform keeps running
without our hooks (fresh-user report, seventh session: a compiled baseline of the same class first,
then the transformed model offloaded 0 tensors, silently). Gradients stay exact; the step must say
that nothing moved.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn as nn

from annotate_offload.annotate import offload_transform

from ._models import assert_same_step, sync_of

pytest.importorskip("torch._dynamo")


class _BlockA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(64, 128), nn.Linear(128, 64)

    def forward(self, x):
        return x + self.b(torch.relu(self.a(x)))


class _StackA(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = nn.ModuleList(_BlockA() for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _BlockB(_BlockA):
    def forward(self, x):  # its own code object: Dynamo's cache for _BlockA does not apply
        return x + self.b(torch.relu(self.a(x)))


class _StackB(_StackA):
    def __init__(self) -> None:
        nn.Module.__init__(self)
        self.layers = nn.ModuleList(_BlockB() for _ in range(4))

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


@pytest.fixture(autouse=True)
def _fresh_dynamo():
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def _step(m, x, compiled):
    """run_step through ``torch.compile(m)`` (its parameters keep the names of ``m``)."""
    x = x.detach().clone().requires_grad_(True)
    loss = (torch.compile(m, backend="eager") if compiled else m)(x).square().mean()
    loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in m.named_parameters()}
    m.zero_grad(set_to_none=True)
    return loss.detach(), grads, x.grad


def _transform(m):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        offload_transform(m, num_layers=2, path="hooks", min_offload_numel=0)


def test_compiled_after_the_transform_offloads():
    m = _StackA()
    ref = copy.deepcopy(m)
    _transform(m)
    x = torch.randn(8, 64)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert_same_step(_step(m, x, True), _step(ref, x, False))
    assert not [w for w in seen if "without any layer's forward hooks" in str(w.message)]
    assert sync_of(m).stats.bytes_offloaded_per_layer.keys() == {0, 1}


def test_a_class_compiled_before_the_transform_warns_and_reset_fixes_it():
    x = torch.randn(8, 64)
    baseline = _StackB()
    _step(baseline, x, True)  # compiles _BlockB.forward without hooks
    m = _StackB()
    ref = copy.deepcopy(m)
    _transform(m)
    with pytest.warns(UserWarning, match=r"hook path\): a training forward ran without any layer's forward hooks.*"
                                         r"torch._dynamo.reset\(\)"):
        a = _step(m, x, True)
    assert_same_step(a, _step(ref, x, False))  # exact, but nothing moved
    assert not sync_of(m).stats.bytes_offloaded_per_layer
    torch._dynamo.reset()
    assert_same_step(_step(m, x, True), _step(ref, x, False))
    assert sync_of(m).stats.bytes_offloaded_per_layer.keys() == {0, 1}
