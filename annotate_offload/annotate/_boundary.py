"""The two calls a layer boundary makes into the runtime, shared by the fx path and the hook path.

``enter(i, x)`` before layer ``i`` opens its offload scope (and, when the layer is offloaded,
marks its input ready: Note [Layer input at entry]); ``commit(out, i)`` after it closes the scope.
Both are no-ops when autograd is off (eval, ``no_grad``, ``inference_mode``) and during backward
(activation-checkpoint recompute re-runs layer forwards; they must not open scopes).
"""

from __future__ import annotations

import copy
from typing import Any

import torch

from annotate_offload.errors import OffloadError
from annotate_offload.runtime._context import inside_checkpoint

__all__ = ["LayerBoundary", "deepcopy_fields", "in_backward", "refuse_pickle"]


def in_backward() -> bool:
    """True while the autograd engine runs a backward pass on this thread (e.g. checkpoint recompute)."""
    return torch._C._current_graph_task_id() != -1


def _first_tensor(x: Any) -> torch.Tensor | None:
    if isinstance(x, torch.Tensor):
        return x
    if isinstance(x, (tuple, list)):
        for v in x:
            t = _first_tensor(v)
            if t is not None:
                return t
    if isinstance(x, dict):
        for v in x.values():
            t = _first_tensor(v)
            if t is not None:
                return t
    return None


def _tensors(x: Any) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (tuple, list)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


def refuse_pickle(self: Any, protocol: Any = None) -> Any:
    """``__reduce_ex__`` of the objects ``offload_transform`` puts on a model (see Note [Copying a
    synchronizer] in annotate_offload/runtime/_synchronizer.py): ``copy.deepcopy`` of the model
    works, pickling it does not."""
    raise OffloadError(
        "offload_transform: a model with offloading applied cannot be pickled (torch.save(model)): its "
        "forward drives a runtime with CUDA side streams and host buffers that do not outlive the process. "
        "Save model.state_dict() instead (its keys are unchanged by offload_transform), or call "
        "remove_offload(model) before torch.save(model) and offload_transform again after loading."
    )


def deepcopy_fields(self: Any, memo: dict) -> Any:
    """``__deepcopy__`` of those objects: a field-by-field deep copy (``__slots__`` and ``__dict__``),
    so the runtime's own ``__deepcopy__`` decides what a copy of it is."""
    cls = type(self)
    new = cls.__new__(cls)
    memo[id(self)] = new
    for klass in cls.__mro__:
        for name in getattr(klass, "__slots__", ()):
            if name != "__weakref__" and hasattr(self, name):
                setattr(new, name, copy.deepcopy(getattr(self, name), memo))
    if hasattr(self, "__dict__"):
        new.__dict__.update(copy.deepcopy(self.__dict__, memo))
    return new


