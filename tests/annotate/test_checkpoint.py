"""torch.utils.checkpoint inside and around layers, reentrant and non-reentrant, on both paths.

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

from ._models import CkptInside, Stack, assert_same_step, run_step, sync_of

L = 4


def _x():
    return torch.randn(2, 32, 64)


def _apply(model, path, n=2, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return offload_transform(model, num_layers=n, path=path, min_offload_numel=0, **kw)


def _check_offloads(model, ref, n=2):
    x = _x()
    for _ in range(2):
        assert_same_step(run_step(model, x), run_step(ref, x))
        per_layer = sync_of(model).stats.bytes_offloaded_per_layer
        assert set(per_layer) == set(range(n)) and all(b > 0 for b in per_layer.values()), per_layer


@pytest.mark.parametrize("reentrant", [False, True], ids=["non_reentrant", "reentrant"])
@pytest.mark.parametrize("path", ["fx", "hooks"])
def test_checkpoint_inside_layers(path, reentrant):
    model = Stack(L, block=partial(CkptInside, reentrant=reentrant))
    ref = copy.deepcopy(model)
    _apply(model, path)
    _check_offloads(model, ref)
    # What is offloaded is the checkpoint's input only (one (2, 32, 64) fp32 tensor per layer),
    # not the block's internals: the checkpoint still recomputes them.
    assert sync_of(model).stats.bytes_offloaded_per_layer == {0: 2 * 32 * 64 * 4, 1: 2 * 32 * 64 * 4}


@pytest.mark.parametrize("around", ["non_reentrant", "reentrant"])
def test_checkpoint_around_layers_fx_keeps_the_checkpoint_and_offloads_its_inputs(around):
    model = Stack(L, around=around)
    ref = copy.deepcopy(model)
    _apply(model, "fx")
    gm = model.__dict__["_annotate_offload_state"].graph_module
    tagged = [n for n in gm.graph.nodes if n.meta.get("offload_layer", {}).get("checkpoint")]
    assert len(tagged) == L  # fx did not trace through the checkpoint and drop it
    _check_offloads(model, ref)
    assert sync_of(model).stats.bytes_offloaded_per_layer == {0: 2 * 32 * 64 * 4, 1: 2 * 32 * 64 * 4}


@pytest.mark.parametrize("around", ["non_reentrant", "reentrant"])
def test_checkpoint_around_layers_hooks_refuses_clearly(around):
    model = Stack(L, around=around)
    _apply(model, "hooks")
    with pytest.raises(OffloadError, match=r"layer 0 \(layers.0\) runs .*checkpoint.*recompute=True"):
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


@pytest.mark.parametrize("path", ["fx", "hooks"])
def test_checkpoint_around_the_whole_model(path):
    """Fresh-user report (seventh session) item 2: on the fx path a non-reentrant checkpoint around the
    transformed model failed in backward with torch's "CheckpointError: ... different metadata" (our
    saved-tensor scopes replaced the checkpoint's hooks), even with num_layers=0. Kept layers now
    stand aside (bit-exact); offloaded ones are refused in forward with the fix, and the model still
    trains without the checkpoint afterwards (Note [A checkpoint around the layer])."""
    kept, ref = Stack(L), None
    ref = copy.deepcopy(kept)
    _apply(kept, path, n=0)
    x = _x()
    assert_same_step(run_step(_Wrapped(kept), x), run_step(_Wrapped(ref), x))
    model = Stack(L)
    ref = copy.deepcopy(model)
    _apply(model, path)
    with pytest.raises(OffloadError, match=r"layer 0 .*runs inside torch.utils.checkpoint\(use_reentrant=False\).*recompute=True"):
        run_step(_Wrapped(model), x)
    sync = sync_of(model)
    assert sync._scope is None and sync._step is None
    _check_offloads(model, ref)


def test_checkpoint_around_kept_layers_hooks_is_left_alone():
    model = Stack(L, around="non_reentrant")
    ref = copy.deepcopy(model)
    _apply(model, "hooks", n=0)
    x = _x()
    assert_same_step(run_step(model, x), run_step(ref, x))


@pytest.mark.parametrize("path", ["fx", "hooks"])
def test_recompute_option_checkpoints_and_offloads_the_checkpoint_input(path):
    model = Stack(L)
    ref = copy.deepcopy(model)
    _apply(model, path, recompute=True)
    assert [lp.choice for lp in model.offload_plan.layers] == ["recompute_offload"] * 2 + ["recompute"] * 2
    _check_offloads(model, ref)
    assert sync_of(model).stats.bytes_offloaded_per_layer == {0: 2 * 32 * 64 * 4, 1: 2 * 32 * 64 * 4}


def test_hooks_do_not_open_scopes_during_recompute():
    model = Stack(L, block=partial(CkptInside, reentrant=False))
    _apply(model, "hooks", recompute=True)
    entered = []
    sync = sync_of(model)
    orig = sync.enter_layer
    sync.enter_layer = lambda i: (entered.append(i), orig(i))[1]
    run_step(model, _x())
    assert entered == list(range(L))  # once per layer: the backward recompute opened none
