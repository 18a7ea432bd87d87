"""Which parameters :class:`HybridDeviceOptimizer` steps on the host, and in which chunks (private).

Split rule (Megatron-Core's): whole tensors; the budget is ``offload_fraction`` times the numel of
the trainable device-resident parameters; walk the param groups in order, each group in order,
and offload a parameter while the numel offloaded so far is below the budget (the last one may
overshoot by one tensor). Parameters already on the host always go to the host side and do not
count; frozen ones are never offloaded. A DTensor (FSDP2 shard) counts and is stepped through its
local shard (:func:`local_tensor`), so each rank offloads its own shards.
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional

import torch

__all__: list[str] = []


def local_tensor(p: Optional[torch.Tensor]) -> Any:
    """The tensor this rank stores for ``p`` (``p`` itself, or a DTensor's local shard)."""
    return p.to_local() if type(p).__name__ == "DTensor" and hasattr(p, "to_local") else p


def local_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    """The local part of ``p.grad`` (``None`` when there is no gradient)."""
    return local_tensor(p.grad)


class Placement(NamedTuple):
    """Where one parameter is stepped (``HybridDeviceOptimizer.placements``)."""

    group: int  # index in param_groups
    index: int  # index in that group's params
    shape: tuple  # local shape
    numel: int  # local element count
    side: str  # "cpu" (host optimizer) or "gpu" (device optimizer)
    chunk: int  # host chunk (and index in cpu_optimizers), -1 on the device side


def choose_offloaded(params: list[torch.Tensor], fraction: float,
                     on_device: Callable[[torch.Tensor], bool]) -> list[bool]:
    """Per parameter, in param-group order: ``True`` where it is stepped on the host."""
    budget = fraction * sum(local_tensor(p).numel() for p in params if p.requires_grad and on_device(p))
    done, out = 0, []
    for p in params:
        out.append(p.requires_grad and (not on_device(p) or done < budget))
        if out[-1] and on_device(p):
            done += local_tensor(p).numel()
    return out


def make_chunks(sizes_bytes: list[int], chunk_bytes: int) -> list[list[int]]:
    """Group consecutive items (in step order) into chunks of about ``chunk_bytes``; tensors are never
    split. An item that would overflow the current chunk starts a new one only if the current one is at
    least half full, so a bias in front of a chunk-sized weight joins it (each chunk costs a host
    optimizer call and a thread fork/join)."""
    chunks: list[list[int]] = []
    used = 0  # bytes in the last chunk
    for i, b in enumerate(sizes_bytes):
        if not chunks or used + b > chunk_bytes and 2 * used >= chunk_bytes:
            chunks.append([])
            used = 0
        chunks[-1].append(i)
        used += b
    return chunks


# Note [Serial small tensors]: torch's fused CPU AdamW runs one OpenMP parallel region per tensor,
# whatever its size, so a 2048-element norm weight wakes the whole thread team, and one descheduled
# thread stalls the region for a scheduler slice. Tensors under ``SERIAL_NUMEL`` elements are
# stepped in chunks of their own with one thread.
SERIAL_NUMEL = 1 << 16
SERIAL_CHUNK_BYTES = 1 << 20


def split_serial(groups: list[list[int]], numels: list[int], sizes_bytes: list[int],
                 chunk_bytes: int) -> list[tuple[list[int], bool]]:
    """Split the chunks of :func:`make_chunks` into ``(indices, serial)`` chunks, order preserved: each
    chunk's large tensors stay one chunk; its small ones collect, across chunks, into serial chunks that
    close at ``min(chunk_bytes, SERIAL_CHUNK_BYTES)`` (Note [Serial small tensors])."""
    out: list[tuple[list[int], bool]] = []
    small: list[int] = []
    small_bytes = 0
    for g in groups:
        if big := [i for i in g if numels[i] >= SERIAL_NUMEL]:
            out.append((big, False))
        for i in g:
            if numels[i] < SERIAL_NUMEL:
                small.append(i)
                small_bytes += sizes_bytes[i]
        if small and small_bytes >= min(chunk_bytes, SERIAL_CHUNK_BYTES):
            out.append((small, True))
            small, small_bytes = [], 0
    return out + [(small, True)] if small else out
