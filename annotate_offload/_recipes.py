"""CLI recipes: a named model builder plus its default :class:`~annotate_offload.config.Config`.

=============  =====================================================================  ========
recipe         model                                                                  device
=============  =====================================================================  ========
``llama-tiny`` built-in Llama (RMSNorm, rotary, SwiGLU, GQA), 4 layers, 0.8M params   any
``gpt-small``  ``models.gpt.GPTStack`` (LayerNorm, fused QKV, GELU), 4 layers (fx)    any
``llama-1b``   built-in Llama with Llama 3.2 1B's decoder shape, bf16 autocast         CUDA
``hf-llama``   ``transformers.LlamaForCausalLM`` from a small ``LlamaConfig`` (hooks)  any
=============  =====================================================================  ========

Every model is built from ``train.seed`` alone (no downloaded weights), so two builds are
identical: that is what lets the CLI compare an offloaded run with a baseline step by step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import importlib.util
import math
import statistics
import sys
import time
import warnings
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional

import torch
import torch.nn.functional as F
from torch import nn

from .config import Config, ModelConfig, OptimizerConfig, TrainConfig

__all__ = ["Recipe", "RECIPES", "get_recipe", "check_runnable", "make_batches", "run", "compare", "Report", "RunResult"]


@dataclass(frozen=True)
class Recipe:
    """A named training setup.

    Attributes:
        name (str): what ``--recipe`` takes.
        summary (str): one line for ``--help`` and the report header.
        config (Config): defaults, before the user's overrides.
        build (Callable[[Config, torch.device], nn.Module]): seeded model factory; the model maps
            ``(B, T)`` int64 token ids to ``(B, T, 256)`` logits (or an object with ``.logits``).
        needs_cuda (bool): refuse to run on a CPU. Default: ``False``.
        needs_module (str | None): a package that must be importable. Default: ``None``.
    """

    name: str
    summary: str
    config: Config
    build: Callable[[Config, torch.device], nn.Module]
    needs_cuda: bool = False
    needs_module: Optional[str] = None


def _llama(preset: str) -> Callable[[Config, torch.device], nn.Module]:
    def build(cfg: Config, device: torch.device) -> nn.Module:
        from .models.llama import Llama, LlamaConfig

        base = LlamaConfig.from_preset(preset)
        shape = dataclasses.replace(base, num_layers=cfg.model.num_layers or base.num_layers,
                                    max_seq_len=max(base.max_seq_len, cfg.model.seq_length))
        return Llama(shape, seed=cfg.train.seed, device=device)

    return build


def _seeded_cpu_build(seed: int, make: Callable[[], nn.Module], device: torch.device) -> nn.Module:
    """Build with the global RNG seeded (models that init from it), on the CPU, then move."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = make()
    return model.to(device)


def _gpt_small(cfg: Config, device: torch.device) -> nn.Module:
    from .models.gpt import GPTConfig, GPTStack

    shape = GPTConfig(hidden=128, heads=4, layers=cfg.model.num_layers or 4, vocab=256,
                      max_seq=max(512, cfg.model.seq_length))
    return _seeded_cpu_build(cfg.train.seed, lambda: GPTStack(shape), device)


def _hf_llama(cfg: Config, device: torch.device) -> nn.Module:
    import transformers

    hf_cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=cfg.model.num_layers or 4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(512, cfg.model.seq_length),
        tie_word_embeddings=False, use_cache=False)
    hf_cfg._attn_implementation = "sdpa"
    return _seeded_cpu_build(cfg.train.seed, lambda: transformers.LlamaForCausalLM(hf_cfg), device)


def _small(num_layers: int, **model) -> Config:
    """CPU-sized defaults: both offloads on, activations of the first L-1 layers, half the optimizer."""
    return Config(
        # N = L-1 with a one-layer prefetch and release lag: copies overlap compute even there
        # (TE's schedule would serialise them, and offload_transform would warn about it)
        model=ModelConfig(cpu_offloading=True, num_layers=num_layers, cpu_offloading_num_layers=num_layers - 1,
                          seq_length=128, min_offload_numel=1024,
                          **{"prefetch_layers": 1, "release_lag": 1, **model}),
        optimizer=OptimizerConfig(lr=1e-3, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5),
        train=TrainConfig(train_iters=100, global_batch_size=8, micro_batch_size=8, seed=1234),
    )


RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("llama-tiny", "built-in Llama (RMSNorm, rotary, SwiGLU, GQA), 4 layers, 0.8M params; CPU in ~1 min",
               _small(4), _llama("llama-tiny")),
        Recipe("gpt-small", "GPT stack (LayerNorm, fused QKV, GELU MLP), 4 layers; the torch.fx path",
               _small(4), _gpt_small),
        Recipe("llama-1b", "Llama 3.2 1B decoder shape (0.97B params, byte vocab), bf16 autocast; one GPU",
               Config(
                   model=ModelConfig(cpu_offloading=True, num_layers=16, cpu_offloading_num_layers=12,
                                     seq_length=4096, bf16=True),
                   # 3e-4 without warm-up made the loss jump from 5.9 to 10.9 at step 2 on the H200
                   # (chaotic steps amplify the last-bit CPU-vs-CUDA AdamW differences past 1e-3)
                   optimizer=OptimizerConfig(lr=3e-5, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5,
                                             overlap_cpu_optimizer_d2h_h2d=True),
                   train=TrainConfig(train_iters=10, global_batch_size=4, micro_batch_size=4, seed=1234)),
               _llama("llama-1b"), needs_cuda=True),
        Recipe("hf-llama", "transformers LlamaForCausalLM from a small LlamaConfig (no download); the hooks path",
               _small(4), _hf_llama, needs_module="transformers"),
    )
}


def get_recipe(name: str) -> Recipe:
    """The recipe called ``name``.

    Raises:
        ValueError: unknown name (the message lists the valid ones).
    """
    if name not in RECIPES:
        raise ValueError(f"unknown recipe {name!r}; valid: {', '.join(RECIPES)}.")
    return RECIPES[name]


def check_runnable(recipe: Recipe, device: torch.device, *, train: bool = True) -> None:
    """Raise ``ValueError`` (what is missing, and the fix) when ``recipe`` cannot run on ``device``.

    ``train=False`` (``annotate-offload plan``) skips the GPU requirement: a plan trains nothing, and
    :func:`plan_text` builds a GPU-only model with uninitialised CPU weights.
    """
    if train and recipe.needs_cuda and device.type != "cuda":
        raise ValueError(f"recipe {recipe.name!r} needs a CUDA GPU (device is {device.type}); "
                         f"use --recipe llama-tiny on a CPU.")
    if recipe.needs_module and importlib.util.find_spec(recipe.needs_module) is None:
        raise ValueError(f"recipe {recipe.name!r} needs the {recipe.needs_module!r} package; "
                         f"pip install 'annotate-offload[hf]', or use --recipe llama-tiny.")
    if recipe.config.model.num_layers is None:  # pragma: no cover - recipe definitions above all set it
        raise ValueError(f"recipe {recipe.name!r} has no model.num_layers.")


# --------------------------------------------------------------------------- running a recipe
# Note [CPU memory accounting]: without a GPU there is no device allocator to ask, so "device
# memory" is the runtime's own accounting: parameters + gradients + device-side optimizer state,
# plus saved activations. Saved tensors outside the runtime's layer scopes are counted live by an
# outer saved_tensors_hooks pair (the runtime's hooks are innermost inside layers); inside layers
# the runtime reports what it kept (``OffloadStats.kept_bytes``, parameters excluded) and what it
# still holds of offloaded layers (``peak_resident_bytes``). The peak adds the peak of each part
# (they need not coincide), so it is an upper bound of the live curve ``--plot`` draws (a fresh
# user saw 41.6 MiB in the table against a ~34 MiB curve). It is labelled as such in the table.

_MiB = 1 << 20


