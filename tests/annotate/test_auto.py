"""``memory_budget=``: the planner's choices, schedule and optimizer split are applied; budgets are checked;
a plain ``num_layers=N`` gets the overlap schedule (Note [Default schedule from the link])."""

from __future__ import annotations

import copy
import re
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import annotate_offload as ao
import annotate_offload.planner as planner
from annotate_offload.annotate import offload_layer, offload_transform
from annotate_offload.annotate._layers import saved_ops

from ._models import MLPBlock, Stack, assert_same_step, cfg, run_step, sync_of

X = torch.randn(2, 32, 64)
CHUNK = 2 * 32 * 64 * 4  # one (2, 32, 64) fp32 layer input, bytes


def test_the_plans_choices_and_schedule_are_applied_and_exact(plan_choices):
    seen = {}
    plan_choices(["offload", "recompute_offload", "recompute", "keep"], seen)
    model = Stack(4)
    ref = copy.deepcopy(model)
    offload_transform(model, memory_budget="1MiB", example_inputs=(X,), config=cfg())
    assert seen["layers"] == list(model.layers) and seen["budget"] == "1MiB" and seen["keep"] == []
    plan = model.offload_plan
    assert [lp.choice for lp in plan.layers] == ["offload", "recompute_offload", "recompute", "keep"]
    sync = sync_of(model)
    assert (sync.release_lag, sync.prefetch_layers) == (1, 1)  # the schedule the planner assumed
    assert_same_step(run_step(model, X), run_step(ref, X))
    per_layer = sync.stats.bytes_offloaded_per_layer
    assert per_layer[1] == CHUNK  # recompute_offload: only the checkpoint input moves
    assert per_layer[0] > CHUNK and set(per_layer) == {0, 1}


