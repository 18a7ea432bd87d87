"""Storage units, and TransformerEngine's ``TensorGroup`` / ``TensorGroupProcessor``: how saved
tensors are grouped, deduplicated and rebuilt, by the runtime and by code that calls TE's names.

Note [Storage units]. What crosses the link is never "a tensor" but a byte range of a storage:

* a tensor, or a view whose memory span covers at least half of its storage (``x.t()``,
  ``x[:, 1:]``, interleaved q/k/v of one fused buffer), or any view marked
  ``offload_base_tensor``, moves its **whole storage** once;
* a small view of a large storage moves only its own span;
* an expanded (stride-0) tensor moves its span, which is the un-expanded data: a
  ``(1, 4096)`` vector expanded to ``(64, 4096)`` moves 16 KiB, not 1 MiB.

Every saved tensor is rebuilt with ``as_strided(size, stride, offset)`` on its unit's bytes,
wherever they sit (the original storage, a host copy, a reload), with ``offset`` the unit's own
(absolute) storage offset plus the tensor's offset inside the unit. Units are deduplicated by
storage identity, byte range and version (a data pointer alone would conflate a tensor with its
transpose): each byte crosses the link once per step, and an aliased unit waits for the latest ready
event among its members.
"""

from __future__ import annotations

import dataclasses
from typing import Any, NamedTuple, Optional

import torch

__all__ = ["TensorGroup", "TensorGroupProcessor"]


class _ViewMeta(NamedTuple):
    """How to rebuild one saved tensor from its unit's flat bytes."""

    dtype: torch.dtype
    shape: tuple
    stride: tuple
    offset: int  # in elements of ``dtype``, from the unit's first byte
    conj: bool  # the lazy conjugate and negative bits (``x.conj()``, ``x.conj().imag``): the bytes are without them
    neg: bool


def _view_meta(t: torch.Tensor, lo: int) -> _ViewMeta:
    """How to rebuild ``t`` from the bytes of a unit that starts at byte ``lo`` of its storage."""
    return _ViewMeta(t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset() - lo // t.element_size(),
                     t.is_conj(), t.is_neg())


def _unit_range(t: torch.Tensor, whole: bool) -> Optional[tuple[int, int]]:
    """Byte range ``[lo, hi)`` of ``t``'s storage to move, or ``None`` if it cannot be moved."""
    if any(s < 0 for s in t.stride()):
        return None
    lo = hi = t.storage_offset()
    if t.numel():
        hi += 1 + sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    item, storage_bytes = t.element_size(), t.untyped_storage().nbytes()
    lo, hi = lo * item, hi * item
    if hi > storage_bytes:
        return None
    if (whole or 2 * (hi - lo) >= storage_bytes) and storage_bytes % item == 0:
        return 0, storage_bytes
    return lo, hi


def _holds(lo: int, hi: int, rng: tuple[int, int], t: torch.Tensor) -> bool:
    """Whether a unit's bytes ``[lo, hi)`` contain ``t``'s range ``rng`` as whole elements of ``t``'s dtype
    (a view of another dtype over the same storage may start mid-element: ``t`` then gets a unit of its own)."""
    return lo <= rng[0] and rng[1] <= hi and lo % t.element_size() == 0 and (hi - lo) % t.element_size() == 0


