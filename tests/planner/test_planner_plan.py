"""plan_offload: the result, its text, budgets (parsing, the smallest feasible one), an end-to-end CPU run."""

import dataclasses
import re

import pytest
import torch

from annotate_offload.models.gpt import GPTConfig, GPTStack
from annotate_offload.config import parse_memory_budget
from annotate_offload.planner import PlannerResult, _plan as plan_module, plan_offload
from annotate_offload.planner._plan import format_bytes
from annotate_offload.planner._cost_model import LayerMeasurement, LinkBandwidth, StepMeasurement, predict

GB = 10**9
SAME = tuple(LayerMeasurement(10.0, 20.0, GB, GB // 10, name=f"layers.{i}", grad_bytes=GB // 10) for i in range(6))
STEP = StepMeasurement(static_bytes=2 * GB, param_numels=(10**8,) * 8, param_state_bytes=(GB // 2,) * 8,
                       device_ms=7.0, host_ms=230.0)
LINK = LinkBandwidth(60.0, 60.0)


def plan(budget, **kw):
    return plan_offload(None, memory_budget=budget, measurements=SAME, step=STEP, bandwidth=LINK, **kw)


def test_result_fields_helpers_and_text():
    r = plan(8 * GB)
    assert isinstance(r, PlannerResult) and not r.fits
    assert r.prediction.peak_bytes <= 8 * GB < r.keep_all.peak_bytes and r.prediction.step_ms >= r.keep_all.step_ms
    assert r.offloaded_layers == tuple(i for i, c in enumerate(r.choices) if c in ("offload", "recompute_offload"))
    assert r.recomputed_layers == tuple(i for i, c in enumerate(r.choices) if "recompute" in c)
    assert r.runtime_kwargs() == {"num_layers": 6, "offloaded_layers": r.offloaded_layers,
                                  "release_lag": r.release_lag, "prefetch_layers": r.prefetch_layers}
    assert r.optimizer_kwargs() == {"offload_fraction": r.offload_fraction}
    text = str(r)
    assert f"predicted step {r.prediction.step_ms:.1f} ms" in text and "plan for memory_budget=7.45 GiB" in text
    for i, c in enumerate(r.choices):  # per layer: choice, predicted ms and peak
        assert re.search(rf"layers\.{i}\s+{c}\s+{r.prediction.layer_ms[i]:.2f}", text)
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.choices = ()


def test_a_model_that_fits_keeps_everything_and_the_optimizer_on_the_device():
    r = plan("1TiB")
    assert r.fits and r.choices == ("keep",) * 6 and r.optimizer_kwargs() == {"offload_fraction": 0.0}
    assert r.summary().count("\n") == 0 and "fits memory_budget=1024.00 GiB" in r.summary()
    fixed = plan("1TiB", offload_fraction=0.5)  # the user's optimizer already holds half the state on the host
    assert fixed.fits and f"predicted peak {format_bytes(fixed.prediction.peak_bytes)} with every layer kept and the " \
        "optimizer's offload_fraction=0.500" in fixed.summary()
    assert fixed.prediction.peak_bytes < r.prediction.peak_bytes


def test_a_tight_budget_moves_optimizer_state_only_when_recompute_is_not_enough():
    full = predict(SAME, ["recompute"] * 6, LINK, STEP)
    assert plan(full.peak_bytes).offload_fraction == 0.0
    r = plan(full.peak_bytes - GB)
    assert r.offload_fraction > 0 and r.prediction.peak_bytes <= full.peak_bytes - GB
    with pytest.raises(ValueError, match="smallest feasible budget"):
        plan(full.peak_bytes - GB, optimizer="device")


@pytest.mark.parametrize("budget, error, match", [
    ("abc", ValueError, "is not a memory size"), (0, ValueError, "must be positive"), (-1, ValueError, "must be positive"),
    ("0GiB", ValueError, "must be positive"), (2.5, ValueError, "not a whole number of bytes"),
    ("20G", ValueError, "is not a memory size"), ([4], TypeError, "must be bytes")])
def test_bad_budgets_are_refused_before_measuring(monkeypatch, budget, error, match):
    monkeypatch.setattr(plan_module, "measure", lambda *a, **k: pytest.fail("measured before checking"))
    with pytest.raises(error, match=rf"^plan_offload: memory_budget.*{match}") as info:
        plan_offload(torch.nn.Linear(2, 2), memory_budget=budget, example_inputs=(torch.ones(2),))
    assert "smallest feasible" not in str(info.value) and ".;" not in str(info.value)


def test_a_budget_below_what_any_plan_needs_names_the_smallest_feasible_budget():
    with pytest.raises(ValueError, match=r"the smallest feasible budget for this model and batch is (\d+) bytes") as info:
        plan(1000)
    smallest = int(re.search(r"is (\d+) bytes", str(info.value)).group(1))
    assert plan(smallest).prediction.peak_bytes <= smallest
    assert "memory_budget=1000 (1000 bytes) cannot be met" in str(info.value)
    suggested = re.search(r"e\.g\. '([^']+)'", str(info.value)).group(1)
    assert suggested == format_bytes(smallest, up=True) and parse_memory_budget(suggested) >= smallest
    with pytest.raises(ValueError, match=f"is {smallest} bytes"):
        plan(smallest - 1)


def test_the_suggested_budget_has_a_sensible_unit_and_is_not_rounded_down():
    assert format_bytes(int(1.5 * 2**20), up=True) == "1.50 MiB" and format_bytes(int(1.5 * 2**20) + 1, up=True) == "1.51 MiB"
    assert format_bytes(512, up=True) == "512 B" and format_bytes(3 * 2**30 + 1, up=True) == "3.01 GiB"
    for n in (1, 1023, 1024, 1025, 10**6, 123456789, 5 * 10**9 + 7):
        assert parse_memory_budget(format_bytes(n, up=True)) >= n


def test_a_given_offload_fraction_is_planned_for_and_only_the_layers_are_searched():
    free, fixed = plan(10 * GB), plan(10 * GB, offload_fraction=0.5)
    assert free.offload_fraction == 0.0 and not free.fraction_given
    assert fixed.offload_fraction == 0.5 and fixed.fraction_given and fixed.prediction.peak_bytes <= 10 * GB
    assert fixed.choices.count("keep") > free.choices.count("keep")  # half the Adam state is off the device already
    assert fixed.prediction == predict(SAME, fixed.choices, LINK, STEP, release_lag=fixed.release_lag,
                                       prefetch_layers=fixed.prefetch_layers, offload_fraction=0.5)
    assert "optimizer offload_fraction=0.500 (the optimizer's)" in fixed.summary()
    with pytest.raises(ValueError, match="smallest feasible budget"):  # fits only with more of it on the host
        plan(plan(4 * GB).prediction.peak_bytes, offload_fraction=0.0)
    for bad in (1.5, "0.5", True):
        with pytest.raises(ValueError, match=rf"offload_fraction={bad!r} with optimizer='hybrid'; pass a number"):
            plan(10 * GB, offload_fraction=bad)
    with pytest.raises(ValueError, match="offload_fraction=0.5 with optimizer='device'"):
        plan(10 * GB, offload_fraction=0.5, optimizer="device")


def test_bad_arguments():
    with pytest.raises(ValueError, match="example_inputs is None and measurements is None"):
        plan_offload(None, memory_budget=GB)
    with pytest.raises(TypeError, match=r"measurements\[0\] is a float"):
        plan_offload(None, memory_budget=GB, measurements=[1.0])
    with pytest.raises(TypeError, match="bandwidth must be a LinkBandwidth"):
        plan_offload(None, memory_budget=GB, measurements=SAME, bandwidth=50.0)
    with pytest.raises(ValueError, match="1 layers but 6"):
        plan_offload(None, memory_budget=GB, measurements=SAME, layers=[torch.nn.Linear(1, 1)], bandwidth=LINK)
    with pytest.raises(ValueError, match="optimizer must be one of"):
        plan(GB, optimizer="sgd")
    with pytest.raises(ValueError, match=r"keep=\[6\] names a layer past the last of the 6 layers; pass .* \[0, 6\)"):
        plan(GB, keep=[6])
    for bad in ([-1], [True], ["0"]):
        with pytest.raises(ValueError, match=r"keep=.* must hold layer indices"):
            plan_offload(None, memory_budget=GB, keep=bad)  # refused before anything else is looked at


def test_a_given_schedule_is_kept():
    r = plan(8 * GB, release_lag=2, prefetch_layers=3)
    assert (r.release_lag, r.prefetch_layers) == (2, 3)


def test_same_measurements_same_plan_and_a_larger_budget_not_slower():
    plans = [plan(b) for b in (7 * GB, 8 * GB, 10 * GB)]
    assert plan(8 * GB) == plans[1]
    steps = [p.prediction.step_ms for p in plans]
    assert steps == sorted(steps, reverse=True)


def test_end_to_end_on_a_small_gpt_leaves_weights_and_grads_alone(monkeypatch):
    from annotate_offload.planner import _bandwidth

    monkeypatch.setattr(_bandwidth, "_ADAMW_CACHE", {"cpu": (100.0, 3000.0)})
    model = GPTStack(GPTConfig(hidden=32, heads=4, layers=4))
    x = torch.randn(2, 64, 32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    keep_all = plan_offload(model, memory_budget=2**40, example_inputs=(x,), bandwidth=LinkBandwidth(10.0, 10.0))
    assert keep_all.fits and keep_all.choices == ("keep",) * 4
    assert [m.name for m in keep_all.measurements] == ["layers.0", "layers.1", "layers.2", "layers.3"]
    assert keep_all.step.static_bytes == sum(p.numel() * 4 for p in model.parameters())
    budget = keep_all.keep_all.peak_bytes - keep_all.measurements[0].saved_bytes // 2
    tight = plan_offload(model, memory_budget=budget, measurements=keep_all.measurements, step=keep_all.step,
                         bandwidth=LinkBandwidth(10.0, 10.0))
    assert (tight.choices, tight.offload_fraction) != (keep_all.choices, 0.0) and tight.prediction.peak_bytes <= budget
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_schedule_knobs_are_checked_before_profiling(monkeypatch):
    from annotate_offload.planner import _plan

    monkeypatch.setattr(_plan, "measure", lambda *a, **k: pytest.fail("profiled before checking"))
    model = GPTStack(GPTConfig(hidden=32, heads=2, layers=2))
    with pytest.raises(ValueError, match=r"plan_offload: prefetch_layers must be None or an int >= 1, got 0"):
        plan_offload(model, memory_budget=1 << 20, example_inputs=(torch.randn(1, 4, 32),), prefetch_layers=0)
