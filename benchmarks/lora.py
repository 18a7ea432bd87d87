"""LoRA: step time and activation memory of a Llama with LoRA adapters, activation offload against none.

    python benchmarks/lora.py [--num-layers 8,15] [--policy opt_out,opt_in] [--steps 10] [--warmup 3]
    python benchmarks/lora.py --tiny             # llama-tiny on the CPU in seconds; no claims

The model is the built-in Llama (:class:`annotate_offload.models.Llama`, preset ``llama-1b``; weights
from a seed, nothing downloaded) in bf16 with :func:`annotate_offload.peft.apply_lora` (r=16, alpha=32) on
all seven projections; only the adapters train. Batch 2 x 4096 tokens, loss: next-token cross-entropy on
the inputs, no optimizer step. One model serves every row: the baseline runs it as is; each offload row
applies ``offload_transform`` (``num_layers=N``, the selection ``policy``, ``prefetch_layers=1``), measures,
and ``remove_offload`` restores it. Per row: median step time (CUDA events, after warm-up), activation
memory (peak during a step minus the allocation before it), peak in total, D2H bytes per step, and whether
the loss and every adapter gradient equal the baseline's bit for bit (one extra step under a
bit-reproducible attention backend).
"""

from __future__ import annotations

import argparse
import shlex
import sys
import warnings

import torch
import torch.nn.functional as F

from _timing import StepTimes, bit_exact_context, device_name, fmt_bytes, free_memory, time_steps

from annotate_offload import offload_transform, remove_offload
from annotate_offload.config import ModelConfig
from annotate_offload.models import Llama, LlamaConfig
from annotate_offload.peft import apply_lora

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def _build(preset: str, device, dtype) -> Llama:
    model = Llama(LlamaConfig.from_preset(preset), seed=0, device=device, dtype=dtype)
    torch.manual_seed(0)
    apply_lora(model, TARGETS, r=16, alpha=32.0)
    with torch.no_grad():  # B = 0 would make every A gradient zero, and the exactness check see less
        for name, p in model.named_parameters():
            if name.endswith("lora_B.weight"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(1)).mul_(1e-3).to(p))
    return model.train()


def _loss(model, ids) -> torch.Tensor:
    return F.cross_entropy(model(ids).float().flatten(0, 1), ids.flatten())


def _exact_step(model, ids, device) -> tuple:
    with bit_exact_context(device):
        loss = _loss(model, ids)
        loss.backward()
    grads = {n: p.grad.detach().cpu() for n, p in model.named_parameters() if p.grad is not None}
    model.zero_grad(set_to_none=True)
    return loss.detach().cpu(), grads


def _same(a, b) -> bool:
    return torch.equal(a[0], b[0]) and a[1].keys() == b[1].keys() and all(torch.equal(a[1][k], b[1][k]) for k in a[1])


def run(*, preset: str, batch: int, seq: int, device, dtype, num_layers: list[int], policies: list[str],
        min_offload_numel: int, warmup: int, steps: int, log=lambda s: None) -> list[tuple]:
    """``[(name, N, policy, StepTimes, D2H bytes, exact)]``: the baseline first, then each ``(N, policy)``."""
    model = _build(preset, device, dtype)
    ids = torch.randint(0, model.config.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0)).to(device)

    def measure() -> StepTimes:
        return time_steps(lambda: _loss(model, ids), lambda loss: (loss.backward(), model.zero_grad(set_to_none=True)),
                          device=device, warmup=warmup, steps=steps)

    log(f"baseline ({preset}, {batch} x {seq}, {dtype})")
    reference = _exact_step(model, ids, device)
    rows = [("none", 0, "-", measure(), 0, True)]
    free_memory(device)
    for policy in policies:
        for n in num_layers:
            log(f"offload num_layers={n} policy={policy}")
            cfg = ModelConfig(cpu_offloading=True, cpu_offloading_num_layers=n, offload_policy=policy,
                              prefetch_layers=1, min_offload_numel=min_offload_numel)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                offload_transform(model, config=cfg)
            try:
                exact = _same(_exact_step(model, ids, device), reference)
                times = measure()
                rows.append(("offload", n, policy, times, model.offload_plan.stats.bytes_offloaded, exact))
            finally:
                remove_offload(model)
                free_memory(device)
    return rows


