"""CLI recipes (a seeded model builder and its default :class:`~annotate_offload.config.Config`) and the
training loop of ``annotate-offload train`` and ``plan``.

=============  =====================================================================  ========
recipe         model                                                                  device
=============  =====================================================================  ========
``llama-tiny`` built-in Llama (RMSNorm, rotary, SwiGLU, GQA), 4 layers, 0.8M params   any
``llama-1b``   built-in Llama with Llama 3.2 1B's decoder shape, bf16 autocast         CUDA
``hf-llama``   ``transformers.LlamaForCausalLM`` from a small ``LlamaConfig``          any
=============  =====================================================================  ========

Every model is built from ``train.seed`` alone, so an offloaded run and its baseline start identical.
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

from .annotate._plan import _opt_bytes as _fmt_bytes
from .config import Config, ModelConfig, OptimizerConfig, TrainConfig

__all__ = ["Recipe", "RECIPES", "get_recipe", "check_runnable", "make_batches", "run", "compare", "plan_text"]


@dataclass(frozen=True)
class Recipe:
    """A named training setup.

    Attributes:
        name (str): what ``--recipe`` takes.
        summary (str): one line for ``--help`` and the report header.
        config (Config): defaults, before the user's overrides.
        build (Callable[[Config, torch.device], nn.Module]): seeded model factory: ``(B, T)`` token ids to
            ``(B, T, 256)`` logits (or an object with ``.logits``).
        needs_cuda (bool): refuse to train on a CPU. Default: ``False``.
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


def _hf_llama(cfg: Config, device: torch.device) -> nn.Module:
    import transformers

    hf_cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=128, intermediate_size=352, num_hidden_layers=cfg.model.num_layers or 4,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=max(512, cfg.model.seq_length),
        tie_word_embeddings=False, use_cache=False)
    hf_cfg._attn_implementation = "sdpa"
    with torch.random.fork_rng(devices=[]):  # transformers initialises from the global RNG
        torch.manual_seed(cfg.train.seed)
        model = transformers.LlamaForCausalLM(hf_cfg)
    return model.to(device)


# CPU-sized defaults: both offloads on, activations of the first L-1 layers (a one-layer prefetch and
# release lag let copies overlap compute there), half the optimizer on the host.
_SMALL = Config(
    model=ModelConfig(cpu_offloading=True, num_layers=4, cpu_offloading_num_layers=3, seq_length=128,
                      min_offload_numel=1024, prefetch_layers=1, release_lag=1),
    optimizer=OptimizerConfig(lr=1e-3, optimizer_cpu_offload=True, optimizer_offload_fraction=0.5),
    train=TrainConfig(train_iters=100, micro_batch_size=8, seed=1234),
)

