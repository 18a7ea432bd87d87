"""Timeline of W3 steps with HybridDeviceOptimizer: where does a delayed_param_update step go?

The closing run measured delayed_param_update at 519.5 ms per step against a 316 ms bound: the
phases showed ``step()`` returning in 3 ms and a 354 ms host update, i.e. the forward/backward of
step t+1 did not overlap the host update of step t. This script prints, per step and relative to
the first step's start (host clock, ms): forward/backward/step() begin and end on the host, the
GPU forward and backward intervals (CUDA events, aligned to the host clock at a synchronize),
and the worker's host-chunk busy intervals, for:

1. ``delayed``: ``delayed_param_update=True`` (f=1, offload_gradients);
2. ``delayed, N threads``: the same with a smaller host thread budget (CPU contention test);
3. ``exact``: the default mode (f=1, offload_gradients);
4. ``fwd/bwd + busy host``: forward/backward alone while a thread runs fused CPU AdamW over the
   same number of elements in a loop (does host compute slow the GPU side down?).

Run on the GPU machine: ``python benchmarks/diag_delayed.py [--steps 5] [--threads 8]``.
"""

from __future__ import annotations

import argparse
import threading
import time

import torch

from annotate_offload.models.gpt import GPTConfig, GPTStack
from annotate_offload.optim import HybridDeviceOptimizer


CUDA = torch.cuda.is_available()


def _sync():
    if CUDA:
        torch.cuda.synchronize()


def _loss(model, x):
    with torch.autocast(x.device.type, dtype=torch.bfloat16):
        out = model(x)
    return out.float().square().mean()


class _GpuClock:
    """Host-aligned CUDA event times (ms since ``t0``)."""

    def __init__(self):
        _sync()
        self.ev0 = torch.cuda.Event(enable_timing=True) if CUDA else None
        if CUDA:
            self.ev0.record()
        _sync()
        self.t0 = time.perf_counter()
        self.marks: list = []

    def mark(self, name, step):
        if not CUDA:  # CPU dry run: host times stand in for device times
            self.marks.append((name, step, self.host()))
            return
        e = torch.cuda.Event(enable_timing=True)
        e.record()
        self.marks.append((name, step, e))

    def host(self):
        return (time.perf_counter() - self.t0) * 1e3

    def resolve(self):
        _sync()
        return [(n, s, self.ev0.elapsed_time(e) if CUDA else e) for n, s, e in self.marks]


def _spans(chunks, lo, hi):
    """Merge worker intervals inside [lo, hi) -> busy ms and first/last."""
    xs = sorted((a, b) for a, b in chunks if b > lo and a < hi)
    busy, last_end, first, last = 0.0, -1e18, None, None
    for a, b in xs:
        a, b = max(a, lo), min(b, hi)
        if first is None:
            first = a
        last = b
        if a > last_end:
            busy += b - a
        else:
            busy += max(0.0, b - last_end)
        last_end = max(last_end, b)
    return busy, first, last


def timeline(name, model, x, steps, **kw):
    opt = HybridDeviceOptimizer(model.parameters(), lr=1e-5, offload_fraction=1.0, offload_gradients=True, **kw)
    chunks: list[tuple[float, float]] = []
    clock = None
    real = opt._run_chunk

    def spy(*a, **k):
        t = clock.host() if clock else 0.0
        try:
            return real(*a, **k)
        finally:
            if clock:
                chunks.append((t, clock.host()))

    opt._run_chunk = spy
    for _ in range(2):  # warm-up
        _loss(model, x).backward()
        opt.step()
        opt.zero_grad()
    opt.flush()
    clock = _GpuClock()
    rows = []
    for i in range(steps):
        h = {"fwd0": clock.host()}
        clock.mark("fwd0", i)
        loss = _loss(model, x)
        h["fwd1"] = clock.host()
        clock.mark("fwd1", i)
        loss.backward()
        h["bwd1"] = clock.host()
        clock.mark("bwd1", i)
        opt.step()
        h["step1"] = clock.host()
        clock.mark("step1", i)
        opt.zero_grad()
        rows.append(h)
    opt.flush()
    g = {}
    for n, s, t in clock.resolve():
        g[(n, s)] = t
    total = clock.host()
    print(f"\n### {name}: {total / steps:.1f} ms/step ({steps} steps, threads={opt.thread_budget})")
    print("| step | host fwd | host bwd end | step() call..return | GPU fwd | GPU bwd | GPU step end | worker busy in step | worker first..last |")
    print("|---|---|---|---|---|---|---|---|---|")
    for i, h in enumerate(rows):
        lo = h["fwd0"]
        hi = rows[i + 1]["fwd0"] if i + 1 < len(rows) else total
        busy, first, last = _spans(chunks, lo, hi)
        fl = f"{first:.0f}..{last:.0f}" if first is not None else "-"
        print(f"| {i} | {h['fwd0']:.0f}..{h['fwd1']:.0f} | {h['bwd1']:.0f} | {h['bwd1']:.0f}..{h['step1']:.0f} | "
              f"{g[('fwd0', i)]:.0f}..{g[('fwd1', i)]:.0f} | ..{g[('bwd1', i)]:.0f} | {g[('step1', i)]:.0f} | {busy:.0f} | {fl} |")
    opt.close()
    model.zero_grad(set_to_none=True)
    if CUDA:
        torch.cuda.empty_cache()


def busy_host(model, x, steps, threads):
    n = sum(p.numel() for p in model.parameters())
    torch.manual_seed(0)
    p = torch.zeros(n)
    p.grad = torch.zeros(n)
    opt = torch.optim.AdamW([p], lr=1e-5, fused=True)
    stop = threading.Event()

    def spin():
        torch.set_num_threads(threads)
        while not stop.is_set():
            opt.step()

    def fb(k):
        _sync()
        t = time.perf_counter()
        for _ in range(k):
            _loss(model, x).backward()
        _sync()
        model.zero_grad(set_to_none=True)
        return (time.perf_counter() - t) * 1e3 / k

    fb(1)
    quiet = fb(steps)
    th = threading.Thread(target=spin, daemon=True)
    th.start()
    time.sleep(0.2)
    loaded = fb(steps)
    stop.set()
    th.join()
    print(f"\n### fwd+bwd alone: {quiet:.1f} ms; with fused CPU AdamW looping on {threads} threads: {loaded:.1f} ms")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--threads", type=int, default=8)
    ap.add_argument("--tiny", action="store_true", help="2 layers, hidden 64 (a dry run of the script, CPU too)")
    a = ap.parse_args()
    torch.manual_seed(0)
    dev = "cuda" if CUDA else "cpu"
    h, layers, b, t = (64, 2, 2, 16) if a.tiny else (2048, 24, 4, 1024)
    model = GPTStack(GPTConfig(hidden=h, heads=4 if a.tiny else 16, layers=layers), device=dev)
    x = torch.randn(b, t, h, device=dev)
    name = torch.cuda.get_device_name() if CUDA else "CPU"
    print(f"torch {torch.__version__}, {name}, torch threads {torch.get_num_threads()}")
    timeline("delayed", model, x, a.steps, delayed_param_update=True)
    timeline(f"delayed, {a.threads} threads", model, x, a.steps, delayed_param_update=True, cpu_threads=a.threads)
    timeline("exact", model, x, a.steps)
    busy_host(model, x, a.steps, max(1, torch.get_num_threads() - 1))


if __name__ == "__main__":
    main()
