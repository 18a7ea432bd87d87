"""State placement and the validated ``load_state_dict`` of :class:`HybridDeviceOptimizer` (private).

``opt.state[p]`` is the very dict the sub-optimizer keeps for ``p``'s inner tensor; :func:`place`
repairs what user code moved (RL frameworks move optimizer state to the host and back).

Note [Validated loads]: torch's ``Optimizer.load_state_dict`` checks only counts, and a moment of the
wrong shape reaches the fused kernel, which reads or writes out of bounds. :func:`check_load` checks
everything against what the class itself creates (:func:`probe`) and builds the converted state
aside, so a refused load changes nothing.
"""

from __future__ import annotations

import copy
import math
from typing import Any, Callable, Optional

import torch

from ._pipeline import IMPL_KEYS, STRUCTURAL_KEYS, Slot

__all__: list[str] = []


def _step(v: torch.Tensor, e: Slot) -> torch.Tensor:
    """``step`` where torch keeps it: fp32 on the parameter's device for fused/capturable groups, else the CPU."""
    if e.sub_group.get("fused") or e.sub_group.get("capturable"):
        return v if v.dtype == torch.float32 and v.get_device() == e.inner.get_device() else v.to(e.inner.device, torch.float32)
    return v if v.get_device() < 0 else v.to("cpu")


def place(e: Slot, st: dict[str, Any]) -> None:
    """Make ``st`` the sub-optimizer's state of ``e`` and put its tensors back where ``e`` is stepped (a
    replaced ``master_param`` is copied into the master). Runs at every step: no ``.device``, no ``.to()``
    when all is in place."""
    if e.st is not st:
        e.opt.state[e.inner] = e.st = st
    dev = e.inner.get_device()
    for k, v in list(st.items()):
        if not isinstance(v, torch.Tensor):
            continue
        if k == "master_param":
            if e.master is None:
                del st[k]
            elif v is not e.master:
                with torch.no_grad():
                    e.master.copy_(v)
                st[k] = e.master
        elif k == "step":
            if (nv := _step(v, e)) is not v:
                st[k] = nv
        elif v.get_device() != dev:
            st[k] = v.to(e.inner.device)


