"""Autograd's guarantees kept by the runtime, and TransformerEngine's documented uses honoured."""

from __future__ import annotations

import pytest
import torch

import annotate_offload as ao
from annotate_offload.runtime import TensorGroup, TensorGroupProcessor


def _ctx(n=1, layers=2, **kw):
    kw.setdefault("min_offload_numel", 0)
    return ao.get_cpu_offload_context(True, n, layers, device="cpu", **kw)


# -- views at a non-zero storage offset --------------------------------------------------------
def _split_layer(x, w):
    return sum((chunk @ w).sum() for chunk in torch.split(x, 1024))  # each chunk saved: a view at an offset


@pytest.mark.parametrize("offload_layer", [False, True])
def test_split_chunks_unpacked_from_the_device_or_host_equal_the_reference(offload_layer):
    x = torch.randn(4096, 64)
    w = torch.randn(64, 8, requires_grad=True)
    wr = w.detach().clone().requires_grad_(True)
    _split_layer(x, wr).backward()
    ctx, sync_fn, sync = _ctx(layers=1, manual_synchronization=True)
    with ctx:
        out = _split_layer(x, w)
    out = sync_fn(out)
    if offload_layer:
        sync.start_offload_layer(0)
        sync.release_activation_forward_gpu_memory(0)
        sync.start_reload_layer(0)
    out.backward()
    assert sync.stats.tensors_offloaded == 4
    assert (sync.stats.bytes_reloaded > 0) == offload_layer
    torch.testing.assert_close(w.grad, wr.grad, rtol=0, atol=0)


def test_tensor_group_rebuilds_views_at_an_offset_from_the_original_bytes():
    x = torch.randn(1000, 100)
    views = [x[10:12], x[500:], x[999:, 3:]]
    units, aux = TensorGroupProcessor.tensor_group_process_before_offload(TensorGroup(views, [None] * 3))
    back = TensorGroupProcessor.tensor_group_process_after_reload(TensorGroup(units.tensor_list, units.events, aux))
    for v, b in zip(views, back.tensor_list):
        assert torch.equal(v, b) and b.storage_offset() == v.storage_offset()
