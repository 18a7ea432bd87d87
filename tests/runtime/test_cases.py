"""Cases from ../shared/cases that broke other offload libraries (CPU-backend twins).

On the CPU backend memory is the runtime's own accounting (``OffloadStats.resident_bytes``, the
host pool); the GPU twins with real allocator numbers live in ``test_cuda.py``.
"""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
import torch.nn as nn

import annotate_offload as ao
from annotate_offload import OffloadError
from annotate_offload.runtime import DefaultOffloadSynchronizer

from ._models import assert_bit_identical, clone, grads, make_stack, run_offloaded, run_plain


def _ctx(n, layers, **kw):
    kw.setdefault("min_offload_numel", 0)
    return ao.get_cpu_offload_context(True, n, layers, device="cpu", **kw)


def test_a03_unused_branch_does_not_leak_across_steps():
    expert = nn.Linear(64, 64)
    trunk = nn.Linear(64, 64)
    ctx, sync = _ctx(1, 2, prefetch_layers=1)
    s = ctx.offload_synchronizer
    pool_in_use = []
    for step in range(20):
        x = torch.randn(32, 64, requires_grad=True)
        with ctx:
            h = torch.relu(trunk(x))
            unused = torch.tanh(expert(h))  # saved tensors of a branch that never reaches loss
        h = sync(h + unused.detach() * 0)
        with ctx:
            out = torch.sigmoid(trunk(h))
        out = sync(out)
        out.sum().backward()
        assert s.stats.resident_bytes == 0
        del x, h, unused, out
        gc.collect()
        assert not list(s._step.layers.values())  # the runtime holds nothing between steps
        pool_in_use.append(s.pool.in_use_bytes)
    assert len(set(pool_in_use[2:])) == 1  # constant at the start of every step


def test_a04a_backward_after_leaving_the_context():
    blocks = make_stack(3)
    ref = clone(blocks)
    x = torch.randn(2, 8, 64, requires_grad=True)
    ctx, sync = _ctx(2, 3, prefetch_layers=1)
    out = run_offloaded(blocks, x, ctx, sync)
    assert not ctx.inside_context
    out.sum().backward()
    xr = x.detach().clone().requires_grad_(True)
    run_plain(ref, xr).sum().backward()
    assert_bit_identical(grads(blocks) + [x.grad], grads(ref) + [xr.grad])


