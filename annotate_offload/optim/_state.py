"""State placement and the validated ``load_state_dict`` of :class:`HybridDeviceOptimizer` (private).

``opt.state[p]`` is the very dict the sub-optimizer keeps for ``p``'s inner tensor: one structure,
not two aliased ones, so moving it moves both. :func:`place` repairs what user code moved (RL
frameworks move optimizer state to the host and back between rollouts).

Note [Validated loads]: torch's ``Optimizer.load_state_dict`` checks only group and parameter
counts and casts the rest; a moment of the wrong shape then reaches the fused kernel, which reads
or writes out of bounds. :func:`check_load` therefore checks everything against what the optimizer
class itself creates (:func:`probe`: the class stepped once over a tiny tensor) before anything is
applied, and builds the converted state (cast and moved as torch does) aside, so a refused load
changes nothing.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, NamedTuple, Optional

import torch

from ._pipeline import IMPL_KEYS, STRUCTURAL_KEYS

__all__: list[str] = []


class Entry(NamedTuple):
    """One parameter of the optimizer and what steps it."""

    param: torch.Tensor
    flat: int  # index in param_groups order (the state dict's parameter id)
    group: int
    index: int
    local: torch.Tensor  # the tensor the model reads (its local shard for a DTensor)
    inner: torch.Tensor  # the tensor its sub-optimizer steps
    opt: torch.optim.Optimizer
    sub_group: dict  # its group in that sub-optimizer
    master: Optional[torch.Tensor]  # a separate master (host copy or fp32), else None
    host: bool


def wants_device_step(group: dict[str, Any]) -> bool:
    """torch keeps ``step`` as fp32 on the parameter's device for fused/capturable groups."""
    return bool(group.get("fused") or group.get("capturable"))


def _step_value(v: torch.Tensor, inner: torch.Tensor, fused: bool) -> torch.Tensor:
    if fused:
        return v if v.dtype == torch.float32 and v.device == inner.device else v.to(inner.device, torch.float32)
    return v if v.device.type == "cpu" else v.to("cpu")


def place(e: Entry, st: dict[str, Any]) -> None:
    """Move ``st``'s tensors back to where ``e`` is stepped and re-attach its master (in place)."""
    if e.opt.state.get(e.inner) is not st:
        e.opt.state[e.inner] = st
    for k, v in list(st.items()):
        if not torch.is_tensor(v):
            continue
        if k == "master_param":
            if e.master is None:
                del st[k]
            elif v is not e.master:
                with torch.no_grad():
                    e.master.copy_(v)
                st[k] = e.master
        elif k == "step":
            if (nv := _step_value(v, e.inner, wants_device_step(e.sub_group))) is not v:
                st[k] = nv
        elif v.device != e.inner.device:
            st[k] = v.to(e.inner.device)


