"""State placement and ``load_state_dict`` of :class:`HybridDeviceOptimizer` (private).

``opt.state[p]`` is the very dict the sub-optimizer keeps for ``p``'s inner tensor (one structure,
not two aliased ones: moving one half of an aliased pair is what broke verl/Megatron resumes,
reference/optimizer_offload.md §6 item 8). :func:`place` repairs what user code moved.
"""

from __future__ import annotations

import copy
from typing import TYPE_CHECKING, Any, Optional

import torch

if TYPE_CHECKING:  # pragma: no cover
    from ._hybrid import HybridDeviceOptimizer

__all__: list[str] = []


def wants_device_step(group: dict[str, Any]) -> bool:
    """torch keeps ``step`` as an fp32 tensor on the param's device for fused/capturable groups
    (per group, as torch's own ``load_state_dict``: Note [Complex parameters] in ``_build.py``)."""
    return bool(group.get("fused") or group.get("capturable"))


def _step_value(v: torch.Tensor, inner: torch.Tensor, fused: bool) -> torch.Tensor:
    if fused:  # checked first: this runs for every parameter at every step, and .to() costs a dispatch
        if v.dtype == torch.float32 and v.device == inner.device:
            return v
        return v.to(device=inner.device, dtype=torch.float32)
    return v.to("cpu") if v.device.type != "cpu" else v


def place(st: dict[str, Any], inner: torch.Tensor, master: Optional[torch.Tensor], *, fused: bool) -> None:
    """Move ``st``'s tensors back to ``inner``'s device and re-attach ``master_param`` (in place)."""
    for k, v in list(st.items()):
        if not torch.is_tensor(v):
            continue
        if k == "master_param":
            if master is None:
                del st[k]
            elif v is not master:
                with torch.no_grad():
                    master.copy_(v)
                st[k] = master
        elif k == "step":
            nv = _step_value(v, inner, fused)
            if nv is not v:
                st[k] = nv
        elif v.device != inner.device:
            st[k] = v.to(inner.device)


def detach_views(st: dict[str, Any]) -> dict[str, Any]:
    """A shallow copy of ``st`` where tensors that view a larger storage (pinned slabs) are cloned.

    ``torch.save`` of a view writes its whole storage, so a master that views a 256 MiB slab would
    otherwise cost 256 MiB in the checkpoint.
    """
    out = dict(st)
    for k, v in out.items():
        if torch.is_tensor(v) and v.untyped_storage().nbytes() > v.numel() * v.element_size():
            out[k] = v.clone()
    return out


def load(opt: "HybridDeviceOptimizer", sd: dict[str, Any], structural: tuple[str, ...]) -> None:
    """Load ``sd`` into ``opt``; see ``HybridDeviceOptimizer.load_state_dict``. Group keys in
    ``structural`` are not taken from ``sd``."""
    if not isinstance(sd, dict) or "param_groups" not in sd or "state" not in sd:
        raise ValueError(
            "HybridDeviceOptimizer.load_state_dict: expected a dict with 'state' and 'param_groups' "
            f"(an optimizer state_dict()), got {type(sd).__name__} with keys {sorted(sd) if isinstance(sd, dict) else '-'}."
        )
    saved_groups = sd["param_groups"]
    if len(saved_groups) != len(opt.param_groups):
        raise ValueError(
            f"HybridDeviceOptimizer.load_state_dict: the state dict has {len(saved_groups)} param groups, this optimizer "
            f"{len(opt.param_groups)}; build the optimizer with the same groups as the one that was saved."
        )
    for i, (sg, g) in enumerate(zip(saved_groups, opt.param_groups)):
        if len(sg["params"]) != len(g["params"]):
            raise ValueError(
                f"HybridDeviceOptimizer.load_state_dict: param group {i} has {len(sg['params'])} params in the state dict "
                f"and {len(g['params'])} here; the parameter lists must match (same model, same group order)."
            )
    saved_state = sd["state"]
    for sg, g in zip(saved_groups, opt.param_groups):
        for k, v in sg.items():
            if k != "params" and k not in structural:
                g[k] = copy.deepcopy(v)
        for sid, p in zip(sg["params"], g["params"]):
            _load_one(opt, p, saved_state.get(sid, {}))
    opt._sync_hyper()


def _load_one(opt: "HybridDeviceOptimizer", p: torch.Tensor, saved: dict[str, Any]) -> None:
    from ._slots import HostSlot

    slot = opt._slot_of[id(p)]
    if isinstance(slot, HostSlot):
        inner, master, sub = slot.master, slot.master, opt._chunks[slot.chunk].opt
    else:
        inner, sub = slot.inner, opt._gpu_opt
        master = slot.inner if slot.has_master else None
    fused = wants_device_step(slot.sub_group)
    new: dict[str, Any] = {}
    with torch.no_grad():
        # Note [Loading masters]: a master of the model's own dtype is the weight itself, and the
        # model is its authority: it is re-seeded from the model below, so loading an optimizer
        # checkpoint alone leaves the weights as they are, as torch's optimizers do (it used to put
        # the checkpoint's weights back into the model at the next step, for host-stepped
        # parameters only; fresh-user report, eighth session). A wider master (fp32 for a bf16
        # model) holds bits the model does not, so it is loaded; so is every host master in
        # delayed mode, where the masters run one update ahead of the model by design (a model
        # file written before state_dict()'s flush lacks that update; load_state_dict then
        # writes the loaded masters into the model).
        from_checkpoint = master is not None and (master.dtype != slot.local.dtype
                                                  or (opt._delayed and isinstance(slot, HostSlot)))
        for k, v in saved.items():
            if k == "master_param":
                if from_checkpoint:
                    master.copy_(v)
            elif k == "step" and torch.is_tensor(v):
                new[k] = _step_value(v.clone(), inner, fused)
            elif torch.is_tensor(v):
                dt = inner.dtype if v.is_floating_point() else v.dtype
                new[k] = v.to(device=inner.device, dtype=dt, copy=True)
            else:
                new[k] = copy.deepcopy(v)
        if master is not None and not (from_checkpoint and "master_param" in saved):
            master.copy_(slot.local)  # no master saved (e.g. a plain AdamW checkpoint) or the same dtype: the model's
        if master is not None and new:
            new["master_param"] = master
    slot.p_ver = p._version
    opt.state[p] = new
    sub.state[inner] = new