def detach_views(st: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of ``st`` where views of a larger storage (the pinned slabs) are cloned, so
    ``torch.save`` writes the tensor, not its whole slab."""
    return {k: v.clone() if torch.is_tensor(v) and v.untyped_storage().nbytes() > v.numel() * v.element_size() else v
            for k, v in st.items()}


def probe(cls: type, kw: dict[str, Any], like: list[tuple[torch.dtype, Any, int]], *,
          group: bool = False) -> tuple[Optional[dict[str, Any]], Optional[Exception]]:
    """Step ``cls`` once, on zero gradients, over one tensor of side 2 per ``(dtype, device, ndim)`` of
    ``like``, with ``kw`` as constructor keywords (checked by the constructor) or as the group's values
    (``group``). Returns the state it created for the first tensor, or the error it raised."""
    try:
        ps = [torch.zeros((2,) * n, dtype=d, device=dev) for d, dev, n in like]
        for p in ps:
            p.grad = torch.zeros_like(p)
        opt = cls([{**kw, "params": ps}]) if group else cls(ps, **kw)
        opt.step()
        return dict(opt.state.get(ps[0], {})), None
    except (TypeError, ValueError, RuntimeError, NotImplementedError, AssertionError) as err:
        return None, err


def _desc(v: Any) -> str:
    return f"a tensor of shape {tuple(v.shape)} and dtype {v.dtype}" if torch.is_tensor(v) else f"{type(v).__name__} {v!r:.80}"


def _convert(e: Slot, k: str, v: Any, t: Any, bad: Callable[[str], ValueError]) -> Any:
    """``v`` loaded as state ``k`` of ``e``, cast and moved as torch does; ``t``: what the class creates."""
    if not torch.is_tensor(t):  # a key the class does not create: kept, cast and moved as torch keeps it
        if torch.is_tensor(v) and k != "master_param":
            return v.to(e.inner.device, e.inner.dtype if v.is_floating_point() else v.dtype, copy=True)
        return copy.deepcopy(v)
    shape = () if t.dim() == 0 else tuple(e.local.shape) if k == "master_param" or t.shape == (2,) * e.inner.dim() else None
    kind = "complex" if t.is_complex() else "floating-point" if t.is_floating_point() else str(t.dtype)
    if not torch.is_tensor(v) and shape == () and type(v) in (int, float) and math.isfinite(v):
        v = torch.tensor(float(v))
    if (not torch.is_tensor(v) or (shape == () and v.numel() != 1) or (shape and tuple(v.shape) != shape)
            or (shape != () and (v.is_complex(), v.is_floating_point()) != (t.is_complex(), t.is_floating_point()))):
        raise bad(f"a {kind} tensor" + (f" of shape {shape}" if shape is not None else ""))
    if k in ("master_param", "step"):
        return v if k == "master_param" else _step(v.detach().reshape(()).clone(), e)
    return v.to(e.inner.device, e.inner.dtype if v.is_floating_point() else v.dtype, copy=True)


def check_load(sd: Any, entries: list[Slot], groups: list[dict[str, Any]],
               check_hyper: Callable[[int, dict[str, Any]], None]) -> tuple[list[dict[str, Any]], dict[int, dict]]:
    """Validate ``sd`` against the optimizer and convert it (Note [Validated loads]); applies nothing.
    Returns ``(hyper-parameters per group, state per flat index)``."""
    def bad(what: str) -> ValueError:
        return ValueError(f"HybridDeviceOptimizer.load_state_dict: {what}; nothing was loaded. Load a state dict "
                          "saved by an optimizer over this model, with the same param groups.")

    if not (isinstance(sd, dict) and isinstance(sd.get("state"), dict) and isinstance(sd.get("param_groups"), list)):
        raise bad(f"expected an optimizer state_dict() (a 'state' dict and a 'param_groups' list), found {_desc(sd)}")
    saved = sd["param_groups"]
    if len(saved) != len(groups):
        raise bad(f"the state dict has {len(saved)} param groups, this optimizer {len(groups)}")
    hypers = []
    for gi, (sg, g) in enumerate(zip(saved, groups)):
        ids = sg.get("params") if isinstance(sg, dict) else None
        if not isinstance(ids, (list, tuple)) or len(ids) != len(g["params"]):
            raise bad(f"param group {gi} holds {len(ids) if isinstance(ids, (list, tuple)) else _desc(sg)} parameters "
                      f"in the state dict and {len(g['params'])} here")
        hypers.append({k: copy.deepcopy(v) for k, v in sg.items() if k not in ("params", *STRUCTURAL_KEYS, *IMPL_KEYS)})
        check_hyper(gi, hypers[-1])
    cache: dict = {}
    states: dict[int, dict] = {}
    for e in entries:
        sg = saved[e.group]
        names = sg.get("param_names") or ()
        where = (f"parameter {e.flat}{f' {names[e.index]!r}' if len(names) > e.index else ''} (param group {e.group}, "
                 f"index {e.index}, shape {tuple(e.local.shape)})")
        try:
            st = sd["state"].get(sg["params"][e.index], {})
        except TypeError:  # an unhashable id
            st = None
        if not isinstance(st, dict):
            raise bad(f"{where}: expected a dict of state tensors, found {_desc(st)}")
        if st:  # what the class creates, with the loaded hyper-parameters
            kw = {k: v for k, v in e.sub_group.items() if k != "params"}
            kw.update({k: v for k, v in hypers[e.group].items() if k in kw})
            key = (type(e.opt), repr(sorted(kw.items())), e.inner.dtype, e.inner.device, e.inner.dim())
            tmpl = cache[key] if key in cache else cache.setdefault(key, probe(type(e.opt), kw, [key[2:]], group=True)[0] or {})
            if missing := [k for k in tmpl if k not in st]:
                raise bad(f"{where}, state {missing[0]!r}: expected the keys {sorted(tmpl)}, found {sorted(st)}")
            states[e.flat] = {k: _convert(e, k, v, e.master if k == "master_param" else tmpl.get(k),
                                          lambda want, k=k, v=v: bad(f"{where}, state {k!r}: expected {want}, found {_desc(v)}"))
                              for k, v in st.items()}
        else:
            states[e.flat] = {}
    return hypers, states
