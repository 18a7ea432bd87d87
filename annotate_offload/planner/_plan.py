"""``plan_offload``: measure, search and explain a plan for a total memory budget."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Sequence

from torch import nn

from annotate_offload.config import parse_memory_budget

from ._bandwidth import measure_bandwidth
from ._cost_model import (CHOICES, OFFLOADED, RECOMPUTED, LayerMeasurement, LinkBandwidth, Prediction,
                          StepMeasurement, check_schedule, predict)
from ._measure import measure
from ._search import SCHEDULES, Infeasible, search

__all__ = ["PlannerResult", "plan_offload", "format_bytes"]

_OPTIMIZERS = ("hybrid", "device", None)


def format_bytes(n: float, up: bool = False) -> str:
    """``n`` bytes in the largest binary unit that keeps it >= 1: ``"2.27 MiB"``, ``"512 B"``; ``up`` rounds
    up (``n`` an int), so that the text parsed as a size is at least ``n``."""
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if abs(n) >= 1 << shift:
            return f"{(-(-int(n) * 100 >> shift) / 100 if up else n / (1 << shift)):.2f} {unit}"
    return f"{int(n)} B"


@dataclass(frozen=True)
class PlannerResult:
    """A plan: per layer one of ``CHOICES``, a schedule and an optimizer split, with what it is predicted
    to cost (Notes [Planner time model], [Planner memory model]).

    Apply it with ``offload_transform(model, memory_budget=...)`` (which calls :func:`plan_offload`), or by
    hand: the runtime for :attr:`offloaded_layers` (``DefaultOffloadSynchronizer(**result.runtime_kwargs())``)
    with each layer's scope opened around its call, ``torch.utils.checkpoint`` inside that scope around
    :attr:`recomputed_layers`, and ``HybridDeviceOptimizer(model.parameters(), **result.optimizer_kwargs())``.
    Torch's ``create_selective_checkpoint_contexts`` with ``annotate_offload.annotate._layers.selective_policy``
    recomputes a ``selective`` layer as planned, but holds what it keeps on the device where no hook sees it,
    so a ``selective_offload`` layer applied that way holds more than predicted; ``offload_transform``
    offloads it (Note [Selective recompute]).

    Attributes:
        choices (tuple[str, ...]): per layer (forward order), one of ``"keep"``, ``"offload"``,
            ``"recompute"``, ``"recompute_offload"``, ``"selective"``, ``"selective_offload"``.
        release_lag (int), prefetch_layers (int): the runtime schedule the prediction assumes.
        offload_fraction (float): ``HybridDeviceOptimizer``'s share of parameters stepped on the host.
        prediction (Prediction): the plan's predicted step time, peak, and per layer time and peak.
        keep_all (Prediction): every layer kept and the optimizer on the device.
        memory_budget (int): the budget planned for: peak device memory of a step, bytes.
        measurements (tuple[LayerMeasurement, ...]), step (StepMeasurement), bandwidth (LinkBandwidth):
            what the plan was computed from.
        search_mode (str): ``"exhaustive"`` (exact optimum of the cost model) or ``"heuristic"``.
        fraction_given (bool): ``offload_fraction`` was given (the optimizer's), not chosen.
    """

    choices: tuple
    release_lag: int
    prefetch_layers: int
    offload_fraction: float
    prediction: Prediction
    keep_all: Prediction
    memory_budget: int
    measurements: tuple
    step: StepMeasurement
    bandwidth: LinkBandwidth
    search_mode: str
    fraction_given: bool = False

    @property
    def fits(self) -> bool:
        """Whether the model fits the budget as it is (then nothing is offloaded or recomputed)."""
        return self.keep_all.peak_bytes <= self.memory_budget

    @property
    def offloaded_layers(self) -> tuple[int, ...]:
        """Indices whose saved tensors go through the runtime's offload (``offload``, ``recompute_offload``,
        ``selective_offload``)."""
        return tuple(i for i, c in enumerate(self.choices) if c in OFFLOADED)

    @property
    def recomputed_layers(self) -> tuple[int, ...]:
        """Indices to wrap in ``torch.utils.checkpoint`` (every choice but ``keep`` and ``offload``)."""
        return tuple(i for i, c in enumerate(self.choices) if c in RECOMPUTED)

    def runtime_kwargs(self) -> dict[str, Any]:
        """Keyword arguments for ``DefaultOffloadSynchronizer`` that realise the schedule predicted here."""
        return {"num_layers": len(self.choices), "offloaded_layers": self.offloaded_layers,
                "release_lag": self.release_lag, "prefetch_layers": self.prefetch_layers}

    def optimizer_kwargs(self) -> dict[str, float]:
        """``{"offload_fraction": f}`` for ``HybridDeviceOptimizer(model.parameters(), **kwargs)`` (its exact
        mode, the default); ``0.0`` keeps the optimizer on the device (a plain fused AdamW does the same)."""
        return {"offload_fraction": self.offload_fraction}

    def summary(self) -> str:
        """Lines on the budget, the predicted step and peak, the schedule and the optimizer split."""
        p, k, b = self.prediction, self.keep_all, self.memory_budget
        if self.fits:  # with a given split, the plan is every layer kept at that split
            peak, where = ((p.peak_bytes, f"the optimizer's offload_fraction={self.offload_fraction:.3f}")
                           if self.fraction_given else (k.peak_bytes, "the optimizer on the device"))
            return (f"the model fits memory_budget={format_bytes(b)}: predicted peak {format_bytes(peak)} with every "
                    f"layer kept and {where}; nothing is offloaded or recomputed")
        counts = ", ".join(f"{self.choices.count(c)} {c}" for c in CHOICES if c in self.choices)
        return "\n".join([
            f"plan for memory_budget={format_bytes(b)} ({self.search_mode} search): {counts}; "
            f"release_lag={self.release_lag}, prefetch_layers={self.prefetch_layers}; "
            f"optimizer offload_fraction={self.offload_fraction:.3f}" + " (the optimizer's)" * self.fraction_given,
            f"  predicted step {p.step_ms:.1f} ms (optimizer {p.optimizer_ms:.1f} ms), peak {format_bytes(p.peak_bytes)}; "
            f"keeping everything: {k.step_ms:.1f} ms, {format_bytes(k.peak_bytes)}",
            f"  link D2H {self.bandwidth.d2h_gbps:.1f} / H2D {self.bandwidth.h2d_gbps:.1f} GB/s ({self.bandwidth.source}); "
            f"AdamW {self.step.device_ms:.0f} ms per 1e9 elements on the device, {self.step.host_ms:.0f} on the host",
        ])

    def __str__(self) -> str:
        rows = [f"  {m.name[:24]:<24} {c:<17} {ms:>9.2f} {format_bytes(peak):>11}" for m, c, ms, peak in
                zip(self.measurements, self.choices, self.prediction.layer_ms, self.prediction.layer_peak_bytes)]
        return "\n".join([self.summary(), f"  {'layer':<24} {'choice':<17} {'pred. ms':>9} {'pred. peak':>11}", *rows])


def plan_offload(
    model: nn.Module | None,
    *,
    memory_budget: int | float | str,
    example_inputs: Any = None,
    layers: Sequence[nn.Module] | None = None,
    measurements: Sequence[LayerMeasurement] | None = None,
    step: StepMeasurement | None = None,
    bandwidth: LinkBandwidth | None = None,
    release_lag: int | None = None,
    prefetch_layers: int | None = None,
    min_offload_numel: int | None = None,
    optimizer: str | None = "hybrid",
    keep: Sequence[int] = (),
    offload_fraction: float | None = None,
) -> PlannerResult:
    """The fastest plan whose predicted peak device memory fits ``memory_budget``.

    Measures each layer, the rest of the step, the host link and fused AdamW's speed on both sides
    (unless given), simulates every candidate plan (Notes [Planner time model], [Planner memory model]
    in ``_cost_model.py``) and returns the fastest that fits (Note [Planner search]: deterministic, and
    a larger budget never predicts a slower step). When the model fits as it is, the plan keeps every
    layer and the optimizer on the device.

    Args:
        model (nn.Module | None): the model to plan; may be ``None`` when ``measurements`` is given.
        memory_budget (int | float | str): the step's peak device memory
            (``torch.cuda.max_memory_allocated``: weights, gradients, optimizer state on the device,
            activations), bytes or a string such as ``"20GiB"`` or ``"500MB"``.
        example_inputs: inputs of one training step (tensor, tuple/list, or dict of keyword inputs), on
            the device the step runs on; required unless ``measurements`` is given.
        layers (Sequence[nn.Module] | None): the layers, in forward order; ``None``: the layers
            ``offload_transform`` finds (``@offload_layer`` marks, else the repeated blocks).
        measurements (Sequence[LayerMeasurement] | None), step (StepMeasurement | None): skip profiling
            and use these (``step`` ``None`` then counts nothing beyond the layers).
        bandwidth (LinkBandwidth | None): skip the link measurement and use this.
        release_lag (int | None), prefetch_layers (int | None): the runtime schedule; ``None`` searches
            it (``0..4`` and ``1..3``). Default: ``None``.
        min_offload_numel (int | None): the runtime's threshold: saved tensors under it stay on the GPU
            in an offloaded layer. ``None``: the runtime's default, 262144 (TransformerEngine's).
        optimizer (str | None): ``"hybrid"`` (AdamW over ``model.parameters()``, a fraction of them on the
            host if needed), ``"device"`` (AdamW on the device) or ``None`` (no optimizer: forward and
            backward only). Default: ``"hybrid"``.
        keep (Sequence[int]): indices of layers that must not be offloaded (``@offload_layer(offload=False)``);
            they are kept or recomputed. Default: ``()``.
        offload_fraction (float | None): with ``optimizer="hybrid"``, the split of the optimizer the step
            uses, in ``[0, 1]``: the search then chooses only the layers and the schedule. ``None``: the
            search chooses the split too. Default: ``None``.

    Returns:
        PlannerResult: the plan; ``print(result)`` shows the prediction per layer and in total.

    Raises:
        TypeError: a budget that is neither a number nor a string; bad ``example_inputs`` or ``measurements``.
        ValueError: a budget that is not a size (``"abc"``), zero or negative (before measuring), or below
            what any plan needs (after measuring: the message gives the smallest feasible budget); no ``example_inputs`` and
            no ``measurements``; ``layers`` and ``measurements`` of different lengths; a bad ``optimizer``; a
            ``keep`` index that is not an int in ``[0, number of layers)``.

    Example::

        result = plan_offload(model, memory_budget="20GiB", example_inputs=(x,))
        print(result)
        opt = HybridDeviceOptimizer(model.parameters(), **result.optimizer_kwargs())
    """
    budget = parse_memory_budget(memory_budget, "plan_offload")  # before any profiling
    check_schedule("plan_offload", release_lag, prefetch_layers)  # before any profiling
    if optimizer not in _OPTIMIZERS:
        raise ValueError(f"plan_offload: optimizer must be one of {_OPTIMIZERS}, got {optimizer!r}.")
    keep = tuple(keep)
    if any(isinstance(k, bool) or not isinstance(k, int) or k < 0 for k in keep):
        raise ValueError(f"plan_offload: keep={list(keep)!r} must hold layer indices (ints >= 0).")
    if offload_fraction is not None and (optimizer != "hybrid" or isinstance(offload_fraction, bool) or not
                                         isinstance(offload_fraction, (int, float)) or not 0 <= offload_fraction <= 1):
        raise ValueError(f"plan_offload: offload_fraction={offload_fraction!r} with optimizer={optimizer!r}; pass a "
                         "number in [0, 1] with optimizer='hybrid', or offload_fraction=None to let the search choose.")
    if measurements is None:
        if example_inputs is None:
            raise ValueError("plan_offload: example_inputs is None and measurements is None; pass example_inputs=(x,) "
                             "at training shapes so the layers can be profiled.")
        if model is None:
            raise ValueError("plan_offload: model is None; pass the model, or measurements= to plan without one.")
        from annotate_offload.runtime._layer_state import DEFAULT_MIN_OFFLOAD_NUMEL

        threshold = DEFAULT_MIN_OFFLOAD_NUMEL if min_offload_numel is None else min_offload_numel
        measurements, measured = measure(model, layers, example_inputs, min_offload_numel=threshold,
                                         optimizer=optimizer is not None)
        step = measured if step is None else step
    else:
        measurements = tuple(measurements)
        for i, m in enumerate(measurements):
            if not isinstance(m, LayerMeasurement):
                raise TypeError(f"plan_offload: measurements[{i}] is a {type(m).__name__}, not a LayerMeasurement; "
                                "pass the result of measure(...).")
        if layers is not None and len(layers) != len(measurements):
            raise ValueError(f"plan_offload: {len(layers)} layers but {len(measurements)} measurements; give one per layer.")
    if not measurements:
        raise ValueError("plan_offload: no layers to plan; pass layers= with the model's repeated blocks.")
    if any(k >= len(measurements) for k in keep):
        raise ValueError(f"plan_offload: keep={list(keep)!r} names a layer past the last of the {len(measurements)} "
                         f"layers; pass indices in [0, {len(measurements)}).")
    step = StepMeasurement() if step is None else step
    if bandwidth is None:
        bandwidth = measure_bandwidth(next((p.device for p in model.parameters()), None) if model is not None else None)
    elif not isinstance(bandwidth, LinkBandwidth):
        raise TypeError(f"plan_offload: bandwidth must be a LinkBandwidth, got {type(bandwidth).__name__}.")
    schedules = [(k if release_lag is None else release_lag, p if prefetch_layers is None else prefetch_layers)
                 for k, p in SCHEDULES]
    try:
        found = search(measurements, bandwidth, budget, step, schedules=dict.fromkeys(schedules),
                   host_optimizer=optimizer == "hybrid", keep=keep, offload_fraction=offload_fraction)
    except Infeasible as exc:
        raise ValueError(f"plan_offload: memory_budget={memory_budget!r} ({budget} bytes) cannot be met; the smallest "
                         f"feasible budget for this model and batch is {exc.smallest} bytes: pass memory_budget >= "
                         f"{exc.smallest}, e.g. '{format_bytes(exc.smallest, up=True)}', or shrink the batch or "
                         "sequence.") from None
    keep_all = predict(measurements, ("keep",) * len(measurements), bandwidth, step)
    return PlannerResult(choices=found.choices, release_lag=found.release_lag, prefetch_layers=found.prefetch_layers,
                         offload_fraction=found.prediction.offload_fraction if offload_fraction is None else
                         float(offload_fraction), prediction=found.prediction,
                         keep_all=keep_all, memory_budget=budget, measurements=measurements, step=step,
                         bandwidth=bandwidth, search_mode=found.mode, fraction_given=offload_fraction is not None)
