"""Hugging Face Trainer with OffloadCallback and HybridDeviceOptimizer: the same run as AdamW(fused=True) without them."""

from __future__ import annotations

import re
import warnings

import pytest
import torch

transformers = pytest.importorskip("transformers")

from annotate_offload import HybridDeviceOptimizer  # noqa: E402
from annotate_offload.integrations.transformers import OffloadCallback, optimizer_cls_and_kwargs  # noqa: E402

from ._tiny import ADAMW, HYBRID, OFFLOAD, Tokens, llama, same  # noqa: E402

pytestmark = pytest.mark.usefixtures("in_tmp")  # Trainer's output_dir


def trainer(optimizer, callbacks=(), *, data=None, out="out", **kwargs) -> "transformers.Trainer":
    args = dict(max_steps=4, per_device_train_batch_size=2, logging_steps=1, report_to=[], save_strategy="no",
                use_cpu=True, learning_rate=optimizer[1].get("lr", 1e-3), weight_decay=0.1, disable_tqdm=True)
    args = transformers.TrainingArguments(str(out), **{**args, **kwargs})
    return transformers.Trainer(model=llama(), args=args, train_dataset=data or Tokens(), callbacks=list(callbacks),
                                optimizer_cls_and_kwargs=optimizer)


def logged(tr) -> tuple[list, list]:
    logs = [h for h in tr.state.log_history if "loss" in h]
    return [h["loss"] for h in logs], [h["grad_norm"] for h in logs]


def run(optimizer, callbacks=(), **kwargs):
    tr = trainer(optimizer, callbacks, **kwargs)
    tr.train()
    return tr, logged(tr)


def check_same(a, b) -> None:
    same(a[0], b[0])  # losses
    same(a[1], b[1])  # grad norms


@pytest.mark.parametrize("kwargs", [{}, {"bf16": True}, {"gradient_accumulation_steps": 2, "max_grad_norm": 0.5}],
                         ids=["fp32", "bf16", "accumulate_clip"])
def test_trainer_equals_adamw(kwargs):
    _, base = run(ADAMW, **kwargs)
    tr, ours = run(HYBRID, [OffloadCallback(**OFFLOAD)], **kwargs)
    check_same(base, ours)
    plan = tr.model.offload_plan
    assert plan.offloaded_layers == (0, 1) and plan.bytes_source == "measured" and plan.bytes_per_step > 0
    opt = tr.optimizer.optimizer
    assert isinstance(opt, HybridDeviceOptimizer) and opt.offloaded_numel > 0
    assert [g["weight_decay"] for g in opt.param_groups] == [0.1, 0.0]  # Trainer's weight-decay groups
    assert len(opt.param_groups[1]["params"]) == 2 * 4 + 1  # norms: no decay


def test_the_model_train_returns_holds_the_last_delayed_update():
    tr = trainer((HybridDeviceOptimizer, {"lr": 1e-3, "offload_fraction": 1.0, "delayed_param_update": True}),
                 [OffloadCallback(**OFFLOAD)])
    tr.train()
    after = [p.detach().clone() for p in tr.model.parameters()]
    tr.optimizer.optimizer.flush()
    assert all(torch.equal(a, p) for a, p in zip(after, tr.model.parameters()))


def test_a_callback_reused_across_runs_keeps_no_model_alive():
    import gc
    import weakref

    cb = OffloadCallback(**OFFLOAD)
    tr, _ = run(HYBRID, [cb])
    weight = weakref.ref(next(tr.model.parameters()))
    del tr
    gc.collect()
    assert weight() is None  # a sweep builds the next model while the callback lives on
    tr, _ = run(HYBRID, [cb])  # and the callback transforms the next run's model
    assert tr.model.offload_plan.offloaded_layers == (0, 1)


