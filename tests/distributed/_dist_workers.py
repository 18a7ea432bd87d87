"""Per-rank bodies of the distributed tests (importable by spawned processes)."""

from __future__ import annotations

import warnings
from typing import Any

import torch
import torch.distributed as dist
from torch import nn

from _dist_harness import LR, batches, full, loss_fn, make_model

from annotate_offload.annotate import offload_transform
from annotate_offload.distributed import attach_optimizer, clip_grad_norm_, load_checkpoint, local_thread_budget, save_checkpoint
from annotate_offload.config import ModelConfig
from annotate_offload.errors import OffloadError
from annotate_offload.optim import HybridDeviceOptimizer


def _offload(model: nn.Module) -> nn.Module:
    # min_offload_numel=1: the tiny model's activations are below the 256K default
    return offload_transform(model, 2, config=ModelConfig(cpu_offloading=True, min_offload_numel=1, prefetch_layers=1))


def _train(model: nn.Module, opt: Any, rank: int, steps: int, first: int = 0, total: "int | None" = None) -> list[float]:
    losses = []
    data = batches(total or steps, dist.get_world_size())
    for s in range(first, steps):
        loss = loss_fn(model(data[s][rank]))
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


def _host(opt: Any) -> list[tuple[torch.Tensor, int]]:
    """(parameter, host chunk) of every host-stepped parameter."""
    params = [p for g in opt.param_groups for p in g["params"]]
    return [(p, pl.chunk) for p, pl in zip(params, opt.placements) if pl.side == "cpu"]


def _owned_chunks(opt: Any) -> list[int]:
    """Host chunks this rank steps (all of them unless the host step is sharded)."""
    return sorted({c for p, c in _host(opt) if opt.pipeline.steps_here(p)})


def _owned_host_params(opt: Any) -> int:
    return sum(1 for p, _ in _host(opt) if opt.pipeline.steps_here(p))


def _weights(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: full(v).detach().clone() for k, v in model.state_dict().items()}


# --------------------------------------------------------------------------- DDP
def ddp_train(rank: int, world: int, *, out_dir: str, bucket_view: bool, attach: bool, steps: int = 3,
              fraction: float = 0.5, offload: bool = True, shard: bool = True, **opt_kw: Any) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model()
    if offload:
        _offload(model)
    # tiny buckets: several buckets, so D2H starts bucket by bucket
    ddp = DDP(model, gradient_as_bucket_view=bucket_view, bucket_cap_mb=0.001)
    budget = local_thread_budget()
    opt = HybridDeviceOptimizer(ddp.parameters(), offload_fraction=fraction, lr=LR, cpu_threads=budget.threads, **opt_kw)
    hook = None
    caught: list[str] = []
    if attach:
        with warnings.catch_warnings(record=True) as w:
            warnings.simplefilter("always")
            hook = attach_optimizer(ddp, opt, shard_host_step=shard)
        caught = [str(x.message) for x in w]
    else:
        late = [0]

        def count_late(*_):  # what OffloadCommHook.copied_at_step counts, for the optimizer's own hooks
            late[0] += opt.pipeline.uncopied()

        opt.register_step_pre_hook(count_late)
    stepped: dict[int, int] = {}  # host chunk -> host optimizer steps run on this rank
    for ci, sub in enumerate(opt.cpu_optimizers):
        sub.register_step_post_hook(lambda *_, ci=ci: stepped.__setitem__(ci, stepped.get(ci, 0) + 1))
    losses = _train(ddp, opt, rank, steps)
    shard = getattr(hook, "shard", None)
    try:
        opt.state_dict()
        state_dict = "ok"
    except OffloadError as e:
        state_dict = f"OffloadError: {e}"
    return {
        "weights": _weights(model), "losses": losses, "warnings": caught, "stepped_chunks": sorted(stepped),
        "chunks": len(opt.cpu_optimizers), "owned_chunks": None if shard is None else _owned_chunks(opt),
        "owned_host_params": _owned_host_params(opt),
        "broadcasts": None if shard is None else shard.broadcasts, "state_dict": state_dict,
        "copied_in_hook": None if hook is None else hook.copied_in_hook,
        "copied_at_step": late[0] if hook is None else hook.copied_at_step,
        "host_params": sum(1 for p in opt.placements if p.side == "cpu"),
        "threads": opt.thread_budget, "budget": budget.threads,
        "bytes_per_step": model.offload_plan.bytes_per_step if offload else None,
    }


