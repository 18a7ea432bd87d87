"""Hugging Face ``Trainer`` (and TRL's trainers, which are ``Trainer``\\ s): :class:`OffloadCallback`.

Usage::

    from annotate_offload import HybridDeviceOptimizer
    from annotate_offload.integrations.transformers import OffloadCallback

    trainer = Trainer(model, args, train_dataset=ds, callbacks=[OffloadCallback(num_layers=8)],
                      optimizer_cls_and_kwargs=(HybridDeviceOptimizer, {"lr": 1e-4, "offload_fraction": 0.5}))

Trainer gives the optimizer its weight-decay groups (``TrainingArguments.weight_decay``, none for
biases and norms) and the learning rate of ``optimizer_cls_and_kwargs``; it clips with
``max_grad_norm`` through accelerate, which the default (exact) optimizer mode supports.
"""

from __future__ import annotations

import contextlib
import logging
import warnings
import weakref
from collections.abc import Mapping
from typing import Any

import torch
from torch.utils._pytree import tree_map
from transformers import TrainerCallback

from ..errors import OffloadError
from ..optim import HybridDeviceOptimizer
from ._common import Offload, as_config, check_modes, hybrid_of

__all__ = ["OffloadCallback", "optimizer_cls_and_kwargs"]

logger = logging.getLogger(__name__)

# TrainingArguments that Trainer applies in place of the config's optimizer fields
_TRAINER_OWNS = (("learning_rate", "lr"), ("weight_decay", "weight_decay"), ("max_grad_norm", "clip_grad"))


def optimizer_cls_and_kwargs(config: Any) -> tuple[type, dict[str, Any]]:
    """``Trainer(optimizer_cls_and_kwargs=...)`` from a config's optimizer section (Megatron Bridge names):
    ``HybridDeviceOptimizer`` with ``optimizer_cpu_offload=True``, else ``torch.optim.AdamW(fused=True)``.
    Trainer applies its own ``weight_decay`` and ``max_grad_norm``: an :class:`OffloadCallback` built from
    the same config refuses TrainingArguments that disagree.

    Args:
        config (Config | OptimizerConfig | Mapping): e.g. ``{"optimizer": {"optimizer_cpu_offload": True,
            "optimizer_offload_fraction": 0.5, "lr": 1e-4}}``.

    Returns:
        tuple[type, dict]: ``(optimizer class, keyword arguments)``.

    Raises:
        TypeError, ValueError: an invalid config (field, value and fix in the message).
    """
    o = as_config(config, "optimizer_cls_and_kwargs")[0].optimizer
    kwargs = dict(lr=o.lr, betas=(o.adam_beta1, o.adam_beta2), eps=o.adam_eps, weight_decay=o.weight_decay)
    if not o.optimizer_cpu_offload:
        return torch.optim.AdamW, {**kwargs, "fused": True}
    return HybridDeviceOptimizer, {**kwargs, "offload_fraction": o.optimizer_offload_fraction,
                                   "overlap_cpu_optimizer_d2h_h2d": o.overlap_cpu_optimizer_d2h_h2d,
                                   "use_torch_optimizer_for_cpu_offload": o.use_torch_optimizer_for_cpu_offload,
                                   "pin_cpu_grads": o.pin_cpu_grads, "pin_cpu_params": o.pin_cpu_params}