def test_trainer_from_config_and_helper():
    config = {"model": {"cpu_offloading": True, "cpu_offloading_num_layers": 2, "min_offload_numel": 0},
              "optimizer": {"optimizer_cpu_offload": True, "optimizer_offload_fraction": 0.5, "lr": 2e-3,
                            "weight_decay": 0.05, "clip_grad": 0.5, "adam_beta2": 0.99}}
    cls, kwargs = optimizer_cls_and_kwargs(config)
    assert cls is HybridDeviceOptimizer and kwargs["betas"] == (0.9, 0.99) and kwargs["offload_fraction"] == 0.5
    args = dict(learning_rate=2e-3, weight_decay=0.05, max_grad_norm=0.5)
    fused = {k: v for k, v in kwargs.items() if k in ("lr", "betas", "eps", "weight_decay")}
    _, base = run((torch.optim.AdamW, {**fused, "fused": True}), **args)
    tr, ours = run((cls, kwargs), [OffloadCallback.from_config(config)], **args)
    check_same(base, ours)
    assert tr.model.offload_plan.bytes_per_step > 0
    assert optimizer_cls_and_kwargs({"optimizer": {"lr": 1e-4}}) == (
        torch.optim.AdamW, {"lr": 1e-4, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.01, "fused": True})


def test_trainer_memory_budget_plans_on_the_first_batch():
    data = Tokens(16, 64)  # activations outweigh this model's weights and optimizer state
    full = (HybridDeviceOptimizer, {"lr": 1e-3, "offload_fraction": 1.0})
    tr = trainer(full, [OffloadCallback(memory_budget="1B", min_offload_numel=0)], data=data)
    with pytest.raises(ValueError, match="smallest feasible budget") as err:
        tr.train()
    assert tr.state.global_step == 0
    smallest = int(re.search(r"budget for this model and batch is (\d+) bytes", str(err.value)).group(1))
    _, base = run(ADAMW, data=data)
    tr, ours = run(full, [OffloadCallback(memory_budget=int(smallest * 1.3), min_offload_numel=0)], data=data)
    check_same(base, ours)
    plan = tr.model.offload_plan
    assert plan.planner is not None and {lp.choice for lp in plan.layers} != {"keep"}, plan


def test_trainer_memory_budget_plans_for_the_optimizer_trainer_built():
    data = Tokens(16, 64)
    half = (HybridDeviceOptimizer, {"lr": 1e-3, "offload_fraction": 0.5})
    probe = trainer(half, [OffloadCallback(memory_budget="1B", min_offload_numel=0)], data=data)
    with pytest.raises(ValueError, match="smallest feasible budget") as err:
        probe.train()
    smallest = int(re.search(r"budget for this model and batch is (\d+) bytes", str(err.value)).group(1))
    tr = trainer(half, [OffloadCallback(memory_budget=int(smallest * 1.3), min_offload_numel=0)], data=data)
    tr.train()
    plan = tr.model.offload_plan
    assert plan.optimizer_kwargs() == {"offload_fraction": 0.5}
    assert "optimizer offload_fraction=0.500 (the optimizer's)" in repr(plan)


def test_trainer_resume_equals_uninterrupted():
    save = dict(save_strategy="steps", save_steps=2)
    _, full = run(HYBRID, [OffloadCallback(**OFFLOAD)], out="a", **save)
    tr = trainer(HYBRID, [OffloadCallback(**OFFLOAD)], out="b", **save)
    tr.train(resume_from_checkpoint="a/checkpoint-2")
    check_same(full, logged(tr))
    assert tr.model.offload_plan.bytes_per_step > 0