def make_batches(cfg: Config, data_path: Optional[str]):
    """:class:`~annotate_offload.data.ByteBatches` for ``cfg`` from the built-in text or ``data_path``.

    Raises:
        ValueError: missing, unreadable or empty file, or text shorter than one sample.
    """
    from .data import ByteBatches, encode, load_text

    return ByteBatches(encode(load_text(data_path)), micro_batch_size=cfg.train.micro_batch_size,
                       seq_length=cfg.model.seq_length, seed=cfg.train.seed)


def _offload_transform():
    try:
        from . import offload_transform  # the public name (DESIGN.md)
    except ImportError:
        from .annotate import offload_transform
    return offload_transform


def _offload_stats(model: nn.Module):
    """The runtime's OffloadStats of a transformed model's current step, or ``None``."""
    stats = getattr(model, "offload_stats", None)
    if stats is not None:
        return stats
    state = model.__dict__.get("_annotate_offload_state")
    return getattr(getattr(getattr(state, "boundary", None), "sync", None), "stats", None)


def _layer_list(model: nn.Module) -> list[nn.Module]:
    """The repeated blocks (first ``nn.ModuleList`` whose children share one class), for tracing memory."""
    for module in model.modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1 and len({type(m) for m in module}) == 1:
            return list(module)
    return []


class _SavedBytes:
    """Live bytes of tensors saved for backward outside the runtime's scopes (see Note above)."""

    def __init__(self, model: nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.refs: dict[int, list[int]] = {}
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key, nbytes = storage.data_ptr(), storage.nbytes()
        if key in self.params or nbytes == 0:
            return t
        entry = self.refs.setdefault(key, [0, nbytes])
        if entry[0] == 0:
            self.live += nbytes
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        weakref.finalize(t, self._drop, key)
        return t

    def _drop(self, key: int) -> None:
        entry = self.refs.get(key)
        if entry is not None:
            entry[0] -= 1
            if entry[0] == 0:
                self.live -= entry[1]
                del self.refs[key]

    def hooks(self):
        return torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t)


def _runtime_held(stats) -> int:
    if stats is None:
        return 0
    kept = sum(v for k, v in stats.kept_bytes.items() if k != "parameter")
    return kept + stats.resident_bytes


@dataclass
class RunResult:
    """One training run of :func:`compare`.

    Attributes:
        label (str): ``"offload"`` or ``"baseline"``.
        losses (list[float]): loss of each step (mean over its micro-batches).
        step_ms (list[float]): wall time of each step, ms (CUDA synchronised).
        bytes_offloaded (list[int]): activation bytes copied to host per step.
        peak_bytes (int | None): peak device memory, bytes (source: :attr:`Report.memory_source`).
        trace (list[tuple[str, int]]): device memory at layer boundaries over the last step, bytes.
        failure (str | None): why the run stopped early (``"out of memory: ..."``).
        plan (str | None): ``repr(model.offload_plan)``.
        notes (list[str]): warnings raised while setting up.
    """

    label: str
    losses: list = field(default_factory=list)
    step_ms: list = field(default_factory=list)
    bytes_offloaded: list = field(default_factory=list)
    peak_bytes: Optional[int] = None
    trace: list = field(default_factory=list)
    failure: Optional[str] = None
    plan: Optional[str] = None
    notes: list = field(default_factory=list)


def _optimizer(model: nn.Module, cfg: Config, offload: bool):
    o = cfg.optimizer
    hyper = dict(lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, weight_decay=o.weight_decay)
    if offload and o.optimizer_cpu_offload:
        from .optim import HybridDeviceOptimizer

        return HybridDeviceOptimizer(
            model.parameters(), offload_fraction=o.optimizer_offload_fraction, pin_cpu_grads=o.pin_cpu_grads,
            pin_cpu_params=o.pin_cpu_params, overlap_cpu_optimizer_d2h_h2d=o.overlap_cpu_optimizer_d2h_h2d,
            use_torch_optimizer_for_cpu_offload=o.use_torch_optimizer_for_cpu_offload, **hyper)
    return torch.optim.AdamW(model.parameters(), fused=True, **hyper)


