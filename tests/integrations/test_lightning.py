"""Lightning with OffloadCallback and HybridDeviceOptimizer: the same run as AdamW(fused=True) without them."""

from __future__ import annotations

import re

import pytest
import torch

pl = pytest.importorskip("lightning.pytorch")

from lightning.pytorch.callbacks import ModelCheckpoint  # noqa: E402
from lightning.pytorch.plugins.precision import MixedPrecision  # noqa: E402

from annotate_offload import HybridDeviceOptimizer  # noqa: E402
from annotate_offload.integrations.lightning import OffloadCallback  # noqa: E402

from ._tiny import ADAMW, HYBRID, OFFLOAD, llama, same, tokens  # noqa: E402

pytestmark = pytest.mark.usefixtures("in_tmp")  # Lightning's default_root_dir


class Lit(pl.LightningModule):
    """A tiny Llama that records each step's loss and gradient norm (before clipping)."""

    def __init__(self, optimizer) -> None:
        super().__init__()
        self.model, self.optimizer = llama(), optimizer
        self.losses, self.norms = [], []

    def forward(self, input_ids):
        return self.model(input_ids=input_ids, labels=input_ids).loss

    def training_step(self, batch, i):
        loss = self(batch)
        self.losses.append(loss.item())
        return loss

    def on_before_optimizer_step(self, optimizer):
        self.norms.append(torch.nn.utils.get_total_norm([p.grad for p in self.parameters() if p.grad is not None]).item())

    def configure_optimizers(self):
        cls, kwargs = self.optimizer
        opt = cls(self.parameters(), **kwargs)
        if cls is torch.optim.AdamW and self.trainer.precision == "bf16-mixed":
            opt._step_supports_amp_scaling = False  # as the callback does: Lightning refuses clipping otherwise
        return opt


def fit(optimizer, callbacks=(), *, ckpt_path=None, epochs=2, root=".", seq=16, **kwargs) -> Lit:
    lit = Lit(optimizer)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_epochs=epochs, callbacks=list(callbacks), logger=False,
                         enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                         enable_progress_bar=False, enable_model_summary=False, default_root_dir=str(root), **kwargs)
    trainer.fit(lit, torch.utils.data.DataLoader(tokens(16, seq), batch_size=4), ckpt_path=ckpt_path)
    return lit


def check_same(a: Lit, b: Lit) -> None:
    same(a.losses, b.losses)
    same(a.norms, b.norms)
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("kwargs", [{}, {"precision": "bf16-mixed", "gradient_clip_val": 0.5},
                                    {"accumulate_grad_batches": 2, "gradient_clip_val": 0.5}],
                         ids=["fp32", "bf16_clip", "accumulate_clip"])
def test_lightning_equals_adamw(kwargs):
    base = fit(ADAMW, **kwargs)
    ours = fit(HYBRID, [OffloadCallback(**OFFLOAD)], **kwargs)
    check_same(base, ours)
    assert ours.offload_plan.offloaded_layers == (0, 1) and ours.offload_plan.bytes_per_step > 0


def test_the_model_fit_leaves_holds_the_last_delayed_update():
    lit = fit((HybridDeviceOptimizer, {"lr": 1e-3, "offload_fraction": 1.0, "delayed_param_update": True}),
              [OffloadCallback(**OFFLOAD)], epochs=1)
    after = [p.detach().clone() for p in lit.parameters()]
    lit.trainer.optimizers[0].flush()
    assert all(torch.equal(a, p) for a, p in zip(after, lit.parameters()))


def test_lightning_16_mixed_keeps_gradscaler_exact():
    # Lightning maps precision="16-mixed" to bf16 on a CPU; the plugin keeps fp16 and a GradScaler. Its scale
    # starts high enough that fp16 gradients overflow: the first steps are skipped, then halved, in both runs.
    def plugin():
        return [MixedPrecision("16-mixed", "cpu", scaler=torch.amp.GradScaler("cpu", init_scale=2.0**24))]

    base, ours = fit(ADAMW, plugins=plugin()), fit(HYBRID, [OffloadCallback(**OFFLOAD)], plugins=plugin())
    check_same(base, ours)
    assert ours.trainer.precision_plugin.scaler.get_scale() < 2.0**24  # steps were skipped
    assert ours.trainer.optimizers[0]._step_supports_amp_scaling  # GradScaler hands it the scale


def test_lightning_resumes_at_an_epoch_boundary(tmp_path):
    def callbacks():
        return [OffloadCallback(**OFFLOAD), ModelCheckpoint(tmp_path, save_top_k=-1, every_n_epochs=1)]

    full = fit(HYBRID, callbacks(), root=tmp_path)
    resumed = fit(HYBRID, callbacks(), root=tmp_path, ckpt_path=tmp_path / "epoch=0-step=4.ckpt")
    same(full.losses[4:], resumed.losses)
    same(full.norms[4:], resumed.norms)
    assert all(torch.equal(p, q) for p, q in zip(full.parameters(), resumed.parameters()))
    assert resumed.offload_plan.bytes_per_step > 0


