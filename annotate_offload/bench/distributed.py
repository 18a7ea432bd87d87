"""Weak scaling of activation offload + ``HybridDeviceOptimizer`` on several GPUs (issue 9), launched with torchrun.

Workload: issue 4's model, :class:`annotate_offload.models.gpt.GPTStack` (24 layers, hidden 2048, 16
heads, hidden states in and out: 1.21 G parameters), fp32 weights, forward under
``torch.autocast(bfloat16)``, loss ``mean(out.float()**2)``, ``--batch`` x ``--seq`` tokens *per GPU*;
activations of the first ``--offload-layers`` layers offloaded (``offload_transform``), optimizer
state of ``--fraction`` of each rank's parameters stepped on the host (``HybridDeviceOptimizer``,
AdamW), one process per GPU with DDP (``gradient_as_bucket_view=True``, the offload comm hook and the host
step sharded across ranks unless ``--replicate-host-step``)
or FSDP2 (``fully_shard`` per ``--fsdp-unit-layers`` blocks, default 1), each rank's host threads from
``local_thread_budget``.

Runs, all in one ``torchrun`` launch:

1. ``1 GPU`` (rank 0 alone, the other ranks wait): the same per-GPU work without communication,
   host threads as a single process on this host would get (``local_thread_budget(0, 1)``).
1b. ``1 GPU, DDP|FSDP2 at world size 1`` (W > 1): run 1 with the model wrapped in DDP or
   ``fully_shard``-ed over a one-rank group and attached to the optimizer: the same program as run 5
   on one GPU (weak scaling in the textbook sense), so the parallel wrapper's own cost (FSDP2's
   per-unit hooks and copy-in/out, DDP's buckets) is in this reference too.
2. ``1 GPU, accumulated``: rank 0 alone, ``W`` micro-batches per step (the ones the ``W`` ranks
   get) with gradient accumulation: the update ``W`` GPUs make, for loss parity.
3. ``1 GPU, 1/W of the host`` (W > 1): rank 0 alone with the host threads (and, with ``--bind``,
   the CPUs) one rank gets in run 5: separates what adding GPUs costs from what a single
   process gains by having every core.
4. ``1 GPU, 1/W of the host, the other GPU(s) copying`` (``--peer-copies``): run 3 while every
   other rank copies pinned memory (256 MiB D2H then H2D, back to back): the host-memory load of
   their activation offload without their compute or collectives.
5. ``W GPUs``: every rank; step time is the slowest rank's.

Every run also reports where its step goes: CPU wall time of the training thread and
compute-stream time (CUDA events recorded at the same marks) for forward, backward, ``step()`` and
the gap to the next step; ``--profile DIR`` writes chrome traces of two more steps of runs 3 and 5.

Step time is the mean over ``--steps`` steps after ``--warmup`` steps, one synchronize at the end;
inputs are generated (CPU generator, seeded by step and rank) and moved to the GPU before timing.
Weak-scaling efficiency = ``T(1 GPU) / T(W GPUs)`` at equal per-GPU work (issue 9 asks >= 90% at
f = 0.5; the report also gives it against runs 1b and 3). Loss parity: the per-step loss of run 5 (mean over
ranks) against run 2, max relative
difference over ``--parity-steps`` steps from the same initial weights (not bitwise on GPU:
all-reduce order and bf16 autocast; CPU/gloo runs with 2 ranks are bit-identical, tests/distributed;
with 3 or more the reduction order differs from the accumulated sum, ~2e-5).

Run (2-GPU machine; keep NVLink multicast off)::

    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m annotate_offload.bench.distributed --parallel ddp
    NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 -m annotate_offload.bench.distributed --parallel fsdp

``--tiny`` runs a 2-layer, hidden-64 model on CPU processes (gloo) in seconds, also without torchrun
(one process): a smoke run for CI whose numbers carry no claim.
"""

from __future__ import annotations

import argparse
import datetime
import os
import statistics
import sys
import threading
import time
from typing import Any, Optional, Sequence

import torch
import torch.distributed as dist
from torch import nn

from ..annotate import offload_transform
from ..distributed import attach_optimizer, bind_to_budget, local_thread_budget
from ..models.gpt import GPTConfig, GPTStack
from ..optim import HybridDeviceOptimizer

