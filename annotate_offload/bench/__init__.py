"""Benchmarks of issue 7: ``annotate-offload bench [activations|optimizer|all] ...``.

``main(argv)`` is what the ``annotate-offload bench`` CLI and ``python -m annotate_offload.bench``
call. ``activations`` runs W1 (PCIe-bound) and W2 (compute-bound) of
:mod:`annotate_offload.bench.activations`; ``optimizer`` hands its arguments to
``annotate_offload.bench.optimizer.main`` (W3); ``all`` runs both. Importing this package does
not initialise CUDA.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import os
import shlex
import sys

__all__ = ["main", "BenchUsageError"]


class BenchUsageError(ValueError):
    """Bad ``bench`` arguments, or a run this machine cannot do (no GPU); raised before anything runs.

    ``annotate-offload bench`` prints it as one line and exits with status 2.
    """


def _csv(values: str, convert, flag: str = "") -> list:
    out = []
    for item in values.split(","):
        item = item.strip()
        if not item:
            continue
        try:
            out.append(None if item.lower() == "none" else convert(item))
        except ValueError:
            raise BenchUsageError(f"bench: {flag} {values!r}: {item!r} is not an integer; "
                                  f"give comma-separated integers or 'none', e.g. {flag} 0,1.") from None
    return out


def _parser(prog: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=prog, description="Benchmarks: activation offload (W1 PCIe-bound, W2 compute-bound) and optimizer offload (W3).")
    p.add_argument("what", nargs="?", default="all", choices=("activations", "optimizer", "all"),
                   help="which suite to run (default: all)")
    p.add_argument("--tiny", action="store_true", help="tiny shapes on CPU in seconds, for CI (no timing claims)")
    p.add_argument("--out", metavar="DIR", help="also write activations.md and activations.png (and --profile files) here")
    p.add_argument("--workloads", default="W1,W2", help="comma-separated activation workloads (default: W1,W2)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda, or cpu with --tiny")
    p.add_argument("--warmup", type=int, help="untimed steps per method (default: 3, tiny: 1)")
    p.add_argument("--steps", type=int, help="timed steps per method, median reported (default: 10, tiny: 2)")
    p.add_argument("--release-lag", default="0,1", help="release_lag values to try, comma-separated, 'none' = TE schedule (default: 0,1)")
    p.add_argument("--prefetch-layers", default="1,2", help="prefetch_layers values to try, comma-separated (default: 1,2)")
    p.add_argument("--profile", action="store_true", help="torch.profiler table + trace of one step of the fastest annotate_offload setting (into --out, default ./out/bench, git-ignored)")
    p.add_argument("--no-png", action="store_true", help="skip the matplotlib chart")
    return p


def _positive(name: str, value, default: int) -> int:
    if value is None:
        return default
    if value < 0 or (name == "--steps" and value < 1):
        raise BenchUsageError(f"bench: {name} must be {'>= 1' if name == '--steps' else '>= 0'}, got {value}.")
    return value


def _device(args):
    import torch

    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        if args.tiny:  # --tiny was given: the CUDA device is what cannot be had
            raise BenchUsageError("bench: --device cuda but no CUDA device here; drop --device (--tiny runs on the CPU).")
        raise BenchUsageError("bench: no CUDA device here; pass --tiny for the CPU smoke run "
                              "(or --device cpu for full-size shapes on the CPU, slow).")
    return device


def _run_activations(args, command: str) -> int:
    from annotate_offload.bench import _report
    from annotate_offload.bench.activations import run_workload, workloads_for

    device = _device(args)
    try:
        workloads = workloads_for(_csv(args.workloads, str), args.tiny)
    except BenchUsageError:
        raise
    except ValueError as exc:  # an unknown workload name
        raise BenchUsageError(str(exc)) from None
    lags = _csv(args.release_lag, int, "--release-lag")
    prefetch = _csv(args.prefetch_layers, int, "--prefetch-layers")
    if any(v is not None and v < 0 for v in lags):
        raise BenchUsageError(f"bench: --release-lag values must be >= 0 or 'none', got {args.release_lag!r}.")
    if any(v is not None and v < 1 for v in prefetch):
        raise BenchUsageError(f"bench: --prefetch-layers values must be >= 1 or 'none', got {args.prefetch_layers!r}.")
    warmup = _positive("--warmup", args.warmup, 1 if args.tiny else 3)
    steps = _positive("--steps", args.steps, 2 if args.tiny else 10)
    out_dir = args.out or (os.path.join("out", "bench") if args.profile else None)
    log = lambda msg: print(msg, file=sys.stderr, flush=True)  # noqa: E731  (table goes to stdout)
    reports, bandwidth = [], None
    for workload in workloads:
        report = run_workload(
            workload,
            device=device,
            tiny=args.tiny,
            command=command,
            warmup=warmup,
            steps=steps,
            release_lags=lags or [None],
            prefetch_layers=prefetch or [None],
            bandwidth=bandwidth,
            profile_dir=out_dir if args.profile else None,
            log=log,
        )
        bandwidth = report.bandwidth
        reports.append(report)
    text = "# annotate_offload activation benchmark (issue 7)\n\n" + "\n".join(_report.format_report(r) for r in reports)
    print(text)
    if out_dir:
        os.makedirs(out_dir, exist_ok=True)
        with open(os.path.join(out_dir, "activations.md"), "w") as f:
            f.write(text)
        if not args.no_png:
            png = os.path.join(out_dir, "activations.png")
            if not _report.write_png(reports, png):
                log("bench: matplotlib not importable; no PNG written")
    return 0


class _Tee(io.TextIOBase):
    def __init__(self, *streams) -> None:
        self.streams = streams

    def write(self, text: str) -> int:
        for s in self.streams:
            s.write(text)
        return len(text)

    def flush(self) -> None:
        for s in self.streams:
            s.flush()


def _run_optimizer(argv: list, out_dir: str | None = None) -> int:
    try:
        from annotate_offload.bench import optimizer
    except ImportError as exc:
        print(f"bench optimizer: annotate_offload.bench.optimizer is not importable ({exc}); skipped.", file=sys.stderr)
        return 0
    if out_dir is None:
        return int(optimizer.main(argv) or 0)
    captured = io.StringIO()  # its table goes to stdout; keep a copy as DIR/optimizer.md
    with contextlib.redirect_stdout(_Tee(sys.stdout, captured)):
        rc = optimizer.main(argv)
    os.makedirs(out_dir, exist_ok=True)
    with open(os.path.join(out_dir, "optimizer.md"), "w") as f:
        f.write(captured.getvalue())
    return int(rc or 0)


def main(argv=None, prog: str = "annotate-offload bench") -> int:
    """Run the benchmarks; returns the exit status.

    Args:
        argv (list[str] | None): arguments after ``bench`` (default: ``sys.argv[1:]``), e.g.
            ``["activations", "--tiny", "--out", "bench_out"]``. For ``optimizer`` every argument
            after it is passed to ``annotate_offload.bench.optimizer.main`` unchanged; ``all``
            passes it ``--tiny`` when given and, with ``--out DIR``, also saves its table as
            ``DIR/optimizer.md``.
        prog (str): program name shown in help and in the reports' command line.

    Returns:
        int: 0 on success.

    Raises:
        SystemExit: on ``--help`` or unparsable arguments (argparse).
        BenchUsageError: (a ValueError) an unknown workload, a negative step count or knob
            value, or a CUDA run without a CUDA device; raised before anything runs.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    command = " ".join([prog, shlex.join(argv)]).strip()
    if argv and argv[0] == "optimizer":
        return _run_optimizer(argv[1:])
    args = _parser(prog).parse_args(argv)
    if args.what in ("activations", "all"):
        _device(args)  # before the optimizer suite of "all" has run for minutes
    rc = 0
    if args.what in ("activations", "all"):
        rc = _run_activations(args, command)
    if args.what in ("optimizer", "all"):
        rc = rc or _run_optimizer(["--tiny"] if args.tiny else [], args.out)
    return rc
