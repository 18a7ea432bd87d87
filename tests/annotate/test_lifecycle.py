"""The transformed model across its life: train/eval branches, repeated forwards, retain_graph,
dtype moves, shared and replaced layers, copies, deletion, and importing without CUDA."""

from __future__ import annotations

import copy
import gc
import sys
import warnings
import weakref

import pytest
import torch
import torch.nn as nn

from annotate_offload.annotate import offload_transform, remove_offload
from annotate_offload.errors import OffloadError

from ._models import MLPBlock, Stack, assert_same_step, cfg, run_step, sync_of

X = torch.randn(2, 32, 64)


def _apply(model, n=2, **kw):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return offload_transform(model, n, config=cfg(), **kw)


def _grads_equal(a, b):
    return all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))


class TrainEvalBranch(nn.Module):
    """Root forward branches on self.training."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([MLPBlock() for _ in range(3)])

    def forward(self, x):
        for layer in self.layers:
            x = layer(x)
        return x * 2 if self.training else x - 1


def test_train_and_eval_branches_follow_model_training():
    model = TrainEvalBranch()
    ref = copy.deepcopy(model)
    _apply(model)
    assert_same_step(run_step(model, X), run_step(ref, X))
    model.eval(), ref.eval()
    with torch.no_grad():
        assert torch.equal(model(X), ref(X))
    model.train(), ref.train()
    assert_same_step(run_step(model, X), run_step(ref, X))


def test_two_forwards_then_one_backward():
    model = Stack(4)
    ref = copy.deepcopy(model)
    _apply(model)
    for m in (model, ref):
        (m(X).square().mean() + m(X * 2).square().mean()).backward()
    assert _grads_equal(model, ref)


def test_retain_graph_backward_twice():
    model = Stack(4)
    ref = copy.deepcopy(model)
    _apply(model)
    for m in (model, ref):
        loss = m(X).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
    assert _grads_equal(model, ref)
    assert sync_of(model).stats.bytes_offloaded > 0


def test_dtype_move_after_transform():
    class Scaled(Stack):  # a root buffer: .double() replaces the buffer object
        def forward(self, x):
            return super().forward(x) * self.scale

    scaled = Scaled(4)
    scaled.register_buffer("scale", torch.full((64,), 0.5))
    ref = copy.deepcopy(scaled)
    _apply(scaled)
    scaled.double(), ref.double()
    x = X.double()
    assert_same_step(run_step(scaled, x), run_step(ref, x))
    assert sync_of(scaled).stats.bytes_offloaded > 0


def test_import_does_not_initialise_cuda(run_group):
    code = ("import torch, annotate_offload.annotate as a; from annotate_offload.annotate import _transform, "
            "_layers, _estimate; print(torch.cuda.is_initialized())")
    out = run_group([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


# -- shared, repeated and replaced layers -------------------------------------------------------
def test_a_layer_at_two_positions_is_refused_at_transform_naming_both():
    model = Stack(3)
    model.layers[2] = model.layers[0]  # one module, two positions: it runs twice per forward
    with pytest.raises(OffloadError, match=r"layer layers\.0 is also registered as layers\.2.*own module"):
        offload_transform(model, 1, layer_types=MLPBlock)
    assert "offload_plan" not in model.__dict__ and not any("forward" in m.__dict__ for m in model.modules())


class CallsLayerTwice(nn.Module):
    """Calls layer 0 twice per forward (one fqn, two calls)."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([MLPBlock() for _ in range(3)])

    def forward(self, x):
        x = self.layers[0](x)
        for layer in self.layers:
            x = layer(x)
        return x


class RunsLayersReversed(nn.Module):
    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([MLPBlock() for _ in range(3)])

    def forward(self, x):
        for layer in reversed(self.layers):
            x = layer(x)
        return x


@pytest.mark.parametrize("make, error", [
    (CallsLayerTwice, r"layer 0 \(layers\.0\) runs more than once in one forward"),
    (RunsLayersReversed, r"layer 1 \(layers\.1\) runs after layer 2 \(layers\.2\).*registration order")])
def test_layers_run_twice_or_out_of_order_are_refused_with_example_inputs_and_exact_without(make, error):
    """With example_inputs the transform sees the forward and refuses, leaving the model untouched;
    without them a repeated or earlier layer starts a new runtime step (like a second forward): exact."""
    model = make()
    ref = copy.deepcopy(model)
    with pytest.raises(OffloadError, match=error):
        _apply(model, 1, example_inputs=(X,))
    assert "offload_plan" not in model.__dict__ and not any("forward" in m.__dict__ for m in model.modules())
    _apply(model, 1)
    assert_same_step(run_step(model, X), run_step(ref, X))
    with torch.no_grad():
        assert torch.equal(model(X), ref(X))


def test_a_replaced_layer_is_offloaded_from_the_next_forward_and_a_removed_one_is_refused():
    ref = Stack(3)
    model = _apply(copy.deepcopy(ref))
    model.layers[1] = copy.deepcopy(ref.layers[1])  # replaced after the transform
    assert_same_step(run_step(model, X), run_step(ref, X))  # wrapped at the start of this forward
    assert set(sync_of(model).stats.bytes_offloaded_per_layer) == {0, 1}
    assert "forward" in model.layers[1].__dict__
    model.layers[0] = model.layers[1]  # a layer moved: the two slots hold one module
    with pytest.raises(OffloadError, match=r"layers\.0 \(layer 0\) now holds layer 1 \(layers\.1\).*remove_offload"):
        model(X)
    model.layers[0] = copy.deepcopy(ref.layers[0])
    assert_same_step(run_step(model, X), run_step(ref, X))
    del model.layers[2]
    with pytest.raises(OffloadError, match=r"layers\.2 \(layer 2\) is gone since the transform"):
        model(X)
    remove_offload(model)
    _apply(model, 1)  # transformed again with the new list
    assert len(model.offload_plan.layers) == 2


