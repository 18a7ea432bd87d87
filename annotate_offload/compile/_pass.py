"""The fx pass that offloads the saved activations of a compiled graph: the package's one module that
touches torch's private compile APIs.

Note [Compiled offload pass].

*Where.* After AOTAutograd has partitioned a joint graph, both partitioners hand forward and backward
to ``torch._functorch._activation_offloading.activation_offloading.enable_activation_offloading`` when
``torch._functorch.config.enable_activation_offloading`` is set (torch 2.11 and 2.13 alike).
:func:`install` wraps that function and sets the flag the first time a graph with a ``layer`` op is
traced (torch's own offloading runs after the pass, on the nodes its policy marked). A graph without
``layer`` ops is returned unchanged. What the forward saves is its outputs after the first
``num_fwd_outputs``, each a backward input of the same name.

*What.* A saved activation belongs to layer ``i`` of runtime ``key`` when its first use in the
backward carries the tag ``(key, i)`` (Note [Traced layers] in ``annotate/_layers.py``): the op
whose backward needs it ran in layer ``i``, the layer whose saved-tensor hooks would pack it in
eager mode. It is offloaded when the runtime offloads layer ``i`` and it passes the eager rules,
judged on the graph. Kept are: graph inputs and their views and casts (parameters, buffers and the
compiled function's inputs: the caller holds them, a copy frees nothing), user outputs and their
views (likewise), tensors marked ``mark_not_offload`` (or not marked ``mark_activation_offload``
under the opt-in policy), tensors below ``min_offload_numel`` elements, on another device than the
layer's activations, with symbolic shapes (a recompile for dynamic shapes keeps them) or not strided.

*How.* (Note [Compiled offload ops] in ``_ops.py``.) Forward: ``begin`` after the inputs;
``save`` right after each offloaded activation exists (the views and detaches it is made of are moved
up to the tensor they view first: the min-cut partitioner puts the detach of an op's saved output at
the end of the forward, and the layer's release would follow it there); the token replaces it among the outputs;
its layer's ``release`` (with the activation in ``keep``) after the first tensor the forward
saves from the point where the runtime's schedule releases that layer on (the entry of layer
``i + 1 + release_lag``, or the end of the last layer), or after the user outputs when that point
is not in this graph. Backward: for each layer, ``reach`` after the inputs of its first node that
depend on the backward; for each storage unit, one ``load`` of its tensors' tokens where the runtime's
schedule starts its layer's reload (or before the first use of any of them, where nothing in this graph
starts it), a ``ready`` before that first use, and each tensor an ``as_strided`` view of what ``load``
returns, so the unit crosses once and the compiler knows the tensors alias (q, k and v of one fused buffer).
The ``layer`` markers and ``mark`` ops are removed. Reported bytes count storage units as the runtime
does (Note [Storage units]), so they equal the runtime's ``bytes_offloaded`` per step.
"""

from __future__ import annotations

import dataclasses
import warnings
import weakref
from typing import Any, Optional

import torch
import torch.fx as fx

from annotate_offload.runtime._tensor_group import _unit_range

from . import _ops

__all__: list[str] = []

_OPS = torch.ops.annotate_offload
_CASTS = (torch.ops.aten._to_copy.default, torch.ops.prims.convert_element_type.default)
_installed = [False]


@dataclasses.dataclass(frozen=True)
class SavedActivation:
    """One tensor a compiled forward saves for its backward.

    Attributes:
        name (str): the forward graph node (and backward input) name.
        layer (int | None): the layer it belongs to (``None``: saved outside the layers).
        shape (tuple[int, ...]), dtype (torch.dtype): the tensor's.
        nbytes (int): its logical size in bytes (``numel * element_size``).
        kept (str | None): why it stays on the device (``"input"``, ``"output"``, ``"dynamic_shape"`` or
            one of the runtime's ``KEEP_REASONS``), or ``None`` if it is offloaded.
    """

    name: str
    layer: Optional[int]
    shape: tuple
    dtype: torch.dtype
    nbytes: int
    kept: Optional[str]


@dataclasses.dataclass(frozen=True)
class GraphOffloads:
    """What the pass did to one compiled forward/backward pair of a transformed model.

    Attributes:
        saved (tuple[SavedActivation, ...]): every tensor the forward saves, in output order.
        offloaded_bytes (int): bytes the runtime copies per step for this graph: the storage units
            of the offloaded activations, each once (Note [Storage units]), in bytes.
    """

    saved: tuple
    offloaded_bytes: int