class _CountOps(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.counts = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.counts[func] = self.counts.get(func, 0) + 1
        return func(*args, **(kwargs or {}))


def test_a_selective_layer_reruns_only_what_its_matrix_multiplies_do_not_give_and_is_exact(plan_choices):
    mms = {}
    for first in ("keep", "recompute", "selective"):
        plan_choices([first] + ["keep"] * 3)
        torch.manual_seed(0)
        model, ref = Stack(4), Stack(4)
        ref.load_state_dict(model.state_dict())
        offload_transform(model, memory_budget="1MiB", example_inputs=(X,), config=cfg())
        with _CountOps() as ops:
            got = run_step(model, X)
        assert_same_step(got, run_step(ref, X))
        mms[first] = sum(n for op, n in ops.counts.items() if op in saved_ops())
        assert ops.counts.get(torch.ops.aten.gelu.default, 0) == 4 + (first != "keep")  # its gelu reruns
    assert mms["recompute"] == mms["keep"] + 1 == mms["selective"] + 1  # the rerun stops after fc1's gelu


def test_a_selective_offload_layer_moves_its_input_and_kept_outputs_and_is_exact(plan_choices):
    plan_choices(["selective_offload", "selective", "keep", "keep"])
    torch.manual_seed(0)
    model, ref = Stack(4), Stack(4)
    ref.load_state_dict(model.state_dict())
    offload_transform(model, memory_budget="1MiB", example_inputs=(X,), config=cfg())
    assert sorted(model.offload_plan.offloaded_layers) == [0]
    with _CountOps() as ops:
        got = run_step(model, X)
    with _CountOps() as ref_ops:
        want = run_step(ref, X)
    assert_same_step(got, want)
    # the input, fc1's (64, 128) and fc2's (64, 64) outputs; the gelu between them is rerun, not moved
    assert dict(sync_of(model).stats.bytes_offloaded_per_layer) == {0: 4 * CHUNK}
    mms, gelus = ([sum(n for op, n in c.counts.items() if op in ops_) for c in (ops, ref_ops)]
                  for ops_ in (saved_ops(), {torch.ops.aten.gelu.default}))
    assert mms[0] == mms[1] and gelus[0] == gelus[1] + 2  # no matrix multiply reruns; both layers' gelus do


class _ScaledInPlace(MLPBlock):
    def forward(self, x):
        h = self.fc1(x)
        h.mul_(2)  # nothing has saved h yet: the run without recompute is valid
        return x + self.fc2(F.gelu(h))


class _ChangedAfterUse(MLPBlock):
    def forward(self, x):
        h = self.fc1(x)
        out = x + self.fc2(F.gelu(h))
        h.mul_(2)  # gelu saved h: the run without recompute raises at backward
        return out


@pytest.mark.parametrize("choice", ["recompute", "recompute_offload", "selective", "selective_offload"])
def test_in_place_changes_give_a_recomputed_layer_the_results_and_errors_of_the_run_without_it(plan_choices,
                                                                                              choice):
    def step(block, plan):
        torch.manual_seed(0)
        model = Stack(4, block=block)
        if plan:  # every layer recomputed: the error cannot come from a kept layer
            plan_choices([choice] + [choice.split("_")[0]] * 3)
            offload_transform(model, memory_budget="1MiB", example_inputs=(X,), config=cfg())
        return run_step(model, X)

    # a kept output changed before anything saved it is computed again in the rerun, not handed back
    assert_same_step(step(_ScaledInPlace, True), step(_ScaledInPlace, False))
    for plan in (False, True):  # a saved tensor changed in place: autograd's error, at backward
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            step(_ChangedAfterUse, plan)


@pytest.mark.parametrize("choice", ["recompute", "recompute_offload", "selective", "selective_offload"])
def test_a_recomputed_layer_reruns_in_each_backward_of_a_retained_graph(plan_choices, choice):
    plan_choices([choice, choice.split("_")[0], "keep", "keep"])
    torch.manual_seed(0)
    model, ref = Stack(4), Stack(4)
    ref.load_state_dict(model.state_dict())
    offload_transform(model, memory_budget="1MiB", example_inputs=(X,), config=cfg())
    grads = []
    for m in (model, ref):
        loss = m(X).square().mean()
        loss.backward(retain_graph=True)
        loss.backward()
        grads.append([p.grad for p in m.parameters()])
    assert all(torch.equal(a, b) for a, b in zip(*grads))


@pytest.mark.parametrize("around", ["non_reentrant", "reentrant"])
def test_a_selective_layer_inside_the_users_checkpoint_is_exact(plan_choices, around):
    plan_choices(["selective"] * 4)
    torch.manual_seed(0)
    model, ref = Stack(4, around=around), Stack(4, around=around)
    ref.load_state_dict(model.state_dict())
    offload_transform(model, memory_budget="1MiB", example_inputs=(X,), config=cfg())
    assert_same_step(run_step(model, X), run_step(ref, X))


def test_declared_keep_layers_are_passed_to_the_planner(plan_choices):
    seen = {}
    plan_choices(["keep", "recompute_offload", "keep", "keep"], seen)
    model = Stack(4)
    offload_layer(offload=False)(model.layers[0])
    for blk in model.layers[1:]:
        offload_layer(blk)
    offload_transform(model, memory_budget=1 << 20, example_inputs=(X,))
    assert seen["keep"] == [0]


def test_the_real_planner_fits_the_budget_exactly_and_the_plan_shows_predicted_and_measured():
    model = Stack(4)
    ref = copy.deepcopy(model)
    probe = planner.plan_offload(model, memory_budget="1TiB", example_inputs=(X,), layers=list(model.layers))
    budget = probe.keep_all.peak_bytes - probe.measurements[0].saved_bytes // 2
    offload_transform(model, memory_budget=budget, example_inputs=(X,), config=cfg())
    plan = model.offload_plan
    assert plan.planner.prediction.peak_bytes <= budget and not plan.planner.fits
    assert model.offload_plan.optimizer_kwargs() == plan.planner.optimizer_kwargs()
    assert_same_step(run_step(model, X), run_step(ref, X))
    measured = plan.measure(lambda: run_step(model, X))
    assert measured["peak_bytes"] is None and len(measured["layer_ms"]) == 4 and measured["step_ms"] > 0
    text = repr(plan)
    assert "pred. ms" in text and "meas. ms" in text and f"{plan.planner.prediction.step_ms:.2f}" in text
    assert not model._forward_pre_hooks and not any(m._forward_hooks for m in model.layers)  # one-off hooks


def test_a_model_that_fits_keeps_everything_with_a_one_line_warning():
    model = Stack(4)
    with pytest.warns(UserWarning, match="fits memory_budget=") as caught:
        offload_transform(model, memory_budget="64GiB", example_inputs=(X,))
    assert len([w for w in caught if "fits" in str(w.message)]) == 1 and "\n" not in str(caught[0].message)
    plan = model.offload_plan
    assert [lp.choice for lp in plan.layers] == ["keep"] * 4
    assert plan.optimizer_kwargs() == {"offload_fraction": 0.0}
    assert str(plan).count("fits memory_budget=") == 1  # said once, by the planner's summary


@pytest.mark.parametrize("budget", [1, "1KiB"])
def test_small_budgets_name_the_smallest_feasible_budget_and_leave_the_model_alone(budget):
    model = Stack(4)
    with pytest.raises(ValueError, match=r"memory_budget=.*the smallest feasible budget for this model and batch is \d+"):
        offload_transform(model, memory_budget=budget, example_inputs=(X,))
    assert "offload_plan" not in model.__dict__ and "forward" not in model.layers[0].__dict__


@pytest.mark.parametrize("inputs", [(X,), None], ids=["example_inputs", "no_inputs"])
@pytest.mark.parametrize("budget, error, match", [
    ("lots", ValueError, r"memory_budget='lots' is not a memory size; pass bytes .*TiB\)\.$"),
    (0, ValueError, "memory_budget=0 must be positive"), (-5, ValueError, "memory_budget=-5 must be positive"), ("-1GiB", ValueError, "memory_budget='-1GiB' must be positive"),
    ([1], TypeError, r"memory_budget must be bytes .* got \[1\] \(list\)")])
def test_bad_budgets_are_refused_before_anything_is_measured(monkeypatch, inputs, budget, error, match):
    monkeypatch.setattr(planner, "plan_offload", lambda *a, **k: pytest.fail("measured before checking"))
    model = Stack(4)
    with pytest.raises(error, match=rf"^offload_transform: {match}"):
        offload_transform(model, memory_budget=budget, example_inputs=inputs)
    assert "offload_plan" not in model.__dict__ and "forward" not in model.layers[0].__dict__


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(num_layers="auto"), ValueError, r"num_layers='auto' requires memory_budget="),
        (dict(num_layers=2, memory_budget="1GiB", example_inputs=(X,)), ValueError,
         r"memory_budget='1GiB' plans the layers itself, but num_layers=2"),
        (dict(memory_budget="1GiB"), ValueError, r"memory_budget='1GiB' needs example_inputs="),
        (dict(memory_budget="1GiB", example_inputs=(X,), config=cfg(recompute=True)), ValueError,
         "config.recompute=True with memory_budget=; the planner chooses recompute per layer"),
        (dict(memory_budget="1GiB", example_inputs=(X,), config=cfg(memory_budget="2GiB")), ValueError,
         "differs from config.memory_budget"),
    ],
)
def test_budget_arguments_are_checked_before_anything_is_measured(monkeypatch, kwargs, error, match):
    monkeypatch.setattr(planner, "plan_offload", lambda *a, **k: pytest.fail("measured before checking"))
    with pytest.raises(error, match=match):
        offload_transform(Stack(4), **kwargs)