def _flat_bytes(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """A ``uint8`` tensor aliasing bytes ``[lo, hi)`` of ``t``'s storage (no copy)."""
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    return flat.set_(t.untyped_storage(), lo, (hi - lo,), (1,))


def _rebuild(flat: torch.Tensor, meta: _ViewMeta) -> torch.Tensor:
    """Rebuild a saved tensor from its unit's flat ``uint8`` bytes, wherever they sit (no copy)."""
    typed = flat.view(meta.dtype)
    t = typed.as_strided(meta.shape, meta.stride, typed.storage_offset() + meta.offset)
    t = torch._neg_view(t) if meta.neg else t
    return t.conj() if meta.conj else t


@dataclasses.dataclass
class TensorGroup:
    """Tensors that move together (TransformerEngine's ``TensorGroup``).

    Attributes:
        tensor_list (list[torch.Tensor]): the tensors.
        events (list): one event per tensor (``None`` where none was recorded).
        aux (Any): what :class:`TensorGroupProcessor` needs to undo its processing.
    """

    tensor_list: list = dataclasses.field(default_factory=list)
    events: list = dataclasses.field(default_factory=list)
    aux: Any = None


class TensorGroupProcessor:
    """Shrink a group to storage units before offload and rebuild it after reload (TE's API;
    Note [Storage units]). A layer's ``fwd_gpu_tensor_group`` in the runtime is such a unit group,
    filled one save at a time by the same helpers."""

    @staticmethod
    def tensor_group_process_before_offload(group: TensorGroup) -> tuple[TensorGroup, dict]:
        """Return ``(unit_group, aux)``: one contiguous flat ``uint8`` tensor per unique unit.

        Raises:
            ValueError: for a tensor with negative strides (it cannot be rebuilt by strides).
        """
        units = TensorGroup(aux=TensorGroupProcessor._new_aux())
        for pos, t in enumerate(group.tensor_list):
            rng = _unit_range(t, bool(getattr(t, "offload_base_tensor", False)))
            if rng is None:
                raise ValueError(
                    f"TensorGroupProcessor: tensor {pos} (shape {tuple(t.shape)}, stride {tuple(t.stride())}) "
                    "cannot be described by its storage; do not offload it (mark_not_offload) or make it "
                    "contiguous first"
                )
            event = group.events[pos] if pos < len(group.events) else None
            unit = TensorGroupProcessor._find(units, t, rng)
            if unit is None:
                unit = TensorGroupProcessor._add_unit(units, t, rng, event)
            elif event is not None:
                units.events[unit] = event  # later members are later on the stream: keep the latest
            TensorGroupProcessor._add_view(units, t, unit)
        return units, units.aux

    @staticmethod
    def tensor_group_process_after_reload(group: TensorGroup) -> TensorGroup:
        """Rebuild the original tensors from their units (``group.aux`` from before offload).

        Raises:
            ValueError: if ``group.aux`` is missing.
        """
        if group.aux is None:
            raise ValueError(
                "TensorGroupProcessor: group.aux is None; pass the aux returned by "
                "tensor_group_process_before_offload"
            )
        aux = group.aux
        tensors = [_rebuild(group.tensor_list[u], meta) for u, meta in zip(aux["unit_index"], aux["metas"])]
        events = [group.events[u] if group.events else None for u in aux["unit_index"]]
        return TensorGroup(tensors, events, None)

    # -- one save at a time (the runtime's path) ---------------------------------------------
    @staticmethod
    def _new_aux() -> dict:
        # units: (storage id, lo, hi, version) per unit; by_storage: storage id -> its units;
        # metas / unit_index: per saved tensor
        return {"units": [], "by_storage": {}, "metas": [], "unit_index": []}

    @staticmethod
    def _find(units: TensorGroup, t: torch.Tensor, rng: tuple[int, int]) -> Optional[int]:
        """The unit still holding its device bytes that holds ``t``'s range (:func:`_holds`) at ``t``'s version."""
        for u in units.aux["by_storage"].get(t.untyped_storage()._cdata, ()):
            _, lo, hi, version = units.aux["units"][u]
            if version == t._version and _holds(lo, hi, rng, t) and units.tensor_list[u] is not None:
                return u
        return None

    @staticmethod
    def _add_unit(units: TensorGroup, t: torch.Tensor, rng: tuple[int, int], event: Any) -> int:
        units.tensor_list.append(_flat_bytes(t, *rng))
        units.events.append(event)
        sid, unit = t.untyped_storage()._cdata, len(units.tensor_list) - 1
        units.aux["units"].append((sid, rng[0], rng[1], t._version))
        units.aux["by_storage"].setdefault(sid, []).append(unit)
        return unit

    @staticmethod
    def _add_view(units: TensorGroup, t: torch.Tensor, unit: int) -> int:
        """Record how ``t`` is rebuilt from ``unit``; returns its position in ``aux``."""
        units.aux["metas"].append(_view_meta(t, units.aux["units"][unit][1]))
        units.aux["unit_index"].append(unit)
        return len(units.aux["metas"]) - 1
