"""Host memory diagnostic for the optimizer's host step: does the kind of host memory (pageable,
transparent huge pages, pinned, registered, hugetlbfs) change fused CPU AdamW's throughput, and can
the fast kind still be copied to and from the GPU at link speed?

Why (benchmarks/NOTES.md, session 6, D1): on the H200 host torch's fused CPU AdamW over pageable
buffers ran at 4.88 G params/s, over pinned ones (``cudaHostAlloc``) at 3.79, and the pipeline's
host step (pinned, copies running) at 3.0-3.5. Pinned memory is needed for asynchronous D2H/H2D.

Prints a markdown table per round (variants alternated, so host drift hits every variant alike):
AdamW ms and G params/s, in-place add GB/s, D2H/H2D GB/s from that memory (where registered), and
the share of the buffers on huge pages (``AnonHugePages`` of /proc/self/smaps_rollup, or hugetlbfs).

Usage: CUDA_VISIBLE_DEVICES=0 taskset -c 0-15 python benchmarks/diag_host_memory.py [--gparams 0.25] [--rounds 3]
"""

from __future__ import annotations

import argparse
import ctypes
import mmap
import os
import time

import torch

MADV_HUGEPAGE, MADV_NOHUGEPAGE, MAP_HUGETLB = 14, 15, 0x40000
HUGE = 2 << 20
libc = ctypes.CDLL(None, use_errno=True)


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError as e:
        return f"({e.__class__.__name__})"


def _anon_huge_kib() -> int:
    for line in _read("/proc/self/smaps_rollup").splitlines():
        if line.startswith("AnonHugePages:"):
            return int(line.split()[1])
    return -1


class Arena:
    """fp32 buffers of one memory kind; ``close()`` unregisters and frees."""

    def __init__(self, kind: str) -> None:
        self.kind, self.keep, self.registered, self.maps = kind, [], [], []

    def empty(self, numel: int) -> torch.Tensor:
        nbytes = numel * 4
        if self.kind == "pinned":
            t = torch.empty(numel, pin_memory=True)
            self.keep.append(t)
            return t.zero_()
        if self.kind == "hugetlb+reg":
            size = -(-nbytes // HUGE) * HUGE
            mm = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | MAP_HUGETLB)
            self.maps.append(mm)
            t = torch.frombuffer(mm, dtype=torch.float32, count=numel)
        else:
            raw = torch.empty(numel + HUGE // 4)
            self.keep.append(raw)
            t = raw.narrow(0, (-raw.data_ptr()) % HUGE // 4, numel)
            advice = {"pageable": None, "nothp": MADV_NOHUGEPAGE, "thp": MADV_HUGEPAGE}[self.kind.split("+")[0]]
            if advice is not None:
                libc.madvise(ctypes.c_void_p(t.data_ptr()), ctypes.c_size_t(nbytes - nbytes % HUGE), advice)
        t.zero_()  # first touch from the OpenMP team (pages spread as the kernel places them)
        if self.kind.endswith("+reg"):
            rc = int(torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0))
            if rc != 0:
                raise RuntimeError(f"cudaHostRegister failed: {rc}")
            self.registered.append(t.data_ptr())
        return t

    def close(self) -> None:
        for p in self.registered:
            torch.cuda.cudart().cudaHostUnregister(p)
        self.registered, self.keep = [], []
        for mm in self.maps:
            try:
                mm.close()
            except BufferError:
                pass  # a tensor still views it; freed with the tensor
        self.maps = []


def measure(kind: str, n: int, threads: int, reps: int) -> dict:
    huge0 = _anon_huge_kib()
    a = Arena(kind)
    try:
        p, g, m, v = (a.empty(n) for _ in range(4))
    except (OSError, RuntimeError, ValueError) as e:
        a.close()
        return {"kind": kind, "error": f"{e.__class__.__name__}: {e}"[:90]}
    huge = (_anon_huge_kib() - huge0) * 1024 / (4 * n * 4) if kind != "hugetlb+reg" else 1.0
    g.normal_()
    p.grad = g
    opt = torch.optim.AdamW([p], lr=1e-5, fused=True)
    torch.set_num_threads(threads)
    opt.step()
    t_adam = []
    for _ in range(reps):
        t0 = time.perf_counter()
        opt.step()
        t_adam.append(time.perf_counter() - t0)
    t_add = []
    for _ in range(reps):
        t0 = time.perf_counter()
        m.add_(v, alpha=1e-6)
        t_add.append(time.perf_counter() - t0)
    row = {"kind": kind, "adam_ms": min(t_adam) * 1e3, "gps": n / min(t_adam) / 1e9,
           "add_gbs": 12 * n / min(t_add) / 1e9, "huge": huge}
    if kind == "pinned" or kind.endswith("+reg"):
        k = min(n, 256 << 20)  # 1 GiB
        dev = torch.empty(k, device="cuda")
        for name, dst, src in (("d2h", m[:k], dev), ("h2d", dev, v[:k])):
            dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            for _ in range(3):
                dst.copy_(src, non_blocking=True)
            torch.cuda.synchronize()
            row[name] = 3 * 4 * k / (time.perf_counter() - t0) / 1e9
        del dev
    del opt, p, g, m, v
    a.close()
    return row


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--gparams", type=float, default=0.25)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=max(1, len(os.sched_getaffinity(0)) - 1))
    ap.add_argument("--kinds", default="pageable,nothp,thp,pinned,nothp+reg,thp+reg,hugetlb+reg")
    args = ap.parse_args()
    n = int(args.gparams * 1e9)
    print(f"torch {torch.__version__}, {torch.cuda.get_device_name(0) if torch.cuda.is_available() else 'no GPU'}, "
          f"{args.threads} threads, {n / 1e9:.2f} G fp32 params (4 buffers of {4 * n / 2**30:.2f} GiB)")
    print("THP enabled:", _read("/sys/kernel/mm/transparent_hugepage/enabled"),
          "| defrag:", _read("/sys/kernel/mm/transparent_hugepage/defrag"))
    print("hugetlb:", " ".join(line for line in _read("/proc/meminfo").splitlines() if "Huge" in line))
    print("NUMA nodes:", _read("/sys/devices/system/node/online"), "| memlock:", os.popen("ulimit -l").read().strip())
    kinds = args.kinds.split(",")
    for r in range(args.rounds):
        print(f"\nround {r + 1}\n\n| memory | AdamW ms | G params/s | add GB/s | on huge pages | D2H GB/s | H2D GB/s |\n|---|---|---|---|---|---|---|")
        for kind in kinds:
            row = measure(kind, n, args.threads, args.reps)
            if "error" in row:
                print(f"| {kind} | {row['error']} | | | | | |")
                continue
            f = lambda k: f"{row[k]:.1f}" if k in row else "-"  # noqa: E731
            print(f"| {kind} | {row['adam_ms']:.1f} | {row['gps']:.2f} | {row['add_gbs']:.1f} | {row['huge']:.0%} | "
                  f"{f('d2h')} | {f('h2d')} |", flush=True)


if __name__ == "__main__":
    main()