_REPORTS: "weakref.WeakKeyDictionary[Any, list]" = weakref.WeakKeyDictionary()  # runtime -> its graphs


def compiled_offloads(model: Any) -> list:
    """What the compile pass did to each graph compiled from ``model`` since its transform.

    Args:
        model (nn.Module): the module ``offload_transform`` was applied to.

    Returns:
        list[GraphOffloads]: one entry per forward/backward pair AOTAutograd partitioned, in compile
        order (a graph served from torch's compile caches has none).

    Raises:
        TypeError: ``model`` is not an ``nn.Module``.
        ValueError: ``model`` was not transformed by ``offload_transform``.
    """
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"compiled_offloads: model must be an nn.Module, got {type(model).__name__}.")
    state = model.__dict__.get("_annotate_offload_state")
    if state is None:
        raise ValueError(
            f"compiled_offloads: {type(model).__name__} was not transformed; pass the module given to "
            "offload_transform (the model itself, not a wrapper around it)."
        )
    return list(_REPORTS.get(state.sync, ()))


def install() -> None:
    """Run :func:`offload_saved` at every partition from now on (idempotent; Note [Compiled offload pass])."""
    if _installed[0]:
        return
    _installed[0] = True
    import torch._functorch.config as functorch_config

    try:
        from torch._functorch._activation_offloading import activation_offloading as torch_offloading

        torch_pass = torch_offloading.enable_activation_offloading
    except (ImportError, AttributeError) as e:  # a torch whose partitioner has no offloading hook
        warnings.warn(f"annotate_offload: torch {torch.__version__} has no activation-offloading hook in "
                      f"AOTAutograd's partitioner ({e}); compiled models of transformed layers train exactly but "
                      "offload nothing. Use torch 2.11 or later.", UserWarning, stacklevel=2)
        return

    def partitioned(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int, static_inputs: Any) -> None:
        offload_saved(fw, bw, num_fwd_outputs)
        torch_pass(fw, bw, num_fwd_outputs, static_inputs)

    torch_offloading.enable_activation_offloading = partitioned
    functorch_config.enable_activation_offloading = True


# ---------------------------------------------------------------------------------------- graph facts


def _tag(node: fx.Node) -> Optional[tuple]:
    custom = node.meta.get("custom")
    return custom.get(_ops.TAG) if isinstance(custom, dict) else None


def _is_view(node: fx.Node) -> bool:
    return node.op == "call_function" and getattr(node.target, "is_view", False) and isinstance(node.args[0], fx.Node)


def _chain(node: fx.Node, casts: bool = False) -> list:
    """``node`` and the nodes it views (and casts, with ``casts``), up to the first that is neither."""
    out = [node]
    while _is_view(node) or (casts and node.op == "call_function" and node.target in _CASTS):
        node = node.args[0]
        out.append(node)
    return out


def _val(node: Any) -> Any:
    return node.meta.get("val") if isinstance(node, fx.Node) else None


def _insert(graph: fx.Graph, where: Any, target: Any, args: tuple, val: Any, name: str) -> fx.Node:
    with where:
        node = graph.call_function(target, args, name=name)
    node.meta["val"] = val
    return node


# ---------------------------------------------------------------------------------------- the pass


