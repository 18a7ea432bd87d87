"""get_cpu_offload_context: signature, returns and validation, as TransformerEngine's."""

from __future__ import annotations

import contextlib
import inspect
import warnings

import pytest
import torch

import annotate_offload as ao
from annotate_offload import OffloadError
from annotate_offload.runtime import DefaultOffloadSynchronizer, ManualOffloadSynchronizer

from ._models import make_stack, run_offloaded

TE_PARAMS = [
    "enabled",
    "num_layers",
    "model_layers",
    "offload_activations",
    "offload_weights",
    "double_buffering",
    "manual_synchronization",
    "retain_pinned_cpu_buffers",
    "offload_stream",
]


def test_signature_is_transformer_engines_plus_four_keyword_only_options():
    params = inspect.signature(ao.get_cpu_offload_context).parameters
    assert list(params)[: len(TE_PARAMS)] == TE_PARAMS
    extra = [p for name, p in params.items() if name not in TE_PARAMS]
    assert [p.name for p in extra] == ["prefetch_layers", "policy", "min_offload_numel", "device"]
    assert all(p.kind is inspect.Parameter.KEYWORD_ONLY for p in extra)


def test_prefetch_layers_sets_the_look_ahead_both_ways():
    ctx, _ = ao.get_cpu_offload_context(True, 3, 4, device="cpu", prefetch_layers=1)
    s = ctx.offload_synchronizer
    assert (s.prefetch_layers, s.release_lag) == (1, 1)
    ctx, _ = ao.get_cpu_offload_context(True, 3, 4, device="cpu", prefetch_layers=2)
    s = ctx.offload_synchronizer
    assert (s.prefetch_layers, s.release_lag) == (2, 2)
    ctx, _ = ao.get_cpu_offload_context(True, 1, 4, device="cpu")
    assert (ctx.offload_synchronizer.prefetch_layers, ctx.offload_synchronizer.release_lag) == (2, 2)  # TE's L-N-1


def test_disabled_returns_nullcontext_and_identity():
    ctx, fn = ao.get_cpu_offload_context(False, 3, 4)
    assert isinstance(ctx, contextlib.nullcontext)
    t = torch.zeros(2)
    assert fn(t) is t
    ctx, fn, sync = ao.get_cpu_offload_context(False, 3, 4, manual_synchronization=True)
    assert isinstance(ctx, contextlib.nullcontext) and sync is None and fn(t) is t


def test_enabled_returns_context_with_megatron_attributes():
    ctx, fn = ao.get_cpu_offload_context(True, 1, 4, device="cpu")
    assert ctx.inside_context is False
    assert isinstance(ctx.offload_synchronizer, DefaultOffloadSynchronizer)
    ctx, fn, sync = ao.get_cpu_offload_context(True, 1, 4, manual_synchronization=True, device="cpu")
    assert isinstance(sync, ManualOffloadSynchronizer) and ctx.offload_synchronizer is sync


def test_nothing_selected_raises():
    with pytest.raises(ValueError, match="not mentioned what to offload"):
        ao.get_cpu_offload_context(True, 1, 4, offload_activations=False, offload_weights=False)


def test_too_many_layers_raises_and_last_layer_warns():
    with pytest.raises(ValueError, match="num_layers=4 must be <= model_layers - 1 = 3"):
        ao.get_cpu_offload_context(True, 4, 4, device="cpu")
    with pytest.warns(UserWarning, match="prefetch_layers=1"):
        ao.get_cpu_offload_context(True, 3, 4, device="cpu")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ao.get_cpu_offload_context(True, 3, 4, device="cpu", prefetch_layers=1)


def test_offload_stream_needs_manual_mode():
    with pytest.raises(ValueError, match="offload_stream is only supported with manual"):
        ao.get_cpu_offload_context(True, 1, 4, offload_stream=object(), device="cpu")


