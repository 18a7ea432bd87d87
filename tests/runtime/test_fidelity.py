"""Autograd's guarantees kept by the runtime, and TransformerEngine's documented uses honoured.

One test per kind of fault: in-place changes after a save, views at a storage offset, an offload
scope inside a checkpoint, several backward passes per step, the synchronizer driven directly,
errors in the middle of a step, and the tensor-group classes the runtime moves tensors with.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

import annotate_offload as ao
from annotate_offload.runtime import (
    DefaultOffloadSynchronizer,
    ManualOffloadSynchronizer,
    TensorGroup,
    TensorGroupProcessor,
)

from ._models import assert_bit_identical, clone, grads


def _no_saved_tensor_hooks() -> bool:
    return torch._C._autograd._top_saved_tensors_default_hooks(False) is None


def _ctx(n=1, layers=2, **kw):
    kw.setdefault("min_offload_numel", 0)
    kw.setdefault("prefetch_layers", None if kw.get("manual_synchronization") else 1)
    return ao.get_cpu_offload_context(True, n, layers, device="cpu", **kw)


# -- in-place change after the save ------------------------------------------------------------
def _sigmoid_then_in_place(lin, x):
    y = torch.sigmoid(lin(x))  # sigmoid saves its output y
    y.mul_(2)  # ... which is then changed in place: autograd's backward must refuse
    return y


@pytest.mark.parametrize("mode", ["offloaded", "device_original"])
def test_in_place_change_after_save_raises_after_the_tensor_is_gone(mode):
    lin = nn.Linear(64, 64)
    x = torch.randn(32, 64)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        _sigmoid_then_in_place(lin, x).sum().backward()  # reference: autograd raises
    if mode == "offloaded":
        ctx, sync = _ctx()
    else:  # manual mode, layers never offloaded: backward reads the device original
        ctx, sync, _ = _ctx(manual_synchronization=True)
    with ctx:
        y = _sigmoid_then_in_place(lin, x)
    y = sync(y)
    with ctx:
        out = (y * 3).sum()  # the only reference to y left after this is autograd's
    out = sync(out)
    del y
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        out.backward()


class _Tanh(nn.Module):
    def __init__(self, edit_input: bool = False):
        super().__init__()
        self.lin, self.edit_input = nn.Linear(8, 8), edit_input

    def forward(self, x):
        if self.edit_input:
            x.mul_(2)  # the previous layer's output, which its tanh saved (and the layer released)
        return torch.tanh(self.lin(x))


@pytest.mark.parametrize("when", ["in_the_next_layer", "between_two_backwards"])
def test_in_place_change_after_the_release_raises_once_the_tensor_died(when):
    torch.manual_seed(0)
    ref = nn.Sequential(_Tanh(), _Tanh(when == "in_the_next_layer"), _Tanh())
    model = clone(ref)
    ao.offload_transform(model, num_layers=2, min_offload_numel=0)
    for m in (ref, model):  # the released layer's tensor object is dead when backward reads it
        x = torch.randn(4, 8, requires_grad=True)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            if when == "in_the_next_layer":
                m(x * 1).sum().backward()
            else:
                h0 = m[0](x)
                y = m[2](m[1](h0))
                y.sum().backward(retain_graph=True)
                h0.add_(1)
                del h0
                y.sum().backward()


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


# -- an offload scope inside a checkpointed function -------------------------------------------
def _pow_chain(a, scope):
    h = a.pow(2)
    with scope():
        h = h.pow(2).pow(2)  # saved inside the offload scope
    return h.pow(2)  # saved after it: checkpoint pairs its saves by position


@pytest.mark.parametrize("api", ["context", "enter_layer"])
def test_offload_scope_inside_a_checkpoint_gives_the_reference_gradient(api):
    a = torch.randn(64, 64, requires_grad=True)
    _pow_chain(a, lambda: torch.enable_grad()).sum().backward()
    expected, a.grad = a.grad, None
    if api == "context":
        ctx, sync = _ctx()
        scope = lambda: ctx  # noqa: E731
    else:
        s = DefaultOffloadSynchronizer(2, 1, device="cpu", min_offload_numel=0)

        class _Scope:
            def __enter__(self):
                s.enter_layer(0)

            def __exit__(self, *exc):
                s.exit_layer()

        scope = _Scope
    checkpoint(lambda t: _pow_chain(t, scope), a, use_reentrant=False).sum().backward()
    torch.testing.assert_close(a.grad, expected, rtol=0, atol=0)
    assert _no_saved_tensor_hooks()


@pytest.mark.filterwarnings("ignore:.*backward began after the offload context")  # layer 0 runs under no_grad
def test_layer_and_sync_fn_inside_a_reentrant_checkpoint_replay_without_offloading():
    layers = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(2)])
    ref = clone(layers)
    ctx, sync = _ctx()
    x = torch.randn(8, 32, requires_grad=True)

    def layer(i, h):
        with ctx:
            h = layers[i](h)
        return sync(h)  # in the recompute too: a no-op there

    layer(1, checkpoint(lambda t: layer(0, t), x, use_reentrant=True)).sum().backward()
    xr = x.detach().clone().requires_grad_(True)
    ref[1](ref[0](xr)).sum().backward()
    assert_bit_identical(grads(layers) + [x.grad], grads(ref) + [xr.grad])
    assert _no_saved_tensor_hooks()


# -- one backward per output in one step (manual mode) -----------------------------------------
def test_manual_mode_backward_per_output_keeps_reloads_of_layers_not_yet_run():
    layers = nn.ModuleList([nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3)])
    ref = clone(layers)
    xs = [torch.randn(16, 64) for _ in range(3)]
    ctx, sync_fn, sync = _ctx(layers=3, manual_synchronization=True)
    outs = []
    for layer, x in zip(layers, xs):
        with ctx:
            out = layer(x)
        outs.append(sync_fn(out))
    for i in range(3):
        sync.start_offload_layer(i)
        sync.release_activation_forward_gpu_memory(i)
    for i in reversed(range(3)):
        sync.start_reload_layer(i)
    for out in outs:  # the first backward must not release the other layers' reloads
        out.sum().backward()
    for layer, x in zip(ref, xs):
        layer(x).sum().backward()
    assert_bit_identical(grads(layers), grads(ref))
    assert sync.stats.bytes_reloaded == sync.stats.bytes_offloaded > 0


# -- the synchronizer driven directly, as TransformerEngine's tests do --------------------------
def test_default_synchronizer_driven_directly_round_trips_like_transformer_engine():
    L = 4
    sync = DefaultOffloadSynchronizer(num_layers=L, num_offloaded_layers=L - 1, device="cpu", min_offload_numel=0)
    for _ in range(3):
        saved, handles = [], []
        for i in range(L):
            assert sync.fwd_step() == i  # no scope exit between layers
            tensors = [torch.randn(8, 16) for _ in range(i + 1)]
            saved.append(tensors)
            handles.append([sync.push_tensor(t) for t in tensors])
        assert _no_saved_tensor_hooks()
        # TE's handles: an int for an offloaded tensor, the tensor itself for a kept one
        assert all(isinstance(h, int) for layer in handles[:-1] for h in layer)
        assert all(h is t for h, t in zip(handles[-1], saved[-1]))
        for i in reversed(range(L)):
            sync.bwd_step(i)  # outside a backward pass
            for h, t in zip(handles[i], saved[i]):
                back = sync.pop_tensor(h)
                assert torch.equal(back, t) and (i == L - 1 or back.data_ptr() != t.data_ptr())
        sync.finish_part_of_bwd()
    assert sync.stats.bytes_reloaded == sync.stats.bytes_offloaded > 0
    assert sync.stats.resident_bytes == 0


# -- errors in the middle of a step ------------------------------------------------------------
class _SkipBatch(Exception):
    pass


def _step(layers, x, ctx, sync, fail_after=None, sync_arg=None):
    h = x
    for i, layer in enumerate(layers):
        with ctx:
            h = layer(h)
        if i == fail_after:
            raise _SkipBatch  # e.g. a NaN check between the layer and sync_fn
        h = sync(h if sync_arg is None else sync_arg(h))
    h.sum().backward()


@pytest.mark.parametrize(
    "failure",
    ["between_context_and_sync", "sync_fn_on_a_tuple", "inside_the_layer"],
)
def test_an_error_mid_step_leaves_no_state_and_no_hook_behind(failure):
    layers = nn.ModuleList([nn.Sequential(nn.Linear(32, 32), nn.Tanh()) for _ in range(3)])
    ref = clone(layers)
    ctx, sync = _ctx(n=2, layers=3)
    x = torch.randn(8, 32, requires_grad=True)
    bad, error = {  # the step's arguments, and the error it raises
        "between_context_and_sync": (dict(fail_after=1), _SkipBatch),
        "sync_fn_on_a_tuple": (dict(sync_arg=lambda h: (h,)), TypeError),
    }.get(failure, (None, None))
    if bad is None:
        boom = nn.Module()
        boom.forward = lambda h: 1 / 0
        with pytest.raises(ZeroDivisionError):
            _step([layers[0], boom], x, ctx, sync)
    else:
        with pytest.raises(error):
            _step(layers, x, ctx, sync, **bad)
    assert _no_saved_tensor_hooks() and not ao.is_cpu_offload_enabled() and not ctx.inside_context
    for _ in range(2):  # the following steps run, exactly
        for p in list(layers.parameters()) + list(ref.parameters()):
            p.grad = None
        _step(layers, x, ctx, sync)
        ref_h = x
        for layer in ref:
            ref_h = layer(ref_h)
        ref_h.sum().backward()
        assert_bit_identical(grads(layers), grads(ref))
        assert ctx.offload_synchronizer.stats.bytes_reloaded > 0


def test_a_refused_layer_entry_leaves_no_hook_installed():
    s = DefaultOffloadSynchronizer(3, 2, device="cpu", min_offload_numel=0)
    s.enter_layer(0)
    with pytest.raises(ao.OffloadError, match="still open"):
        s.enter_layer(1)
    assert _no_saved_tensor_hooks() and not ao.is_cpu_offload_enabled()
    x = torch.randn(4, 4, requires_grad=True)
    (x * x).sum().backward()  # an unrelated save goes through autograd, not the abandoned runtime
    assert s.stats.tensors_offloaded == 0


# -- the tensor-group classes are the runtime's ------------------------------------------------
def test_layer_tensors_are_grouped_deduplicated_and_rebuilt_by_tensor_group_processor():
    s = ManualOffloadSynchronizer(2, device="cpu", min_offload_numel=0)
    x = torch.randn(8, 64, 64)
    w = torch.randn(64, 64, requires_grad=True)
    s.enter_layer(0)
    out = (x * w).sum() + (x.mT * w).sum() + (x[:, :32] * w[:32]).sum()
    s.commit_layer(out, 0)
    state = s._step.layers[0]
    group = state.fwd_gpu_tensor_group
    assert isinstance(group, TensorGroup) and len(group.tensor_list) == 1  # x, x.mT, x[:, :32]: one unit
    units, aux = TensorGroupProcessor.tensor_group_process_before_offload(TensorGroup([x, x.mT, x[:, :32]]))
    assert [u.nbytes for u in units.tensor_list] == [t.nbytes for t in group.tensor_list] == [x.nbytes]
    s.start_offload_layer(0)
    s.release_activation_forward_gpu_memory(0)
    s.start_reload_layer(0)
    assert isinstance(state.cpu_tensor_group, TensorGroup) and isinstance(state.bwd_gpu_tensor_group, TensorGroup)
    back = TensorGroupProcessor.tensor_group_process_after_reload(
        TensorGroup(state.bwd_gpu_tensor_group.tensor_list, state.bwd_gpu_tensor_group.events, aux)
    )
    for orig, new in zip([x, x.mT, x[:, :32]], back.tensor_list):
        assert torch.equal(orig, new) and orig.stride() == new.stride()
    wr = w.detach().clone().requires_grad_(True)
    out.backward()
    ((x * wr).sum() + (x.mT * wr).sum() + (x[:, :32] * wr[:32]).sum()).backward()
    torch.testing.assert_close(w.grad, wr.grad, rtol=0, atol=0)


# -- what a saved tensor is besides its bytes, and where it is saved ---------------------------------------
class _Saves(nn.Module):
    """A block whose ops save a conjugate and a negative view (complex), or two views of one storage in two
    dtypes, the second starting mid-element of the first's unit."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.lin = nn.Linear(16, 16, dtype=torch.complex64 if kind == "conj_neg" else torch.float32)
        self.p16 = nn.Parameter(torch.ones(8, dtype=torch.float16))
        self.p32 = nn.Parameter(torch.ones(1))

    def forward(self, x):
        h = self.lin(x)
        if self.kind == "conj_neg":  # mul saves h.conj() (conjugate bit) and imag(h.conj()) (negative bit)
            return h * h.conj() + h * torch.imag(h.conj())
        hd = h.detach()
        self.aux = self.p16 * hd.view(torch.float16)[0, 0, 1:9]  # saves bytes [2, 18) of h's storage
        return h + (self.p32 * hd[0, 0, 1:2]).sum()  # saves bytes [4, 8) as float32


