"""``HybridDeviceOptimizer`` state through ``torch.distributed.checkpoint`` (DCP), at any world size and fraction (private).

Note [DCP layout]: the optimizer's ``state_dict()`` holds each rank's local tensors keyed by index;
DCP reshards only global tensors, so the adapter writes

    {"model": <the model's state_dict()>,
     "optim": {"state": {fqn: {"exp_avg": T, "exp_avg_sq": T, "step": t[, "master_param": T]}},
               "param_groups": <JSON string of the groups, params as FQNs>}}

where ``T`` wraps the optimizer's own state tensor, wherever it lives, as a DTensor with the
parameter's placements (a plain tensor for a replicated parameter, which DCP dedups).
``master_param`` is written only when its dtype differs from the parameter's. The keys depend on
dtypes only, never on fraction or world size, so loading builds tensors in the new layout from the
metadata, lets DCP reshard into them, and hands the result to ``load_state_dict``.
"""

from __future__ import annotations

import json
import warnings
from typing import Any, Optional

import torch
from torch import nn

from ..errors import OffloadError
from ._shards import check_optimizer, is_dtensor, local_shard, param_owners, shard_of

__all__: list[str] = []

_MODEL, _OPTIM = "model", "optim"


def _dcp(op: Any, state_dict: dict, checkpoint_id: Any, process_group: Any) -> None:
    """``dcp.save``/``dcp.load``; without a process group as one process, which DCP is told explicitly and
    warns about even then (here that is the intent, so the warning is silenced)."""
    import torch.distributed as dist

    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        op(state_dict, checkpoint_id=checkpoint_id, process_group=process_group,
           no_dist=not (dist.is_available() and dist.is_initialized()))


def _unwrap(model: nn.Module) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return model.module if isinstance(model, DistributedDataParallel) else model


def _fqns(model: nn.Module, opt: Any, who: str) -> list[list[str]]:
    owners = param_owners(_unwrap(model))
    out = []
    for gi, g in enumerate(opt.param_groups):
        row = []
        for pi, p in enumerate(g["params"]):
            if id(p) not in owners:
                raise ValueError(
                    f"{who}: parameter {pi} of param group {gi} (shape {tuple(p.shape)}) is not a parameter of the model; "
                    "pass the model the optimizer was built on."
                )
            row.append(owners[id(p)][2])
        out.append(row)
    return out


def _as_global(v: torch.Tensor, p: torch.Tensor) -> torch.Tensor:
    """``v`` (this rank's piece of a state of ``p``) as DCP should see it; no copy, no device move."""
    if not is_dtensor(p) or v.dim() == 0 or tuple(v.shape) != tuple(local_shard(p).shape):
        return v
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    # DTensor.from_local would move a host tensor to the mesh's device; build the wrapper directly.
    spec = DTensorSpec(p.device_mesh, tuple(p.placements), tensor_meta=TensorMeta(p.shape, p.stride(), v.dtype))
    return DTensor(v.detach(), spec, requires_grad=False)


def _groups_json(opt: Any, fqns: list[list[str]]) -> str:
    groups = []
    for g, names in zip(opt.param_groups, fqns):
        d = {}
        for k, v in g.items():
            v = v.item() if isinstance(v, torch.Tensor) else v
            d[k] = names if k == "params" else list(v) if isinstance(v, tuple) else v
        groups.append(d)
    return json.dumps(groups, sort_keys=True)


def _optimizer_state_dict(model: nn.Module, optimizer: Any, who: str) -> dict[str, Any]:
    opt = check_optimizer(optimizer, who)
    fqns = _fqns(model, opt, who)
    opt.flush()
    state: dict[str, dict[str, Any]] = {}
    for g, names in zip(opt.param_groups, fqns):
        for p, name in zip(g["params"], names):
            st = opt.state.get(p)
            if not st:
                continue
            if opt.pipeline.is_host(p) and not opt.pipeline.steps_here(p):
                continue  # its owner writes it (Note [Host-step sharding]); this rank's copy may be stale
            out = {}
            for k, v in st.items():
                if k == "master_param" and (not torch.is_tensor(v) or v.dtype == p.dtype):
                    continue  # equals the weights (Note [DCP layout])
                out[k] = _as_global(v, p) if torch.is_tensor(v) else v
            state[name] = out
    return {"state": state, "param_groups": _groups_json(opt, fqns)}


def _template(opt: Any, fqns: list[list[str]], md: Any, key: str) -> dict[str, Any]:
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    entries = md.state_dict_metadata
    by_fqn: dict[str, dict[str, Any]] = {}
    prefix = f"{key}.state."
    for k, meta in entries.items():
        if k.startswith(prefix) and isinstance(meta, TensorStorageMetadata):
            fqn, _, name = k[len(prefix) :].rpartition(".")
            by_fqn.setdefault(fqn, {})[name] = meta
    state: dict[str, dict[str, Any]] = {}
    for g, names in zip(opt.param_groups, fqns):
        for p, name in zip(g["params"], names):
            metas = by_fqn.get(name)
            if not metas:
                continue
            d = {}
            for sk, meta in metas.items():
                size, dtype = tuple(meta.size), meta.properties.dtype
                if is_dtensor(p) and size == tuple(p.shape) and len(size) > 0:
                    local_shape, _ = shard_of(p)
                    d[sk] = _as_global(torch.empty(local_shape, dtype=dtype), p)
                else:
                    d[sk] = torch.empty(size, dtype=dtype)
            state[name] = d
    if f"{key}.param_groups" not in entries:
        raise OffloadError(
            f"load_checkpoint: the checkpoint has no '{key}.param_groups'; it was not written by "
            "annotate_offload.distributed.save_checkpoint (or key= differs)."
        )
    return {"state": state, "param_groups": ""}


