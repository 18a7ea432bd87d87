"""``plan_offload``: measure, search, and explain a per-layer keep/offload/recompute plan."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from torch import nn

from ._cost_model import LayerMeasurement, LinkBandwidth, Prediction, allowed_choices, check_schedule, predict
from ._bandwidth import measure_bandwidth
from ._measure import measure_layers
from ._search import search

__all__ = ["PlannerResult", "plan_offload"]


def _gib(n: float) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1 (KiB at least)."""
    for unit, shift in (("GiB", 30), ("MiB", 20)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n / 1024:.2f} KiB"


@dataclass(frozen=True)
class PlannerResult:
    """A plan: per layer keep, offload, recompute or recompute_offload, with its predicted cost.

    Apply it with ``torch.utils.checkpoint`` around the layers in :attr:`recomputed_layers` and the runtime
    for :attr:`offloaded_layers` (``DefaultOffloadSynchronizer(**result.runtime_kwargs())``, whose schedule
    the prediction assumes).

    Attributes:
        choices (tuple[str, ...]): per layer (forward order), one of ``"keep"``, ``"offload"``,
            ``"recompute"``, ``"recompute_offload"``.
        reasons (tuple[str, ...]): per layer, why (what the choice costs and what each alternative would).
        predicted_step_ms (float): predicted forward plus backward time of the layers, ms.
        predicted_peak_bytes (int): predicted peak of saved-activation bytes on the GPU.
        memory_budget (int): the budget planned for, bytes.
        baseline_step_ms (float): predicted time with every layer kept, ms.
        baseline_peak_bytes (int): predicted peak with every layer kept, bytes.
        layer_names (tuple[str, ...]): per layer, its qualified name (``""`` if unknown).
        measurements (tuple[LayerMeasurement, ...]): what the plan was computed from.
        bandwidth (LinkBandwidth): the host link it assumed.
        release_lag (int): runtime schedule: an offloaded layer ``i`` is released at the entry of ``i+1+k``.
        prefetch_layers (int): runtime schedule: layer ``i`` is reloaded when backward enters ``i+p``.
        search_mode (str): ``"exhaustive"`` (exact optimum of the cost model) or ``"heuristic"``.
    """

    choices: tuple[str, ...]
    reasons: tuple[str, ...]
    predicted_step_ms: float
    predicted_peak_bytes: int
    memory_budget: int
    baseline_step_ms: float
    baseline_peak_bytes: int
    layer_names: tuple[str, ...]
    measurements: tuple[LayerMeasurement, ...]
    bandwidth: LinkBandwidth
    release_lag: int
    prefetch_layers: int
    search_mode: str

    @property
    def offloaded_layers(self) -> tuple[int, ...]:
        """Indices whose saved tensors go through the runtime's offload (``offload``, ``recompute_offload``)."""
        return tuple(i for i, c in enumerate(self.choices) if c in ("offload", "recompute_offload"))

    @property
    def recomputed_layers(self) -> tuple[int, ...]:
        """Indices to wrap in ``torch.utils.checkpoint`` (``recompute``, ``recompute_offload``)."""
        return tuple(i for i, c in enumerate(self.choices) if c in ("recompute", "recompute_offload"))

    def runtime_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``DefaultOffloadSynchronizer`` that realise the schedule predicted here."""
        return {
            "num_layers": len(self.choices),
            "offloaded_layers": self.offloaded_layers,
            "release_lag": self.release_lag,
            "prefetch_layers": self.prefetch_layers,
        }

    def __str__(self) -> str:
        slower = (self.predicted_step_ms / self.baseline_step_ms - 1) * 100 if self.baseline_step_ms else 0.0
        lines = [
            f"Offload plan ({self.search_mode} search, {len(self.choices)} layers, link D2H "
            f"{self.bandwidth.d2h_gbps:.1f} / H2D {self.bandwidth.h2d_gbps:.1f} GB/s, {self.bandwidth.source})",
            f"  predicted step time (layers fwd+bwd): {self.predicted_step_ms:.2f} ms "
            f"(keep-all {self.baseline_step_ms:.2f} ms, {slower:+.1f}%)",
            f"  predicted peak activation memory:     {_gib(self.predicted_peak_bytes)} "
            f"(budget {_gib(self.memory_budget)}, keep-all {_gib(self.baseline_peak_bytes)})",
            f"  schedule: release_lag={self.release_lag}, prefetch_layers={self.prefetch_layers}",
        ]
        width = max([len("layer")] + [len(f"{i} {n}".strip()) for i, n in enumerate(self.layer_names)])
        lines.append(f"  {'layer':<{width}}  {'choice':<17}  why")
        for i, (name, choice, reason) in enumerate(zip(self.layer_names, self.choices, self.reasons)):
            lines.append(f"  {f'{i} {name}'.strip():<{width}}  {choice:<17}  {reason}")
        return "\n".join(lines)


def _reasons(
    layers: Sequence[LayerMeasurement],
    choices: tuple[str, ...],
    base: Prediction,
    bandwidth: LinkBandwidth,
    budget: int,
    release_lag: int,
    prefetch_layers: int,
) -> tuple[str, ...]:
    reasons = []
    n = len(layers)
    for i, (m, c) in enumerate(zip(layers, choices)):
        if c == "keep":
            what = f"keeps {_gib(m.saved_bytes)} on GPU"
        elif c == "recompute":
            what = f"reruns forward (+{m.forward_ms:.2f} ms), holds its {_gib(m.checkpoint_input_bytes)} input"
        else:
            nbytes = m.moved_bytes(recompute=c != "offload")
            stall = base.d2h_stall_ms[i] + base.h2d_stall_ms[i]
            hidden = "hidden behind other layers' compute" if stall == 0 else f"stalls {stall:.2f} ms"
            what = (
                f"copies {_gib(nbytes)} out and back (D2H {bandwidth.d2h_ms(nbytes):.2f} ms, "
                f"H2D {bandwidth.h2d_ms(nbytes):.2f} ms, {hidden})"
            )
            if c == "recompute_offload":
                what = f"reruns forward (+{m.forward_ms:.2f} ms); " + what.replace("copies", "its input: copies", 1)
        alternatives = []
        for alt in allowed_choices(i, n, release_lag):
            if alt == c:
                continue
            swapped = choices[:i] + (alt,) + choices[i + 1 :]
            p = predict(layers, swapped, bandwidth, release_lag=release_lag, prefetch_layers=prefetch_layers)
            if p.peak_bytes > budget:
                alternatives.append(f"{alt}: over budget ({_gib(p.peak_bytes)})")
            else:
                delta = p.step_ms - base.step_ms
                alternatives.append(f"{alt}: {delta:+.2f} ms" + (" (tie, less preferred)" if abs(delta) < 1e-6 else ""))
        reasons.append(what + ("; vs " + ", ".join(alternatives) if alternatives else ""))
    return tuple(reasons)


def _check_budget(memory_budget: Any) -> int:
    if isinstance(memory_budget, bool) or not isinstance(memory_budget, (int, float)):
        raise TypeError(f"plan_offload: memory_budget must be a number of bytes, got {memory_budget!r}; pass e.g. 4 * 2**30.")
    if not math.isfinite(memory_budget):
        raise ValueError(
            f"plan_offload: memory_budget must be a finite number of bytes, got {memory_budget!r}; pass e.g. 4 * 2**30 "
            "(a budget larger than every layer's saved bytes keeps them all)."
        )
    if memory_budget < 0:
        raise ValueError(f"plan_offload: memory_budget must be >= 0 bytes, got {memory_budget!r}.")
    if isinstance(memory_budget, float) and not memory_budget.is_integer():  # 2.5 GiB meant, 2.5 bytes given
        raise ValueError(
            f"plan_offload: memory_budget is a number of bytes, got the fraction {memory_budget!r}; pass a whole "
            "number, e.g. 4 * 2**30 for 4 GiB (4e9 is accepted)."
        )
    return int(memory_budget)


def _model_device(model: nn.Module | None):
    if model is not None:
        for p in model.parameters():
            return p.device
    return None


def plan_offload(
    model: nn.Module | None,
    *,
    memory_budget: int,
    example_inputs: Any = None,
    layers: Sequence[nn.Module] | None = None,
    measurements: Sequence[LayerMeasurement] | None = None,
    bandwidth: LinkBandwidth | None = None,
    release_lag: int = 1,
    prefetch_layers: int = 1,
    min_offload_numel: int | None = None,
) -> PlannerResult:
    """Choose keep, offload, recompute or recompute_offload per layer to fit a memory budget, fastest.

    Measures each layer (:func:`measure_layers`) and the host link (:func:`measure_bandwidth`) unless
    given, predicts every candidate plan with the cost model (``_cost_model``: Notes [Planner time model]
    and [Planner memory model]) and returns the fastest one whose predicted peak fits (Note [Planner
    search]: deterministic, and a larger budget never predicts a slower step).

    Args:
        model (nn.Module | None): the model to plan; may be ``None`` when ``measurements`` is given.
        memory_budget (int): bytes of saved activations the GPU may hold at once.
        example_inputs: inputs of one training step (tensor, tuple/list, or dict of keyword inputs);
            required unless ``measurements`` is given.
        layers (Sequence[nn.Module] | None): the layers, in forward order; ``None`` discovers the
            repeated blocks (children of an ``nn.ModuleList``/``nn.Sequential`` sharing one class).
        measurements (Sequence[LayerMeasurement] | None): skip profiling and use these.
        bandwidth (LinkBandwidth | None): skip the link measurement and use this.
        release_lag (int): runtime schedule the plan assumes (see :func:`predict`). Default: ``1``.
        prefetch_layers (int): runtime schedule the plan assumes (see :func:`predict`). Default: ``1``.
        min_offload_numel (int | None): the runtime's threshold the plan assumes: saved tensors under
            it stay on the GPU in an offloaded layer. ``None``: the runtime's default, 262144 (256K
            elements, TransformerEngine's). Used when profiling (``measurements`` not given).

    Returns:
        PlannerResult: the plan; ``print(result)`` shows the predicted step time, peak and per-layer why.

    Raises:
        TypeError: a budget that is not a number, bad ``example_inputs`` or ``measurements``.
        ValueError: a negative budget; no ``example_inputs`` and no ``measurements``; ``layers`` and
            ``measurements`` of different lengths; a budget no plan meets (the message states the
            smallest feasible budget).

    Example::

        result = plan_offload(model, memory_budget=4 * 2**30, example_inputs=(x,))
        print(result)
        result.choices  # ('recompute', 'recompute', 'offload', ..., 'keep')
    """
    budget = _check_budget(memory_budget)
    check_schedule("plan_offload", release_lag, prefetch_layers)  # before any profiling
    if measurements is None:
        if example_inputs is None:
            raise ValueError(
                "plan_offload: example_inputs is None and measurements is None; pass example_inputs=(x,) at "
                "training shapes so the layers can be profiled."
            )
        if model is None:
            raise ValueError("plan_offload: model is None; pass the model, or measurements= to plan without one.")
        from annotate_offload.runtime._layer_state import DEFAULT_MIN_OFFLOAD_NUMEL

        threshold = DEFAULT_MIN_OFFLOAD_NUMEL if min_offload_numel is None else min_offload_numel
        measurements = measure_layers(model, layers, example_inputs, min_offload_numel=threshold)
    else:
        measurements = tuple(measurements)
        for i, m in enumerate(measurements):
            if not isinstance(m, LayerMeasurement):
                raise TypeError(
                    f"plan_offload: measurements[{i}] is a {type(m).__name__}, not a LayerMeasurement; pass the "
                    "result of measure_layers(...)."
                )
        if layers is not None and len(layers) != len(measurements):
            raise ValueError(
                f"plan_offload: {len(layers)} layers but {len(measurements)} measurements; give one per layer."
            )
    if bandwidth is None:
        bandwidth = measure_bandwidth(_model_device(model))
    elif not isinstance(bandwidth, LinkBandwidth):
        raise TypeError(f"plan_offload: bandwidth must be a LinkBandwidth, got {type(bandwidth).__name__}.")
    found = search(measurements, bandwidth, budget, release_lag=release_lag, prefetch_layers=prefetch_layers)
    keep_all = predict(measurements, ("keep",) * len(measurements), bandwidth, release_lag=release_lag,
                       prefetch_layers=prefetch_layers)
    reasons = _reasons(measurements, found.choices, found.prediction, bandwidth, budget, release_lag, prefetch_layers)
    return PlannerResult(
        choices=found.choices,
        reasons=reasons,
        predicted_step_ms=found.prediction.step_ms,
        predicted_peak_bytes=found.prediction.peak_bytes,
        memory_budget=budget,
        baseline_step_ms=keep_all.step_ms,
        baseline_peak_bytes=keep_all.peak_bytes,
        layer_names=tuple(m.name for m in measurements),
        measurements=measurements,
        bandwidth=bandwidth,
        release_lag=release_lag,
        prefetch_layers=prefetch_layers,
        search_mode=found.mode,
    )