class _Stack(nn.Module):
    def __init__(self, blocks) -> None:
        super().__init__()
        self.layers = nn.ModuleList(blocks)

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x


class _Mlp(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        return x + self.fc2(torch.nn.functional.gelu(self.fc1(x)))


def _grads(m):
    return {k: p.grad for k, p in m.named_parameters() if p.grad is not None}


def _same_grads(a, b):
    ga, gb = _grads(a), _grads(b)
    assert ga.keys() == gb.keys() and ga and all(torch.equal(ga[k], gb[k]) for k in ga)


@pytest.mark.parametrize("kind", ["conj_neg", "dtype_alias"])
def test_saved_views_keep_their_conjugate_negative_bits_and_their_own_dtype(kind):
    model = _Stack([_Saves(kind) for _ in range(3)])
    ref = clone(model)
    ao.offload_transform(model, num_layers=2, min_offload_numel=0)
    x = torch.randn(2, 8, 16, dtype=model.layers[0].lin.weight.dtype)
    for m in (model, ref):
        m(x).abs().square().mean().backward()
    assert model.offload_plan.bytes_per_step > 0
    _same_grads(model, ref)


def test_a_torch_func_transform_runs_the_layers_as_without_offload():
    from torch.func import functional_call, grad, jvp

    model = _Stack([_Mlp() for _ in range(3)])
    ref = clone(model)
    ao.offload_transform(model, num_layers=2, min_offload_numel=0)
    x = torch.randn(4, 16)

    def loss(m):
        return lambda p: functional_call(m, p, (x,)).square().mean()

    got, want = (grad(loss(m))(dict(m.named_parameters())) for m in (model, ref))
    assert all(torch.equal(got[k], want[k]) for k in want)
    (o1, t1), (o2, t2) = (jvp(m, (x,), (torch.ones_like(x),)) for m in (model, ref))
    assert torch.equal(o1, o2) and torch.equal(t1, t2)
    for m in (model, ref):  # and a plain step still offloads
        m(x).square().mean().backward()
    assert model.offload_plan.bytes_per_step > 0
    _same_grads(model, ref)


class _Keeps(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.l1, self.l2 = nn.Linear(16, 32), nn.Linear(32, 16)

    def forward(self, x):
        self.kept = torch.tanh(self.l1(x))  # tanh saves it (2, 8, 32); l2 saves its (16, 32) view
        return self.l2(self.kept)


def test_an_in_place_change_names_the_saved_view_as_autograd_does():
    import re

    model = _Stack([_Keeps() for _ in range(2)])
    ref = clone(model)
    ao.offload_transform(model, num_layers=1, min_offload_numel=0)
    x = torch.randn(2, 8, 16)
    errors = []
    for m in (ref, model):
        out = m(x).sum()
        m.layers[0].kept.mul_(2)  # after the forward, through the saved view's base
        with pytest.raises(RuntimeError, match="modified by an inplace operation") as err:
            out.backward()
        errors.append(re.search(r"\[torch\.\w+ \[[\d, ]*\]\]", str(err.value)).group(0))
    assert errors[1] == errors[0] == "[torch.FloatTensor [16, 32]]"
