"""Lightning: :class:`OffloadCallback`.

Usage::

    from annotate_offload import HybridDeviceOptimizer
    from annotate_offload.integrations.lightning import OffloadCallback

    class LitModel(L.LightningModule):
        def configure_optimizers(self):
            return HybridDeviceOptimizer(self.parameters(), offload_fraction=0.5, lr=1e-4)

    L.Trainer(precision="bf16-mixed", gradient_clip_val=1.0, callbacks=[OffloadCallback(num_layers=8)]).fit(LitModel())
"""

from __future__ import annotations

from typing import Any

import lightning.pytorch as pl
import torch
from lightning.pytorch.plugins.precision import MixedPrecision
from lightning.pytorch.utilities.rank_zero import rank_zero_info
from torch.nn.parallel import DistributedDataParallel
from torch.utils._pytree import tree_map

from ..distributed import attach_optimizer
from ._common import Offload, check_modes, hybrid_of

__all__ = ["OffloadCallback"]


class OffloadCallback(pl.Callback):
    """Offload activations (and wire ``HybridDeviceOptimizer``) in a Lightning ``Trainer``.

    At fit start, for each ``HybridDeviceOptimizer`` ``configure_optimizers`` returned: refuses the modes
    the run would silently break; under ``bf16-mixed`` (no ``GradScaler``) clears its
    ``_step_supports_amp_scaling``, with which Lightning refuses ``gradient_clip_val`` (Note
    [GradScaler]); under DDP attaches it with ``shard_host_step=False``, so ``optimizer.state_dict()``
    needs no collective. Then, once per model, transforms the ``LightningModule`` with
    ``offload_transform`` and, after the first optimizer step, logs the plan on rank zero.

    Args:
        num_layers (int | None): offload the first ``N`` repeated layers (``0 <= N < L``). Required unless
            ``memory_budget`` or the config's ``cpu_offloading_num_layers``/``memory_budget`` is given.
        memory_budget (int | str | None): the step's peak device memory, e.g. ``"20GiB"``, planned at fit
            start on ``example_inputs`` under the run's autocast, for the optimizer ``configure_optimizers``
            returned (a ``HybridDeviceOptimizer``'s ``offload_fraction``, else on the device); ``None``: no budget.
        example_inputs (Tensor | tuple | dict | None): one training step's inputs to the ``LightningModule``'s
            forward, moved to its device; required with a budget. Default: ``None``.
        config (Config | ModelConfig | Mapping | None): Megatron Bridge names, see :meth:`from_config`.
        **fields: ``offload_transform``'s keyword fields: ``min_offload_numel``, ``release_lag``,
            ``prefetch_layers``, ``recompute``, ``offload_policy``.

    Raises:
        TypeError, ValueError: bad arguments, at construction (``offload_transform``'s checks; a budget
            without ``example_inputs``).
        ValueError: at fit start, before the first step: ``offload_gradients=True`` with ``gradient_clip_val``;
            ``step_in_backward=True`` with ``gradient_clip_val`` or ``accumulate_grad_batches > 1``;
            ``offload_gradients=True`` under DDP (``attach_optimizer``'s refusal); a config with
            ``optimizer_cpu_offload=True`` and no ``HybridDeviceOptimizer``.
    """

    def __init__(self, num_layers: int | None = None, *, memory_budget: int | str | None = None,
                 example_inputs: Any = None, config: Any = None, **fields: Any) -> None:
        self._offload = Offload("OffloadCallback", num_layers, memory_budget, config, fields)
        if self._offload.budget and example_inputs is None:
            raise ValueError(f"OffloadCallback: memory_budget={self._offload.settings.memory_budget!r} needs "
                             "example_inputs=, one training step's inputs to the LightningModule's forward, to plan "
                             "on; pass e.g. example_inputs=(input_ids,).")
        self.example_inputs = example_inputs
        self._log_plan = False

    @classmethod
    def from_config(cls, config: Any, example_inputs: Any = None) -> "OffloadCallback":
        """The callback of a config with this package's Megatron Bridge names, as a YAML recipe carries it
        (e.g. ``{"model": {"cpu_offloading": True, "cpu_offloading_num_layers": 8}}``); ``TypeError`` or
        ``ValueError`` for an invalid one (unknown keys name the closest valid one)."""
        return cls(config=config, example_inputs=example_inputs)

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        opts = [o for o in map(hybrid_of, trainer.optimizers) if o is not None]
        if self._offload.optimizer_section and self._offload.config.optimizer.optimizer_cpu_offload and not opts:
            raise ValueError("OffloadCallback: the config has optimizer.optimizer_cpu_offload=True but "
                             "configure_optimizers returned no HybridDeviceOptimizer; return "
                             "HybridDeviceOptimizer(self.parameters(), ...) from it.")
        plugin = trainer.precision_plugin
        clip = trainer.gradient_clip_val or 0
        for opt in opts:
            check_modes(opt, "OffloadCallback", (f"gradient_clip_val={clip!r} clips with clip_grad_norm_",
                                                 ", or set gradient_clip_val=None") if clip > 0 else None,
                        ("accumulate_grad_batches", trainer.accumulate_grad_batches))
        for opt in opts:
            if isinstance(plugin, MixedPrecision) and plugin.scaler is None:
                opt._step_supports_amp_scaling = False  # no GradScaler reads it; Lightning's clip check does
            if isinstance(trainer.strategy.model, DistributedDataParallel):  # a new wrapper and optimizer per fit
                attach_optimizer(trainer.strategy.model, opt, shard_host_step=False)
        if self._offload.wants(pl_module):
            example = tree_map(lambda t: t.to(pl_module.device) if isinstance(t, torch.Tensor) else t,
                               self.example_inputs)
            with plugin.forward_context():
                self._offload.transform(pl_module, example, opts[0] if len(opts) == 1 else None)
            self._log_plan = trainer.is_global_zero

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        for opt in filter(None, map(hybrid_of, trainer.optimizers)):
            opt.flush()  # delayed_param_update: the model fit() leaves holds the last update

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule, *args: Any) -> None:
        if self._log_plan and trainer.global_step > 0:
            rank_zero_info(f"annotate_offload plan after the first step:\n{pl_module.offload_plan!r}")
            self._log_plan = False
