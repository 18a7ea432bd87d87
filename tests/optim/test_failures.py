"""Failure semantics (Note [Failed steps] in annotate_offload/optim/_hybrid.py) and bounds.

After an exception in ``step()`` every parameter is stepped or untouched, the exception lists the
untouched ones, and a retried ``step()`` steps each of them exactly once, in every mode; ``close()``
always cleans up first.
"""

from __future__ import annotations

import os
import threading

import pytest
import torch

from _hdo_util import FailOnce, assert_same, inputs, loss_of, pair
from annotate_offload.errors import OffloadError
from annotate_offload.optim import HybridDeviceOptimizer, _hybrid


MODES = {"exact": {}, "offload_gradients": {"offload_gradients": True}, "serial": {"overlap_cpu_optimizer_d2h_h2d": False},
         "step_in_backward": {"step_in_backward": True}}


def _build(mode, f=0.75):
    m, r = pair()
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=f, chunk_bytes=128, lr=1e-2, fused=True,
                                cpu_optimizer_cls=FailOnce, **MODES.get(mode, {}))
    ref = torch.optim.AdamW(r.parameters(), lr=1e-2, fused=True)
    assert len(opt.cpu_optimizers) >= 3 and opt.gpu_optimizer is not None
    return m, r, opt, ref