def offload_saved(fw: fx.GraphModule, bw: fx.GraphModule, num_fwd_outputs: int) -> None:
    """Offload the saved activations of offloaded layers in one partitioned graph pair, in place
    (Note [Compiled offload pass]); a no-op for graphs without this package's ``layer`` op."""
    fg, bg = fw.graph, bw.graph
    entries = {node.args[:2]: node for node in fg.find_nodes(op="call_function", target=_OPS.layer.default)}
    runtimes = {key: _ops.runtime(key) for key, _ in entries}
    runtimes = {key: sync for key, sync in runtimes.items() if sync is not None}
    if not runtimes:
        return
    marks: dict = {True: set(), False: set()}
    for node in fg.find_nodes(op="call_function", target=_OPS.mark.default):
        marks[bool(node.args[1])].add(node.args[0])
        fg.erase_node(node)
    outs = list(fg.output_node().args[0])
    held = {_chain(n)[-1] for n in outs[:num_fwd_outputs] if isinstance(n, fx.Node)}
    backward_inputs = {n.name: n for n in bg.find_nodes(op="placeholder")}
    bw_order = {n: i for i, n in enumerate(bg.nodes)}
    saved = [n for n in outs[num_fwd_outputs:] if isinstance(_val(n), torch.Tensor) and n.name in backward_inputs]

    def owner(node: fx.Node) -> Optional[tuple]:
        for user in sorted(backward_inputs[node.name].users, key=bw_order.__getitem__):
            tag = _tag(user)
            if tag is not None and tag[0] in runtimes:
                return tag
        return None

    owners = {n: owner(n) for n in saved}
    device = next((_val(n).device for n in saved if owners[n] and _val(n).device.type == "cuda"), torch.device("cpu"))

    def kept(node: fx.Node) -> Optional[str]:
        tag, val, views = owners[node], _val(node), _chain(node)
        if tag is None or tag[1] not in runtimes[tag[0]].offloaded_layers:
            return "layer_not_offloaded"
        sync = runtimes[tag[0]]
        if _chain(node, casts=True)[-1].op in ("placeholder", "get_attr"):
            return "input"
        if views[-1] in held:
            return "output"
        if any(n in marks[False] for n in views):
            return "marked"
        if sync.policy == "opt_in" and not any(n in marks[True] for n in views):
            return "not_selected"
        if val.device != device:
            return "not_on_device"
        if any(not isinstance(d, int) for d in (*val.shape, *val.stride(), val.storage_offset())):
            return "dynamic_shape"
        if val.numel() < max(sync.min_offload_numel, 1):
            return "too_small"
        if val.layout != torch.strided or _unit_range(val, False) is None:
            return "unsupported"
        return None

    report = [SavedActivation(n.name, owners[n][1] if owners[n] else None, tuple(_val(n).shape), _val(n).dtype,
                              _val(n).numel() * _val(n).element_size(), kept(n)) for n in saved]
    moved = [(n, owners[n]) for n, r in zip(saved, report) if r.kept is None]
    for node, _ in moved:
        _hoist(node)
    forward_order = {n: i for i, n in enumerate(fg.nodes)}
    moved.sort(key=lambda m: forward_order[m[0]])  # save order, in which the runtime makes its units
    if any(r.kept == "dynamic_shape" for r in report):
        warnings.warn("annotate_offload: a compiled graph of offloaded layers has dynamic shapes; its activations "
                      "with symbolic sizes stay on the device. Compile with torch.compile(model, dynamic=False) "
                      "(one graph per shape) to offload them.", UserWarning, stacklevel=2)
    if moved:
        _forward(fg, moved, entries, runtimes, saved, num_fwd_outputs)
        _backward(bg, moved, runtimes, backward_inputs)
    for node in entries.values():
        fg.erase_node(node)
    for key in runtimes:
        mine = tuple(r for r, n in zip(report, saved) if owners[n] is not None and owners[n][0] == key)
        units = _units([(n, tag) for n, tag in moved if tag[0] == key])
        _REPORTS.setdefault(runtimes[key], []).append(GraphOffloads(mine, sum(hi - lo for _, _, lo, hi, _ in units)))
    fw.recompile()
    bw.recompile()


def _units(moved: list) -> list:
    """The storage units the runtime copies for these activations, in save order, each
    ``[tag, storage, lo, hi, members]``: a layer copies a unit once (Note [Storage units]), and no
    layer shares one with another in a compiled graph."""
    units: list = []
    for node, tag in moved:
        val = _val(node)
        storage = val.untyped_storage()._cdata
        lo, hi = _unit_range(val, False)
        unit = next((u for u in units if u[:2] == [tag, storage] and u[2] <= lo and hi <= u[3]), None)
        if unit is None:
            units.append(unit := [tag, storage, lo, hi, []])
        unit[4].append(node)
    return units


def _span(val: Any) -> tuple:
    """The bytes ``[lo, hi)`` of its storage that a tensor spans."""
    lo = val.storage_offset() * val.element_size()
    return lo, lo + (1 + sum((n - 1) * st for n, st in zip(val.shape, val.stride()))) * val.element_size()


