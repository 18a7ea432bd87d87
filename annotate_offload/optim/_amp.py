"""``torch.amp.GradScaler`` support of :class:`HybridDeviceOptimizer` (private).

Note [GradScaler]: ``GradScaler.unscale_`` rescales ``p.grad`` in place without bumping its
version counter, so a host copy made in backward would look current and the host would step
gradients still multiplied by the loss scale. The optimizer therefore declares
``_step_supports_amp_scaling``, the contract of torch's fused optimizers: ``GradScaler.step``
does not unscale but sets ``grad_scale`` and ``found_inf`` on the optimizer for ``step()``. Then

- ``found_inf`` non-zero: nothing is stepped (read on the host, which must know);
- ``grad_scale`` set: each sub-optimizer gets it as torch's fused optimizers do (on its own
  device); a class without that support gets what GradScaler's own path does, its gradients
  multiplied by the fp32 ``1 / scale`` before its step. Either way the result is bit-identical to
  the same class under GradScaler without offload;
- ``grad_scale`` is ``None`` (the user called ``scaler.unscale_(opt)``): every host copy is stale
  and ``step()`` copies the gradients again.

``offload_gradients`` (the scaler's inf/NaN check reads ``p.grad``, which the hooks freed) and
``step_in_backward`` (chunks stepped before the check) are refused with an ``OffloadError``.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, NamedTuple, Optional

import torch

from ..errors import OffloadError

__all__: list[str] = []


class AmpStep(NamedTuple):
    """What GradScaler asked of one ``step()``."""

    skip: bool  # inf/NaN found: step nothing
    scale: Optional[torch.Tensor] = None  # the scaler's scale (its device); None: nothing to unscale
    found: Optional[torch.Tensor] = None
    host_scale: Optional[torch.Tensor] = None  # CPU copies for the host half (the scaler may change
    host_found: Optional[torch.Tensor] = None  # its tensors in place before a delayed host step runs)
    host_inv: Optional[torch.Tensor] = None  # fp32 1/scale on the CPU, for classes without the support


def supports(opt: torch.optim.Optimizer) -> bool:
    """True when ``opt`` unscales through ``grad_scale``/``found_inf`` (torch's fused optimizers)."""
    return bool(getattr(opt, "_step_supports_amp_scaling", False))


def inverse(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` as ``GradScaler.unscale_`` computes it (fp64 reciprocal, then fp32)."""
    return scale.double().reciprocal().float()


def begin(opt: Any) -> Optional[AmpStep]:
    """What a GradScaler set on ``opt`` (a ``HybridDeviceOptimizer``) for this ``step()``, or ``None``.

    Raises:
        OffloadError: GradScaler with ``offload_gradients=True`` or ``step_in_backward=True``.
    """
    found = getattr(opt, "found_inf", None)
    if found is None:
        return None
    for flag, why in (("offload_gradients", "the scaler checks p.grad for inf/NaN, which the backward hooks freed"),
                      ("step_in_backward", "host chunks were stepped in backward, before the scaler's inf/NaN check")):
        if opt.defaults[flag]:
            raise OffloadError(f"HybridDeviceOptimizer: GradScaler with {flag}=True is not supported: {why}. Build the "
                               f"optimizer with {flag}=False to train with GradScaler (fp16).")
    if bool(found.item()):
        return AmpStep(True)
    scale = getattr(opt, "grad_scale", None)
    if scale is None:  # scaler.unscale_(opt) ran: p.grad changed in place, versions unchanged
        opt.pipeline.forget_copy()
        return AmpStep(False)
    host = scale.detach().to("cpu", torch.float32, copy=True)
    return AmpStep(False, scale, found, host, torch.zeros((), dtype=torch.float32), inverse(host))


@contextlib.contextmanager
def handed_over(opt: torch.optim.Optimizer, amp: Optional[AmpStep], *, host: bool) -> Iterator[None]:
    """For one ``opt.step()``: ``grad_scale``/``found_inf`` set on ``opt`` the way GradScaler hands them to
    torch's fused optimizers, when this step unscales and ``opt`` supports it; otherwise nothing."""
    if amp is None or amp.scale is None or not supports(opt):
        yield
        return
    opt.grad_scale, opt.found_inf = (amp.host_scale, amp.host_found) if host else (amp.scale, amp.found)
    try:
        yield
    finally:
        del opt.grad_scale, opt.found_inf


def unscale_(grads: list[torch.Tensor], inv: torch.Tensor) -> None:
    """What ``GradScaler.unscale_`` does to ``grads`` (in place, per dtype and device)."""
    by: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        by.setdefault((g.dtype, g.device), []).append(g)
    for (_, dev), gs in by.items():
        torch._amp_foreach_non_finite_check_and_unscale_(gs, torch.zeros((), device=dev), inv.to(dev))