def ddp_suite(rank: int, world: int, *, out_dir: str, steps: int) -> dict[str, Any]:
    """All DDP scenarios in one pair of processes (spawning costs more than the scenarios)."""
    return {
        "bucket_view": ddp_train(rank, world, out_dir=out_dir, bucket_view=True, attach=True, steps=steps, chunk_bytes=512),
        "replicated": ddp_train(rank, world, out_dir=out_dir, bucket_view=True, attach=True, steps=steps, shard=False,
                                chunk_bytes=512),
        "serial": ddp_train(rank, world, out_dir=out_dir, bucket_view=True, attach=True, steps=steps, chunk_bytes=512,
                            overlap_cpu_optimizer_d2h_h2d=False),
        "no_bucket_view": ddp_train(rank, world, out_dir=out_dir, bucket_view=False, attach=True, steps=steps,
                                    fraction=1.0, offload=False),
        "unattached": ddp_train(rank, world, out_dir=out_dir, bucket_view=True, attach=False, steps=steps,
                                fraction=1.0, offload=False),
        "refusals": ddp_refusals(rank, world, out_dir=out_dir),
        # the host step of a chunk starts in backward, once DDP has reduced all its gradients
        "step_in_backward": ddp_train(rank, world, out_dir=out_dir, bucket_view=True, attach=True, steps=steps,
                                      fraction=1.0, chunk_bytes=1024, step_in_backward=True),
    }


def ddp_refusals(rank: int, world: int, *, out_dir: str) -> dict[str, str]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    out = {}
    model = make_model()
    ddp = DDP(model, gradient_as_bucket_view=True)
    for name, call in {
        "not_hdo": lambda: attach_optimizer(ddp, torch.optim.AdamW(ddp.parameters())),
        "offload_gradients": lambda: attach_optimizer(ddp, HybridDeviceOptimizer(ddp.parameters(), offload_gradients=True)),
        "delayed_sharded": lambda: attach_optimizer(ddp, HybridDeviceOptimizer(ddp.parameters(), delayed_param_update=True)),
        "foreign": lambda: attach_optimizer(ddp, HybridDeviceOptimizer([nn.Parameter(torch.ones(3))])),
    }.items():
        try:
            call()
            out[name] = "no error"
        except (TypeError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    attach_optimizer(ddp, HybridDeviceOptimizer(ddp.parameters(), offload_fraction=0.5))
    try:  # last: the DDP model now has our comm hook
        attach_optimizer(ddp, HybridDeviceOptimizer(ddp.parameters(), offload_fraction=0.5))
        out["twice"] = "no error"
    except OffloadError as e:
        out["twice"] = f"OffloadError: {e}"
    return out


# --------------------------------------------------------------------------- FSDP2
def _shard(model: nn.Module, reshard: bool = True, mp: bool = False) -> nn.Module:
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw = {"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)} if mp else {}
    for m in (model.inp, *model.layers, model.head):
        fully_shard(m, reshard_after_forward=reshard, **kw)
    fully_shard(model, reshard_after_forward=reshard, **kw)
    return model


def fsdp_train(rank: int, world: int, *, out_dir: str, steps: int = 3, fraction: float = 0.5, offload: bool = True,
               offload_gradients: bool = False, clip: "float | None" = None, reshard: bool = True,
               mp: bool = False, autocast: bool = False, batched_numel: "int | None" = None, **opt_kw: Any) -> dict[str, Any]:
    if batched_numel is not None:  # Note [Tiny gradients at step()]: 0 gives every test tensor its own hook
        from annotate_offload.optim import _hybrid

        saved, _hybrid.BATCHED_NUMEL = _hybrid.BATCHED_NUMEL, batched_numel
        try:
            return fsdp_train(rank, world, out_dir=out_dir, steps=steps, fraction=fraction, offload=offload,
                              offload_gradients=offload_gradients, clip=clip, reshard=reshard, mp=mp, autocast=autocast,
                              **opt_kw)
        finally:
            _hybrid.BATCHED_NUMEL = saved
    model = make_model()
    if offload:
        _offload(model)  # before fully_shard (fx tracing would run FSDP's pre-forward hooks), as torchtitan orders AC
    _shard(model, reshard, mp)
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=fraction, lr=LR, offload_gradients=offload_gradients, **opt_kw)
    att = attach_optimizer(model, opt)
    losses = []
    data = batches(steps, world)
    for s in range(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(data[s][rank])
        loss = loss_fn(out)
        loss.backward()
        if clip is not None:
            clip_grad_norm_(model.parameters(), clip, optimizer=opt)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    refused = twice = ""
    try:
        opt.clip_grad_norm_(1.0)
    except OffloadError as e:
        refused = str(e)
    try:
        attach_optimizer(model, opt)
    except OffloadError as e:
        twice = str(e)
    return {
        "weights": _weights(model), "losses": losses, "clip_refused": refused, "attached_twice": twice,
        "placements": opt.placements, "recopied": att.recopied, "copied_at_step": att.copied_at_step,
        "bytes_per_step": model.offload_plan.bytes_per_step if offload else None,
    }


def fsdp_replaced_param(rank: int, world: int, *, out_dir: str, fp32_masters: bool = False) -> str:
    """``fp32_masters``: a bf16 model stepped on the device half through fp32 masters, no backward
    (the check runs before anything is stepped); else a host-stepped parameter of an fp32 model."""
    model = _shard(make_model(torch.bfloat16 if fp32_masters else torch.float32))
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.0 if fp32_masters else 0.5, lr=LR,
                                param_update_in_fp32=fp32_masters)
    attach_optimizer(model, opt)
    if not fp32_masters:
        loss_fn(model(batches(1, world)[0][rank])).backward()
    # replace the parameter's local storage behind the optimizer's back
    p = model.inp.weight
    p._local_tensor = p._local_tensor.clone()
    try:
        opt.step()
    except OffloadError as e:
        return str(e)
    return "no error"


# --------------------------------------------------------------------------- checkpoints
def fsdp_save(rank: int, world: int, *, out_dir: str, ckpt: str, steps: int, fraction: float, total: int) -> dict[str, Any]:
    model = _shard(_offload(make_model()))
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=fraction, lr=LR)
    attach_optimizer(model, opt)
    losses = _train(model, opt, rank, steps, total=total)
    save_checkpoint(model, opt, ckpt)
    return {"losses": losses}


