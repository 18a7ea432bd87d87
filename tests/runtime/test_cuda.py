"""GPU tests of the runtime: races, memory, pinning. Run on a GPU machine: pytest -m cuda.

Exactness with attention needs a bit-reproducible SDPA backward (DESIGN.md: flash and cuDNN
attention are not; the memory-efficient backend is with deterministic algorithms on), so these
tests use ``annotate_offload.testing.bit_reproducible()``.
"""

from __future__ import annotations

import gc
import os
import sys
import weakref

import pytest
import torch
import torch.nn as nn

import annotate_offload as ao
from annotate_offload.runtime import DefaultOffloadSynchronizer
from annotate_offload.runtime._pinned_pool import PinnedBufferPool
from annotate_offload.runtime._device import get_backend

from ._models import (CHECKPOINTED_TANH_THEN_SUM, assert_bit_identical, clone, grads, make_stack,
                      run_offloaded, run_plain)

pytestmark = pytest.mark.cuda

MiB = 1 << 20
_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _sdpa_exact():
    from annotate_offload.testing import bit_reproducible

    return bit_reproducible()


def _alloc():
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated()


# -- A01 ---------------------------------------------------------------------------------------
class _SavesFresh(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        fresh = torch.cos(x)
        ctx.save_for_backward(fresh)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        (fresh,) = ctx.saved_tensors
        return g * fresh


class _Sleeps(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        torch.cuda._sleep(1_500_000_000)  # ~1 s of GPU work before the view is consumed
        return g * 2.0


class _PassThroughSaves(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(torch.sin(x))
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        (s,) = ctx.saved_tensors
        return g + s * 0


class _ReturnsView(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 1.0

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        return x.t().t()  # a view of the reloaded saved tensor


def test_a01_freed_buffer_race():
    fns = [_SavesFresh, _Sleeps, _PassThroughSaves, _ReturnsView]

    def run(sync):
        x = torch.randn(256, 1024, device="cuda", requires_grad=True)
        h = x * 1.0
        for i, fn in enumerate(fns):
            if sync:
                sync.enter_layer(i)
            h = fn.apply(h)
            if sync:
                h = sync.commit_layer(h, i)
        if sync:
            sync.enter_layer(4)
        loss = h.sum()
        if sync:
            loss = sync.commit_layer(loss, 4)
        loss.backward()
        return x.grad

    torch.manual_seed(0)
    ref = run(None)
    torch.manual_seed(0)
    s = DefaultOffloadSynchronizer(5, 4, device="cuda", min_offload_numel=0)
    got = run(s)
    assert s.stats.bytes_reloaded == s.stats.bytes_offloaded > 0
    assert torch.isfinite(got).all()
    torch.testing.assert_close(got, ref, rtol=0, atol=0)


# -- A02 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("boundary", [True, False], ids=["prefetch", "on_demand"])
def test_a02_reload_waits_for_a_slow_d2h(boundary):
    def run(sync):
        w = torch.randn(4096, device="cuda", requires_grad=True)
        big = torch.randn(64, 4096, 4096, device="cuda")  # 4 GiB fp32: a slow D2H
        if sync:
            with torch.cuda.stream(sync.backend.d2h_stream):
                torch.cuda._sleep(200_000_000)
            sync.enter_layer(0)
        y = torch.sigmoid(big * w)
        if sync:
            y = sync.commit_layer(y, 0) if boundary else (sync.exit_layer() or y)
            sync.enter_layer(1)
        loss = y.sum()
        if sync:
            loss = sync.commit_layer(loss, 1)
        loss.backward()
        return w.grad

    torch.manual_seed(1)
    ref = run(None)
    torch.manual_seed(1)
    s = DefaultOffloadSynchronizer(2, 1, device="cuda")
    got = run(s)
    assert s.stats.bytes_offloaded > 0
    if not boundary:
        assert s.stats.on_demand_reloads == 1
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    del got, ref
    torch.cuda.empty_cache()


# -- A05 ---------------------------------------------------------------------------------------
class _SavesCpu(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, c):
        ctx.save_for_backward(c)
        return x * 2

    @staticmethod
    def backward(ctx, g):
        (c,) = ctx.saved_tensors
        assert c.device.type == "cpu"
        _SavesCpu.seen = c.clone()
        return g * 2, None


def test_a05_cpu_tensor_stays_on_cpu():
    c = torch.randn(2048)  # 8 KiB
    s = DefaultOffloadSynchronizer(2, 1, device="cuda", min_offload_numel=0)
    x = torch.randn(512, 512, device="cuda", requires_grad=True)
    s.enter_layer(0)
    y = _SavesCpu.apply(x * 1.0, c)
    y = s.commit_layer(y, 0)
    s.enter_layer(1)
    loss = s.commit_layer(y.sum(), 1)
    loss.backward()
    assert torch.equal(_SavesCpu.seen, c)
    assert s.stats.kept.get("not_on_device") == 1


# -- A06 + accounting identity -----------------------------------------------------------------
def test_a06_memory_really_drops_and_originals_die():
    torch.manual_seed(0)
    layers = nn.ModuleList(
        [nn.Sequential(nn.Linear(4096, 4096), nn.ReLU()) for _ in range(40)]
    ).cuda()
    x = torch.randn(64, 4096, device="cuda")

    def forward(sync=None, watch=None):
        h = x
        for i, layer in enumerate(layers):
            if sync:
                sync.enter_layer(i)
            h = layer(h)
            if i == 5 and watch is not None:
                watch.append(weakref.ref(h))
            if sync:
                h = sync.commit_layer(h, i)
        return h

    forward().sum().backward()  # warm-up: cuBLAS workspaces and .grad buffers exist from now on
    start = _alloc()
    out = forward()
    without = _alloc() - start
    del out
    gc.collect()
    s = DefaultOffloadSynchronizer(40, 39, device="cuda", release_lag=0, prefetch_layers=1)
    watch: list = []
    start = _alloc()
    out = forward(s, watch)
    gc.collect()
    with_offload = _alloc() - start
    offloaded = s.stats.bytes_offloaded
    assert offloaded > 0
    assert without - with_offload >= 0.9 * offloaded
    # accounting identity: device now + offloaded bytes ~= device without offload (10%)
    assert abs(with_offload + offloaded - without) <= 0.1 * without
    assert watch[0]() is None, "an offloaded GPU original is still alive"
    out.sum().backward()
    del out
    gc.collect()
    assert _alloc() == start  # memory back to its starting value after backward


def test_memory_back_to_start_after_backward_and_accounting_on_a_transformer():
    blocks = make_stack(4, hidden=1024, heads=8, device="cuda", dtype=torch.bfloat16)
    for p in blocks.parameters():
        p.grad = torch.zeros_like(p)
    x = torch.randn(4, 1024, 1024, device="cuda", dtype=torch.bfloat16)
    with _sdpa_exact():
        run_plain(blocks, x).float().sum().backward()  # warm-up (workspaces)
        gc.collect()
        start = _alloc()
        out = run_plain(blocks, x)
        without = _alloc() - start
        out.float().sum().backward()
        del out
        gc.collect()
        ctx, sync = ao.get_cpu_offload_context(True, 3, 4, prefetch_layers=1)
        run_offloaded(blocks, x, ctx, sync).float().sum().backward()  # warm-up (pinned pool)
        gc.collect()
        for _ in range(2):
            start = _alloc()
            out = run_offloaded(blocks, x, ctx, sync)
            after_fwd = _alloc() - start
            off = ctx.offload_synchronizer.stats.bytes_offloaded
            out.float().sum().backward()
            del out
            gc.collect()
            assert _alloc() == start
    assert abs(after_fwd + off - without) <= 0.1 * without, (after_fwd, off, without)


# -- numerics under perturbed timing -----------------------------------------------------------
@pytest.mark.parametrize("perturb", ["none", "d2h", "h2d", "compute"])
def test_bit_identical_over_50_iterations_with_perturbed_timing(perturb):
    blocks = make_stack(4, hidden=512, heads=8, device="cuda", dtype=torch.bfloat16)
    ref = clone(blocks)
    ctx, sync = ao.get_cpu_offload_context(True, 3, 4, prefetch_layers=1)
    backend = get_backend("cuda")  # the process-wide backend whose streams the runtime binds to
    stream = {"d2h": backend.d2h_stream, "h2d": backend.h2d_stream}.get(perturb)
    g = torch.Generator(device="cpu").manual_seed(0)
    with _sdpa_exact():
        for it in range(50):
            x = torch.randn(2, 256, 512, generator=g).cuda().to(torch.bfloat16)
            for p in list(blocks.parameters()) + list(ref.parameters()):
                p.grad = None
            cycles = int(torch.randint(0, 2_000_000, (1,), generator=g))
            if stream is not None:
                with torch.cuda.stream(stream):
                    torch.cuda._sleep(cycles)
            elif perturb == "compute":
                torch.cuda._sleep(cycles)
            out = run_offloaded(blocks, x, ctx, sync)
            out.float().square().mean().backward()
            ref_out = run_plain(ref, x)
            ref_out.float().square().mean().backward()
            assert torch.equal(out, ref_out), it
            assert_bit_identical(grads(blocks), grads(ref))
    assert ctx.offload_synchronizer.stats.bytes_reloaded > 0


def test_a09_in_place_after_offload_raises_100_times():
    for _ in range(100):
        x = torch.randn(4096, 4096, device="cuda")  # 64 MiB
        w = torch.randn(4096, 4096, device="cuda", requires_grad=True)
        s = DefaultOffloadSynchronizer(2, 1, device="cuda")
        s.enter_layer(0)
        y = s.commit_layer(x * w, 0)
        x.add_(1)
        s.enter_layer(1)
        loss = s.commit_layer(y.sum(), 1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            loss.backward()


def test_in_place_change_of_a_saved_output_raises_100_of_100_with_a_slow_d2h():
    """Note [Version check]: ``sigmoid`` saves its output, which the layer then scales in place.
    The D2H of that output is held back on the copy stream, so it reads the bytes after the
    in-place write; the saved tensor itself is gone by backward. Autograd raises without offload;
    with offload the runtime must raise every time, never return a gradient."""
    torch.manual_seed(0)
    lin = nn.Linear(4096, 4096, device="cuda")
    x = torch.randn(2048, 4096, device="cuda")
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y = torch.sigmoid(lin(x))
        y.mul_(2)
        y.sum().backward()
    ctx, sync = ao.get_cpu_offload_context(True, 1, 2, prefetch_layers=1)
    d2h = get_backend("cuda").d2h_stream  # the runtime binds to it at the first save
    raised = 0
    for _ in range(100):
        with torch.cuda.stream(d2h):
            torch.cuda._sleep(20_000_000)  # the copy starts after the in-place write below
        with ctx:
            y = torch.sigmoid(lin(x))
            y.mul_(2)
        y = sync(y)
        with ctx:
            out = (y * 3).sum()
        out = sync(out)
        del y
        try:
            out.backward()
        except RuntimeError as exc:
            raised += "modified by an inplace operation" in str(exc)
        lin.zero_grad(set_to_none=True)
    torch.cuda.synchronize()
    assert raised == 100


# -- A11 ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("gib", [1.13, 2.25])
def test_a11_pinned_host_memory_is_exact_and_reused(gib):
    numel = int(gib * (1 << 30)) // 2
    s = DefaultOffloadSynchronizer(2, 1, device="cuda")
    s.pool.trim()
    base = s.pool.cached_bytes
    w = torch.randn(1, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    for _ in range(3):
        x = torch.randn(numel, device="cuda", dtype=torch.bfloat16)
        s.enter_layer(0)
        y = s.commit_layer(torch.sigmoid(x * w), 0)
        s.enter_layer(1)
        loss = s.commit_layer(y.float().sum(), 1)
        loss.backward()
        del x, y, loss
    ratio = (s.pool.cached_bytes - base) / s.stats.bytes_offloaded
    assert ratio < 1.1, ratio
    s.pool.trim()
    torch.cuda.empty_cache()


def test_a11_pinning_failure_falls_back_to_pageable(monkeypatch):
    def fail(self, nbytes):
        raise RuntimeError("cudaHostAlloc: out of memory")

    monkeypatch.setattr(PinnedBufferPool, "_pin", fail)
    from annotate_offload.runtime import _pinned_pool

    monkeypatch.setattr(_pinned_pool, "_POOLS", {})
    blocks = make_stack(3, hidden=256, heads=4, device="cuda")
    ref = clone(blocks)
    x = torch.randn(2, 128, 256, device="cuda")
    ctx, sync = ao.get_cpu_offload_context(True, 2, 3, prefetch_layers=1, min_offload_numel=0)
    with pytest.warns(RuntimeWarning, match="falling back to pageable"):
        with _sdpa_exact():
            run_offloaded(blocks, x, ctx, sync).sum().backward()
    with _sdpa_exact():
        run_plain(ref, x).sum().backward()
    assert_bit_identical(grads(blocks), grads(ref))


# -- a forward and backward on the user's own stream ------------------------------------------
def _forward_on_a_user_stream() -> None:
    """Body of the test below (run in a child process)."""
    torch.manual_seed(0)
    blocks = make_stack(layers=3, hidden=512, heads=8, device="cuda")
    ref_blocks = clone(blocks)
    x = torch.randn(4, 256, 512, device="cuda")
    user = torch.cuda.Stream()
    ctx, sync_fn = ao.get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=3, prefetch_layers=1, min_offload_numel=0
    )
    with _sdpa_exact():
        user.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(user):
            torch.cuda._sleep(50_000_000)  # the D2H must not overtake the producer on this stream
            out = run_offloaded(blocks, x, ctx, sync_fn)
            assert torch.cuda.current_stream() == user
            out.float().square().mean().backward()
        torch.cuda.synchronize()
        run_plain(ref_blocks, x).float().square().mean().backward()
    assert ctx.offload_synchronizer.stats.bytes_offloaded > 0
    assert_bit_identical(grads(blocks), grads(ref_blocks))


def test_forward_on_a_user_stream_keeps_that_stream_current_and_is_exact(run_group):
    """A model run on the user's own stream: each D2H waits for that stream (not the default one,
    which a 50M-cycle sleep on the user stream would otherwise let it overtake), the user's stream
    is current after every layer, and gradients are bit-identical.

    It runs in a child process. On the H200 (torch 2.11.0+cu130), a plain forward and backward on
    a side stream, with no offload at all, left the process in a state where a later
    ``torch.autograd.graph.save_on_cpu`` backward hit an illegal memory access: a torch-level
    fault outside this package that must not take the rest of the suite down with it.
    """
    code = "from tests.runtime.test_cuda import _forward_on_a_user_stream as f; f()"
    # the child imports torch, starts CUDA and runs three small layers: seconds; a hang there must not
    # hold the suite (its process group is killed at the timeout)
    out = run_group([sys.executable, "-c", code], cwd=_ROOT, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stdout[-2000:] + out.stderr[-4000:]


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA GPUs")
def test_offload_on_a_device_that_is_not_current_keeps_the_current_device():
    torch.manual_seed(0)
    blocks = make_stack(layers=3, hidden=256, heads=4, device="cuda:1")
    ref_blocks = clone(blocks)
    x = torch.randn(2, 128, 256, device="cuda:1")
    ctx, sync_fn = ao.get_cpu_offload_context(
        enabled=True, num_layers=2, model_layers=3, prefetch_layers=1,
        min_offload_numel=0, device="cuda:1",
    )
    torch.cuda.set_device(0)
    with _sdpa_exact():
        out = run_offloaded(blocks, x, ctx, sync_fn)
        assert torch.cuda.current_device() == 0
        out.square().mean().backward()
        run_plain(ref_blocks, x).square().mean().backward()
    assert ctx.offload_synchronizer.stats.bytes_offloaded > 0
    assert_bit_identical(grads(blocks), grads(ref_blocks))


def test_a_checkpointed_layer_offloads_its_inputs_on_cuda_without_a_device():
    """Note [Device binding]: the empty CPU tensor that non-reentrant checkpoint saves first must not
    bind the step to the CPU backend; the layer's CUDA input is offloaded."""
    x = torch.randn(1024, 1024, device="cuda", requires_grad=True)
    ctx, sync_fn = ao.get_cpu_offload_context(True, 1, 2)
    run_offloaded(CHECKPOINTED_TANH_THEN_SUM, x, ctx, sync_fn).backward()
    assert ctx.offload_synchronizer.backend.device_type == "cuda"
    assert ctx.offload_synchronizer.stats.bytes_offloaded == x.nbytes
    xr = x.detach().clone().requires_grad_()
    torch.tanh(xr).sum().backward()
    assert torch.equal(x.grad, xr.grad)
