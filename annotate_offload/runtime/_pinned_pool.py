"""A pool of host buffers for offloaded activations, reused across steps.

Note [Pinned pool]: pinning is expensive the first time and torch's caching host allocator rounds
every block up to a power of two, so the pool allocates each buffer at its exact size (page-aligned
pageable memory registered with ``cudaHostRegister``) and reuses freed buffers of that size on the
next step. Without registration it falls back to torch's pinned allocator, and when pinning fails to
pageable memory with a warning. A buffer comes back with the event of the last copy that used it;
whoever takes it next makes its D2H stream wait for that event before overwriting it.
"""

from __future__ import annotations

import threading
import warnings
from typing import Any, Optional

import torch

__all__: list[str] = []

_PAGE = 4096


class PinnedBufferPool:
    """Exact-size host buffers (flat ``uint8`` CPU tensors), reused across steps.

    Args:
        pin (bool): pin the buffers (``True`` on CUDA, ``False`` on the CPU backend, where host
            buffers are plain CPU tensors).

    Attributes:
        in_use_bytes (int): bytes currently handed out.
        cached_bytes (int): bytes allocated by the pool in total (in use + free).
        peak_bytes (int): high-water mark of ``cached_bytes``.
    """

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: dict[int, list[tuple[torch.Tensor, Any]]] = {}
        self._registered: set[int] = set()  # data pointers pinned with cudaHostRegister
        self._lock = threading.Lock()
        self.in_use_bytes = 0
        self.cached_bytes = 0
        self.peak_bytes = 0
        self._warned = False
        self._use_register: Optional[bool] = None

    def _pin(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of pinned host memory: registered in place when possible (exact size)."""
        if self._use_register is None:
            self._use_register = hasattr(torch.cuda, "cudart")
        if self._use_register:
            raw = torch.empty(nbytes + _PAGE, dtype=torch.uint8)
            shift = (-raw.data_ptr()) % _PAGE
            tensor = raw[shift : shift + nbytes]
            length = min(-(-nbytes // _PAGE) * _PAGE, raw.numel() - shift)
            try:
                if int(torch.cuda.cudart().cudaHostRegister(tensor.data_ptr(), length, 0)) == 0:
                    self._registered.add(tensor.data_ptr())
                    return tensor
            except Exception:  # noqa: BLE001
                pass
            self._use_register = False  # registration unsupported: use torch's pinned allocator
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)

    def _allocate(self, nbytes: int) -> torch.Tensor:
        if self.pin:
            try:
                return self._pin(nbytes)
            except Exception as exc:  # noqa: BLE001 - any pinning failure falls back
                if not self._warned:
                    self._warned = True
                    warnings.warn(
                        f"offload runtime: pinning {nbytes} bytes of host memory failed ({exc}); "
                        "falling back to pageable host memory. Offloading stays correct but the copies "
                        "become synchronous and slower. Free host memory or lower the number of "
                        "offloaded layers to get pinned buffers back.",
                        RuntimeWarning,
                        stacklevel=4,
                    )
        return torch.empty(nbytes, dtype=torch.uint8)

    def acquire(self, nbytes: int) -> tuple[torch.Tensor, Any]:
        """A buffer of exactly ``nbytes`` bytes (reused when one is free), and the event its
        previous user's last copy recorded (``None`` if new): wait for it before writing."""
        with self._lock:
            bucket = self._free.get(nbytes)
            if bucket:
                self.in_use_bytes += nbytes
                return bucket.pop()
        buf = self._allocate(nbytes)
        with self._lock:
            self.in_use_bytes += nbytes
            self.cached_bytes += nbytes
            self.peak_bytes = max(self.peak_bytes, self.cached_bytes)
        return buf, None

    def release(self, buf: torch.Tensor, last_use: Any = None) -> None:
        """Give ``buf`` back; ``last_use`` is the event of the last copy that read or wrote it."""
        with self._lock:
            self.in_use_bytes -= buf.numel()
            self._free.setdefault(buf.numel(), []).append((buf, last_use))

    def trim(self) -> int:
        """Free every buffer not in use; returns the bytes freed."""
        with self._lock:
            buffers = [b for bucket in self._free.values() for b, _ in bucket]
            self._free.clear()
            freed = sum(b.numel() for b in buffers)
            self.cached_bytes -= freed
        for b in buffers:
            if b.data_ptr() in self._registered:
                self._registered.discard(b.data_ptr())
                try:
                    torch.cuda.cudart().cudaHostUnregister(b.data_ptr())
                except Exception:  # noqa: BLE001
                    pass
        return freed

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
