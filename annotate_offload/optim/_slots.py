"""Per-parameter and per-chunk records of :class:`HybridDeviceOptimizer` (private).

Note [Host step lifecycle] (one host-stepped parameter, overlap on):

1. backward: the post-accumulate-grad hook records a *ready* event on the compute stream, the
   D2H stream waits on it and copies the gradient into the slot's pinned buffer (``d2h_ev``);
   the slot remembers which gradient tensor and version it copied (``grad_ref``/``grad_ver``).
2. ``step()``: a gradient that was never copied, or was modified after the copy (clipping with
   ``torch.nn.utils.clip_grad_norm_``, a loss scaler's ``unscale_``), is copied again now, so the
   host always steps the gradient the GPU holds at ``step()`` time. ``clip_grad_norm_`` of the
   optimizer instead records the coefficient and multiplies the host copy (same fp32 product).
3. the training thread (the default mode; a worker thread with ``step_in_backward`` or
   ``delayed_param_update``) waits for each chunk's D2H events, runs the host optimizer on the chunk,
   writes bf16 staging if the model is bf16, and enqueues the H2D of the chunk on the H2D stream
   (which waited for the compute stream at ``step()``); the next chunk is stepped meanwhile.
4. ``step()`` returns after the compute stream waits on the last H2D event, so the next forward
   never reads a stale weight (Megatron-LM #3140 recorded that event on the wrong stream).
"""

from __future__ import annotations

import weakref
from typing import Any, Optional

import torch

__all__: list[str] = []


class HostSlot:
    """One parameter stepped by the host optimizer."""

    __slots__ = (
        "param", "group", "index", "local", "master", "grad_bufs", "staging", "scratch", "chunk",
        "grad_ref", "grad_ver", "grad_ptr", "valid", "use", "d2h_ev", "ready_ev", "scales", "p_ver", "submitted", "seq",
        "sub_group", "consumed",
    )

    def __init__(self, param: torch.Tensor, group: int, index: int, local: torch.Tensor) -> None:
        self.param = param
        self.group = group
        self.index = index
        self.local = local  # the tensor the model reads (param or its local shard)
        self.master: torch.Tensor = local  # replaced by a host view
        self.grad_bufs: list[torch.Tensor] = []
        self.staging: Optional[torch.Tensor] = None  # model-dtype pinned copy for H2D
        self.scratch: Optional[torch.Tensor] = None  # accumulation landing buffer (lazy)
        self.chunk = -1
        self.grad_ref: Optional[weakref.ref] = None
        self.grad_ver = -1
        self.grad_ptr = 0
        self.valid = False  # the host buffer holds this step's gradient
        self.consumed = False  # it holds the last step's, which step() consumed (offload_gradients)
        self.use = False  # step this parameter in the current step
        self.d2h_ev: Any = None
        self.ready_ev: Any = None
        self.scales: list[tuple[torch.Tensor, Any]] = []  # pending clip coefficients
        self.p_ver = -1
        self.submitted = False
        self.seq = -1  # D2H issue order of its gradient (Note [Host chunk order] in _pipeline.py)
        self.sub_group: dict[str, Any] = {}  # its group in the chunk's optimizer (set when that is built)

    def copied(self, g: torch.Tensor) -> bool:
        """True if the host buffer holds exactly ``g`` (the local gradient) as it is now.

        Identity is checked on ``param.grad`` (stable also for DTensor gradients, whose
        ``to_local()`` returns a new view object per call) and freshness on ``g``'s version.
        """
        return (
            self.valid and self.grad_ref is not None and self.grad_ref() is self.param.grad
            and self.grad_ptr == g.data_ptr() and g._version == self.grad_ver
        )

    def forget_copy(self) -> None:
        """Make ``step()`` copy this parameter's gradient again (it changed where versions do not show)."""
        self.valid = False
        self.grad_ref = None

    def reset_step(self, keep: bool = False) -> None:
        """End of ``step()``. ``keep``: the step raised before this slot's chunk was stepped, so
        its gradient and pending clip coefficients stay for a retried ``step()``."""
        self.use = False
        self.submitted = False
        self.ready_ev = None
        if keep:
            return
        self.scales = []
        self.consumed = self.valid
        self.valid = False
        self.grad_ref = None

    def __repr__(self) -> str:
        return f"HostSlot(group={self.group}, index={self.index}, shape={tuple(self.local.shape)}, chunk={self.chunk})"


class DevSlot:
    """One parameter stepped by the device optimizer (``inner`` is what that optimizer sees)."""

    __slots__ = ("param", "group", "index", "local", "inner", "p_ver", "sub_group")

    def __init__(self, param: torch.Tensor, group: int, index: int, local: torch.Tensor, inner: torch.Tensor) -> None:
        self.param = param
        self.group = group
        self.index = index
        self.local = local
        self.inner = inner
        self.p_ver = -1
        self.sub_group: dict[str, Any] = {}  # its group in the device optimizer (set when that is built)

    @property
    def has_master(self) -> bool:
        return self.inner is not self.param

    def __repr__(self) -> str:
        return f"DevSlot(group={self.group}, index={self.index}, master={self.has_master})"


class Chunk:
    """A run of host slots stepped by one host optimizer instance, the unit of pipelining."""

    __slots__ = ("slots", "opt", "links", "trainable", "landed", "h2d_ev", "pending", "serial")

    def __init__(self, slots: list[HostSlot], opt: torch.optim.Optimizer, links: list[tuple[dict, dict, tuple]], *,
                 serial: bool = False) -> None:
        self.slots = slots
        self.opt = opt
        self.serial = serial  # small tensors only: stepped with one thread (Note [Serial small tensors] in _split.py)
        self.links = links  # (sub-optimizer group, HDO group, keys to copy)
        self.trainable = sum(1 for s in slots if s.param.requires_grad)
        self.landed = 0
        self.h2d_ev: Any = None
        self.pending: list[HostSlot] = []  # stepped on the host, H2D not yet issued (delayed mode)

    @property
    def nbytes(self) -> int:
        return sum(s.master.numel() * s.master.element_size() for s in self.slots)

    def __repr__(self) -> str:
        return f"Chunk(params={len(self.slots)}, bytes={self.nbytes}, serial={self.serial})"
