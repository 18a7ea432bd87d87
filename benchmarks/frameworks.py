"""Frameworks: a 1.1B Hugging Face Llama trained through Trainer, accelerate, Lightning and TRL's SFTTrainer.

    python benchmarks/frameworks.py [--steps 4] [--warmup 2] [--num-layers 11] [--batch 4] [--seq 2048]
    python benchmarks/frameworks.py --tiny       # a tiny Llama on the CPU in a minute; no claims

The model is ``LlamaForCausalLM`` from a TinyLlama-1.1B-shaped ``LlamaConfig`` (22 layers, hidden 2048, GQA
32/4 heads, vocabulary 32000; weights from a seed, nothing downloaded), fp32 weights under bf16 autocast
(each framework's bf16 mixed precision), random tokens, ``--batch`` x ``--seq`` per step. Every run builds
a fresh model and trains ``--warmup`` + ``--steps`` steps; a row gives the median wall time of the timed
steps (device synchronised at each step's end, data loading and framework work included), the peak
allocated memory during them (``torch.cuda.max_memory_allocated`` after a reset at the end of warm-up,
less what was still allocated when the run began, e.g. cuBLAS workspaces; a leak from an earlier run is
reported on stderr) and the bytes ``offload_transform`` moved to the host per step. A run that fails
prints its error in its row and the others go on.

* Trainer (``max_grad_norm=1.0``), accelerate (``accelerator.clip_grad_norm_(..., 1.0)``) and Lightning
  (``precision="bf16-mixed"``, ``gradient_clip_val=1.0``): ``AdamW(fused=True)`` without offload; with the
  framework's callback (or ``offload_transform`` before ``prepare``), the first ``--num-layers`` layers
  offloaded; and that plus ``HybridDeviceOptimizer(offload_fraction=0.5)`` (through
  ``optimizer_cls_and_kwargs``, ``prepare`` and ``configure_optimizers``).
* SFTTrainer (``gradient_checkpointing=False``): without offload; TRL's ``SFTConfig(activation_offloading=True)``;
  ``OffloadCallback(memory_budget=<TRL's peak>)``, planned on the first batch; ``OffloadCallback(num_layers=21)``.
  Target: at TRL's memory our peak at most TRL's and our step time at most TRL's.

TRL needs ``trl`` and ``datasets``; on a machine without network carry their wheels in ``.whl/`` (see
``benchmarks/README.md``)::

    python3 -m pip download --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \\
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform any -d .whl \\
      trl==1.16.0 datasets==5.2.0 pyarrow pandas python-dateutil six dill multiprocess xxhash
    python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site

Without them the SFTTrainer rows say so and the others run.
"""

from __future__ import annotations

import argparse
import os
import shlex
import sys
import tempfile
import time
import traceback
import warnings

import torch
from _timing import device_name, fmt_bytes, free_memory, median, sync
from transformers import LlamaConfig, LlamaForCausalLM

from annotate_offload import HybridDeviceOptimizer, offload_transform


class Meter:
    """Step times (ms, device synchronised at each step's end) after ``warmup`` steps, and the peak since."""

    def __init__(self, device: torch.device, warmup: int) -> None:
        self.device, self.warmup, self.n, self.ms, self.last = device, warmup, 0, [], 0.0
        self.start = torch.cuda.memory_allocated() if device.type == "cuda" else 0
        if self.start > 256 << 20:
            print(f"  note: {fmt_bytes(self.start)} still allocated from earlier runs (left out of the peak)",
                  file=sys.stderr, flush=True)

    def step(self) -> None:
        sync(self.device)
        now = time.perf_counter()
        if self.n >= self.warmup:
            self.ms.append((now - self.last) * 1e3)
        self.n, self.last = self.n + 1, now
        if self.n == self.warmup and self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats()

    def peak(self) -> int | None:
        return torch.cuda.max_memory_allocated() - self.start if self.device.type == "cuda" else None