def test_an_instance_forward_set_on_a_layer_after_the_transform_runs_inside_the_scope():
    ref = Stack(3)
    model = _apply(copy.deepcopy(ref))
    layer = model.layers[0]
    orig = layer.forward
    layer.forward = lambda x: orig(x) * 2  # the user's override, after the transform
    ref_layer = ref.layers[0]
    ref_orig = ref_layer.forward
    ref_layer.forward = lambda x: ref_orig(x) * 2
    for _ in range(2):  # the override calls the earlier wrapper: one scope per call all the same
        assert_same_step(run_step(model, X), run_step(ref, X))
        assert set(sync_of(model).stats.bytes_offloaded_per_layer) == {0, 1}
    layer.forward = lambda x: MLPBlock.forward(layer, x) + 1  # an override that does not call it
    ref_layer.forward = lambda x: MLPBlock.forward(ref_layer, x) + 1
    assert_same_step(run_step(model, X), run_step(ref, X))  # seen at layer 1: wrapped from the next forward
    assert_same_step(run_step(model, X), run_step(ref, X))
    assert set(sync_of(model).stats.bytes_offloaded_per_layer) == {0, 1}


# -- copies (Note [Copying a synchronizer]) ----------------------------------------------------
def test_deepcopy_is_an_independent_offloaded_model():
    ref = Stack(3)
    model = _apply(copy.deepcopy(ref))
    dup = copy.deepcopy(model)  # an EMA copy, a frozen reference model
    assert type(dup) is type(model)
    assert sync_of(dup) is not sync_of(model)
    assert dup.layers[0].__dict__["forward"].module() is dup.layers[0]
    assert sync_of(dup).backend is sync_of(model).backend and sync_of(dup).pool is sync_of(model).pool
    for p, q in zip(dup.parameters(), model.parameters()):
        assert p is not q and torch.equal(p, q)
    steps = sync_of(model).stats.step
    # the copy steps on its own runtime; the original's step count does not move
    assert_same_step(run_step(dup, X), run_step(ref, X))
    assert sync_of(dup).stats.bytes_offloaded > 0 and sync_of(model).stats.step == steps
    assert_same_step(run_step(model, X), run_step(ref, X))
    # interleaved forwards of the two stay exact
    loss_a = model(X.clone().requires_grad_(True)).square().mean()
    loss_b = dup(X.clone().requires_grad_(True)).square().mean()
    loss_a.backward()
    loss_b.backward()
    assert _grads_equal(model, dup)
    model.zero_grad(set_to_none=True)
    dup.zero_grad(set_to_none=True)
    remove_offload(dup)  # undoing the copy leaves the original offloaded
    assert not any("forward" in m.__dict__ for m in dup.modules())
    assert_same_step(run_step(model, X), run_step(ref, X))
    assert sync_of(model).stats.bytes_offloaded > 0


def test_a_layer_copied_alone_or_outliving_its_model_is_a_plain_module_a_new_transform_takes():
    ref = Stack(3)
    model = _apply(copy.deepcopy(ref))
    memo: dict = {}
    lone = copy.deepcopy(model.layers[1], memo)
    assert not any(id(p) in memo for p in model.layers[0].parameters())  # not the whole model
    assert torch.equal(lone(X), ref.layers[1](X))
    layers = list(model.layers)
    del model
    gc.collect()
    new = copy.deepcopy(ref)
    new.layers = nn.ModuleList(layers)
    _apply(new)
    assert_same_step(run_step(new, X), run_step(ref, X))
    assert sync_of(new).stats.bytes_offloaded > 0
    remove_offload(new)
    assert not any("forward" in m.__dict__ for m in new.modules())


def test_averaged_model_of_a_transformed_model_steps():
    model = _apply(Stack(3))
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    run_step(model, X)
    ema.update_parameters(model)
    with torch.no_grad():
        assert torch.equal(ema(X), ema.module(X))


def test_pickling_a_transformed_model_names_the_fix(tmp_path):
    model = _apply(Stack(3))
    with pytest.raises(OffloadError, match=r"state_dict\(\).*remove_offload"):
        torch.save(model, tmp_path / "m.pt")
    torch.save(model.state_dict(), tmp_path / "sd.pt")  # the supported way
    fresh = Stack(3)
    fresh.load_state_dict(torch.load(tmp_path / "sd.pt"))
    assert_same_step(run_step(_apply(fresh), X), run_step(model, X))


@pytest.mark.parametrize("num_layers", [2, "auto"])
def test_deleting_a_transformed_model_frees_it_without_the_garbage_collector(num_layers):
    """No reference cycle: like an untransformed model, the last reference going frees the weights
    (a cycle kept them, and their device memory, until the next garbage collection)."""
    model = Stack(4)
    weight = weakref.ref(model.layers[0].fc1.weight)
    kw = dict(memory_budget=1 << 20, example_inputs=(X,)) if num_layers == "auto" else {}
    gc.collect()
    gc.disable()
    try:
        _apply(model, num_layers, **kw)
        run_step(model, X)
        del model
        assert weight() is None
    finally:
        gc.enable()
