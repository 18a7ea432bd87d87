"""Storage units, view rebuilding, and TE's ``TensorGroup`` / ``TensorGroupProcessor``.

Note [Storage units] (DESIGN.md runtime rule 4). What crosses the link is never "a tensor" but a
byte range of a storage:

* a tensor, or a view whose memory span covers at least half of its storage (``x.t()``,
  ``x[:, 1:]``, interleaved q/k/v of one fused buffer), or any view marked
  ``offload_base_tensor``, moves its **whole storage** once and is rebuilt with
  ``as_strided(size, stride, storage_offset)``: strides and storage offsets are exactly what the
  consumer saw;
* a small view of a large storage moves only its own span (the offset is then relative to it);
* an expanded (stride-0) tensor moves its span, which is the un-expanded data: a
  ``(1, 4096)`` vector expanded to ``(64, 4096)`` moves 16 KiB, not 1 MiB.

Aliases are deduplicated by storage identity (not by ``id(tensor)``, and not by data pointer
alone, which conflated a tensor with its transpose in ms-swift PR #10157): each byte crosses the
link once per step.
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
    offset: int  # in elements of ``dtype``, relative to the unit's first byte


def _span_elems(t: torch.Tensor) -> tuple[int, int]:
    """``[lo, hi)`` element range of ``t`` inside its storage (strides must be non-negative)."""
    lo = t.storage_offset()
    hi = lo + 1
    for size, stride in zip(t.shape, t.stride()):
        if size == 0:
            return lo, lo
        hi += (size - 1) * stride
    return lo, hi


def _unit_range(t: torch.Tensor, whole: bool) -> Optional[tuple[int, int]]:
    """Byte range ``[lo, hi)`` of ``t``'s storage to move, or ``None`` if it cannot be moved."""
    if any(s < 0 for s in t.stride()):
        return None
    item = t.element_size()
    storage_bytes = t.untyped_storage().nbytes()
    lo, hi = _span_elems(t)
    lo_b, hi_b = lo * item, hi * item
    if hi_b > storage_bytes:
        return None
    if whole or 2 * (hi_b - lo_b) >= storage_bytes:
        if storage_bytes % item == 0:
            return 0, storage_bytes
    return lo_b, hi_b


def _flat_bytes(t: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """A ``uint8`` tensor aliasing bytes ``[lo, hi)`` of ``t``'s storage (no copy)."""
    flat = torch.empty(0, dtype=torch.uint8, device=t.device)
    flat.set_(t.untyped_storage(), lo, (hi - lo,), (1,))
    return flat


def _view_meta(t: torch.Tensor, lo: int) -> _ViewMeta:
    item = t.element_size()
    return _ViewMeta(t.dtype, tuple(t.shape), tuple(t.stride()), t.storage_offset() - lo // item)


def _rebuild(flat: torch.Tensor, meta: _ViewMeta) -> torch.Tensor:
    """Rebuild a saved tensor from its unit's flat ``uint8`` bytes, wherever they sit (no copy).

    ``as_strided`` takes an absolute storage offset: the unit starts at byte ``lo`` of the
    original storage when it is served before release, at byte 0 of a reload.
    """
    typed = flat.view(meta.dtype)
    return typed.as_strided(meta.shape, meta.stride, typed.storage_offset() + meta.offset)


@dataclasses.dataclass
class TensorGroup:
    """The tensors of one layer that move together (TransformerEngine's ``TensorGroup``).

    Attributes:
        tensor_list (list[torch.Tensor]): the tensors.
        events (list): one ready event per tensor (``None`` where none was recorded).
        aux (Any): what :class:`TensorGroupProcessor` needs to undo its processing.
    """

    tensor_list: list = dataclasses.field(default_factory=list)
    events: list = dataclasses.field(default_factory=list)
    aux: Any = None


class TensorGroupProcessor:
    """Shrink a group before offload and restore it after reload (TE-compatible static API).

    ``tensor_group_process_before_offload`` turns each tensor into its storage unit (see
    Note [Storage units]), deduplicates units by storage identity and byte range, and keeps for
    every aliased unit the **latest** ready event among its members (an aliased group must not
    start copying before its last writer is done). ``tensor_group_process_after_reload`` rebuilds
    every original tensor with ``as_strided`` on its reloaded unit, so views of one buffer stay
    views of one buffer. Stride-0 tensors are never materialised.
    """

    @staticmethod
    def tensor_group_process_before_offload(group: TensorGroup) -> tuple[TensorGroup, dict]:
        """Return ``(unit_group, aux)``: one contiguous flat ``uint8`` tensor per unique unit.

        Raises:
            ValueError: for a tensor with negative strides (it cannot be rebuilt by strides).
        """
        aux: dict = {"metas": [], "unit_index": []}
        units: list[torch.Tensor] = []
        events: list = []
        seen: dict[tuple, int] = {}
        for pos, t in enumerate(group.tensor_list):
            whole = bool(getattr(t, "offload_base_tensor", False))
            rng = _unit_range(t, whole)
            if rng is None:
                raise ValueError(
                    f"TensorGroupProcessor: tensor {pos} (shape {tuple(t.shape)}, stride "
                    f"{tuple(t.stride())}) cannot be described by its storage; do not offload it "
                    "(mark_not_offload) or make it contiguous first"
                )
            lo, hi = rng
            key = (t.untyped_storage()._cdata, lo, hi)
            event = group.events[pos] if pos < len(group.events) else None
            idx = seen.get(key)
            if idx is None:
                idx = seen[key] = len(units)
                units.append(_flat_bytes(t, lo, hi))
                events.append(event)
            elif event is not None:
                events[idx] = event  # later members are later on the stream: keep the latest
            aux["metas"].append(_view_meta(t, lo))
            aux["unit_index"].append(idx)
        return TensorGroup(units, events, aux), aux

    @staticmethod
    def tensor_group_process_after_reload(group: TensorGroup) -> TensorGroup:
        """Rebuild the original tensors from reloaded units (``group.aux`` from before offload).

        Raises:
            ValueError: if ``group.aux`` is missing.
        """
        if group.aux is None:
            raise ValueError(
                "TensorGroupProcessor: group.aux is None; pass the aux returned by "
                "tensor_group_process_before_offload"
            )
        aux = group.aux
        tensors = [
            _rebuild(group.tensor_list[idx], meta)
            for idx, meta in zip(aux["unit_index"], aux["metas"])
        ]
        events = [group.events[idx] if group.events else None for idx in aux["unit_index"]]
        return TensorGroup(tensors, events, None)
