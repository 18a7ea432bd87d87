"""Per-tensor marks read by the offload runtime, and the selection policy switch.

Marks are plain Python attributes on the tensor object, as in TransformerEngine: a different alias
of the same storage (``detach()``, a view) does not inherit them.

``mark_not_offload`` sets TE's ``_TE_do_not_offload`` (Megatron's ``_do_not_offload`` is honoured
too), ``mark_activation_offload`` the opt-in mark ``activation_offloading``, and ``start_offload``
TE's ready event ``start_reload_event``. ``NVTE_CPU_OFFLOAD_V1=1`` selects the opt-in policy for the
whole process; like TE it is read once, at import.
"""

from __future__ import annotations

import os
from typing import Literal

import torch
import torch.utils._pytree as pytree

__all__ = [
    "mark_activation_offload",
    "mark_not_offload",
    "start_offload",
    "default_policy",
]

Policy = Literal["opt_out", "opt_in"]

_NVTE_CPU_OFFLOAD_V1: bool = os.environ.get("NVTE_CPU_OFFLOAD_V1", "0") == "1"

_POLICIES = ("opt_out", "opt_in")


def default_policy() -> Policy:
    """``"opt_in"`` when ``NVTE_CPU_OFFLOAD_V1=1`` was set at import, else ``"opt_out"``."""
    return "opt_in" if _NVTE_CPU_OFFLOAD_V1 else "opt_out"


def check_policy(policy: object) -> Policy:
    """Validate a policy value; ``None`` means :func:`default_policy`."""
    if policy is None:
        return default_policy()
    if policy not in _POLICIES:
        raise ValueError(
            f"policy={policy!r} is not a selection policy; use 'opt_out' (offload every eligible "
            "tensor unless mark_not_offload) or 'opt_in' (only tensors marked with "
            "mark_activation_offload / activation_offloading=True)"
        )
    return policy  # type: ignore[return-value]


def _tensors(args: tuple, fn: str) -> list[torch.Tensor]:
    """The tensors of ``args`` (nested lists and tuples flattened, ``None`` skipped), all checked first."""
    leaves = pytree.tree_leaves(list(args), is_leaf=lambda x: not isinstance(x, (list, tuple)))  # a dict is refused
    flat = [t for t in leaves if t is not None]
    if (bad := next((t for t in flat if not isinstance(t, torch.Tensor)), None)) is not None:
        raise TypeError(
            f"{fn}() takes tensors, got {type(bad).__name__}; pass the tensors themselves "
            "(lists and tuples of tensors are accepted)"
        )
    return flat


def mark_not_offload(*tensors: torch.Tensor) -> None:
    """Keep these tensors on the device even when they are saved inside an offload scope.

    Use it for tensors the model keeps alive anyway (layer outputs, residuals, caches, weight
    copies): copying them costs link bandwidth and frees nothing.

    The mark is read when autograd saves the tensor, and only later saves see it. An op that saves
    its input saves it when you call the op, so mark the tensor before passing it on. An op that
    saves its own output (``relu``, ``sigmoid``, ``tanh``, ``exp``) saves it before returning it:
    in ``h = torch.relu(a(x)); mark_not_offload(h)`` relu's save of ``h`` is already offloaded, and
    only the next op's save of ``h`` stays on the device.

    Args:
        *tensors: tensors (or lists/tuples of tensors; ``None`` is skipped).

    Raises:
        TypeError: for an argument that is not a tensor.
    """
    for t in _tensors(tensors, "mark_not_offload"):
        t._TE_do_not_offload = True
        _traced_mark(t, False)


def mark_activation_offload(*tensors: torch.Tensor) -> None:
    """Select these tensors for offloading under the opt-in policy (``activation_offloading``).

    Under the default opt-out policy every eligible tensor is offloaded anyway, so the mark is
    harmless there; it matters for ``policy="opt_in"`` / ``NVTE_CPU_OFFLOAD_V1=1``.

    Raises:
        TypeError: for an argument that is not a tensor.
    """
    for t in _tensors(tensors, "mark_activation_offload"):
        t.activation_offloading = True
        _traced_mark(t, True)


def _traced_mark(t: torch.Tensor, offload: bool) -> None:
    """Under ``torch.compile`` a mark is also an op of the traced program, which the fx pass reads
    (Note [Compiled offload pass] in ``annotate_offload/compile/_pass.py``)."""
    if torch.compiler.is_compiling():
        from annotate_offload.compile import _ops  # noqa: F401 - registers the op

        torch.ops.annotate_offload.mark(t, offload)


def mark_ready(t: torch.Tensor) -> None:
    """Record that ``t`` is final now (ready event on the current stream, with its version) without
    copying it: if autograd saves it later in this scope, its D2H waits for this event instead of
    the stream position at save time (Note [Layer input at entry] in ``annotate/_layers.py``). In a
    compiled graph every D2H waits for the compute stream at its save: nothing to record."""
    if t.device.type == "cuda" and not torch.compiler.is_compiling():
        event = torch.cuda.Event()
        event.record(torch.cuda.current_stream(t.device))
        t.start_reload_event = event
        t._ao_ready_version = t._version


def start_offload(*tensors: torch.Tensor, offload_base_tensor: bool = False) -> None:
    """Declare tensors final so their D2H copy can start now, before autograd saves them.

    Records a ready event on the current stream (attribute ``start_reload_event``) together with
    the tensor's version; inside an offload scope of an offloaded layer the copy is enqueued at
    once on the D2H stream behind that event. If the tensor is later modified in place, the mark
    is ignored and the copy is redone at save time.

    Args:
        *tensors: tensors (lists/tuples accepted, ``None`` skipped).
        offload_base_tensor (bool): for views (e.g. q/k/v slices of one fused QKV buffer), offload
            the whole base storage once instead of each view. Default: ``False``.

    Raises:
        TypeError: for an argument that is not a tensor.
    """
    from ._synchronizer import _active_synchronizer  # local: avoid an import cycle

    sync = _active_synchronizer()
    for t in _tensors(tensors, "start_offload"):
        if offload_base_tensor and t._base is not None:
            t.offload_base_tensor = True
        mark_ready(t)
        if sync is not None:
            sync._start_offload_now(t)
