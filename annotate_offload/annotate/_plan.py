"""``OffloadPlan``: what ``offload_transform`` did to a model, attached as ``model.offload_plan``."""

from __future__ import annotations

import copy
import time
from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable, Literal

import torch

from ._layers import _copied_ref

__all__ = ["LayerPlan", "OffloadPlan"]

# least intrusive first: the planner breaks ties in this order (planner/_cost_model.py, CHOICES)
Choice = Literal["keep", "offload", "recompute", "recompute_offload", "selective", "selective_offload"]
OFFLOADED = frozenset({"offload", "recompute_offload", "selective_offload"})  # through the runtime's copies
RECOMPUTED = frozenset({"recompute", "recompute_offload", "selective", "selective_offload"})  # checkpointed
SELECTIVE = frozenset({"selective", "selective_offload"})  # Note [Selective recompute] in _layers.py


@dataclass(frozen=True)
class LayerPlan:
    """One layer of the plan.

    Attributes:
        index (int): the layer's position among the declared layers; the runtime's layer id.
        fqn (str): the module's fully qualified name in the model.
        module_type (str): the module's class name.
        choice (str): a :data:`Choice` (Note [Selective recompute] in ``_layers.py`` for ``"selective*"``).
        declared_keep (bool): ``@offload_layer(offload=False)`` keeps it on the GPU whatever ``num_layers`` says.
        bytes_per_step (int | None): bytes of saved activations this layer moves to host per
            training step (``0`` when it offloads nothing). ``None`` until known.
        estimated_bytes (int | None): the meta-device estimate of ``bytes_per_step`` (kept for comparison).
    """

    index: int
    fqn: str
    module_type: str
    choice: Choice
    declared_keep: bool = False
    bytes_per_step: int | None = None
    estimated_bytes: int | None = None

    @property
    def offloaded(self) -> bool:
        """Whether the layer's saved activations go to host memory."""
        return self.choice in OFFLOADED