@pytest.mark.parametrize("name, value", [("cpu_offloading_num_layers", 0), ("cpu_offloading_num_layers", 2),
                                         ("recompute", True)])
def test_a_config_with_a_budget_refuses_a_layer_count_or_recompute(name, value):
    # 0 layers too: the planner chooses the layers, a count of any value contradicts the budget
    with pytest.raises(ValueError, match=rf"^memory_budget lets the planner choose the layers \(model\.{name}={value!r}\)"
                                         rf"\. Fix: set model\.{name}=(None|False) with a memory budget"):
        cfg(memory_budget="1GiB", **{name: value})
    assert getattr(cfg(**{name: value}), name) == value  # without a budget: a fixed plan


def test_a_budget_of_the_wrong_type_is_refused_before_measuring(monkeypatch):
    from annotate_offload.planner import _plan

    monkeypatch.setattr(_plan, "measure", lambda *a, **k: pytest.fail("measured before checking"))
    model = Stack(4)
    with pytest.raises(TypeError, match="memory_budget must be bytes"):
        offload_transform(model, memory_budget=[1], example_inputs=(X,))
    assert "offload_plan" not in model.__dict__


def test_the_configs_budget_plans_too(plan_choices):
    seen = {}
    plan_choices(["keep"] * 4, seen)
    offload_transform(Stack(4), config=cfg(memory_budget="20GiB"), example_inputs=(X,))
    assert seen["budget"] == "20GiB"


