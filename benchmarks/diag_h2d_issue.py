"""What one host->device copy costs the thread that issues it (W3 exact step: F2 measured 12-17 ms
of "H2D issue" on the worker for 288 parameters, ~47 us per copy, NOTES "Session ... (eighth)").

Builds W3's model and a ``HybridDeviceOptimizer`` (f=1), then times, on the calling thread, the
issue (not the transfer) of every host master's H2D, several ways:

- ``_h2d_chunk``: the optimizer's own issue path, from step() on (no per-parameter waits) and as
  in backward (a wait on each parameter's gradient-ready event first);
- ``copy_ loop``: ``local.copy_(master, non_blocking=True)`` per parameter under one stream context;
- ``_foreach_copy_``: one call per chunk (the per-tensor loop runs in C++);
- ``registered``: the copy loop from a pageable buffer pinned with ``cudaHostRegister`` instead of
  the caching host allocator (whose copies record an event per call);
- ``... under load``: the copy loop while another thread runs fused CPU AdamW on cores - 1 threads,
  as the worker's own OpenMP team does between its H2D issues.

Prints a markdown table: microseconds per copy (median of the rounds) and the whole issue in ms.
Usage (GPU): ``CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 python benchmarks/diag_h2d_issue.py [--rounds 5]``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time

import torch

from annotate_offload.bench.optimizer import _FULL
from annotate_offload.models.gpt import GPTStack
from annotate_offload.optim import HybridDeviceOptimizer


def _time_issue(fn, side_sync) -> float:
    side_sync()
    t = time.perf_counter()
    with torch.no_grad():  # the copies write leaf parameters in place
        fn()
    dt = time.perf_counter() - t
    side_sync()
    return dt


class _Load:
    """Fused CPU AdamW looping on another thread with ``threads`` OpenMP threads."""

    def __init__(self, threads: int, numel: int = 1 << 24) -> None:
        self.threads, self.stop = threads, threading.Event()
        p = torch.zeros(numel)
        p.grad = torch.ones(numel)
        self.opt = torch.optim.AdamW([p], lr=1e-5, fused=True)
        self.t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        torch.set_num_threads(self.threads)
        while not self.stop.is_set():
            self.opt.step()

    def __enter__(self):
        self.t.start()
        time.sleep(0.2)
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.t.join()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    if not torch.cuda.is_available():
        raise SystemExit("diag_h2d_issue.py needs a CUDA GPU: it times cudaMemcpyAsync issue")
    dev = torch.device("cuda")
    model = GPTStack(_FULL["config"], device=dev)
    opt = HybridDeviceOptimizer(model.parameters(), lr=1e-5, offload_fraction=1.0)
    slots = [s for c in opt._chunks for s in c.slots]
    n = len(slots)
    h2d = opt._h2d
    sync = torch.cuda.synchronize
    ev = torch.cuda.Event()
    ev.record()
    for s in slots:
        s.ready_ev = ev
    total = sum(s.master.numel() for s in slots)
    flat = torch.empty(total, dtype=torch.float32)  # pageable, then registered with the driver
    rc = torch.cuda.cudart().cudaHostRegister(flat.data_ptr(), flat.numel() * 4, 0)
    reg, off = [], 0
    for s in slots:
        k = s.master.numel()
        reg.append(flat[off:off + k].view(s.master.shape).copy_(s.master))
        off += k

    def own(in_backward: bool):
        return lambda: [opt._h2d_chunk(c, c.slots, h2d, in_backward=in_backward) for c in opt._chunks]

    def loop(srcs):
        def run():
            with torch.cuda.stream(h2d):
                for s, src in zip(slots, srcs):
                    s.local.copy_(src, non_blocking=True)
        return run

    def foreach():
        with torch.cuda.stream(h2d):
            for c in opt._chunks:
                torch._foreach_copy_([s.local for s in c.slots], [s.master for s in c.slots], non_blocking=True)

    masters = [s.master for s in slots]
    tiny = [s for s in slots if opt._batched(s)]  # the gradients step() copies in one batch (BATCHED_NUMEL)
    scratch = torch.empty(sum(s.local.numel() for s in tiny), dtype=torch.float32, pin_memory=True)

    def d2h_loop():
        with torch.cuda.stream(h2d):
            for s in tiny:
                s.grad_bufs[0].copy_(s.local, non_blocking=True)

    def d2h_foreach():
        with torch.cuda.stream(h2d):
            torch._foreach_copy_([s.grad_bufs[0] for s in tiny], [s.local for s in tiny], non_blocking=True)

    def d2h_cat():  # one gather kernel, one D2H; the scatter on the host waits for the copy
        with torch.cuda.stream(h2d):
            scratch.copy_(torch.cat([s.local.reshape(-1) for s in tiny]), non_blocking=True)
        h2d.synchronize()
        torch._foreach_copy_([s.grad_bufs[0].view(-1) for s in tiny], list(scratch.split([s.local.numel() for s in tiny])))

    cores = len(os.sched_getaffinity(0))
    ways = [("_h2d_chunk, from step() on", own(False)), ("_h2d_chunk, as in backward (waits)", own(True)),
            ("copy_ loop (pinned, caching host allocator)", loop(masters)), ("_foreach_copy_ per chunk", foreach)]
    ways += [(f"D2H of the {len(tiny)} tiny gradients: copy_ loop (per tiny copy)", d2h_loop),
             ("D2H tiny: _foreach_copy_", d2h_foreach), ("D2H tiny: cat + one D2H + host scatter (incl. wait)", d2h_cat)]
    if rc == 0:
        ways.append(("copy_ loop (cudaHostRegister'd pageable)", loop(reg)))
    res: dict[str, list[float]] = {k: [] for k, _ in ways}
    loaded = "copy_ loop under fused CPU AdamW load"
    res[loaded] = []
    for _ in range(a.rounds):
        for k, fn in ways:
            res[k].append(_time_issue(fn, sync))
        with _Load(max(1, cores - 1)):
            res[loaded].append(_time_issue(loop(masters), sync))
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name()}, {n} host parameters in {len(opt._chunks)} chunks, "
          f"cudaHostRegister rc={rc}, {a.rounds} rounds")
    print("| way | us per copy (median) | min | max | issue of all ms |\n|---|---:|---:|---:|---:|")
    for k, ts in res.items():
        us = [t / (len(tiny) if "tiny" in k else n) * 1e6 for t in ts]
        print(f"| {k} | {statistics.median(us):.1f} | {min(us):.1f} | {max(us):.1f} | {statistics.median(ts) * 1e3:.2f} |")
    opt.close()
    if rc == 0:
        torch.cuda.cudart().cudaHostUnregister(flat.data_ptr())


if __name__ == "__main__":
    main()