__all__ = ["main", "format_report"]

GiB = 1024**3
_NAMES = {"ddp": "DDP", "fsdp": "FSDP2"}


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m annotate_offload.bench.distributed", description=__doc__.split("\n")[0])
    p.add_argument("--parallel", choices=("ddp", "fsdp"), default="ddp", help="DDP or FSDP2 fully_shard (default: ddp)")
    p.add_argument("--fraction", type=float, default=0.5, help="HybridDeviceOptimizer offload_fraction (default: 0.5)")
    p.add_argument("--offload-layers", type=int, help="layers whose activations are offloaded (default: layers // 2)")
    p.add_argument("--layers", type=int, help="GPT layers (default: 24, tiny: 2)")
    p.add_argument("--hidden", type=int, help="hidden size (default: 2048, tiny: 64)")
    p.add_argument("--heads", type=int, help="attention heads (default: 16, tiny: 4)")
    p.add_argument("--batch", type=int, help="sequences per GPU (default: 4, tiny: 2)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: 1024, tiny: 16)")
    p.add_argument("--steps", type=int, help="timed steps (default: 10, tiny: 2)")
    p.add_argument("--warmup", type=int, help="untimed steps first (default: 3, tiny: 1)")
    p.add_argument("--parity-steps", type=int, help="steps compared for loss parity (default: 5, tiny: 2)")
    p.add_argument("--lr", type=float, default=1e-4, help="AdamW learning rate (default: 1e-4)")
    p.add_argument("--parity-rtol", type=float, default=5e-3, help="loss parity passes below this relative difference")
    p.add_argument("--min-efficiency", type=float, default=0.9, help="weak-scaling efficiency target (default: 0.9)")
    p.add_argument("--fsdp-mp", action="store_true", help="FSDP2 with MixedPrecisionPolicy(param_dtype=bfloat16, "
                   "reduce_dtype=float32): bf16 all-gathers, as torchtitan trains (default: fp32 all-gathers under autocast)")
    p.add_argument("--fsdp-unit-layers", type=int, default=1, metavar="K",
                   help="FSDP2: group K consecutive blocks into one fully_shard unit (default: 1, a unit per block); "
                        "FSDP2's pre-/post-forward and backward hooks cost CPU time per unit")
    p.add_argument("--replicate-host-step", action="store_true", help="DDP: every rank steps every host chunk "
                   "(attach_optimizer(..., shard_host_step=False)) instead of 1/W of them")
    p.add_argument("--peer-copies", action="store_true",
                   help="add a row: rank 0 alone on its host share while every other rank copies pinned memory "
                        "(256 MiB D2H then H2D, back to back), the host-memory load of their activation offload without "
                        "their compute or communication")
    p.add_argument("--bind", action="store_true", help="pin each rank to its thread budget's CPUs (its GPU's NUMA node) "
                   "before building the model and optimizer, so host state is allocated on that node")
    p.add_argument("--tiny", action="store_true", help="tiny model on CPU (gloo) for CI; numbers carry no claim")
    p.add_argument("--out", metavar="FILE", help="also write the markdown report here (rank 0)")
    p.add_argument("--profile", metavar="DIR", help="after the timed steps of the '1/W of the host' and W-GPU runs, "
                   "trace 2 more steps with torch.profiler into DIR/<run>_rank<r>.json (chrome trace)")
    return p


