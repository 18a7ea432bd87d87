"""LoRA benchmark (issue 5): peak memory and step time of a small Llama with LoRA, offload vs none.

The model is the built-in Llama (:mod:`annotate_offload.models.llama`, a preset, weights from a
seed: nothing is downloaded) with :func:`annotate_offload.peft.apply_lora` on the chosen linear
layers, in bf16 by default (base and adapters; only the adapters train). One model object serves
every row: the baseline runs it as is; each offload row applies
``apply_offload_marks`` + ``offload_transform(num_layers=N, policy=...)``, measures, and
``remove_offload`` restores it.

Per row: median step time (forward + backward of the LM loss, no optimizer step; CUDA events,
after warm-up), activation memory (peak allocated during a step minus the allocation before it),
peak allocated in total, D2H bytes per step from the runtime's ``OffloadStats``, and whether the
loss and every adapter gradient are bit-identical to the baseline's (one extra step per row with a
bit-reproducible SDPA backend on CUDA: memory-efficient attention, see DESIGN.md "Devices and
tests"; timed steps keep the default backend).

Run on a GPU: ``python -m annotate_offload.bench.lora`` (llama-1b, batch 2 x 4096 tokens, LoRA
r=16 on all seven projections, N in {8, 15}, opt-out); ``--tiny`` is a CPU smoke run that makes
no timing or memory claims.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
import warnings
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

from annotate_offload.bench._timing import GiB, StepTimes, free_memory, time_steps

__all__ = ["LoraRow", "run", "format_table", "main"]

_ALL = "q_proj,k_proj,v_proj,o_proj,gate_proj,up_proj,down_proj"


@dataclass
class LoraRow:
    """One line of the table.

    Attributes:
        name (str): ``"none"`` or ``"offload"``.
        num_layers (int): layers offloaded (0 for the baseline).
        policy (str): selection policy (``"-"`` for the baseline).
        times (StepTimes): measurements (memory fields are ``None`` on CPU).
        offloaded_bytes (int): D2H bytes per step, in bytes (runtime stats).
        exact (bool | None): loss and adapter gradients bit-identical to the baseline's.
    """

    name: str
    num_layers: int
    policy: str
    times: StepTimes
    offloaded_bytes: int = 0
    exact: Optional[bool] = None


def _sdpa_exact(device: torch.device):
    """A bit-reproducible backend for the exactness step (annotate_offload.testing on CUDA)."""
    if device.type != "cuda":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        return sdpa_kernel(SDPBackend.MATH)
    from annotate_offload.testing import bit_reproducible

    return bit_reproducible()


def _build(preset: str, device: torch.device, dtype: torch.dtype, targets: list[str], r: int, alpha: float):
    from annotate_offload.models.llama import Llama, LlamaConfig
    from annotate_offload.peft import apply_lora

    model = Llama(LlamaConfig.from_preset(preset), seed=0, device=device, dtype=dtype)
    torch.manual_seed(0)
    apply_lora(model, targets, r=r, alpha=alpha)
    with torch.no_grad():  # B = 0 would make every A gradient zero: the exactness check would see less
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).mul_(1e-3).to(p))
    return model.train()


def _loss(model, ids: torch.Tensor) -> torch.Tensor:
    logits = model(ids)
    return F.cross_entropy(logits.float().flatten(0, 1), ids.flatten())


def _exact_step(model, ids: torch.Tensor, device: torch.device) -> tuple:
    with _sdpa_exact(device):
        loss = _loss(model, ids)
        loss.backward()
    grads = {n: p.grad.detach().to("cpu", copy=True) for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach().cpu(), grads


def _same(a: tuple, b: tuple) -> bool:
    return torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def run(
    *,
    preset: str,
    batch: int,
    seq: int,
    device: torch.device,
    dtype: torch.dtype,
    targets: list[str],
    r: int,
    alpha: float,
    num_layers: list[int],
    policies: list[str],
    prefetch_layers: Optional[int],
    release_lag: Optional[int],
    min_offload_numel: Optional[int],
    warmup: int,
    steps: int,
    log=lambda msg: None,
) -> list[LoraRow]:
    """Measure the baseline and every ``(N, policy)`` offload setting on one LoRA Llama.

    Returns:
        list[LoraRow]: the baseline first, then one row per setting.

    Raises:
        ValueError: from ``offload_transform`` for an ``N`` out of ``[0, L)``, or from the model
            config for a bad preset or ``seq > max_seq_len``.
    """
    from annotate_offload.annotate import offload_transform, remove_offload
    from annotate_offload.peft import apply_offload_marks

    model = _build(preset, device, dtype, targets, r, alpha)
    if seq > model.config.max_seq_len:
        raise ValueError(f"bench lora: --seq {seq} exceeds the preset's max_seq_len={model.config.max_seq_len}.")
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)

    def measure() -> StepTimes:
        return time_steps(lambda: _loss(model, ids), lambda loss: (loss.backward(), model.zero_grad(set_to_none=True)),
                          device=device, warmup=warmup, steps=steps)

    log(f"bench lora: baseline ({preset}, {batch}x{seq}, {dtype}, r={r})")
    reference = _exact_step(model, ids, device)
    rows = [LoraRow("none", 0, "-", measure())]
    free_memory(device)
    marks = apply_offload_marks(model)
    for policy in policies:
        for n in num_layers:
            log(f"bench lora: offload num_layers={n} policy={policy}")
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")  # N = L-1 schedule warning: prefetch_layers is set
                offload_transform(model, num_layers=n, policy=policy, prefetch_layers=prefetch_layers,
                                  release_lag=release_lag, min_offload_numel=min_offload_numel)
            try:
                exact = _same(_exact_step(model, ids, device), reference)
                times = measure()
                sync = model.__dict__["_annotate_offload_state"].boundary.sync
                rows.append(LoraRow("offload", n, policy, times, sync.stats.bytes_offloaded, exact))
            finally:
                remove_offload(model)
                free_memory(device)
    marks.remove()
    return rows


def _gib(v: Optional[int]) -> str:
    return "-" if v is None else f"{v / GiB:.2f}"


def format_table(rows: list[LoraRow], *, header: str) -> str:
    """Markdown: a header block, then one line per row; ratios are relative to the baseline."""
    base = rows[0].times
    lines = [header, "",
             "| method | N | policy | step ms | vs none | activation GiB | vs none | peak total GiB | D2H MiB/step | exact |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for row in rows:
        t = row.times
        mem_ratio = "-" if (t.peak_bytes is None or not base.peak_bytes) else f"{t.peak_bytes / base.peak_bytes:.2f}x"
        exact = "-" if row.exact is None else ("yes" if row.exact else "**NO**")
        lines.append(
            f"| {row.name} | {row.num_layers} | {row.policy} | {t.step:.1f} | {t.step / base.step:.2f}x | "
            f"{_gib(t.peak_bytes)} | {mem_ratio} | {_gib(t.peak_total_bytes)} | {row.offloaded_bytes / 2**20:.1f} | {exact} |"
        )
    return "\n".join(lines) + "\n"


def _csv_ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m annotate_offload.bench.lora",
                                description="LoRA Llama: peak memory and step time, activation offload vs none.")
    p.add_argument("--tiny", action="store_true", help="llama-tiny on CPU, 2x64 tokens, seconds; no claims")
    p.add_argument("--preset", help="annotate_offload.models.llama preset (default: llama-1b; tiny: llama-tiny)")
    p.add_argument("--batch", type=int, help="sequences per step (default: 2)")
    p.add_argument("--seq", type=int, help="tokens per sequence (default: 4096; tiny: 64)")
    p.add_argument("--dtype", choices=("bfloat16", "float32"), help="parameter dtype (default: bfloat16; tiny: float32)")
    p.add_argument("--targets", default=_ALL, help=f"LoRA target modules, comma-separated (default: {_ALL})")
    p.add_argument("--r", type=int, default=16, help="LoRA rank (default: 16)")
    p.add_argument("--alpha", type=float, default=32.0, help="LoRA alpha (default: 32)")
    p.add_argument("--num-layers", help="offloaded layer counts N, comma-separated (default: L/2 and L-1)")
    p.add_argument("--policy", default="opt_out", help="selection policies, comma-separated: opt_out,opt_in (default: opt_out)")
    p.add_argument("--prefetch-layers", type=int, default=1, help="runtime reload look-ahead (default: 1)")
    p.add_argument("--release-lag", type=int, help="runtime release lag (default: TE's bound)")
    p.add_argument("--min-offload-numel", type=int, help="runtime size threshold in elements (default: 262144; tiny: 0)")
    p.add_argument("--warmup", type=int, help="untimed steps per row (default: 3; tiny: 1)")
    p.add_argument("--steps", type=int, help="timed steps per row, median reported (default: 10; tiny: 2)")
    p.add_argument("--device", choices=("cuda", "cpu"), help="default: cuda, or cpu with --tiny")
    p.add_argument("--out", metavar="FILE", help="also write the markdown table here")
    return p


def main(argv: Optional[list] = None) -> int:
    """Run the benchmark and print the markdown table; returns 0, or 1 when a row is not bit-exact.

    Raises:
        SystemExit: on ``--help`` or unparsable arguments (argparse).
        ValueError: a bad preset, policy, count or step number, or a CUDA run without a GPU.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    args = _parser().parse_args(argv)
    from annotate_offload.models.llama import LlamaConfig

    device = torch.device(args.device or ("cpu" if args.tiny else "cuda"))
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ValueError("bench lora: no CUDA device here; pass --tiny for the CPU smoke run.")
    preset = args.preset or ("llama-tiny" if args.tiny else "llama-1b")
    layers = LlamaConfig.from_preset(preset).num_layers
    num_layers = _csv_ints(args.num_layers) if args.num_layers else sorted({layers // 2, layers - 1})
    policies = [p.strip() for p in args.policy.split(",") if p.strip()]
    bad = [p for p in policies if p not in ("opt_out", "opt_in")]
    if bad or not policies:
        raise ValueError(f"bench lora: --policy {args.policy!r}: use opt_out, opt_in or both (comma-separated).")
    for name, value in (("--batch", args.batch), ("--seq", args.seq), ("--steps", args.steps), ("--r", args.r)):
        if value is not None and value < 1:
            raise ValueError(f"bench lora: {name} must be >= 1, got {value}.")
    if args.warmup is not None and args.warmup < 0:
        raise ValueError(f"bench lora: --warmup must be >= 0, got {args.warmup}.")
    dtype = getattr(torch, args.dtype or ("float32" if args.tiny else "bfloat16"))
    batch, seq = args.batch or 2, args.seq or (64 if args.tiny else 4096)
    targets = [t.strip() for t in args.targets.split(",") if t.strip()]
    rows = run(preset=preset, batch=batch, seq=seq, device=device, dtype=dtype, targets=targets, r=args.r,
               alpha=args.alpha, num_layers=num_layers, policies=policies, prefetch_layers=args.prefetch_layers,
               release_lag=args.release_lag,
               min_offload_numel=args.min_offload_numel if args.min_offload_numel is not None else (0 if args.tiny else None),
               warmup=args.warmup if args.warmup is not None else (1 if args.tiny else 3),
               steps=args.steps or (2 if args.tiny else 10), log=lambda m: print(m, file=sys.stderr, flush=True))
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    header = (f"# LoRA offload benchmark (issue 5)\n\n{preset} ({layers} layers), batch {batch} x {seq} tokens, "
              f"{str(dtype).replace('torch.', '')}, LoRA r={args.r} alpha={args.alpha:g} on {','.join(targets)}; "
              f"device {gpu}, torch {torch.__version__}.\n"
              f"Command: `{shlex.join(['python', '-m', 'annotate_offload.bench.lora', *argv])}`"
              + ("\n\n--tiny: CPU smoke run, the numbers carry no claim." if args.tiny else ""))
    text = format_table(rows, header=header)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0 if all(r.exact is not False for r in rows) else 1


if __name__ == "__main__":
    with contextlib.suppress(BrokenPipeError):
        sys.exit(main())