def detach_views(st: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of ``st`` where views of a larger storage (the pinned slabs) are cloned, so
    ``torch.save`` writes the tensor, not its whole slab."""
    return {k: v.clone() if torch.is_tensor(v) and v.untyped_storage().nbytes() > v.numel() * v.element_size() else v
            for k, v in st.items()}


def probe(cls: type, kw: dict[str, Any], like: list[tuple[torch.dtype, Any, int]], *,
          group: bool = False) -> tuple[Optional[dict[str, Any]], Optional[Exception]]:
    """Step ``cls`` once, on zero gradients, over one tensor of side 2 per ``(dtype, device, ndim)`` of
    ``like``, with ``kw`` as constructor keywords (checked by the constructor) or as the group's
    values (``group``). Returns the state it created for the first tensor, or the error it raised."""
    try:
        ps = []
        for dtype, device, dim in like:
            ps.append(torch.zeros((2,) * dim, dtype=dtype, device=device))
            ps[-1].grad = torch.zeros_like(ps[-1])
        opt = cls([{**kw, "params": ps}]) if group else cls(ps, **kw)
        opt.step()
        return dict(opt.state.get(ps[0], {})), None
    except (TypeError, ValueError, RuntimeError, NotImplementedError, AssertionError) as e:
        return None, e


def _template(e: Entry, hyper: dict[str, Any], cache: dict) -> dict[str, Any]:
    """The state ``e``'s sub-optimizer class creates in one step, with the loaded hyper-parameters."""
    kw = {k: v for k, v in e.sub_group.items() if k != "params"}
    kw.update({k: v for k, v in hyper.items() if k in kw})
    key = (type(e.opt), repr(sorted(kw.items())), e.inner.dtype, e.inner.device, e.inner.dim())
    if key not in cache:  # a class that cannot step the probe: torch's own checks only
        cache[key] = probe(type(e.opt), kw, [key[2:]], group=True)[0] or {}
    return cache[key]


def _desc(v: Any) -> str:
    if torch.is_tensor(v):
        return f"a tensor of shape {tuple(v.shape)} and dtype {v.dtype}"
    return f"{type(v).__name__} {v!r:.80}"


def check_load(sd: Any, entries: list[Entry], groups: list[dict[str, Any]],
               check_hyper: Callable[[int, dict[str, Any]], None]) -> tuple[list[dict[str, Any]], dict[int, dict]]:
    """Validate ``sd`` against the optimizer and convert it (Note [Validated loads]).

    Returns ``(hyper-parameters per group, state per flat index)``; applies nothing.

    Raises:
        ValueError: a malformed state dict, another number of groups or parameters, a hyper-parameter
            the optimizer class refuses or a non-finite ``lr``, or a state entry that does not fit its
            parameter (missing key, wrong shape, non-floating moment, non-tensor where a tensor belongs).
        TypeError: a hyper-parameter of the wrong type.
    """
    who = "HybridDeviceOptimizer.load_state_dict"
    if not isinstance(sd, dict) or not isinstance(sd.get("state"), dict) or not isinstance(sd.get("param_groups"), list):
        raise ValueError(f"{who}: expected an optimizer state_dict() (a dict with a 'state' dict and a 'param_groups' "
                         f"list), found {_desc(sd)}; nothing was loaded.")
    saved = sd["param_groups"]
    if len(saved) != len(groups):
        raise ValueError(f"{who}: the state dict has {len(saved)} param groups, this optimizer {len(groups)}; build the "
                         "optimizer with the same groups as the one that was saved. Nothing was loaded.")
    hypers = []
    for gi, (sg, g) in enumerate(zip(saved, groups)):
        ids = sg.get("params") if isinstance(sg, dict) else None
        if not isinstance(ids, (list, tuple)) or len(ids) != len(g["params"]):
            raise ValueError(f"{who}: param group {gi} holds {len(ids) if isinstance(ids, (list, tuple)) else _desc(sg)} "
                             f"parameters in the state dict and {len(g['params'])} here; the parameter lists must match "
                             "(same model, same group order). Nothing was loaded.")
        hyper = {k: v for k, v in sg.items() if k != "params" and k not in STRUCTURAL_KEYS and k not in IMPL_KEYS}
        if "lr" in hyper and (not isinstance(hyper["lr"], (int, float, torch.Tensor)) or not math.isfinite(float(hyper["lr"]))):
            raise ValueError(f"{who}: lr={hyper['lr']!r} in param group {gi} of the state dict: the learning rate must be "
                             "a finite number. Nothing was loaded.")
        check_hyper(gi, hyper)
        hypers.append(copy.deepcopy(hyper))
    cache: dict = {}
    states: dict[int, dict] = {}
    for e in entries:
        sg = saved[e.group]
        sid = sg["params"][e.index]
        names = sg.get("param_names")
        name = f" {names[e.index]!r}" if isinstance(names, (list, tuple)) and len(names) > e.index else ""
        try:
            st = sd["state"].get(sid, {})
        except TypeError:  # an unhashable id
            st = None
        where = f"parameter {e.flat}{name} (param group {e.group}, index {e.index}, shape {tuple(e.local.shape)})"

        def bad(key: str, expected: str, found: Any) -> ValueError:
            return ValueError(f"{who}: {where}, state {key!r}: expected {expected}, found {found}; nothing was loaded. "
                              "Load a state dict saved by an optimizer over this model.")

        if not isinstance(st, dict):
            raise bad("*", "a dict of state tensors", _desc(st))
        tmpl = _template(e, hypers[e.group], cache) if st else {}
        missing = [k for k in tmpl if k not in st]
        if missing:
            raise bad(missing[0], f"the keys {sorted(tmpl)} of {type(e.opt).__name__}'s state", f"keys {sorted(st)}")
        out: dict[str, Any] = {}
        for k, v in st.items():
            t = e.master if k == "master_param" else tmpl.get(k)
            if t is None or not torch.is_tensor(t):
                out[k] = v.to(e.inner.device, e.inner.dtype if v.is_floating_point() else v.dtype, copy=True) \
                    if torch.is_tensor(v) and k != "master_param" else copy.deepcopy(v)
                continue
            scalar = t.dim() == 0
            shape = () if scalar else tuple(e.local.shape) if k == "master_param" or t.shape == (2,) * e.inner.dim() else None
            kind = "complex" if t.is_complex() else "floating-point" if t.is_floating_point() else str(t.dtype)
            want = f"a {kind} tensor" + (f" of shape {shape}" if shape is not None else "")
            if not torch.is_tensor(v):
                if not (scalar and isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)):
                    raise bad(k, want, _desc(v))
                v = torch.tensor(float(v))
            if (v.is_complex(), v.is_floating_point()) != (t.is_complex(), t.is_floating_point()) and not scalar:
                raise bad(k, want, _desc(v))
            if (scalar and v.numel() != 1) or (shape is not None and not scalar and tuple(v.shape) != shape):
                raise bad(k, want, _desc(v))
            if k == "master_param":
                out[k] = v
            elif k == "step":
                out[k] = _step_value(v.detach().reshape(()).clone(), e.inner, wants_device_step(e.sub_group))
            else:
                out[k] = v.to(e.inner.device, e.inner.dtype if v.is_floating_point() else v.dtype, copy=True)
        states[e.flat] = out
    return hypers, states
