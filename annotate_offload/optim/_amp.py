"""``torch.amp.GradScaler`` support of :class:`HybridDeviceOptimizer` (private).

Note [GradScaler]: ``GradScaler.unscale_`` rescales ``p.grad`` in place without bumping its version,
so a host copy would look current while still scaled. The optimizer therefore declares
``_step_supports_amp_scaling`` (torch's fused optimizers' contract): ``GradScaler.step`` sets
``grad_scale`` and ``found_inf`` instead. A step with ``found_inf`` steps nothing; otherwise each
sub-optimizer gets the scale as torch's fused optimizers do, or GradScaler's own unscale first when its
class lacks the support: bit-identical to the same class under GradScaler. After ``scaler.unscale_``
every host copy is made again. ``offload_gradients`` and ``step_in_backward`` miss the inf check: refused.
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
    scale: Optional[torch.Tensor] = None  # the scaler's scale and found_inf (their device); None: no unscaling
    found: Optional[torch.Tensor] = None
    host_scale: Optional[torch.Tensor] = None  # CPU copies for the host half (the scaler changes its own
    host_found: Optional[torch.Tensor] = None  # in place, maybe before a delayed host step runs)
    host_inv: Optional[torch.Tensor] = None  # inverse(host_scale), for host classes that take no scale


def inverse(scale: torch.Tensor) -> torch.Tensor:
    """``1 / scale`` as ``GradScaler.unscale_`` computes it (fp64 reciprocal, then fp32)."""
    return scale.double().reciprocal().float()


def takes_scale(opt: torch.optim.Optimizer, amp: Optional[AmpStep]) -> Optional[bool]:
    """Who unscales ``opt``'s gradients in this step: ``None`` nobody (no scale to undo), ``True``
    ``opt.step()`` itself (:func:`handed_over`), ``False`` the caller first (GradScaler's ``unscale_``)."""
    return None if amp is None or amp.scale is None else bool(getattr(opt, "_step_supports_amp_scaling", False))


def begin(opt: Any) -> Optional[AmpStep]:
    """What a GradScaler set on ``opt`` (a ``HybridDeviceOptimizer``) for this ``step()``, or ``None``."""
    found = getattr(opt, "found_inf", None)
    if found is None:
        return None
    for flag in ("offload_gradients", "step_in_backward"):
        if opt.defaults[flag]:
            raise OffloadError(f"HybridDeviceOptimizer: GradScaler with {flag}=True is not supported (Note [GradScaler]): "
                               f"the host gradients miss the scaler's inf/NaN check. Build the optimizer with {flag}=False "
                               "to train with GradScaler (fp16).")
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
    """``grad_scale``/``found_inf`` set on ``opt`` for one ``opt.step()``, as GradScaler hands them to
    torch's fused optimizers, when this step unscales and ``opt`` supports it."""
    if not takes_scale(opt, amp):
        yield
        return
    opt.grad_scale, opt.found_inf = (amp.host_scale, amp.host_found) if host else (amp.scale, amp.found)
    try:
        yield
    finally:
        del opt.grad_scale, opt.found_inf


def unscale_(grads: list[torch.Tensor], scale: torch.Tensor) -> None:
    """What ``GradScaler.unscale_`` does to ``grads`` (in place, per dtype and device)."""
    by: dict[Any, list[torch.Tensor]] = {}
    for g in grads:
        by.setdefault((g.dtype, g.device), []).append(g)
    for (_, dev), gs in by.items():
        torch._amp_foreach_non_finite_check_and_unscale_(gs, torch.zeros((), device=dev), inverse(scale).to(dev))