class OffloadCallback(TrainerCallback):
    """Offload activations (and check the optimizer) in Hugging Face ``Trainer`` and TRL's trainers.

    At train begin, once per model: refuses optimizer modes the run would silently break, transforms
    ``trainer.model`` with ``offload_transform`` and, after the first step, logs the plan (INFO, world
    process zero). Under ``torchrun`` (DDP) a ``HybridDeviceOptimizer`` is attached to Trainer's
    ``DistributedDataParallel`` model at its first training forward with ``shard_host_step=False``, so
    ``optimizer.state_dict()`` needs no collective and Trainer's checkpoints save and resume it.

    Args:
        num_layers (int | None): offload the first ``N`` decoder layers (``0 <= N < L``). Required unless
            ``memory_budget`` or the config's ``cpu_offloading_num_layers``/``memory_budget`` is given.
        memory_budget (int | str | None): the step's peak device memory, e.g. ``"20GiB"``: the planner
            chooses per layer at train begin, measuring the first training batch (taken without
            advancing the data order) under the run's bf16/fp16 autocast, for the optimizer Trainer built (a
            ``HybridDeviceOptimizer``'s ``offload_fraction``, else on the device); ``None``: no budget.
        config (Config | ModelConfig | Mapping | None): Megatron Bridge names; see :meth:`from_config`.
        **fields: ``offload_transform``'s keyword fields: ``min_offload_numel``, ``release_lag``,
            ``prefetch_layers``, ``recompute``, ``offload_policy``.

    Raises:
        TypeError, ValueError: bad arguments, at construction (``offload_transform``'s checks).
        ValueError: at train begin, before the first step: ``offload_gradients=True`` or
            ``step_in_backward=True`` (Trainer reads the gradient norm every step, for ``max_grad_norm``
            and for its logged ``grad_norm``); TRL's ``activation_offloading=True`` too; a config with
            ``optimizer_cpu_offload=True`` and another optimizer, or whose ``lr``/``weight_decay``/
            ``clip_grad`` differ from ``learning_rate``/``weight_decay``/``max_grad_norm``.
        OffloadError: a distributed run whose model is not ``DistributedDataParallel`` (FSDP, DeepSpeed)
            with a ``HybridDeviceOptimizer``.
    """

    def __init__(self, num_layers: int | None = None, *, memory_budget: int | str | None = None,
                 config: Any = None, **fields: Any) -> None:
        self._offload = Offload("OffloadCallback", num_layers, memory_budget, config, fields, inputs="")
        self._attached: Any = lambda: None  # weakly, the optimizer attached to Trainer's DDP model
        self._log_plan = False

    @classmethod
    def from_config(cls, config: Any) -> "OffloadCallback":
        """The callback of a config with this package's Megatron Bridge names, as a YAML recipe carries it
        (e.g. ``{"model": {"cpu_offloading": True, "cpu_offloading_num_layers": 8}}``; its optimizer section
        goes to :func:`optimizer_cls_and_kwargs`); ``TypeError`` or ``ValueError`` for an invalid one."""
        return cls(config=config)

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None,
                       train_dataloader: Any = None, **kwargs: Any) -> None:
        opt = hybrid_of(optimizer)
        self._check(args, opt)
        if self._offload.wants(model):
            example = _first_batch(train_dataloader, args.device) if self._offload.budget else None
            with _autocast(args):
                self._offload.transform(model, example, opt)
            self._log_plan = state.is_world_process_zero
        if opt is not None and opt is not self._attached() and torch.distributed.is_available() \
                and torch.distributed.is_initialized() and torch.distributed.get_world_size() > 1:
            _AttachToDDP(model, opt)
            self._attached = weakref.ref(opt)

    def on_step_end(self, args: Any, state: Any, control: Any, optimizer: Any = None, **kwargs: Any) -> None:
        if (control.should_save or control.should_training_stop) and (opt := hybrid_of(optimizer)) is not None:
            opt.flush()  # delayed_param_update: the model Trainer saves, and returns, holds the last update
        if self._log_plan:
            logger.info("annotate_offload plan after the first step:\n%r", self._offload.model.offload_plan)
            self._log_plan = False

    def _check(self, args: Any, opt: Any) -> None:
        who = "OffloadCallback"
        if opt is not None:
            why = (f"to clip at max_grad_norm={args.max_grad_norm!r} and to log grad_norm" if args.max_grad_norm else
                   f"to log grad_norm, also with max_grad_norm={args.max_grad_norm!r}")
            check_modes(opt, who, (f"Trainer computes the gradient norm with clip_grad_norm_ at every step ({why})", ""),
                        ("gradient_accumulation_steps", args.gradient_accumulation_steps))
        if self._offload.settings is not None and getattr(args, "activation_offloading", False):
            raise ValueError(f"{who}: {type(args).__name__}(activation_offloading=True) offloads activations with "
                             "TRL's own hooks as well; pass activation_offloading=False to offload with this callback, "
                             "or remove the callback.")
        if not self._offload.optimizer_section:
            return
        section = self._offload.config.optimizer
        if section.optimizer_cpu_offload and opt is None:
            raise ValueError(f"{who}: the config has optimizer.optimizer_cpu_offload=True but Trainer's optimizer is not "
                             "a HybridDeviceOptimizer; pass Trainer(optimizer_cls_and_kwargs=optimizer_cls_and_kwargs("
                             "config)) (from annotate_offload.integrations.transformers).")
        for arg, name in _TRAINER_OWNS:
            if getattr(args, arg) != getattr(section, name):
                raise ValueError(f"{who}: the config has optimizer.{name}={getattr(section, name)!r} but "
                                 f"TrainingArguments.{arg}={getattr(args, arg)!r}, which Trainer applies; set "
                                 f"TrainingArguments({arg}={getattr(section, name)!r}) or optimizer.{name}="
                                 f"{getattr(args, arg)!r} so they agree.")


