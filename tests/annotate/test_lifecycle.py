"""The transformed model across its life: train/eval branches, repeated forwards, retain_graph,
dtype/device moves, and importing without CUDA."""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings

import pytest
import torch
import torch.nn as nn

from annotate_offload.annotate import offload_transform

from ._models import MLPBlock, Stack, assert_same_step, run_step, sync_of

X = torch.randn(2, 32, 64)


def _apply(model, path="fx", n=2):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return offload_transform(model, num_layers=n, path=path, min_offload_numel=0)


def _grads_equal(a, b):
    return all(torch.equal(p.grad, q.grad) for p, q in zip(a.parameters(), b.parameters()))


class TrainEvalBranch(nn.Module):
    """Root forward branches on self.training, which fx would otherwise fix at trace time."""

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
    assert model.__dict__["_annotate_offload_state"].graph_module_eval is not None
    assert_same_step(run_step(model, X), run_step(ref, X))
    model.eval(), ref.eval()
    with torch.no_grad():
        assert torch.equal(model(X), ref(X))
    model.train(), ref.train()
    assert_same_step(run_step(model, X), run_step(ref, X))


def test_same_graph_for_both_modes_is_traced_once():
    model = Stack(3)
    _apply(model)
    assert model.__dict__["_annotate_offload_state"].graph_module_eval is None


@pytest.mark.parametrize("path", ["fx", "hooks"])
def test_two_forwards_then_one_backward(path):
    model = Stack(4)
    ref = copy.deepcopy(model)
    _apply(model, path)
    for m in (model, ref):
        (m(X).square().mean() + m(X * 2).square().mean()).backward()
    assert _grads_equal(model, ref)


@pytest.mark.parametrize("path", ["fx", "hooks"])
def test_retain_graph_backward_twice(path):
    model = Stack(4)
    ref = copy.deepcopy(model)
    _apply(model, path)
    for m in (model, ref):
        loss = m(X).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
    assert _grads_equal(model, ref)
    assert sync_of(model).stats.bytes_offloaded > 0


def test_dtype_move_after_transform():
    class Scaled(Stack):  # a root buffer the graph reads: .double() replaces the buffer object
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


def test_import_does_not_initialise_cuda():
    code = ("import torch, annotate_offload.annotate as a; from annotate_offload.annotate import _transform, "
            "_fx_pass, _hooks, _estimate; print(torch.cuda.is_initialized())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


class SharedLayer(nn.Module):
    """Calls layer 0 twice (weight sharing): not one offload unit."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList([MLPBlock() for _ in range(3)])

    def forward(self, x):
        x = self.layers[0](x)
        for layer in self.layers:
            x = layer(x)
        return x


def test_layer_called_twice_is_refused_clearly():
    """path='auto' used to fall back to the hook path, which then refused every training forward
    (fresh-user report, seventh session, second pass, item 3): it now refuses at transform time,
    leaving the model untouched. An explicit path='hooks' (no tracing) refuses at the first forward."""
    from annotate_offload.errors import OffloadError

    model = SharedLayer()
    with pytest.raises(OffloadError, match=r"layers.0 is called more than once.*Neither path can offload it.*filter_fn="):
        _apply(model, path="auto", n=1)
    assert not hasattr(model, "offload_plan") and "forward" not in model.__dict__
    _apply(model, path="hooks", n=1)
    with pytest.raises(OffloadError, match=r"layer 0 started after layer 0 in the same forward"):
        run_step(model, X)
    with torch.no_grad():
        model(X)  # eval forwards never reach the runtime
    assert sync_of(model)._step is None


# -- copies (Note [Copying a synchronizer]) ----------------------------------------------------
@pytest.mark.parametrize("path", ["fx", "hooks"])
def test_deepcopy_is_an_independent_offloaded_model(path):
    ref = Stack(3)
    model = _apply(copy.deepcopy(ref), path)
    dup = copy.deepcopy(model)  # an EMA copy, a frozen reference model
    assert type(dup) is type(model) and dup.offload_plan.path == path
    assert sync_of(dup) is not sync_of(model)
    assert sync_of(dup).backend is sync_of(model).backend and sync_of(dup).pool is sync_of(model).pool
    for p, q in zip(dup.parameters(), model.parameters()):
        assert p is not q and torch.equal(p, q)
    steps = sync_of(model).stats.step
    # the copy steps on its own runtime; the original's step count does not move
    assert_same_step(run_step(dup, X), run_step(ref, X))
    assert sync_of(dup).stats.bytes_offloaded > 0 and sync_of(model).stats.step == steps
    assert_same_step(run_step(model, X), run_step(ref, X))
    # interleaved forwards of the two (the original's scope open while the copy runs) stay exact
    loss_a = model(X.clone().requires_grad_(True)).square().mean()
    loss_b = dup(X.clone().requires_grad_(True)).square().mean()
    loss_a.backward()
    loss_b.backward()
    assert _grads_equal(model, dup)
    model.zero_grad(set_to_none=True)
    dup.zero_grad(set_to_none=True)
    from annotate_offload.annotate import remove_offload

    remove_offload(dup)  # undoing the copy leaves the original offloaded
    assert "forward" not in dup.__dict__ and not any(m._forward_pre_hooks for m in dup.modules())
    assert_same_step(run_step(model, X), run_step(ref, X))
    assert sync_of(model).stats.bytes_offloaded > 0


def test_averaged_model_of_a_transformed_model_steps():
    model = _apply(Stack(3))
    ema = torch.optim.swa_utils.AveragedModel(model, multi_avg_fn=torch.optim.swa_utils.get_ema_multi_avg_fn(0.9))
    run_step(model, X)
    ema.update_parameters(model)
    with torch.no_grad():
        assert torch.equal(ema(X), ema.module(X))


@pytest.mark.parametrize("path", ["fx", "hooks"])
def test_pickling_a_transformed_model_names_the_fix(path, tmp_path):
    from annotate_offload.errors import OffloadError

    model = _apply(Stack(3), path)
    with pytest.raises(OffloadError, match=r"state_dict\(\).*remove_offload"):
        torch.save(model, tmp_path / "m.pt")
    torch.save(model.state_dict(), tmp_path / "sd.pt")  # the supported way
    fresh = Stack(3)
    fresh.load_state_dict(torch.load(tmp_path / "sd.pt"))
    assert_same_step(run_step(_apply(fresh, path), X), run_step(model, X))


def test_fx_path_refuses_a_layer_list_changed_after_the_trace():
    from annotate_offload.annotate import remove_offload
    from annotate_offload.errors import OffloadError

    ref = Stack(3)
    model = _apply(copy.deepcopy(ref))
    model.layers[1] = copy.deepcopy(ref.layers[1])  # replacing in place: the code looks it up live
    assert_same_step(run_step(model, X), run_step(ref, X))
    model.layers.append(copy.deepcopy(ref.layers[0]))  # the traced forward would never call it
    with pytest.raises(OffloadError, match=r"layers has 4 modules, but had 3 when the forward was traced.*remove_offload"):
        model(X)
    del model.layers[3]
    assert_same_step(run_step(model, X), run_step(ref, X))  # back to the traced shape: runs again
    remove_offload(model)
    model.layers.append(copy.deepcopy(ref.layers[0]))
    _apply(model)  # transformed again with the new list
    assert len(model.offload_plan.layers) == 4
    model(X)
