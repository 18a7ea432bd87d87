"""Global-norm gradient clipping for sharded (FSDP2) parameters that the host step sees (private)."""

from __future__ import annotations

from typing import Any, Iterable, Optional

import torch

from ..errors import OffloadError
from ._shards import check_optimizer, is_dtensor

__all__: list[str] = []


def clip_grad_norm_(
    parameters: Iterable[torch.Tensor],
    max_norm: float,
    norm_type: float = 2.0,
    *,
    error_if_nonfinite: bool = False,
    optimizer: Optional[Any] = None,
) -> torch.Tensor:
    """``torch.nn.utils.clip_grad_norm_`` for DTensor (FSDP2) or plain gradients, with one in-place multiply
    per gradient so that an attached optimizer re-copies it (Note [DTensor gradient versions] in ``_attach.py``).

    Args:
        parameters (Iterable[torch.Tensor]): parameters whose ``.grad`` is clipped (``None`` grads skipped).
        max_norm (float): maximum total norm.
        norm_type (float): p of the p-norm; ``inf`` for the max norm. Default: ``2.0``.
        error_if_nonfinite (bool): raise if the total norm is nan/inf. Default: ``False``.
        optimizer (HybridDeviceOptimizer | None): checked for ``offload_gradients=True``, whose host-held
            gradients this function cannot see. Default: ``None``.

    Returns:
        torch.Tensor: the total norm (a plain 0-dim tensor, the same on every rank).

    Raises:
        ValueError: ``max_norm`` is not a positive number.
        OffloadError: ``optimizer`` frees device gradients (``offload_gradients=True``).
    """
    if isinstance(max_norm, bool) or not isinstance(max_norm, (int, float)) or not max_norm > 0:
        raise ValueError(f"clip_grad_norm_: max_norm must be a positive number, got {max_norm!r}.")
    if optimizer is not None and check_optimizer(optimizer, "clip_grad_norm_").defaults["offload_gradients"]:
        raise OffloadError(
            "clip_grad_norm_: the optimizer has offload_gradients=True, so the host-stepped gradients are no longer on "
            "the device and would be left out of the norm. Build it with offload_gradients=False to clip under FSDP2."
        )
    grads = [p.grad for p in parameters if p.grad is not None]
    if not grads:
        return torch.tensor(0.0)
    with torch.no_grad():
        total = torch.nn.utils.get_total_norm(grads, norm_type, error_if_nonfinite)
        if is_dtensor(total):
            total = total.full_tensor()
        coef = torch.clamp(max_norm / (total + 1e-6), max=1.0)
        for g in grads:
            g.mul_(coef.to(g.device))
    return total