class _AttachToDDP:
    """Forward pre-hook on Trainer's model: at its first training forward, under the DDP wrapper Trainer
    built (accelerate's ``prepare``), attach the optimizer to it, then remove itself."""

    def __init__(self, model: torch.nn.Module, opt: Any) -> None:
        self.model, self.opt = model, opt
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module: torch.nn.Module, args: tuple) -> None:
        if not torch.is_grad_enabled():
            return  # an evaluation forward runs outside DDP
        from torch.nn.parallel import DistributedDataParallel

        from ..distributed import attach_optimizer

        ddp = DistributedDataParallel._get_active_ddp_module()  # DDP's record of the wrapper running (for Dynamo)
        self.handle.remove()
        if ddp is None or ddp.module is not self.model:
            raise OffloadError(
                "OffloadCallback: this distributed Trainer run does not train the model through "
                "DistributedDataParallel (FSDP or DeepSpeed?); a HybridDeviceOptimizer is supported there under DDP "
                "only. Use torch.optim.AdamW, or launch without FSDP/DeepSpeed.")
        with warnings.catch_warnings():  # Trainer's DDP has gradient_as_bucket_view=False and no way to change it
            warnings.filterwarnings("ignore", r"register_offload_comm_hook: DistributedDataParallel\(gradient_as_bucket")
            attach_optimizer(ddp, self.opt, shard_host_step=False)


def _first_batch(loader: Any, device: torch.device) -> Any:
    """The first batch of Trainer's training loader, on ``device``, without advancing the run: torch's own
    iteration over the loader's sampler (not accelerate's, which records its position), with the RNG restored."""
    if loader is None:
        raise ValueError("OffloadCallback: memory_budget needs the training dataloader to plan on its first batch, "
                         "but Trainer gave none; pass num_layers=N instead.")
    with torch.random.fork_rng(devices=[]):
        batch = next(iter(torch.utils.data.DataLoader.__iter__(loader)))
    batch = dict(batch) if isinstance(batch, Mapping) else batch  # BatchEncoding
    return tree_map(lambda t: t.to(device) if isinstance(t, torch.Tensor) else t, batch)


def _autocast(args: Any) -> Any:
    """The autocast Trainer's forward runs in, for the planner's measurements."""
    dtype = torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else None
    return torch.autocast(args.device.type, dtype=dtype) if dtype is not None else contextlib.nullcontext()
