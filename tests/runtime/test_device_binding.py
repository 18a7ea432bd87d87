"""Note [Device binding] (runtime/_synchronizer.py): without ``device=``, the backend is bound per
step from the first tensor an offloaded layer saves, never at construction."""

from __future__ import annotations

import torch

import annotate_offload as ao

from ._models import CHECKPOINTED_TANH_THEN_SUM, run_offloaded


def test_without_a_device_the_backend_follows_the_saved_tensors(monkeypatch):
    """On a machine with CUDA, a CPU model needs no device='cpu': nothing is bound (or initialised)
    at construction, and the step binds the CPU backend from its tensors."""
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)  # what a GPU machine reports
    ctx, sync_fn = ao.get_cpu_offload_context(True, 1, 2, min_offload_numel=0)
    sync = ctx.offload_synchronizer
    w = torch.nn.Parameter(torch.randn(64, 64))
    x = torch.randn(32, 64)
    for _ in range(2):
        with ctx:
            h = torch.tanh(x @ w)
        h = sync_fn(h)
        with ctx:
            y = h.sum()
        y = sync_fn(y)
        y.backward()
    assert sync.backend.device_type == "cpu" and sync.stats.bytes_offloaded == 2 * x.nbytes
    assert torch.equal(w.grad, 2 * torch.autograd.grad(torch.tanh(x @ w).sum(), w)[0])


def test_a_cpu_tensor_saved_first_does_not_bind_the_step(monkeypatch):
    """Non-reentrant checkpoint saves an empty CPU tensor before the layer's inputs; binding the step
    to it would keep every CUDA tensor of the step on the device. Only a CUDA tensor binds a step."""
    from annotate_offload.runtime._synchronizer import OffloadSynchronizer

    bound = []
    real = OffloadSynchronizer._bind_to
    monkeypatch.setattr(OffloadSynchronizer, "_bind_to", lambda self, t: (bound.append(t.device), real(self, t)))
    ctx, sync_fn = ao.get_cpu_offload_context(True, 1, 2, min_offload_numel=0)
    x = torch.randn(32, 64, requires_grad=True)
    run_offloaded(CHECKPOINTED_TANH_THEN_SUM, x, ctx, sync_fn).backward()
    assert bound == [] and ctx.offload_synchronizer.stats.bytes_offloaded == x.nbytes