class _Flaky(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls == 3:
            raise RuntimeError("boom")
        return torch.relu(self.lin(x))


def test_a04b_exception_mid_forward_leaves_no_state():
    layers = nn.ModuleList([_Flaky() for _ in range(3)])
    ctx, sync = _ctx(2, 3, prefetch_layers=1)
    s = ctx.offload_synchronizer
    x = torch.randn(16, 64, requires_grad=True)
    h = x
    with pytest.raises(RuntimeError, match="boom"):
        for layer in layers:
            layer.calls = 2  # third call raises
            with ctx:
                h = layer(h)
            h = sync(h)
    assert not ctx.inside_context and not ao.is_cpu_offload_enabled()
    assert s._step is None and s.stats.resident_bytes == 0
    for layer in layers:
        layer.calls = 10
    ref = clone(layers)
    out = run_offloaded(layers, x, ctx, sync)
    out.sum().backward()
    xr = x.detach().clone().requires_grad_(True)
    run_plain(ref, xr).sum().backward()
    assert_bit_identical(grads(layers) + [x.grad], grads(ref) + [xr.grad])
    assert s.stats.resident_bytes == 0


@pytest.mark.filterwarnings("ignore:.*backward began after the offload context")  # one block of model_layers=2
def test_a07_one_storage_many_saves_moves_bytes_once():
    x0 = torch.randn(8, 512, 512)
    w = torch.randn(512, 512, requires_grad=True)
    ctx, sync = _ctx(1, 2)

    def f(x, w):
        a = x * w  # saves x
        b = torch.bmm(x.transpose(-1, -2), w.expand(8, 512, 512))  # saves x.t()
        c = x[:, :256] * w[:256]  # saves x[:, :256]
        return a.sum() + b.sum() + c.sum()

    x = x0.clone()
    with ctx:
        out = f(x, w)
    out = sync(out)
    out.backward()
    stats = ctx.offload_synchronizer.stats
    assert stats.bytes_offloaded == x.nbytes
    assert stats.tensors_deduplicated >= 2
    wr = w.detach().clone().requires_grad_(True)
    f(x0.clone(), wr).backward()
    torch.testing.assert_close(w.grad, wr.grad, rtol=0, atol=0)


def test_a08_parameters_and_their_casts_stay():
    layers = nn.Sequential(*[nn.Linear(256, 256) for _ in range(4)])
    for p in layers.parameters():
        p.custom_tag = "keep-me"
    params = {p.untyped_storage()._cdata for p in layers.parameters()}
    s = DefaultOffloadSynchronizer(2, 1, device="cpu", min_offload_numel=0)
    packed = []
    orig_push = s.push_tensor

    def spy(t):
        h = orig_push(t)
        if h is not t:
            packed.append(t)
        return h

    s.push_tensor = spy
    x = torch.randn(64, 256, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        s.enter_layer(0)
        y = layers(x)
        s.commit_layer(y, 0)
        s.enter_layer(1)
        z = y.float().sum()
        s.commit_layer(z, 1)
    z.backward()
    assert packed, "activations should have been offloaded"
    for t in packed:
        assert t.untyped_storage()._cdata not in params
        assert not isinstance(t, nn.Parameter)
        assert t.shape != (256, 256)  # no weight cast and no w.t() view
    assert s.stats.kept.get("parameter", 0) >= 4
    assert all(getattr(p, "custom_tag", None) == "keep-me" for p in layers.parameters())


@pytest.mark.filterwarnings("ignore:.*backward began after the offload context")  # one block of model_layers=2
def test_a09_in_place_after_save_raises_like_autograd():
    for _ in range(3):
        x = torch.randn(2048, 2048)  # 16 MiB (the GPU twin uses 64 MiB, 100 times)
        w = torch.randn(2048, 2048, requires_grad=True)
        ctx, sync = _ctx(1, 2)
        with ctx:
            y = x * w
        y = sync(y)
        x.add_(1)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()
    # and without offload autograd raises the same kind of error
    x = torch.randn(8, 8)
    w = torch.randn(8, 8, requires_grad=True)
    y = x * w
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


@pytest.mark.filterwarnings("ignore:.*backward began after the offload context")  # one block of model_layers=2
def test_a09_in_place_on_a_kept_tensor_still_raises():
    ctx, sync = _ctx(0, 2)
    x = torch.randn(8, 8)
    w = torch.randn(8, 8, requires_grad=True)
    with ctx:
        y = x * w
    y = sync(y)
    x.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()


def test_a10_layouts_values_strides_offsets():
    a = torch.randn(1024, 2048)
    v = torch.randn(1, 4096)
    cl = torch.randn(2, 8, 32, 32).to(memory_format=torch.channels_last)
    zero = torch.randn(0, 16)
    inputs = {"t": a.t(), "off": a[:, 1:], "exp": v.expand(64, 4096), "cl": cl, "zero": zero}
    weights = {k: torch.randn_like(t, requires_grad=True) for k, t in inputs.items()}
    unpacked = {}

    s = DefaultOffloadSynchronizer(2, 1, device="cpu", min_offload_numel=0)
    s.enter_layer(0)
    outs = {k: inputs[k] * weights[k] for k in inputs}
    total = sum(o.sum() for o in outs.values())
    s.commit_layer(total, 0)
    for k, o in outs.items():
        unpacked[k] = o.grad_fn._saved_self
    exp_unpacked = unpacked["exp"]
    assert exp_unpacked.stride() == (0, 1)  # never materialised
    for k, t in inputs.items():
        u = unpacked[k]
        assert torch.equal(u, t), k
        assert u.stride() == t.stride(), k
        if k in ("t", "off", "cl"):
            assert u.storage_offset() == t.storage_offset(), k
    s.enter_layer(1)
    s.commit_layer(total, 1)
    total.backward()
    stats = s.stats
    assert stats.kept.get("zero_size") == 1
    moved = a.nbytes + v.nbytes + cl.nbytes  # a once for .t() and [:, 1:]; v: 16 KiB, not 1 MiB
    assert stats.bytes_offloaded == moved
    for k in inputs:
        if k == "zero":
            continue
        ref = inputs[k]
        torch.testing.assert_close(weights[k].grad, ref, rtol=0, atol=0)


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_a12_eval_passes_before_training(mode):
    blocks = make_stack(3)
    ref = clone(blocks)
    ctx, sync = _ctx(2, 3, prefetch_layers=1)
    with mode():
        for _ in range(2):
            run_offloaded(blocks, torch.randn(2, 8, 64), ctx, sync)
    s = ctx.offload_synchronizer
    assert s._step is None and s.stats.tensors_offloaded == 0
    opt = torch.optim.SGD(blocks.parameters(), lr=0.1)
    opt_ref = torch.optim.SGD(ref.parameters(), lr=0.1)
    for _ in range(3):
        x = torch.randn(2, 8, 64)
        opt.zero_grad()
        run_offloaded(blocks, x, ctx, sync).square().mean().backward()
        opt.step()
        opt_ref.zero_grad()
        run_plain(ref, x).square().mean().backward()
        opt_ref.step()
        assert_bit_identical(list(blocks.parameters()), list(ref.parameters()))
    assert s.stats.tensors_offloaded > 0


def test_a13a_interleaved_backward_of_branches():
    f = nn.Linear(64, 64)
    g, h = nn.Linear(64, 64), nn.Linear(64, 64)
    mods = nn.ModuleList([f, g, h])
    ref = clone(mods)
    s = DefaultOffloadSynchronizer(4, offloaded_layers=[0, 1, 2], device="cpu",
                                   min_offload_numel=0, prefetch_layers=1)

    def forward(m, x, sync=None):
        outs = []
        for i, fn in enumerate([lambda t: torch.tanh(m[0](t)), lambda t: torch.tanh(m[2](t)),
                                lambda t: torch.tanh(m[1](t))]):
            src = x if i < 2 else outs[1]
            if sync:
                sync.enter_layer(i)
            o = fn(src)
            if sync:
                o = sync.commit_layer(o, i)
            outs.append(o)
        loss = outs[0].sum() + outs[2].sum()
        if sync:
            sync.enter_layer(3)
            loss = sync.commit_layer(loss * 1.0, 3)
        return loss

    x = torch.randn(32, 64, requires_grad=True)
    forward(mods, x, s).backward()
    xr = x.detach().clone().requires_grad_(True)
    forward(ref, xr).backward()
    assert_bit_identical(grads(mods) + [x.grad], grads(ref) + [xr.grad])


def test_a13b_retain_graph_twice_accumulates_same_grads():
    blocks = make_stack(3)
    ref = clone(blocks)
    x = torch.randn(2, 8, 64, requires_grad=True)
    ctx, sync = _ctx(2, 3, prefetch_layers=1)
    out = run_offloaded(blocks, x, ctx, sync).sum()
    out.backward(retain_graph=True)
    first = grads(blocks)
    out.backward()
    xr = x.detach().clone().requires_grad_(True)
    out_r = run_plain(ref, xr).sum()
    out_r.backward(retain_graph=True)
    out_r.backward()
    assert_bit_identical(grads(blocks), grads(ref))
    for a, b in zip(grads(blocks), first):
        torch.testing.assert_close(a, 2 * b, rtol=0, atol=0)


def test_a13c_double_backward_matches_reference():
    torch.manual_seed(0)
    mlp = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh())
    ref = clone(mlp)

    def loss_of(m, x, sync=None):
        layers = [m[:2], m[2:]]
        h = x
        for i, part in enumerate(layers):
            if sync:
                sync.enter_layer(i)
            h = part(h)
            if sync:
                h = sync.commit_layer(h, i)
        (gx,) = torch.autograd.grad(h.sum(), x, create_graph=True)
        return gx.norm()

    s = DefaultOffloadSynchronizer(2, 1, device="cpu", min_offload_numel=0)
    x = torch.randn(16, 32, requires_grad=True)
    loss_of(mlp, x, s).backward()
    xr = x.detach().clone().requires_grad_(True)
    loss_of(ref, xr).backward()
    assert_bit_identical(grads(mlp), grads(ref))
    assert s.stats.bytes_offloaded > 0


def test_offloaded_originals_are_not_kept_alive():
    s = DefaultOffloadSynchronizer(3, 1, device="cpu", min_offload_numel=0, release_lag=0)
    w = torch.randn(256, 256, requires_grad=True)
    s.enter_layer(0)
    a = torch.randn(256, 256)
    y = torch.tanh(a * w)
    s.commit_layer(y, 0)
    ref_a = weakref.ref(a)
    del a
    s.enter_layer(1)  # release point of layer 0 with release_lag=0
    z = y * 2
    s.commit_layer(z, 1)
    gc.collect()
    assert ref_a() is None
    s.enter_layer(2)
    out = s.commit_layer(z.sum(), 2)
    out.backward()
    assert s.stats.resident_bytes == 0


@pytest.mark.parametrize("offloaded", [True, False], ids=["held_with_device_bytes", "kept"])
def test_a_forward_whose_backward_never_runs_frees_its_graph(offloaded):
    # the forward stops after layer 1: its saved tensors are still held by the layer (offloaded,
    # not released yet) or by their pack handles (a layer not offloaded)
    s = DefaultOffloadSynchronizer(3, 2 if offloaded else 1, device="cpu", min_offload_numel=0)
    w = torch.randn(64, 64, requires_grad=True)
    ref_w = weakref.ref(w)
    s.enter_layer(0)
    y = s.commit_layer(torch.tanh(torch.randn(64, 64) * w), 0)
    s.enter_layer(1)
    z = torch.tanh(y * 2)  # tanh saves its output, whose node holds the handle
    s.exit_layer()
    del y, z, w, s
    gc.collect()
    assert ref_w() is None


def test_a_step_without_layer_backward_hooks_is_freed_by_reference_counting():
    # the synchronizer driven directly (no layer wrapper, so no backward end callback): what the
    # step held must go when the user drops it, not at some later garbage collection
    def layer_states():
        return [o for o in gc.get_objects() if type(o).__name__ == "_LayerState"]

    gc.collect()
    gc.disable()
    try:
        before = {id(o) for o in layer_states()}
        s = DefaultOffloadSynchronizer(2, 1, device="cpu", min_offload_numel=0)
        s.enter_layer(0)
        a = torch.randn(64, 64, requires_grad=True)
        y = torch.tanh(a * 2)
        s.exit_layer()
        s.enter_layer(1)
        s.exit_layer()
        y.sum().backward()
        states = [weakref.ref(o) for o in layer_states() if id(o) not in before]
        del y, a, s
        alive = sum(r() is not None for r in states)
    finally:
        gc.enable()
    assert states and alive == 0


def test_two_forwards_before_one_backward():
    blocks = make_stack(3)
    ref = clone(blocks)
    ctx, sync = _ctx(2, 3, prefetch_layers=1)
    x1, x2 = torch.randn(2, 8, 64), torch.randn(2, 8, 64)
    o1 = run_offloaded(blocks, x1, ctx, sync).sum()
    first_step = ctx.offload_synchronizer.stats
    o2 = run_offloaded(blocks, x2, ctx, sync).sum()
    o2.backward()
    o1.backward()
    (run_plain(ref, x1).sum() + run_plain(ref, x2).sum()).backward()
    for a, b in zip(grads(blocks), grads(ref)):
        torch.testing.assert_close(a, b)
    assert first_step.bytes_reloaded == first_step.bytes_offloaded > 0


def test_a06_cpu_twin_each_storage_crosses_once_across_layers():
    """ReLU saves its output, the next layer's Linear saves the same tensor as its input: one copy."""
    layers = nn.ModuleList([nn.Sequential(nn.Linear(256, 256), nn.ReLU()) for _ in range(10)])
    s = DefaultOffloadSynchronizer(10, 9, device="cpu", min_offload_numel=0, release_lag=0,
                                   prefetch_layers=1)
    x = torch.randn(64, 256)
    h = x
    for i, layer in enumerate(layers):
        s.enter_layer(i)
        h = s.commit_layer(layer(h), i)
    unit = 64 * 256 * 4
    assert s.stats.bytes_offloaded == (1 + 9) * unit  # x, then each offloaded layer's output
    assert s.stats.tensors_deduplicated == 8
    h.sum().backward()
    assert s.stats.bytes_reloaded == s.stats.bytes_offloaded and s.stats.on_demand_reloads == 0
    assert s.stats.resident_bytes == 0
