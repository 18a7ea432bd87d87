"""Search (Note [Planner search]): exact on small instances, within the budget, monotone, deterministic."""

import itertools
import random

import pytest

from annotate_offload.planner._cost_model import (LayerMeasurement, LinkBandwidth, StepMeasurement, allowed_choices,
                                                  predict, simulate, with_optimizer)
from annotate_offload.planner._search import SCHEDULES, Infeasible, choose_schedule, search

GB = 10**9


def random_layers(rng, n):
    out = []
    for _ in range(n):
        f, b, a, fp, bp = (rng.uniform(1, 20), rng.uniform(2, 40), rng.randint(GB // 4, 2 * GB),
                           rng.randint(GB // 4, 2 * GB), rng.randint(0, GB // 2))
        s = rng.randint(0, a)  # what a selective rerun keeps lowers its backward's peak by at most itself
        out.append(LayerMeasurement(
            forward_ms=f, backward_ms=b, saved_bytes=a, checkpoint_input_bytes=rng.randint(GB // 100, GB // 10),
            forward_peak_bytes=fp, backward_peak_bytes=bp, grad_bytes=rng.randint(0, GB // 2), selective_bytes=s,
            selective_ms=b + rng.uniform(0, f), selective_peak_bytes=max(fp, a + bp) - rng.randint(0, s),
        ))
    return tuple(out)


def random_step(rng, tensors=3):
    numels = tuple(rng.randint(10**7, 10**8) for _ in range(tensors))
    return StepMeasurement(static_bytes=rng.randint(GB, 4 * GB), other_grad_bytes=rng.randint(0, GB // 10),
                           other_ms=rng.uniform(0, 5), param_numels=numels,
                           param_state_bytes=tuple(8 * n for n in numels), device_ms=7.0, host_ms=230.0)


def brute_force(layers, bw, step, budget):
    """The least predicted step time over every schedule, choice and optimizer split that fits."""
    n, best = len(layers), None
    for k, p in SCHEDULES:
        for plan in itertools.product(*(allowed_choices(i, n, k) for i in range(n))):
            sim = simulate(layers, plan, bw, step, k, p)
            for m in range(len(step.param_numels) + 1):
                pred = with_optimizer(sim, step, m)
                if pred.peak_bytes <= budget and (best is None or pred.step_ms < best):
                    best = pred.step_ms
    return best


def budgets(layers, bw, step, count=8):
    keep = predict(layers, ["keep"] * len(layers), bw, step).peak_bytes
    try:
        search(layers, bw, 0, step)
    except Infeasible as e:
        low = e.smallest
    return sorted({low + (keep + GB - low) * i // count for i in range(count + 1)})


@pytest.mark.parametrize("seed, gbps", [(0, 10.0), (1, 50.0), (2, 400.0)])
def test_exhaustive_search_agrees_with_brute_force_and_fits(seed, gbps):
    rng = random.Random(seed)
    layers, step, bw = random_layers(rng, 4), random_step(rng), LinkBandwidth(gbps, gbps * 1.2)
    for budget in budgets(layers, bw, step):
        r = search(layers, bw, budget, step)
        assert r.mode == "exhaustive"
        assert r.prediction.step_ms == pytest.approx(brute_force(layers, bw, step, budget), abs=1e-6)
        again = predict(layers, r.choices, bw, step, release_lag=r.release_lag, prefetch_layers=r.prefetch_layers,
                        offload_fraction=r.prediction.offload_fraction)
        assert again == r.prediction and again.peak_bytes <= budget  # the prediction respects the budget


@pytest.mark.parametrize("seed", [3, 4])
@pytest.mark.parametrize("limit", [None, 0], ids=["exhaustive", "heuristic"])
def test_a_larger_budget_is_never_slower_and_the_heuristic_never_beats_the_optimum(seed, limit):
    rng = random.Random(seed)
    layers, step, bw = random_layers(rng, 5), random_step(rng), LinkBandwidth(30.0, 30.0)
    kwargs = {} if limit is None else {"exhaustive_limit": limit}
    previous = None
    for budget in budgets(layers, bw, step):
        r = search(layers, bw, budget, step, **kwargs)
        assert r.prediction.peak_bytes <= budget
        assert previous is None or r.prediction.step_ms <= previous
        previous = r.prediction.step_ms
        assert r.prediction.step_ms >= search(layers, bw, budget, step).prediction.step_ms - 1e-9


def test_never_slower_than_the_single_strategies_at_the_same_budget():
    rng = random.Random(5)
    layers, step, bw = random_layers(rng, 12), random_step(rng, 20), LinkBandwidth(60.0, 60.0)  # heuristic mode
    strategies = [("recompute",) * 12] + [tuple("offload" if i < n else "keep" for i in range(12)) for n in range(11)]
    for budget in budgets(layers, bw, step):
        r = search(layers, bw, budget, step)
        assert r.mode == "heuristic"
        try:
            single = search(layers, bw, budget, step, plans=strategies)
        except Infeasible:
            continue
        assert single.mode == "given plans" and r.prediction.step_ms <= single.prediction.step_ms


def test_the_gradients_slack_keeps_the_last_layers_at_full_recomputes_peak():
    layers = tuple(LayerMeasurement(10.0, 20.0, GB, GB // 10, grad_bytes=GB) for _ in range(6))
    bw = LinkBandwidth(1.0, 1.0)  # copies never pay off
    full = predict(layers, ["recompute"] * 6, bw)
    r = search(layers, bw, full.peak_bytes)
    # at layer 0's backward all later gradients exist; late layers have that room for their activations
    assert r.choices[-1] == "keep" and r.prediction.step_ms < full.step_ms


def test_the_optimizer_goes_to_the_host_only_as_far_as_needed():
    layers = tuple(LayerMeasurement(10.0, 20.0, GB, GB // 10) for _ in range(3))
    step = StepMeasurement(param_numels=(10**8,) * 4, param_state_bytes=(GB,) * 4, device_ms=7.0, host_ms=230.0)
    bw = LinkBandwidth(1.0, 1.0)
    least = search(layers, bw, 0 + 10**15, step)
    assert least.host_tensors == 0 and least.choices == ("keep",) * 3
    tight = search(layers, bw, predict(layers, ["recompute"] * 3, bw, step).peak_bytes - GB, step)
    assert tight.host_tensors == 1 and tight.prediction.offload_fraction == pytest.approx(0.125)
    with pytest.raises(Infeasible):
        search(layers, bw, tight.prediction.peak_bytes - 1, step, host_optimizer=False)


def test_infeasible_budgets_carry_the_smallest_feasible_budget():
    rng = random.Random(7)
    layers, step, bw = random_layers(rng, 4), random_step(rng), LinkBandwidth(20.0, 20.0)
    with pytest.raises(Infeasible) as info:
        search(layers, bw, 1000, step)
    smallest = info.value.smallest
    assert search(layers, bw, smallest, step).prediction.peak_bytes == smallest
    with pytest.raises(Infeasible):
        search(layers, bw, smallest - 1, step)


def test_deterministic_and_ties_prefer_the_least_intrusive_plan():
    same = tuple(LayerMeasurement(10.0, 20.0, GB, GB // 10) for _ in range(4))
    fast = LinkBandwidth(10_000.0, 10_000.0)  # every copy hides: offloading costs nothing
    keep = predict(same, ["keep"] * 4, fast).peak_bytes
    r = search(same, fast, keep - GB // 2)
    assert r.choices == ("offload", "keep", "keep", "keep") and (r.release_lag, r.prefetch_layers) == (0, 1)
    assert search(list(same), LinkBandwidth(10_000.0, 10_000.0), keep - GB // 2) == r
    slow = search(same, LinkBandwidth(1.0, 1.0), keep - GB // 2)  # copies never pay off: recompute layer 0
    assert slow.choices == ("recompute", "keep", "keep", "keep")
    assert search(same, fast, keep).choices == ("keep",) * 4  # a budget the model meets keeps everything


def test_declared_keep_layers_are_never_offloaded():
    same = tuple(LayerMeasurement(10.0, 20.0, GB, GB // 10) for _ in range(5))
    fast = LinkBandwidth(10_000.0, 10_000.0)
    budget = predict(same, ["keep"] * 5, fast).peak_bytes - GB
    assert search(same, fast, budget).choices[0] == "offload"
    r = search(same, fast, budget, keep=[0, 1])
    assert r.choices[:2] in {("keep", "keep"), ("keep", "recompute"), ("recompute", "keep")} and "offload" in r.choices


def test_heuristic_scales_to_deep_models():
    rng = random.Random(8)
    layers, step, bw = random_layers(rng, 40), random_step(rng, 100), LinkBandwidth(50.0, 50.0)
    keep = predict(layers, ["keep"] * 40, bw, step).peak_bytes
    steps = []
    for budget in (keep // 3, keep // 2, keep):
        r = search(layers, bw, budget, step)
        assert r.mode == "heuristic" and r.prediction.peak_bytes <= budget
        steps.append(r.prediction.step_ms)
    assert steps == sorted(steps, reverse=True)


def test_choose_schedule_overlaps_and_waits_longer_for_a_slow_link():
    fwd = [10.0] * 8
    moved = {i: GB for i in range(4)}
    assert choose_schedule(fwd, moved, LinkBandwidth(1000.0, 1000.0), 3) == (0, 1)  # copies hide in their layer
    k, p = choose_schedule(fwd, moved, LinkBandwidth(40.0, 40.0), 3)  # 25 ms copies: 3 forwards, 2 backwards
    assert (k, p) == (3, 2)
    assert choose_schedule(fwd, moved, LinkBandwidth(40.0, 40.0), 1) == (1, 1)  # capped at the gap