def test_offload_weights_is_deprecated_and_double_buffering_accepted():
    with pytest.warns(DeprecationWarning, match="Offloading weights is deprecated"):
        ctx, fn = ao.get_cpu_offload_context(True, 1, 4, True, True, device="cpu")
    assert hasattr(ctx, "offload_synchronizer")
    with pytest.warns(DeprecationWarning):
        ctx, fn = ao.get_cpu_offload_context(True, 1, 4, False, True)
    assert isinstance(ctx, contextlib.nullcontext)
    ctx, fn = ao.get_cpu_offload_context(True, 1, 4, double_buffering=True, device="cpu")
    assert hasattr(ctx, "offload_synchronizer")


@pytest.mark.parametrize(
    "kwargs,exc,match",
    [
        (dict(num_layers="2"), TypeError, "num_layers='2'"),
        (dict(num_layers=-1), ValueError, "num_layers=-1"),
        (dict(model_layers=0), ValueError, "model_layers=0"),
        (dict(prefetch_layers=1.5), TypeError, "prefetch_layers=1.5"),
        (dict(prefetch_layers=0), ValueError, "prefetch_layers=0"),
        (dict(policy="everything"), ValueError, "policy='everything'"),
        (dict(min_offload_numel=-5), ValueError, "min_offload_numel=-5"),
        (dict(device="tpu"), ValueError, "device='tpu'"),
        (dict(enabled="no"), TypeError, "enabled='no': expected a bool"),
        (dict(offload_activations="no"), TypeError, "offload_activations='no': expected a bool"),
        (dict(retain_pinned_cpu_buffers=1), TypeError, "retain_pinned_cpu_buffers=1: expected a bool"),
        (dict(manual_synchronization=None), TypeError, "manual_synchronization=None: expected a bool"),
    ],
)
def test_bad_arguments_name_parameter_and_value(kwargs, exc, match):
    base = dict(enabled=True, num_layers=1, model_layers=4, device="cpu")
    base.update(kwargs)
    with pytest.raises(exc, match=match):
        ao.get_cpu_offload_context(**base)


def _ctx(layers=3, n=1, **kw):
    return ao.get_cpu_offload_context(True, n, layers, device="cpu", min_offload_numel=0, **kw)


def test_sync_inside_context_before_a_layer_or_on_a_non_tensor_raises():
    ctx, sync = _ctx()
    x = torch.randn(2, 8, 64, requires_grad=True)
    with pytest.raises(OffloadError, match="before any layer ran"):
        sync(x)
    with ctx:
        y = x * 2
        with pytest.raises(OffloadError, match="inside the offload context"):
            sync(y)
    with pytest.raises(TypeError, match="got list"):
        sync([y])
    assert sync(y) is y


def test_nested_context_entry_raises():
    ctx, sync = _ctx()
    with ctx:
        with pytest.raises(OffloadError, match="entered again while inside"):
            with ctx:
                pass


@pytest.mark.parametrize("mode", [torch.no_grad, torch.inference_mode])
def test_grad_disabled_passes_straight_through(mode):
    blocks = make_stack(3)
    ctx, sync = _ctx(layers=3, n=2, prefetch_layers=1)
    x = torch.randn(2, 8, 64)
    with mode():
        h = x
        for blk in blocks:
            with ctx:
                assert ctx.inside_context
                assert not ao.is_cpu_offload_enabled()
                h = blk(h)
            assert sync(h) is h
    s = ctx.offload_synchronizer
    assert s._step is None and s.stats.tensors_offloaded == 0 and s._num_of_fwds is None


def test_is_cpu_offload_enabled_only_inside_a_layer_scope():
    ctx, sync = _ctx()
    x = torch.randn(4, requires_grad=True)
    assert not ao.is_cpu_offload_enabled()
    with ctx:
        assert ao.is_cpu_offload_enabled()
        y = x * 2
    assert not ao.is_cpu_offload_enabled()
    sync(y)


