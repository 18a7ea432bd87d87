"""Which parameters :class:`HybridDeviceOptimizer` steps on the host, and in which chunks (private).

Split rule (Megatron-Core's, reference/optimizer_offload.md §1.3): whole tensors; the budget is
``offload_fraction x`` the total numel of trainable device-resident parameters; walk the
param groups in order, then each group in order, and offload a parameter while the numel
offloaded so far is below the budget (the last one may overshoot by one tensor). ``0`` offloads
nothing, ``1`` everything. Parameters already on the host always go to the host side and do not
count; frozen parameters (``requires_grad=False``) are never offloaded and do not count.

Distributed seam: every place that needs "the tensor this rank owns" goes through
:func:`local_tensor` / :func:`local_grad`. For a plain tensor that is the tensor itself; for a
DTensor (FSDP2 shard) it is ``to_local()``, so per-rank offload of shards only has to be
finished here and in the placement of results, not spread through the optimizer.
"""

from __future__ import annotations

from typing import Callable, NamedTuple, Optional

import torch

__all__: list[str] = []


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def local_tensor(p: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores for parameter ``p`` (``p`` itself, or a DTensor's local shard)."""
    return p.to_local() if _is_dtensor(p) else p


def local_grad(p: torch.Tensor) -> Optional[torch.Tensor]:
    """The local part of ``p.grad`` (``None`` when the parameter has no gradient)."""
    g = p.grad
    if g is None:
        return None
    return g.to_local() if _is_dtensor(g) else g


class Placement(NamedTuple):
    """Where one parameter is stepped (``HybridDeviceOptimizer.placements``).

    Attributes:
        group (int): index in ``param_groups``.
        index (int): index in that group's ``params``.
        shape (tuple[int, ...]): local shape.
        numel (int): local element count.
        side (str): ``"cpu"`` (host optimizer) or ``"gpu"`` (device optimizer).
        chunk (int): host chunk index, ``-1`` on the device side.
    """

    group: int
    index: int
    shape: tuple
    numel: int
    side: str
    chunk: int


def choose_offloaded(
    groups: list[list[torch.Tensor]], fraction: float, on_device: Callable[[torch.Tensor], bool]
) -> list[list[bool]]:
    """Per group, per param: ``True`` where the parameter is stepped on the host."""
    total = sum(local_tensor(p).numel() for g in groups for p in g if p.requires_grad and on_device(p))
    budget = fraction * total
    done = 0
    out: list[list[bool]] = []
    for g in groups:
        row = []
        for p in g:
            if not p.requires_grad:
                row.append(False)
            elif not on_device(p):
                row.append(True)
            elif done < budget:
                done += local_tensor(p).numel()
                row.append(True)
            else:
                row.append(False)
        out.append(row)
    return out


def make_chunks(sizes_bytes: list[int], chunk_bytes: int) -> list[list[int]]:
    """Group consecutive items (already in step order) into chunks of about ``chunk_bytes``.

    An item that would push the current chunk past ``chunk_bytes`` starts a new chunk only if the
    current one is at least half full; otherwise it joins it (a chunk holds at most
    ``chunk_bytes / 2`` plus its largest item). Without that rule a bias in front of a weight of
    ``chunk_bytes`` formed a chunk of its own: the W3 GPT model (issue 7) got 121 chunks, 25 of them
    under 8 MiB, each paying a full host optimizer call, a thread-pool fork/join and its own events,
    instead of 73 of about 64 MiB. A single item larger than ``chunk_bytes`` forms its own chunk
    (tensors are never split).
    """
    chunks: list[list[int]] = []
    cur: list[int] = []
    cur_bytes = 0
    for i, b in enumerate(sizes_bytes):
        if cur and cur_bytes + b > chunk_bytes and 2 * cur_bytes >= chunk_bytes:
            chunks.append(cur)
            cur, cur_bytes = [], 0
        cur.append(i)
        cur_bytes += b
    if cur:
        chunks.append(cur)
    return chunks


# Note [Serial small tensors]: torch's fused CPU AdamW runs one OpenMP parallel region per tensor,
# whatever its size (``parallel_for`` with grain 0): a 2048-element LayerNorm weight wakes the whole
# thread team, and one descheduled thread (a busy training thread, a VM's stolen vCPU) stalls the
# region for a scheduler slice. The W3 GPT model has 192 such tensors next to 96 large ones. Tensors
# under ``SERIAL_NUMEL`` elements are therefore stepped in chunks of their own with one thread.
SERIAL_NUMEL = 1 << 16
SERIAL_CHUNK_BYTES = 1 << 20


def split_serial(groups: list[list[int]], numels: list[int], sizes_bytes: list[int], chunk_bytes: int) -> list[tuple[list[int], bool]]:
    """Split the chunks of :func:`make_chunks` into ``(indices, serial)`` chunks, order preserved.

    Each group's large tensors (``>= SERIAL_NUMEL`` elements) stay one chunk; its small ones are
    collected, across groups, into serial chunks that close once they hold
    ``min(chunk_bytes, SERIAL_CHUNK_BYTES)`` (Note [Serial small tensors]). A serial chunk comes after
    the large chunk of the group that completed it, so no chunk waits for gradients that land later
    than those of the chunks before it by more than that group.
    """
    out: list[tuple[list[int], bool]] = []
    small: list[int] = []
    small_bytes = 0
    limit = min(chunk_bytes, SERIAL_CHUNK_BYTES)
    for g in groups:
        big = [i for i in g if numels[i] >= SERIAL_NUMEL]
        if big:
            out.append((big, False))
        for i in g:
            if numels[i] < SERIAL_NUMEL:
                small.append(i)
                small_bytes += sizes_bytes[i]
        if small and small_bytes >= limit:
            out.append((small, True))
            small, small_bytes = [], 0
    if small:
        out.append((small, True))
    return out
