"""Where the CPU time of an offloaded forward goes: the saved-tensor hooks' share, per function.

Issue 9's FSDP2 forward is CPU-bound, and the pack hooks are the part of it this project owns
(~1.3 ms per offloaded layer on the 2-GPU host, session 3). This builds the weak-scaling bench's
model (``GPTStack`` 24 x 2048, 16 heads, autocast bf16, 4 x 1024 tokens), runs forwards with
``--offload-layers`` of its layers offloaded and with none, and prints

1. the CPU wall time of one forward (``perf_counter`` around the call, synchronised before and
   after; median of ``--repeat``), with and without offload, and the difference per offloaded layer;
2. a ``cProfile`` of ``--repeat`` offloaded forwards: the annotate_offload functions by own time
   (per forward, in ms), then the torch calls they make.

cProfile inflates Python-heavy code, so compare rows of one run, not with the wall times.
Run on the GPU machine: ``taskset -c 0-15 python benchmarks/diag_pack.py``; on CPU it is a smoke run.
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import statistics
import time

import torch

from annotate_offload.annotate import offload_transform
from annotate_offload.models.gpt import GPTConfig, GPTStack


def _forward_ms(model, x, repeat: int, sync) -> float:
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        with torch.autocast(x.device.type, dtype=torch.bfloat16):
            out = model(x)
        t1 = time.perf_counter()
        out.float().square().mean().backward()
        sync()
        times.append((t1 - t0) * 1e3)
    return statistics.median(times)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--offload-layers", type=int, default=12)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--no-profile", action="store_true", help="only the wall-time table (an A/B of two checkouts)")
    a = ap.parse_args()
    cuda = torch.cuda.is_available()
    dev = torch.device("cuda" if cuda else "cpu")
    cfg = GPTConfig(hidden=2048, heads=16, layers=24) if cuda else GPTConfig(hidden=64, heads=4, layers=4)
    batch, seq = (4, 1024) if cuda else (2, 16)
    offload = a.offload_layers if cuda else 2
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    x = torch.randn(batch, seq, cfg.hidden, device=dev)
    torch.manual_seed(0)
    plain = GPTStack(cfg, device=dev)
    base = _forward_ms(plain, x, a.repeat + 2, sync)
    del plain
    torch.manual_seed(0)
    model = GPTStack(cfg, device=dev)
    offload_transform(model, num_layers=offload, prefetch_layers=1, **({} if cuda else {"min_offload_numel": 1}))
    off = _forward_ms(model, x, a.repeat + 2, sync)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name() if cuda else 'CPU'}; "
          f"{cfg.layers} layers x {cfg.hidden}, {batch} x {seq} tokens, {offload} layers offloaded")
    print("| forward | CPU ms (median) |\n|---|---:|")
    print(f"| no offload | {base:.2f} |\n| {offload} layers offloaded | {off:.2f} |")
    print(f"| difference per offloaded layer | {(off - base) / max(1, offload):.3f} |")
    print(f"| difference per offloaded layer / plain forward per layer | "
          f"{(off - base) / max(1, offload) / (base / cfg.layers):.2f} |\n")
    if a.no_profile:
        return
    prof = cProfile.Profile()
    for _ in range(a.repeat):
        sync()
        prof.enable()
        with torch.autocast(dev.type, dtype=torch.bfloat16):
            out = model(x)
        prof.disable()
        out.float().square().mean().backward()
        sync()
    st = pstats.Stats(prof)
    rows = []
    for (fname, line, func), (cc, nc, tt, ct, callers) in st.stats.items():
        rows.append((tt / a.repeat * 1e3, ct / a.repeat * 1e3, nc // a.repeat, fname, line, func))
    ours = sorted((r for r in rows if "annotate_offload" in r[3]), reverse=True)
    print("| annotate_offload function | own ms / fwd | cumulative ms / fwd | calls / fwd |\n|---|---:|---:|---:|")
    for tt, ct, nc, fname, line, func in ours[:25]:
        short = fname.split("annotate_offload/")[-1]
        print(f"| {short}:{line} {func} | {tt:.3f} | {ct:.3f} | {nc} |")
    other = sorted((r for r in rows if "annotate_offload" not in r[3]), reverse=True)
    print("\n| other function (torch, builtins) | own ms / fwd | calls / fwd |\n|---|---:|---:|")
    for tt, ct, nc, fname, line, func in other[:25]:
        print(f"| {fname.split('/')[-1]}:{line} {func} | {tt:.3f} | {nc} |")


if __name__ == "__main__":
    main()
