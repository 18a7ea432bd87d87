"""Streams, events and pinned host slabs of :class:`HybridDeviceOptimizer` (private).

:class:`Side` wraps CUDA streams and events on one device. Without CUDA the "device" parameters are
CPU tensors and every stream and event is ``None``: waits are no-ops, copies are synchronous, and
splitting, hooks, chunks, state and all numerics run as on a GPU. Nothing touches CUDA at import.

Note [Host slabs]: torch's caching host allocator rounds each pinned allocation up to a power of
two, so :func:`carve` packs the views (64-byte aligned) into power-of-two slabs of at least
``MIN_SLAB_BYTES`` and sizes only the last slab to what it holds.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any

import torch

__all__: list[str] = []

MIN_SLAB_BYTES = 64 << 20


class Side:
    """Streams and events of the parameters' (one) device; every stream and event is ``None`` without CUDA."""

    def __init__(self, params: list[torch.Tensor]) -> None:
        devices = {p.device for p in params if p.device.type == "cuda"}
        other = next((p.device for p in params if p.device.type not in ("cpu", "cuda", "meta")), None)
        if other is not None or len(devices) > 1:
            raise ValueError(f"HybridDeviceOptimizer: parameters on {other or sorted(map(str, devices))}: pass CUDA "
                             "parameters of one device (build one optimizer per device) or CPU parameters.")
        self.can_pin = self.cuda = bool(devices)
        self.device = devices.pop() if devices else torch.device("cpu")

    def new_stream(self) -> Any:
        return torch.cuda.Stream(device=self.device) if self.cuda else None

    def current_stream(self) -> Any:
        return torch.cuda.current_stream(self.device) if self.cuda else None

    def bind_thread(self, stream: Any) -> None:
        """Make this thread use the device, and ``stream`` (one of :meth:`new_stream`) as its current stream."""
        if self.cuda:
            torch.cuda.set_device(self.device)
            torch.cuda.set_stream(stream)

    @staticmethod
    def use(stream: Any) -> Any:
        return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()

    @staticmethod
    def record(stream: Any) -> Any:
        return stream.record_event() if stream is not None else None

    @staticmethod
    def wait_event(stream: Any, event: Any) -> None:
        if stream is not None and event is not None:
            stream.wait_event(event)

    @staticmethod
    def synchronize(event: Any) -> None:
        if event is not None:
            event.synchronize()


def carve(numels: list[int], dtypes: list[torch.dtype], *, pin: bool, what: str) -> list[torch.Tensor]:
    """1-D host views of ``numels[i]`` elements of ``dtypes[i]`` (Note [Host slabs]); a pinning failure
    falls back to pageable memory with one ``ResourceWarning``."""
    out: list[Any] = [None] * len(numels)
    unpinned = False
    pow2 = lambda n: 1 << max(0, (n - 1).bit_length())  # noqa: E731
    for dtype in dict.fromkeys(dtypes):
        idx = [i for i, d in enumerate(dtypes) if d == dtype]
        esize = torch.empty((), dtype=dtype).element_size()
        align = max(1, 64 // esize)
        slab = max(MIN_SLAB_BYTES, pow2(max(numels[i] * esize for i in idx))) // esize
        places, used = [], []  # (slab, offset) per view; elements used per slab
        for i in idx:
            if not used or used[-1] + numels[i] > slab:
                used.append(0)
            places.append((len(used) - 1, used[-1]))
            used[-1] += -(-numels[i] // align) * align
        slabs = []
        for k, u in enumerate(used):
            size = slab if k < len(used) - 1 else max(align, pow2(u * esize) // esize)
            try:
                slabs.append(torch.empty(size, dtype=dtype, pin_memory=pin))
            except RuntimeError:  # e.g. the locked-memory limit
                slabs.append(torch.empty(size, dtype=dtype))
                unpinned = True
        for i, (k, off) in zip(idx, places):
            out[i] = slabs[k].narrow(0, off, numels[i])
    if unpinned:
        warnings.warn(f"HybridDeviceOptimizer: could not pin host memory for {what}; using pageable memory, so its "
                      "copies are staged and synchronous. Raise the locked-memory limit (ulimit -l) or pass "
                      "pin_cpu_params=False / pin_cpu_grads=False.", ResourceWarning, stacklevel=4)
    return out
