"""Which submodules of a model are layers: explicit selection, ``@offload_layer`` marks, or discovery.

Precedence: ``layer_types=`` or ``filter_fn=`` (the caller's word), then ``@offload_layer``
marks, then discovery of repeated blocks: the children of an ``nn.ModuleList``/``nn.Sequential``
that all share one class (the decoder layers of a Hugging Face model, the blocks of a GPT).
In every case only the outermost match counts (a layer inside a layer is part of it).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass
from typing import Callable, Sequence

import torch.nn as nn

from ._decorators import layer_mark

__all__ = ["LayerRef", "find_layers"]

FilterFn = Callable[[nn.Module, str], bool]


@dataclass(frozen=True)
class LayerRef:
    """One declared layer: its fully qualified name, the module, and whether it may be offloaded."""

    fqn: str
    module: nn.Module
    offload: bool


def find_layers(
    model: nn.Module,
    *,
    layer_types: type | Sequence[type] | None = None,
    filter_fn: FilterFn | None = None,
) -> tuple[list[LayerRef], str]:
    """Layers of ``model`` in registration order, and a one-line description of how they were found.

    Raises:
        TypeError: if ``layer_types`` holds something that is not an ``nn.Module`` subclass, or
            ``filter_fn`` is not callable.
        ValueError: if both ``layer_types`` and ``filter_fn`` are given, or no layer is found.
    """
    if layer_types is not None and filter_fn is not None:
        raise ValueError(
            "offload_transform: pass layer_types= or filter_fn=, not both "
            f"(got layer_types={layer_types!r} and filter_fn={filter_fn!r}); "
            "fold the type test into filter_fn, e.g. lambda m, fqn: isinstance(m, Block) and ..."
        )
    if layer_types is not None:
        types = _check_types(layer_types)
        names = ", ".join(t.__name__ for t in types)
        refs = _outermost(model, lambda m, fqn: isinstance(m, types))
        how = f"layer_types=({names})"
    elif filter_fn is not None:
        if not callable(filter_fn):
            raise TypeError(
                f"offload_transform: filter_fn must be callable as filter_fn(module, fqn) -> bool, got {filter_fn!r}"
            )
        try:
            inspect.signature(filter_fn).bind(model, "")
        except TypeError:  # a one-argument lambda: the bare "takes 1 positional argument" named neither
            raise TypeError(
                f"offload_transform: filter_fn is called as filter_fn(module, fqn) -> bool, but {filter_fn!r} "
                f"takes {inspect.signature(filter_fn)}; write it as e.g. lambda module, fqn: isinstance(module, Block)"
            ) from None
        except ValueError:  # no introspectable signature (a builtin): call it and let it fail on its own
            pass
        refs = _outermost(model, lambda m, fqn: bool(filter_fn(m, fqn)))
        how = f"filter_fn={getattr(filter_fn, '__qualname__', repr(filter_fn))}"
    else:
        refs = _outermost(model, lambda m, fqn: layer_mark(m) is not None)
        how = "@offload_layer marks"
        if not refs:
            refs, how = _discover(model)
    if not refs:
        raise ValueError(
            f"offload_transform: found no layers in {type(model).__name__} (looked for {how}); "
            "mark the repeated block with @offload_layer, or pass layer_types=(Block,) or "
            "filter_fn=lambda module, fqn: ..."
        )
    return refs, how


def _check_types(layer_types: type | Sequence[type]) -> tuple[type, ...]:
    try:
        types = (layer_types,) if isinstance(layer_types, type) else tuple(layer_types)
    except TypeError:  # an instance (layer_types=Block()) is not iterable
        types = ()
    bad = [t for t in types if not (isinstance(t, type) and issubclass(t, nn.Module))]
    if bad or not types:
        raise TypeError(
            f"offload_transform: layer_types must be nn.Module subclasses, got {layer_types!r}; "
            "pass the layer classes, e.g. layer_types=(LlamaDecoderLayer,)"
        )
    return types


def _ref(fqn: str, module: nn.Module) -> LayerRef:
    mark = layer_mark(module)
    return LayerRef(fqn, module, True if mark is None else mark.offload)


def _outermost(model: nn.Module, pred: FilterFn) -> list[LayerRef]:
    refs: list[LayerRef] = []
    inside: list[str] = []  # prefixes of accepted layers; their descendants are part of them
    for fqn, module in model.named_modules():
        if module is model or any(fqn.startswith(p) for p in inside):
            continue
        if pred(module, fqn):
            refs.append(_ref(fqn, module))
            inside.append(fqn + ".")
    return refs


def _discover(model: nn.Module) -> tuple[list[LayerRef], str]:
    """The children of the largest container (by parameter count) of >= 2 modules of one class."""
    found: list[tuple[str, nn.Module]] = []
    for fqn, module in model.named_modules():
        if not isinstance(module, (nn.ModuleList, nn.Sequential)):
            continue
        children = list(module.children())
        if len(children) < 2 or len({type(c) for c in children}) != 1:
            continue
        if isinstance(children[0], (nn.ModuleList, nn.ModuleDict)):
            continue  # no forward of their own: not a block (an nn.Sequential block is one)
        if any(fqn.startswith(f + ".") for f, _ in found):
            continue  # nested in an earlier container's blocks
        found.append((fqn, module))
    if not found:
        return [], "@offload_layer marks, then an nn.ModuleList/nn.Sequential of at least two blocks of one class"
    size = [sum(0 if nn.parameter.is_lazy(p) else p.numel() for p in c.parameters()) for _, c in found]
    fqn, container = found[max(range(len(found)), key=lambda k: (size[k], -k))]
    names = [name for name, _ in container.named_children()]
    refs = [_ref(f"{fqn}.{n}" if fqn else n, getattr(container, n)) for n in names]
    block = type(refs[0].module)
    how = f"discovered {fqn or '<root>'}: {len(refs)} x {block.__name__}"
    # Note [One discovered container]: the registration order of two stacks of one block class need not be the
    # order they run (CLIP registers its text tower first and runs its vision tower first), which only a forward
    # shows; the others are named so the caller can pass layer_types= where the order is right (T5's stacks).
    if others := [f for f, c in found if f != fqn and type(next(c.children())) is block]:
        how += f" (also {', '.join(others)}: layer_types={block.__name__} takes them too)"
    return refs, how
