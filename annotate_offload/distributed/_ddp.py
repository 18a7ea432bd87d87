"""DDP: the host step sees all-reduced gradients, and each bucket's D2H starts when its all-reduce ends (private).

Note [DDP and host-stepped gradients]: the optimizer's post-accumulate-grad hooks fire on the
*local* gradient, before DDP's bucket all-reduce, so a D2H started there would carry this rank's
gradient, not the mean. :func:`attach_optimizer` removes those hooks and installs a comm hook that
divides each bucket by the world size and all-reduces it (torch's default ``allreduce_hook``, same
bits), then, in the future's callback, starts the D2H of the bucket's host-stepped gradients
through the optimizer's own path. With ``gradient_as_bucket_view=True`` ``p.grad`` is the reduced
bucket view, so ``step()`` sees the same tensor at the same version and does not copy again; a later
in-place change bumps the version and is re-copied. With ``gradient_as_bucket_view=False`` DDP fills
``p.grad`` only at the end of backward, so every D2H happens at ``step()`` (a warning says so).
"""

from __future__ import annotations

import threading
import warnings
from typing import Any

import torch
import torch.distributed as dist

from ..errors import OffloadError

__all__: list[str] = []


class OffloadCommHook:
    """The DDP communication hook that :func:`attach_optimizer` installs (one per DDP model).

    Attributes:
        copied_in_hook (int): host-stepped gradients whose D2H started in a bucket callback (cumulative).
        copied_at_step (int): host-stepped gradients that ``step()`` still had to copy (cumulative).
        overlapped (bool): ``gradient_as_bucket_view`` was on, so D2H starts in backward.
        shard (HostShard | None): this rank's share of the host step; ``None``: every rank steps all.
    """

    def __init__(self, opt: Any, process_group: Any, overlapped: bool) -> None:
        self._pipeline = opt.pipeline
        self._pg = process_group
        self._lock = threading.Lock()  # gloo runs bucket callbacks on several worker threads
        self.overlapped = overlapped
        self.copied_in_hook = 0
        self.copied_at_step = 0
        self._pre_step = None
        self.shard: Any = None

    def allreduce_then_copy(self, state, bucket):  # no annotations: DDP's _check_comm_hook compares them by value
        """The hook DDP calls per bucket: mean all-reduce, then the D2H of its host-stepped gradients."""
        buf = bucket.buffer()
        buf.div_(self._pg.size() if self._pg is not None else dist.get_world_size())
        params = list(bucket.parameters()) if self.overlapped else []
        fut = dist.all_reduce(buf, group=self._pg, async_op=True).get_future()
        return fut.then(lambda f: self._reduced(f, params))

    def _reduced(self, fut: torch.futures.Future, params: list[torch.Tensor]) -> torch.Tensor:
        out = fut.value()[0]
        if not params:
            return out
        lo = out.data_ptr()
        hi = lo + out.numel() * out.element_size()
        pl = self._pipeline
        with self._lock:
            for p in params:
                g = p.grad  # device-stepped, or not (yet) the reduced bucket view: copied at step()
                if pl.is_host(p) and g is not None and lo <= g.data_ptr() < hi and pl.grad_ready(p):
                    self.copied_in_hook += 1  # (grad_ready skips parameters another rank steps)
        return out

    def _before_step(self, *_: Any) -> None:
        self.copied_at_step += self._pipeline.uncopied()

    def __repr__(self) -> str:
        return f"OffloadCommHook(overlapped={self.overlapped}, copied_in_hook={self.copied_in_hook}, copied_at_step={self.copied_at_step})"


def register_offload_comm_hook(ddp_model: Any, opt: Any, *, shard_host_step: bool) -> OffloadCommHook:
    """The DDP half of :func:`attach_optimizer`, which documents it and checks model and optimizer."""
    if opt.defaults["offload_gradients"]:
        raise ValueError(
            "register_offload_comm_hook: the optimizer has offload_gradients=True; under DDP the gradient bucket stays "
            "allocated, so freeing p.grad saves no GPU memory and breaks gradient_as_bucket_view. Build it with "
            "offload_gradients=False, or shard gradients with FSDP2 (fully_shard) instead."
        )
    if not isinstance(shard_host_step, bool):
        raise TypeError(f"register_offload_comm_hook: shard_host_step must be True or False, got {shard_host_step!r}.")
    if shard_host_step and opt.defaults.get("delayed_param_update", False):
        raise ValueError(
            "register_offload_comm_hook: shard_host_step=True is not supported with delayed_param_update=True (the delayed "
            "H2D lands in the next step() and in flush(), which would have to be collective); pass shard_host_step=False."
        )
    overlapped = bool(getattr(ddp_model, "gradient_as_bucket_view", False))
    if not overlapped:
        warnings.warn(
            "register_offload_comm_hook: DistributedDataParallel(gradient_as_bucket_view=False) copies the reduced "
            "gradients into p.grad only at the end of backward, so the host-stepped gradients are copied at step() "
            "instead of during backward. Pass gradient_as_bucket_view=True to overlap the D2H with backward.",
            UserWarning,
            stacklevel=2,
        )
    hook = OffloadCommHook(opt, ddp_model.process_group, overlapped)
    try:
        ddp_model.register_comm_hook(None, hook.allreduce_then_copy)
    except RuntimeError as e:  # nothing of ours is installed yet
        raise OffloadError(
            "register_offload_comm_hook: this DistributedDataParallel model already has a communication hook "
            f"({e}); attach_optimizer must be called once per DDP model, and not on a model that has another comm "
            "hook."
        ) from e
    opt.pipeline.remove_grad_hooks()
    if shard_host_step and dist.get_world_size(ddp_model.process_group) > 1:
        from ._host_shard import HostShard

        hook.shard = HostShard(opt, ddp_model.process_group)
    hook._pre_step = opt.register_step_pre_hook(hook._before_step)
    return hook