def _settings(a: argparse.Namespace) -> argparse.Namespace:
    big = dict(layers=24, hidden=2048, heads=16, batch=4, seq=1024, steps=10, warmup=3, parity_steps=5)
    tiny = dict(layers=2, hidden=64, heads=4, batch=2, seq=16, steps=2, warmup=1, parity_steps=2)
    for k, v in (tiny if a.tiny else big).items():
        if getattr(a, k) is None:
            setattr(a, k, v)
    if a.offload_layers is None:
        a.offload_layers = a.layers // 2
    for k in ("layers", "hidden", "heads", "batch", "seq", "steps", "parity_steps"):
        if getattr(a, k) < 1:
            raise ValueError(f"--{k.replace('_', '-')} must be >= 1, got {getattr(a, k)}.")
    if a.warmup < 0:
        raise ValueError(f"--warmup must be >= 0, got {a.warmup}.")
    if not 0 <= a.offload_layers < a.layers:
        raise ValueError(f"--offload-layers must be in [0, layers={a.layers}), got {a.offload_layers}.")
    if a.fsdp_mp and a.parallel != "fsdp":
        raise ValueError("--fsdp-mp needs --parallel fsdp.")
    if a.fsdp_unit_layers < 1:
        raise ValueError(f"--fsdp-unit-layers must be >= 1, got {a.fsdp_unit_layers}.")
    if a.fsdp_unit_layers != 1 and a.parallel != "fsdp":
        raise ValueError("--fsdp-unit-layers needs --parallel fsdp.")
    if a.fsdp_unit_layers > a.layers:
        raise ValueError(f"--fsdp-unit-layers must be <= --layers ({a.layers}), got {a.fsdp_unit_layers}.")
    if a.replicate_host_step and a.parallel != "ddp":
        raise ValueError("--replicate-host-step needs --parallel ddp (FSDP2 parameters are sharded already).")
    GPTConfig(hidden=a.hidden, heads=a.heads, layers=a.layers)  # its ValueError names the bad size
    if not 0 <= a.fraction <= 1:
        raise ValueError(f"--fraction must be in [0, 1], got {a.fraction}.")
    if a.profile and os.path.exists(a.profile) and not os.path.isdir(a.profile):
        raise ValueError(f"--profile {a.profile!r} is a file; give a directory (created if missing) for the traces.")
    return a


