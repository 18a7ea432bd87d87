"""What the GPUs of a multi-GPU host share: NCCL collectives vs. pinned-memory copies vs. GEMMs.

The FSDP2 / DDP weak-scaling traces of session 3 showed NCCL's ring kernels running the LL protocol
for 200 MB messages, busy 250 ms per step, GEMMs 1.5x slower than in the 1-GPU run and activation
copies at 42-49 instead of 55 GB/s: as if the collectives went through host memory (no GPU peer
access) and shared the PCIe links and the SMs with offload. This measures it directly, every rank
at once, each row the mean of ``--iters`` repetitions after one warm-up:

* pinned D2H and H2D (``--mib`` per copy) alone, and while an all-gather loop runs;
* ``all_gather_into_tensor`` (``--mib`` per rank in) alone, and while D2H + H2D loops run;
* a bf16 8192^3 GEMM alone, and while an all-gather loop runs (SMs taken by NCCL kernels).

Run: ``NCCL_NVLS_ENABLE=0 torchrun --nproc-per-node 2 benchmarks/diag_links.py`` (try NCCL_PROTO,
NCCL_P2P_LEVEL, NCCL_MAX_NCHANNELS in the environment to compare transports).
"""

from __future__ import annotations

import argparse
import os

import torch
import torch.distributed as dist


def _timed(fn, stream: torch.cuda.Stream, iters: int) -> float:
    """Mean ms of ``fn`` enqueued ``iters`` times on ``stream`` (after one warm-up)."""
    with torch.cuda.stream(stream):
        fn()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(iters):
            fn()
        b.record()
    b.synchronize()
    return a.elapsed_time(b) / iters


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--iters", type=int, default=8)
    a = ap.parse_args()
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    dev = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
    torch.cuda.set_device(dev)
    dist.init_process_group("nccl", device_id=dev)
    n = a.mib * 2**20
    gpu = torch.empty(n, dtype=torch.uint8, device=dev)
    host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    host2 = torch.empty(n, dtype=torch.uint8, pin_memory=True)
    gpu2 = torch.empty(n, dtype=torch.uint8, device=dev)
    ag_in = torch.empty(n // 4, dtype=torch.float32, device=dev)
    ag_out = torch.empty(n // 4 * world, dtype=torch.float32, device=dev)
    m = torch.randn(8192, 8192, device=dev, dtype=torch.bfloat16)
    s_d2h, s_h2d, s_ag, s_mm = (torch.cuda.Stream(dev) for _ in range(4))
    peer = [torch.cuda.can_device_access_peer(dev.index, j) for j in range(torch.cuda.device_count()) if j != dev.index]

    d2h = lambda: host.copy_(gpu, non_blocking=True)  # noqa: E731
    h2d = lambda: gpu2.copy_(host2, non_blocking=True)  # noqa: E731
    ag = lambda: dist.all_gather_into_tensor(ag_out, ag_in)  # noqa: E731
    mm = lambda: torch.mm(m, m)  # noqa: E731

    def both(main_fn, main_s, side: list, it: int) -> float:
        """``main_fn`` timed while ``side`` (fn, stream) loops run on their streams for as long."""
        for fn, s in side:
            with torch.cuda.stream(s):
                for _ in range(it + 2):
                    fn()
        return _timed(main_fn, main_s, it)

    dist.barrier()
    t_d2h = _timed(d2h, s_d2h, a.iters)
    t_h2d = _timed(h2d, s_h2d, a.iters)
    dist.barrier()
    t_ag = _timed(ag, s_ag, a.iters)
    torch.cuda.synchronize()
    dist.barrier()
    t_mm = _timed(mm, s_mm, a.iters * 4)
    dist.barrier()
    t_ag_copies = both(ag, s_ag, [(d2h, s_d2h), (h2d, s_h2d)], a.iters)
    torch.cuda.synchronize()
    dist.barrier()
    # the side all-gather loop must run on every rank (a collective): same count everywhere
    t_d2h_ag = both(d2h, s_d2h, [(ag, s_ag)], a.iters)
    torch.cuda.synchronize()
    dist.barrier()
    t_mm_ag = both(mm, s_mm, [(ag, s_ag)], a.iters * 4)
    torch.cuda.synchronize()
    dist.barrier()
    gbs = lambda ms, nb: nb / ms / 1e6  # noqa: E731
    rows = [("pinned D2H alone", t_d2h, gbs(t_d2h, n)), ("pinned H2D alone", t_h2d, gbs(t_h2d, n)),
            ("all-gather alone (GB/s received)", t_ag, gbs(t_ag, n * (world - 1))),
            ("all-gather while D2H + H2D loop", t_ag_copies, gbs(t_ag_copies, n * (world - 1))),
            ("pinned D2H while all-gather loops", t_d2h_ag, gbs(t_d2h_ag, n)),
            ("bf16 GEMM 8192^3 alone (TFLOP/s)", t_mm, 2 * 8192**3 / t_mm / 1e9),
            ("bf16 GEMM while all-gather loops (TFLOP/s)", t_mm_ag, 2 * 8192**3 / t_mm_ag / 1e9)]
    if rank == 0:
        env = {k: v for k, v in os.environ.items() if k.startswith("NCCL_")}
        print(f"world {world}, {torch.cuda.get_device_name(dev)}, torch {torch.__version__}, NCCL "
              f"{'.'.join(map(str, torch.cuda.nccl.version()))}, peer access {peer}, {a.mib} MiB per copy, env {env}")
        print("| what (rank 0, every rank at once) | ms | GB/s |")
        print("|---|---:|---:|")
        for name, ms, rate in rows:
            print(f"| {name} | {ms:.2f} | {rate:.1f} |", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
