"""The fx path: trace with the layers as leaves, tag their call nodes, insert the layer boundaries.

Inserted around layer ``i`` (the index is a constant in the graph, never a count)::

    b    = self._annotate_offload_boundary  # read from the live model at each call
    x_i  = _enter(b, i, x)               # open layer i's offload scope; mark x ready if offloaded
    y    = layers.i(x_i)                 # or torch.utils.checkpoint.checkpoint(layers.i, x_i, ...)
    y_c  = _commit(b, y, i)              # close the scope, mark the layer boundary
    ...  = _keep(b, t)                   # for tensors the forward also returns: mark_not_offload

The boundary is an attribute of the model, not a constant of the generated code, so a deep copy
of the model (Note [Copying a synchronizer] in annotate_offload/runtime/_synchronizer.py) runs its
own copy of the boundary and runtime with the same code.

``torch.utils.checkpoint.checkpoint`` called on a layer is kept in the graph as one call (fx
would otherwise trace through it and silently drop the recompute), so the checkpoint's saved
inputs are packed inside the layer's scope and really offloaded.
"""

from __future__ import annotations

import operator
import warnings
from typing import Any, Callable

import torch.fx as fx
import torch.nn as nn
import torch.utils.checkpoint as _cp

from ._boundary import LayerBoundary
from ._discover import LayerRef

__all__ = ["FxTraceError", "SharedLayerError", "trace_layers", "ordered_layers", "insert_boundaries", "META_KEY", "BOUNDARY_ATTR"]

META_KEY = "offload_layer"  # node.meta[META_KEY] = {"index", "fqn", "offload", "checkpoint"}
BOUNDARY_ATTR = "_annotate_offload_boundary"  # the model attribute the generated code reads


def _enter(boundary: LayerBoundary, index: int, x: Any = None) -> Any:
    return boundary.enter(index, x)


def _commit(boundary: LayerBoundary, out: Any, index: int) -> Any:
    return boundary.commit(out, index)


def _keep(boundary: LayerBoundary, x: Any) -> Any:
    return boundary.keep(x)

_ORIG_CHECKPOINT = _cp.checkpoint


class FxTraceError(RuntimeError):
    """Tracing failed or the graph does not show the layers; the message is one line for the plan."""


class SharedLayerError(FxTraceError):
    """The graph calls one layer more than once: a property of the model, which the hook path cannot
    offload either (its boundary refuses a layer entered twice in one forward)."""


class _LayerTracer(fx.Tracer):
    def __init__(self, leaf_ids: set[int]) -> None:
        super().__init__()
        self._leaf_ids = leaf_ids

    def is_leaf_module(self, m: nn.Module, qualname: str) -> bool:
        return id(m) in self._leaf_ids or super().is_leaf_module(m, qualname)


def _checkpoint_leaf(layer_ids: set[int]) -> Callable[..., Any]:
    """A stand-in for ``checkpoint`` during tracing: records a call on a layer as one graph node."""

    def checkpoint(function: Any, *args: Any, **kwargs: Any) -> Any:
        proxies = [a for a in (*args, *kwargs.values()) if isinstance(a, fx.Proxy)]
        if not proxies:
            return _ORIG_CHECKPOINT(function, *args, **kwargs)
        if not (isinstance(function, nn.Module) and id(function) in layer_ids):
            raise FxTraceError(
                f"torch.utils.checkpoint around {getattr(function, '__qualname__', type(function).__name__)}, "
                "which is not a layer, cannot be kept in the graph"
            )
        return proxies[0].tracer.create_proxy("call_function", _ORIG_CHECKPOINT, (function, *args), kwargs)

    return checkpoint


def trace_layers(model: nn.Module, layers: list[LayerRef], *, training: bool | None = None) -> fx.GraphModule:
    """Trace ``model.forward`` with ``layers`` as leaves (with every module's ``training`` flag
    temporarily set to ``training`` when given, so train and eval graphs can be compared).

    Raises:
        FxTraceError: tracing failed (message: one line, the first line of the cause).
    """
    if training is None:
        return _trace(model, layers)
    flags = [(m, m.training) for m in model.modules()]
    for m, _ in flags:
        m.training = training
    try:
        return _trace(model, layers)
    finally:
        for m, flag in flags:
            m.training = flag


def _trace(model: nn.Module, layers: list[LayerRef]) -> fx.GraphModule:
    ids = {id(r.module) for r in layers}
    stand_in = _checkpoint_leaf(ids)
    # Patch `checkpoint` where forwards look it up: the module attribute and any
    # `from torch.utils.checkpoint import checkpoint` globals of the model's classes.
    globals_dicts = []
    for m in model.modules():
        fwd = getattr(type(m), "forward", None)
        g = getattr(fwd, "__globals__", None)
        if g is not None and g.get("checkpoint") is _ORIG_CHECKPOINT and all(g is not d for d in globals_dicts):
            globals_dicts.append(g)
    before = set(model.__dict__)
    _cp.checkpoint = stand_in
    for g in globals_dicts:
        g["checkpoint"] = stand_in
    try:
        with warnings.catch_warnings():
            # Tracing probes attributes; deprecation notices it triggers (HF) are noise here.
            warnings.simplefilter("ignore", FutureWarning)
            warnings.simplefilter("ignore", DeprecationWarning)
            graph = _LayerTracer(ids).trace(model)
    except FxTraceError:
        raise
    except Exception as e:  # tracing fails with many error types (TraceError, TypeError, ...)
        first = (str(e).strip().splitlines() or [""])[0]
        raise FxTraceError(f"{type(e).__name__}: {first[:200]}") from e
    finally:
        _cp.checkpoint = _ORIG_CHECKPOINT
        for g in globals_dicts:
            g["checkpoint"] = _ORIG_CHECKPOINT
        added = set(model.__dict__) - before  # tensor constants the tracer stored on the root
    gm = fx.GraphModule(model, graph, class_name=f"Offloaded{type(model).__name__}")
    gm.meta["root_attrs_added"] = sorted(added)
    return gm