def _static_bytes(model: nn.Module, opt) -> int:
    """Parameters + gradients + device-side Adam moments (fp32), bytes (CPU accounting)."""
    params = list({id(p): p for p in model.parameters()}.values())
    total = sum(p.numel() * p.element_size() for p in params)
    numel = sum(p.numel() for p in params if p.requires_grad)
    on_host = int(getattr(opt, "offloaded_numel", 0) or 0)
    return 2 * total + 2 * 4 * (numel - on_host)


class _Tracer:
    """Samples device memory at layer boundaries of one step (forward pre/post, backward via grad hooks)."""

    def __init__(self, model: nn.Module, read: Callable[[], int]) -> None:
        self.read, self.samples, self.handles = read, [], []
        for i, layer in enumerate(_layer_list(model)):
            self.handles.append(layer.register_forward_pre_hook(self._pre(i)))
            self.handles.append(layer.register_forward_hook(self._post(i)))

    def mark(self, label: str) -> None:
        self.samples.append((label, self.read()))

    def _pre(self, i: int):
        return lambda module, args: self.mark(f"fwd {i}")

    def _post(self, i: int):
        def hook(module, args, out):
            self.mark(f"fwd {i} end")
            t = out if isinstance(out, torch.Tensor) else next((o for o in out if isinstance(o, torch.Tensor)), None)
            if t is not None and t.requires_grad:
                t.register_hook(lambda g: self.mark(f"bwd {i}"))
        return hook

    def close(self) -> None:
        for h in self.handles:
            h.remove()
        self.handles = []


def _forward_ctx(cfg: Config, device: torch.device, sdpa_backend: str, saved: Optional[_SavedBytes]):
    stack = contextlib.ExitStack()
    if cfg.model.bf16 and device.type != "meta":
        stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
    elif cfg.model.bf16:  # autocast has no meta device: its casts, emulated (Note [Autocast on meta])
        from .annotate._estimate import autocast_on_meta

        stack.enter_context(autocast_on_meta(torch.bfloat16))
    if device.type == "cuda" and sdpa_backend != "default":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        backend = SDPBackend.EFFICIENT_ATTENTION if sdpa_backend == "efficient" else SDPBackend.MATH
        stack.enter_context(sdpa_kernel(backend))
    if saved is not None:
        stack.enter_context(saved.hooks())
    return stack