def test_a_plain_num_layers_gets_the_overlap_schedule_and_te_s_context_keeps_te_s():
    model = Stack(4)
    offload_transform(model, 2, config=cfg())
    sync = sync_of(model)
    assert (sync.release_lag, sync.prefetch_layers) == (1, 1)
    assert len(model._forward_pre_hooks) == 1  # measures the link at the first training forward on CUDA
    with torch.no_grad():
        model(X)
    assert len(model._forward_pre_hooks) == 1  # not a training forward: still waiting
    run_step(model, X)
    assert not model._forward_pre_hooks and (sync.release_lag, sync.prefetch_layers) == (1, 1)  # CPU: kept
    given = Stack(4)
    offload_transform(given, 2, config=cfg(release_lag=0, prefetch_layers=2))
    assert (sync_of(given).release_lag, sync_of(given).prefetch_layers) == (0, 2) and not given._forward_pre_hooks
    ctx, _ = ao.get_cpu_offload_context(True, 2, 4, device="cpu")
    assert (ctx.offload_synchronizer.release_lag, ctx.offload_synchronizer.prefetch_layers) == (1, 1)  # TE: L-N-1
    ctx, _ = ao.get_cpu_offload_context(True, 1, 4, device="cpu")
    assert (ctx.offload_synchronizer.release_lag, ctx.offload_synchronizer.prefetch_layers) == (2, 2)


def test_a_deep_copy_of_a_planned_model_measures_itself(plan_choices):
    plan_choices(["offload", "keep", "keep", "keep"])
    model = Stack(4)
    offload_transform(model, memory_budget="1GiB", example_inputs=(X,), config=cfg())
    twin = copy.deepcopy(model)
    assert twin.offload_plan.model() is twin and twin.offload_plan.planner == model.offload_plan.planner
    twin.offload_plan.measure(lambda: run_step(twin, X))
    assert twin.offload_plan.measured is not None and model.offload_plan.measured is None


def test_measuring_a_step_leaves_no_hook_and_no_reference_to_the_model(plan_choices):
    import gc
    import weakref

    plan_choices(["offload", "keep", "keep", "keep"])
    model = Stack(4)
    offload_transform(model, memory_budget="1GiB", example_inputs=(X,), config=cfg())
    weight = next(model.layers[0].parameters())
    model.offload_plan.measure(lambda: run_step(model, X))
    assert not weight._backward_hooks  # else each later step would run the measurement's hooks
    weight = weakref.ref(weight)
    del model
    gc.collect()
    assert weight() is None


def test_the_plan_counts_what_the_runtime_will_not_move():
    # with the default threshold (256K elements) nothing of this model moves: the plan must not
    # choose offload and promise a peak the run would exceed
    from annotate_offload.models import GPTConfig, GPTStack

    x = torch.randn(4, 128, 64)
    model = GPTStack(GPTConfig(hidden=64, heads=4, layers=4))
    probe = planner.plan_offload(model, memory_budget="1TiB", example_inputs=(x,), optimizer=None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        offload_transform(model, memory_budget=probe.keep_all.peak_bytes - 1000, example_inputs=(x,))
    assert not any(lp.choice == "offload" for lp in model.offload_plan.layers)  # it would free nothing
    model(x).square().mean().backward()
    assert model.offload_plan.runtime.stats.bytes_offloaded == 0


@pytest.mark.cuda
def test_the_schedule_is_chosen_from_the_link_at_the_first_training_forward_on_cuda():
    model = Stack(6, h=1024).cuda()
    offload_transform(model, 4, config=cfg())
    x = torch.randn(8, 512, 1024, device="cuda")
    run_step(model, x)
    assert not model._forward_pre_hooks
    note = next(n for n in model.offload_plan.notes if n.startswith("schedule from the link"))
    lag, prefetch = map(int, re.findall(r"=(\d+)", note))
    assert (sync_of(model).release_lag, sync_of(model).prefetch_layers) == (lag, prefetch)
    assert 0 <= lag <= 1 and 1 <= prefetch <= 1  # capped at TE's gap L - N - 1 = 1


def test_a_planned_transform_leaves_no_reference_to_the_model(plan_choices):
    import gc
    import weakref

    from annotate_offload.models import Llama, LlamaConfig

    # a recomputed layer before kept ones whose ops save their outputs (rsqrt): the meta estimate's
    # graph is never run backward, so nothing it saves may keep the layers alive
    plan_choices(["recompute_offload", "recompute", "keep", "keep"])
    model = Llama(LlamaConfig.from_preset("llama-tiny"))
    weight = weakref.ref(model.layers[0].mlp.up_proj.weight)
    offload_transform(model, memory_budget="1MiB", example_inputs=(torch.randint(0, 256, (2, 16)),))
    del model
    gc.collect()
    assert weight() is None
