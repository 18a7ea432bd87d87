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
import time

import torch

from annotate_offload.bench import _peers
from annotate_offload.bench.optimizer import _FULL, _TINY, _Clock, _free, _loss
from annotate_offload.models.gpt import GPTStack
from annotate_offload.optim import HybridDeviceOptimizer, _pipeline
from annotate_offload.optim._phases import StepPhases


class _Stamps:
    """Where one training step's time goes: CUDA events on the compute stream (GPU side) and
    ``perf_counter`` on the training thread (host side), at loss start, backward end and step end."""

    def __init__(self, dev: torch.device) -> None:
        self.cuda = dev.type == "cuda"
        self.ev: list = []
        self.t: list[float] = []

    def mark(self) -> None:
        self.t.append(time.perf_counter())
        if self.cuda:
            e = torch.cuda.Event(enable_timing=True)
            e.record()
            self.ev.append(e)

    def gpu_ms(self, i: int) -> float:
        return self.ev[i].elapsed_time(self.ev[i + 1]) if self.cuda else float("nan")

    def host_ms(self, i: int) -> float:
        return (self.t[i + 1] - self.t[i]) * 1e3


def _alloc_counts(dev: torch.device) -> tuple[int, int, int]:
    """The caching allocator's cudaMalloc / cudaFree / retry counters (0 on CPU)."""
    if dev.type != "cuda":
        return (0, 0, 0)
    m = torch.cuda.memory_stats(dev)
    return (m.get("num_device_alloc", 0), m.get("num_device_free", 0), m.get("num_alloc_retries", 0))


def _split(stamps: list, mem0: tuple, mem1: tuple) -> str:
    """Median phase columns over the timed steps (ms), then the allocator counters' growth."""
    med = lambda xs: statistics.median(xs) if xs else float("nan")  # noqa: E731
    cols = [med([s.gpu_ms(0) for s, _ in stamps]), med([s.gpu_ms(1) for s, _ in stamps]),
            med([s.host_ms(0) for s, _ in stamps]), med([s.host_ms(1) for s, _ in stamps])]
    sums = [ph.summary() for _, ph in stamps if ph is not None]
    cols += [med([p[k] for p in sums]) for k in ("d2h_wait_ms", "host_busy_ms", "first_chunk_ms", "last_chunk_ms")]
    cells = [f"{c:.1f}" for c in cols]
    cells.append(" / ".join(str(b - a) for a, b in zip(mem0, mem1)))
    return " | ".join(cells)


_SPANS: list = []  # (t_in, t0, t1, t_end) of each host chunk, perf_counter seconds


def _record_spans() -> None:
    """Keep each chunk's span: ``StepPhases.chunk_done`` gets t0, t1, t_end and the wait t0 - t_in."""
    done = StepPhases.chunk_done

    def chunk_done(self, t0, t1, t_end, wait_s, numel):
        _SPANS.append((t0 - wait_s, t0, t1, t_end))
        return done(self, t0, t1, t_end, wait_s, numel)

    StepPhases.chunk_done = chunk_done


def _anatomy(ph, spans: list) -> list[float]:
    """step() split on the host clock (ms): prologue (call -> first chunk picked up), D2H waits,
    host compute, H2D issue, worker idle between chunks, tail (last chunk done -> return)."""
    if ph is None or not spans or ph.t_return is None:
        return [float("nan")] * 7
    spans = sorted(spans)
    idle = sum(max(0.0, b[0] - a[3]) for a, b in zip(spans, spans[1:]))
    return [1e3 * x for x in (spans[0][0] - ph.t_call, sum(s[1] - s[0] for s in spans), sum(s[2] - s[1] for s in spans),
                              sum(s[3] - s[2] for s in spans), idle, ph.t_return - spans[-1][3])] + [float(len(spans))]