@pytest.mark.parametrize("optimizer, callback, kwargs, match", [
    ((HybridDeviceOptimizer, {"lr": 1e-3, "offload_gradients": True}), {}, {"gradient_clip_val": 1.0},
     r"offload_gradients=True\) frees .* but gradient_clip_val=1.0 clips .* Fix: build the optimizer with "
     r"offload_gradients=False .*, or set gradient_clip_val=None"),
    ((HybridDeviceOptimizer, {"lr": 1e-3, "step_in_backward": True}), {}, {"gradient_clip_val": 1.0},
     r"step_in_backward=True\) steps .* but gradient_clip_val=1.0 clips"),
    ((HybridDeviceOptimizer, {"lr": 1e-3, "step_in_backward": True}), {}, {"accumulate_grad_batches": 2},
     r"step_in_backward=True\) steps .* but accumulate_grad_batches=2 accumulates .* or set accumulate_grad_batches=1"),
    (ADAMW, {"config": {"model": {"cpu_offloading": True, "cpu_offloading_num_layers": 2},
                        "optimizer": {"optimizer_cpu_offload": True}}}, {},
     r"optimizer_cpu_offload=True but configure_optimizers returned no HybridDeviceOptimizer"),
], ids=["offload_gradients_clip", "step_in_backward_clip", "step_in_backward_accumulate", "not_hybrid"])
def test_lightning_refuses_before_the_first_step(optimizer, callback, kwargs, match):
    lit = Lit(optimizer)
    weights = [p.detach().clone() for p in lit.parameters()]
    cb = OffloadCallback(**callback) if callback else OffloadCallback(**OFFLOAD)
    trainer = pl.Trainer(accelerator="cpu", max_epochs=1, callbacks=[cb], logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, **kwargs)
    with pytest.raises(ValueError, match=match):
        trainer.fit(lit, torch.utils.data.DataLoader(tokens(16, 16), batch_size=4))
    assert trainer.global_step == 0 and not lit.losses
    assert all(torch.equal(a, b) for a, b in zip(weights, lit.parameters()))


@pytest.mark.parametrize("budget, error, match", [
    ("lots", ValueError, "memory_budget='lots' is not a memory size"), (-5, ValueError, "memory_budget=-5 must be positive"),
    (0, ValueError, "memory_budget=0 must be positive"), ([1], TypeError, r"memory_budget must be bytes .* got \[1\]")])
def test_lightning_checks_the_budget_at_construction(budget, error, match):
    with pytest.raises(error, match=rf"^OffloadCallback: {match}"):
        OffloadCallback(memory_budget=budget, example_inputs=(torch.zeros(1, 4, dtype=torch.long),))
    with pytest.raises(error, match=rf"^OffloadCallback: {match}"):  # the bad value first, then the missing inputs
        OffloadCallback(memory_budget=budget)


def test_lightning_memory_budget_plans_on_example_inputs():
    example = (tokens(4, 64)[:4],)  # one step's batch; activations outweigh weights and optimizer state here
    with pytest.raises(ValueError, match=r"memory_budget='1GiB' needs example_inputs="):
        OffloadCallback(memory_budget="1GiB")
    with pytest.raises(ValueError, match=r"smallest feasible budget for this model and batch is (\d+) bytes") as err:
        fit(HYBRID, [OffloadCallback(memory_budget="1B", example_inputs=example, min_offload_numel=0)], seq=64)
    smallest = int(re.search(r"is (\d+) bytes", str(err.value)).group(1))
    base = fit(ADAMW, seq=64)
    ours = fit((HybridDeviceOptimizer, {"lr": 1e-3, "offload_fraction": 1.0}),
               [OffloadCallback(memory_budget=int(smallest * 1.3), example_inputs=example, min_offload_numel=0)], seq=64)
    check_same(base, ours)
    assert ours.offload_plan.planner is not None and {lp.choice for lp in ours.offload_plan.layers} != {"keep"}


def test_offload_gradients_accumulates_on_the_host_exactly():
    # without clipping nothing reads the device gradients: the host adds the micro-batches, as the device would
    base = fit(ADAMW, accumulate_grad_batches=2)
    ours = fit((HybridDeviceOptimizer, {"lr": 1e-3, "offload_fraction": 0.5, "offload_gradients": True}),
               [OffloadCallback(**OFFLOAD)], accumulate_grad_batches=2)
    same(base.losses, ours.losses)
    assert all(torch.equal(p, q) for p, q in zip(base.parameters(), ours.parameters()))