@dataclass
class OffloadPlan:
    """What ``offload_transform`` did: per layer the choice and its bytes; with a memory budget also
    the prediction, per layer and in total, and after :meth:`measure` the measured figures.

    Attributes:
        layers (tuple[LayerPlan, ...]): every declared layer, in registration (and run) order.
        layer_source (str): how the layers were found (marks, ``layer_types=``, discovery).
        bytes_source (str): ``"measured"`` (the first training forward), ``"estimate"`` (meta-device run
            of ``example_inputs``) or ``"pending"``.
        notes (tuple[str, ...]): warnings given while planning, for the record.
        runtime (DefaultOffloadSynchronizer): the runtime the layers drive (``plan.stats``: its stats).
        planner (PlannerResult | None): the planner's result for ``memory_budget=`` (``None`` otherwise).
        measured (dict | None): from :meth:`measure`: ``step_ms``, ``peak_bytes`` (``None`` on a CPU),
            ``layer_ms`` and ``layer_peak_bytes`` (per layer: forward plus backward ms, the peak during either).
    """

    layers: tuple[LayerPlan, ...]
    layer_source: str = ""
    bytes_source: str = "pending"
    notes: tuple[str, ...] = field(default_factory=tuple)
    runtime: Any = field(default=None, repr=False, compare=False)
    planner: Any = field(default=None, repr=False, compare=False)
    measured: dict | None = field(default=None, repr=False, compare=False)
    model: Any = field(default=None, repr=False, compare=False)  # weakref to the model

    @property
    def stats(self) -> Any:
        """The runtime's ``OffloadStats`` of the current or last training step (bytes moved, kept reasons)."""
        return None if self.runtime is None else self.runtime.stats

    @property
    def num_layers(self) -> int:
        """Number of declared layers ``L``."""
        return len(self.layers)

    @property
    def offloaded_layers(self) -> tuple[int, ...]:
        """Indices of the layers whose activations are offloaded."""
        return tuple(lp.index for lp in self.layers if lp.offloaded)

    @property
    def bytes_per_step(self) -> int | None:
        """Bytes offloaded per training step over all offloaded layers, or ``None`` until known."""
        vals = [lp.bytes_per_step for lp in self.layers if lp.offloaded]
        return None if any(v is None for v in vals) else sum(vals)  # type: ignore[arg-type]

    def optimizer_kwargs(self) -> dict[str, float]:
        """The optimizer settings the plan assumed, for ``HybridDeviceOptimizer(model.parameters(), **kwargs)``
        (its exact mode): ``{"offload_fraction": f}``; ``0.0`` (also without a memory budget) keeps the
        optimizer on the device."""
        return self.planner.optimizer_kwargs() if self.planner is not None else {"offload_fraction": 0.0}

    def measure(self, step: Callable[[], Any]) -> dict:
        """Run ``step()`` (one training step) once with timing and memory hooks at the layers' boundaries
        and keep the figures in :attr:`measured` (shown beside the prediction by ``repr``). On CUDA: CUDA
        events and the allocator's peak between boundaries; on a CPU, times only. A layer's backward runs
        from its output's gradient to its inputs' and parameters' gradients.

        Returns:
            dict: :attr:`measured` (a layer that did not run forward and backward in ``step`` gets ``None``).

        Raises:
            RuntimeError: the model is gone (or ``remove_offload`` was called).
        """
        model = self.model() if self.model is not None else None
        if model is None:
            raise RuntimeError("OffloadPlan.measure: the transformed model is gone (or remove_offload was called).")
        mods = [model.get_submodule(lp.fqn) for lp in self.layers]
        cuda = torch.cuda.is_available() and any(p.is_cuda for p in model.parameters())
        n, handles = len(mods), []
        marks: dict[tuple, tuple] = {}  # (layer, phase, "start" | "end") -> (time or event, peak so far)

        def mark(key) -> None:
            if cuda:
                event = torch.cuda.Event(enable_timing=True)
                event.record()
                marks[key] = (event, torch.cuda.max_memory_allocated())
                torch.cuda.reset_peak_memory_stats()
            else:
                marks[key] = (time.perf_counter(), None)

        def on_output(i: int, out: Any) -> None:
            mark((i, "fwd", "end"))
            tensors = [t for t in torch.utils._pytree.tree_leaves(out) if isinstance(t, torch.Tensor) and t.requires_grad]
            if tensors:
                handles.append(tensors[0].register_hook(lambda g: mark((i, "bwd", "start"))))

        def on_input(i: int, mod: torch.nn.Module, args: tuple, kwargs: dict) -> None:
            mark((i, "fwd", "start"))
            ends = [t for t in torch.utils._pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)
                    and t.requires_grad] + [p for p in mod.parameters() if p.requires_grad]
            if ends:  # removed after the step: a hook left on a parameter would hold it and fire on every step
                handles.append(torch.autograd.graph.register_multi_grad_hook(ends, lambda g: mark((i, "bwd", "end"))))

        for i, mod in enumerate(mods):
            handles.append(mod.register_forward_pre_hook(lambda m, a, k, i=i: on_input(i, m, a, k), with_kwargs=True))
            handles.append(mod.register_forward_hook(lambda m, a, out, i=i: on_output(i, out)))
        try:
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            t0 = time.perf_counter()
            step()
            if cuda:
                torch.cuda.synchronize()
            step_ms = (time.perf_counter() - t0) * 1e3
        finally:
            for h in handles:
                h.remove()
        ms = ((lambda a, b: a.elapsed_time(b)) if cuda else (lambda a, b: (b - a) * 1e3))
        ran = [all((i, ph, e) in marks for ph in ("fwd", "bwd") for e in ("start", "end")) for i in range(n)]
        layer_ms = tuple(sum(ms(marks[(i, ph, "start")][0], marks[(i, ph, "end")][0]) for ph in ("fwd", "bwd"))
                         if ran[i] else None for i in range(n))
        peaks = None
        if cuda:  # the peak between a boundary and the next is read at the next one
            peaks = tuple(max(marks[(i, ph, "end")][1] for ph in ("fwd", "bwd")) if ran[i] else None for i in range(n))
            peak = max([m[1] for m in marks.values()] + [torch.cuda.max_memory_allocated()])
        self.measured = {"step_ms": step_ms, "peak_bytes": peak if cuda else None, "layer_ms": layer_ms,
                         "layer_peak_bytes": peaks}
        return self.measured

    def _with_bytes(self, per_layer: dict[int, int], source: str) -> None:
        def value(lp: LayerPlan) -> int:
            return per_layer.get(lp.index, 0) if lp.offloaded else 0

        if source == "estimate":
            self.layers = tuple(replace(lp, bytes_per_step=value(lp), estimated_bytes=value(lp)) for lp in self.layers)
        else:
            self.layers = tuple(replace(lp, bytes_per_step=value(lp)) for lp in self.layers)
        self.bytes_source = source
        empty = [lp.index for lp in self.layers if lp.offloaded and not lp.bytes_per_step]
        if source == "measured" and empty and self.stats is not None:
            self.notes += (_why_nothing_moved(empty, self.stats, self.runtime.min_offload_numel),)

    def _replace_layer(self, index: int, module_type: str) -> None:
        self.layers = tuple(replace(lp, module_type=module_type) if lp.index == index else lp for lp in self.layers)

    def __deepcopy__(self, memo: dict) -> "OffloadPlan":
        # the copy's model reference is to the copied model (reached through memo), as the state's is
        new = OffloadPlan.__new__(OffloadPlan)
        memo[id(self)] = new
        for f in fields(self):
            setattr(new, f.name, copy.deepcopy(getattr(self, f.name), memo) if f.name != "model" else None)
        new.model = None if self.model is None else _copied_ref(self.model, memo)
        return new

    def __repr__(self) -> str:
        head = f"OffloadPlan(layers={self.num_layers}, offloaded={len(self.offloaded_layers)}"
        total = self.bytes_per_step
        head += f", bytes/step={_opt_bytes(total)} [{self.bytes_source}])" if total is not None else ", bytes/step=pending)"
        lines = [head]
        if self.layer_source:
            lines.append(f"  layers: {self.layer_source}")
        if self.planner is not None:
            lines += ["  " + line for line in self.planner.summary().splitlines()]
        show_estimate = self.bytes_source == "measured" and any(lp.estimated_bytes is not None for lp in self.layers)
        pred, meas = getattr(self.planner, "prediction", None), self.measured
        cols = ["idx", "layer", "type", "choice", "bytes/step"] + (["estimate"] if show_estimate else [])
        cols += ["pred. ms", "pred. peak"] if pred is not None else []
        cols += ["meas. ms", "meas. peak"] if meas is not None else []
        rows = [cols]
        for lp in self.layers:
            choice = lp.choice + (" (declared)" if lp.declared_keep else "")
            row = [str(lp.index), lp.fqn, lp.module_type, choice, _opt_bytes(lp.bytes_per_step)]
            row += [_opt_bytes(lp.estimated_bytes)] if show_estimate else []
            for figures in (pred and (pred.layer_ms, pred.layer_peak_bytes), meas and (meas["layer_ms"],
                                                                                        meas["layer_peak_bytes"])):
                if figures:
                    ms = figures[0][lp.index]
                    row += ["-" if ms is None else f"{ms:.2f}", _opt_bytes(figures[1] and figures[1][lp.index])]
            rows.append(row)
        if pred is not None or meas is not None:
            row = ["", "step", "", "", ""] + ([""] if show_estimate else [])
            row += [f"{pred.step_ms:.2f}", _opt_bytes(pred.peak_bytes)] if pred is not None else []
            row += [f"{meas['step_ms']:.2f}", _opt_bytes(meas["peak_bytes"])] if meas is not None else []
            rows.append(row)
        widths = [max(len(r[c]) for r in rows) for c in range(len(cols))]
        for r in rows:
            lines.append("  " + "  ".join(v.ljust(w) if c < 4 else v.rjust(w) for c, (v, w) in enumerate(zip(r, widths))))
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _why_nothing_moved(layers: list[int], stats: Any, min_numel: int) -> str:
    """Why offloaded ``layers`` moved 0 B in the measured forward, from the runtime's keep counters."""
    small, why = stats.kept.get("too_small", 0), ""
    other = ", ".join(f"{r}={n}" for r, n in sorted(stats.kept.items()) if r not in ("too_small", "layer_not_offloaded"))
    if small:
        every = "all " if not any(stats.bytes_offloaded_per_layer.values()) and not other else ""
        why = (f": {every}{small} saved tensors of the offloaded layers ({_opt_bytes(stats.kept_bytes['too_small'])}) "
               f"are < min_offload_numel={min_numel} elements and stay on the device; lower it with "
               "min_offload_numel=... (offload_transform keyword, callback keyword or config field) to move them")
    return (f"offloaded layer{'s' * (len(layers) > 1)} {', '.join(map(str, layers))} moved 0 B{why}"
            + (f" (also kept on the device: {other})" if other else ""))


def _opt_bytes(n: int | None) -> str:
    from annotate_offload.planner._plan import format_bytes  # the planner loads when first used, as elsewhere

    return "-" if n is None else format_bytes(n)
