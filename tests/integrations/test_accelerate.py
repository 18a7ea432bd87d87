"""accelerate: offload_transform before or after prepare, accelerator.clip_grad_norm_, save_state/load_state."""

from __future__ import annotations

import pytest
import torch

accelerate = pytest.importorskip("accelerate")

from annotate_offload import HybridDeviceOptimizer, offload_transform  # noqa: E402

from ._tiny import OFFLOAD, Tokens, llama, same  # noqa: E402


@pytest.fixture(autouse=True)
def _no_accelerator_left():
    yield
    # singletons: a test elsewhere that builds an Accelerator(mixed_precision="bf16") must not find ours
    accelerate.state.AcceleratorState._reset_state(True)
    accelerate.state.GradientState._reset_state()


def train(hybrid: bool, transform: str | None, *, steps=range(4), ckpt=None, save=None, mixed_precision="no"):
    """Losses and gradient norms of ``steps`` (indices into the loader) through accelerate; ``save_state`` to
    ``ckpt`` after step ``save``, or ``load_state`` from it first when ``save`` is ``None``."""
    accelerate.state.AcceleratorState._reset_state(True)  # a singleton: each run sets its own precision
    acc = accelerate.Accelerator(cpu=True, mixed_precision=mixed_precision)
    model = llama()
    opt = (HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, lr=1e-3) if hybrid
           else torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True))
    if transform == "before":
        offload_transform(model, **OFFLOAD)
    model, opt, loader = acc.prepare(model, opt, torch.utils.data.DataLoader(Tokens(), batch_size=2))
    if transform == "after":
        offload_transform(acc.unwrap_model(model), **OFFLOAD)
    if ckpt is not None and save is None:
        acc.load_state(str(ckpt))
    losses, norms = [], []
    for i, batch in enumerate(loader):
        if i not in steps:
            continue
        loss = model(**batch).loss
        acc.backward(loss)
        norms.append(acc.clip_grad_norm_(model.parameters(), 1.0).item())
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
        if i == save:
            acc.save_state(str(ckpt))
    plan = getattr(acc.unwrap_model(model), "offload_plan", None)
    return losses, norms, plan


@pytest.mark.parametrize("transform, mixed_precision", [("before", "no"), ("after", "no"), ("before", "bf16")])
def test_accelerate_equals_adamw(transform, mixed_precision):
    *base, _ = train(False, None, mixed_precision=mixed_precision)
    *ours, plan = train(True, transform, mixed_precision=mixed_precision)
    same(base[0], ours[0])
    same(base[1], ours[1])
    assert plan.bytes_per_step > 0


def test_accelerate_save_state_load_state_resumes_exactly(tmp_path):
    full = train(True, "before", ckpt=tmp_path, save=1)
    resumed = train(True, "after", steps=range(2, 4), ckpt=tmp_path)
    same(full[0][2:], resumed[0])
    same(full[1][2:], resumed[1])


def test_the_distributed_helpers_take_the_optimizer_accelerate_returns(tmp_path):
    from annotate_offload.distributed import attach_optimizer, load_checkpoint, save_checkpoint

    def built():
        accelerate.state.AcceleratorState._reset_state(True)
        model = llama()
        opt = HybridDeviceOptimizer(model.parameters(), offload_fraction=0.5, lr=1e-3)
        return accelerate.Accelerator(cpu=True).prepare(model, opt)

    model, opt = built()
    assert type(opt).__name__ == "AcceleratedOptimizer"
    attach_optimizer(model, opt, shard_host_step=False)  # the README's line, with accelerate's wrapper
    torch.manual_seed(0)
    for p in model.parameters():
        p.grad = torch.randn_like(p)
    opt.step()
    save_checkpoint(model, opt, str(tmp_path / "ckpt"))
    model2, opt2 = built()
    load_checkpoint(model2, opt2, str(tmp_path / "ckpt"))
    want, got = opt.optimizer.state_dict()["state"], opt2.optimizer.state_dict()["state"]
    assert want.keys() == got.keys() and want
    assert all(torch.equal(torch.as_tensor(want[i][k]), torch.as_tensor(got[i][k])) for i in want for k in want[i])
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), model2.parameters()))
