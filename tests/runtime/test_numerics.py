"""Offloading is a copy: outputs and every gradient bit-identical to the run without it."""

from __future__ import annotations

import warnings

import pytest
import torch

import annotate_offload as ao

from ._models import assert_bit_identical, clone, grads, make_stack, run_offloaded, run_plain

L = 4


def _reference(blocks, x):
    ref = clone(blocks)
    xr = x.detach().clone().requires_grad_(True)
    out = run_plain(ref, xr)
    out.square().mean().backward()
    return out.detach(), grads(ref) + [xr.grad]


@pytest.mark.parametrize("n", [0, 1, L - 1])
@pytest.mark.parametrize(
    "knobs", [{}, {"prefetch_layers": 1}, {"prefetch_layers": 2}]
)
def test_default_mode_bit_identical(n, knobs):
    blocks = make_stack(L)
    x = torch.randn(2, 16, 64, requires_grad=True)
    ref_out, ref_grads = _reference(blocks, x)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        ctx, sync = ao.get_cpu_offload_context(
            True, n, L, device="cpu", min_offload_numel=0, **knobs
        )
    for _ in range(2):  # two steps: the second reuses pooled host buffers
        for p in blocks.parameters():
            p.grad = None
        x.grad = None
        out = run_offloaded(blocks, x, ctx, sync)
        out.square().mean().backward()
        assert torch.equal(out.detach(), ref_out)
        assert_bit_identical(grads(blocks) + [x.grad], ref_grads)
    stats = ctx.offload_synchronizer.stats
    if n:
        assert stats.bytes_offloaded > 0 and stats.bytes_reloaded == stats.bytes_offloaded
        assert set(stats.bytes_offloaded_per_layer) == set(range(n))
    else:
        assert stats.bytes_offloaded == 0
    assert stats.resident_bytes == 0


@pytest.mark.parametrize("k", [None, 1])
@pytest.mark.parametrize("frozen", [1, 2])
def test_frozen_first_layers_end_without_a_backward_and_the_rest_stays_exact(frozen, k):
    blocks = make_stack(L)
    blocks[:frozen].requires_grad_(False)  # their outputs have no grad_fn: no backward reaches them
    x = torch.randn(2, 16, 64)
    ref = clone(blocks)
    ref_out = run_plain(ref, x)
    ref_out.square().mean().backward()
    ctx, sync = ao.get_cpu_offload_context(True, L - 1, L, device="cpu", min_offload_numel=0, prefetch_layers=k)
    for _ in range(2):
        blocks.zero_grad(set_to_none=True)
        out = run_offloaded(blocks, x, ctx, sync)
        out.square().mean().backward()
        assert torch.equal(out.detach(), ref_out.detach())
        assert_bit_identical([p.grad for p in blocks.parameters() if p.requires_grad],
                             [p.grad for p in ref.parameters() if p.requires_grad])
    stats = ctx.offload_synchronizer.stats
    assert set(stats.bytes_offloaded_per_layer) == set(range(frozen, L - 1))  # frozen layers save nothing
    assert stats.bytes_reloaded == stats.bytes_offloaded > 0 and stats.resident_bytes == 0


@pytest.mark.parametrize("n", [0, 1, L - 1])
def test_manual_mode_bit_identical(n):
    blocks = make_stack(L)
    x = torch.randn(2, 16, 64, requires_grad=True)
    ref_out, ref_grads = _reference(blocks, x)
    ctx, sync_fn, sync = ao.get_cpu_offload_context(
        True, n, L, manual_synchronization=True, device="cpu", min_offload_numel=0
    )
    h = x
    for i, blk in enumerate(blocks):
        with ctx:
            h = blk(h)
        h = sync_fn(h)
        if i < n:
            sync.start_offload_layer(i)
            sync.release_activation_forward_gpu_memory(i)
    for i in range(n):
        sync.start_reload_layer(i)
    h.square().mean().backward()
    assert torch.equal(h.detach(), ref_out)
    assert_bit_identical(grads(blocks) + [x.grad], ref_grads)
    assert sync.stats.bytes_reloaded == sync.stats.bytes_offloaded
    assert (sync.stats.bytes_offloaded > 0) == (n > 0)


def test_every_saved_tensor_really_comes_back_from_host_memory():
    """On the CPU backend unpack returns a separate tensor rebuilt from the host copy."""
    x = torch.randn(512, 512, requires_grad=True)
    ctx, sync = ao.get_cpu_offload_context(True, 1, 2, device="cpu", prefetch_layers=1)
    with ctx:
        y = torch.tanh(x)  # saves its output
    y = sync(y)
    with ctx:
        z = y * 3
    z = sync(z)
    unpacked = y.grad_fn._saved_result
    assert unpacked.data_ptr() != y.data_ptr() and torch.equal(unpacked, y)
    z.sum().backward()
    stats = ctx.offload_synchronizer.stats
    assert stats.bytes_offloaded == y.nbytes and stats.bytes_reloaded >= y.nbytes
    xr = x.detach().clone().requires_grad_(True)
    (torch.tanh(xr) * 3).sum().backward()
    torch.testing.assert_close(x.grad, xr.grad, rtol=0, atol=0)


def test_autocast_bf16_bit_identical():
    blocks = make_stack(3)
    x = torch.randn(2, 16, 64, requires_grad=True)
    ref = clone(blocks)
    xr = x.detach().clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out_ref = run_plain(ref, xr)
    out_ref.float().sum().backward()
    ctx, sync = ao.get_cpu_offload_context(
        True, 2, 3, device="cpu", min_offload_numel=0, prefetch_layers=1
    )
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = run_offloaded(blocks, x, ctx, sync)
    out.float().sum().backward()
    assert torch.equal(out, out_ref)
    assert_bit_identical(grads(blocks) + [x.grad], grads(ref) + [xr.grad])
    stats = ctx.offload_synchronizer.stats
    assert stats.bytes_offloaded > 0 and stats.kept.get("parameter", 0) > 0
