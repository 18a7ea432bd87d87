"""``HybridDeviceOptimizer.clip_grad_norm_``: one global norm over GPU and host gradients (private)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional

import torch

from ._slots import HostSlot
from ._split import local_grad

if TYPE_CHECKING:  # pragma: no cover
    from ._hybrid import HybridDeviceOptimizer

__all__: list[str] = []


def _host_scale(buf: torch.Tensor, gdt: torch.dtype, coef: torch.Tensor) -> None:
    if buf.dtype == gdt:
        buf.mul_(coef)
    else:
        buf.copy_(buf.to(gdt).mul_(coef))


def clip_hybrid(opt: "HybridDeviceOptimizer", max_norm: float, norm_type: float, error_if_nonfinite: bool, foreach: Optional[bool]) -> torch.Tensor:
    """See ``HybridDeviceOptimizer.clip_grad_norm_``.

    The norm is ``torch.nn.utils.get_total_norm`` over the gradients in ``param_groups`` order
    (GPU tensors where the GPU holds the gradient, the host buffer where only the host does), and
    the coefficient is torch's ``clamp(max_norm / (norm + 1e-6), max=1)``; GPU gradients are scaled
    in place, host copies get the same fp32 multiply before their step.
    """
    side = opt._side
    tensors: list[torch.Tensor] = []
    dev: list[tuple[Any, torch.Tensor]] = []  # (slot or None, gpu grad)
    host_only: list[HostSlot] = []
    with torch.no_grad():
        for g in opt.param_groups:
            for p in g["params"]:
                slot = opt._slot_of[id(p)]
                gl = local_grad(p)
                if isinstance(slot, HostSlot) and gl is None and slot.valid and opt._offload_grads:
                    side.synchronize(slot.d2h_ev)
                    buf = slot.grad_bufs[opt._buf]
                    for coef, ev in slot.scales:
                        side.synchronize(ev)
                        _host_scale(buf, slot.local.dtype, coef)
                    slot.scales = []
                    tensors.append(buf)
                    host_only.append(slot)
                elif gl is not None:
                    tensors.append(gl)
                    dev.append((slot, gl))
        if not tensors:
            return torch.tensor(0.0)
        total = torch.nn.utils.get_total_norm(tensors, norm_type, error_if_nonfinite, foreach)
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        pre_copied = [s for s, gl in dev if isinstance(s, HostSlot) and s.copied(gl)]
        if pre_copied or host_only:
            host_coef = torch.empty((), dtype=coef.dtype, pin_memory=side.can_pin)
            host_coef.copy_(coef, non_blocking=True)
            ev = side.record(side.current_stream())
            for s in (*pre_copied, *host_only):
                s.scales.append((host_coef, ev))
        if opt._d2h is not None and dev:
            # the in-place scaling below must not race a D2H of the same gradient still in flight
            side.wait_stream(side.current_stream(), opt._d2h)
        by_dev: dict[torch.device, list[torch.Tensor]] = {}
        for _, gl in dev:
            by_dev.setdefault(gl.device, []).append(gl)
        for d, grads in by_dev.items():
            c = coef.to(d)
            if foreach is None or foreach:
                torch._foreach_mul_(grads, c)
            else:
                for gl in grads:
                    gl.mul_(c)
        for s in pre_copied:
            gl = local_grad(s.param)
            s.grad_ver = gl._version  # the host copy + pending coefficient equals the scaled GPU gradient
    # like torch.nn.utils.clip_grad_norm_, the norm lives on the parameters' device (get_total_norm
    # puts it on the device of the first tensor, which is a host buffer when that grad is offloaded)
    first = next((p for g in opt.param_groups for p in g["params"]), None)
    return total.to(first.device) if first is not None else total
