"""plan_offload: the public result, its table, input validation, and an end-to-end CPU run."""

import dataclasses

import pytest
import torch

from annotate_offload.models.gpt import GPTConfig, GPTStack
from annotate_offload.planner import PlannerResult, plan_offload
from annotate_offload.planner._cost_model import LayerMeasurement, LinkBandwidth

GB = 10**9
SAME = tuple(LayerMeasurement(10.0, 20.0, GB, GB // 10, name=f"layers.{i}") for i in range(6))


def test_result_fields_helpers_and_table():
    r = plan_offload(None, memory_budget=3 * GB, measurements=SAME, bandwidth=LinkBandwidth(60.0, 60.0))
    assert isinstance(r, PlannerResult)
    assert len(r.choices) == len(r.reasons) == 6
    assert set(r.choices) <= {"keep", "offload", "recompute", "recompute_offload"}
    assert r.predicted_peak_bytes <= 3 * GB < r.baseline_peak_bytes
    assert r.predicted_step_ms >= r.baseline_step_ms == 180.0
    assert r.offloaded_layers == tuple(i for i, c in enumerate(r.choices) if c in ("offload", "recompute_offload"))
    assert r.recomputed_layers == tuple(i for i, c in enumerate(r.choices) if "recompute" in c)
    kwargs = r.runtime_kwargs()
    assert kwargs == {"num_layers": 6, "offloaded_layers": r.offloaded_layers, "release_lag": 1, "prefetch_layers": 1}
    text = str(r)
    assert "predicted step time" in text and f"{r.predicted_step_ms:.2f} ms" in text
    assert "predicted peak activation memory" in text
    for i, (choice, reason) in enumerate(zip(r.choices, r.reasons)):
        assert f"{i} layers.{i}" in text and reason in text
        assert choice in text
    with pytest.raises(dataclasses.FrozenInstanceError):
        r.choices = ()


def test_reasons_explain_the_alternatives():
    # 1 GB copies take 16.7 ms at 60 GB/s: they hide behind a layer's and the next one's forward (20 ms)
    # when no other copy queues in front, so spaced-out offloads beat recompute (10 ms each);
    # at 30 GB/s (33 ms copies) recompute is cheaper.
    r = plan_offload(None, memory_budget=3 * GB, measurements=SAME, bandwidth=LinkBandwidth(60.0, 60.0))
    assert r.choices == ("offload", "offload", "keep", "offload", "keep", "keep")
    assert "hidden behind other layers' compute" in r.reasons[0] and "recompute: over budget" in r.reasons[0]
    assert "stalls 3.33 ms" in r.reasons[1]
    r = plan_offload(None, memory_budget=3 * GB + GB // 2, measurements=SAME, bandwidth=LinkBandwidth(30.0, 30.0))
    i = r.choices.index("recompute")
    assert "reruns forward (+10.00 ms)" in r.reasons[i]
    assert "offload: +" in r.reasons[i]
    k = r.choices.index("keep")
    assert "keeps" in r.reasons[k]


def test_same_measurements_same_plan_and_larger_budget_not_slower():
    bw = LinkBandwidth(25.0, 30.0)
    plans = [plan_offload(None, memory_budget=b, measurements=SAME, bandwidth=bw) for b in (2 * GB, 3 * GB, 5 * GB)]
    again = plan_offload(None, memory_budget=3 * GB, measurements=SAME, bandwidth=bw)
    assert again == plans[1]
    steps = [p.predicted_step_ms for p in plans]
    assert steps == sorted(steps, reverse=True)


def test_infeasible_budget_raises_with_the_smallest_feasible_budget():
    with pytest.raises(ValueError, match=r"memory_budget=1000 bytes .* cannot be met; the smallest feasible budget"):
        plan_offload(None, memory_budget=1000, measurements=SAME, bandwidth=LinkBandwidth(60.0, 60.0))


@pytest.mark.parametrize(
    "kwargs, error, match",
    [
        (dict(memory_budget="4GiB"), TypeError, "memory_budget must be a number of bytes"),
        (dict(memory_budget=-5), ValueError, "memory_budget must be >= 0"),
        (dict(memory_budget=2.5), ValueError, r"memory_budget is a number of bytes, got the fraction 2.5"),
        (dict(memory_budget=GB), ValueError, "example_inputs is None and measurements is None"),
        (dict(memory_budget=GB, measurements=[1.0]), TypeError, r"measurements\[0\] is a float"),
        (dict(memory_budget=GB, measurements=SAME, bandwidth=50.0), TypeError, "bandwidth must be a LinkBandwidth"),
        (dict(memory_budget=GB, measurements=SAME, layers=[torch.nn.Linear(1, 1)]), ValueError, "1 layers but 6"),
    ],
)
def test_bad_arguments(kwargs, error, match):
    with pytest.raises(error, match=match):
        plan_offload(None, **kwargs)


def test_end_to_end_on_a_small_gpt_leaves_weights_and_grads_alone():
    model = GPTStack(GPTConfig(hidden=32, heads=4, layers=4))
    x = torch.randn(2, 64, 32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    keep_all = plan_offload(model, memory_budget=2**40, example_inputs=(x,), bandwidth=LinkBandwidth(10.0, 10.0))
    assert keep_all.choices == ("keep",) * 4
    assert keep_all.layer_names == ("layers.0", "layers.1", "layers.2", "layers.3")
    m = keep_all.measurements
    assert all(q.saved_bytes > q.checkpoint_input_bytes == 2 * 64 * 32 * 4 for q in m)
    budget = keep_all.baseline_peak_bytes - m[0].saved_bytes // 2
    tight = plan_offload(model, memory_budget=budget, measurements=m, bandwidth=LinkBandwidth(10.0, 10.0))
    assert tight.choices != keep_all.choices and tight.predicted_peak_bytes <= budget
    assert all(p.grad is None for p in model.parameters())
    for k, v in model.state_dict().items():
        assert torch.equal(v, before[k])


def test_budget_messages_use_a_readable_unit_and_infinity_is_a_value_error():
    from annotate_offload.planner._search import format_bytes

    assert format_bytes(2375680) == "2.27 MiB (2375680 bytes)" and format_bytes(3 * 2**30) == "3.00 GiB (3221225472 bytes)"
    assert format_bytes(512) == "512 B (512 bytes)"
    with pytest.raises(ValueError, match="memory_budget must be a finite number of bytes, got inf"):
        plan_offload(None, memory_budget=float("inf"), measurements=[LayerMeasurement(1.0, 1.0, 1, 1)] * 2,
                     bandwidth=LinkBandwidth(1.0, 1.0))


def test_schedule_knobs_are_checked_by_plan_offload_before_profiling(monkeypatch):
    from annotate_offload.planner import _plan

    monkeypatch.setattr(_plan, "measure_layers", lambda *a, **k: pytest.fail("profiled before checking"))
    model = GPTStack(GPTConfig(hidden=32, heads=2, layers=2))
    with pytest.raises(ValueError, match=r"plan_offload: prefetch_layers must be an int >= 1, got 0"):
        plan_offload(model, memory_budget=1 << 20, example_inputs=(torch.randn(1, 4, 32),), prefetch_layers=0)
    with pytest.raises(ValueError, match=r"plan_offload: release_lag must be an int >= 0, got -1"):
        plan_offload(model, memory_budget=1 << 20, example_inputs=(torch.randn(1, 4, 32),), release_lag=-1)
