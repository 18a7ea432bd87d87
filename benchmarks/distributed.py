"""Weak scaling of activation offload + HybridDeviceOptimizer on several GPUs (DDP or FSDP2), under torchrun.

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/distributed.py --parallel ddp [--bind]
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/distributed.py --parallel fsdp [--fsdp-unit-layers 2]
    python benchmarks/distributed.py --tiny      # one CPU process (gloo); torchrun --nproc-per-node 2 works too

Workload: the optimizer benchmark's model (:class:`annotate_offload.models.GPTStack`, 24 layers, hidden
2048, 16 heads: 1.21 G parameters), fp32 weights, forward under bf16 autocast, loss ``mean(out.float()**2)``,
``4 x 1024`` tokens *per GPU*; the activations of the first ``--offload-layers`` layers offloaded
(``offload_transform``), ``--fraction`` of each rank's parameters stepped on the host
(``HybridDeviceOptimizer`` attached with ``attach_optimizer``: DDP's host step sharded across ranks unless
``--replicate-host-step``; FSDP2 ``fully_shard`` per ``--fsdp-unit-layers`` blocks), host threads from
``local_thread_budget``. Runs, in one launch:

1. ``1 GPU``: rank 0 alone, the same per-GPU work without communication, every core of the host;
2. ``1 GPU, <DDP|FSDP2> at world size 1``: run 1 wrapped and attached over a one-rank group, the same
   program as run 4 on one GPU, so the wrapper's own cost is in this reference too;
3. ``1 GPU, accumulated``: rank 0 alone stepping once per ``W`` micro-batches (the ones the ranks get),
   the update ``W`` GPUs make, for loss parity;
4. ``W GPUs``: every rank; step time is the slowest rank's.

Weak-scaling efficiency = ``T(run 1 or 2) / T(run 4)`` at equal per-GPU work (target: 90%). Loss parity:
the per-step loss of run 4 (mean over ranks) against run 3, max relative difference (not bitwise on GPUs:
all-reduce order and bf16 autocast). Step time is the mean over ``--steps`` steps after ``--warmup``, one
synchronize at the end; inputs are made and moved before the clock starts. ``--profile DIR`` writes
Chrome traces of two steps of run 4, per rank.
"""

from __future__ import annotations

import argparse
import datetime
import os
import shlex
import sys
import time

import torch
import torch.distributed as dist

from _timing import GiB, free_memory, sync

from annotate_offload import HybridDeviceOptimizer, offload_transform
from annotate_offload.config import ModelConfig
from annotate_offload.distributed import attach_optimizer, bind_to_budget, local_thread_budget
from annotate_offload.models import GPTConfig, GPTStack

_NAMES = {"ddp": "DDP", "fsdp": "FSDP2"}
_FULL = dict(layers=24, hidden=2048, heads=16, batch=4, seq=1024, steps=10, warmup=3, parity_steps=5)
_TINY = dict(layers=2, hidden=64, heads=4, batch=2, seq=16, steps=2, warmup=1, parity_steps=2)


class Env:
    """Rank, world, device and the process group of this process."""

    def __init__(self, tiny: bool) -> None:
        self.rank, self.world = int(os.environ.get("RANK", "0")), int(os.environ.get("WORLD_SIZE", "1"))
        self.distributed = self.world > 1
        if tiny:
            self.device = torch.device("cpu")
        else:
            self.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
            torch.cuda.set_device(self.device)
        if self.distributed:
            kw = {"device_id": self.device} if self.device.type == "cuda" else {}
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo",
                                    timeout=datetime.timedelta(minutes=10), **kw)


def _model(a, env: Env) -> torch.nn.Module:
    torch.manual_seed(0)
    model = GPTStack(GPTConfig(hidden=a.hidden, heads=a.heads, layers=a.layers), device=env.device)
    if a.offload_layers:
        offload_transform(model, config=ModelConfig(cpu_offloading=True, cpu_offloading_num_layers=a.offload_layers,
                                                    prefetch_layers=1, min_offload_numel=1 if a.tiny else 256 * 1024))
    return model


def _wrap(a, env: Env, model: torch.nn.Module, group=None) -> torch.nn.Module:
    """``model`` in DDP, or ``fully_shard``-ed per ``--fsdp-unit-layers`` blocks, over ``group``."""
    if a.parallel == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        ids = [env.device.index] if env.device.type == "cuda" else None
        return DDP(model, process_group=group, gradient_as_bucket_view=True, device_ids=ids)
    from torch.distributed.fsdp import fully_shard

    kw = {}
    if group is not None:
        from torch.distributed.device_mesh import DeviceMesh

        kw["mesh"] = DeviceMesh.from_group(group, env.device.type)
    layers, k = list(model.layers), a.fsdp_unit_layers
    for i in range(0, len(layers), k):
        fully_shard(layers[i] if k == 1 else layers[i:i + k], **kw)
    return fully_shard(model, **kw)


