"""Aligned host steps: ranks start their host optimizer step together (private).

Note [Aligned host steps]: ranks on one host share its memory bandwidth. In exact mode a rank
starts its host AdamW at ``step()``, and the fastest rank gets there first: its CPU has queued the
whole backward while its GPU still waits for the slower rank's collectives. Its 15 AdamW threads
then run while the slower rank's training thread is still dispatching backward, and that thread
slows down: session 3's FSDP2 traces (2 x H200, 32-core host, ``--bind``) show every CPU op of
one rank's backward 1.7-2x slower (``aten::mm`` dispatch 13.6 vs 7.1 ms per step) exactly while the
other rank stepped on the host, and the next forward of the first rank slowed the same way
while the second rank stepped. The slowdown is not core placement: the VM reports no SMT
siblings, and a dispatch-bound loop on one CPU slowed 1.24x with AdamW on the other 16 CPUs, 1.27x
with it on any other 16 (``benchmarks/diag_cpu.py``). It is shared memory, so the fix is time, not
place: each rank waits at ``step()`` until every rank arrived (a barrier on a gloo group: CPU only,
no device synchronization), then all ranks run their host steps at the same time and their
forward/backward phases at the same time. What the first rank gives up is starting its host
chunks while its GPU waits for the others' reduce-scatters, time it would otherwise lose at the
next collective anyway.

Only exact-mode steps are aligned: ``step_in_backward`` steps chunks inside backward and
``delayed_param_update`` overlaps the host update with the next forward by design.
"""

from __future__ import annotations

import time
from typing import Any, Optional

import torch.distributed as dist

__all__: list[str] = []


def aligned_mode(opt: Any) -> bool:
    """True when ``opt`` runs its host step inside ``step()`` (exact mode)."""
    d = opt.defaults
    return not d.get("step_in_backward", False) and not d.get("delayed_param_update", False)


class HostStepAlignment:
    """A step pre-hook: a CPU barrier over ``ranks`` before every ``step()`` (Note [Aligned host steps]).

    Attributes:
        waited_s (float): seconds this rank spent waiting in the barrier, cumulative.
        steps (int): barriers passed.
    """

    def __init__(self, ranks: Optional[list[int]] = None) -> None:
        self._group = dist.new_group(ranks=ranks, backend="gloo", use_local_synchronization=ranks is not None)
        self.waited_s = 0.0
        self.steps = 0

    def __call__(self, *_: Any) -> None:
        t0 = time.perf_counter()
        dist.barrier(group=self._group)
        self.waited_s += time.perf_counter() - t0
        self.steps += 1

    def __repr__(self) -> str:
        return f"HostStepAlignment(steps={self.steps}, waited_s={self.waited_s:.3f})"


def install(opt: Any, ranks: Optional[list[int]] = None) -> tuple[Optional[HostStepAlignment], Any]:
    """``(alignment, hook handle)`` for ``opt``, or ``(None, None)`` when there is nothing to align
    (one rank, or a mode that does not step inside ``step()``). Collective over ``ranks`` (every rank
    of the default group when ``None``): every rank must call it."""
    if not dist.is_initialized() or (len(ranks) if ranks is not None else dist.get_world_size()) < 2 or not aligned_mode(opt):
        return None, None
    a = HostStepAlignment(ranks)
    return a, opt.register_step_pre_hook(a)
