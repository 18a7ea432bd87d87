"""Streams, events and pinned host slabs of :class:`HybridDeviceOptimizer` (private).

Two stream backends with one small interface, picked from where the parameters live:
``_CudaSide`` (real side streams and events on one device) and ``_CpuSide`` for machines without
a GPU, whose "device" parameters are CPU tensors and whose streams and events are no-ops that are
always complete. Splitting, hooks, chunking, state and all numerics run the same on both; only
the concurrency is missing on the CPU. Nothing here touches CUDA at import time.

Note [Host slabs]: torch's caching host allocator rounds every pinned allocation up to a power
of two, so pinning each master and gradient buffer separately can waste up to half the pinned
memory. :func:`carve` allocates power-of-two slabs (at least ``MIN_SLAB_BYTES`` and at least the
largest tensor), packs the views into them in order at 64-byte alignment and sizes only the last
slab to what it holds. Slabs live as long as the optimizer; loads copy into them.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import torch

__all__: list[str] = []

MIN_SLAB_BYTES = 64 << 20
_ALIGN_BYTES = 64


class _CpuSide:
    """No-op streams and events; the "GPU side" is CPU tensors (tests, CI)."""

    __slots__ = ()
    can_pin = False

    def owns(self, t: torch.Tensor) -> bool:
        return True

    def new_stream(self) -> Any:
        return None

    def current_stream(self) -> Any:
        return None

    @contextlib.contextmanager
    def use(self, stream: Any) -> Iterator[None]:
        yield

    def record(self, stream: Any = None) -> Any:
        return None

    def wait_event(self, stream: Any, event: Any) -> None:
        pass

    def wait_stream(self, stream: Any, other: Any) -> None:
        pass

    def synchronize(self, event: Any) -> None:
        pass

    def record_stream(self, t: torch.Tensor, stream: Any) -> None:
        pass

    def bind_thread(self) -> None:
        pass

    def __repr__(self) -> str:
        return "_CpuSide()"


class _CudaSide:
    """CUDA streams and events on one device."""

    __slots__ = ("device",)
    can_pin = True

    def __init__(self, device: torch.device) -> None:
        self.device = torch.device("cuda", device.index if device.index is not None else torch.cuda.current_device())

    def owns(self, t: torch.Tensor) -> bool:
        return t.device.type == "cuda"

    def new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.device)

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device)

    def use(self, stream: Any) -> Any:
        return torch.cuda.stream(stream)

    def record(self, stream: Any = None) -> Any:
        ev = torch.cuda.Event()
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
        ValueError: parameters on several CUDA devices, or on an accelerator other than CUDA.
    """
    devices = {p.device for p in params if p.device.type == "cuda"}
    other = next((p.device for p in params if p.device.type not in ("cpu", "cuda", "meta")), None)
    if other is not None:
        raise ValueError(f"HybridDeviceOptimizer: parameters on {other} are not supported; use CUDA parameters "
                         "(stepped partly on the host) or CPU parameters.")
    if len(devices) > 1:
        raise ValueError(f"HybridDeviceOptimizer: parameters live on several CUDA devices {sorted(map(str, devices))}; "
                         "build one optimizer per device (one per rank).")
    return _CudaSide(devices.pop()) if devices else _CpuSide()


def _empty(numel: int, dtype: torch.dtype, pin: bool) -> tuple[torch.Tensor, bool]:
    if pin:
        try:
            return torch.empty(numel, dtype=dtype, pin_memory=True), True
        except RuntimeError:  # e.g. the locked-memory limit: pageable memory, one warning below
            pass
    return torch.empty(numel, dtype=dtype), False


def carve(numels: list[int], dtypes: list[torch.dtype], *, pin: bool, what: str) -> list[torch.Tensor]:
    """1-D host views of ``numels[i]`` elements of ``dtypes[i]`` from power-of-two slabs (Note [Host slabs]).

    A pinning failure falls back to pageable memory with one ``ResourceWarning``; it never raises.
    """
    out: list[Any] = [None] * len(numels)
    unpinned = False
    for dtype in dict.fromkeys(dtypes):
        idx = [i for i, d in enumerate(dtypes) if d == dtype]
        esize = torch.empty((), dtype=dtype).element_size()
        align = max(1, _ALIGN_BYTES // esize)
        largest = max(numels[i] * esize for i in idx)
        slab_numel = max(MIN_SLAB_BYTES, 1 << max(0, (largest - 1).bit_length())) // esize
        places, used = [], []  # (slab, offset) per view; elements used per slab
        for i in idx:
            if not used or used[-1] + numels[i] > slab_numel:
                used.append(0)
            places.append((len(used) - 1, used[-1]))
            used[-1] += -(-numels[i] // align) * align
        slabs = []
        for k, u in enumerate(used):
            size = slab_numel if k < len(used) - 1 else max(align, (1 << max(0, (u * esize - 1).bit_length())) // esize)
            slab, pinned = _empty(size, dtype, pin)
            unpinned |= pin and not pinned
            slabs.append(slab)
        for i, (k, off) in zip(idx, places):
            out[i] = slabs[k].narrow(0, off, numels[i])
    if unpinned:
        warnings.warn(f"HybridDeviceOptimizer: could not pin host memory for {what}; using pageable memory, so its "
                      "copies are staged and synchronous. Raise the locked-memory limit (ulimit -l) or pass "
                      "pin_cpu_params=False / pin_cpu_grads=False to silence this.", ResourceWarning, stacklevel=4)
    return out
