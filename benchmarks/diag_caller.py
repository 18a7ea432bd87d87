"""A/B: exact-mode host chunks on the worker thread vs. on the thread that called ``step()``.

Run 4 of the W3 benchmark: the serial path (overlap off, chunks stepped on the calling thread)
reached 4.6-4.7 G params/s while the pipelined exact mode (worker thread) reached 3.7-4.0, so
the overlapped copies bought nothing. In exact mode ``step()`` waits for the host step anyway, so
the calling thread can step the chunks itself while the H2D stream copies finished ones back.
One optimizer, W3's model (1.21 G params, f=1, offload_gradients), the two variants alternated
A B A B (host noise hits both), ``--steps`` timed steps each after one warm-up step.

Run on the GPU machine: ``python benchmarks/diag_caller.py [--steps 4]``.
"""

from __future__ import annotations

import argparse
import time

import torch

from annotate_offload.models.gpt import GPTConfig, GPTStack
from annotate_offload.optim import HybridDeviceOptimizer


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--tiny", action="store_true")
    a = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    h, layers, b, t = (64, 2, 2, 16) if a.tiny else (2048, 24, 4, 1024)
    torch.manual_seed(0)
    model = GPTStack(GPTConfig(hidden=h, heads=4 if a.tiny else 16, layers=layers), device=dev)
    x = torch.randn(b, t, h, device=dev)
    opt = HybridDeviceOptimizer(model.parameters(), lr=1e-5, offload_fraction=1.0, offload_gradients=True)

    def step():
        with torch.autocast(dev, dtype=torch.bfloat16):
            out = model(x)
        out.float().square().mean().backward()
        opt.step()
        opt.zero_grad()

    def sync():
        if dev == "cuda":
            torch.cuda.synchronize()

    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if dev == 'cuda' else 'CPU'}, "
          f"{opt.offloaded_numel / 1e9:.3f} G host params, {opt.thread_budget} threads")
    print("| variant | ms/step | host step ms | host G params/s |")
    print("|---|---|---|---|")
    for caller in (False, True, False, True):
        opt._caller_steps = caller
        step()
        sync()
        t0 = time.perf_counter()
        host = 0.0
        for _ in range(a.steps):
            step()
            host += opt.host_step_seconds
        sync()
        ms = (time.perf_counter() - t0) * 1e3 / a.steps
        hs = host * 1e3 / a.steps
        print(f"| {'caller thread' if caller else 'worker thread'} | {ms:.1f} | {hs:.1f} | "
              f"{opt.offloaded_numel / hs / 1e6:.2f} |", flush=True)
    opt.close()


if __name__ == "__main__":
    main()