def _batch(a, env: Env, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    return torch.randn(a.batch, a.seq, a.hidden, generator=g).to(env.device)


def _step(model, opt, xs) -> torch.Tensor:
    loss_sum = None
    for x in xs:
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            out = model(x)
        loss = out.float().square().mean()
        (loss / len(xs)).backward()
        loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
    opt.step()
    opt.zero_grad(set_to_none=True)
    return loss_sum / len(xs)


def _timed(a, env: Env, model, opt, rank: int, micro: int = 1, collective: bool = False, trace: str | None = None) -> dict:
    """``warmup + steps`` steps (at least ``parity_steps``): mean step seconds, peak GiB and the first
    ``parity_steps`` losses (averaged over ranks when ``collective``; read after the clock stopped)."""
    total = max(a.warmup + a.steps, a.parity_steps)
    xs = [[_batch(a, env, s, rank if micro == 1 else m) for m in range(micro)] for s in range(total)]
    kept, t0 = [], 0.0
    sync(env.device)
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)
    for s in range(total):
        if s == a.warmup:
            sync(env.device)
            t0 = time.perf_counter()
        loss = _step(model, opt, xs[s])
        if s < a.parity_steps:
            kept.append(loss)
    sync(env.device)
    step_s = (time.perf_counter() - t0) / max(1, total - a.warmup)
    losses = torch.stack(kept)
    if collective:
        dist.all_reduce(losses)
        losses = losses / env.world
    peak = torch.cuda.max_memory_allocated(env.device) / GiB if env.device.type == "cuda" else float("nan")
    if trace:
        from torch.profiler import ProfilerActivity, profile

        with profile(activities=[ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.device.type == "cuda" else [])) as prof:
            for s in range(2):
                _step(model, opt, xs[s])
            sync(env.device)
        prof.export_chrome_trace(trace)
    return {"step_s": step_s, "peak_gib": peak, "losses": losses.tolist()}


def _single(a, env: Env, micro: int, group=None) -> dict:
    """Rank 0 alone with every core; with ``group`` (one rank) wrapped and attached as in the W-GPU run."""
    free_memory(env.device)  # the previous run's model and optimizer
    budget = local_thread_budget(0, 1)
    model = _model(a, env)
    if group is not None:
        model = _wrap(a, env, model, group)
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=a.fraction, lr=1e-4, cpu_threads=budget.threads)
    if group is not None:
        attach_optimizer(model, opt, shard_host_step=not a.replicate_host_step)
    try:
        return _timed(a, env, model, opt, 0, micro=micro)
    finally:
        opt.close()


def _multi(a, env: Env) -> dict:
    free_memory(env.device)
    budget = local_thread_budget()
    if a.bind:
        bind_to_budget(budget)
    model = _wrap(a, env, _model(a, env))
    opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=a.fraction, lr=1e-4, cpu_threads=budget.threads)
    attach_optimizer(model, opt, shard_host_step=not a.replicate_host_step)
    trace = os.path.join(a.profile, f"{a.parallel}_rank{env.rank}.json") if a.profile else None
    try:
        r = _timed(a, env, model, opt, env.rank, collective=True, trace=trace)
    finally:
        opt.close()
    worst = torch.tensor([r["step_s"], r["peak_gib"]], dtype=torch.float64, device=env.device)
    dist.all_reduce(worst, op=dist.ReduceOp.MAX)
    r.update(step_s=worst[0].item(), peak_gib=worst[1].item(), threads=budget.threads)
    return r


