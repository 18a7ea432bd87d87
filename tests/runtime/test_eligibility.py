"""Which saved tensors stay on the device as weights (DESIGN.md runtime rules 3 and 6): real
parameters, their views and their autocast casts; any other saved tensor, a leaf that requires
grad included, is eligible."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from annotate_offload.runtime import DefaultOffloadSynchronizer


def _one_layer(fn):
    sync = DefaultOffloadSynchronizer(2, 1, device="cpu", min_offload_numel=0)
    sync.enter_layer(0)
    y = sync.commit_layer(fn(), 0)
    sync.enter_layer(1)
    loss = sync.commit_layer(y.float().sum(), 1)
    loss.backward()
    return sync.stats


def test_a_leaf_that_requires_grad_is_offloaded_and_a_parameter_is_not():
    """A model input with requires_grad (HF's enable_input_require_grads gives the first layer one)
    is an activation and is offloaded; the weight is kept, and so are its bf16 cast and views."""
    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(32, 64, requires_grad=True)  # a leaf, not a parameter
    ref = torch.autograd.grad((x @ w).sum(), (x, w))
    stats = _one_layer(lambda: x @ w)
    assert stats.bytes_offloaded == x.nbytes and stats.kept["parameter"] == 1  # x moved, w kept
    assert torch.equal(x.grad, ref[0]) and torch.equal(w.grad, ref[1])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        stats = _one_layer(lambda: F.linear(x, w))
    assert stats.bytes_offloaded == x.numel() * 2  # the bf16 cast of x; w's cast stays
    assert stats.kept["parameter"] >= 1


def test_a_sparse_tensor_saved_in_a_kept_layer_after_an_offloaded_one_trains_as_without_offload():
    """The layer after an offloaded one paces its reload by the bytes it keeps; a sparse tensor has no
    ``nbytes`` and stays on the device."""
    from annotate_offload import offload_transform

    class Sparse(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.lin = torch.nn.Linear(16, 16)

        def forward(self, x):
            h = self.lin(x)
            return torch.sparse.mm((h * (h > 0)).to_sparse(), self.lin.weight.t()) + h

    class Stack(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.layers = torch.nn.ModuleList([Sparse() for _ in range(3)])

        def forward(self, x):
            for layer in self.layers:
                x = layer(x)
            return x

    ref = Stack()
    m = Stack()
    m.load_state_dict(ref.state_dict())
    offload_transform(m, num_layers=1, min_offload_numel=0)
    x = torch.randn(4, 16)
    ref(x).sum().backward()
    m(x).sum().backward()
    for p, q in zip(m.parameters(), ref.parameters()):
        assert torch.equal(p.grad, q.grad)
