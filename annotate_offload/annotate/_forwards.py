"""The instance-level forwards ``offload_transform`` installs (on the model and on recomputed layers)."""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch
import torch.nn as nn
import torch.utils.checkpoint as _cp

from ._boundary import LayerBoundary, deepcopy_fields, in_backward, refuse_pickle
from ._hooks import HookState

__all__ = ["OffloadedForward", "ByMode", "RecomputeForward"]

_ORIG_CHECKPOINT = _cp.checkpoint



class OffloadedForward:
    """The model's instance-level forward: runs the transformed graph (fx) or the original forward
    (hooks), records whether the forward trains, and drops the step's offload state on an exception."""

    __reduce_ex__ = refuse_pickle
    __deepcopy__ = deepcopy_fields

    def __init__(self, fn: Callable[..., Any], boundary: LayerBoundary, hook_state: HookState, wrapped: Any) -> None:
        self.fn, self.boundary, self.hook_state = fn, boundary, hook_state
        functools.update_wrapper(self, wrapped)  # inspect.signature(model.forward) still works

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        training = torch.is_grad_enabled() and not in_backward()
        b = self.boundary
        prev, self.hook_state.forward_grad = self.hook_state.forward_grad, training
        prev_in, prev_last, b.in_forward, b.forward_last = b.in_forward, b.forward_last, True, -1
        try:
            out = self.fn(*args, **kwargs)
        except BaseException:
            if training:
                b.abort()
            raise
        finally:
            self.hook_state.forward_grad = prev
            b.in_forward, b.forward_last = prev_in, prev_last
        if training:
            self.boundary.forward_done()
        return out

    def __repr__(self) -> str:
        name = getattr(self.__wrapped__, "__qualname__", type(self.__wrapped__).__name__)
        return f"<offloaded forward of {name}>"


class ByMode:
    """Runs the train-mode or the eval-mode transformed graph, following ``model.training``."""

    def __init__(self, model: nn.Module, train_fn: Callable[..., Any], eval_fn: Callable[..., Any]) -> None:
        self.model, self.train_fn, self.eval_fn = model, train_fn, eval_fn

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return (self.train_fn if self.model.training else self.eval_fn)(*args, **kwargs)


class RecomputeForward:
    """A layer's instance-level forward for ``recompute``/``recompute_offload``: non-reentrant checkpoint."""

    def __init__(self, fwd: Callable[..., Any]) -> None:
        self.fwd = fwd
        functools.update_wrapper(self, fwd)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not torch.is_grad_enabled():
            return self.fwd(*args, **kwargs)
        return _ORIG_CHECKPOINT(self.fwd, *args, use_reentrant=False, **kwargs)