def format_table(rows: list[tuple], header: str) -> str:
    base = rows[0][3]
    lines = [header, "", "| method | N | policy | step ms | vs none | act. mem | vs none | peak total | D2H/step | exact |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, n, policy, t, moved, exact in rows:
        mem = f"{t.peak_bytes / base.peak_bytes:.2f}x" if t.peak_bytes is not None and base.peak_bytes else "-"
        lines.append(f"| {name} | {n} | {policy} | {t.step:.1f} | {t.step / base.step:.2f}x | {fmt_bytes(t.peak_bytes)} | "
                     f"{mem} | {fmt_bytes(t.peak_total_bytes)} | {fmt_bytes(moved)} | {'yes' if exact else '**NO**'} |")
    return "\n".join(lines) + "\n"


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r}: give comma-separated integers, e.g. 8,15") from None


def main(argv=None) -> int:
    """Print the table; exit status 1 when a row is not bit-exact, 2 for bad arguments."""
    p = argparse.ArgumentParser(prog="python benchmarks/lora.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--tiny", action="store_true", help="llama-tiny in fp32 on the CPU, 2 x 64 tokens; no claims")
    p.add_argument("--num-layers", type=_ints, help="offloaded layer counts N (default: L/2 and L-1)")
    p.add_argument("--policy", default="opt_out", help="selection policies: opt_out, opt_in or both (default: opt_out)")
    p.add_argument("--warmup", type=int, help="untimed steps per row (default: 3, tiny: 1)")
    p.add_argument("--steps", type=int, help="timed steps per row, median reported (default: 10, tiny: 2)")
    args = p.parse_args(argv)
    preset = "llama-tiny" if args.tiny else "llama-1b"
    layers = LlamaConfig.from_preset(preset).num_layers
    policies = [v.strip() for v in args.policy.split(",") if v.strip()]
    warmup = (1 if args.tiny else 3) if args.warmup is None else args.warmup
    steps = (2 if args.tiny else 10) if args.steps is None else args.steps
    num_layers = args.num_layers or sorted({layers // 2, layers - 1})
    if not policies or any(v not in ("opt_out", "opt_in") for v in policies):
        p.error(f"--policy {args.policy!r}: use opt_out, opt_in or both (comma-separated)")
    if steps < 1 or warmup < 0 or any(not 0 <= n < layers for n in num_layers):
        p.error(f"need --steps >= 1, --warmup >= 0 and 0 <= --num-layers < {layers}")
    if not args.tiny and not torch.cuda.is_available():
        p.error("no CUDA device here; pass --tiny for the CPU smoke run")
    if args.tiny:
        torch.set_num_threads(1)
    device, dtype = torch.device("cpu" if args.tiny else "cuda"), torch.float32 if args.tiny else torch.bfloat16
    batch, seq = 2, 64 if args.tiny else 4096
    rows = run(preset=preset, batch=batch, seq=seq, device=device, dtype=dtype, num_layers=num_layers, policies=policies,
               min_offload_numel=0 if args.tiny else 256 * 1024, warmup=warmup, steps=steps,
               log=lambda s: print(s, file=sys.stderr, flush=True))
    command = shlex.join(["python", "benchmarks/lora.py", *(sys.argv[1:] if argv is None else argv)])
    header = (f"# LoRA offload\n\n{preset} ({layers} layers), batch {batch} x {seq} tokens, {str(dtype)[6:]}, LoRA r=16 "
              f"alpha=32 on {','.join(TARGETS)}; {device_name(device)}, torch {torch.__version__}; `{command}`"
              + ("\n\n--tiny: CPU smoke run; the numbers carry no claim." if args.tiny else ""))
    print(format_table(rows, header))
    return 0 if all(r[5] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
