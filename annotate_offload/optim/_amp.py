"""``torch.amp.GradScaler`` support of :class:`HybridDeviceOptimizer` (private).

Note [GradScaler]: GradScaler's ``unscale_`` rescales ``p.grad`` in place with
``torch._amp_foreach_non_finite_check_and_unscale_``, which does not bump the gradient's version
counter. The host copies that the backward hooks made (Note [Host step lifecycle] in
``_slots.py``) looked current, so the host half stepped on gradients still multiplied by the loss
scale (fresh-user report, seventh session: SGD updates 65536x too large, AdamW off by 2e-3 after
one step). The optimizer therefore declares ``_step_supports_amp_scaling``, the contract torch's
fused optimizers use: ``GradScaler.step`` no longer unscales the gradients itself but sets
``grad_scale`` and ``found_inf`` on the optimizer for the duration of ``step()``. Then:

- ``found_inf`` non-zero: nothing is stepped (read once on the host: the host half must know).
  torch's fused kernels skip the update and undo the step count, and GradScaler's standard path
  skips ``step()``; the state ends up the same either way.
- ``grad_scale`` set (the gradients are still scaled): each sub-optimizer gets the scale the way
  torch's fused optimizers do (``grad_scale``/``found_inf`` attributes, on its own device). A
  sub-optimizer class without that support gets what GradScaler's standard path does instead:
  its gradients are multiplied by ``1 / scale`` (fp32, as ``GradScaler.unscale_`` computes it)
  before its step. Either way the result is bit-identical to the same optimizer class under
  GradScaler without offload.
- ``grad_scale`` is ``None`` (the user called ``scaler.unscale_(opt)``, e.g. to clip): ``p.grad``
  was rescaled in place, so every host copy is stale and ``step()`` copies the gradients again.

Not supported, with an :class:`OffloadError` raised before anything is stepped:
``offload_gradients=True`` (GradScaler's inf/NaN check reads ``p.grad``, which the hooks freed) and
``step_in_backward=True`` (chunks are stepped in backward, before the scale and the inf check are
known).
"""

from __future__ import annotations

import contextlib
from typing import TYPE_CHECKING, Iterator, NamedTuple, Optional

import torch

from ..errors import OffloadError
from ._split import local_grad

if TYPE_CHECKING:  # pragma: no cover
    from ._hybrid import HybridDeviceOptimizer

__all__: list[str] = []


class AmpStep(NamedTuple):
    """What GradScaler asked of one ``step()``."""

    skip: bool  # inf/NaN found: step nothing
    scale: Optional[torch.Tensor]  # GradScaler's scale (its device), None when nothing to unscale
    found: Optional[torch.Tensor]  # GradScaler's found_inf (its device; zero when not skipping)
    host_scale: Optional[torch.Tensor]  # CPU copies for the host half (the scale may change in place
    host_found: Optional[torch.Tensor]  # at scaler.update() before a delayed host step runs)
    host_inv: Optional[torch.Tensor]  # fp32 1/scale on the CPU, for host classes without the support


def supports(opt: torch.optim.Optimizer) -> bool:
    """True when ``opt`` unscales through ``grad_scale``/``found_inf`` (torch's fused optimizers)."""
    return bool(getattr(opt, "_step_supports_amp_scaling", False))


def inverse(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` as ``GradScaler.unscale_`` computes it (fp64 reciprocal, then fp32)."""
    return scale.double().reciprocal().float()


def begin(opt: "HybridDeviceOptimizer") -> Optional[AmpStep]:
    """Read what a GradScaler set on ``opt`` for this ``step()`` (``None`` without one).

    Raises:
        OffloadError: GradScaler with ``offload_gradients=True`` or ``step_in_backward=True``.
    """
    found = getattr(opt, "found_inf", None)
    if found is None:
        return None
    if opt._offload_grads:
        raise OffloadError(
            "HybridDeviceOptimizer: GradScaler with offload_gradients=True is not supported: the scaler checks p.grad "
            "for inf/NaN, and the backward hooks already freed the host-stepped gradients on the GPU, so it would miss "
            "them. Build the optimizer with offload_gradients=False when training with GradScaler (fp16)."
        )
    if opt._in_backward:
        if opt._worker is not None:  # chunks already stepped in backward: let them land before raising
            opt._worker.drain()
            side = opt._side
            side.wait_event(side.current_stream(), side.record(opt._h2d))
        raise OffloadError(
            "HybridDeviceOptimizer: GradScaler with step_in_backward=True is not supported: host chunks were stepped "
            "in backward, before the scaler's inf/NaN check and unscaling, so this step already used scaled gradients. "
            "Use the default mode (or delayed_param_update=True) with GradScaler, and restart from a checkpoint."
        )
    if bool(found.item()):
        return AmpStep(True, None, None, None, None, None)
    scale = getattr(opt, "grad_scale", None)
    if scale is None:
        # scaler.unscale_(opt) ran: p.grad changed in place with its version unchanged (Note [GradScaler]);
        # the copy again also drops coefficients pending for the old one (_copied)
        for s in opt._host_slots:
            if local_grad(s.param) is not None:
                s.forget_copy()
        return AmpStep(False, None, None, None, None, None)
    host_scale = scale.detach().to("cpu", torch.float32, copy=True)
    return AmpStep(False, scale, found, host_scale, torch.zeros((), dtype=torch.float32), inverse(host_scale))


@contextlib.contextmanager
def handed_over(opt: torch.optim.Optimizer, amp: Optional[AmpStep], *, host: bool) -> Iterator[None]:
    """For one ``opt.step()``: ``grad_scale``/``found_inf`` set on ``opt`` (the host copies for a host
    sub-optimizer) the way GradScaler hands them to torch's fused optimizers, when this step
    unscales and ``opt`` supports it; otherwise nothing."""
    if amp is None or amp.scale is None or not supports(opt):
        yield
        return
    opt.grad_scale, opt.found_inf = (amp.host_scale, amp.host_found) if host else (amp.scale, amp.found)
    try:
        yield
    finally:
        del opt.grad_scale, opt.found_inf


def unscale_device_grads(grads: list[torch.Tensor], scale: torch.Tensor) -> None:
    """What ``GradScaler.unscale_`` does to ``grads`` (in place, per dtype), for a device optimizer
    class without ``_step_supports_amp_scaling``."""
    inv = inverse(scale)
    dummy = torch.zeros((), dtype=torch.float32, device=scale.device)
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for g in grads:
        by_dtype.setdefault(g.dtype, []).append(g)
    for gs in by_dtype.values():
        torch._amp_foreach_non_finite_check_and_unscale_(gs, dummy, inv)
