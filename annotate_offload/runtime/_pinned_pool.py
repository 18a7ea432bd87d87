"""A pool of host buffers for offloaded activations, reused across steps.

Note [Pinned pool] (DESIGN.md runtime rule 7): pinning is expensive the first time (the first 4 GiB
``cudaHostAlloc`` took 2.1 s on the H200 machine, ``cudaHostRegister`` of 4 GiB 1.7 s) and torch's
caching host allocator rounds every block up to a power of two, so a 1.13 GiB activation would pin
2 GiB. This pool therefore allocates each buffer at its exact size (page-aligned pageable memory
registered with ``cudaHostRegister``), keeps freed buffers keyed by size, and hands the same buffers
out again on the next step. When registration is unavailable it falls back to torch's pinned
allocator, and when pinning fails altogether to pageable memory with a warning (copies then run
synchronously, but results stay correct).

A buffer returned to the pool remembers the event of the last H2D copy that read it; whoever takes
it next makes its D2H stream wait for that event before overwriting it.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Optional

import torch

__all__: list[str] = []

_PAGE = 4096


class _HostBuffer:
    """One host allocation: a flat ``uint8`` tensor of exactly ``nbytes`` bytes."""

    __slots__ = ("tensor", "nbytes", "pinned", "registered_ptr", "last_read_event", "__weakref__")

    def __init__(self, tensor: torch.Tensor, nbytes: int, pinned: bool, registered_ptr: int = 0):
        self.tensor = tensor
        self.nbytes = nbytes
        self.pinned = pinned
        self.registered_ptr = registered_ptr
        self.last_read_event: Any = None

    def __repr__(self) -> str:
        return f"_HostBuffer(nbytes={self.nbytes}, pinned={self.pinned})"


class PinnedBufferPool:
    """Exact-size host buffers, reused across steps.

    Args:
        pin (bool): pin the buffers (``True`` on CUDA, ``False`` on the CPU backend, where host
            buffers are plain CPU tensors).

    Attributes:
        in_use_bytes (int): bytes currently handed out.
        cached_bytes (int): bytes allocated by the pool in total (in use + free), in bytes.
        peak_bytes (int): high-water mark of ``cached_bytes``.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: dict[int, list[_HostBuffer]] = {}
        self._lock = threading.Lock()
        self.in_use_bytes = 0
        self.cached_bytes = 0
        self.peak_bytes = 0
        self._warned = False
        self._use_register: Optional[bool] = None

    # -- allocation -------------------------------------------------------------------------
    def _pin_register(self, nbytes: int) -> _HostBuffer:
        """Pageable page-aligned memory pinned in place with ``cudaHostRegister`` (exact size)."""
        raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
        shift = (-raw.data_ptr()) % _PAGE
        tensor = raw[shift : shift + nbytes]
        length = ((nbytes + _PAGE - 1) // _PAGE) * _PAGE
        length = min(length, raw.numel() - shift)
        cudart = torch.cuda.cudart()
        err = cudart.cudaHostRegister(tensor.data_ptr(), length, 0)
        if int(err) != 0:
            raise RuntimeError(f"cudaHostRegister failed with error {int(err)}")
        return _HostBuffer(tensor, nbytes, True, tensor.data_ptr())

    def _pin(self, nbytes: int) -> _HostBuffer:
        """Allocate ``nbytes`` of pinned host memory (overridable in tests)."""
        if self._use_register is None:
            self._use_register = hasattr(torch.cuda, "cudart")
        if self._use_register:
            try:
                return self._pin_register(nbytes)
            except Exception:  # registration unsupported: use torch's pinned allocator
                self._use_register = False
        tensor = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
        return _HostBuffer(tensor, nbytes, True)

    def _allocate(self, nbytes: int) -> _HostBuffer:
        if not self.pin:
            return _HostBuffer(torch.empty(nbytes, dtype=torch.uint8), nbytes, False)
        try:
            return self._pin(nbytes)
        except Exception as exc:  # noqa: BLE001 - any pinning failure falls back
            if not self._warned:
                self._warned = True
                warnings.warn(
                    f"annotate_offload: pinning {nbytes} bytes of host memory failed ({exc}); "
                    "falling back to pageable host memory. Offloading stays correct but the copies "
                    "become synchronous and slower. Free host memory or lower the number of "
                    "offloaded layers to get pinned buffers back.",
                    RuntimeWarning,
                    stacklevel=3,
                )
            return _HostBuffer(torch.empty(nbytes, dtype=torch.uint8), nbytes, False)

    # -- public -----------------------------------------------------------------------------
    def acquire(self, nbytes: int) -> _HostBuffer:
        """Return a buffer of exactly ``nbytes`` bytes (reused when one is free)."""
        with self._lock:
            bucket = self._free.get(nbytes)
            if bucket:
                buf = bucket.pop()
                self.in_use_bytes += nbytes
                return buf
        buf = self._allocate(nbytes)
        with self._lock:
            self.in_use_bytes += nbytes
            self.cached_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.cached_bytes)
        return buf

    def release(self, buf: _HostBuffer, last_read_event: Any = None) -> None:
        """Give ``buf`` back; ``last_read_event`` orders the next writer after the last H2D."""
        buf.last_read_event = last_read_event
        with self._lock:
            self.in_use_bytes -= buf.nbytes
            self._free.setdefault(buf.nbytes, []).append(buf)

    def trim(self) -> int:
        """Free every buffer not in use; returns the bytes freed."""
        with self._lock:
            buffers = [b for bucket in self._free.values() for b in bucket]
            self._free.clear()
            freed = sum(b.nbytes for b in buffers)
            self.cached_bytes -= freed
        for b in buffers:
            if b.registered_ptr:
                try:
                    torch.cuda.cudart().cudaHostUnregister(b.registered_ptr)
                except Exception:  # noqa: BLE001
                    pass
                b.registered_ptr = 0
        return freed

    @property
    def free_bytes(self) -> int:
        return self.cached_bytes - self.in_use_bytes

    def __repr__(self) -> str:
        return (
            f"PinnedBufferPool(pin={self.pin}, in_use_bytes={self.in_use_bytes}, "
            f"cached_bytes={self.cached_bytes}, peak_bytes={self.peak_bytes})"
        )


_POOLS: dict[str, PinnedBufferPool] = {}


def get_pool(device_type: str) -> PinnedBufferPool:
    """The process-wide pool for a backend (``"cuda"`` pins, ``"cpu"`` does not)."""
    pool = _POOLS.get(device_type)
    if pool is None:
        pool = _POOLS.setdefault(device_type, PinnedBufferPool(pin=device_type == "cuda"))
    return pool