def fsdp_resume(rank: int, world: int, *, out_dir: str, ckpt: str, first: int, steps: int, fraction: float) -> dict[str, Any]:
    model = _shard(_offload(make_model()))
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=fraction, lr=LR)
    attach_optimizer(model, opt)
    load_checkpoint(model, opt, ckpt)
    losses = _train(model, opt, rank, steps, first=first)
    return {"weights": _weights(model), "losses": losses}


def ddp_resume(rank: int, world: int, *, out_dir: str, ckpt: str, first: int, steps: int, fraction: float) -> dict[str, Any]:
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model()
    ddp = DDP(model, gradient_as_bucket_view=True)
    opt = HybridDeviceOptimizer(ddp.parameters(), offload_fraction=fraction, lr=LR)
    attach_optimizer(ddp, opt)
    load_checkpoint(ddp, opt, ckpt)
    losses = _train(ddp, opt, rank, steps, first=first)
    return {"weights": _weights(model), "losses": losses}


def fsdp_suite(rank: int, world: int, *, out_dir: str, steps: int) -> dict[str, Any]:
    """All FSDP2 scenarios in one pair of processes."""
    return {
        "half": fsdp_train(rank, world, out_dir=out_dir, steps=steps, fraction=0.5),
        "all_offload_grads": fsdp_train(rank, world, out_dir=out_dir, steps=steps, fraction=1.0, offload_gradients=True),
        # the hook path (test tensors are all tiny): its D2H in backward, then the re-copy after clipping
        "clipped": fsdp_train(rank, world, out_dir=out_dir, steps=steps, fraction=0.5, clip=0.05, batched_numel=0),
        "replaced": fsdp_replaced_param(rank, world, out_dir=out_dir),
        "replaced_fp32_master": fsdp_replaced_param(rank, world, out_dir=out_dir, fp32_masters=True),
        "step_in_backward": fsdp_train(rank, world, out_dir=out_dir, steps=steps, fraction=1.0, chunk_bytes=1024,
                                       step_in_backward=True),
        # FSDP2 mixed precision (bf16 all-gathered weights) and autocast (bf16 casts of the weights),
        # each with and without activation offload
        "mp": fsdp_train(rank, world, out_dir=out_dir, steps=2, mp=True),
        "mp_plain": fsdp_train(rank, world, out_dir=out_dir, steps=2, mp=True, offload=False),
        "autocast": fsdp_train(rank, world, out_dir=out_dir, steps=2, autocast=True),
        "autocast_plain": fsdp_train(rank, world, out_dir=out_dir, steps=2, autocast=True, offload=False),
    }