def run(recipe: Recipe, cfg: Config, device: torch.device, batches, *, offload: bool,
        progress: bool = False, sdpa_backend: str = "efficient") -> RunResult:
    """Train ``cfg.train.train_iters`` steps of ``recipe``, with (``offload=True``) or without offloading.

    A CUDA out-of-memory error ends the run and is recorded in :attr:`RunResult.failure`.
    """
    res = RunResult("offload" if offload else "baseline")
    cuda = device.type == "cuda"
    n_micro, iters = cfg.train.num_micro_batches, cfg.train.train_iters
    model = opt = tracer = bar = None
    exit_stack = contextlib.ExitStack()
    try:
        if cuda:
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = recipe.build(cfg, device)
            model.train()
            if offload and cfg.model.cpu_offloading:
                _offload_transform()(model, config=cfg.model)
            opt = _optimizer(model, cfg, offload)
        res.notes = list(dict.fromkeys(str(w.message) for w in caught))
        saved = None if cuda else _SavedBytes(model)
        static = 0 if cuda else _static_bytes(model, opt)

        in_step = [False]  # the runtime's stats describe live tensors only between forward and end of backward

        def read() -> int:
            if cuda:
                return torch.cuda.memory_allocated(device)
            return static + saved.live + (_runtime_held(_offload_stats(model)) if in_step[0] else 0)

        if progress:
            try:
                from tqdm.auto import tqdm
                bar = tqdm(total=iters, desc=res.label, unit="step", leave=False, file=sys.stderr)
            except ImportError:
                bar = None
        act_peak = 0
        if device.type == "cuda" and sdpa_backend == "efficient":
            # the efficient SDPA backward is bit-reproducible only with deterministic algorithms
            # (annotate_offload.testing); the whole step, backward included, needs it
            from .testing import bit_reproducible

            exit_stack.enter_context(bit_reproducible())
        for step in range(iters):
            if step == iters - 1:
                tracer = _Tracer(model, read)
                tracer.mark("start")
            t0 = time.perf_counter()
            loss_sum, moved = None, 0
            for micro in range(n_micro):
                x, y = (t.to(device, non_blocking=True) for t in batches[step * n_micro + micro])
                in_step[0] = True
                with _forward_ctx(cfg, device, sdpa_backend, saved):
                    out = model(x)
                    logits = getattr(out, "logits", out)
                    loss = F.cross_entropy(logits.float().flatten(0, 1), y.flatten()) / n_micro
                if tracer is not None:
                    tracer.mark("loss")
                loss.backward()
                in_step[0] = False
                loss_sum = loss.detach() if loss_sum is None else loss_sum + loss.detach()
                stats = _offload_stats(model)
                if stats is not None:
                    moved += stats.bytes_offloaded
                if saved is not None:
                    held = 0 if stats is None else _runtime_held(stats) - stats.resident_bytes + stats.peak_resident_bytes
                    act_peak = max(act_peak, saved.peak + held)
                    saved.peak = saved.live
            if cfg.optimizer.clip_grad > 0:
                clip = getattr(opt, "clip_grad_norm_", None)
                if clip is not None:
                    clip(cfg.optimizer.clip_grad)
                else:
                    torch.nn.utils.clip_grad_norm_(model.parameters(), cfg.optimizer.clip_grad)
            opt.step()
            opt.zero_grad(set_to_none=True)
            if cuda:
                torch.cuda.synchronize(device)
            res.step_ms.append((time.perf_counter() - t0) * 1e3)
            res.losses.append(float(loss_sum))
            res.bytes_offloaded.append(moved)
            if tracer is not None:
                tracer.mark("step end")
                res.trace = tracer.samples
            if bar is not None:
                bar.set_postfix(loss=f"{res.losses[-1]:.4f}")
                bar.update()
        res.peak_bytes = torch.cuda.max_memory_allocated(device) if cuda else static + act_peak
        plan = getattr(model, "offload_plan", None)
        res.plan = None if plan is None else repr(plan)  # after the steps: bytes per layer are measured
    except torch.OutOfMemoryError as exc:
        res.failure = "out of memory: " + str(exc).strip().splitlines()[0][:160]
    finally:
        exit_stack.close()
        if bar is not None:
            bar.close()
        if tracer is not None:
            tracer.close()
        close = getattr(opt, "close", None)
        if close is not None:
            close()
        del model, opt
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return res


def _fmt_bytes(n: Optional[int]) -> str:
    if n is None:
        return "-"
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n} B"


