"""The planner's search: the fastest predicted plan whose predicted peak fits a memory budget.

Note [Planner search]
    A plan is per-layer choices, a schedule ``(release_lag, prefetch_layers)`` from :data:`SCHEDULES`
    and an optimizer split. The search never looks at the budget while it builds candidates: it builds
    a fixed set of (schedule, choices) from the measurements alone and simulates each one without the
    optimizer (:func:`~._cost_model.simulate`). Only then, per candidate, it takes the fewest leading
    parameters to the host whose Adam state closes the gap to the budget (the Adam state is on the
    device for the whole step, so it shifts every phase's memory by the same bytes, and the optimizer's
    time adds to the step: with the host slower than the device per element, fewer is faster), drops
    the candidates that cannot fit even with all of it on the host, and returns the best by :func:`plan_key`.

    * Exhaustive: when the number of allowed (schedule, choices) pairs (6 choices per offloadable layer,
      3 for the last ``release_lag + 1`` layers) is at most ``exhaustive_limit``, the candidates are all
      of them, so the result is the exact optimum of the cost model over choices, schedules and splits.
    * Heuristic (larger models), per schedule: the all-keep plan and the one-knob families (recompute
      the first ``n`` layers; recompute and offload the inputs of the first ``n``; offload the first
      ``n``, TransformerEngine's choice; recompute every layer and offload the first ``n`` inputs, or
      recompute the first ``n`` of them selectively; recompute every layer selectively and offload what
      the first ``n`` keep), and
      a greedy path from all-keep that repeatedly applies the one-layer change with the least predicted
      time added per byte of peak removed, until no single change lowers the peak.
    * ``plans=`` (the single strategies a user could pick: full recompute, offload-only): only those.

    Monotone in the budget (a larger budget never predicts a slower step): the candidates do not
    depend on the budget, each candidate's split for a larger budget moves no more parameters, so the
    feasible set grows with the budget and the minimum over a superset is never larger. For the same
    reason the plan is never predicted slower than the single strategies at the same budget: their
    plans are candidates too.

    Deterministic: ties are broken by :func:`plan_key`: least predicted step time (compared at 1 ns),
    then the least intrusive choices (sum of ranks keep 0, offload 1, recompute 2, recompute_offload 3,
    selective 4, selective_offload 5),
    then fewer parameters on the host, lower predicted peak, the smaller schedule, and the plan whose
    changes sit on earlier layers.

    The smallest feasible budget (given when a budget cannot be met) is the least predicted peak over
    the candidates with the whole optimizer state on the host.

    A given ``offload_fraction`` (the optimizer the user already has) fixes the split: the search then
    chooses only the layers' choices and the schedule, and the smallest budget is for that split.
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
import statistics
from dataclasses import dataclass
from typing import Sequence

from ._cost_model import (CHOICES, OFFLOADED, ON_DEVICE, LayerMeasurement, LinkBandwidth, Prediction,
                          StepMeasurement, allowed_choices, simulate, validate, with_optimizer)

__all__ = ["SCHEDULES", "SearchResult", "Infeasible", "plan_key", "search", "choose_schedule"]

_RANK = {c: r for r, c in enumerate(CHOICES)}
#: The schedules searched: ``(release_lag, prefetch_layers)``.
SCHEDULES: tuple[tuple[int, int], ...] = tuple((k, p) for k in range(5) for p in range(1, 4))
#: (schedule, choices) pairs enumerated exhaustively up to this many; above it the heuristic set is used.
EXHAUSTIVE_LIMIT = 1 << 15


def plan_key(choices: Sequence[str], schedule: tuple, host_tensors: int, prediction: Prediction) -> tuple:
    """Sort key of a plan: smaller is better (see Note [Planner search] for the order)."""
    ranks = [_RANK[c] for c in choices]
    return (round(prediction.step_ms, 6), sum(ranks), host_tensors, prediction.peak_bytes, schedule,
            tuple(-r for r in ranks))


@dataclass(frozen=True)
class SearchResult:
    """What :func:`search` returns.

    Attributes:
        choices (tuple[str, ...]): per layer, one of ``CHOICES``.
        release_lag (int), prefetch_layers (int): the schedule.
        host_tensors (int): leading trainable parameters stepped on the host.
        prediction (Prediction): the chosen plan's prediction.
        mode (str): ``"exhaustive"``, ``"heuristic"`` or ``"given plans"``.
        candidates (int): how many (schedule, choices) pairs were simulated.
        smallest_budget (int): the least predicted peak of any candidate (every parameter on the host).
    """

    choices: tuple
    release_lag: int
    prefetch_layers: int
    host_tensors: int
    prediction: Prediction
    mode: str
    candidates: int
    smallest_budget: int


class Infeasible(ValueError):
    """No candidate fits the budget; ``smallest`` is the smallest feasible budget, bytes."""

    def __init__(self, smallest: int) -> None:
        super().__init__(smallest)
        self.smallest = smallest


def _allowed(i: int, n: int, k: int, keep: frozenset) -> tuple[str, ...]:
    """:func:`~._cost_model.allowed_choices`, without the copies for the layers in ``keep``."""
    return ON_DEVICE if i in keep else allowed_choices(i, n, k)


def _families(n: int, k: int, keep: frozenset) -> list[tuple]:
    offloadable = [i for i in range(n) if "offload" in _allowed(i, n, k, keep)]
    plans = [tuple("recompute" if i < m else "keep" for i in range(n)) for m in range(n + 1)]
    plans += [tuple("selective" if i < m else "recompute" for i in range(n)) for m in range(n + 1)]
    for m in range(len(offloadable) + 1):
        first = set(offloadable[:m])
        plans.append(tuple("recompute_offload" if i in first else "keep" for i in range(n)))
        plans.append(tuple("offload" if i in first else "keep" for i in range(n)))
        plans.append(tuple("recompute_offload" if i in first else "recompute" for i in range(n)))
        plans.append(tuple("selective_offload" if i in first else "selective" for i in range(n)))
    return plans


def _greedy_path(n: int, k: int, keep: frozenset, sim) -> list[tuple]:
    """The plans of a greedy path from all-keep (Note [Planner search], heuristic mode).

    Changes wait in a heap and are re-simulated lazily (only when they reach the top); when the heap
    runs dry a full scan confirms that no single change lowers the peak any more.
    """
    plan = ("keep",) * n
    path = [plan]

    def score(i: int, c: str):
        new = plan[:i] + (c,) + plan[i + 1:]
        (t0, peak0), (t1, peak1) = sim(plan)[:2], sim(new)[:2]
        return None if peak1 >= peak0 else ((t1 - t0) / (peak0 - peak1), tuple(_RANK[x] for x in new))

    def entries(indices) -> list:
        return [(s, i, c) for i in indices for c in _allowed(i, n, k, keep)
                if c != plan[i] and (s := score(i, c)) is not None]

    heap = entries(range(n))
    heapq.heapify(heap)
    while True:
        best = None
        while heap:
            _, i, c = heapq.heappop(heap)
            fresh = None if plan[i] == c else score(i, c)
            if fresh is None:
                continue
            if not heap or fresh <= heap[0][0]:
                best = (i, c)
                break
            heapq.heappush(heap, (fresh, i, c))
        if best is None:
            heap = entries(range(n))  # full scan: does any single change still lower the peak?
            if not heap:
                return path
            heapq.heapify(heap)
            continue
        i, c = best
        plan = plan[:i] + (c,) + plan[i + 1:]
        path.append(plan)
        for entry in entries([i]):  # the changed layer's other choices, scored from its new choice
            heapq.heappush(heap, entry)


@functools.lru_cache(maxsize=16)
def _candidates(layers, bandwidth, step, schedules, plans, keep, exhaustive_limit):
    # Cached on the (frozen, hashable) measurements: planning several budgets for one model is cheap.
    n = len(layers)
    out: dict[tuple, tuple] = {}

    def add(schedule, plan):
        if schedule != schedules[0] and not any(c in OFFLOADED for c in plan):
            schedule = schedules[0]  # the schedule of a plan without copies does not matter
        if (schedule, plan) not in out:
            out[(schedule, plan)] = simulate(layers, plan, bandwidth, step, *schedule)
        return out[(schedule, plan)]

    options = {s: [_allowed(i, n, s[0], keep) for i in range(n)] for s in schedules}
    if plans is not None:
        for s, plan in itertools.product(schedules, plans):
            if all(c in options[s][i] for i, c in enumerate(plan)):
                add(s, plan)
        return out, "given plans"
    if sum(math.prod(len(o) for o in opts) for opts in options.values()) <= exhaustive_limit:
        for s in schedules:
            for plan in itertools.product(*options[s]):
                add(s, plan)
        return out, "exhaustive"
    for s in schedules:
        for plan in _families(n, s[0], keep) + _greedy_path(n, s[0], keep, lambda pl, s=s: add(s, pl)):
            add(s, plan)
    return out, "heuristic"


def search(
    layers: Sequence[LayerMeasurement],
    bandwidth: LinkBandwidth,
    memory_budget: int,
    step: StepMeasurement | None = None,
    *,
    schedules: Sequence[tuple[int, int]] = SCHEDULES,
    host_optimizer: bool = True,
    plans: Sequence[Sequence[str]] | None = None,
    keep: Sequence[int] = (),
    exhaustive_limit: int = EXHAUSTIVE_LIMIT,
    offload_fraction: float | None = None,
) -> SearchResult:
    """The fastest predicted plan whose predicted peak is at most ``memory_budget`` bytes.

    Args:
        layers (Sequence[LayerMeasurement]): per layer, in forward order (at least one).
        bandwidth (LinkBandwidth): the host link.
        memory_budget (int): peak device memory allowed, bytes.
        step (StepMeasurement | None): the rest of the step. Default: ``None`` (layers only).
        schedules (Sequence[tuple[int, int]]): the ``(release_lag, prefetch_layers)`` to try.
            Default: :data:`SCHEDULES`.
        host_optimizer (bool): the optimizer may step parameters on the host. Default: ``True``.
        plans (Sequence[Sequence[str]] | None): consider only these choices. Default: ``None``.
        keep (Sequence[int]): layers that are never offloaded (kept or recomputed). Default: ``()``.
        exhaustive_limit (int): enumerate every plan when there are at most this many.
        offload_fraction (float | None): the optimizer's fixed split; ``None``: chosen. Default: ``None``.

    Returns:
        SearchResult: the chosen plan (see Note [Planner search] for ties and monotonicity).

    Raises:
        Infeasible: a budget below every candidate's predicted peak (a ``ValueError`` carrying the
            smallest feasible budget).
    """
    step = StepMeasurement() if step is None else step
    layers = tuple(layers)
    for plan in plans or ():
        validate(layers, plan, 0, 1)
    found, mode = _candidates(layers, bandwidth, step, tuple(schedules), None if plans is None else
                              tuple(tuple(p) for p in plans), frozenset(keep), exhaustive_limit)
    all_host = len(step.param_numels) if host_optimizer else 0
    total_state = sum(step.param_state_bytes)
    faster_on_host = step.host_ms < step.device_ms
    best, smallest = None, math.inf
    most = all_host if offload_fraction is None else step.host_tensors(offload_fraction)
    for (schedule, plan), sim in found.items():
        smallest = min(smallest, sim[1] + step.optimizer(most)[0])
        m = step.fewest_host_tensors(sim[1] + total_state - memory_budget)
        if m is None or m > most:
            continue
        m = most if faster_on_host or offload_fraction is not None else m
        pred = with_optimizer(sim, step, m)
        key = plan_key(plan, schedule, m, pred)
        if best is None or key < best[0]:
            best = (key, schedule, plan, m, pred)
    if best is None:
        raise Infeasible(int(smallest))
    _, (k, p), plan, m, pred = best
    return SearchResult(plan, k, p, m, pred, mode, len(found), int(smallest))


def choose_schedule(forward_ms: Sequence[float], moved: dict[int, int], bandwidth: LinkBandwidth,
                    max_gap: int) -> tuple[int, int]:
    """``(release_lag, prefetch_layers)`` for a fixed set of offloaded layers (Note [Default schedule from
    the link] in ``annotate/_transform.py``): the fastest by :func:`~._cost_model.simulate`, each up to
    ``max_gap``, with every layer's forward the median of ``forward_ms`` and its backward twice that;
    the smallest schedule on ties (within 1 us).

    Args:
        forward_ms (Sequence[float]): per layer, its forward time, ms.
        moved (dict[int, int]): per offloaded layer, the bytes it copies.
        bandwidth (LinkBandwidth): the host link.
        max_gap (int): the largest ``release_lag`` and ``prefetch_layers`` to consider (>= 1).
    """
    f = statistics.median(forward_ms)
    layers = tuple(LayerMeasurement(f, 2 * f, moved.get(i, 0), 0) for i in range(len(forward_ms)))
    plan = tuple("offload" if i in moved else "keep" for i in range(len(forward_ms)))
    step = StepMeasurement()
    options = [(k, p) for k in range(max_gap + 1) for p in range(1, max_gap + 1)]
    return min(options, key=lambda s: (round(simulate(layers, plan, bandwidth, step, *s)[0], 3), sum(s), s))
