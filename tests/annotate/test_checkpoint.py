"""torch.utils.checkpoint inside and around layers, reentrant and non-reentrant.

Offloading must really move what the checkpoint saves (runtime stats show bytes for every
offloaded layer), or refuse with an OffloadError; it must never offload nothing silently.
"""

from __future__ import annotations

import copy
import warnings
from functools import partial

import pytest
import torch

from annotate_offload.annotate import offload_transform
from annotate_offload.errors import OffloadError

from ._models import CkptInside, Stack, assert_same_step, cfg, run_step, sync_of

L = 4


def _x():
    return torch.randn(2, 32, 64)


def _apply(model, n=2, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return offload_transform(model, n, config=cfg(**kw))


def _check_offloads(model, ref, n=2):
    x = _x()
    for _ in range(2):
        assert_same_step(run_step(model, x), run_step(ref, x))
        per_layer = sync_of(model).stats.bytes_offloaded_per_layer
        assert set(per_layer) == set(range(n)) and all(b > 0 for b in per_layer.values()), per_layer


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
def test_checkpoint_inside_layers(reentrant):
    model = Stack(L, block=partial(CkptInside, reentrant=reentrant))
    ref = copy.deepcopy(model)
    _apply(model)
    _check_offloads(model, ref)
    # What is offloaded is the checkpoint's input only (one (2, 32, 64) fp32 tensor per layer),
    # not the block's internals: the checkpoint still recomputes them.
    assert sync_of(model).stats.bytes_offloaded_per_layer == {0: 2 * 32 * 64 * 4, 1: 2 * 32 * 64 * 4}


@pytest.mark.parametrize("around", ["non_reentrant", "reentrant"])
def test_checkpoint_around_offloaded_layers_is_refused_clearly(around):
    """The checkpoint saves the layer's input before the layer's scope opens: nothing could move."""
    model = Stack(L, around=around)
    _apply(model)
    with pytest.raises(OffloadError, match=r"layer 0 \(layers.0\) runs inside torch.utils.checkpoint\(use_reentrant="
                                           r".*recompute=True"):
        run_step(model, _x())
    sync = sync_of(model)
    assert sync._scope is None and sync._step is None


class _Wrapped(torch.nn.Module):
    """The user's non-reentrant checkpoint around the whole (transformed) model."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, x):
        return torch.utils.checkpoint.checkpoint(self.inner, x, use_reentrant=False)


def test_checkpoint_around_the_whole_model():
    """A non-reentrant checkpoint around the transformed model: a saved-tensor scope inside it would
    replace the checkpoint's hooks ("CheckpointError: ... different metadata" in backward). Kept
    layers stand aside (bit-exact); offloaded ones are refused in forward with the fix, and the model
    still trains without the checkpoint afterwards (Note [A checkpoint around the layer])."""
    kept = Stack(L)
    ref = copy.deepcopy(kept)
    _apply(kept, n=0)
    x = _x()
    assert_same_step(run_step(_Wrapped(kept), x), run_step(_Wrapped(ref), x))
    model = Stack(L)
    ref = copy.deepcopy(model)
    _apply(model)
    with pytest.raises(OffloadError, match=r"layer 0 .*runs inside torch.utils.checkpoint\(use_reentrant=False\).*recompute=True"):
        run_step(_Wrapped(model), x)
    sync = sync_of(model)
    assert sync._scope is None and sync._step is None
    _check_offloads(model, ref)


@pytest.mark.parametrize("around", ["non_reentrant", "reentrant"])
def test_checkpoint_around_kept_layers_is_left_alone(around):
    model = Stack(L, around=around)
    ref = copy.deepcopy(model)
    _apply(model, n=0)
    x = _x()
    assert_same_step(run_step(model, x), run_step(ref, x))


def test_recompute_option_checkpoints_and_offloads_the_checkpoint_input():
    model = Stack(L)
    ref = copy.deepcopy(model)
    _apply(model, recompute=True)
    assert [lp.choice for lp in model.offload_plan.layers] == ["recompute_offload"] * 2 + ["recompute"] * 2
    _check_offloads(model, ref)
    assert sync_of(model).stats.bytes_offloaded_per_layer == {0: 2 * 32 * 64 * 4, 1: 2 * 32 * 64 * 4}


def test_layer_forwards_do_not_open_scopes_during_recompute():
    model = Stack(L, block=partial(CkptInside, reentrant=False))
    _apply(model, recompute=True)
    entered = []
    sync = sync_of(model)
    orig = sync.enter_layer
    sync.enter_layer = lambda i: (entered.append(i), orig(i))[1]
    run_step(model, _x())
    assert entered == list(range(L))  # once per layer: the backward recompute opened none


class _NormBlock(torch.nn.Module):
    def __init__(self, h: int) -> None:
        super().__init__()
        self.lin, self.bn = torch.nn.Linear(h, h), torch.nn.BatchNorm1d(h)

    def forward(self, x):
        return x + torch.relu(self.bn(self.lin(x).transpose(1, 2)).transpose(1, 2))


@pytest.mark.parametrize("selective", [False, True])
def test_a_recomputed_layer_updates_its_buffers_once_per_step(selective):
    # BatchNorm's running statistics: the backward's rerun of the forward must not update them again
    model = Stack(L, block=_NormBlock)
    ref = copy.deepcopy(model)
    _apply(model, recompute=True)
    state = model.__dict__["_annotate_offload_state"]
    state.recompute = dict.fromkeys(state.recompute, selective)  # as a plan with "selective" layers
    for _ in range(3):
        x = _x()
        assert_same_step(run_step(model, x), run_step(ref, x))
    for (name, a), (_, b) in zip(model.named_buffers(), ref.named_buffers()):
        assert torch.equal(a, b), name
    model.eval(), ref.eval()
    with torch.no_grad():
        x = _x()
        assert torch.equal(model(x), ref(x))


class _KeywordBlock(torch.nn.Module):
    """A block whose keywords share names with torch.utils.checkpoint's own."""

    def __init__(self, h: int) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(h, h)

    def forward(self, x, *, debug=None, use_reentrant=None):
        assert debug is False and use_reentrant is True  # the caller's values, not checkpoint's
        return torch.relu(self.lin(x))


class _KeywordStack(Stack):
    def forward(self, x):
        x = self.inp(x)
        for layer in self.layers:
            x = layer(x, debug=False, use_reentrant=True)
        return self.out(x)


def test_a_recomputed_layer_gets_its_own_keywords_even_where_checkpoint_takes_the_name():
    model = _KeywordStack(L, block=_KeywordBlock)
    ref = copy.deepcopy(model)
    _apply(model, recompute=True)
    _check_offloads(model, ref)