class Setup:
    def __init__(self, a: argparse.Namespace) -> None:
        self.tiny, self.steps, self.warmup = a.tiny, a.steps, a.warmup
        self.device = torch.device("cpu" if a.tiny else "cuda")
        self.cfg = (LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=16) if a.tiny else
                    LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=5632, num_hidden_layers=22,
                                num_attention_heads=32, num_key_value_heads=4, max_position_embeddings=a.seq))
        self.batch, self.seq = (2, 16) if a.tiny else (a.batch, a.seq)
        self.num_layers = a.num_layers if a.num_layers is not None else self.cfg.num_hidden_layers // 2
        self.fields = {"min_offload_numel": 0} if a.tiny else {}  # a tiny model's tensors are small
        self.ids = torch.randint(0, self.cfg.vocab_size, (self.batch * (self.steps + self.warmup), self.seq),
                                 generator=torch.Generator().manual_seed(0))
        self.out = tempfile.mkdtemp()

    def model(self) -> LlamaForCausalLM:
        torch.manual_seed(0)
        with torch.device(self.device):
            model = LlamaForCausalLM(self.cfg)
        model.config.use_cache = False  # training: no KV cache
        return model

    def meter(self) -> Meter:
        free_memory(self.device)
        return Meter(self.device, self.warmup)

    def data(self) -> list[dict]:
        return [{"input_ids": x, "labels": x} for x in self.ids]


def _result(meter: Meter, model, opt=None) -> tuple:
    plan = getattr(model, "offload_plan", None)
    if isinstance(opt, HybridDeviceOptimizer):
        opt.close()
    return median(meter.ms), meter.peak(), plan and plan.bytes_per_step