def _h2d_batched(opt) -> None:
    """Next experiment of session 8 (not in the package): each chunk's H2D as one copy of its
    contiguous run of masters into a GPU staging buffer, then one ``_foreach_copy_`` scatter on
    the same stream, instead of one ``copy_`` per parameter (F2-F5: 12-17 ms of H2D issue per W3
    exact step, ~45 us per copy under contention). Costs one chunk of GPU memory (64 MiB for W3).
    Chunks that are not one contiguous run of same-dtype masters, chunks stepped in backward and
    delayed mode's skips keep the per-parameter path."""
    h2d, staging = opt._h2d_chunk, {}
    largest = max((sum(s.master.numel() for s in c.slots) for c in opt._chunks), default=0)

    def batched(c, slots, stream, **kw):
        if kw.get("in_backward") or opt._h2d_skip or len(slots) < 2 or any(s.staging is not None for s in slots):
            return h2d(c, slots, stream, **kw)
        first = slots[0].master
        n = 0
        for s in slots:
            m = s.master
            if (m.dtype != first.dtype or not m.is_contiguous() or s.local.dtype != m.dtype
                    or m.data_ptr() != first.data_ptr() + n * first.element_size()):
                return h2d(c, slots, stream, **kw)
            n += m.numel()
        dev = slots[0].local.device
        buf = staging.get(dev)
        if buf is None or buf.numel() < n or buf.dtype != first.dtype:
            buf = staging[dev] = torch.empty(max(n, largest), dtype=first.dtype, device=dev)
        with torch.no_grad(), opt._side.use(stream):
            run = buf[:n]
            run.copy_(first.as_strided((n,), (1,)), non_blocking=True)
            parts = [v.view(s.local.shape) for v, s in zip(run.split([s.local.numel() for s in slots]), slots)]
            torch._foreach_copy_([s.local for s in slots], parts)
            for s in slots:
                s.p_ver = s.param._version
            c.h2d_ev = opt._side.record(stream)

    opt._h2d_chunk = batched


def _drop_version_hooks(opt) -> None:
    """Removes the post-accumulate-grad hooks of Note [Gradient transforms that miss host
    gradients] (one per parameter whose gradient stays on the device), to time what they cost
    the backward (not timed on the GPU before session 9)."""
    from annotate_offload.optim._pipeline import _VersionHook

    kept = []
    for h in opt._hooks:
        d = h.hooks_dict_ref()
        if d is not None and isinstance(d.get(h.id), _VersionHook):
            h.remove()
        else:
            kept.append(h)
    dropped = len(opt._hooks) - len(kept)
    opt._hooks[:] = kept
    print(f"(novh: removed {dropped} version hooks)")


def _h2d_waits_per_parameter(opt) -> None:
    """The H2D issue as it was before Note [H2D ordering]: every chunk's H2D waits on each
    parameter's gradient-ready event, also from step() on (F2: 12-17 ms of H2D issue per exact step)."""
    h2d = opt._h2d_chunk

    def with_waits(c, slots, stream, **kw):
        kw["in_backward"] = True
        return h2d(c, slots, stream, **kw)

    opt._h2d_chunk = with_waits


def _copy_keeping_gpu_grad(opt):
    """``opt._copied`` as if offload_gradients were off: the hook copies but leaves ``p.grad``."""
    copied = opt._copied

    def keep(s, g, stream, **kw) -> None:
        opt._offload_grads = False  # the hook runs while the training thread waits in backward()
        try:
            copied(s, g, stream, **kw)
        finally:
            opt._offload_grads = True

    return keep


def _free_grads_at_step(opt) -> None:
    """offload_gradients, but each GPU gradient lives until step() instead of being dropped (with
    ``record_stream``) by its hook: separates when the gradient is freed from the bookkeeping of
    offloaded gradients (E4: the exact step's host AdamW ran 2.97 vs 3.59 G params/s with and
    without offload_gradients in one bench run)."""
    step = opt.step

    def free_then_step(*a, **k):
        for s in opt._host_slots:
            if s.param.grad is not None and s.copied(s.param.grad):
                s.param.grad = None  # its D2H was enqueued with record_stream in the hook
        return step(*a, **k)

    opt._copied, opt.step = _copy_keeping_gpu_grad(opt), free_then_step


