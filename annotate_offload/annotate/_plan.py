"""``OffloadPlan``: what ``offload_transform`` did to a model, attached as ``model.offload_plan``."""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Literal

__all__ = ["LayerPlan", "OffloadPlan"]

Choice = Literal["keep", "offload", "recompute", "recompute_offload"]


@dataclass(frozen=True)
class LayerPlan:
    """One layer of the plan.

    Attributes:
        index (int): the layer's position among the declared layers (module registration order,
            which must be the order they run in); the runtime's layer id.
        fqn (str): the module's fully qualified name in the model.
        module_type (str): the module's class name.
        choice (str): ``"keep"``, ``"offload"``, ``"recompute"`` or ``"recompute_offload"``.
        declared_keep (bool): ``@offload_layer(offload=False)`` keeps it on the GPU whatever ``num_layers`` says.
        bytes_per_step (int | None): bytes of saved activations this layer moves to host per
            training step (``0`` for a kept or recompute-only layer). ``None`` until known.
        estimated_bytes (int | None): the meta-device estimate of ``bytes_per_step`` made from
            ``example_inputs`` (kept after the measurement replaces it, for comparison).
        reason (str): why this choice (the planner's explanation with ``num_layers="auto"``).
    """

    index: int
    fqn: str
    module_type: str
    choice: Choice
    declared_keep: bool = False
    bytes_per_step: int | None = None
    estimated_bytes: int | None = None
    reason: str = ""

    @property
    def offloaded(self) -> bool:
        """Whether the layer's saved activations go to host memory."""
        return self.choice in ("offload", "recompute_offload")


@dataclass
class OffloadPlan:
    """What ``offload_transform`` did: per layer the choice and its bytes.

    Attributes:
        layers (tuple[LayerPlan, ...]): every declared layer, in registration (and run) order.
        layer_source (str): how the layers were found (marks, ``layer_types=``, discovery).
        bytes_source (str): where ``bytes_per_step`` comes from: ``"measured"`` (runtime stats of
            the first training forward, which replace any estimate), ``"estimate"`` (meta-device
            run of ``example_inputs``, until the first training step) or ``"pending"``.
        notes (tuple[str, ...]): warnings given while planning, for the record.
        runtime (DefaultOffloadSynchronizer): the runtime engine the layers' forwards drive
            (``plan.stats`` is its ``OffloadStats``).
    """

    layers: tuple[LayerPlan, ...]
    layer_source: str = ""
    bytes_source: str = "pending"
    notes: tuple[str, ...] = field(default_factory=tuple)
    runtime: Any = field(default=None, repr=False, compare=False)

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

    def _with_bytes(self, per_layer: dict[int, int], source: str) -> None:
        def value(lp: LayerPlan) -> int:
            return per_layer.get(lp.index, 0) if lp.offloaded else 0

        if source == "estimate":
            self.layers = tuple(replace(lp, bytes_per_step=value(lp), estimated_bytes=value(lp)) for lp in self.layers)
        else:
            self.layers = tuple(replace(lp, bytes_per_step=value(lp)) for lp in self.layers)
        self.bytes_source = source

    def _replace_layer(self, index: int, module_type: str) -> None:
        self.layers = tuple(replace(lp, module_type=module_type) if lp.index == index else lp for lp in self.layers)

    def __repr__(self) -> str:
        head = f"OffloadPlan(layers={self.num_layers}, offloaded={len(self.offloaded_layers)}"
        total = self.bytes_per_step
        head += f", bytes/step={_fmt_bytes(total)} [{self.bytes_source}])" if total is not None else ", bytes/step=pending)"
        lines = [head]
        if self.layer_source:
            lines.append(f"  layers: {self.layer_source}")
        show_estimate = self.bytes_source == "measured" and any(lp.estimated_bytes is not None for lp in self.layers)
        rows = [("idx", "layer", "type", "choice", "bytes/step") + (("estimate",) if show_estimate else ())]
        for lp in self.layers:
            choice = lp.choice + (" (declared)" if lp.declared_keep else "")
            row = (str(lp.index), lp.fqn, lp.module_type, choice, _opt_bytes(lp.bytes_per_step))
            rows.append(row + ((_opt_bytes(lp.estimated_bytes),) if show_estimate else ()))
        widths = [max(len(r[c]) for r in rows) for c in range(len(rows[0]))]
        for r in rows:
            lines.append("  " + "  ".join(v.ljust(w) if c < 4 else v.rjust(w) for c, (v, w) in enumerate(zip(r, widths))))
        lines.extend(f"  why {lp.index}: {lp.reason}" for lp in self.layers if lp.reason)
        lines.extend(f"  note: {n}" for n in self.notes)
        return "\n".join(lines)


def _opt_bytes(n: int | None) -> str:
    return "-" if n is None else _fmt_bytes(n)


def _fmt_bytes(n: int) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"