def trainer(s: Setup, offload: bool, hybrid: bool = False) -> tuple:
    import transformers

    from annotate_offload.integrations.transformers import OffloadCallback

    meter = s.meter()

    class Timing(transformers.TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            meter.step()

    opt = (HybridDeviceOptimizer, {"lr": 1e-4, "offload_fraction": 0.5}) if hybrid else \
        (torch.optim.AdamW, {"lr": 1e-4, "fused": True})
    args = transformers.TrainingArguments(
        os.path.join(s.out, "trainer"), max_steps=s.warmup + s.steps, per_device_train_batch_size=s.batch,
        bf16=not s.tiny, use_cpu=s.tiny, learning_rate=1e-4, report_to=[], save_strategy="no", disable_tqdm=True)
    callbacks = [OffloadCallback(s.num_layers, **s.fields)] if offload else []
    tr = transformers.Trainer(model=s.model(), args=args, train_dataset=s.data(), callbacks=callbacks + [Timing()],
                              optimizer_cls_and_kwargs=opt)
    tr.remove_callback(transformers.PrinterCallback)  # stdout carries the table only
    tr.train()
    return _result(meter, tr.model, tr.optimizer.optimizer)


def accelerate_(s: Setup, offload: bool, hybrid: bool = False) -> tuple:
    import accelerate

    meter = s.meter()
    accelerate.state.AcceleratorState._reset_state(True)
    acc = accelerate.Accelerator(cpu=s.tiny, mixed_precision="no" if s.tiny else "bf16")
    model = s.model()
    opt = (HybridDeviceOptimizer(model.parameters(), lr=1e-4, offload_fraction=0.5) if hybrid else
           torch.optim.AdamW(model.parameters(), lr=1e-4, fused=True))
    if offload:
        offload_transform(model, s.num_layers, **s.fields)
    loader = torch.utils.data.DataLoader(s.data(), batch_size=s.batch)
    model, opt, loader = acc.prepare(model, opt, loader)
    for batch in loader:
        acc.backward(model(**batch).loss)
        acc.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad()
        meter.step()
    return _result(meter, acc.unwrap_model(model), getattr(opt, "optimizer", opt))


def lightning_(s: Setup, offload: bool, hybrid: bool = False) -> tuple:
    import lightning.pytorch as pl

    from annotate_offload.integrations.lightning import OffloadCallback

    meter = s.meter()

    class Lit(pl.LightningModule):
        def __init__(self, model) -> None:
            super().__init__()
            self.model = model

        def training_step(self, batch, i):
            return self.model(input_ids=batch, labels=batch).loss

        def on_train_batch_end(self, *args):
            meter.step()

        def configure_optimizers(self):
            if hybrid:
                self.opt = HybridDeviceOptimizer(self.parameters(), lr=1e-4, offload_fraction=0.5)
                return self.opt
            opt = torch.optim.AdamW(self.parameters(), lr=1e-4, fused=True)
            opt._step_supports_amp_scaling = False  # bf16 has no scaler; Lightning refuses clipping otherwise
            return opt

    lit = Lit(s.model())
    callbacks = [OffloadCallback(s.num_layers, **s.fields)] if offload else []
    pl.Trainer(accelerator="cpu" if s.tiny else "gpu", devices=1, precision="32-true" if s.tiny else "bf16-mixed",
               max_steps=s.warmup + s.steps, callbacks=callbacks, logger=False, enable_checkpointing=False,
               enable_progress_bar=False, enable_model_summary=False, default_root_dir=s.out, gradient_clip_val=1.0,
               ).fit(lit, torch.utils.data.DataLoader(s.ids, batch_size=s.batch))
    return _result(meter, lit, getattr(lit, "opt", None))


def sft(s: Setup, trl_offload: bool = False, **callback) -> tuple:
    import datasets
    import transformers
    import trl
    from tokenizers import Tokenizer, models

    from annotate_offload.integrations.transformers import OffloadCallback

    meter = s.meter()

    class Timing(transformers.TrainerCallback):
        def on_step_end(self, *args, **kwargs):
            meter.step()

    vocab = {f"t{i}": i for i in range(s.cfg.vocab_size)}
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel(vocab, unk_token="t0")),
                                               pad_token="t1", eos_token="t2")
    args = trl.SFTConfig(os.path.join(s.out, "sft"), max_steps=s.warmup + s.steps, per_device_train_batch_size=s.batch,
                         bf16=not s.tiny, use_cpu=s.tiny, learning_rate=1e-4, report_to=[], save_strategy="no",
                         disable_tqdm=True, gradient_checkpointing=False, max_length=s.seq,
                         activation_offloading=trl_offload)
    callbacks = [OffloadCallback(**callback, **s.fields)] if callback else []
    tr = trl.SFTTrainer(model=s.model(), args=args, processing_class=tok, callbacks=callbacks + [Timing()],
                        train_dataset=datasets.Dataset.from_dict({"input_ids": s.ids.tolist()}),
                        optimizer_cls_and_kwargs=(torch.optim.AdamW, {"lr": 1e-4, "fused": True}))
    tr.remove_callback(transformers.PrinterCallback)
    tr.train()
    return _result(meter, tr.model)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=4, help="timed steps per run (default 4)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps first (default 2)")
    p.add_argument("--num-layers", type=int, default=None, help="layers offloaded (default: half of them)")
    p.add_argument("--batch", type=int, default=4, help="sequences per step (default 4)")
    p.add_argument("--seq", type=int, default=2048, help="tokens per sequence (default 2048)")
    p.add_argument("--tiny", action="store_true", help="a tiny Llama on the CPU; the numbers carry no claim")
    a = p.parse_args(argv)
    if a.steps < 1 or a.warmup < 1:
        p.error("--steps and --warmup must be >= 1")
    if not a.tiny and not torch.cuda.is_available():
        p.error("needs a CUDA GPU; pass --tiny for the CPU smoke run")
    s = Setup(a)
    if not 0 < s.num_layers < s.cfg.num_hidden_layers:
        p.error(f"--num-layers must be in [1, {s.cfg.num_hidden_layers - 1}]")
    last = s.cfg.num_hidden_layers - 1
    n = s.num_layers
    runs = [("Trainer", "none", lambda: trainer(s, False)),
            ("Trainer", f"OffloadCallback(num_layers={n})", lambda: trainer(s, True)),
            ("Trainer", f"OffloadCallback(num_layers={n}) + HybridDeviceOptimizer(0.5)", lambda: trainer(s, True, True)),
            ("accelerate", "none", lambda: accelerate_(s, False)),
            ("accelerate", f"offload_transform(num_layers={n}) before prepare", lambda: accelerate_(s, True)),
            ("accelerate", f"offload_transform(num_layers={n}) + HybridDeviceOptimizer(0.5)",
             lambda: accelerate_(s, True, True)),
            ("Lightning", "none", lambda: lightning_(s, False)),
            ("Lightning", f"OffloadCallback(num_layers={n})", lambda: lightning_(s, True)),
            ("Lightning", f"OffloadCallback(num_layers={n}) + HybridDeviceOptimizer(0.5)",
             lambda: lightning_(s, True, True)),
            ("SFTTrainer", "none", lambda: sft(s)),
            ("SFTTrainer", "TRL activation_offloading=True", lambda: sft(s, trl_offload=True)),
            ("SFTTrainer", "OffloadCallback(memory_budget=TRL's peak)",
             lambda: sft(s, memory_budget=rows[-1][3]) if rows[-1][3] else "no TRL peak to match"),
            ("SFTTrainer", f"OffloadCallback(num_layers={last})", lambda: sft(s, num_layers=last))]
    rows: list[tuple] = []
    t0 = time.perf_counter()
    for framework, method, fn in runs:
        print(f"[{time.perf_counter() - t0:5.0f} s] {framework}: {method}", file=sys.stderr, flush=True)
        if s.tiny and method.startswith("TRL"):
            result = "TRL's offload needs an accelerator"
        else:
            try:
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    result = fn()
            except ImportError as e:
                result = f"not importable: {e}"
            except Exception as e:  # e.g. a budget below the smallest feasible one; the other runs go on
                traceback.print_exc()
                result = f"{type(e).__name__}: {str(e)[:160]}"
        rows.append((framework, method, *result) if isinstance(result, tuple) else (framework, method, result, None, None))
    base: dict[str, tuple] = {}
    cmd = "python benchmarks/frameworks.py " + shlex.join(argv if argv is not None else sys.argv[1:])
    print(f"{device_name(s.device)}, torch {torch.__version__}; {s.batch} x {s.seq} tokens per step; "
          f"median of {s.steps} steps after {s.warmup}; `{cmd.strip()}`\n")
    print("| framework | run | step ms | peak | step / none | peak - none | D2H / step |")
    print("|---|---|---:|---:|---:|---:|---:|")
    for framework, method, ms, peak, moved in rows:
        if isinstance(ms, str):
            print(f"| {framework} | {method} | {ms} | | | | |")
            continue
        ref = base.setdefault(framework, (ms, peak))
        ratio = f"{ms / ref[0]:.2f}x"
        delta = "-" if peak is None else f"{(peak - ref[1]) / 2**30:+.2f} GiB"
        print(f"| {framework} | {method} | {ms:.1f} | {fmt_bytes(peak)} | {ratio} | {delta} | {fmt_bytes(moved)} |")
    trl_row = next((r for r in rows if r[1].startswith("TRL")), None)
    if trl_row is not None and not isinstance(trl_row[2], str):
        print()
        for _, method, ms, peak, _ in rows:
            if method.startswith("OffloadCallback") and rows.index(trl_row) < [r[1] for r in rows].index(method) \
                    and not isinstance(ms, str):
                ok = peak <= trl_row[3] and ms <= trl_row[2]
                print(f"SFTTrainer {method} vs TRL activation_offloading: peak {fmt_bytes(peak)} vs "
                      f"{fmt_bytes(trl_row[3])}, step {ms:.1f} vs {trl_row[2]:.1f} ms: "
                      f"{'meets' if ok else 'misses'} the target (peak <= TRL's and step <= TRL's)")
    print(f"\n{len(runs)} runs in {time.perf_counter() - t0:.0f} s wall")
    return 0


if __name__ == "__main__":
    sys.exit(main())
