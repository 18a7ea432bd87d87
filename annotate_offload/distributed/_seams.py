"""The few private parts of :class:`HybridDeviceOptimizer` the distributed layer relies on (private).

Everything here stands in for a public seam requested from the optimizer's owner
(docs/requests_distributed.md); keeping the accesses in one module means one place to switch
when those land, and a clear ``OffloadError`` instead of an ``AttributeError`` if the optimizer's
internals move first.
"""

from __future__ import annotations

from typing import Any, Iterator, Optional

import torch

from ..errors import OffloadError
from ..optim import HybridDeviceOptimizer
from ..optim._slots import HostSlot

__all__: list[str] = []

_NEEDED = ("_hooks", "_slot_of", "_host_slots", "_dev_slots", "_on_grad", "_chunks", "_shard", "_steps_here", "_batched")


def check_optimizer(opt: Any, who: str) -> HybridDeviceOptimizer:
    """``opt`` as a ``HybridDeviceOptimizer`` whose internals this layer knows.

    Raises:
        TypeError: ``opt`` is not a ``HybridDeviceOptimizer``.
        OffloadError: the optimizer's internals changed (this package and ``annotate_offload.optim``
            are out of step).
    """
    if not isinstance(opt, HybridDeviceOptimizer):
        raise TypeError(f"{who}: optimizer must be an annotate_offload.optim.HybridDeviceOptimizer, got {type(opt).__name__}.")
    missing = [n for n in _NEEDED if not hasattr(opt, n)]
    if missing:
        raise OffloadError(
            f"{who}: this HybridDeviceOptimizer lacks {missing}; annotate_offload.distributed and annotate_offload.optim "
            "are out of step (see docs/requests_distributed.md for the seams it needs)."
        )
    return opt


def remove_grad_hooks(opt: HybridDeviceOptimizer) -> int:
    """Remove the optimizer's post-accumulate-grad hooks; returns how many there were."""
    n = len(opt._hooks)
    for h in opt._hooks:
        h.remove()
    opt._hooks = []
    return n


def host_slot(opt: HybridDeviceOptimizer, p: torch.Tensor) -> Optional[Any]:
    """The host slot of ``p`` (``None`` when ``p`` is stepped on the device or not in ``opt``)."""
    s = opt._slot_of.get(id(p))
    return s if isinstance(s, HostSlot) else None


def grad_ready(opt: HybridDeviceOptimizer, slot: Any) -> None:
    """Start the D2H of ``slot``'s current (final, reduced) gradient, as the optimizer's own hook would."""
    opt._on_grad(slot)


def slots(opt: HybridDeviceOptimizer) -> Iterator[tuple[Any, bool]]:
    """``(slot, on_host)`` for every parameter of ``opt``."""
    for s in opt._host_slots:
        yield s, True
    for d in opt._dev_slots:
        yield d, False


def grad_copied(slot: Any, g: Optional[torch.Tensor]) -> bool:
    """True when the host buffer of ``slot`` already holds ``g`` as it is now (no copy at ``step()``)."""
    return g is not None and slot.copied(g)


def offloads_gradients(opt: HybridDeviceOptimizer) -> bool:
    """The ``offload_gradients`` constructor flag (kept in ``defaults``)."""
    return bool(opt.defaults.get("offload_gradients", False))


def forget_grad_copy(slot: Any) -> None:
    """Make ``step()`` copy ``slot``'s gradient again (its device gradient changed unseen)."""
    slot.forget_copy()


def set_shard(opt: HybridDeviceOptimizer, shard: Any) -> Any:
    """Install the host-step sharding of Note [Host-step sharding] (``_host_shard.py``); returns it."""
    if getattr(opt, "_shard", None) is not None:
        raise OffloadError("HybridDeviceOptimizer: its host step is already sharded (attach the optimizer once).")
    opt._shard = shard
    return shard


def steps_here(opt: HybridDeviceOptimizer, slot: Any) -> bool:
    """True when this rank runs the host step of ``slot`` (always, unless the host step is sharded)."""
    return opt._steps_here(slot.chunk)


def batched(opt: HybridDeviceOptimizer, slot: Any) -> bool:
    """True when ``slot``'s gradient is copied at ``step()`` with the other tiny ones, by design
    (Note [Tiny gradients at step()] in ``optim/_pipeline.py``)."""
    return opt._batched(slot)