def test_two_contexts_in_one_process_are_independent():
    """A policy and a reference model, each with its own context, interleaved."""
    policy, ref = make_stack(3), make_stack(3)
    ctx_a, sync_a = _ctx(layers=3, n=2, prefetch_layers=1)
    ctx_b, sync_b = _ctx(layers=3, n=1)
    x = torch.randn(2, 8, 64, requires_grad=True)
    ya = run_offloaded(policy, x, ctx_a, sync_a)
    with torch.no_grad():
        run_offloaded(ref, x, ctx_b, sync_b)
    yb = run_offloaded(ref, x, ctx_b, sync_b)
    (ya.sum() + yb.sum()).backward()
    assert ctx_a.offload_synchronizer.stats.tensors_offloaded > 0
    assert ctx_b.offload_synchronizer.stats.tensors_offloaded > 0


@pytest.mark.filterwarnings("ignore:.*backward began after the offload context")  # one block of model_layers=2
def test_user_saved_tensor_hooks_inside_ours_see_every_save():
    """Documented: only the innermost saved_tensors_hooks pair is active (PyTorch semantics)."""
    ctx, sync = _ctx(layers=2, n=1)
    seen = []
    x = torch.randn(4, 4, requires_grad=True)
    with ctx:
        with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
            y = (x * x).sum()
    sync(y)
    y.backward()
    assert len(seen) == 2 and ctx.offload_synchronizer.stats.tensors_offloaded == 0


@pytest.mark.filterwarnings("ignore:.*backward began after the offload context")  # one block of model_layers=2
def test_user_saved_tensor_hooks_around_ours_are_shadowed():
    ctx, sync = _ctx(layers=2, n=1)
    seen = []
    x = torch.randn(4, 4, requires_grad=True) * 1.0  # an activation, not a leaf
    with torch.autograd.graph.saved_tensors_hooks(lambda t: seen.append(t) or t, lambda t: t):
        with ctx:
            y = (x * x).sum()
        sync(y)
        z = y * x.sum()  # saved outside our scope: the user's hooks see it
    z.backward()
    stats = ctx.offload_synchronizer.stats
    assert (stats.tensors_offloaded, stats.tensors_deduplicated) == (2, 1)  # x twice, one copy
    assert stats.bytes_offloaded == x.nbytes
    assert len(seen) == 2


@pytest.mark.parametrize("ran, warns", [(4, False), (5, True), (3, True), (8, False)])
def test_a_forward_that_runs_the_context_a_different_number_of_times_than_model_layers_warns(ran, warns):
    # 8 = two full forwards before one backward (gradient accumulation), which is fine
    layers = [torch.nn.Linear(64, 64) for _ in range(ran)]
    ctx, sync = ao.get_cpu_offload_context(enabled=True, num_layers=2, model_layers=4, min_offload_numel=0, device="cpu")
    h = torch.randn(8, 64, requires_grad=True)
    for layer in layers:
        with ctx:
            h = torch.tanh(layer(h))
        h = sync(h)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        h.sum().backward()
    hits = [w for w in seen if "model_layers=4" in str(w.message)]
    assert len(hits) == (1 if warns else 0), [str(w.message) for w in seen]
    if warns:
        assert "Pass model_layers equal to the number of `with ctx:` blocks" in str(hits[0].message)


def test_wrong_types_are_type_errors_and_prefetch_zero_is_refused_like_offload_transform():
    with pytest.raises(TypeError, match=r"model_layers='4': expected an int"):
        ao.get_cpu_offload_context(enabled=True, num_layers=1, model_layers="4")
    with pytest.raises(TypeError, match=r"model_layers=4.0: expected an int"):
        ao.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=4.0)
    with pytest.raises(ValueError, match=r"model_layers=0: must be >= 1"):
        ao.get_cpu_offload_context(enabled=True, num_layers=0, model_layers=0)
    with pytest.raises(ValueError, match=r"num_layers=-1: must be >= 0 .*0 offloads none"):
        ao.get_cpu_offload_context(enabled=True, num_layers=-1, model_layers=4)
    with pytest.raises(ValueError, match=r"prefetch_layers=0: must be >= 1"):
        ao.get_cpu_offload_context(enabled=True, num_layers=1, model_layers=4, prefetch_layers=0, device="cpu")