def _free_grads_after_step(opt) -> None:
    """offload_gradients, but each GPU gradient lives until step() has returned (the host step is
    over), then is dropped: with og_late_free (dropped as step() begins) this tells whether E5's
    cost follows the moment the GPU blocks are freed or offload_gradients' bookkeeping."""
    step = opt.step

    def step_then_free(*a, **k):
        out = step(*a, **k)
        for s in opt._host_slots:
            s.param.grad = None
        return out

    opt._copied, opt.step = _copy_keeping_gpu_grad(opt), step_then_free


def _free_grads_after_their_copy(opt) -> None:
    """offload_gradients, but each hook waits for its gradient's D2H before dropping it, so no GPU
    block is ever freed with a copy still reading it (the backward thread stalls at PCIe speed:
    compare host busy, not step ms). With og_late_free this splits E5's cost between blocks freed
    while their copy is pending and offload_gradients' other bookkeeping."""
    keep = _copy_keeping_gpu_grad(opt)

    def wait_then_free(s, g, stream, **kw) -> None:
        keep(s, g, stream, **kw)
        opt._side.synchronize(s.d2h_ev)
        s.param.grad = None

    opt._copied = wait_then_free


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=4)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--only", help="comma-separated: defaults,threads,chunk16,chunk32,chunk16_all,chunk256,both,hookall,fewer,h2d_batched,novh,h2d_waits,og_late_free,og_keep,og_wait_free,noog,sib,sib_fewer,sib_all,sib128,sib256,delayed,delayed_fewer,delayed_all,torchao (default: all)")
    ap.add_argument("--rotate", action="store_true", help="rotate the optimizers' order each round (an order effect "
                    "shows as a variant that is fast only in one position)")
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
        "chunk16": ("annotate_offload exact, chunk_bytes=16 MiB (about one big parameter per chunk, as torchao steps)",
                    ours(chunk_bytes=16 << 20)),
        "chunk32": ("annotate_offload exact, chunk_bytes=32 MiB", ours(chunk_bytes=32 << 20)),
        "chunk16_all": (f"annotate_offload exact, chunk_bytes=16 MiB, cpu_threads={cores}",
                        ours(chunk_bytes=16 << 20, cpu_threads=cores)),
        "chunk256": ("annotate_offload exact, chunk_bytes=256 MiB", ours(chunk_bytes=256 << 20)),
        "both": (f"annotate_offload exact, 256 MiB, cpu_threads={cores}", ours(chunk_bytes=256 << 20, cpu_threads=cores)),
        "hookall": ("annotate_offload exact, a hook per gradient (BATCHED_NUMEL=0)", ours()),
        # the overlapped modes, at the default budget (cores - 1) and with one more core left to the
        # training and autograd threads that launch forward/backward while the host step runs
        "fewer": (f"annotate_offload exact, cpu_threads={fewer}", ours(cpu_threads=fewer)),
        "og_late_free": ("annotate_offload exact, gradients offloaded but freed on the GPU at step(), not in their hook",
                         ours()),
        "h2d_batched": ("annotate_offload exact, one H2D per chunk through a GPU staging buffer + on-device scatter",
                        ours()),
        "novh": ("annotate_offload exact, without the version hooks of the gradients left on the GPU", ours()),
        "h2d_waits": ("annotate_offload exact, per-parameter waits before each H2D (before Note [H2D ordering])", ours()),
        "og_keep": ("annotate_offload exact, gradients offloaded but freed on the GPU after step() returned",
                    ours()),
        "og_wait_free": ("annotate_offload exact, gradients offloaded, each dropped once its D2H has finished",
                         ours()),
        "noog": ("annotate_offload exact, gradients kept on the GPU (offload_gradients=False)", ours(offload_gradients=False)),
        "sib": ("annotate_offload step_in_backward", ours(step_in_backward=True)),
        "sib_fewer": (f"annotate_offload step_in_backward, cpu_threads={fewer}", ours(step_in_backward=True, cpu_threads=fewer)),
        "sib_all": (f"annotate_offload step_in_backward, cpu_threads={cores}", ours(step_in_backward=True, cpu_threads=cores)),
        "sib128": ("annotate_offload step_in_backward, chunk_bytes=128 MiB", ours(step_in_backward=True, chunk_bytes=128 << 20)),
        "sib256": ("annotate_offload step_in_backward, chunk_bytes=256 MiB (delayed mode's default)",
                   ours(step_in_backward=True, chunk_bytes=256 << 20)),
        "delayed": ("annotate_offload delayed_param_update", ours(delayed_param_update=True)),
        "delayed_all": (f"annotate_offload delayed_param_update, cpu_threads={cores}",
                        ours(delayed_param_update=True, cpu_threads=cores)),
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
    print("| round | optimizer | ms/step | host AdamW ms/step | GPU fwd+bwd | step() on GPU | backward() call | step() call "
          "| D2H wait | host busy | first chunk | last chunk | cudaMalloc / cudaFree / retries |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|")
    _record_spans()
    anat: list[str] = []
    order = list(makers.items())
    for r in range(a.rounds):
        if a.rotate and r:
            order = order[1:] + order[:1]
        for name, make in order:
            _free(dev)
            # Note [Tiny gradients at step()]: the "hookall" variant restores the hook per tiny gradient
            _pipeline.BATCHED_NUMEL = 0 if "BATCHED_NUMEL=0" in name else batched_default
            opt = make()
            if opt is None:
                print(f"| {r} | {name} | not importable |")
                continue

            stamps: list = []
            parts: list = []

            if "freed on the GPU at step()" in name:
                _free_grads_at_step(opt)
            if "one H2D per chunk through a GPU staging buffer" in name:
                _h2d_batched(opt)
            if "without the version hooks" in name:
                _drop_version_hooks(opt)
            if "per-parameter waits before each H2D" in name:
                _h2d_waits_per_parameter(opt)
            if "freed on the GPU after step() returned" in name:
                _free_grads_after_step(opt)
            if "dropped once its D2H has finished" in name:
                _free_grads_after_their_copy(opt)

            def step() -> None:
                st = _Stamps(dev)
                st.mark()
                _loss(model, x, dev).backward()
                st.mark()
                _SPANS.clear()
                opt.step()
                st.mark()
                ph = getattr(opt, "_last_ph", None)
                parts.append(_anatomy(ph, list(_SPANS)))
                opt.zero_grad()
                stamps.append((st, ph))

            for _ in range(a.warmup):
                step()
            stamps.clear()
            parts.clear()
            mem0 = _alloc_counts(dev)
            ms = clock.time(step, a.steps)
            mem1 = _alloc_counts(dev)
            times[name].append(ms)
            if parts and parts[-1][-1] == parts[-1][-1]:  # not nan: a host-chunk optimizer
                med = [statistics.median(p[i] for p in parts) for i in range(7)]
                anat.append(f"| {r} | {name} | " + " | ".join(f"{v:.1f}" for v in med[:6]) + f" | {med[6]:.0f} |")
            host = getattr(opt, "host_step_seconds", float("nan")) * 1e3  # the last step's
            print(f"| {r} | {name} | {ms:.1f} | {host:.1f} | {_split(stamps, mem0, mem1)} |", flush=True)
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
    print("\nstep() on the host clock, median ms over the timed steps: prologue = step() call to the first chunk "
          "picked up; idle = the worker between chunks; tail = last chunk done to step() return")
    print("| round | optimizer | prologue | D2H waits | host compute | H2D issue | idle | tail | chunks |\n"
          "|---|---|---:|---:|---:|---:|---:|---:|---:|")
    print("\n".join(anat))
    print("\n| optimizer | median ms/step | min | max |\n|---|---:|---:|---:|")
    for name, t in times.items():
        if t:
            print(f"| {name} | {statistics.median(t):.1f} | {min(t):.1f} | {max(t):.1f} |")


if __name__ == "__main__":
    main()