def ddp_save(rank: int, world: int, *, out_dir: str, ckpt: str, steps: int, fraction: float, total: int) -> dict[str, Any]:
    """DDP with the host step sharded: train ``steps`` steps, save (each rank writes its own chunks' state)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    model = make_model()
    ddp = DDP(model, gradient_as_bucket_view=True)
    opt = HybridDeviceOptimizer(ddp.parameters(), offload_fraction=fraction, lr=LR, chunk_bytes=512)
    hook = attach_optimizer(ddp, opt)
    losses = _train(ddp, opt, rank, steps, total=total)
    save_checkpoint(ddp, opt, ckpt)
    assert hook.shard is not None
    return {"losses": losses, "owned": _owned_chunks(opt)}


def checkpoint_suite(rank: int, world: int, *, out_dir: str, ckpt_single: str, ckpt_fsdp: str, half: int,
                     steps: int, ckpt_ddp: str = "") -> dict[str, Any]:
    """Resume a 1-process checkpoint under FSDP2, then write an FSDP2 one and resume it under DDP;
    write a sharded-DDP one (resumed by one process in the test)."""
    return {
        "ddp_save": ddp_save(rank, world, out_dir=out_dir, ckpt=ckpt_ddp, steps=half, fraction=0.5, total=steps),
        "fsdp_from_single": fsdp_resume(rank, world, out_dir=out_dir, ckpt=ckpt_single, first=half, steps=steps, fraction=0.5),
        "fsdp_save": fsdp_save(rank, world, out_dir=out_dir, ckpt=ckpt_fsdp, steps=half, fraction=0.5, total=steps),
        "ddp_from_fsdp": ddp_resume(rank, world, out_dir=out_dir, ckpt=ckpt_fsdp, first=half, steps=steps, fraction=0.25),
    }


# --------------------------------------------------------------------------- CUDA (2 GPUs, NCCL)
def cuda_suite(rank: int, world: int, *, out_dir: str, steps: int, ckpt: str, device: str = "cuda") -> dict[str, Any]:
    """DDP and FSDP2 on ``cuda:rank`` with NCCL; then a DCP round trip FSDP2 f=0.5 -> FSDP2 f=0.25.
    (``device="cpu"`` runs the same code on gloo, to check the test itself without a GPU.)"""
    from torch.nn.parallel import DistributedDataParallel as DDP

    dev = torch.device("cuda", rank) if device == "cuda" else torch.device("cpu")
    data = batches(steps, world)
    out: dict[str, Any] = {}
    for kind in ("ddp", "fsdp"):
        model = _offload(make_model().to(dev))
        wrapped = DDP(model, gradient_as_bucket_view=True, bucket_cap_mb=0.001) if kind == "ddp" else _shard(model)
        # small chunks: several host chunks, so DDP's sharded host step gives each rank some
        opt = HybridDeviceOptimizer(wrapped.parameters(), offload_fraction=0.5, lr=LR, chunk_bytes=512)
        att = attach_optimizer(wrapped, opt)
        for s in range(steps):
            loss_fn(wrapped(data[s][rank].to(dev))).backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize()
        out[kind] = {"weights": {k: v.cpu() for k, v in _weights(model).items()},
                     "host_params": sum(p.side == "cpu" for p in opt.placements),
                     "owned_host_params": _owned_host_params(opt),
                     "copied_in_hook": getattr(att, "copied_in_hook", None), "copied_at_step": getattr(att, "copied_at_step", None)}
        if kind == "fsdp":
            save_checkpoint(model, opt, ckpt)
            want = {i: {k: local_shard_cpu(v) for k, v in opt.state[p].items()} for i, p in enumerate(model.parameters())}
            model2 = _shard(_offload(make_model().to(dev)))
            opt2 = HybridDeviceOptimizer(model2.parameters(), offload_fraction=0.25, lr=LR)
            attach_optimizer(model2, opt2)
            load_checkpoint(model2, opt2, ckpt)
            got = {i: {k: local_shard_cpu(v) for k, v in opt2.state[p].items()} for i, p in enumerate(model2.parameters())}
            out["ckpt_equal"] = all(
                set(got[i]) == set(want[i]) and all(torch.equal(got[i][k], want[i][k]) for k in want[i]) for i in want
            )
            out["ckpt_weights_equal"] = all(torch.equal(full(a).cpu(), full(b).cpu()) for a, b in zip(model.parameters(), model2.parameters()))
    return out


def local_shard_cpu(v: Any) -> Any:
    return v.detach().to("cpu", copy=True) if torch.is_tensor(v) else v