def _layer_calls(gm: fx.GraphModule, layers: list[LayerRef]) -> list[tuple[fx.Node, LayerRef, bool]]:
    """The call nodes of the layers, in graph order: ``(node, layer, via_checkpoint)``."""
    by_fqn = {r.fqn: r for r in layers}
    calls = []
    for node in gm.graph.nodes:
        if node.op == "call_module" and node.target in by_fqn:
            calls.append((node, by_fqn[node.target], False))
        elif node.op == "call_function" and node.target is _ORIG_CHECKPOINT:
            fn = node.args[0] if node.args else None
            if isinstance(fn, fx.Node) and fn.op == "get_attr" and fn.target in by_fqn:
                calls.append((node, by_fqn[fn.target], True))
    seen: dict[str, fx.Node] = {}
    for node, ref, _ in calls:
        if ref.fqn in seen:
            raise SharedLayerError(
                f"layer {ref.fqn} is called more than once in one forward (nodes {seen[ref.fqn].name} and "
                f"{node.name}); a shared layer cannot be one offload unit"
            )
        seen[ref.fqn] = node
    return calls


def ordered_layers(gm: fx.GraphModule, layers: list[LayerRef]) -> list[LayerRef]:
    """``layers`` in graph (execution) order; layers the graph never calls go last, in their order."""
    called = [ref for _, ref, _ in _layer_calls(gm, layers)]
    ids = {id(r) for r in called}
    return called + [r for r in layers if id(r) not in ids]


_VIEW_METHODS = {"view", "reshape", "transpose", "permute", "expand", "unsqueeze", "squeeze", "flatten",
                 "unflatten", "view_as", "narrow", "select", "unbind", "split", "chunk", "t", "detach"}


def _returned_nodes(gm: fx.GraphModule) -> set[fx.Node]:
    """Nodes whose tensors the forward returns (directly, inside containers, or as views)."""
    out = next(n for n in reversed(gm.graph.nodes) if n.op == "output")
    found: set[fx.Node] = set()
    stack = list(out.all_input_nodes)
    while stack:
        n = stack.pop()
        if n in found:
            continue
        found.add(n)
        if (n.op == "call_function" and n.target is operator.getitem) or (
            n.op == "call_method" and n.target in _VIEW_METHODS
        ):
            stack.extend(n.all_input_nodes[:1])
    return found


def insert_boundaries(
    gm: fx.GraphModule, layers: list[LayerRef], boundary: LayerBoundary, offloaded: frozenset[int]
) -> None:
    """Tag the layer call nodes and insert ``enter``/``commit`` (and ``keep``) around them, in place.

    ``layers`` must be in graph order (``ordered_layers``); layer ``i`` is ``layers[i]``.
    """
    index = {id(r): i for i, r in enumerate(layers)}
    graph = gm.graph
    returned = _returned_nodes(gm)
    kept: set[fx.Node] = set()
    calls = _layer_calls(gm, layers)
    if not calls:
        return
    gm.__dict__[BOUNDARY_ATTR] = boundary  # for lint; at run time `self` is the live model
    placeholders = [n for n in graph.nodes if n.op == "placeholder"]
    where = graph.inserting_after(placeholders[-1]) if placeholders else graph.inserting_before(next(iter(graph.nodes)))
    with where, warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # fx: get_attr of an object that is not a module/tensor
        b = graph.get_attr(BOUNDARY_ATTR)
    for node, ref, via_ckpt in calls:
        i = index[id(ref)]
        node.meta[META_KEY] = {"index": i, "fqn": ref.fqn, "offload": i in offloaded, "checkpoint": via_ckpt}
        arg_pos = 1 if via_ckpt else 0  # checkpoint(layer, x, ...) vs layer(x, ...)
        x = node.args[arg_pos] if len(node.args) > arg_pos else None
        if i in offloaded:
            # Tensors the model returns stay alive anyway: mark them before the layer can save them.
            for inp in node.all_input_nodes:
                if inp in returned and inp not in kept and inp.op != "get_attr":
                    kept.add(inp)
                    with graph.inserting_before(node):
                        graph.call_function(_keep, (b, inp)).meta[META_KEY] = {"index": i, "role": "keep"}
        with graph.inserting_before(node):
            if isinstance(x, fx.Node):
                entered = graph.call_function(_enter, (b, i, x))
                args = list(node.args)
                args[arg_pos] = entered
                node.args = tuple(args)
            else:
                entered = graph.call_function(_enter, (b, i))
            entered.meta[META_KEY] = {"index": i, "role": "enter"}
        with graph.inserting_after(node):
            committed = graph.call_function(_commit, (b, node, i))
            committed.meta[META_KEY] = {"index": i, "role": "commit"}
        node.replace_all_uses_with(committed, delete_user_cb=lambda u, c=committed: u is not c)
        if node in returned:
            returned.add(committed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        graph.lint()
    gm.recompile()