RECIPES: dict[str, Recipe] = {
    r.name: r
    for r in (
        Recipe("llama-tiny", "built-in Llama (RMSNorm, rotary, SwiGLU, GQA), 4 layers, 0.8M params; CPU in a few minutes",
               _SMALL, _llama("llama-tiny")),
        Recipe("llama-1b", "Llama 3.2 1B decoder shape (0.97B params, byte vocab), bf16 autocast; one GPU, "
               "planned for a 20 GiB memory budget",
               Config(
                   # model.memory_budget extends Megatron Bridge's names: the planner picks the layers'
                   # choices, the schedule and the optimizer's offload_fraction for the step's peak memory
                   model=ModelConfig(cpu_offloading=True, num_layers=16, memory_budget="20GiB", seq_length=4096,
                                     bf16=True),
                   # a larger rate without warm-up makes the first steps chaotic, and chaotic steps amplify
                   # the last-bit CPU-vs-CUDA AdamW differences past the 1e-3 parity criterion
                   optimizer=OptimizerConfig(lr=3e-5, optimizer_cpu_offload=True, overlap_cpu_optimizer_d2h_h2d=True),
                   train=TrainConfig(train_iters=20, micro_batch_size=4, seed=1234)),
               _llama("llama-1b"), needs_cuda=True),
        Recipe("hf-llama", "transformers LlamaForCausalLM from a small LlamaConfig (no download)",
               _SMALL, _hf_llama, needs_module="transformers"),
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

    ``train=False`` (``annotate-offload plan``) skips the GPU requirement: a plan trains nothing.
    """
    if train and recipe.needs_cuda and device.type != "cuda":
        raise ValueError(f"recipe {recipe.name!r} needs a CUDA GPU (device is {device.type}); "
                         f"use --recipe llama-tiny on a CPU.")
    if recipe.needs_module and importlib.util.find_spec(recipe.needs_module) is None:
        raise ValueError(f"recipe {recipe.name!r} needs the {recipe.needs_module!r} package; "
                         f"pip install 'annotate-offload[hf]', or use --recipe llama-tiny.")


def make_batches(cfg: Config, data_path: Optional[str]):
    """:class:`~annotate_offload.data.ByteBatches` for ``cfg`` from the built-in text or ``data_path``.

    Raises:
        ValueError: missing, unreadable or empty file, or text shorter than one sample.
    """
    from .data import ByteBatches, encode, load_text

    return ByteBatches(encode(load_text(data_path)), micro_batch_size=cfg.train.micro_batch_size,
                       seq_length=cfg.model.seq_length, seed=cfg.train.seed)


# --------------------------------------------------------------------------- running a recipe
# Note [CPU memory accounting]: without a GPU, "device memory" is parameters + gradients + device-side
# Adam moments, plus saved activations: outside the layer scopes counted live by an outer
# saved_tensors_hooks pair, inside them what the runtime kept (``OffloadStats.kept_bytes``, parameters
# excluded) and still holds of offloaded layers (``resident_bytes``). The peak adds the peaks of these
# parts, which need not coincide: an upper bound of the live curve ``--plot`` draws.

_MiB = 1 << 20


def _stats(model: nn.Module):
    """The runtime's ``OffloadStats`` of a transformed model's current step, or ``None``."""
    return getattr(getattr(model, "offload_plan", None), "stats", None)


def _runtime_held(stats) -> int:
    if stats is None:
        return 0
    return sum(v for k, v in stats.kept_bytes.items() if k != "parameter") + stats.resident_bytes


class _SavedBytes:
    """Live bytes of tensors saved for backward outside the runtime's scopes (Note [CPU memory accounting])."""

    def __init__(self, model: nn.Module) -> None:
        self.params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self.refs: dict[int, list[int]] = {}  # storage -> [saved tensors alive, bytes]
        self.live = self.peak = 0

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key in self.params or storage.nbytes() == 0:
            return t
        entry = self.refs.setdefault(key, [0, storage.nbytes()])
        if entry[0] == 0:
            self.live += entry[1]
            self.peak = max(self.peak, self.live)
        entry[0] += 1
        weakref.finalize(t, self._drop, key)
        return t

    def _drop(self, key: int) -> None:
        entry = self.refs[key]
        entry[0] -= 1
        if entry[0] == 0:
            self.live -= entry[1]
            del self.refs[key]


class _Tracer:
    """Device memory at the layer boundaries of one step (forward pre/post hooks, backward via grad hooks)."""

    def __init__(self, model: nn.Module, read: Callable[[], int]) -> None:
        self.read, self.samples, self.handles = read, [("start", read())], []
        from .annotate._discover import find_layers

        for i, layer in enumerate(ref.module for ref in find_layers(model)[0]):
            self.handles.append(layer.register_forward_pre_hook(lambda m, a, i=i: self.mark(f"fwd {i}")))
            self.handles.append(layer.register_forward_hook(lambda m, a, out, i=i: self._post(i, out)))

    def mark(self, label: str) -> None:
        self.samples.append((label, self.read()))

    def _post(self, i: int, out) -> None:
        self.mark(f"fwd {i} end")
        t = out if isinstance(out, torch.Tensor) else next((o for o in out if isinstance(o, torch.Tensor)), None)
        if t is not None and t.requires_grad:
            t.register_hook(lambda g: self.mark(f"bwd {i}"))

    def close(self) -> None:
        for h in self.handles:
            h.remove()


@dataclass
class RunResult:
    """One training run of :func:`compare`.

    Attributes:
        label (str): ``"offload"`` or ``"baseline"``.
        losses (list[float]): loss of each step.
        step_ms (list[float]): wall time of each step, ms (CUDA synchronised).
        bytes_offloaded (list[int]): activation bytes copied to host per step.
        peak_bytes (int | None): peak device memory, bytes (see :attr:`Report.memory_source`).
        trace (list[tuple[str, int]]): device memory at layer boundaries over the last step, bytes.
        failure (str | None): why the run stopped early (``"out of memory: ..."``).
        plan (str | None): ``repr(model.offload_plan)``.
        notes (list[str]): warnings raised while setting up.
        planned (PlannerResult | None): the planner's result with ``model.memory_budget``.
        predicted (Prediction | None): the predicted step time and peak, when planned.
        fraction (float): the optimizer's ``offload_fraction`` (``0``: ``torch.optim.AdamW`` on the device).
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
    planned: object = None
    predicted: object = None
    fraction: float = 0.0

    @property
    def median_ms(self) -> float:
        """Median step time without the first step, ms (``nan`` without steps)."""
        return statistics.median(self.step_ms[1:] or self.step_ms) if self.step_ms else math.nan


def _optimizer(model: nn.Module, cfg: Config, fraction: float):
    o = cfg.optimizer
    hyper = dict(lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, weight_decay=o.weight_decay)
    if fraction > 0:
        from .optim import HybridDeviceOptimizer

        return HybridDeviceOptimizer(
            model.parameters(), offload_fraction=fraction, pin_cpu_grads=o.pin_cpu_grads,
            pin_cpu_params=o.pin_cpu_params, overlap_cpu_optimizer_d2h_h2d=o.overlap_cpu_optimizer_d2h_h2d,
            use_torch_optimizer_for_cpu_offload=o.use_torch_optimizer_for_cpu_offload, **hyper)
    return torch.optim.AdamW(model.parameters(), fused=True, **hyper)


def _forward_ctx(cfg: Config, device: torch.device, sdpa_backend: str) -> contextlib.ExitStack:
    stack = contextlib.ExitStack()
    if cfg.model.bf16:
        stack.enter_context(torch.autocast(device.type, dtype=torch.bfloat16))
    if device.type == "cuda" and sdpa_backend != "default":
        from torch.nn.attention import SDPBackend, sdpa_kernel

        stack.enter_context(sdpa_kernel(SDPBackend.EFFICIENT_ATTENTION if sdpa_backend == "efficient" else SDPBackend.MATH))
    return stack


def run(recipe: Recipe, cfg: Config, device: torch.device, batches, *, offload: bool, label: str = "",
        progress: bool = False, sdpa_backend: str = "efficient") -> RunResult:
    """Train ``cfg.train.train_iters`` steps of ``recipe``, with (``offload=True``) or without offloading.

    With ``model.memory_budget`` the transform plans on the first batch and the optimizer takes the plan's
    ``offload_fraction``; the last step is measured per layer. Out of memory ends the run
    (:attr:`RunResult.failure`).
    """
    res = RunResult(label or ("offload" if offload else "baseline"))
    cuda, iters = device.type == "cuda", cfg.train.train_iters
    model = opt = tracer = bar = None
    outer = contextlib.ExitStack()
    try:
        if cuda:
            torch.cuda.empty_cache()
        if cuda and sdpa_backend == "efficient":
            # the efficient SDPA backward is bit-reproducible only with deterministic algorithms on
            from .testing import bit_reproducible

            outer.enter_context(bit_reproducible())
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            model = recipe.build(cfg, device).train()
            hybrid = offload and cfg.optimizer.optimizer_cpu_offload
            res.fraction = cfg.optimizer.optimizer_offload_fraction if hybrid else 0.0
            if offload and cfg.model.cpu_offloading:
                from .annotate import offload_transform

                budget = cfg.model.memory_budget is not None
                with _forward_ctx(cfg, device, sdpa_backend):
                    offload_transform(model, config=cfg,
                                      example_inputs=(batches[0][0].to(device),) if budget else None)
                res.planned = model.offload_plan.planner
                if res.planned is not None:
                    res.predicted = res.planned.prediction
                    res.fraction = res.planned.offload_fraction  # 0.0 when the config keeps the optimizer on device
            opt = _optimizer(model, cfg, res.fraction)
        res.notes = list(dict.fromkeys(str(w.message) for w in caught))
        saved = None if cuda else _SavedBytes(model)
        if saved is not None:
            outer.enter_context(torch.autograd.graph.saved_tensors_hooks(saved.pack, lambda t: t))
            params = list({id(p): p for p in model.parameters()}.values())
            trainable = sum(p.numel() for p in params if p.requires_grad) - int(getattr(opt, "offloaded_numel", 0) or 0)
            static = 2 * sum(p.numel() * p.element_size() for p in params) + 8 * trainable  # + fp32 Adam moments
        in_step = [False]  # the runtime's stats describe live tensors only between forward and end of backward

        def read() -> int:
            if cuda:
                return torch.cuda.memory_allocated(device)
            return static + saved.live + (_runtime_held(_stats(model)) if in_step[0] else 0)

        if progress and importlib.util.find_spec("tqdm") is not None:
            from tqdm.auto import tqdm

            bar = tqdm(total=iters, desc=res.label, unit="step", leave=False, file=sys.stderr)
        act_peak, peak = 0, 0

        def one_step(step: int):
            nonlocal act_peak
            x, y = (t.to(device, non_blocking=True) for t in batches[step])
            in_step[0] = True
            with _forward_ctx(cfg, device, sdpa_backend):
                out = model(x)
                loss = F.cross_entropy(getattr(out, "logits", out).float().flatten(0, 1), y.flatten())
            loss.backward()
            in_step[0] = False
            stats = _stats(model)
            if saved is not None:
                held = 0 if stats is None else _runtime_held(stats) - stats.resident_bytes + stats.peak_resident_bytes
                act_peak = max(act_peak, saved.peak + held)
                saved.peak = saved.live
            if cfg.optimizer.clip_grad > 0:
                clip = getattr(opt, "clip_grad_norm_", None)  # HybridDeviceOptimizer's sees host gradients too
                (clip or (lambda c: torch.nn.utils.clip_grad_norm_(model.parameters(), c)))(cfg.optimizer.clip_grad)
            opt.step()
            opt.zero_grad(set_to_none=True)
            return loss, stats

        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)  # after planning: the step's peak only
        for step in range(iters):
            if step == iters - 1:
                tracer = _Tracer(model, read)
            t0 = time.perf_counter()
            if step == iters - 1 and res.planned is not None:  # one measured step, per layer
                peak = torch.cuda.max_memory_allocated(device) if cuda else 0
                box: list = []
                peak = max(peak, model.offload_plan.measure(lambda: box.append(one_step(step)))["peak_bytes"] or 0)
                loss, stats = box[0]
            else:
                loss, stats = one_step(step)
            if cuda:
                torch.cuda.synchronize(device)
            res.step_ms.append((time.perf_counter() - t0) * 1e3)
            res.losses.append(loss.item())
            res.bytes_offloaded.append(0 if stats is None else stats.bytes_offloaded)
            if bar is not None:
                bar.set_postfix(loss=f"{res.losses[-1]:.4f}")
                bar.update()
        if tracer is not None:
            tracer.mark("step end")
            res.trace = tracer.samples
        res.peak_bytes = max(peak, torch.cuda.max_memory_allocated(device)) if cuda else static + act_peak
        plan = getattr(model, "offload_plan", None)
        res.plan = None if plan is None else repr(plan)  # after the steps: bytes per layer are measured
    except torch.OutOfMemoryError as exc:
        res.failure = "out of memory: " + str(exc).strip().splitlines()[0][:160]
    finally:
        outer.close()
        for done in (bar, tracer, opt):
            getattr(done, "close", lambda: None)()
        del model, opt
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return res


def strategies(planned, cfg: Config) -> dict[str, tuple | str]:
    """The single strategies a user could pick for the plan's budget, sized by the planner from the plan's
    measurements: full recompute (every layer checkpointed) and offload-only (the first ``N`` layers,
    TransformerEngine's choice, with its best schedule), each with the optimizer fraction it needs to
    fit. Per name, ``(config to run, its Prediction)``, or why there is none (``"does not fit ..."``)."""
    from .planner._search import Infeasible, search

    n, out = len(planned.choices), {}
    options = {"full recompute": [("recompute",) * n],
               "offload only": [tuple("offload" if i < k else "keep" for i in range(n)) for k in range(n)]}
    for name, plans in options.items():
        try:
            r = search(planned.measurements, planned.bandwidth, planned.memory_budget, planned.step, plans=plans,
                       host_optimizer=cfg.optimizer.optimizer_cpu_offload)
        except Infeasible as exc:
            out[name] = f"does not fit (needs {_fmt_bytes(exc.smallest)})"
            continue
        model = dataclasses.replace(cfg.model, memory_budget=None, recompute=name == "full recompute",
                                    cpu_offloading_num_layers=r.choices.count("offload"),
                                    release_lag=r.release_lag, prefetch_layers=r.prefetch_layers)
        optimizer = dataclasses.replace(cfg.optimizer, optimizer_offload_fraction=r.prediction.offload_fraction)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # a 0.0 fraction with optimizer offload on warns; run() uses AdamW then
            out[name] = (dataclasses.replace(cfg, model=model, optimizer=optimizer), r.prediction)
    return out


@dataclass
class Report:
    """The runs of :func:`compare` and the parity verdict.

    Attributes:
        recipe (Recipe), cfg (Config), device (torch.device): what ran.
        offload (RunResult): the offloaded run (the first round's).
        baseline (RunResult | None): the run without offloading (``None`` with ``--no-compare-baseline``).
        rounds (dict[str, list[RunResult]]): every method's run per round, ``offload`` and ``baseline`` included.
    """

    recipe: Recipe
    cfg: Config
    device: torch.device
    offload: RunResult
    baseline: Optional[RunResult]
    rounds: dict

    @property
    def exact(self) -> bool:
        """Whether parity means identical losses (activation offload only) rather than ``|Δloss| < 1e-3``."""
        return not self.cfg.optimizer.optimizer_cpu_offload

    @property
    def memory_source(self) -> str:
        return ("torch.cuda.max_memory_allocated" if self.device.type == "cuda"
                else "CPU: runtime accounting, an upper bound, see Note [CPU memory accounting]")

    def delta(self, run: RunResult) -> Optional[float]:
        """``max |loss - loss_baseline|`` over the steps both completed, or ``None``."""
        if self.baseline is None or self.baseline.failure or not self.baseline.losses or not run.losses:
            return None
        return max(abs(a - b) for a, b in zip(run.losses, self.baseline.losses))

    @property
    def ok(self) -> bool:
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
        delta = self.delta(self.offload)
        if self.exact:
            return ("PASS: identical losses" if self.offload.losses == self.baseline.losses else
                    f"FAIL: losses differ (max |Δloss| = {delta:.3g}); activation offload must be a bit-exact copy")
        if delta is not None and delta < 1e-3:
            return f"PASS: max |Δloss| = {delta:.3g} < 0.001"
        return f"FAIL: max |Δloss| = {delta} >= 0.001 (Megatron Bridge's criterion)"

    def step_ms(self, label: str) -> float:
        """The method's step time: the median over rounds of each run's median step, ms."""
        return statistics.median(r.median_ms for r in self.rounds[label]) if self.rounds.get(label) else math.nan

    def table(self) -> str:
        """The report printed by ``annotate-offload train`` (markdown tables)."""
        c, m, rounds = self.cfg, self.cfg.model, self.rounds
        if not m.cpu_offloading:
            acts = "activations: off"
        elif m.memory_budget is not None:
            acts = f"activations planned for memory_budget={m.memory_budget} (the plan is below)"
        else:
            acts = f"activations of the first {m.cpu_offloading_num_layers} of {m.num_layers} layers"
        opt = (f"optimizer: {self.offload.fraction:g} of parameters stepped on the host"
               if self.offload.fraction > 0 else "optimizer: on device")
        n_rounds = max(len(v) for v in rounds.values())
        lines = [f"annotate-offload train: recipe {self.recipe.name} on {self.device.type}, torch {torch.__version__}, "
                 f"{c.train.train_iters} steps of {c.train.micro_batch_size}x{m.seq_length} tokens, seed {c.train.seed}",
                 f"offload: {acts}; {opt}", ""]
        n = len(self.offload.losses)
        every = max(1, math.ceil(n / 20))
        head = "| step | loss (offload) |" + (" loss (baseline) | abs delta |" if self.baseline else "")
        lines += [head, "|" + "---:|" * (head.count("|") - 1)]
        for i in (i for i in range(n) if i % every == 0 or i == n - 1):
            row = f"| {i + 1} | {self.offload.losses[i]:.6f} |"
            if self.baseline:
                b = self.baseline.losses[i] if i < len(self.baseline.losses) else None
                row += f" {b:.6f} | {abs(self.offload.losses[i] - b):.3g} |" if b is not None else " - | - |"
            lines.append(row)
        if every > 1:
            lines.append(f"(every {every}th step shown; the delta is over all steps)")

        def cells(fn) -> str:
            return " | ".join(runs[0].failure if runs[0].failure else fn(label, runs) for label, runs in rounds.items())

        def peak(runs, key) -> Optional[int]:
            values = [getattr(r, key) if key == "peak_bytes" else r.predicted and r.predicted.peak_bytes for r in runs]
            return max((v for v in values if v is not None), default=None)

        base = self.step_ms("baseline") if "baseline" in rounds else math.nan
        delta = self.delta(self.offload)
        crit = "identical losses (activation offload only)" if self.exact else "< 0.001 (optimizer offload)"
        steps = "median, first step excluded" + (f"; median of {n_rounds} rounds, order rotated" if n_rounds > 1 else "")
        lines += ["", "| | " + " | ".join(rounds) + " |", "|---|" + "---:|" * len(rounds),
                  f"| peak device memory ({self.memory_source}) | "
                  f"{cells(lambda _, r: _fmt_bytes(peak(r, 'peak_bytes')))} |",
                  f"| step time ({steps}) | {cells(lambda label, _: f'{self.step_ms(label):.1f} ms')} |",
                  f"| bytes offloaded per step | {cells(lambda _, r: _fmt_bytes(max(r[0].bytes_offloaded, default=0)))} |"]
        if any(r[0].predicted is not None for r in rounds.values()):
            lines += [f"| predicted peak | {cells(lambda _, r: _fmt_bytes(peak(r, 'predicted')))} |",
                      f"| predicted step time | "
                      f"{cells(lambda _, r: f'{r[0].predicted.step_ms:.1f} ms' if r[0].predicted else '-')} |",
                      f"| optimizer offload_fraction | {cells(lambda _, r: f'{r[0].fraction:.3f}')} |"]
        if math.isfinite(base):
            lines += [f"| step / baseline | {cells(lambda label, _: f'{self.step_ms(label) / base:.2f}x')} |",
                      f"| max abs Δloss vs baseline | {cells(lambda _, r: f'{self.delta(r[0]):.3g}')} |"]
        singles = {k: v for k in ("full recompute", "offload only") if math.isfinite(v := self.step_ms(k))}
        if singles:
            best = min(singles, key=singles.get)
            lines.append(f"\nthe plan is {(1 - self.step_ms('offload') / singles[best]) * 100:.1f}% faster than the "
                         f"best single strategy ({best}, {singles[best]:.1f} ms)")
        lines += ["", f"max |Δloss| = {'-' if delta is None else f'{delta:.3g}'} (criterion: {crit}) -> {self.verdict}"]
        if self.offload.plan:
            lines += ["", self.offload.plan]
        return "\n".join(lines + [f"note: {w}" for w in self.offload.notes])

    def plot(self, path: str) -> None:
        """Write ``path``: device memory over the last step (both runs) and both loss curves."""
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        runs = [r for r in (self.offload, self.baseline) if r is not None and r.losses]
        fig, (ax_mem, ax_loss) = plt.subplots(1, 2, figsize=(12, 4.5))
        for r in runs:
            ax_mem.plot([v / _MiB for _, v in r.trace], marker=".", label=r.label)
            ax_loss.plot(range(1, len(r.losses) + 1), r.losses, label=r.label, linestyle="-" if r is self.offload else "--")
        ref = max(runs, key=lambda r: len(r.trace), default=None)
        if ref is not None and ref.trace:
            ticks = list(range(0, len(ref.trace), max(1, len(ref.trace) // 12)))
            ax_mem.set_xticks(ticks, [ref.trace[i][0] for i in ticks], rotation=60, fontsize=7)
        ax_mem.set(ylabel="device memory (MiB)")
        ax_mem.set_title(f"memory over one step ({self.memory_source.split(',')[0]})", fontsize=9)
        ax_loss.set(xlabel="step", ylabel="loss")
        ax_loss.set_title(f"{self.recipe.name}: {self.verdict}", fontsize=9)
        for ax in (ax_mem, ax_loss):
            ax.legend()
        fig.tight_layout()
        fig.savefig(path, dpi=110)
        plt.close(fig)


def compare(recipe: Recipe, cfg: Config, device: torch.device, batches, *, baseline: bool = True,
            rounds: int = 1, compare_strategies: bool = False, progress: bool = False,
            sdpa_backend: str = "efficient") -> Report:
    """Run ``recipe`` with offloading, then (``baseline=True``) without, same seed and data; with
    ``compare_strategies`` (needs ``model.memory_budget``) also the single strategies of :func:`strategies`.
    ``rounds`` repeats every method, each round in an order rotated by one."""
    kw = dict(progress=progress, sdpa_backend=sdpa_backend)
    methods = ["offload"] + ["baseline"] * baseline + ["full recompute", "offload only"] * compare_strategies
    runs: dict[str, list[RunResult]] = {name: [] for name in methods}
    singles: dict = {}
    for r in range(rounds):
        for name in methods[r % len(methods):] + methods[:r % len(methods)]:
            if name in ("offload", "baseline"):
                res = run(recipe, cfg, device, batches, offload=name == "offload", **kw)
            else:
                planned = runs["offload"][0].planned
                singles = singles or (strategies(planned, cfg) if planned is not None else {})
                entry = singles.get(name, "not planned (the offloaded run has no plan)")
                if isinstance(entry, str):
                    res = RunResult(name, failure=entry)
                else:
                    res = run(recipe, entry[0], device, batches, offload=True, label=name, **kw)
                    res.predicted = entry[1]
            runs[name].append(res)
    return Report(recipe, cfg, device, runs["offload"][0], runs["baseline"][0] if baseline else None, runs)


def plan_text(recipe: Recipe, cfg: Config, device: torch.device) -> str:
    """What ``annotate-offload plan`` prints, training nothing: the offload plan with its bytes per layer
    estimated on the meta device from one micro-batch (with ``model.memory_budget``, planned on ``device``),
    and the predicted device memory of parameters, gradients and optimizer state with and without offload.
    A CUDA-only recipe is planned elsewhere with uninitialised weights, and without a memory budget."""
    lines = [f"annotate-offload plan: recipe {recipe.name} on {device.type} ({recipe.summary})"]
    elsewhere = recipe.needs_cuda and device.type != "cuda"
    if elsewhere:
        model = recipe.build(cfg, torch.device("meta")).to_empty(device=device)
        lines.append(f"(planned without a GPU: weights uninitialised, shapes and dtypes only; "
                     f"train --recipe {recipe.name} needs a CUDA GPU)")
    else:
        model = recipe.build(cfg, device)
    notes: list[str] = []
    host = cfg.optimizer.optimizer_offload_fraction if cfg.optimizer.optimizer_cpu_offload else 0.0
    if cfg.model.cpu_offloading and cfg.model.memory_budget is not None and elsewhere:
        host = 0.0
        lines.append(f"model.memory_budget={cfg.model.memory_budget}: the planner measures the layers on the GPU the "
                     f"recipe trains on; run this on a CUDA machine, or pass model.memory_budget=None "
                     f"model.cpu_offloading_num_layers=N for a fixed plan's estimate")
    elif cfg.model.cpu_offloading:
        from .annotate import offload_transform

        x = torch.zeros(cfg.train.micro_batch_size, cfg.model.seq_length, dtype=torch.int64, device=device)
        with warnings.catch_warnings(record=True) as caught:  # a budget is measured in config.model.bf16's autocast
            warnings.simplefilter("always")
            offload_transform(model, config=cfg, example_inputs=(x,))
        notes = list(dict.fromkeys(str(w.message) for w in caught))
        lines.append(repr(model.offload_plan))
        if model.offload_plan.planner is not None:
            host = model.offload_plan.planner.offload_fraction  # 0.0 when the config keeps the optimizer on device
    else:
        lines.append("activation offload is off (model.cpu_offloading=False)")
    params = list({id(p): p for p in model.parameters()}.values())
    p_bytes, adam = sum(p.numel() * p.element_size() for p in params), 8 * sum(p.numel() for p in params)
    rows = [("parameters", p_bytes, p_bytes), ("gradients", p_bytes, p_bytes),
            ("optimizer state (fp32 Adam moments)", adam, round(adam * (1 - host)))]
    lines += ["", "| predicted device memory | baseline | offload |", "|---|---:|---:|"]
    lines += [f"| {name} | {_fmt_bytes(b)} | {_fmt_bytes(w)} |" for name, b, w in rows]
    lines += ["", f"(saved activations: the plan's bytes/step move to host memory; {host:g} of the parameter "
              "elements are stepped on the host, their masters and moments in host memory)"]
    return "\n".join(lines + [f"note: {n}" for n in notes])