def format_report(a, env: Env, one: dict, solo: dict | None, acc: dict | None, many: dict | None, cmd: str) -> str:
    W, tokens, name = env.world, a.batch * a.seq, _NAMES[a.parallel]
    dev = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "CPU (gloo; a smoke run, no claim)"
    lines = [f"### Weak scaling, activation offload + HybridDeviceOptimizer ({name if W > 1 else '1 process'})", "",
             f"`{cmd}`  ",
             f"torch {torch.__version__}, {dev}, world size {W}; GPT {a.layers} layers x hidden {a.hidden}, {a.batch} x "
             f"{a.seq} tokens per GPU, autocast bf16, offload_fraction={a.fraction}, activations of {a.offload_layers} "
             f"layers offloaded" + (f", fully_shard units of {a.fsdp_unit_layers} blocks" if a.parallel == "fsdp" else ""),
             "", "| run | GPUs | step (ms) | tokens/s | peak GPU mem (GiB) |", "|---|---:|---:|---:|---:|"]
    host = " (host step sharded)" if a.parallel == "ddp" and not a.replicate_host_step else ""
    for label, n, r in (("1 GPU", 1, one), (f"1 GPU, {name} at world size 1", 1, solo), (f"{W} GPUs {name}{host}", W, many)):
        if r is not None:
            lines.append(f"| {label} | {n} | {r['step_s'] * 1e3:.1f} | {n * tokens / r['step_s']:,.0f} | {r['peak_gib']:.2f} |")
    if many is None:
        return "\n".join(lines)
    eff = one["step_s"] / many["step_s"]
    lines += ["", f"**Weak-scaling efficiency** T(1 GPU) / T({W} GPUs) = **{eff:.1%}** "
              f"({'meets' if eff >= 0.9 else 'MISSES'} the 90% target); against the same {name} program at world size 1: "
              f"**{solo['step_s'] / many['step_s']:.1%}** ({name} at world size 1 takes {solo['step_s'] / one['step_s']:.2f}x "
              "the plain 1-GPU step).",
              "", f"| step | loss, 1 GPU accumulating {W} micro-batches | loss, {W} GPUs | rel. diff |", "|---:|---:|---:|---:|"]
    worst = 0.0
    for i, (x, y) in enumerate(zip(acc["losses"], many["losses"])):
        worst = max(worst, abs(x - y) / max(abs(x), 1e-30))
        lines.append(f"| {i} | {x:.6f} | {y:.6f} | {abs(x - y) / max(abs(x), 1e-30):.2e} |")
    lines += ["", f"**Loss parity**: max relative difference {worst:.2e} ({'passes' if worst <= 5e-3 else 'FAILS'} rtol 5e-3)."]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(prog="benchmarks/distributed.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp", help="DDP or FSDP2 fully_shard (default: ddp)")
    p.add_argument("--fraction", type=float, default=0.5, help="HybridDeviceOptimizer offload_fraction (default: 0.5)")
    p.add_argument("--offload-layers", type=int, help="layers whose activations are offloaded (default: layers // 2)")
    p.add_argument("--steps", type=int, help="timed steps (default: 10, tiny: 2)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default: 3, tiny: 1)")
    p.add_argument("--fsdp-unit-layers", type=int, default=1, metavar="K", help="FSDP2: K blocks per fully_shard unit")
    p.add_argument("--replicate-host-step", action="store_true", help="DDP: every rank steps every host chunk")
    p.add_argument("--bind", action="store_true", help="pin each rank to its thread budget's CPUs (its GPU's NUMA node)")
    p.add_argument("--profile", metavar="DIR", help="Chrome traces of two steps of the W-GPU run, per rank")
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU processes (gloo); numbers carry no claim")
    a = p.parse_args(argv)
    for k, v in (_TINY if a.tiny else _FULL).items():
        if getattr(a, k, None) is None:
            setattr(a, k, v)
    a.offload_layers = a.layers // 2 if a.offload_layers is None else a.offload_layers
    if a.steps < 1 or a.warmup < 0 or not 0 <= a.offload_layers < a.layers or not 0 <= a.fraction <= 1:
        p.error(f"need --steps >= 1, --warmup >= 0, 0 <= --offload-layers < {a.layers} and 0 <= --fraction <= 1")
    if not 1 <= a.fsdp_unit_layers <= a.layers or a.fsdp_unit_layers > 1 and a.parallel != "fsdp":
        p.error(f"--fsdp-unit-layers needs --parallel fsdp and 1 <= K <= {a.layers}")
    if a.replicate_host_step and a.parallel != "ddp":
        p.error("--replicate-host-step needs --parallel ddp (FSDP2 parameters are sharded already)")
    if not a.tiny and not torch.cuda.is_available():
        p.error("no CUDA device here; pass --tiny for the CPU smoke run")
    if a.tiny:
        torch.set_num_threads(1)
    env = Env(a.tiny)
    if a.profile:
        os.makedirs(a.profile, exist_ok=True)
    try:
        one = solo = acc = None
        group = dist.new_group([0]) if env.distributed else None  # every rank creates it; rank 0 alone uses it
        if env.rank == 0:
            one = _single(a, env, micro=1)
            solo = _single(a, env, micro=1, group=group) if group is not None else None
            acc = _single(a, env, micro=env.world) if env.distributed else None
        if env.distributed:
            dist.barrier()
        many = _multi(a, env) if env.distributed else None
        if env.rank == 0:
            launch = f"torchrun --nproc-per-node {env.world} " if env.distributed else "python "
            cmd = launch + shlex.join(["benchmarks/distributed.py", *(sys.argv[1:] if argv is None else argv)])
            print(format_report(a, env, one, solo, acc, many, cmd), flush=True)
    finally:
        if env.distributed:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    code = main()
    # Note [Exit without finalizing]: DDP and FSDP keep their gloo process group (and its worker
    # threads) alive past destroy_process_group. A worker can drop the last reference to a finished
    # collective's tensors after the interpreter began to finalize; it then cannot take the GIL and
    # aborts the process (pytorch/pytorch#190489). os._exit leaves no finalization to race.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
