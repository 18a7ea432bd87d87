"""num_layers="auto": the planner's per-layer choices are applied (keep, offload, recompute, recompute_offload)."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch

import annotate_offload.planner as planner
from annotate_offload.annotate import offload_layer, offload_transform

from ._models import Stack, assert_same_step, cfg, run_step, sync_of

X = torch.randn(2, 32, 64)
CHUNK = 2 * 32 * 64 * 4  # one (2, 32, 64) fp32 layer input, bytes


def _stub(choices, seen=None):
    def plan_offload(model, *, memory_budget, example_inputs, layers, **kw):
        if seen is not None:
            seen.update(layers=layers, budget=memory_budget, **kw)
        return SimpleNamespace(choices=tuple(choices), reasons=tuple(f"stub {c}" for c in choices),
                               release_lag=1, prefetch_layers=1, predicted_step_ms=1.0,
                               predicted_peak_bytes=123, memory_budget=memory_budget)
    return plan_offload


def test_auto_applies_every_choice(monkeypatch):
    seen = {}
    monkeypatch.setattr(planner, "plan_offload", _stub(["offload", "recompute_offload", "recompute", "keep"], seen))
    model = Stack(4)
    ref = copy.deepcopy(model)
    offload_transform(model, num_layers="auto", memory_budget=1 << 20, example_inputs=(X,), config=cfg())
    assert seen["layers"] == list(model.layers) and seen["budget"] == 1 << 20
    plan = model.offload_plan
    assert [lp.choice for lp in plan.layers] == ["offload", "recompute_offload", "recompute", "keep"]
    assert "why 2: stub recompute" in repr(plan)
    sync = sync_of(model)
    assert (sync.release_lag, sync.prefetch_layers) == (1, 1)  # the schedule the planner assumed
    assert model.layers[2].__dict__.get("forward") is not None  # checkpointed by us
    assert_same_step(run_step(model, X), run_step(ref, X))
    per_layer = sync.stats.bytes_offloaded_per_layer
    assert per_layer[1] == CHUNK  # recompute_offload: only the checkpoint input moves
    assert per_layer[0] > CHUNK  # offload: the layer's saved activations
    assert set(per_layer) == {0, 1}


def test_auto_respects_declared_keep(monkeypatch):
    monkeypatch.setattr(planner, "plan_offload", _stub(["offload", "recompute_offload", "keep", "keep"]))
    model = Stack(4)
    offload_layer(offload=False)(model.layers[0])
    for blk in model.layers[1:]:
        offload_layer(blk)
    offload_transform(model, num_layers="auto", memory_budget=1 << 20, example_inputs=(X,))
    assert [lp.choice for lp in model.offload_plan.layers] == ["keep", "recompute_offload", "keep", "keep"]


def test_auto_with_the_real_planner_is_exact_and_within_budget():
    model = Stack(4)
    ref = copy.deepcopy(model)
    offload_transform(model, num_layers="auto", memory_budget=150_000, example_inputs=(X,), config=cfg())
    assert len(model.offload_plan.layers) == 4 and "auto: predicted" in repr(model.offload_plan)
    assert_same_step(run_step(model, X), run_step(ref, X))


def test_auto_infeasible_budget_is_the_planners_error():
    with pytest.raises(ValueError, match="cannot be met; the smallest feasible budget is"):
        offload_transform(Stack(4), num_layers="auto", memory_budget=1, example_inputs=(X,))


def test_auto_plan_counts_what_the_runtime_will_not_move():
    # with the default threshold (256K elements) nothing of this model moves: the plan must not
    # choose offload and promise a peak the run would exceed
    from annotate_offload.models import GPTConfig, GPTStack

    torch.manual_seed(0)
    x = torch.randn(4, 128, 64)
    model = GPTStack(GPTConfig(hidden=64, heads=4, layers=4))
    offload_transform(model, num_layers="auto", memory_budget=5 << 20, example_inputs=(x,))
    assert not any(lp.choice == "offload" for lp in model.offload_plan.layers)  # it would free nothing
    model(x).square().mean().backward()
    assert model.offload_plan.runtime.stats.bytes_offloaded == 0
