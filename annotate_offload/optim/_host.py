"""Host buffers of :class:`HybridDeviceOptimizer`: few large slabs, carved into per-param views (private).

Note [Host slabs]: PyTorch's caching host allocator rounds every pinned allocation up to a
power of two, so pinning each parameter's master and gradient separately can waste up to 2x
(reference/optimizer_offload.md §1.4, §9 item 8). The arena instead allocates slabs whose size
is already a power of two (at least ``MIN_SLAB_BYTES``, at least the largest tensor) and packs the
tensors into them in order, each view aligned to 64 bytes; only the last slab is sized to what it
holds (rounded up to a power of two). Slabs are allocated once, at construction, and kept for the
optimizer's lifetime: ``load_state_dict`` copies into them instead of re-allocating.
"""

from __future__ import annotations

import warnings

import torch

from ._device import empty_host

__all__: list[str] = []

MIN_SLAB_BYTES = 64 << 20
_ALIGN_BYTES = 64


def _next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def carve(numels: list[int], dtype: torch.dtype, *, pin: bool, what: str) -> tuple[list[torch.Tensor], bool]:
    """Allocate host views of ``numels`` elements of ``dtype`` from power-of-two slabs.

    Args:
        numels (list[int]): element count of each view, in packing order.
        dtype (torch.dtype): element type of every view.
        pin (bool): page-lock the slabs (``cudaHostAlloc`` through torch's host allocator).
        what (str): name used in the warning when pinning fails.

    Returns:
        ``(views, pinned)``: 1-D views in the order of ``numels`` (reshape them yourself) and
        whether every slab is pinned. A pinning failure falls back to pageable memory with one
        ``ResourceWarning``; it never raises.
    """
    esize = torch.empty((), dtype=dtype).element_size()
    align = max(1, _ALIGN_BYTES // esize)
    largest = max((n * esize for n in numels), default=0)
    slab_bytes = max(MIN_SLAB_BYTES, _next_pow2(largest))
    slab_numel = slab_bytes // esize
    # Pack: list of (slab index, offset) per view.
    places: list[tuple[int, int]] = []
    used: list[int] = []
    for n in numels:
        if not used or used[-1] + n > slab_numel:
            used.append(0)
        places.append((len(used) - 1, used[-1]))
        used[-1] += -(-n // align) * align
    slabs: list[torch.Tensor] = []
    all_pinned = True
    for i, u in enumerate(used):
        size = slab_numel if i < len(used) - 1 else max(align, _next_pow2(u * esize) // esize)
        slab, pinned = empty_host(size, dtype, pin)
        all_pinned &= pinned
        slabs.append(slab)
    if pin and not all_pinned:
        warnings.warn(
            f"HybridDeviceOptimizer: could not pin host memory for {what}; using pageable memory, "
            "so its copies are staged and synchronous. Raise the locked-memory limit (ulimit -l) or "
            "pass pin_cpu_params=False / pin_cpu_grads=False to silence this.",
            ResourceWarning,
            stacklevel=3,
        )
    views = [slabs[s].narrow(0, off, n) for (s, off), n in zip(places, numels)]
    return views, all_pinned and pin