@pytest.mark.parametrize("optimizer, callback, kwargs, match", [
    ((HybridDeviceOptimizer, {"offload_gradients": True}), {}, {"max_grad_norm": 0.0},
     r"offload_gradients=True\) frees .* Trainer computes the gradient norm .* max_grad_norm=0.0.* Fix: build the "
     r"optimizer with offload_gradients=False"),
    ((HybridDeviceOptimizer, {"step_in_backward": True}), {}, {},
     r"step_in_backward=True\) steps .* max_grad_norm=1.0.* Fix: build the optimizer with step_in_backward=False"),
    (ADAMW, {"config": {"model": {"cpu_offloading": True, "cpu_offloading_num_layers": 2},
                        "optimizer": {"optimizer_cpu_offload": True}}}, {},
     r"optimizer_cpu_offload=True but Trainer's optimizer is not a HybridDeviceOptimizer"),
    (optimizer_cls_and_kwargs({"optimizer": {"lr": 1e-3}}), {"config": {"optimizer": {"lr": 1e-3}}}, {},
     r"optimizer.weight_decay=0.01 but TrainingArguments.weight_decay=0.1, which Trainer applies; set "
     r"TrainingArguments\(weight_decay=0.01\) or optimizer.weight_decay=0.1"),
], ids=["offload_gradients", "step_in_backward", "not_hybrid", "weight_decay"])
def test_trainer_refuses_before_the_first_step(optimizer, callback, kwargs, match):
    cb = OffloadCallback(**callback) if callback else OffloadCallback(**OFFLOAD)
    tr = trainer(optimizer, [cb], **kwargs)
    weights = [p.detach().clone() for p in tr.model.parameters()]
    with pytest.raises(ValueError, match=match):
        tr.train()
    assert tr.state.global_step == 0 and all(torch.equal(a, b) for a, b in zip(weights, tr.model.parameters()))
    assert "offload_plan" not in tr.model.__dict__


@pytest.mark.parametrize("args, kwargs, error, match", [
    ((), {}, ValueError, r"^OffloadCallback: num_layers is required .* or memory_budget='20GiB' \(the step's peak "
                         r"device memory\) to plan for it\.$"),
    ((-1,), {}, ValueError, r"OffloadCallback: num_layers=-1: pass 0 <= num_layers < L"),
    ((2,), {"min_ofload_numel": 0}, TypeError, r"unexpected keyword 'min_ofload_numel'"),
    ((), {"config": {"cpu_offloading": True}}, ValueError,
     r"unknown config section 'cpu_offloading'; nest it in its section: \{'model': \{'cpu_offloading': ...\}\}"),
    ((), {"config": {"model": {"cpu_ofloading": True}}}, ValueError, r"'model.cpu_ofloading'; did you mean 'model.cpu_offloading'"),
    ((), {"config": {"model": {"cpu_offloading": "yes"}}}, TypeError, r"model.cpu_offloading must be bool"),
    ((), {"config": {"model": {"cpu_offloading": True, "cpu_offloading_num_layers": 2, "pipeline_model_parallel_size": 2}}},
     ValueError, r"no support for Pipeline parallelism"),
    ((), {"config": [("model", {})]}, TypeError, r"config must be a Config, ModelConfig, OptimizerConfig or a mapping"),
    ((), {"memory_budget": "lots"}, ValueError, r"^OffloadCallback: memory_budget='lots' is not a memory size"),
    ((), {"memory_budget": -5}, ValueError, r"^OffloadCallback: memory_budget=-5 must be positive"),
    ((), {"memory_budget": 0}, ValueError, r"^OffloadCallback: memory_budget=0 must be positive"),
    ((), {"memory_budget": [1]}, TypeError, r"^OffloadCallback: memory_budget must be bytes .* got \[1\]"),
])
def test_callback_checks_its_arguments_at_construction(args, kwargs, error, match):
    with pytest.raises(error, match=match):
        OffloadCallback(*args, **kwargs)


def test_offload_off_in_the_config_leaves_the_model_alone():
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        tr, _ = run(HYBRID, [OffloadCallback.from_config({"model": {"cpu_offloading": False}})])
    assert "offload_plan" not in tr.model.__dict__


def test_a_model_offloaded_by_hand_and_by_the_callback_is_refused_naming_both():
    from annotate_offload import offload_transform
    from annotate_offload.errors import OffloadError

    tr = trainer(HYBRID, [OffloadCallback(**OFFLOAD)])
    offload_transform(tr.model, **OFFLOAD)
    plan = tr.model.offload_plan
    with pytest.raises(OffloadError, match=r"^OffloadCallback: LlamaForCausalLM is already offloaded by an "
                                           r"offload_transform call; keep one of the two"):
        tr.train()
    assert tr.state.global_step == 0 and tr.model.offload_plan is plan
