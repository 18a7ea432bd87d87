"""Stream/event layer of :class:`HybridDeviceOptimizer` (private).

Two backends with one small interface, chosen from where the model's parameters live:

* ``_CudaSide``: real CUDA side streams (one D2H, one H2D) and events.
* ``_CpuSide``: for machines without a GPU. The "device" parameters are CPU tensors, streams
  and events are no-ops that are always complete, copies run synchronously, and pinning is
  off (there is no accelerator to pin for). Splitting, hooks, chunking, state handling and all
  numerics run exactly as on a GPU; only the concurrency is missing.

Nothing here touches CUDA at import time.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

__all__: list[str] = []


class _CpuSide:
    """No-op streams and events; the "GPU side" is CPU tensors (tests, CI)."""

    __slots__ = ("device",)
    is_accel = False
    can_pin = False

    def __init__(self) -> None:
        self.device = torch.device("cpu")

    def owns(self, t: torch.Tensor) -> bool:
        return True

    def new_stream(self) -> Any:
        return None

    def current_stream(self) -> Any:
        return None

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        yield

    def record(self, stream: Any = None, timing: bool = False) -> Any:
        return None

    def wait_event(self, stream: Any, event: Any) -> None:
        return None

    def wait_stream(self, stream: Any, other: Any) -> None:
        return None

    def synchronize(self, event: Any) -> None:
        return None

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        return None

    def bind_thread(self) -> None:
        return None

    def __repr__(self) -> str:
        return "_CpuSide()"


class _CudaSide:
    """Real CUDA streams/events on one device."""

    __slots__ = ("device",)
    is_accel = True
    can_pin = True

    def __init__(self, device: torch.device) -> None:
        index = device.index if device.index is not None else torch.cuda.current_device()
        self.device = torch.device("cuda", index)

    def owns(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    def new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def use(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def record(self, stream: Any = None, timing: bool = False) -> Any:
        ev = torch.cuda.Event(enable_timing=timing)
        ev.record(stream if stream is not None else self.current_stream())
        return ev

    def wait_event(self, stream: Any, event: Any) -> None:
        if event is not None:
            stream.wait_event(event)

    def wait_stream(self, stream: Any, other: Any) -> None:
        stream.wait_stream(other)

    def synchronize(self, event: Any) -> None:
        if event is not None:
            event.synchronize()

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        t.record_stream(stream)

    def bind_thread(self) -> None:
        torch.cuda.set_device(self.device)

    def __repr__(self) -> str:
        return f"_CudaSide({self.device})"


def pick_side(params: list[torch.Tensor]) -> "_CpuSide | _CudaSide":
    """The backend for ``params``: CUDA if any parameter is on CUDA, else the CPU stand-in.

    Raises:
        ValueError: parameters on more than one CUDA device, or on an accelerator other than CUDA.
    """
    devices: set[torch.device] = set()
    for p in params:
        if p.device.type == "cuda":
            devices.add(p.device)
        elif p.device.type not in ("cpu", "meta"):
            raise ValueError(
                f"HybridDeviceOptimizer: parameters on device {p.device} are not supported; "
                "only CUDA parameters (offloaded to the host) or CPU parameters (test backend) are."
            )
    if len(devices) > 1:
        raise ValueError(
            f"HybridDeviceOptimizer: parameters live on several CUDA devices {sorted(map(str, devices))}; "
            "one optimizer serves one device (use one per rank/device)."
        )
    if devices:
        return _CudaSide(devices.pop())
    return _CpuSide()


def empty_host(numel: int, dtype: torch.dtype, pin: bool) -> tuple[torch.Tensor, bool]:
    """A 1-D host tensor of ``numel`` elements; pinned if asked and possible.

    Returns ``(tensor, pinned)``. A pinning failure (e.g. the locked-memory limit) falls back to
    pageable memory; the caller warns once.
    """
    if pin:
        try:
            return torch.empty(numel, dtype=dtype, pin_memory=True), True
        except RuntimeError:
            pass
    return torch.empty(numel, dtype=dtype), False