def _fake_token(like: fx.Node, device: Any = None) -> torch.Tensor:
    """The value of a token (Note [Compiled offload ops]): on ``device``, by default on ``like``'s."""
    val = _val(like)
    with val.fake_mode:
        return torch.empty(0, dtype=torch.uint8, device=val.device if device is None else device)


def _hoist(node: fx.Node) -> None:
    """Move the views (and detaches) that ``node`` is made of to right after the tensor they view:
    the min-cut partitioner puts the detach of an op's saved output at the end of the forward, and the
    save, with its layer's release, would follow it there."""
    chain = _chain(node)
    for base, view in zip(chain[:0:-1], chain[-2::-1]):
        if view.all_input_nodes == [base]:
            base.append(view)


def _forward(fg: fx.Graph, moved: list, entries: dict, runtimes: dict, saved: list, num_fwd_outputs: int) -> None:
    first_compute = next(n for n in fg.nodes if n.op != "placeholder")
    steps = {}
    for key in {tag[0] for _, tag in moved}:
        layers = [index for (k, index) in entries if k == key]
        steps[key] = _insert(fg, fg.inserting_before(first_compute), _OPS.begin.default,
                             (key, min(layers), max(layers)), _fake_token(moved[0][0], "cpu"), "offload_begin")
    tokens: dict = {}
    for node, (key, index) in moved:
        tokens[node] = _insert(fg, fg.inserting_after(node), _OPS.save.default, (node, steps[key], index),
                               _fake_token(node), f"offload_{node.name}")
    # release: each layer after the first tensor saved from its release point on (Note [Compiled offload pass])
    order = {n: i for i, n in enumerate(fg.nodes)}
    output = fg.output_node()
    groups: dict = {}
    for node, (key, index) in moved:
        entry = entries.get((key, runtimes[key].release_point(index)))
        anchor = None
        if entry is not None:
            anchor = next((n for n in saved if order[n] > order[entry]), None)
        group = groups.setdefault((key, index, anchor), ([], []))
        group[0].append(tokens[node])
        group[1].append(node)
    for (key, index, anchor), (toks, nodes) in groups.items():
        after = [anchor] if anchor is not None else [n for n in output.args[0][:num_fwd_outputs]
                                                     if isinstance(_val(n), torch.Tensor)]
        last = max([*toks, *after], key=order.__getitem__)
        where = fg.inserting_after(last) if anchor is not None else fg.inserting_before(output)
        _insert(fg, where, _OPS.release.default, (toks, [*nodes, *after]), None, f"offload_release_{index}")
    output.update_arg(0, tuple(tokens.get(n, n) if isinstance(n, fx.Node) else n for n in output.args[0]))