class _Env:
    def __init__(self, tiny: bool) -> None:
        self.distributed = "WORLD_SIZE" in os.environ and int(os.environ["WORLD_SIZE"]) > 1
        self.rank = int(os.environ.get("RANK", "0"))
        self.world = int(os.environ.get("WORLD_SIZE", "1"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        if tiny or not torch.cuda.is_available():
            if not tiny:
                raise SystemExit("annotate_offload.bench.distributed: no CUDA device; pass --tiny for the CPU smoke run.")
            self.device = torch.device("cpu")
        else:
            self.device = torch.device("cuda", self.local_rank)
            torch.cuda.set_device(self.device)
        if self.distributed:
            kw: dict[str, Any] = {"timeout": datetime.timedelta(minutes=10)}
            if self.device.type == "cuda":
                kw["device_id"] = self.device
            dist.init_process_group("nccl" if self.device.type == "cuda" else "gloo", **kw)

    def sync(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    def barrier(self) -> None:
        if self.distributed:
            dist.barrier()


def _model(a: argparse.Namespace, env: _Env) -> nn.Module:
    torch.manual_seed(0)
    model = GPTStack(GPTConfig(hidden=a.hidden, heads=a.heads, layers=a.layers), device=env.device)
    if a.offload_layers:
        kw = {"min_offload_numel": 1} if a.tiny else {}
        offload_transform(model, num_layers=a.offload_layers, prefetch_layers=1, **kw)
    return model


def _batch(a: argparse.Namespace, env: _Env, step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1_000_003 * step + rank)
    return torch.randn(a.batch, a.seq, a.hidden, generator=g).to(env.device)


def _loss(model: nn.Module, x: torch.Tensor, env: _Env) -> torch.Tensor:
    with torch.autocast(env.device.type, dtype=torch.bfloat16):
        out = model(x)
    return out.float().square().mean()


def _peak_reset(env: _Env) -> None:
    if env.device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(env.device)


def _peak(env: _Env) -> float:
    return torch.cuda.max_memory_allocated(env.device) / GiB if env.device.type == "cuda" else float("nan")


def _collect(env: _Env) -> None:
    """After a run's model and optimizer are unreachable: collect their cycles (offload hooks) and
    return the memory, so the next run's peak does not include the last run's weights."""
    import gc

    gc.collect()
    if env.device.type == "cuda":
        torch.cuda.empty_cache()


class _Marks:
    """Per-phase times of the timed steps: forward, backward, ``step()`` (with ``zero_grad``) and the gap
    to the next step, as CPU wall time (``perf_counter``) and as compute-stream time (CUDA events
    recorded at the same points; on CPU the wall times again). Means in ms."""

    _PHASES = ("fwd", "bwd", "step", "gap")

    def __init__(self, env: _Env) -> None:
        self.cuda = env.device.type == "cuda"
        self.steps: list[list[tuple[float, Any]]] = []  # per step: 4 x (perf_counter, CUDA event or None)

    def mark(self) -> None:
        if not self.steps or len(self.steps[-1]) == 4:
            self.steps.append([])
        ev = None
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
        self.steps[-1].append((time.perf_counter(), ev))

    def means(self) -> dict[str, float]:
        """After a synchronize: {'cpu_fwd': ms, ..., 'gpu_gap': ms} (gaps: mark 0 of step s+1 - mark 3 of step s)."""
        rows = [r for r in self.steps if len(r) == 4]
        if len(rows) < 2:
            return {}

        def cpu(a: tuple, b: tuple) -> float:
            return (b[0] - a[0]) * 1e3

        def gpu(a: tuple, b: tuple) -> float:
            return a[1].elapsed_time(b[1]) if self.cuda else cpu(a, b)

        out: dict[str, float] = {}
        for kind, span in (("cpu", cpu), ("gpu", gpu)):
            for k, name in enumerate(self._PHASES[:3]):
                out[f"{kind}_{name}"] = statistics.mean(span(r[k], r[k + 1]) for r in rows)
            out[f"{kind}_gap"] = statistics.mean(span(r[3], nxt[0]) for r, nxt in zip(rows, rows[1:]))
        return out


def _train_step(model: nn.Module, opt: HybridDeviceOptimizer, xs: list[torch.Tensor], env: _Env,
                marks: Optional[_Marks] = None) -> torch.Tensor:
    micro = len(xs)
    step_loss = None
    if marks is not None:
        marks.mark()
    for m, x in enumerate(xs):
        with torch.autograd.profiler.record_function("bench.forward"):
            loss = _loss(model, x, env)
        if marks is not None and m == micro - 1:
            marks.mark()
        with torch.autograd.profiler.record_function("bench.backward"):
            (loss / micro).backward()
        step_loss = loss.detach() if step_loss is None else step_loss + loss.detach()
    if marks is not None:
        marks.mark()
    with torch.autograd.profiler.record_function("bench.step"):
        opt.step()
        opt.zero_grad(set_to_none=True)
    if marks is not None:
        marks.mark()
    return step_loss / micro


def _timed(a: argparse.Namespace, env: _Env, model: nn.Module, opt: HybridDeviceOptimizer, rank: int, micro: int = 1,
           collective: bool = False, trace: Optional[str] = None) -> dict[str, Any]:
    """Train ``warmup + steps`` (at least ``parity_steps``) steps; losses of the first ``parity_steps``
    (averaged over ranks when ``collective``: every rank must then call it). ``trace``: then 2 more
    steps under ``torch.profiler``, written to this chrome-trace file."""
    total = max(a.warmup + a.steps, a.parity_steps)
    # inputs made up front (CPU generator: the same numbers for a rank here and in the parity run),
    # so neither generation nor H2D of inputs competes with the host optimizer step inside the timing
    xs = [[_batch(a, env, s, rank if micro == 1 else m) for m in range(micro)] for s in range(total)]
    env.sync()
    kept: list[torch.Tensor] = []  # parity losses, read after the timed loop: no host sync inside it
    host_s: list[float] = []
    marks = _Marks(env)
    t0 = 0.0
    _peak_reset(env)
    for s in range(total):
        if s == a.warmup:
            env.sync()
            t0 = time.perf_counter()
        v = _train_step(model, opt, xs[s], env, marks if s >= a.warmup else None)
        if s < a.parity_steps:
            kept.append(v)
        if s >= a.warmup:
            host_s.append(opt.host_step_seconds)
    env.sync()
    dt = (time.perf_counter() - t0) / max(1, total - a.warmup)
    losses: list[float] = []
    if kept:  # after the clock stopped: the collective and the read-back are not timed
        stacked = torch.stack(kept)
        if collective:
            dist.all_reduce(stacked)  # every rank reaches this after the same steps
            stacked = stacked / env.world
        losses = stacked.tolist()
    r = {"step_s": dt, "losses": losses, "peak_gib": _peak(env), "host_s": statistics.mean(host_s) if host_s else float("nan"),
         "phases": marks.means()}
    if trace:
        from torch.profiler import ProfilerActivity, profile

        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if env.device.type == "cuda" else [])
        with profile(activities=acts) as prof:
            for s in range(2):
                _train_step(model, opt, xs[s % total], env)
            env.sync()
        prof.export_chrome_trace(trace)
    return r


def _single(a: argparse.Namespace, env: _Env, micro: int, share: bool = False, tag: str = "share",
            solo_group: Any = None) -> dict[str, Any]:
    """Rank 0 alone. ``share``: with one GPU's share of the host (the per-rank budget of the
    multi-GPU run, bound to its CPUs when ``--bind``), instead of every core of the host.
    ``solo_group``: the model wrapped (DDP) or ``fully_shard``-ed (FSDP2) over this one-rank group and
    attached to the optimizer: the same program as the multi-GPU run, at world size 1."""
    saved = os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else None
    budget = local_thread_budget() if share else local_thread_budget(0, 1)
    if share and a.bind:
        bind_to_budget(budget)
    try:
        model = _model(a, env)
        if solo_group is not None:
            model = _wrap(a, env, model, solo_group)
        opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=a.fraction, lr=a.lr, cpu_threads=budget.threads)
        if solo_group is not None:
            attach_optimizer(model, opt, shard_host_step=not a.replicate_host_step)
        trace = os.path.join(a.profile, f"{tag}_rank0.json") if a.profile and share else None
        r = _timed(a, env, model, opt, 0, micro=micro, trace=trace)
        r.update(threads=budget.threads, host_numel=opt.offloaded_numel, numel=sum(p.numel() for p in model.parameters()))
        opt.close()  # stops its worker thread; _collect frees the rest once the run returns
    finally:
        if saved is not None and share and a.bind:
            os.sched_setaffinity(0, saved)
    return r


def _copy_load(env: _Env, group: Any) -> dict[str, float]:
    """Other ranks during the ``--peer-copies`` row: pinned D2H then H2D of 256 MiB, one direction at a
    time as activation offload copies, until rank 0 sends the stop message (gloo ``group``).
    Returns the bytes copied per second (GB/s, both directions together)."""
    mib = 256 if env.device.type == "cuda" else 1  # the CPU smoke run only checks the plumbing
    n = mib * 2**20
    dev = torch.empty(n, dtype=torch.uint8, device=env.device)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=env.device.type == "cuda")
    done = threading.Event()  # gloo's irecv work never reports completion before wait(): a thread waits

    def wait_for_stop() -> None:
        try:
            dist.recv(torch.zeros(1), src=0, group=group)
        finally:
            done.set()  # also when rank 0 died (the connection closes): stop copying, let the launcher end us

    waiter = threading.Thread(target=wait_for_stop, daemon=True)
    waiter.start()
    side = torch.cuda.Stream(env.device) if env.device.type == "cuda" else None
    copies = 0
    t0 = time.perf_counter()
    while not done.is_set():
        if side is not None:
            with torch.cuda.stream(side):
                host.copy_(dev, non_blocking=True)
                dev.copy_(host, non_blocking=True)
            side.synchronize()
        else:
            host.copy_(dev)
            dev.copy_(host)
            time.sleep(0.001)
        copies += 2
    waiter.join()
    dt = time.perf_counter() - t0
    return {"gbps": copies * n / dt / 1e9 if dt > 0 else float("nan"), "mib": mib}


