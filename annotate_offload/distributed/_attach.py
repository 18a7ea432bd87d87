"""``attach_optimizer``: wire a ``HybridDeviceOptimizer`` to a DDP or FSDP2 model (private).

FSDP2 calls the sharded parameters' post-accumulate-grad hooks after the reduce-scatter, so the
optimizer's own hooks already copy the reduced local shard. The attachment adds the guard of Note
[Local shards] (``_shards.py``), DTensor gradient version tracking, and a refusal of the
optimizer's shard-local ``clip_grad_norm_``.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ..errors import OffloadError
from ._ddp import OffloadCommHook, register_offload_comm_hook
from ._shards import check_local_shards, check_optimizer, is_dtensor, param_owners

__all__: list[str] = []


class _SeenVersion:
    """Post-accumulate-grad hook (runs after the optimizer's): the DTensor gradient's version when copied."""

    __slots__ = ("seen",)

    def __init__(self, seen: dict[int, int]) -> None:
        self.seen = seen

    def __call__(self, p: torch.Tensor) -> None:
        if p.grad is not None:
            self.seen[id(p)] = p.grad._version


class ShardedAttachment:
    """What :func:`attach_optimizer` installed on an FSDP2 (or plain) model.

    Note [DTensor gradient versions]: the optimizer skips the copy at ``step()`` of a gradient it copied
    in backward whose local tensor's version is unchanged. In-place ops on a DTensor bump only the
    wrapper's version, and ``torch._foreach_*`` ops (``clip_grad_norm_``, ``GradScaler.unscale_``)
    bump neither. The attachment records the wrapper's version when the gradient lands and makes
    ``step()`` copy again when it moved; after foreach transforms use this package's
    :func:`clip_grad_norm_` or call :meth:`mark_gradients_changed`.

    Attributes:
        sharded (bool): some parameters are DTensors (each rank steps its local shard).
        recopied (int): host gradients copied again at ``step()`` because they changed after backward.
        copied_at_step (int): host gradients ``step()`` had to copy, ``recopied`` ones included (cumulative).
    """

    def __init__(self, opt: Any, model: nn.Module, sharded: bool) -> None:
        self._opt = opt
        self._owners = param_owners(model)
        self.sharded = sharded
        self.recopied = self.copied_at_step = 0
        self._seen: dict[int, int] = {}
        pl = opt.pipeline
        self._watched = [p for p in pl.params if is_dtensor(p) and p.requires_grad]
        self._hooks = [p.register_post_accumulate_grad_hook(_SeenVersion(self._seen)) for p in self._watched]
        self._handle: Any = opt.register_step_pre_hook(self._before_step)

    def _before_step(self, *_: Any) -> None:
        check_local_shards(self._opt, self._owners, who="HybridDeviceOptimizer.step")
        pl = self._opt.pipeline
        for p in self._watched:
            g = p.grad
            if g is not None and self._seen.get(id(p), g._version) != g._version:
                pl.forget_copy(p)
                self.recopied += 1
        self._seen.clear()
        self.copied_at_step += pl.uncopied(skip_batched=True)

    def mark_gradients_changed(self) -> None:
        """Declare that gradients were modified in place after backward in a way versions do not show
        (``torch._foreach_*``): ``step()`` copies every host-stepped gradient again."""
        for p in self._watched:
            if p.grad is not None:
                self._opt.pipeline.forget_copy(p)
                self.recopied += 1
        self._seen.clear()

    def detach(self) -> None:
        """Remove the hooks (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
            for h in self._hooks:
                h.remove()
            self._hooks = []
            self._opt.__dict__.pop("clip_grad_norm_", None)

    def __repr__(self) -> str:
        return f"ShardedAttachment(sharded={self.sharded})"


def _refuse_local_clip(*_: Any, **__: Any) -> torch.Tensor:
    raise OffloadError(
        "HybridDeviceOptimizer.clip_grad_norm_: under FSDP2 its norm would cover only this rank's shard. Clip with "
        "annotate_offload.distributed.clip_grad_norm_(model.parameters(), max_norm, optimizer=opt) (global norm over "
        "the DTensor gradients; it refuses offload_gradients=True, whose gradients it cannot see) before opt.step()."
    )


def attach_optimizer(model: nn.Module, optimizer: Any, *, shard_host_step: bool = True) -> "OffloadCommHook | ShardedAttachment":
    """Wire a ``HybridDeviceOptimizer`` to a model trained with torch.distributed, one process per device;
    call once, after wrapping the model and building the optimizer on its parameters, before the first backward.

    * ``DistributedDataParallel``: the optimizer's gradient hooks are replaced by a comm hook that
      all-reduces each bucket and then starts the D2H of its host-stepped gradients (Note [DDP and
      host-stepped gradients] in ``_ddp.py``; needs ``gradient_as_bucket_view=True`` to overlap).
    * FSDP2 or a plain module: a step pre-hook raises ``OffloadError`` if a parameter or its local
      storage was replaced (Note [Local shards]); with sharded parameters the optimizer's
      ``clip_grad_norm_`` is refused in favour of :func:`annotate_offload.distributed.clip_grad_norm_`.
      After ``torch.nn.utils.clip_grad_norm_`` call ``attachment.mark_gradients_changed()``.

    Args:
        model (nn.Module): the DDP-wrapped or ``fully_shard``-ed model.
        optimizer (HybridDeviceOptimizer): built on ``model``'s parameters.
        shard_host_step (bool): DDP only: each rank steps ``1/W`` of the host chunks and the ranks
            broadcast the new weights (Note [Host-step sharding] in ``_host_shard.py``); checkpoints
            then go through :func:`save_checkpoint`. Ownership is per host chunk (``chunk_bytes``),
            so a host half smaller than ``W`` chunks leaves some ranks idle. Default: ``True``.

    Returns:
        OffloadCommHook | ShardedAttachment: DDP: the comm hook, with copy counters; else the attachment.

    Raises:
        TypeError: ``model`` is not an ``nn.Module``, ``optimizer`` not a ``HybridDeviceOptimizer``,
            or (DDP) ``shard_host_step`` not a bool.
        ValueError: the optimizer steps parameters ``model`` does not own; DDP: ``shard_host_step``
            with ``delayed_param_update=True``, or ``offload_gradients=True``.
        OffloadError: DDP: the model already has a communication hook; FSDP2: the optimizer is attached already.

    Warns:
        UserWarning: DDP with ``gradient_as_bucket_view=False`` (no D2H overlap with backward).

    Example::

        ddp = DistributedDataParallel(model, gradient_as_bucket_view=True)
        opt = HybridDeviceOptimizer(ddp.parameters(), offload_fraction=0.5, lr=1e-4)
        attach_optimizer(ddp, opt)
    """
    from torch.nn.parallel import DistributedDataParallel

    if not isinstance(model, nn.Module):
        raise TypeError(f"attach_optimizer: model must be an nn.Module, got {type(model).__name__}.")
    opt = check_optimizer(optimizer, "attach_optimizer")
    owned = {id(p) for p in model.parameters()}
    params = [p for g in opt.param_groups for p in g["params"]]
    foreign = [tuple(p.shape) for p in params if id(p) not in owned]
    if foreign:
        raise ValueError(
            f"attach_optimizer: the optimizer steps {len(foreign)} parameter(s) the model does not own (shapes "
            f"{foreign[:3]}); build it on model.parameters() after wrapping the model (DDP, fully_shard)."
        )
    if isinstance(model, DistributedDataParallel):
        return register_offload_comm_hook(model, opt, shard_host_step=shard_host_step)
    if opt.__dict__.get("clip_grad_norm_") is _refuse_local_clip:
        raise OffloadError("attach_optimizer: this optimizer is attached to an FSDP2 model already; attach it once.")
    sharded = any(is_dtensor(p) for p in params)
    att = ShardedAttachment(opt, model, sharded)
    if sharded:
        opt.__dict__["clip_grad_norm_"] = _refuse_local_clip
    return att