def _backward(bg: fx.Graph, moved: list, runtimes: dict, backward_inputs: dict) -> None:
    """Per layer: ``reach`` once its backward has started; per unit: ``load`` where the runtime starts its
    reload, ``ready`` before its first use."""
    grads = set(n for n in bg.find_nodes(op="placeholder") if n.name.startswith("tangents"))
    starts: dict = {}  # (key, layer) -> (first node of the layer that takes a gradient, those gradients)
    for n in bg.nodes:
        inputs = [a for a in n.all_input_nodes if a in grads]
        if inputs:
            grads.add(n)
            tag = _tag(n)
            if n.op == "call_function" and tag is not None and tag[0] in runtimes and tag not in starts:
                starts[tag] = (n, inputs)
    placeholders = {}
    for node, tag in moved:
        placeholder = placeholders[node] = backward_inputs[node.name]
        placeholder.meta["val"] = _fake_token(node)
    token = {tag[0]: placeholders[node] for node, tag in moved}
    reached: dict = {}
    for tag, (start, after) in starts.items():
        if tag[0] in token:
            reached[tag] = _insert(bg, bg.inserting_before(start), _OPS.reach.default, (token[tag[0]], tag[1], after),
                                   _fake_token(token[tag[0]]), f"reach_layer_{tag[1]}")
    order = {n: i for i, n in enumerate(bg.nodes)}
    ours = (_OPS.reach.default, _OPS.load.default, _OPS.ready.default)
    loads: dict = {}  # (key, layer) -> its loads
    readies: dict = {}  # (key, layer) -> [(bytes, ready)] of its units
    totals: dict = {}  # (key, layer) -> bytes of its units
    for tag, _, lo, hi, members in _units(moved):
        totals[tag] = totals.get(tag, 0) + hi - lo
        for dtype in dict.fromkeys(_val(n).dtype for n in members):
            nodes = [n for n in members if _val(n).dtype == dtype]
            # a unit made by a tensor of another dtype that does not divide it: each tensor its own span
            spans = [(lo, hi, nodes)] if lo % dtype.itemsize == hi % dtype.itemsize == 0 else [
                (*_span(_val(n)), [n]) for n in nodes]
            for a, b, group in spans:
                holders = [placeholders[n] for n in group]
                first = min((u for h in holders for u in h.users if u.target not in ours), key=order.__getitem__)
                after = [reached[tag]] if tag in reached and order[reached[tag]] < order[first] else [
                    g for g in starts.get(tag, (None, []))[1] if order[g] < order[first]]
                vals = [_val(n) for n in group]
                offsets = [v.storage_offset() - a // dtype.itemsize for v in vals]
                with vals[0].fake_mode:
                    unit_val = torch.empty((b - a) // dtype.itemsize, dtype=dtype, device=vals[0].device)
                    views = [torch.as_strided(unit_val, v.shape, v.stride(), o) for v, o in zip(vals, offsets)]
                unit = _insert(bg, bg.inserting_before(first), _OPS.load.default,
                               (holders, after, offsets, [st for v in vals for st in v.stride()], unit_val.numel(),
                                dtype, vals[0].device), unit_val, f"reload_{group[0].name}")
                ready = _insert(bg, bg.inserting_before(first), _OPS.ready.default,
                                (unit, holders, [g for g in first.all_input_nodes if g in grads] or after),
                                _fake_token(unit), f"ready_{group[0].name}")
                loads.setdefault(tag, []).append(unit)
                readies.setdefault(tag, []).append((b - a, ready))
                for holder, v, o, view in zip(holders, vals, offsets, views):
                    node = _insert(bg, bg.inserting_before(first), torch.ops.aten.as_strided.default,
                                   (unit, list(v.shape), list(v.stride()), o), view, f"reloaded_{holder.name}")
                    holder.replace_all_uses_with(node, delete_user_cb=lambda u: u.target not in ours)
    # the loads of a layer go where the runtime's schedule starts its reloads, so that the compiler counts
    # them from there (it plans its buffers by the memory it sees alive)
    order = {n: i for i, n in enumerate(bg.nodes)}
    for (key, j), mine in loads.items():
        point, after = _reload_point(runtimes[key], key, j, reached, readies, totals, order)
        cursor = point
        for unit in mine if point is not None else ():
            if order[point] < order[unit]:  # a load used before the point stays: the runtime reloads on demand
                unit.update_arg(1, after)
                cursor.append(unit)
                cursor = unit


def _reload_point(sync: Any, key: int, j: int, reached: dict, readies: dict, totals: dict, order: dict) -> tuple:
    """The node after which the runtime starts layer ``j``'s reload in this backward (Note [Default
    schedule], Note [Paced prefetch] in ``runtime/_synchronizer.py``), and what it depends on: the first
    ``reach`` of a layer ``m`` with ``m - k <= j <= m``, or with ``k = 1`` below an offloaded ``m``,
    the ``ready`` at which half of ``m``'s reloaded bytes are used, after ``reach(m)`` and every
    ``ready`` of ``m`` before it. ``None`` where nothing in this graph starts it."""
    k = getattr(sync, "prefetch_layers", -1)  # -1: the user starts reloads (manual mode)
    point = min([reached[(key, m)] for m in range(j, j + 1 + k) if (key, m) in reached], key=order.get, default=None)
    if k != 1 or point is None or point is not reached.get((key, j + 1)) or (key, j + 1) not in readies:
        return point, [point]
    after, used, below = [point], 0, reached.get((key, j))  # reaching layer j starts what is not started
    for nbytes, ready in sorted(readies[(key, j + 1)], key=lambda r: order[r[1]]):
        if below is not None and order[below] < order[ready]:
            break
        used += nbytes
        after.append(ready)
        if 2 * used >= totals[(key, j + 1)]:  # a ready may precede reach(m) (a use before m's gradient): the later
            return max(after, key=order.__getitem__), after
    return below, [below]
