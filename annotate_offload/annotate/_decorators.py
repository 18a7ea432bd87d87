"""``@offload_layer``: declare the unit of offloading on a module class or instance (a plain attribute,
read by ``offload_transform``; it never changes what the module does)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, TypeVar, overload

import torch.nn as nn

__all__ = ["offload_layer"]

_MARK = "_annotate_offload_layer"

_T = TypeVar("_T", bound=Any)


@dataclass(frozen=True)
class LayerMark:
    """What ``@offload_layer`` recorded: the module is a layer; ``offload`` says whether it may be offloaded."""

    offload: bool = True


@overload
def offload_layer(obj: _T, /) -> _T: ...
@overload
def offload_layer(*, offload: bool = True) -> Callable[[_T], _T]: ...


def offload_layer(obj: Any = None, /, *, offload: bool = True) -> Any:
    """Declare a layer: the unit whose saved activations are offloaded, released and reloaded together.

    Use it on an ``nn.Module`` subclass (every instance, and instances of its subclasses, is a
    layer) or on one module instance. ``@offload_layer(offload=False)`` declares the unit but
    keeps its activations on the GPU; ``offload_transform(model, num_layers=N)`` then offloads
    the first ``N`` layers that are not declared this way. A mark on an instance overrides the
    mark of its class.

    Args:
        obj (type | nn.Module): the class or module to mark (when used without parentheses).
        offload (bool): whether the layer's activations may be offloaded. Default: ``True``.

    Returns:
        The same class or module (marked), or a decorator when called with keywords only.

    Raises:
        TypeError: if ``obj`` is neither an ``nn.Module`` subclass nor an ``nn.Module`` instance,
            or ``offload`` is not a bool.

    Example::

        @offload_layer
        class Block(nn.Module): ...

        offload_layer(offload=False)(model.blocks[-1])   # keep the last block on the GPU
    """
    if not isinstance(offload, bool):
        raise TypeError(
            f"offload_layer: offload must be a bool, got {offload!r} ({type(offload).__name__}); "
            "write @offload_layer(offload=False) to keep a layer's activations on the GPU."
        )
    if obj is None:
        return lambda target: _mark(target, offload)
    return _mark(obj, offload)


def _mark(obj: Any, offload: bool) -> Any:
    if isinstance(obj, type) and issubclass(obj, nn.Module):
        setattr(obj, _MARK, LayerMark(offload))  # class attribute: inherited by subclasses
        return obj
    if isinstance(obj, nn.Module):
        object.__setattr__(obj, _MARK, LayerMark(offload))  # instance dict, not a submodule/buffer
        return obj
    raise TypeError(
        f"offload_layer: expected an nn.Module subclass or instance, got {obj!r} "
        f"({type(obj).__name__}); decorate the layer's class (@offload_layer above `class Block(nn.Module)`) "
        "or pass a module instance (offload_layer(model.blocks[0]))."
    )


def layer_mark(module: nn.Module) -> LayerMark | None:
    """The mark of ``module`` (instance first, then class and its bases), or ``None``."""
    mark = module.__dict__.get(_MARK)
    if mark is None:
        mark = getattr(type(module), _MARK, None)
    return mark if isinstance(mark, LayerMark) else None