def _loadable(fqns: list[list[str]], state_dict: dict[str, Any]) -> dict[str, Any]:
    """The optimizer part of a DCP checkpoint as ``opt.load_state_dict`` takes it, resharded into the current layout
    (``fqns``: the optimizer's parameters, group by group). Hyper-parameters come from the checkpoint; structural
    options (fraction, modes) stay the optimizer's. ``ValueError``: the saved groups hold other FQNs."""
    saved_groups = json.loads(state_dict["param_groups"]) if isinstance(state_dict["param_groups"], str) else state_dict["param_groups"]
    if [g["params"] for g in saved_groups] != fqns:
        raise ValueError(
            "load_checkpoint: the checkpoint's param groups hold parameters "
            f"{[g['params'][:3] for g in saved_groups]}... but the optimizer's are {[f[:3] for f in fqns]}...; build the "
            "optimizer with the same groups, in the same order, as the one that was saved."
        )
    flat = [name for names in fqns for name in names]
    state = {i: {k: (local_shard(v) if torch.is_tensor(v) else v) for k, v in st.items()}
             for i, name in enumerate(flat) if (st := state_dict["state"].get(name))}
    groups, start = [], 0
    for sg, names in zip(saved_groups, fqns):
        hyper = {k: (tuple(v) if k == "betas" and isinstance(v, list) else v) for k, v in sg.items() if k != "params"}
        groups.append({**hyper, "params": list(range(start, start + len(names)))})
        start += len(names)
    return {"state": state, "param_groups": groups}


def save_checkpoint(model: nn.Module, optimizer: Any, checkpoint_id: Any, *, process_group: Any = None) -> None:
    """Save model and ``HybridDeviceOptimizer`` state with ``torch.distributed.checkpoint``.

    Collective: every rank of ``process_group`` calls it. Loadable by :func:`load_checkpoint` at
    another world size, another ``offload_fraction``, DDP or FSDP2 or a single process.

    Args:
        model (nn.Module): DDP-wrapped, ``fully_shard``-ed or plain; its ``state_dict()`` is saved
            (a DDP wrapper's inner module, so keys carry no ``module.`` prefix).
        optimizer (HybridDeviceOptimizer): built on ``model``'s parameters.
        checkpoint_id (str | os.PathLike): checkpoint directory (DCP's ``FileSystemWriter``).
        process_group: DCP's process group. Default: the default group (none: single process).
    """
    import torch.distributed.checkpoint as dcp

    sd = {_MODEL: _unwrap(model).state_dict(), _OPTIM: _optimizer_state_dict(model, optimizer, "save_checkpoint")}
    _dcp(dcp.save, sd, checkpoint_id, process_group)


def load_checkpoint(model: nn.Module, optimizer: Optional[Any], checkpoint_id: Any, *, process_group: Any = None) -> None:
    """Load a checkpoint of :func:`save_checkpoint` into ``model`` (in place) and ``optimizer`` (``None``:
    weights only), with the arguments of :func:`save_checkpoint`. The checkpoint is checked and its
    optimizer part read first; then the weights are written in place, the masters re-seeded from them,
    and the optimizer state loaded in its own layout (Note [DCP layout]). A refused load changes nothing.

    Raises:
        OffloadError: the checkpoint has no optimizer part (``optimizer`` given).
        ValueError: the checkpoint's model keys or shapes differ from ``model``'s, or its param groups
            hold other parameters (by FQN) than the optimizer's.
    """
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    inner = _unwrap(model)
    opt = check_optimizer(optimizer, "load_checkpoint") if optimizer is not None else None
    msd = inner.state_dict()
    md = dcp.FileSystemReader(checkpoint_id).read_metadata()
    saved = {k[len(_MODEL) + 1 :] for k in md.state_dict_metadata if k.startswith(_MODEL + ".")}
    missing, unexpected = sorted(set(msd) - saved), sorted(saved - set(msd))
    if missing or unexpected:
        raise ValueError(
            f"load_checkpoint: {checkpoint_id!s} holds another model: missing {missing[:5]}"
            f"{' ...' if len(missing) > 5 else ''}, unexpected {unexpected[:5]}{' ...' if len(unexpected) > 5 else ''} "
            "(keys of the model's state_dict()); load it into the architecture that saved it."
        )
    shapes = [f"{k}: {tuple(m.size)} there, {tuple(v.shape)} here" for k, v in msd.items() if isinstance(
        m := md.state_dict_metadata[f"{_MODEL}.{k}"], TensorStorageMetadata) and tuple(m.size) != tuple(v.shape)]
    if shapes:
        raise ValueError(f"load_checkpoint: {checkpoint_id!s} holds another model: {'; '.join(shapes[:5])} (shapes of "
                         "the model's state_dict()); load it into the architecture that saved it.")
    if opt is not None:  # read and check the optimizer part before a weight changes
        fqns = _fqns(model, opt, "load_checkpoint")
        osd = _template(opt, fqns, md, _OPTIM)
        _dcp(dcp.load, {_OPTIM: osd}, checkpoint_id, process_group)
        osd = _loadable(fqns, osd)
    _dcp(dcp.load, {_MODEL: msd}, checkpoint_id, process_group)
    inner.load_state_dict(msd)
    if opt is not None:
        opt.reload_model_params()
        opt.load_state_dict(osd)
