"""How one rank's host optimizer step slows the other rank's Python thread, by CPU placement.

Session 3's FSDP2 traces: every CPU op of a rank's training thread (aten::mm dispatch, copy_,
layer_norm, ...) ran 1.7-2x slower than in the 1-GPU run exactly while the *other* rank's fused
CPU AdamW ran (the ranks alternate: one steps on the host while the other runs backward), with
``--bind`` giving rank 0 CPUs 0-15 and rank 1 CPUs 16-31. Two explanations: CPUs i and i+16 are
SMT siblings (one physical core), or host memory bandwidth. This separates them, GPU-free:

* the topology /sys reports (SMT siblings per CPU);
* a dispatch-bound loop (small torch ops, the shape of a training thread's CPU work) on one CPU,
  alone and while fused CPU AdamW (``--threads`` threads, ``--mparams`` M params) runs in another
  process on (a) CPUs 0-15, (b) the whole cores that do not hold the loop's CPU;
* fused CPU AdamW of two processes at once, split contiguous (0-15 | 16-31) vs. by whole cores.

Run: ``python benchmarks/diag_cpu.py`` (needs >= 4 CPUs; prints markdown tables).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time


def _siblings() -> dict[int, tuple[int, ...]]:
    from annotate_offload.distributed._threads import parse_cpulist

    out = {}
    for c in sorted(os.sched_getaffinity(0)):
        try:
            with open(f"/sys/devices/system/cpu/cpu{c}/topology/thread_siblings_list") as f:
                out[c] = tuple(parse_cpulist(f.read()))
        except OSError:
            out[c] = (c,)
    return out


def _adamw(cpus: str, threads: int, mparams: int, seconds: float) -> None:
    import torch

    os.sched_setaffinity(0, [int(c) for c in cpus.split(",")])
    torch.set_num_threads(threads)
    n = mparams * 10**6 // 8
    ps = [torch.zeros(n) for _ in range(8)]
    for p in ps:
        p.grad = torch.ones(n)
    opt = torch.optim.AdamW(ps, lr=1e-3, fused=True)
    opt.step()
    t0 = time.perf_counter()
    steps = 0
    while time.perf_counter() - t0 < seconds:
        opt.step()
        steps += 1
    dt = time.perf_counter() - t0
    print(f"{steps * mparams / 1e3 / dt:.3f}", flush=True)  # G params/s


def _dispatch(cpu: int, seconds: float) -> None:
    import torch

    os.sched_setaffinity(0, [cpu])
    torch.set_num_threads(1)
    a, b = torch.randn(64, 64), torch.randn(64, 64)
    for _ in range(200):
        torch.mm(a, b).add_(1).relu_()
    t0 = time.perf_counter()
    n = 0
    while time.perf_counter() - t0 < seconds:
        for _ in range(200):
            torch.mm(a, b).add_(1).relu_()
        n += 200
    print(f"{(time.perf_counter() - t0) / n * 1e6:.2f}", flush=True)  # us per iteration


def _spawn(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, *args], stdout=subprocess.PIPE, text=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--role", choices=("driver", "adamw", "dispatch"), default="driver")
    ap.add_argument("--cpus", default="")
    ap.add_argument("--cpu", type=int, default=0)
    ap.add_argument("--threads", type=int, default=15)
    ap.add_argument("--mparams", type=int, default=200)
    ap.add_argument("--seconds", type=float, default=4.0)
    a = ap.parse_args()
    if a.role == "adamw":
        return _adamw(a.cpus, a.threads, a.mparams, a.seconds)
    if a.role == "dispatch":
        return _dispatch(a.cpu, a.seconds)
    sib = _siblings()
    cpus = sorted(sib)
    half = len(cpus) // 2
    lo, hi = cpus[:half], cpus[half:]
    # whole cores: group siblings, deal cores (both threads) to the two halves
    cores = sorted({tuple(sorted(s)) for s in sib.values()})
    ca = [c for core in cores[: len(cores) // 2] for c in core if c in sib]
    cb = [c for core in cores[len(cores) // 2 :] for c in core if c in sib]
    print(f"{len(cpus)} CPUs, {len(cores)} cores (SMT siblings per /sys); cpu{lo[0]} siblings {sib[lo[0]]}, "
          f"cpu{hi[0]} siblings {sib[hi[0]]}; contiguous halves {lo[0]}-{lo[-1]} | {hi[0]}-{hi[-1]}; "
          f"whole-core halves {ca} | {cb}")
    j = lambda xs: ",".join(map(str, xs))  # noqa: E731
    thr = str(a.threads)
    s = str(a.seconds)
    print("\n| dispatch loop on one CPU (64x64 mm + add + relu) | us / iteration |\n|---|---:|")
    alone = float(_spawn("--role", "dispatch", "--cpu", str(hi[0]), "--seconds", s).communicate()[0])
    print(f"| cpu{hi[0]} alone | {alone:.2f} |")
    for label, bg in ((f"cpu{hi[0]} while AdamW runs on {lo[0]}-{lo[-1]} (contiguous split)", lo),
                      (f"cpu{cb[0]} while AdamW runs on the other half's whole cores", ca)):
        probe = hi[0] if bg is lo else cb[0]
        p = _spawn("--role", "adamw", "--cpus", j(bg), "--threads", thr, "--mparams", str(a.mparams), "--seconds", str(a.seconds + 2))
        time.sleep(1.5)
        v = float(_spawn("--role", "dispatch", "--cpu", str(probe), "--seconds", s).communicate()[0])
        p.communicate()
        print(f"| {label} | {v:.2f} ({v / alone:.2f}x) |")
    print("\n| fused CPU AdamW, two processes at once (G params/s each) | process A | process B |\n|---|---:|---:|")
    one = float(_spawn("--role", "adamw", "--cpus", j(lo), "--threads", thr, "--mparams", str(a.mparams), "--seconds", s).communicate()[0])
    print(f"| one process alone on {lo[0]}-{lo[-1]} | {one:.2f} | - |")
    for label, (x, y) in (("contiguous halves", (lo, hi)), ("whole-core halves", (ca, cb))):
        ps = [_spawn("--role", "adamw", "--cpus", j(c), "--threads", thr, "--mparams", str(a.mparams), "--seconds", s) for c in (x, y)]
        va, vb = (float(p.communicate()[0]) for p in ps)
        print(f"| {label} | {va:.2f} | {vb:.2f} |", flush=True)


if __name__ == "__main__":
    main()
