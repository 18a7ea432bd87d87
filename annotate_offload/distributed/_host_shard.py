"""DDP: each rank steps only its share of the host chunks, then the ranks broadcast the new weights (private).

Note [Host-step sharding]: under DDP every rank holds the same reduced gradients and weights, so a
replicated host step repeats the same work on every rank of a host, which share its memory
bandwidth. As in ZeRO-Offload, each rank steps only its share:

1. Ownership: host chunks are dealt largest first to the least-loaded rank (ties: lowest rank), a
   pure function of the chunk sizes, so every rank computes the same deal.
2. A rank copies D2H and steps only the chunks it owns.
3. A step post-hook broadcasts every host-stepped parameter from its owner, in one fixed order; the
   owner computed the same bits, so training is bit-identical to the replicated optimizer.
4. A rank holds host state for its own chunks only: ``optimizer.state_dict()`` refuses, and
   :func:`save_checkpoint` writes each parameter's state from its owner.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__: list[str] = []


def deal_chunks(nbytes: list[int], world: int) -> list[int]:
    """Owner rank of each chunk: largest first, each to the least-loaded rank (ties: lowest rank)."""
    load = [0] * world
    owner = [0] * len(nbytes)
    for ci in sorted(range(len(nbytes)), key=lambda i: (-nbytes[i], i)):
        r = min(range(world), key=lambda k: (load[k], k))
        owner[ci] = r
        load[r] += nbytes[ci]
    return owner


class HostShard:
    """This rank's share of an optimizer's host step under DDP (Note [Host-step sharding]).

    Attributes:
        owner (list[int]): group rank that steps each host chunk.
        rank (int): this process's rank in the group.
        broadcasts (int): parameters broadcast so far (cumulative).
    """

    def __init__(self, opt: Any, process_group: Any) -> None:
        self._pg = process_group
        self._chunks = opt.pipeline.chunk_tensors()
        self.rank = dist.get_rank(process_group)
        self.owner = deal_chunks([sum(t.numel() * t.element_size() for t in ts) for ts in self._chunks],
                                 dist.get_world_size(process_group))
        self._src = [dist.get_global_rank(process_group, r) if process_group is not None else r for r in self.owner]
        self.broadcasts = 0
        self._pipeline = opt.pipeline
        opt.pipeline.set_owner([o == self.rank for o in self.owner])
        self._handle = opt.register_step_post_hook(self._after_step)

    def owned_numel(self) -> int:
        """Host elements this rank steps."""
        return sum(t.numel() for ts, o in zip(self._chunks, self.owner) if o == self.rank for t in ts)

    def _after_step(self, *_: Any) -> None:
        """Broadcast every host-stepped parameter from its owner (collective)."""
        with torch.no_grad():
            works = [dist.broadcast(t, src=src, group=self._pg, async_op=True)
                     for ts, src in zip(self._chunks, self._src) for t in ts]
        for w in works:
            w.wait()  # NCCL: the current (compute) stream waits; gloo: done on return
        self._pipeline.note_written()  # a broadcast is not a user's load: no master is re-seeded from it
        self.broadcasts += len(works)

    def __repr__(self) -> str:
        mine = sum(1 for o in self.owner if o == self.rank)
        return f"HostShard(rank={self.rank}, chunks={mine}/{len(self.owner)}, host_numel={self.owned_numel()})"