@dataclass
class Report:
    """Both runs of :func:`compare` and the parity verdict.

    Attributes:
        recipe (Recipe), cfg (Config), device (torch.device): what ran.
        offload (RunResult): the offloaded run.
        baseline (RunResult | None): the run without offloading (``None`` with ``--no-compare-baseline``).
    """

    recipe: Recipe
    cfg: Config
    device: torch.device
    offload: RunResult
    baseline: Optional[RunResult]

    @property
    def exact(self) -> bool:
        """Whether parity means identical losses (activation offload only) rather than ``|Δloss| < 1e-3``."""
        return not self.cfg.optimizer.optimizer_cpu_offload

    @property
    def memory_source(self) -> str:
        """Where the peak memory figures come from."""
        return ("torch.cuda.max_memory_allocated" if self.device.type == "cuda"
                else "CPU: runtime accounting, an upper bound, see Note [CPU memory accounting]")

    @property
    def max_delta(self) -> Optional[float]:
        """``max |loss_offload - loss_baseline|`` over the steps both completed, or ``None``."""
        if self.baseline is None or self.baseline.failure or not self.baseline.losses:
            return None
        return max(abs(a - b) for a, b in zip(self.offload.losses, self.baseline.losses))

    @property
    def ok(self) -> bool:
        """The parity verdict (see :attr:`verdict`)."""
        return self.verdict.startswith("PASS")

    @property
    def verdict(self) -> str:
        """``PASS ...`` or ``FAIL ...`` with the reason."""
        if self.offload.failure:
            return f"FAIL: the offloaded run failed ({self.offload.failure})"
        if not all(math.isfinite(v) for v in self.offload.losses):
            return "FAIL: the offloaded run produced a non-finite loss"
        if self.baseline is None:
            return "PASS (no baseline: --no-compare-baseline)"
        if self.baseline.failure:
            return f"PASS (baseline: {self.baseline.failure}; the offloaded run completed)"
        delta = self.max_delta
        if self.exact:
            same = self.offload.losses == self.baseline.losses
            return ("PASS: identical losses" if same else f"FAIL: losses differ (max |Δloss| = {delta:.3g}); "
                    "activation offload must be a bit-exact copy")
        if delta is not None and delta < 1e-3:
            return f"PASS: max |Δloss| = {delta:.3g} < 0.001"
        return f"FAIL: max |Δloss| = {delta} >= 0.001 (Megatron Bridge's criterion)"

    def table(self) -> str:
        """The report printed by ``annotate-offload train`` (markdown tables)."""
        c, runs = self.cfg, [r for r in (self.offload, self.baseline) if r is not None]
        m, o = c.model, c.optimizer
        acts = (f"activations of the first {m.cpu_offloading_num_layers} of {m.num_layers} layers"
                if m.cpu_offloading else "activations: off")
        opt = (f"optimizer: {o.optimizer_offload_fraction:g} of parameters stepped on the host"
               if o.optimizer_cpu_offload else "optimizer: on device")
        lines = [
            f"annotate-offload train: recipe {self.recipe.name} on {self.device.type}, torch {torch.__version__}, "
            f"{c.train.train_iters} steps of {c.train.global_batch_size}x{m.seq_length} tokens, seed {c.train.seed}",
            f"offload: {acts}; {opt}", "",
        ]
        n = len(self.offload.losses)
        every = max(1, math.ceil(n / 20))
        shown = [i for i in range(n) if i % every == 0 or i == n - 1]
        head = "| step | loss (offload) |" + (" loss (baseline) | abs delta |" if self.baseline else "")
        lines += [head, "|" + "|".join("---:" for _ in head.split("|")[1:-1]) + "|"]
        for i in shown:
            row = f"| {i + 1} | {self.offload.losses[i]:.6f} |"
            if self.baseline:
                b = self.baseline.losses[i] if i < len(self.baseline.losses) else None
                row += (f" {b:.6f} | {abs(self.offload.losses[i] - b):.3g} |" if b is not None else " - | - |")
            lines.append(row)
        if every > 1:
            lines.append(f"(every {every}th step shown; the delta is over all steps)")
        lines += ["", "| | " + " | ".join(r.label for r in runs) + " |", "|---|" + "---:|" * len(runs)]

        def cells(fn) -> str:
            return " | ".join(r.failure if r.failure else fn(r) for r in runs)

        med = lambda r: f"{statistics.median(r.step_ms[1:] or r.step_ms):.1f} ms" if r.step_ms else "-"  # noqa: E731
        lines.append(f"| peak device memory ({self.memory_source}) | {cells(lambda r: _fmt_bytes(r.peak_bytes))} |")
        lines.append(f"| step time (median, first step excluded) | {cells(med)} |")
        lines.append(f"| bytes offloaded per optimizer step (all micro-batches) | "
                     f"{cells(lambda r: _fmt_bytes(max(r.bytes_offloaded, default=0)))} |")
        delta = self.max_delta
        crit = "identical losses (activation offload only)" if self.exact else "< 0.001 (optimizer offload)"
        lines += ["", f"max |Δloss| = {'-' if delta is None else f'{delta:.3g}'} (criterion: {crit}) -> {self.verdict}"]
        if self.offload.plan:
            lines += ["", self.offload.plan]
        lines += [f"note: {w}" for w in self.offload.notes]
        return "\n".join(lines)

    def plot(self, path: str) -> None:
        """Write ``path``: device memory over the last step (both runs) and both loss curves."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        runs = [r for r in (self.offload, self.baseline) if r is not None and r.losses]
        fig, (ax_mem, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.5))
        for r in runs:
            if r.trace:
                ax_mem.plot(range(len(r.trace)), [v / _MiB for _, v in r.trace], marker=".", label=r.label)
        ref = max(runs, key=lambda r: len(r.trace)) if runs else None
        if ref is not None and ref.trace:
            ticks = list(range(0, len(ref.trace), max(1, len(ref.trace) // 12)))
            ax_mem.set_xticks(ticks, [ref.trace[i][0] for i in ticks], rotation=60, fontsize=7)
        ax_mem.set_ylabel("device memory (MiB)")
        ax_mem.set_title(f"memory over one step ({self.memory_source.split(',')[0]})", fontsize=9)
        ax_mem.legend()
        for r in runs:
            ax_loss.plot(range(1, len(r.losses) + 1), r.losses, label=r.label, linestyle="-" if r.label == "offload" else "--")
        ax_loss.set_xlabel("step")
        ax_loss.set_ylabel("loss")
        ax_loss.set_title(f"{self.recipe.name}: {self.verdict}", fontsize=9)
        ax_loss.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def compare(recipe: Recipe, cfg: Config, device: torch.device, batches, *, baseline: bool = True,
            progress: bool = False, sdpa_backend: str = "efficient") -> Report:
    """Run ``recipe`` with offloading, then (``baseline=True``) without, same seed and data."""
    kw = dict(progress=progress, sdpa_backend=sdpa_backend)
    off = run(recipe, cfg, device, batches, offload=True, **kw)
    base = run(recipe, cfg, device, batches, offload=False, **kw) if baseline else None
    return Report(recipe, cfg, device, off, base)


def _saved_bytes_per_layer(recipe: Recipe, cfg: Config, fqns: list) -> Optional[list]:
    """Bytes each layer saves for backward (unique storages, parameters excluded), from one
    micro-batch forward of a meta-device copy of the model; ``None`` if it cannot run on meta."""
    try:
        model = recipe.build(cfg, torch.device("meta"))
        layers = [model.get_submodule(f) for f in fqns]
    except Exception:  # noqa: BLE001 - a recipe that cannot build on meta: unknown, not 0
        return None
    params = {p.untyped_storage()._cdata for p in model.parameters()}
    current = [None]
    seen: list = [set() for _ in layers]
    totals = [0] * len(layers)

    from .runtime._layer_state import _is_weight, frozen_shapes

    # the meta estimate's rule: a frozen weight's autocast cast has no grad_fn, so only its shape
    # identifies it (Note [Autocast on meta])
    frozen = frozen_shapes(p for p in model.parameters() if not p.requires_grad)

    def pack(t):
        i = current[0]
        if i is not None and not _is_weight(t, frozen):  # a weight or its autocast cast: not an activation
            key = t.untyped_storage()._cdata
            if key not in params and key not in seen[i]:
                seen[i].add(key)
                totals[i] += t.untyped_storage().nbytes()
        return t

    handles = []
    for i, layer in enumerate(layers):
        handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: current.__setitem__(0, i)))
        handles.append(layer.register_forward_hook(lambda m, a, o: current.__setitem__(0, None)))
    x = torch.zeros(cfg.train.micro_batch_size, cfg.model.seq_length, dtype=torch.int64, device="meta")
    try:
        from .annotate._estimate import fused_sdpa_on_meta

        # fused_sdpa_on_meta first: the mode entered last (bf16 autocast's, from _forward_ctx) sees
        # SDPA first and casts its inputs before the fused-attention mode maps the call
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), fused_sdpa_on_meta(), _forward_ctx(
            cfg, torch.device("meta"), "default", None
        ):
            model(x)
    except Exception:  # noqa: BLE001
        return None
    finally:
        for h in handles:
            h.remove()
    return totals


def plan_text(recipe: Recipe, cfg: Config, device: torch.device) -> str:
    """What ``annotate-offload plan`` prints: the offload plan (bytes estimated on the meta device
    from one micro-batch) and the predicted device memory of parameters, gradients, optimizer state
    and saved activations, with and without offloading. Nothing is trained.

    A recipe that trains only on CUDA (``needs_cuda``) is planned on any other device from a model
    built on the meta device and given uninitialised storage there (``nn.Module.to_empty``): no
    seeded initialisation runs and the weights are never read, only their shapes and dtypes."""
    lines = [f"annotate-offload plan: recipe {recipe.name} on {device.type} ({recipe.summary})"]
    if recipe.needs_cuda and device.type != "cuda":
        model = recipe.build(cfg, torch.device("meta")).to_empty(device=device)
        lines.append(f"(planned without a GPU: weights uninitialised, shapes and dtypes only; "
                     f"train --recipe {recipe.name} needs a CUDA GPU)")
    else:
        model = recipe.build(cfg, device)
    x = torch.zeros(cfg.train.micro_batch_size, cfg.model.seq_length, dtype=torch.int64, device=device)
    notes: list[str] = []
    if cfg.model.cpu_offloading:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            _offload_transform()(model, config=cfg.model, example_inputs=(x,))
        notes = list(dict.fromkeys(str(w.message) for w in caught))
        plan = model.offload_plan
        lines += [repr(plan)]
        # saved bytes of every layer (kept ones too), counted on a meta copy of the model: the
        # plan's bytes/step are what moves, which is 0 for a kept layer
        per_layer = _saved_bytes_per_layer(recipe, cfg, [lp.fqn for lp in plan.layers])
        if cfg.model.bf16 and per_layer is not None:
            notes.append("meta-device estimates emulate bf16 autocast's casts (autocast has no meta device; CUDA's op "
                         "lists, Note [Autocast on meta])")
        if per_layer is None:
            acts = (None, None)
            notes.append("saved activations unknown: the forward does not run on the meta device")
        else:
            moved = [lp.bytes_per_step or 0 for lp in plan.layers]
            kept = sum(b - m for b, m in zip(per_layer, moved))
            n_off = sum(1 for m in moved if m)
            in_flight = max(moved, default=0) * min(n_off, 1 + (cfg.model.release_lag or 0))
            acts = (sum(per_layer), kept + in_flight)
    else:
        lines += ["activation offload is off (model.cpu_offloading=False)"]
        acts = (None, None)
    params = list({id(p): p for p in model.parameters()}.values())
    p_bytes = sum(p.numel() * p.element_size() for p in params)
    numel = sum(p.numel() for p in params)
    o = cfg.optimizer
    host = o.optimizer_offload_fraction if o.optimizer_cpu_offload else 0.0
    adam = 2 * 4 * numel
    rows = [
        ("parameters", p_bytes, p_bytes),
        ("gradients", p_bytes, p_bytes),
        ("optimizer state (fp32 Adam moments)", adam, round(adam * (1 - host))),
        ("saved activations of the layers (one micro-batch)", acts[0], acts[1]),
    ]
    lines += ["", "| predicted device memory | baseline | offload |", "|---|---:|---:|"]
    lines += [f"| {name} | {_fmt_bytes(b)} | {_fmt_bytes(w)} |" for name, b, w in rows]
    lines += ["", "(offload column: kept layers' saved bytes plus release_lag + 1 offloaded layers in flight, "
              "counted on a meta-device copy of the model; the optimizer share stepped "
              f"on the host is {host:g} of parameter elements, their masters and moments in host memory)"]
    lines += [f"note: {n}" for n in notes]
    return "\n".join(lines)
