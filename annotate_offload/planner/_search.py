"""The planner's search: the fastest predicted plan whose predicted peak fits a memory budget.

Note [Planner search]
    The search never looks at the budget while it builds plans. It first builds a fixed set of candidate
    plans from the measurements alone, predicts each one (:func:`~._cost_model.predict`), and only then
    keeps those whose predicted peak is ``<= memory_budget`` and returns the best by :func:`plan_key`.

    * Exhaustive: when the number of allowed plans (4 choices per offloadable layer, 2 for the last
      ``release_lag + 1`` layers) is at most ``exhaustive_limit``, the candidate set is every plan, so the
      result is the exact optimum of the cost model (an 8-layer model with ``release_lag=1`` has 16384).
    * Heuristic (larger models): the union of (a) the all-keep plan and the one-knob families the
      runtime and checkpointing offer on their own -- recompute the first ``n`` layers, offload the first
      ``n`` offloadable layers (the TransformerEngine schedule), offload the first ``n`` and recompute the
      next ``m`` layers, recompute every layer and offload the first ``n`` checkpoint inputs -- and (b) a
      greedy path from all-keep that repeatedly applies the one-layer change with the least predicted
      time added per byte of peak removed (re-predicted lazily), until no single change lowers the peak.

    Monotone in the budget (a larger budget never predicts a slower step): the candidate set ``C`` does
    not depend on the budget, so for ``B1 <= B2`` the feasible sets satisfy ``{c in C: peak(c) <= B1}
    ⊆ {c in C: peak(c) <= B2}``, and the minimum predicted time over a superset is never larger.
    For the same reason the planned step is never predicted slower than offload-only or recompute-only
    for the same budget: both families are in ``C``.

    Deterministic: candidates and predictions depend only on the measurements, and ties are broken by
    :func:`plan_key`: least predicted step time (compared at 1 ns, so summation-order noise cannot
    decide), then the least intrusive plan (sum of ranks keep 0, offload 1, recompute 2,
    recompute_offload 3: no copy or recompute that buys no time), then lower predicted peak, then the
    plan whose changes sit on earlier layers (compared layer by layer from layer 0, a higher rank first;
    TransformerEngine offloads the first layers too).

    The smallest feasible budget reported for an infeasible budget is the least predicted peak over
    ``C`` (the exact minimum over all plans in exhaustive mode).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import math
from dataclasses import dataclass
from typing import Sequence

from ._cost_model import CHOICES, LayerMeasurement, LinkBandwidth, Prediction, _validate, allowed_choices, predict

__all__ = ["SearchResult", "plan_key", "candidate_plans", "search", "format_bytes"]

_RANK = {c: r for r, c in enumerate(CHOICES)}
#: Plans enumerated exhaustively up to this many; above it the heuristic candidate set is used.
EXHAUSTIVE_LIMIT = 1 << 15



def format_bytes(n: float) -> str:
    """``n`` bytes as ``"1.50 GiB (1610612736 bytes)"``, in the largest binary unit that keeps the
    value >= 1 (``"2.27 MiB (2375680 bytes)"``)."""
    return f"{_in_unit(n)} ({int(n)} bytes)"


def _in_unit(n: float) -> str:
    for unit, size in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{int(n)} B"


def plan_key(choices: Sequence[str], prediction: Prediction) -> tuple:
    """Sort key of a plan: smaller is better (see Note [Planner search] for the order)."""
    ranks = [_RANK[c] for c in choices]
    return (round(prediction.step_ms, 6), sum(ranks), prediction.peak_bytes, tuple(-r for r in ranks))


@dataclass(frozen=True)
class SearchResult:
    """What :func:`search` returns.

    Attributes:
        choices (tuple[str, ...]): per layer, one of ``CHOICES``.
        prediction (Prediction): the chosen plan's prediction.
        mode (str): ``"exhaustive"`` or ``"heuristic"``.
        candidates (int): how many distinct plans were predicted.
    """

    choices: tuple[str, ...]
    prediction: Prediction
    mode: str
    candidates: int


def _families(n: int, release_lag: int) -> list[tuple[str, ...]]:
    offloadable = [i for i in range(n) if "offload" in allowed_choices(i, n, release_lag)]
    plans: list[tuple[str, ...]] = []
    for k in range(n + 1):  # recompute-only: the first k layers
        plans.append(tuple("recompute" if i < k else "keep" for i in range(n)))
    for k in range(len(offloadable) + 1):  # recompute everything, offload the first k checkpoint inputs
        chosen = set(offloadable[:k])
        plans.append(tuple("recompute_offload" if i in chosen else "recompute" for i in range(n)))
    for k in range(len(offloadable) + 1):  # offload the first k offloadable layers, recompute the next m
        chosen = set(offloadable[:k])
        rest = [i for i in range(n) if i not in chosen]
        for m in range(len(rest) + 1):
            recomputed = set(rest[:m])
            plans.append(
                tuple("offload" if i in chosen else "recompute" if i in recomputed else "keep" for i in range(n))
            )
    return plans


def _greedy_path(layers, bandwidth, release_lag, prefetch_layers, cache) -> None:
    """Add to ``cache`` the plans of a greedy path from all-keep (Note [Planner search], heuristic mode).

    Each step applies the one-layer change with the least predicted time added per byte of peak
    removed. Changes wait in a heap and are re-predicted lazily (only when they reach the top), so a
    step costs a few predictions instead of ``3 L``; when the heap runs dry a full scan confirms that
    no single change lowers the peak any more.
    """
    n = len(layers)
    state = {"plan": tuple("keep" for _ in range(n))}
    state["pred"] = _predict_cached(state["plan"], layers, bandwidth, release_lag, prefetch_layers, cache)

    def score(i: int, c: str):
        current, current_pred = state["plan"], state["pred"]
        plan = current[:i] + (c,) + current[i + 1 :]
        pred = _predict_cached(plan, layers, bandwidth, release_lag, prefetch_layers, cache)
        saved = current_pred.peak_bytes - pred.peak_bytes
        if saved <= 0:
            return None
        return ((pred.step_ms - current_pred.step_ms) / saved, plan_key(plan, pred)), plan, pred

    def entries(indices) -> list:
        out = []
        for i in indices:
            for c in allowed_choices(i, n, release_lag):
                if c != state["plan"][i] and (scored := score(i, c)) is not None:
                    out.append((scored[0], i, c))
        return out

    heap = entries(range(n))
    heapq.heapify(heap)
    while True:
        best = None
        while heap:
            _, i, c = heapq.heappop(heap)
            if state["plan"][i] == c:
                continue
            fresh = score(i, c)
            if fresh is None:
                continue
            if not heap or fresh[0] <= heap[0][0]:
                best = (fresh, i)
                break
            heapq.heappush(heap, (fresh[0], i, c))
        if best is None:
            heap = entries(range(n))  # full scan: does any single change still lower the peak?
            if not heap:
                return
            heapq.heapify(heap)
            continue
        (_, state["plan"], state["pred"]), changed = best
        for entry in entries([changed]):  # the changed layer's other choices, scored from its new choice
            heapq.heappush(heap, entry)


def _predict_cached(plan, layers, bandwidth, release_lag, prefetch_layers, cache) -> Prediction:
    pred = cache.get(plan)
    if pred is None:
        pred = predict(layers, plan, bandwidth, release_lag=release_lag, prefetch_layers=prefetch_layers, _validated=True)
        cache[plan] = pred
    return pred


def candidate_plans(
    layers: Sequence[LayerMeasurement],
    bandwidth: LinkBandwidth,
    *,
    release_lag: int = 1,
    prefetch_layers: int = 1,
    exhaustive_limit: int = EXHAUSTIVE_LIMIT,
) -> tuple[dict[tuple[str, ...], Prediction], str]:
    """Every candidate plan with its prediction, independent of any budget (Note [Planner search]).

    Returns:
        (dict, str): plan -> prediction (a fresh dict), and the mode (``"exhaustive"`` or ``"heuristic"``).
    """
    _validate(layers, ("keep",) * len(layers), release_lag, prefetch_layers)
    items, mode = _candidates(tuple(layers), bandwidth, release_lag, prefetch_layers, exhaustive_limit)
    return dict(items), mode


@functools.lru_cache(maxsize=8)
def _candidates(layers, bandwidth, release_lag, prefetch_layers, exhaustive_limit):
    # Cached on the (frozen, hashable) measurements: planning several budgets for one model is cheap.
    n = len(layers)
    options = [allowed_choices(i, n, release_lag) for i in range(n)]
    cache: dict[tuple[str, ...], Prediction] = {}
    if math.prod(len(o) for o in options) <= exhaustive_limit:
        for plan in itertools.product(*options):
            _predict_cached(plan, layers, bandwidth, release_lag, prefetch_layers, cache)
        return tuple(cache.items()), "exhaustive"
    for plan in _families(n, release_lag):
        _predict_cached(plan, layers, bandwidth, release_lag, prefetch_layers, cache)
    _greedy_path(layers, bandwidth, release_lag, prefetch_layers, cache)
    return tuple(cache.items()), "heuristic"


def search(
    layers: Sequence[LayerMeasurement],
    bandwidth: LinkBandwidth,
    memory_budget: int,
    *,
    release_lag: int = 1,
    prefetch_layers: int = 1,
    exhaustive_limit: int = EXHAUSTIVE_LIMIT,
) -> SearchResult:
    """The fastest predicted plan whose predicted peak is at most ``memory_budget`` bytes.

    Args:
        layers (Sequence[LayerMeasurement]): per layer, in forward order (at least one).
        bandwidth (LinkBandwidth): the host link.
        memory_budget (int): bytes of saved activations the GPU may hold at once.
        release_lag (int), prefetch_layers (int): the runtime schedule (see :func:`predict`).
        exhaustive_limit (int): enumerate every plan when there are at most this many.

    Returns:
        SearchResult: the chosen plan (see Note [Planner search] for ties and monotonicity).

    Raises:
        ValueError: no layers, a negative or non-integer budget, or a budget below every candidate's
            predicted peak (the message gives the smallest feasible budget).
    """
    if not layers:
        raise ValueError("plan_offload: no layers to plan; pass layers= with the model's repeated blocks.")
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)) or not math.isfinite(memory_budget):
        raise TypeError(f"plan_offload: memory_budget must be a number of bytes, got {memory_budget!r}.")
    if memory_budget < 0:
        raise ValueError(f"plan_offload: memory_budget must be >= 0 bytes, got {memory_budget!r}.")
    cache, mode = candidate_plans(
        layers, bandwidth, release_lag=release_lag, prefetch_layers=prefetch_layers, exhaustive_limit=exhaustive_limit
    )
    best = None
    smallest = None
    for plan, pred in cache.items():
        if smallest is None or (pred.peak_bytes, plan_key(plan, pred)) < (smallest[1].peak_bytes, plan_key(*smallest)):
            smallest = (plan, pred)
        if pred.peak_bytes <= memory_budget and (best is None or plan_key(plan, pred) < plan_key(*best)):
            best = (plan, pred)
    if best is None:
        plan, pred = smallest
        raise ValueError(
            f"plan_offload: memory_budget={int(memory_budget)} bytes ({_in_unit(memory_budget)}) cannot be "
            f"met; the smallest feasible budget is {pred.peak_bytes} bytes ({_in_unit(pred.peak_bytes)}), predicted "
            f"for plan {list(plan)} at {pred.step_ms:.2f} ms. Pass memory_budget >= {pred.peak_bytes}, or shrink the "
            "batch or sequence."
        )
    return SearchResult(choices=best[0], prediction=best[1], mode=mode, candidates=len(cache))
