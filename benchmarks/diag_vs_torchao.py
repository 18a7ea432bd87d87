"""A/B: HybridDeviceOptimizer's default exact mode vs. torchao's CPUOffloadOptimizer, alternated.

The W3 benchmark times each optimizer once, in sequence; host throughput on the H200 machines
drifts by +-15% between and within runs, and torchao beat our exact mode in two runs (B4, session
3) and lost in one (B2). This builds W3's model once (1.21 G params, 24 x 2048, autocast bf16, 4 x
1024 tokens, offload_gradients, f = 1) and alternates torchao with our exact mode (defaults, every
core as host threads, 256 MiB chunks, both) ``--rounds`` times, each fresh: ``--warmup`` steps, then
``--steps`` timed steps. Prints each run and the per-optimizer median.

Run on the GPU machine with torchao's wheel on the path:
``python benchmarks/diag_vs_torchao.py [--rounds 3 --steps 4]``.
"""

from __future__ import annotations

import argparse
import os
import statistics

import torch

from annotate_offload.bench import _peers
from annotate_offload.bench.optimizer import _FULL, _TINY, _Clock, _free, _loss
from annotate_offload.models.gpt import GPTStack
from annotate_offload.optim import HybridDeviceOptimizer, _pipeline


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--only", help="comma-separated: defaults,threads,chunk256,both,hookall,fewer,noog,sib,sib_fewer,delayed,delayed_fewer,torchao (default: all)")
    ap.add_argument("--profile", metavar="DIR", help="after round 0's timed steps, trace one more step of each "
                    "optimizer with torch.profiler (CPU + CUDA) into DIR/<name>.json")
    a = ap.parse_args()
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    spec = _FULL if dev.type == "cuda" else _TINY  # CPU: a smoke run of the script, no claim
    torch.manual_seed(0)
    model = GPTStack(spec["config"], device=dev)
    x = torch.randn(spec["batch"], spec["seq"], spec["config"].hidden, device=dev)
    def ours(**kw):
        kw.setdefault("offload_gradients", True)
        return lambda: HybridDeviceOptimizer(model.parameters(), lr=1e-5, offload_fraction=1.0, **kw)

    cores = len(os.sched_getaffinity(0))
    fewer = max(1, cores - 2)
    every = {
        "defaults": ("annotate_offload exact (defaults)", ours()),
        "threads": (f"annotate_offload exact, cpu_threads={cores}", ours(cpu_threads=cores)),
        "chunk256": ("annotate_offload exact, chunk_bytes=256 MiB", ours(chunk_bytes=256 << 20)),
        "both": (f"annotate_offload exact, 256 MiB, cpu_threads={cores}", ours(chunk_bytes=256 << 20, cpu_threads=cores)),
        "hookall": ("annotate_offload exact, a hook per gradient (BATCHED_NUMEL=0)", ours()),
        # the overlapped modes, at the default budget (cores - 1) and with one more core left to the
        # training and autograd threads that launch forward/backward while the host step runs
        "fewer": (f"annotate_offload exact, cpu_threads={fewer}", ours(cpu_threads=fewer)),
        "noog": ("annotate_offload exact, gradients kept on the GPU (offload_gradients=False)", ours(offload_gradients=False)),
        "sib": ("annotate_offload step_in_backward", ours(step_in_backward=True)),
        "sib_fewer": (f"annotate_offload step_in_backward, cpu_threads={fewer}", ours(step_in_backward=True, cpu_threads=fewer)),
        "delayed": ("annotate_offload delayed_param_update", ours(delayed_param_update=True)),
        "delayed_fewer": (f"annotate_offload delayed_param_update, cpu_threads={fewer}",
                          ours(delayed_param_update=True, cpu_threads=fewer)),
        "torchao": ("torchao CPUOffloadOptimizer", lambda: _peers.make_torchao_cpu_offload_optimizer(
            model.parameters(), lr=1e-5, offload_gradients=True)),
    }
    keys = a.only.split(",") if a.only else list(every)
    unknown = [k for k in keys if k not in every]
    if unknown:
        raise SystemExit(f"--only: unknown {unknown}; choose from {sorted(every)}")
    makers = dict(every[k] for k in keys)
    if a.profile:
        os.makedirs(a.profile, exist_ok=True)
    clock = _Clock(dev)
    batched_default = _pipeline.BATCHED_NUMEL
    times: dict[str, list[float]] = {k: [] for k in makers}
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if dev.type == 'cuda' else 'CPU (smoke run)'}, {sum(p.numel() for p in model.parameters()) / 1e9:.3f} G params")
    print("| round | optimizer | ms/step | host AdamW ms/step |\n|---|---|---:|---:|")
    for r in range(a.rounds):
        for name, make in makers.items():
            _free(dev)
            # Note [Tiny gradients at step()]: the "hookall" variant restores the hook per tiny gradient
            _pipeline.BATCHED_NUMEL = 0 if "BATCHED_NUMEL=0" in name else batched_default
            opt = make()
            if opt is None:
                print(f"| {r} | {name} | not importable |")
                continue

            def step() -> None:
                _loss(model, x, dev).backward()
                opt.step()
                opt.zero_grad()

            for _ in range(a.warmup):
                step()
            ms = clock.time(step, a.steps)
            times[name].append(ms)
            host = getattr(opt, "host_step_seconds", float("nan")) * 1e3  # the last step's
            print(f"| {r} | {name} | {ms:.1f} | {host:.1f} |", flush=True)
            if a.profile and r == 0:
                from torch.profiler import ProfilerActivity, profile

                acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev.type == "cuda" else [])
                with profile(activities=acts) as prof:
                    step()
                    clock.sync()
                slug = "".join(ch if ch.isalnum() else "_" for ch in name)[:60]
                prof.export_chrome_trace(os.path.join(a.profile, f"{slug}.json"))
            if hasattr(opt, "close"):
                opt.close()
            del opt
            model.zero_grad(set_to_none=True)
    print("\n| optimizer | median ms/step | min | max |\n|---|---:|---:|---:|")
    for name, t in times.items():
        if t:
            print(f"| {name} | {statistics.median(t):.1f} | {min(t):.1f} | {max(t):.1f} |")


if __name__ == "__main__":
    main()
