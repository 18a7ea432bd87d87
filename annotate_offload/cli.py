"""``annotate-offload train | plan``: the command users install this package for.

``train --recipe NAME [section.field=value ...]`` trains with offloading, then (by default) the same
steps without it, and prints losses, max ``|Δloss|``, peak memory, step time and bytes offloaded.
Parity (exit status 1 when it fails): identical losses with activation offload only,
``|Δloss| < 0.001`` with optimizer offload (Megatron Bridge's criterion). Bad input prints one line
saying what is wrong and what is valid, and exits with status 2 before anything runs or is written.
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
from typing import Optional, Sequence

import torch

from . import _recipes as _train
from ._recipes import RECIPES, check_runnable, get_recipe
from .config import Config, from_overrides

__all__ = ["main"]

PROG = "annotate-offload"


class _UsageError(Exception):
    """Bad user input: printed as one line, exit status 2."""


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # one line, status 2 (argparse's default prints usage too)
        raise _UsageError(f"{message} (see {self.prog} --help)")


def _add_common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", default="llama-tiny", metavar="NAME",
                   help=f"one of: {', '.join(RECIPES)} (default: llama-tiny)")
    p.add_argument("overrides", nargs="*", metavar="section.field=value",
                   help="Megatron Bridge style overrides, e.g. model.cpu_offloading_num_layers=2 "
                        "optimizer.optimizer_offload_fraction=1.0 train.train_iters=50")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"),
                   help="auto: cuda when available, else cpu (default: auto)")


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``annotate-offload`` (subcommands ``train``, ``plan``)."""
    parser = _Parser(prog=PROG, description="Activation and optimizer offloading to host memory: train, plan.")
    sub = parser.add_subparsers(dest="command", metavar="{train,plan}", parser_class=_Parser, required=True)
    recipes = "\n".join(f"  {r.name:<11} {r.summary}" for r in RECIPES.values())
    train = sub.add_parser("train", help="train a recipe with offloading and compare with a baseline",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           description=f"recipes:\n{recipes}")
    _add_common(train)
    train.add_argument("--data", metavar="PATH", help="train on this text file (default: CPython's documentation topics)")
    train.add_argument("--compare-baseline", action=argparse.BooleanOptionalAction, default=True,
                       help="also run the same steps without offloading and check parity (default: on)")
    train.add_argument("--compare-strategies", action="store_true",
                       help="with model.memory_budget: also run full activation checkpointing and offload-only, "
                            "each with the optimizer fraction the planner finds it needs to fit")
    train.add_argument("--rounds", type=int, default=1, metavar="N",
                       help="run every method N times, each round in an order rotated by one; step times are "
                            "the median over rounds (default: 1)")
    train.add_argument("--plot", metavar="OUT.png", help="draw device memory over one step and both loss curves")
    train.add_argument("--progress", action=argparse.BooleanOptionalAction, default=True,
                       help="tqdm progress bar when tqdm is installed (default: on)")
    train.add_argument("--sdpa-backend", default="efficient", choices=("efficient", "math", "default"),
                       help="CUDA attention kernel (default: efficient). 'efficient' (memory-efficient) and "
                            "'math' are bit-reproducible; 'default' lets torch pick, usually flash or cuDNN, "
                            "which are not, so the loss parity check needs one of the first two")
    _add_common(sub.add_parser("plan", help="print the offload plan and predicted memory without training"))
    return parser


def _resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise _UsageError("--device cuda but no CUDA GPU is available; use --device cpu or auto.")
    return torch.device(name)


def _check_offload_layers(cfg: Config, recipe) -> None:
    """A recipe has no ``num_layers=`` argument to fall back on: activation offload needs the count or a budget."""
    m = cfg.model
    if m.cpu_offloading and m.cpu_offloading_num_layers is None and m.memory_budget is None:
        layers = m.num_layers or recipe.config.model.num_layers
        raise _UsageError(
            f"model.cpu_offloading_num_layers=None with model.cpu_offloading=True: give a number "
            f"0..{layers - 1} (e.g. model.cpu_offloading_num_layers={max(layers - 1, 0)}) or a memory budget "
            f"(e.g. model.memory_budget=20GiB), or set model.cpu_offloading=False.")


def _load_config(args: argparse.Namespace, *, train: bool = True) -> tuple[object, Config, torch.device]:
    try:
        recipe = get_recipe(args.recipe)
        cfg = from_overrides(args.overrides, base=recipe.config)
        device = _resolve_device(args.device)
        check_runnable(recipe, device, train=train)
    except (ValueError, TypeError) as exc:
        raise _UsageError(str(exc)) from None
    _check_offload_layers(cfg, recipe)
    return recipe, cfg, device


def _check_plot_target(path: Optional[str]) -> None:
    if path is None:
        return
    if importlib.util.find_spec("matplotlib") is None:
        raise _UsageError("--plot needs matplotlib; pip install 'annotate-offload[cli]', or drop --plot.")
    parent = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(parent):
        raise _UsageError(f"--plot {path!r}: folder {parent!r} does not exist; create it or choose another path.")
    if not path.lower().endswith((".png", ".pdf", ".svg")):
        raise _UsageError(f"--plot {path!r}: use a .png, .pdf or .svg file name.")
    # open it now, not after the run: a folder that exists but cannot be written (read-only, /proc)
    # would otherwise lose the whole training to a traceback at the end
    existed = os.path.lexists(path)
    try:
        with open(path, "ab"):
            pass
    except OSError as exc:
        raise _UsageError(f"--plot {path!r} cannot be written ({exc.strerror or exc}); "
                          f"choose a writable path, or drop --plot.") from None
    finally:
        if not existed and os.path.lexists(path):
            os.remove(path)


def _cmd_train(args: argparse.Namespace) -> int:
    recipe, cfg, device = _load_config(args)
    try:
        batches = _train.make_batches(cfg, args.data)
    except ValueError as exc:
        raise _UsageError(str(exc)) from None
    _check_plot_target(args.plot)
    if args.rounds < 1:
        raise _UsageError(f"--rounds {args.rounds}: give at least 1.")
    if args.compare_strategies and (cfg.model.memory_budget is None or not cfg.model.cpu_offloading):
        raise _UsageError("--compare-strategies sizes the strategies for model.memory_budget; set one "
                          "(e.g. model.memory_budget=20GiB), or drop --compare-strategies.")
    report = _train.compare(recipe, cfg, device, batches, baseline=args.compare_baseline, rounds=args.rounds,
                            compare_strategies=args.compare_strategies, progress=args.progress,
                            sdpa_backend=args.sdpa_backend)
    print(report.table())
    if args.plot:
        report.plot(args.plot)
        print(f"wrote {args.plot}")
    if not report.ok:
        print(f"{PROG}: parity check failed: {report.verdict}", file=sys.stderr)
        return 1
    return 0


def _cmd_plan(args: argparse.Namespace) -> int:
    print(_train.plan_text(*_load_config(args, train=False)))  # a plan trains nothing: any device will do
    return 0


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Entry point of ``annotate-offload`` and ``python -m annotate_offload``.

    Args:
        argv (Sequence[str] | None): arguments without the program name. Default: ``sys.argv[1:]``.

    Returns:
        int: exit status: ``0`` success, ``1`` parity failure (or the offloaded run failed),
        ``2`` bad input (nothing was run or written).
    """
    try:
        args = build_parser().parse_args(argv)  # None: sys.argv[1:]
        return _cmd_train(args) if args.command == "train" else _cmd_plan(args)
    except _UsageError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
