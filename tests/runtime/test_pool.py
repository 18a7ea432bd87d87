"""Host buffer pool: exact sizes, reuse across steps, pageable fallback."""

from __future__ import annotations

import warnings

import torch

from annotate_offload.runtime import DefaultOffloadSynchronizer
from annotate_offload.runtime._pinned_pool import PinnedBufferPool


def test_exact_sizes_and_reuse():
    pool = PinnedBufferPool(pin=False)
    a, event = pool.acquire(1000)
    assert a.numel() == 1000 and pool.cached_bytes == 1000 and event is None
    pool.release(a, "last copy")
    b, event = pool.acquire(1000)
    assert b is a and pool.cached_bytes == 1000 and event == "last copy"
    c, _ = pool.acquire(1001)
    assert pool.cached_bytes == 2001 and pool.in_use_bytes == 2001
    pool.release(b)
    pool.release(c)
    assert pool.trim() == 2001 and pool.cached_bytes == 0


def test_pinning_failure_falls_back_with_a_warning():
    pool = PinnedBufferPool(pin=True)

    def fail(nbytes):
        raise RuntimeError("cudaHostAlloc failed: out of memory")

    pool._pin = fail
    with warnings.catch_warnings(record=True) as rec:
        warnings.simplefilter("always")
        buf, _ = pool.acquire(4096)
        pool.acquire(4096)
    assert not buf.is_pinned() and buf.numel() == 4096
    assert sum("falling back to pageable" in str(w.message) for w in rec) == 1


def test_host_memory_held_is_close_to_bytes_offloaded_after_a_few_steps():
    """A11's CPU twin: awkward sizes, pool bytes / bytes offloaded < 1.1 in steady state."""
    s = DefaultOffloadSynchronizer(2, 1, device="cpu", min_offload_numel=0)
    s.pool.trim()
    base = s.pool.cached_bytes
    w = torch.randn(1, 1237, requires_grad=True)
    for _ in range(4):
        x = torch.randn(1013, 1237)
        s.enter_layer(0)
        y = torch.sigmoid(x * w)
        s.commit_layer(y, 0)
        s.enter_layer(1)
        z = s.commit_layer(y.sum() * 1.0, 1)
        z.backward()
    held = s.pool.cached_bytes - base
    assert held / s.stats.bytes_offloaded < 1.1
