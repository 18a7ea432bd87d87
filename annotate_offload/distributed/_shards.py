"""Parameter -> the tensor this rank stores, for plain tensors and DTensors (FSDP2) (private).

Note [Local shards]: ``HybridDeviceOptimizer`` resolves each parameter to the tensor this rank
owns once, at construction (``p.to_local()`` for a DTensor), and keeps host masters for exactly
those elements. FSDP2 keeps the same parameters and local storage for the whole run, but a user who
replaces a parameter (``load_state_dict(assign=True)``, ``to_empty``) or its local storage would
have the optimizer update storage the model no longer reads; :func:`check_local_shards` turns that
into an ``OffloadError`` at the next ``step()``.
"""

from __future__ import annotations

from typing import Any, Optional

import torch
from torch import nn

from ..errors import OffloadError
from ..optim import HybridDeviceOptimizer

__all__: list[str] = []


def is_dtensor(t: Any) -> bool:
    """True for a ``torch.distributed.tensor.DTensor`` (checked by name: no distributed import needed)."""
    return torch.is_tensor(t) and type(t).__name__ == "DTensor" and hasattr(t, "to_local")


def local_shard(t: torch.Tensor) -> torch.Tensor:
    """The tensor this rank stores for ``t`` (a DTensor's local shard, sharing storage), else ``t``."""
    if is_dtensor(t):
        with torch.no_grad():
            return t.to_local()
    return t


def shard_of(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(local shape, global offset)`` of this rank's piece of ``t`` (``t.shape`` and zeros for a plain tensor).

    Uses torch's own placement arithmetic, so uneven FSDP2 shards (a last rank with fewer rows or
    none) come out as DCP sees them.
    """
    if not is_dtensor(t):
        return tuple(t.shape), (0,) * t.dim()
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
    return tuple(shape), tuple(offset)


def _same_storage(a: torch.Tensor, b: torch.Tensor) -> bool:
    if a.numel() == 0 and b.numel() == 0:
        return True  # an empty shard has no storage to lose
    return (
        a.untyped_storage().data_ptr() == b.untyped_storage().data_ptr()
        and a.storage_offset() == b.storage_offset()
        and a.shape == b.shape
        and a.stride() == b.stride()
    )


def param_owners(model: nn.Module) -> dict[int, tuple[nn.Module, str, str]]:
    """``id(param) -> (owning module, attribute name, FQN)`` for every parameter of ``model``."""
    out: dict[int, tuple[nn.Module, str, str]] = {}
    for mname, mod in model.named_modules(remove_duplicate=False):
        for pname, p in mod.named_parameters(recurse=False):
            out.setdefault(id(p), (mod, pname, f"{mname}.{pname}" if mname else pname))
    return out


def check_optimizer(opt: Any, who: str) -> HybridDeviceOptimizer:
    """``opt`` as a ``HybridDeviceOptimizer``, also inside the wrappers frameworks return for it (accelerate's
    ``AcceleratedOptimizer``, Lightning's ``LightningOptimizer``: ``.optimizer``); ``TypeError`` if it is none."""
    inner = opt
    for _ in range(4):  # a wrapper of a wrapper at most, in practice
        if isinstance(inner, HybridDeviceOptimizer) or not isinstance(getattr(inner, "optimizer", None),
                                                                      torch.optim.Optimizer):
            break
        inner = inner.optimizer
    if not isinstance(inner, HybridDeviceOptimizer):
        raise TypeError(f"{who}: optimizer must be an annotate_offload.optim.HybridDeviceOptimizer, got {type(opt).__name__}.")
    return inner


def check_local_shards(opt: HybridDeviceOptimizer, owners: Optional[dict[int, tuple[nn.Module, str, str]]] = None,
                       who: str = "HybridDeviceOptimizer") -> None:
    """Raise ``OffloadError`` if a parameter of ``opt``, or its local storage, changed since construction."""
    for p, mine in opt.param_to_local.items():
        name = "?"
        if owners is not None and id(p) in owners:
            mod, attr, name = owners[id(p)]
            if getattr(mod, attr, None) is not p:
                raise OffloadError(
                    f"{who}: parameter {name!r} was replaced after the optimizer was built (e.g. load_state_dict(assign=True) "
                    "or to_empty); the optimizer would keep updating the old tensor. Load weights in place "
                    "(load_state_dict() without assign, or annotate_offload.distributed.load_checkpoint), or build the "
                    "optimizer after replacing the parameters.")
        if not _same_storage(mine, local_shard(p)):
            raise OffloadError(
                f"{who}: the local shard of parameter {name!r} (shape {tuple(mine.shape)}) now lives in other storage "
                "than when the optimizer was built (FSDP re-padding after an assign-style load, or .data replaced); its "
                "updates would be lost. Build the HybridDeviceOptimizer after the model's first forward / after loading, "
                "or load weights in place.")
