"""Search: never over budget, monotone in the budget, deterministic ties, infeasible budgets rejected."""

import itertools
import random
import re

import pytest

from annotate_offload.planner._cost_model import LayerMeasurement, LinkBandwidth, predict
from annotate_offload.planner._cost_model import allowed_choices
from annotate_offload.planner._search import candidate_plans, plan_key, search

GB = 10**9


def random_layers(rng, n):
    return [
        LayerMeasurement(
            forward_ms=rng.uniform(1, 20),
            backward_ms=rng.uniform(2, 40),
            saved_bytes=rng.randint(GB // 4, 2 * GB),
            checkpoint_input_bytes=rng.randint(GB // 100, GB // 10),
        )
        for _ in range(n)
    ]


def budgets_between(layers, bw, count=25):
    keep = predict(layers, ["keep"] * len(layers), bw).peak_bytes
    cands, _ = candidate_plans(layers, bw)
    low = min(p.peak_bytes for p in cands.values())
    return sorted({low + (keep + GB - low) * k // count for k in range(count + 1)})


CASES = [(seed, n, bw) for seed, n in ((0, 4), (1, 5), (2, 6)) for bw in (10.0, 50.0, 400.0)]


@pytest.mark.parametrize("seed, n, gbps", CASES)
@pytest.mark.parametrize("limit", [None, 0], ids=["exhaustive", "heuristic"])
def test_never_over_budget_and_larger_budget_never_slower(seed, n, gbps, limit):
    rng = random.Random(seed)
    layers = random_layers(rng, n)
    bw = LinkBandwidth(gbps, gbps * 1.2)
    kwargs = {} if limit is None else {"exhaustive_limit": limit}
    previous = None
    for budget in budgets_between(layers, bw):
        r = search(layers, bw, budget, **kwargs)
        assert r.mode == ("exhaustive" if limit is None else "heuristic")
        again = predict(layers, r.choices, bw)
        assert again == r.prediction
        assert r.prediction.peak_bytes <= budget
        if previous is not None:
            assert r.prediction.step_ms <= previous
        previous = r.prediction.step_ms


@pytest.mark.parametrize("seed", [3, 4])
def test_exhaustive_is_the_optimum_and_heuristic_never_beats_it(seed):
    rng = random.Random(seed)
    layers = random_layers(rng, 5)
    bw = LinkBandwidth(30.0, 30.0)
    options = [allowed_choices(i, 5, 1) for i in range(5)]
    everything = {plan: predict(layers, plan, bw) for plan in itertools.product(*options)}
    for budget in budgets_between(layers, bw, count=10):
        exact = search(layers, bw, budget)
        fits = [(plan_key(pl, p), pl) for pl, p in everything.items() if p.peak_bytes <= budget]
        assert exact.choices == min(fits)[1]
        heuristic = search(layers, bw, budget, exhaustive_limit=0)
        assert heuristic.prediction.step_ms >= exact.prediction.step_ms


def test_never_slower_than_offload_only_or_recompute_only_for_the_same_budget():
    rng = random.Random(5)
    layers = random_layers(rng, 12)  # heuristic mode
    bw = LinkBandwidth(60.0, 60.0)
    families = []
    for k in range(13):
        families.append(tuple("recompute" if i < k else "keep" for i in range(12)))
    for k in range(11):
        families.append(tuple("offload" if i < k else "keep" for i in range(12)))
    for budget in budgets_between(layers, bw, count=8):
        r = search(layers, bw, budget)
        assert r.mode == "heuristic"
        for plan in families:
            p = predict(layers, plan, bw)
            if p.peak_bytes <= budget:
                assert r.prediction.step_ms <= p.step_ms


def test_deterministic_for_the_same_measurements():
    rng = random.Random(6)
    layers = random_layers(rng, 6)
    bw = LinkBandwidth(40.0, 40.0)
    budget = budgets_between(layers, bw)[8]
    first = search(layers, bw, budget)
    for _ in range(2):
        assert search(list(layers), LinkBandwidth(40.0, 40.0), budget) == first


def test_plan_key_is_a_total_order_on_plans():
    layers = [LayerMeasurement(1.0, 2.0, GB, GB // 10)] * 4
    bw = LinkBandwidth(1000.0, 1000.0)
    cands, _ = candidate_plans(layers, bw)
    keys = [plan_key(pl, p) for pl, p in cands.items()]
    assert len(set(keys)) == len(keys)


def test_ties_prefer_less_intrusive_then_lower_peak_then_earlier_layers():
    same = [LayerMeasurement(10.0, 20.0, GB, GB // 10)] * 4
    fast = LinkBandwidth(10_000.0, 10_000.0)  # every copy hides: offload costs nothing
    # one layer must give up its bytes; offload (rank 1) ties with recompute_offload in time only if
    # both hide, but offload is less intrusive; layers 0 and 1 tie, the earlier one wins.
    r = search(same, fast, 3 * GB + GB // 2)
    assert r.choices == ("offload", "keep", "keep", "keep")
    slow = LinkBandwidth(1.0, 1.0)  # copies never pay off: recompute layer 0 (ties with 1 and 2)
    r = search(same, slow, 3 * GB + GB // 2)
    assert r.choices == ("recompute", "keep", "keep", "keep")
    # a budget that the keep-all plan meets keeps everything (no free copy is added)
    assert search(same, fast, 4 * GB).choices == ("keep",) * 4


def test_offload_only_where_it_hides_or_beats_recompute():
    layers = [LayerMeasurement(5.0, 10.0, GB, GB // 50)] * 6
    # 1 GB at 10 GB/s = 100 ms of copy vs 5 ms of recompute: never offload whole layers
    slow = search(layers, LinkBandwidth(10.0, 10.0), 4 * GB)
    assert "offload" not in slow.choices
    # 1 GB at 400 GB/s = 2.5 ms, hidden behind the next layer's 5 ms forward: offload beats recompute
    fast = search(layers, LinkBandwidth(400.0, 400.0), 4 * GB)
    assert "offload" in fast.choices and "recompute" not in fast.choices
    assert fast.prediction.step_ms == pytest.approx(90.0)


def test_infeasible_budget_names_the_smallest_feasible_budget():
    rng = random.Random(7)
    layers = random_layers(rng, 5)
    bw = LinkBandwidth(20.0, 20.0)
    with pytest.raises(ValueError, match="cannot be met; the smallest feasible budget is") as info:
        search(layers, bw, 1000)
    smallest = int(re.search(r"smallest feasible budget is (\d+) bytes", str(info.value)).group(1))
    assert search(layers, bw, smallest).prediction.peak_bytes == smallest
    with pytest.raises(ValueError, match=f"smallest feasible budget is {smallest} bytes"):
        search(layers, bw, smallest - 1)
    options = [allowed_choices(i, 5, 1) for i in range(5)]
    assert smallest == min(predict(layers, pl, bw).peak_bytes for pl in itertools.product(*options))


@pytest.mark.parametrize(
    "budget, error, match",
    [(-1, ValueError, "memory_budget must be >= 0"), ("4GB", TypeError, "memory_budget must be a number")],
)
def test_bad_budget(budget, error, match):
    with pytest.raises(error, match=match):
        search([LayerMeasurement(1.0, 1.0, 1, 1)], LinkBandwidth(1.0, 1.0), budget)


def test_no_layers():
    with pytest.raises(ValueError, match="no layers to plan"):
        search([], LinkBandwidth(1.0, 1.0), 10)



def test_heuristic_scales_to_deep_models():
    rng = random.Random(8)
    layers = random_layers(rng, 40)
    bw = LinkBandwidth(50.0, 50.0)
    keep = predict(layers, ["keep"] * 40, bw).peak_bytes
    steps = []
    for budget in (keep // 4, keep // 2, keep):
        r = search(layers, bw, budget)
        assert r.mode == "heuristic" and r.prediction.peak_bytes <= budget
        steps.append(r.prediction.step_ms)
    assert steps == sorted(steps, reverse=True)