@pytest.mark.parametrize("clip", [False, True], ids=["", "clipped"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_failed_step_is_all_or_nothing_per_parameter_and_a_retry_steps_the_rest_once(mode, clip, monkeypatch):
    if clip and mode == "step_in_backward":
        pytest.skip("step_in_backward refuses gradients changed after backward")
    if clip:  # every gradient copied by its hook in backward, so clipping scales the host buffers
        monkeypatch.setattr(_hybrid, "BATCHED_NUMEL", 1)
    m, r, opt, ref = _build(mode)
    x = inputs(1, 7)[0]
    opt.cpu_optimizers[len(opt.cpu_optimizers) // 2].fail_next = True  # before backward: step_in_backward runs it there
    before = [p.detach().clone() for p in m.parameters()]
    loss_of(m, x).backward()
    loss_of(r, x).backward()
    if clip:  # the failed chunk's buffers hold the clipped gradient: the retry must not clip them again
        assert torch.equal(opt.clip_grad_norm_(1e-6), torch.nn.utils.clip_grad_norm_(r.parameters(), 1e-6))
    ref.step()
    with pytest.raises(RuntimeError, match="host chunk failed") as info:
        opt.step()
    untouched = info.value.untouched_params
    assert 0 < len(untouched) < len(before)
    assert "untouched_params" in "".join(getattr(info.value, "__notes__", []))
    for i, (p, q, b) in enumerate(zip(m.parameters(), r.parameters(), before)):
        assert torch.equal(p, b if i in untouched else q), i  # untouched, or stepped exactly as torch steps it
    opt.step()  # the retry steps exactly the untouched ones, once
    assert_same(m, r)
    for p, q in zip(m.parameters(), r.parameters()):
        assert torch.equal(opt.state[p]["step"], ref.state[q]["step"])
    for model, o in ((m, opt), (r, ref)):  # and training goes on in step
        o.zero_grad()
        loss_of(model, inputs(1, 8)[0]).backward()
        o.step()
    assert_same(m, r)
    opt.close()


@pytest.mark.parametrize("copied", ["at_step", "by_hooks"])
@pytest.mark.parametrize("mode", ["exact", "offload_gradients", "serial"])
def test_a_gradient_changed_after_a_failed_step_is_refused_and_zero_grad_skips_the_rest(mode, copied, monkeypatch):
    if copied == "by_hooks":  # every gradient copied by its hook in backward: the second backward is refused
        monkeypatch.setattr(_hybrid, "BATCHED_NUMEL", 1)
    m, _, opt, _ = _build(mode)
    x = inputs(1, 7)[0]
    opt.cpu_optimizers[len(opt.cpu_optimizers) // 2].fail_next = True
    loss_of(m, x).backward()
    with pytest.raises(RuntimeError, match="host chunk failed") as info:
        opt.step()
    untouched = set(info.value.untouched_params)
    with pytest.raises(OffloadError, match="after the step\\(\\) that raised had stepped it"):
        loss_of(m, x).backward()  # accumulates into gradients the failed step already used
        opt.step()
    opt.zero_grad()  # the failed step stays unfinished for the untouched parameters
    loss_of(m, x).backward()
    opt.step()
    steps = [int(opt.state[p]["step"]) for p in m.parameters()]
    assert steps == [1 if i in untouched else 2 for i in range(len(steps))]
    opt.close()


def test_a_step_in_backward_step_refused_for_a_clipped_gradient_is_dropped_by_zero_grad():
    """step_in_backward: clipping after backward changes gradients whose chunks were stepped in backward, so
    step() raises; zero_grad() then drops the unfinished step, as the error's note says, and training goes on."""
    m, _, opt, _ = _build("step_in_backward")
    x = inputs(1, 7)[0]
    loss_of(m, x).backward()
    torch.nn.utils.clip_grad_norm_(m.parameters(), 1e-6)
    with pytest.raises(OffloadError, match="after step_in_backward=True stepped it") as info:
        opt.step()
    untouched = set(info.value.untouched_params)
    assert "zero_grad()" in "".join(info.value.__notes__)
    opt.zero_grad()
    loss_of(m, x).backward()
    opt.step()
    steps = [int(opt.state[p]["step"]) for p in m.parameters()]
    assert steps == [1 if i in untouched else 2 for i in range(len(steps))] and 0 < len(untouched) < len(steps)
    opt.close()


@pytest.mark.parametrize("clip", [False, True], ids=["", "clipped"])
def test_a_failed_host_chunk_in_delayed_mode_runs_again_before_the_next_step(clip, monkeypatch):
    """Delayed mode: step t's host work runs during step t + 1; a chunk that failed is reported by the
    next step(), which writes only the finished chunks' weights (untouched_params: all the others),
    and runs once more when step() is called again."""
    if clip:  # every gradient copied by its hook in backward, so clipping scales the host buffers
        monkeypatch.setattr(_hybrid, "BATCHED_NUMEL", 1)
    m, r = pair()
    kw = dict(offload_fraction=0.75, chunk_bytes=128, lr=1e-2, fused=True, delayed_param_update=True)
    opt = HybridDeviceOptimizer(m.parameters(), cpu_optimizer_cls=FailOnce, **kw)
    twin = HybridDeviceOptimizer(r.parameters(), **kw)
    opt.cpu_optimizers[1].fail_next = True  # fails in the worker after step 0, during the next backward
    xs = inputs(3, 7)
    for i, x in enumerate(xs):
        for model, o in ((m, opt), (r, twin)):
            loss_of(model, x).backward()
            if clip:
                o.clip_grad_norm_(1e-6)
            if o is opt and i == 1:
                before = [p.detach().clone() for p in m.parameters()]
                with pytest.raises(RuntimeError, match="host chunk failed") as info:
                    o.step()  # reports step 0's failed chunk; nothing of step 1 ran
                untouched = info.value.untouched_params
                host = [i for i, pl in enumerate(opt.placements) if pl.side == "cpu"]
                assert set(untouched) > set(range(len(before))) - set(host) and not set(host) <= set(untouched)
                for j, (a, b) in enumerate(zip(before, m.parameters())):
                    assert torch.equal(a, b) == (j in untouched), j
            o.step()
            o.zero_grad()
    opt.flush()
    twin.flush()
    assert_same(m, r)
    for p, q in zip(m.parameters(), r.parameters()):
        assert torch.equal(opt.state[p]["step"], twin.state[q]["step"])
    opt.close()
    twin.close()


def test_close_cleans_up_then_reports_the_pending_failure():
    m, _, opt, _ = _build("step_in_backward")
    workers = lambda: sum(t.name.startswith("hdo-cpu-step") for t in threading.enumerate())  # noqa: E731
    n = workers()
    opt.cpu_optimizers[0].fail_next = True
    loss_of(m, inputs(1, 7)[0]).backward()  # the chunk fails in the worker; nothing reported yet
    with pytest.raises(RuntimeError, match="host chunk failed"):
        opt.close()
    assert workers() == n - 1  # the worker was stopped anyway
    assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in m.parameters())  # and the hooks removed
    opt.close()  # idempotent
    with pytest.raises(OffloadError, match="closed"):
        opt.step()


def test_cpu_threads_is_bounded_by_the_usable_cpus():
    n = len(os.sched_getaffinity(0))
    m, _ = pair()
    with pytest.raises(ValueError, match=rf"cpu_threads={n + 1}: pass None or an int in \[1, {n}\]; this process may "
                                         rf"run on {n} CPUs"):
        HybridDeviceOptimizer(m.parameters(), cpu_threads=n + 1)
    with pytest.raises(ValueError, match=r"cpu_threads=100000"):
        HybridDeviceOptimizer(m.parameters(), cpu_threads=100000)
    assert all(not getattr(p, "_post_accumulate_grad_hooks", None) for p in m.parameters())
    HybridDeviceOptimizer(m.parameters(), cpu_threads=n).close()