def _wrap(a: argparse.Namespace, env: _Env, model: nn.Module, group: Any = None) -> nn.Module:
    """``model`` in DDP or FSDP2 as ``--parallel`` says, over ``group`` (``None``: the default group)."""
    if a.parallel == "fsdp":
        return _fully_shard(a, model, group)
    from torch.nn.parallel import DistributedDataParallel as DDP

    ids = [env.device.index] if env.device.type == "cuda" else None
    return DDP(model, process_group=group, gradient_as_bucket_view=True, device_ids=ids)


def _units(a: argparse.Namespace) -> str:
    """The fully_shard units ``_fully_shard`` makes, in words."""
    k, n = a.fsdp_unit_layers, a.layers
    whole, rest = divmod(n, k)
    parts = [f"{whole} of {k} block{'s' if k > 1 else ''}"] + ([f"1 of {rest}"] if rest else [])
    return f"fully_shard units: {' and '.join(parts)}, and the root"


def _fully_shard(a: argparse.Namespace, model: nn.Module, group: Any = None) -> nn.Module:
    """FSDP2 as the bench applies it: ``fully_shard`` per ``--fsdp-unit-layers`` blocks, then the root.
    ``group``: shard over this process group instead of the default one (the world-size-1 row)."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    kw: dict[str, Any] = {}
    if group is not None:
        from torch.distributed.device_mesh import DeviceMesh

        kw["mesh"] = DeviceMesh.from_group(group, next(model.parameters()).device.type)
    if a.fsdp_mp:
        kw["mp_policy"] = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    k = a.fsdp_unit_layers
    layers = list(model.layers)
    for i in range(0, len(layers), k):
        fully_shard(layers[i] if k == 1 else layers[i:i + k], **kw)
    return fully_shard(model, **kw)


def _multi(a: argparse.Namespace, env: _Env) -> dict[str, Any]:
    budget = local_thread_budget()
    if a.bind:
        bind_to_budget(budget)
    model = _model(a, env)
    wrapped = _wrap(a, env, model)
    opt = HybridDeviceOptimizer(wrapped.parameters(), offload_fraction=a.fraction, lr=a.lr, cpu_threads=budget.threads)
    att = attach_optimizer(wrapped, opt, shard_host_step=not a.replicate_host_step)
    trace = os.path.join(a.profile, f"{a.parallel}_rank{env.rank}.json") if a.profile else None
    r = _timed(a, env, wrapped, opt, env.rank, collective=True, trace=trace)
    t = torch.tensor([r["step_s"], r["peak_gib"], r["host_s"]], dtype=torch.float64, device=env.device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    r.update(step_s=t[0].item(), peak_gib=t[1].item(), host_s=t[2].item(), threads=budget.threads, numa=budget.numa_node,
             host_numel=att.shard.owned_numel() if getattr(att, "shard", None) is not None else opt.offloaded_numel,
             cpus=len(budget.cpus), late=att.copied_at_step, host_tensors=sum(p.side == "cpu" for p in opt.placements),
             sharded=getattr(att, "shard", None) is not None)
    opt.close()
    return r


def format_report(a: argparse.Namespace, env: _Env, one: dict[str, Any], acc: dict[str, Any], many: Optional[dict[str, Any]], cmd: str) -> str:
    """The markdown report (rank 0)."""
    W = env.world
    tok = a.batch * a.seq
    dev = torch.cuda.get_device_name(env.device) if env.device.type == "cuda" else "CPU (gloo, smoke run: no claim)"
    fsdp = a.parallel == "fsdp" and W > 1
    lines = [
        f"### Weak scaling, activation offload + HybridDeviceOptimizer ({_NAMES[a.parallel] if W > 1 else '1 process'})",
        "",
        f"`{cmd}`  ",
        f"torch {torch.__version__}, {dev}, world size {W}, NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE', 'unset')}; "
        f"GPT {a.layers} layers x hidden {a.hidden} ({one['numel'] / 1e9:.2f} G params), {a.batch} x {a.seq} tokens per GPU, "
        f"autocast bf16, offload_fraction={a.fraction}, activations of {a.offload_layers} layers offloaded"
        + (", FSDP2 MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32)" if fsdp and a.fsdp_mp else "")
        + (f", {_units(a)}" if fsdp and a.fsdp_unit_layers > 1 else ""),
        "",
        "| run | GPUs | step (ms) | tokens/s | peak GPU mem (GiB) | host params / rank | host threads / rank | host AdamW (G params/s per rank) |",
        "|---|---:|---:|---:|---:|---:|---:|---:|",
    ]

    def row(name: str, n: int, r: dict[str, Any]) -> str:
        thr = r["host_numel"] / r["host_s"] / 1e9 if r["host_s"] and r["host_s"] == r["host_s"] and r["host_s"] > 0 else float("nan")
        return (f"| {name} | {n} | {r['step_s'] * 1e3:.1f} | {n * tok / r['step_s']:,.0f} | {r['peak_gib']:.2f} | "
                f"{r['host_numel'] / 1e6:.3g} M | {r['threads']} | {thr:.2f} |")

    lines.append(row("1 GPU", 1, one))
    solo = one.get("solo")
    solo_name = f"1 GPU, {_NAMES[a.parallel]} at world size 1"
    if solo is not None:
        lines.append(row(solo_name, 1, solo))
    share = one.get("share")
    if share is not None:
        lines.append(row(f"1 GPU, 1/{W} of the host", 1, share))
    loaded = one.get("peer_copies")
    if loaded is not None:
        lines.append(row(f"1 GPU, 1/{W} of the host, the other GPU(s) copying", 1, loaded))
    if many is not None:
        how = " (host step sharded)" if many.get("sharded") else " (host step replicated)" if a.parallel == "ddp" else ""
        lines.append(row(f"{W} GPUs {_NAMES[a.parallel]}{how}", W, many))
        lines.append(f"\nRank 0's host share in the {W}-GPU run: {many['cpus']} CPUs on NUMA node {many['numa']} "
                     f"({'bound' if a.bind else 'not bound; --bind pins it'}); the 1-GPU run used {one['threads']} threads. "
                     f"Host gradients whose D2H had to wait for step() (not overlapped with backward), rank 0, all steps: "
                     f"{many['late']} of {many['host_tensors']} per step.")
        eff = one["step_s"] / many["step_s"]
        ok = "meets" if eff >= a.min_efficiency else "MISSES"
        lines += ["", f"**Weak-scaling efficiency** T(1 GPU) / T({W} GPUs) = **{eff * 100:.1f}%** ({ok} the {a.min_efficiency * 100:.0f}% target)."]
        if solo is not None:
            units = f" ({_units(a)})" if a.parallel == "fsdp" else ""
            lines.append(f"**Against the same {_NAMES[a.parallel]} program on one GPU** (world size 1, every core of the "
                         f"host): **{solo['step_s'] / many['step_s'] * 100:.1f}%**; {_NAMES[a.parallel]} at world size 1 "
                         f"itself takes {solo['step_s'] / one['step_s']:.2f}x the plain 1-GPU step{units}.")
        if share is not None:
            lines.append(f"Against one GPU given its share of the host ({share['threads']} threads"
                         f"{', bound' if a.bind else ''}, what each of the {W} ranks gets): "
                         f"**{share['step_s'] / many['step_s'] * 100:.1f}%**; host AdamW per rank alone on its share vs. "
                         f"all ranks at once shows what the ranks share (host memory bandwidth).")
        if loaded is not None:
            lines.append(f"With the other {W - 1} GPU(s) only copying pinned memory (D2H then H2D of {loaded['peer_mib']} MiB, back to back: "
                         f"{loaded['peer_gbps']:.1f} GB/s, one direction at a time) the 1-GPU run takes "
                         f"{loaded['step_s'] * 1e3:.1f} ms instead of {share['step_s'] * 1e3:.1f}: "
                         f"**{share['step_s'] / loaded['step_s'] * 100:.1f}%**; {W} GPUs reach "
                         f"**{loaded['step_s'] / many['step_s'] * 100:.1f}%** of that loaded run.")
        lines += ["", f"| step | loss, 1 GPU accumulating {W} micro-batches | loss, {W} GPUs | rel. diff |", "|---:|---:|---:|---:|"]
        worst = 0.0
        for i, (x, y) in enumerate(zip(acc["losses"], many["losses"])):
            rd = abs(x - y) / max(abs(x), 1e-30)
            worst = max(worst, rd)
            lines.append(f"| {i} | {x:.6f} | {y:.6f} | {rd:.2e} |")
        ok = "passes" if worst <= a.parity_rtol else "FAILS"
        lines += ["", f"**Loss parity**: max relative difference {worst:.2e} ({ok} rtol {a.parity_rtol:g})."]
    runs = [("1 GPU", one), (solo_name, solo), ("1 GPU, 1/%d of the host" % W, share), ("1 GPU, others copying", loaded)] + ([(f"{W} GPUs (rank 0)", many)] if many else [])
    runs = [(n, r) for n, r in runs if r is not None and r.get("phases")]
    if runs:
        lines += ["", "Where a step goes (ms per step; CPU: wall time between the marks on the training thread; "
                  "GPU: compute-stream time between CUDA events recorded at the same marks; step includes zero_grad; "
                  "gap: end of step() to the next forward):", "",
                  "| run | fwd CPU / GPU | bwd CPU / GPU | step() CPU / GPU | gap CPU / GPU |", "|---|---:|---:|---:|---:|"]
        for n, r in runs:
            ph = r["phases"]
            cells = [f"{ph.get('cpu_' + k, float('nan')):.1f} / {ph.get('gpu_' + k, float('nan')):.1f}" for k in ("fwd", "bwd", "step", "gap")]
            lines.append(f"| {n} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point (every rank of a torchrun launch, or one process). Returns the exit status.

    0: the report was printed (targets met or not: the report says); 2: bad arguments.
    """
    try:
        a = _settings(_parser().parse_args(argv))
    except ValueError as e:
        print(f"annotate_offload.bench.distributed: {e}", file=sys.stderr)
        return 2
    env = _Env(a.tiny)
    if a.profile:
        os.makedirs(a.profile, exist_ok=True)
    idle = [f for f, on in (("--profile", a.profile), ("--peer-copies", a.peer_copies), ("--fsdp-mp", a.fsdp_mp),
                            ("--fsdp-unit-layers", a.fsdp_unit_layers != 1)) if on]
    if idle and not env.distributed and env.rank == 0:
        print(f"annotate_offload.bench.distributed: {', '.join(idle)} act on the runs with several ranks "
              "(launch with torchrun --nproc-per-node 2 or more); this one-process run has none.", file=sys.stderr)
    ok = False
    try:
        one = acc = None
        # the DDP/FSDP2 program at world size 1 (every rank creates the group; rank 0 alone uses it)
        solo = dist.new_group([0]) if env.distributed else None
        if env.rank == 0:
            one = _single(a, env, micro=1)
            _collect(env)
            if solo is not None:
                one["solo"] = _single(a, env, micro=1, solo_group=solo)
                _collect(env)
            acc = _single(a, env, micro=env.world) if env.world > 1 else None
            _collect(env)
            if env.world > 1:
                one["share"] = _single(a, env, micro=1, share=True)
                _collect(env)
        if a.peer_copies and env.distributed:
            group = dist.new_group(backend="gloo")
            if env.rank == 0:
                one["peer_copies"] = _single(a, env, micro=1, share=True, tag="peer_copies")
                _collect(env)
                for r in range(1, env.world):
                    dist.send(torch.ones(1), dst=r, group=group)
                rates = [torch.zeros(2) for _ in range(env.world)]
                dist.gather(torch.zeros(2), rates, dst=0, group=group)
                one["peer_copies"]["peer_gbps"] = min(float(t[0]) for t in rates[1:])
                one["peer_copies"]["peer_mib"] = int(rates[1][1])
            else:
                load = _copy_load(env, group)
                dist.gather(torch.tensor([load["gbps"], float(load["mib"])]), None, dst=0, group=group)
        env.barrier()
        many = _multi(a, env) if env.distributed else None
        _collect(env)
        if env.rank == 0:
            argv_s = " ".join(argv if argv is not None else sys.argv[1:])
            launcher = f"torchrun --nproc-per-node {env.world} -m annotate_offload.bench.distributed" if env.distributed else "python -m annotate_offload.bench.distributed"
            report = format_report(a, env, one, acc, many, f"{launcher} {argv_s}".strip())
            print(report, flush=True)
            if a.out:
                with open(a.out, "w") as f:
                    f.write(report + "\n")
        ok = True
        return 0
    finally:
        if env.distributed:
            if ok:  # after a failure the other ranks may never arrive: exit, and torchrun stops them
                dist.barrier()
            dist.destroy_process_group()


if __name__ == "__main__":
    sys.exit(main())
