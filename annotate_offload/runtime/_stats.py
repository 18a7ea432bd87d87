"""Per-step statistics of the offload runtime, readable by users and benchmarks."""

from __future__ import annotations

import dataclasses
from typing import Dict

__all__ = ["OffloadStats", "KEEP_REASONS"]

# Why a saved tensor stayed on the device (keys of OffloadStats.kept / kept_bytes).
KEEP_REASONS = (
    "layer_not_offloaded",  # the layer's activations are kept by the schedule
    "too_small",  # fewer than min_offload_numel logical elements
    "parameter",  # a parameter (or view/cast of one) or another leaf that requires grad
    "marked",  # mark_not_offload / _TE_do_not_offload / _do_not_offload
    "not_selected",  # opt-in policy and no activation_offloading=True mark
    "not_on_device",  # lives on another device (e.g. a CPU tensor in a CUDA model)
    "zero_size",  # numel() == 0
    "fake",  # FakeTensor / FunctionalTensor (torch.compile tracing)
    "unsupported",  # sparse, quantized, tensor subclasses, negative strides
)


@dataclasses.dataclass
class OffloadStats:
    """What the runtime did in one step (from entering layer 0 to the end of backward).

    Attributes:
        step (int): step counter of the synchronizer (0-based).
        tensors_offloaded (int): saved tensors the runtime took over to serve from host memory (in
            manual mode their bytes move only when ``start_offload_layer`` runs: see ``bytes_offloaded``).
        tensors_deduplicated (int): saved tensors that shared an already-copied storage unit.
        bytes_offloaded (int): bytes copied device-to-host (D2H), in bytes. Each storage unit once.
        bytes_reloaded (int): bytes copied host-to-device (H2D), in bytes.
        on_demand_reloads (int): layers reloaded at unpack time because no prefetch had started.
        kept (dict[str, int]): saved tensors left on the device, by reason (see ``KEEP_REASONS``).
        kept_bytes (dict[str, int]): their logical sizes, in bytes.
        bytes_offloaded_per_layer (dict[int, int]): D2H bytes by layer index.
        resident_bytes (int): device bytes of offloaded units the runtime still references now
            (forward copies not yet released plus reloaded buffers not yet released).
        peak_resident_bytes (int): high-water mark of ``resident_bytes`` in this step.
        pinned_bytes (int): host bytes held by the buffer pool now (in use + cached).
        peak_pinned_bytes (int): high-water mark of the pool, in bytes.
    """

    step: int = 0
    tensors_offloaded: int = 0
    tensors_deduplicated: int = 0
    bytes_offloaded: int = 0
    bytes_reloaded: int = 0
    on_demand_reloads: int = 0
    kept: Dict[str, int] = dataclasses.field(default_factory=dict)
    kept_bytes: Dict[str, int] = dataclasses.field(default_factory=dict)
    bytes_offloaded_per_layer: Dict[int, int] = dataclasses.field(default_factory=dict)
    resident_bytes: int = 0
    peak_resident_bytes: int = 0
    pinned_bytes: int = 0
    peak_pinned_bytes: int = 0

    def _keep(self, reason: str, nbytes: int) -> None:
        self.kept[reason] = self.kept.get(reason, 0) + 1
        self.kept_bytes[reason] = self.kept_bytes.get(reason, 0) + nbytes

    def _resident(self, delta: int) -> None:
        self.resident_bytes += delta
        if self.resident_bytes > self.peak_resident_bytes:
            self.peak_resident_bytes = self.resident_bytes

    def __str__(self) -> str:
        mib = 1 << 20
        kept = ", ".join(f"{k}={v}" for k, v in sorted(self.kept.items())) or "none"
        return (
            f"step {self.step}: offloaded {self.tensors_offloaded} tensors "
            f"({self.bytes_offloaded / mib:.1f} MiB D2H, {self.bytes_reloaded / mib:.1f} MiB H2D, "
            f"{self.tensors_deduplicated} deduplicated); kept: {kept}; "
            f"pinned {self.pinned_bytes / mib:.1f} MiB (peak {self.peak_pinned_bytes / mib:.1f})"
        )