class LayerBoundary:
    """Routes layer boundaries to one runtime synchronizer and remembers which scope is open.

    Args:
        sync: a ``DefaultOffloadSynchronizer`` (see docs/runtime_api.md).
        offloaded (frozenset[int]): indices of offloaded layers (their input is marked ready at entry).
    """

    __slots__ = ("sync", "offloaded", "open_layer", "last_entered", "_measured", "_plan", "estimating",
                 "in_forward", "forward_last")

    __reduce_ex__ = refuse_pickle
    __deepcopy__ = deepcopy_fields

    def __init__(self, sync: Any, offloaded: frozenset[int], plan: Any = None) -> None:
        self.sync = sync
        self.offloaded = offloaded
        self.open_layer: int | None = None
        self.last_entered = -1
        self._measured = False
        self._plan = plan
        self.estimating = False  # set while _estimate runs the forward with a counting stand-in
        self.in_forward = False  # inside the model's (offloaded) forward
        self.forward_last = -1  # last layer entered in the current model forward

    # -- the two calls ---------------------------------------------------------------------
    def active(self) -> bool:
        """Whether a boundary call should reach the runtime now (grad on, not in backward)."""
        return torch.is_grad_enabled() and not in_backward()

    def enter(self, index: int, x: Any = None) -> Any:
        """Open layer ``index``'s scope; return ``x`` unchanged (the fx graph threads it to the layer)."""
        if not self.active():
            return x
        if inside_checkpoint():
            # Note [A checkpoint around the layer] (runtime/_context.py): a checkpoint around the model or
            # the layer (the fx path calls this from inside it). Kept layers stand aside; offloaded ones
            # are refused, as on the hook path.
            if index in self.offloaded:
                raise OffloadError(
                    f"offload_transform: layer {index} runs inside torch.utils.checkpoint(use_reentrant=False) (a "
                    "checkpoint around the model or the layer). That checkpoint keeps only its inputs and recomputes "
                    "the layer in backward, so there is nothing to offload, and a saved-tensor scope inside it breaks "
                    "its recompute. Fix: remove the checkpoint and pass recompute=True to offload_transform (it "
                    "checkpoints the layers itself and offloads what the checkpoint saves), or keep this layer."
                )
            return x
        if self.open_layer is not None:
            # The previous layer never committed: its call raised inside code that caught the error,
            # or one layer ran inside another. Scopes must not nest; drop the step and say so.
            still_open, self.open_layer = self.open_layer, None
            self.sync.abort()
            raise OffloadError(
                f"offload_transform: layer {index} started while layer {still_open} had not finished "
                "(an exception inside it was caught, or one layer calls another); this step's offload "
                "state was dropped. Re-run the forward; if one layer calls another, declare only the "
                "outer one a layer (layer_types= or filter_fn=)."
            )
        if self.in_forward:
            if index <= self.forward_last:
                self.sync.abort()
                raise OffloadError(
                    f"offload_transform: layer {index} started after layer {self.forward_last} in the same "
                    "forward (a layer called twice, or layers that run in another order than they are "
                    "registered); one layer index must be one offload unit, entered in increasing order. "
                    "Select the layers in execution order with filter_fn=, or leave shared modules out."
                )
            self.forward_last = index
        self.sync.enter_layer(index)
        self.open_layer = index
        self.last_entered = index
        if index in self.offloaded:
            t = _first_tensor(x)
            if t is not None and t.requires_grad:
                # Note [Layer input at entry]: mark the input final, copy it only if autograd saves
                # it. Under autocast a layer whose first op is a conv or linear saves only the bf16
                # cast, and an eager copy moved the fp32 input out and back for nothing (review of
                # session 3: a residual Conv2d net moved 32768 bytes where 16384 are saved).
                from annotate_offload.runtime._marks import mark_ready

                mark_ready(t)
        return x

    def commit(self, out: Any, index: int) -> Any:
        """Close layer ``index``'s scope (if this boundary opened it); return ``out`` unchanged."""
        if self.open_layer != index:
            return out
        self.open_layer = None
        return self.sync.commit_layer(out, index)

    def keep(self, x: Any) -> Any:
        """``mark_not_offload`` on the tensors of ``x`` (the model returns them; offloading frees nothing)."""
        if self.active():
            from annotate_offload.runtime import mark_not_offload

            ts = _tensors(x)
            if ts:
                mark_not_offload(*ts)
        return x

    def abort(self) -> None:
        """After an exception in forward: close the open scope and drop this step's runtime state."""
        self.open_layer = None
        self.sync.abort()

    # -- plan bytes, measured on the first training step -------------------------------------
    def forward_done(self) -> None:
        """After a training forward: the first time, copy the per-layer D2H bytes into the plan.

        Every offloaded layer's copy has been issued by then (layer ``i``'s starts when layer
        ``i + 1`` is entered, and the last layer is never offloaded).
        """
        if self._measured or self.estimating or self._plan is None or self.last_entered < 0:
            return
        self._measured = True
        self._plan._with_bytes(dict(self.sync.stats.bytes_offloaded_per_layer), "measured")
