"""DDP: each rank steps only its share of the host chunks, then the ranks broadcast the new weights (private).

Note [Host-step sharding]: under DDP every rank holds the same reduced gradients and the same
weights, so a replicated ``HybridDeviceOptimizer`` repeats the whole host step on every rank. The
ranks of one host then share its memory bandwidth: measured on the 2-GPU H200 machine (issue 9),
fused CPU AdamW falls from 4.2 G params/s for one process to 2.3-2.9 G params/s per rank when both
step at once, so the replicated host step alone costs each rank ~1.5-1.8x what it costs one GPU
(weak-scaling efficiency 64-73% at f = 0.5, benchmarks/NOTES.md). Sharding the host step, as
ZeRO-Offload partitions optimizer state across data-parallel ranks, divides that work by the world
size instead:

1. Ownership: the host chunks (the optimizer's pipelining units) are dealt to ranks largest first,
   each to the least-loaded rank (ties: lowest rank), so every rank owns about ``1/W`` of the host
   bytes. The split is a pure function of the chunk sizes: every rank computes the same one.
2. Backward: a rank copies D2H only the reduced gradients of chunks it owns and steps only those
   (the worker, ``step_in_backward`` and the serial path all skip the others).
3. ``step()``: once the compute stream has waited for this rank's H2D, every host-stepped
   parameter is broadcast from its owner, in one fixed order on every rank (DDP's process group;
   NCCL runs them on its stream after the H2D, and the compute stream waits for them before the
   next forward). The bits are the owner's, computed from the same reduced gradient with the
   same kernel, so training is bit-identical to the replicated optimizer.
4. State: a rank holds host optimizer state for its own chunks only. ``optimizer.state_dict()``
   refuses (``OffloadError``); :func:`annotate_offload.distributed.optimizer_state_dict` and
   :func:`save_checkpoint` write each parameter's state from its owner (DCP saves keys held by
   one rank from that rank), and loading fills every rank, so checkpoints load at any world size,
   fraction or sharding.

Not supported with ``delayed_param_update=True`` (its H2D lands in the next ``step()`` and in
``flush()``, which would then have to be collective); pass ``shard_host_step=False`` there.
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
    """The optimizer's ``_shard`` under DDP (Note [Host-step sharding]).

    Attributes:
        owner (list[int]): group rank that steps each host chunk.
        rank (int): this process's rank in the group.
        broadcasts (int): parameters broadcast so far (cumulative).
    """

    def __init__(self, opt: Any, process_group: Any) -> None:
        self._opt = opt
        self._pg = process_group
        world = dist.get_world_size(process_group)
        self.rank = dist.get_rank(process_group)
        self.owner = deal_chunks([c.nbytes for c in opt._chunks], world)
        self._src = [dist.get_global_rank(process_group, r) if process_group is not None else r for r in self.owner]
        self.broadcasts = 0

    def owns(self, ci: int) -> bool:
        return self.owner[ci] == self.rank

    def owned_numel(self) -> int:
        """Host elements this rank steps."""
        return sum(s.local.numel() for c, o in zip(self._opt._chunks, self.owner) if o == self.rank for s in c.slots)

    def after_h2d(self) -> None:
        """Broadcast every host-stepped parameter from its owner (collective; called in ``step()``)."""
        opt = self._opt
        works = []
        with torch.no_grad():
            for ci, c in enumerate(opt._chunks):
                src = self._src[ci]
                for s in c.slots:
                    works.append(dist.broadcast(s.local, src=src, group=self._pg, async_op=True))
        for w in works:
            w.wait()  # NCCL: the current (compute) stream waits; gloo: done on return
        for s in opt._host_slots:
            s.p_ver = s.param._version  # a broadcast is not a user write (O03 re-seeding must not fire)
        self.broadcasts += len(works)

    def __repr__(self) -> str:
        mine = sum(1 for o in self.owner if o == self.rank)
        return f"HostShard(rank={self.rank}, chunks={mine}/{len(self.owner)}, host_numel={self.owned_numel()})"
