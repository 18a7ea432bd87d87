"""Opt-in modes (step_in_backward, delayed_param_update), validation, split, threads, host slabs."""

from __future__ import annotations

import threading

import pytest
import torch

from annotate_offload.optim import _hybrid

from _hdo_util import Tiny, assert_same, inputs, loss_of, pair, train
from annotate_offload.errors import OffloadError
from annotate_offload.optim import HybridDeviceOptimizer
from annotate_offload.optim._hybrid import CpuWorker, carve, thread_budget


# ---------------------------------------------------------------- step_in_backward
@pytest.mark.parametrize("f", [0.5, 1.0])
def test_step_in_backward_is_exact_without_clipping(f):
    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=f, step_in_backward=True, chunk_bytes=512, lr=1e-2)
    ref = torch.optim.AdamW(r.groups(), lr=1e-2, fused=True)
    assert len(opt.cpu_optimizers) > 1
    xs = inputs(6, 3)
    train(m, opt, xs)
    train(r, ref, xs)
    assert_same(m, r)


def test_step_in_backward_steps_during_backward():
    m, _ = pair()
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=1.0, step_in_backward=True, lr=1e-2)
    before = m.l3.weight.detach().clone()
    loss_of(m, inputs(1, 3)[0]).backward()
    opt.flush()  # the worker has run the chunks stepped in backward
    assert not torch.equal(m.l3.weight, before)  # already updated before step()
    opt.step()


def test_step_in_backward_refuses_to_skip_a_step_it_has_applied():
    # a skipped step (zero_grad after backward, no step) would leave the host half updated and the
    # GPU half not, then fail the next backward with a misleading "second gradient" error: it is refused
    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=0.5, step_in_backward=True, lr=1e-2)
    ref = torch.optim.AdamW(r.groups(), lr=1e-2, fused=True)
    xs = inputs(3, 3)
    loss_of(m, xs[0]).backward()
    with pytest.raises(OffloadError, match=r"cannot be skipped.*Call step\(\)"):
        opt.zero_grad()
    opt.step()  # finishing the step is the way out
    opt.zero_grad()
    train(m, opt, xs[1:])
    train(r, ref, xs)  # the reference takes xs[0]'s step here
    assert_same(m, r)


def test_step_in_backward_skips_a_step_whose_chunks_had_not_all_landed():
    # nothing was stepped yet, so zero_grad() drops what landed, its landed count included; a kept count
    # would make the next backward step the chunk with the skipped step's gradient
    torch.manual_seed(0)
    a, b = torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64, 64))
    opt = HybridDeviceOptimizer([a, b], offload_fraction=1.0, lr=1e-2, step_in_backward=True,
                                cpu_optimizer_cls=torch.optim.SGD)
    assert len(opt.cpu_optimizers) == 1
    x = torch.randn(64)
    (a @ x).sum().backward()  # b unused: its chunk is not complete, nothing stepped
    opt.zero_grad()  # a skipped step
    ra, rb = (torch.nn.Parameter(t.detach().clone()) for t in (a, b))
    ref = torch.optim.SGD([ra, rb], lr=1e-2)
    for (p, q), opt_ in (((a, b), opt), ((ra, rb), ref)):
        ((p @ (x * 3)).sum() + (q @ (x * 2)).sum()).backward()
        opt_.step()
    opt.flush()
    assert torch.equal(a, ra) and torch.equal(b, rb)


def test_step_in_backward_refuses_accumulation_and_clipping():
    m, _ = pair()
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=1.0, step_in_backward=True, lr=1e-2)
    x = inputs(1, 3)[0]
    loss_of(m, x).backward()
    opt.flush()  # the chunks of the first backward have written the weights
    with pytest.raises(OffloadError, match="second gradient"):
        loss_of(m, x).backward()
    m2, _ = pair()
    opt2 = HybridDeviceOptimizer(m2.parameters(), offload_fraction=1.0, step_in_backward=True, lr=1e-2)
    loss_of(m2, x).backward()
    with pytest.raises(OffloadError, match="step_in_backward"):
        opt2.clip_grad_norm_(1.0)
    torch.nn.utils.clip_grad_norm_(m2.parameters(), 1e-3)
    with pytest.raises(OffloadError, match="modified"):
        opt2.step()


# ---------------------------------------------------------------- delayed_param_update
class _Gated(torch.optim.AdamW):
    """A host class whose step for optimizer step ``n`` waits until step ``n + 1`` has begun, so every
    chunk is still running when the next step() begins (the worker then issues its H2D itself)."""

    began = 0
    cv = threading.Condition()

    def step(self, closure=None):
        self.calls = getattr(self, "calls", 0) + 1
        with self.cv:
            assert self.cv.wait_for(lambda: _Gated.began > self.calls, timeout=60)
        return super().step(closure)

    @classmethod
    def open(cls, n):
        with cls.cv:
            cls.began = n
            cls.cv.notify_all()


@pytest.mark.parametrize("f,gated", [(0.5, False), (1.0, False), (1.0, True)])
def test_delayed_param_update_is_one_step_stale(f, gated):
    m, r = pair()
    kw = {"chunk_bytes": 512, "cpu_optimizer_cls": _Gated, "fused": True} if gated else {}
    _Gated.open(1 << 30)  # the constructor's probe steps pass
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=f, delayed_param_update=True, lr=1e-2, **kw)
    if gated:
        _Gated.open(0)
        opt.register_step_pre_hook(lambda *_: _Gated.open(_Gated.began + 1))
    ref = torch.optim.AdamW(r.parameters(), lr=1e-2, fused=True)
    host = {(pl.group, pl.index) for pl in opt.placements if pl.side == "cpu"}
    g = torch.Generator().manual_seed(4)
    grads = [[torch.randn(p.shape, generator=g) for p in m.parameters()] for _ in range(5)]
    history = []
    for gs in grads:
        for p, q, gg in zip(m.parameters(), r.parameters(), gs):
            p.grad, q.grad = gg.clone(), gg.clone()
        opt.step()
        ref.step()
        history.append([q.detach().clone() for q in r.parameters()])
        opt.zero_grad()
        ref.zero_grad()
        for i, (p, q) in enumerate(zip(m.parameters(), r.parameters())):
            if (0, i) in host:  # host part: one update behind
                if len(history) > 1:
                    assert torch.equal(p, history[-2][i])
            else:
                assert torch.equal(p, q)
    if gated:
        _Gated.open(1 << 30)
    opt.flush()
    assert_same(m, r)
    opt.close()


@pytest.mark.parametrize("f", [0.5, 1.0])
def test_delayed_mode_resumes_from_a_model_file_saved_before_the_optimizer(f):
    # HF Trainer's order: the model's state dict (one update behind the masters), then the
    # optimizer's (whose flush applies the update to the live model only); Note [Loading masters]
    import io

    m, _ = pair()
    kw = dict(offload_fraction=f, lr=1e-2, delayed_param_update=True)
    opt = HybridDeviceOptimizer(m.groups(), **kw)
    xs = inputs(6, 3)
    train(m, opt, xs[:3])
    model_file, opt_file = io.BytesIO(), io.BytesIO()
    torch.save(m.state_dict(), model_file)
    torch.save(opt.state_dict(), opt_file)
    train(m, opt, xs[3:])
    opt.flush()
    model_file.seek(0)
    opt_file.seek(0)
    m2 = Tiny()
    m2.load_state_dict(torch.load(model_file, weights_only=True))
    opt2 = HybridDeviceOptimizer(m2.groups(), **kw)
    opt2.load_state_dict(torch.load(opt_file, weights_only=True))
    train(m2, opt2, xs[3:])
    opt2.flush()
    assert_same(m2, m)


def test_delayed_mode_close_keeps_weights_written_since_the_last_step():
    """An LR finder's pattern: restore the weights, then close() the optimizer; the pending update does not
    overwrite them (as step() would not)."""
    m, _ = pair()
    init = {k: v.clone() for k, v in m.state_dict().items()}
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=1.0, lr=1e-2, delayed_param_update=True)
    train(m, opt, inputs(3, 3))
    m.load_state_dict(init)
    opt.close()
    for k, v in m.state_dict().items():
        assert torch.equal(v, init[k]), k


def test_delayed_mode_keeps_weights_loaded_between_steps():
    """O03 in delayed mode: weights loaded while an update is pending are not overwritten by it."""
    m, _ = pair()
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=1.0, delayed_param_update=True, lr=1e-2, chunk_bytes=512)
    xs = inputs(3, 3)
    for x in xs[:2]:
        loss_of(m, x).backward()
        opt.step()
        opt.zero_grad()
    ckpt = Tiny()
    m.load_state_dict(ckpt.state_dict())  # step 2's host update is still pending
    loss_of(m, xs[2]).backward()
    want = [q.detach().clone() for q in ckpt.parameters()]
    opt.step()
    for p, w in zip(m.parameters(), want):
        assert torch.equal(p, w)
    opt.flush()
    for p, master in opt.gpu_params_map_cpu_copy.items():
        assert torch.equal(p, master)
    opt.close()


# ---------------------------------------------------------------- validation
@pytest.mark.parametrize("bad, exc", [(-0.1, ValueError), (1.5, ValueError), (float("nan"), ValueError),
                                      (True, TypeError), ("0.5", TypeError)])
def test_bad_fraction(bad, exc):
    m = Tiny()
    with pytest.raises(exc, match="offload_fraction"):
        HybridDeviceOptimizer(m.parameters(), offload_fraction=bad)


def test_bad_flags_and_modes():
    m = Tiny()
    with pytest.raises(TypeError, match="pin_cpu_grads"):
        HybridDeviceOptimizer(m.parameters(), pin_cpu_grads=1)
    with pytest.raises(ValueError, match="overlap_cpu_optimizer_d2h_h2d"):
        HybridDeviceOptimizer(m.parameters(), overlap_cpu_optimizer_d2h_h2d=False, offload_gradients=True)
    with pytest.raises(ValueError, match="exclusive"):
        HybridDeviceOptimizer(m.parameters(), step_in_backward=True, delayed_param_update=True)
    with pytest.raises(ValueError, match="cpu_threads"):
        HybridDeviceOptimizer(m.parameters(), cpu_threads=0)
    with pytest.raises(ValueError, match="chunk_bytes"):
        HybridDeviceOptimizer(m.parameters(), chunk_bytes=-1)
    with pytest.raises(TypeError, match="chunk_bytes='x'"):
        HybridDeviceOptimizer(m.parameters(), chunk_bytes="x")


def test_gpu_only_class_refused_for_host():
    FusedAdam = type("FusedAdam", (torch.optim.Optimizer,), {"__module__": "transformer_engine.pytorch.optimizers"})
    m = Tiny()
    with pytest.raises(TypeError, match="only runs on the GPU"):
        HybridDeviceOptimizer(m.parameters(), cpu_optimizer_cls=FusedAdam)
    with pytest.raises(TypeError, match="torch.optim.Optimizer subclass"):
        HybridDeviceOptimizer(m.parameters(), cpu_optimizer_cls=dict)


def test_add_param_group_after_construction_raises():
    m = Tiny()
    opt = HybridDeviceOptimizer([m.l1.weight], lr=1e-2)
    with pytest.raises(OffloadError, match="add_param_group"):
        opt.add_param_group({"params": [m.l2.weight]})


def test_load_state_dict_mismatch_raises():
    m = Tiny()
    opt = HybridDeviceOptimizer(m.groups(), lr=1e-2)
    other = HybridDeviceOptimizer(m.parameters(), lr=1e-2)
    with pytest.raises(ValueError, match="param groups"):
        opt.load_state_dict(other.state_dict())


# ---------------------------------------------------------------- split
def test_split_rule_matches_megatron():
    ps = [torch.nn.Parameter(torch.zeros(n)) for n in (100, 50, 30, 20)]  # total 200
    opt = HybridDeviceOptimizer([{"params": ps[:2]}, {"params": ps[2:]}], offload_fraction=0.6)
    sides = [pl.side for pl in opt.placements]
    assert sides == ["cpu", "cpu", "gpu", "gpu"]  # 100 < 120 -> offload next; 150 >= 120 stop
    assert opt.offloaded_numel == 150
    assert [pl.side for pl in HybridDeviceOptimizer(ps, offload_fraction=0.0).placements] == ["gpu"] * 4
    assert [pl.side for pl in HybridDeviceOptimizer(ps, offload_fraction=1.0).placements] == ["cpu"] * 4
    first = HybridDeviceOptimizer(ps, offload_fraction=0.01)
    assert [pl.side for pl in first.placements] == ["cpu", "gpu", "gpu", "gpu"]


def test_chunks_do_not_strand_small_tensors():
    from annotate_offload.optim._hybrid import make_chunks

    # a bias in front of a chunk-sized weight joins it instead of forming a chunk of its own
    assert make_chunks([8, 64, 30, 64, 10, 10, 8, 48], 64) == [[0, 1], [2, 3], [4, 5, 6, 7]]
    # a chunk at least half full is closed before it would overflow; an oversized item stands alone
    assert make_chunks([40, 40, 100, 1], 64) == [[0], [1], [2], [3]]
    assert make_chunks([], 64) == []


def test_host_chunks_are_stepped_in_gradient_landing_order(monkeypatch):
    """Note [Host chunk order]: backward lands the last layer's gradients first, so its chunk is
    stepped first; a gradient copied only at step() (changed after backward) goes last. Same bits."""
    monkeypatch.setattr(_hybrid, "BATCHED_NUMEL", 0)  # tiny test tensors: the per-gradient hook path
    monkeypatch.setattr(_hybrid, "SERIAL_NUMEL", 0)  # every tensor in a parallel chunk of its own
    m, r = pair()
    opt = HybridDeviceOptimizer([m.l1.weight, m.l2.weight, m.l3.weight], offload_fraction=1.0, chunk_bytes=4, lr=1e-2)
    ref = torch.optim.AdamW([r.l1.weight, r.l2.weight, r.l3.weight], lr=1e-2, fused=True)
    chunk_of = {id(p): pl.chunk for p, pl in zip(opt.param_groups[0]["params"], opt.placements)}
    order = []
    for ci, sub in enumerate(opt.cpu_optimizers):
        sub.register_step_pre_hook(lambda *_, ci=ci: order.append(ci))
    x = inputs(1, 3)[0]
    for model, o in ((m, opt), (r, ref)):
        loss_of(model, x).backward()
    assert len(opt.cpu_optimizers) == 3
    opt.step()
    ref.step()
    assert order == [chunk_of[id(m.l3.weight)], chunk_of[id(m.l2.weight)], chunk_of[id(m.l1.weight)]]
    order.clear()
    for model, o in ((m, opt), (r, ref)):
        o.zero_grad()
        loss_of(model, x).backward()
    m.l3.weight.grad.mul_(0.5)  # changed after its D2H: re-copied at step(), so it lands last
    r.l3.weight.grad.mul_(0.5)
    opt.step()
    ref.step()
    assert order == [chunk_of[id(m.l2.weight)], chunk_of[id(m.l1.weight)], chunk_of[id(m.l3.weight)]]
    for a, b in ((m.l1.weight, r.l1.weight), (m.l2.weight, r.l2.weight), (m.l3.weight, r.l3.weight)):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    opt.close()


def test_default_chunk_size_depends_on_the_mode():
    m, _ = pair()
    assert HybridDeviceOptimizer(m.parameters(), offload_fraction=1.0).defaults["chunk_bytes"] == 128 << 20
    delayed = HybridDeviceOptimizer(m.parameters(), offload_fraction=1.0, delayed_param_update=True)
    assert delayed.defaults["chunk_bytes"] == 256 << 20
    assert HybridDeviceOptimizer(m.parameters(), delayed_param_update=True, chunk_bytes=4096).defaults["chunk_bytes"] == 4096
    with pytest.raises(ValueError, match="chunk_bytes=0: pass None or a positive int"):
        HybridDeviceOptimizer(m.parameters(), chunk_bytes=0)


def test_small_tensors_are_gathered_into_serial_chunks(monkeypatch):
    monkeypatch.setattr(_hybrid, "SERIAL_NUMEL", 100)
    monkeypatch.setattr(_hybrid, "SERIAL_CHUNK_BYTES", 40)
    numels = [5, 200, 5, 300, 5, 5, 150]
    sizes = [4 * n for n in numels]
    groups = [[0, 1], [2, 3], [4, 5, 6]]
    # large tensors keep their group's place; small ones collect until 40 bytes, then follow
    assert _hybrid.split_serial(groups, numels, sizes, 1 << 20) == [
        ([1], False), ([3], False), ([0, 2], True), ([6], False), ([4, 5], True)]
    assert _hybrid.split_serial([[0], [2]], numels, sizes, 1 << 20) == [([0, 2], True)]  # the rest at the end


def test_serial_chunks_step_with_one_thread(monkeypatch):
    monkeypatch.setattr(_hybrid, "SERIAL_NUMEL", 200)  # Tiny's biases and norm are "small"
    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=1.0, lr=1e-2, cpu_threads=2)
    ref = torch.optim.AdamW(r.groups(), lr=1e-2, fused=True)
    small = {}  # chunk -> whether every tensor in it is small
    for pl in opt.placements:
        small[pl.chunk] = small.get(pl.chunk, True) and pl.numel < 200
    assert set(small.values()) == {True, False}  # small tensors in chunks of their own, never mixed
    assert all(small[pl.chunk] == (pl.numel < 200) for pl in opt.placements)
    seen = {}
    for ci, sub in enumerate(opt.cpu_optimizers):
        sub.register_step_pre_hook(lambda *_, ci=ci: seen.__setitem__(ci, torch.get_num_threads()))
    xs = inputs(3, 3)
    train(m, opt, xs)
    train(r, ref, xs)
    assert_same(m, r)  # thread count never changes an elementwise kernel's result
    assert {seen[ci] for ci, sm in small.items() if sm} == {1}
    assert {seen[ci] for ci, sm in small.items() if not sm} == {2}


def test_use_torch_optimizer_for_cpu_offload_overrides_gpu_class():
    m = Tiny()
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=0.5, cpu_optimizer_cls=torch.optim.Adam,
                                gpu_optimizer_cls=torch.optim.SGD, use_torch_optimizer_for_cpu_offload=True, lr=1e-2)
    assert all(type(o) is torch.optim.Adam for o in opt.sub_optimizers)


def test_sgd_both_halves():
    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=0.5, cpu_optimizer_cls=torch.optim.SGD, lr=1e-2, momentum=0.9)
    ref = torch.optim.SGD(r.groups(), lr=1e-2, momentum=0.9)
    train(m, opt, inputs(4, 3))
    train(r, ref, inputs(4, 3))
    assert_same(m, r)


# ---------------------------------------------------------------- threads and host memory
def test_thread_budget_ignores_omp_and_splits_per_rank(monkeypatch):
    monkeypatch.setattr("annotate_offload.optim._hybrid.usable_cpus", lambda: 16)
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    assert thread_budget() == 15
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    assert thread_budget() == 7
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "8")
    assert thread_budget() == 2
    assert thread_budget(5) == 5
    # the default mode steps on the training thread, which launches nothing meanwhile: every core
    assert thread_budget(beside_training=False) == 2
    monkeypatch.delenv("LOCAL_WORLD_SIZE")
    assert thread_budget(beside_training=False) == 16
    assert thread_budget(5, beside_training=False) == 5


@pytest.mark.parametrize("mode", ["exact", "step_in_backward", "delayed"])
def test_default_mode_steps_on_the_training_thread(mode, monkeypatch):
    """Note [Thread budget] (``optim/_hybrid.py``): the default mode has no worker thread, runs
    the host chunks where step() was called with the whole budget, queues the GPU half before them,
    and gives the training thread its own thread count back; the overlapped modes keep the worker
    and leave a core to the training thread."""
    import threading

    monkeypatch.setattr("annotate_offload.optim._hybrid.usable_cpus", lambda: 8)
    monkeypatch.setattr("annotate_offload.optim._hybrid.SERIAL_NUMEL", 0)  # no single-threaded chunk
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    flags = {"exact": {}, "step_in_backward": {"step_in_backward": True}, "delayed": {"delayed_param_update": True}}[mode]
    m, _ = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=0.5, chunk_bytes=512, lr=1e-2, **flags)
    assert opt.thread_budget == (8 if mode == "exact" else 7)
    seen = []
    for sub in opt.cpu_optimizers:
        sub.register_step_pre_hook(lambda *_: seen.append((threading.current_thread().name, torch.get_num_threads())))
    opt.gpu_optimizer.register_step_pre_hook(lambda *_: seen.append(("gpu", None)))
    old = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        loss_of(m, inputs(1, 3)[0]).backward()
        opt.step()
        opt.flush()
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(old)
        opt.close()
    chunks = [t for t in seen if t[0] != "gpu"]
    assert len(chunks) == len(opt.cpu_optimizers) > 1
    if mode == "exact":
        assert seen[0] == ("gpu", None)  # queued first, so the GPU steps its half during the host step
        assert chunks == [(threading.current_thread().name, 8)] * len(chunks)
    else:
        assert chunks == [("hdo-cpu-step_0", 7)] * len(chunks)


def test_worker_uses_its_own_thread_count():
    old = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        seen = []
        w = CpuWorker(3, lambda: None)
        w.submit(lambda: seen.append(torch.get_num_threads()))
        w.drain()
        w.close()
        assert seen == [3] and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(old)


def test_worker_reraises_task_errors():
    w = CpuWorker(1, lambda: None)
    w.submit(lambda: 1 / 0)
    with pytest.raises(ZeroDivisionError):
        w.drain()
    w.close()


def test_carve_packs_into_power_of_two_slabs_without_overlap():
    numels = [10, 3, 1 << 20, 7, 5 << 20]
    views = carve(numels, [torch.float32] * len(numels), pin=False, what="test")
    spans = []
    for v, n in zip(views, numels):
        assert v.numel() == n and v.data_ptr() % 64 == 0
        nbytes = v.untyped_storage().nbytes()
        assert nbytes & (nbytes - 1) == 0  # slabs are powers of two
        spans.append((v.untyped_storage().data_ptr(), v.data_ptr(), v.data_ptr() + 4 * n))
    for i, a in enumerate(spans):
        for b in spans[i + 1:]:
            assert a[0] != b[0] or a[2] <= b[1] or b[2] <= a[1]


def test_import_does_not_initialise_cuda(run_group):
    import sys

    code = "import torch, annotate_offload.optim, annotate_offload.distributed; print(torch.cuda.is_initialized())"
    out = run_group([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_offloaded_gradients_are_unreferenced_right_after_their_hook(monkeypatch):
    """Nothing of ours keeps a host-stepped gradient alive once it is copied.

    A spy hook registered before the optimizer's records a weak reference to each gradient; the
    optimizer's hook runs next. Right after backward every one of them must be dead (CPU tensors die
    on their last reference), so on a GPU only the allocator's record_stream guard remains.
    """
    monkeypatch.setattr(_hybrid, "BATCHED_NUMEL", 0)  # tiny test tensors: the per-gradient hook path
    import weakref

    m = Tiny()
    refs = []
    for p in m.parameters():
        p.register_post_accumulate_grad_hook(lambda q: refs.append(weakref.ref(q.grad)))
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=1.0, offload_gradients=True, chunk_bytes=100, lr=1e-2)
    loss_of(m, inputs(1, 3)[0]).backward()
    assert len(refs) == len(list(m.parameters()))
    assert all(r() is None for r in refs)
    assert all(p.grad is None for p in m.parameters())
    opt.step()
    opt.zero_grad()
    refs.clear()
    loss_of(m, inputs(1, 3)[0]).backward()  # second step too
    assert all(r() is None for r in refs)
    opt.close()


def test_step_phases_are_profiler_ranges():
    m, _ = pair()
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=0.5, chunk_bytes=512, lr=1e-2)
    train(m, opt, inputs(1, 3))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        train(m, opt, inputs(1, 3))
    names = [e.key for e in prof.key_averages()]
    counts = {e.key: e.count for e in prof.key_averages()}
    for name in ("HybridDeviceOptimizer.d2h", "HybridDeviceOptimizer.device_step", "HybridDeviceOptimizer.host_chunk"):
        assert name in names, name
    assert counts["HybridDeviceOptimizer.host_chunk"] == len(opt.cpu_optimizers) > 1
    opt.close()


def test_empty_group_is_tolerated():
    m, r = pair()
    opt = HybridDeviceOptimizer([{"params": []}, {"params": list(m.parameters())}], offload_fraction=0.5, lr=1e-2)
    ref = torch.optim.AdamW(r.parameters(), lr=1e-2, fused=True)
    train(m, opt, inputs(2, 3))
    train(r, ref, inputs(2, 3))
    assert_same(m, r)
    opt.load_state_dict(opt.state_dict())


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_tiny_gradients_are_copied_together_at_step(monkeypatch, offload_gradients):
    """Note [Tiny gradients at step()]: host parameters under BATCHED_NUMEL elements get no gradient
    hook (step() copies them); larger ones copy in backward; the result is torch AdamW's to the bit."""
    monkeypatch.setattr(_hybrid, "BATCHED_NUMEL", 200)  # l1.weight (256), l2.weight (1024) hooked; the rest batched
    m, r = pair()
    opt = HybridDeviceOptimizer(m.groups(), offload_fraction=1.0, lr=1e-2, offload_gradients=offload_gradients)
    ref = torch.optim.AdamW(r.groups(), lr=1e-2, fused=True)
    pl = opt.pipeline
    hooked = {id(p) for p in pl.params if not pl.batched(p)}
    assert hooked == {id(m.l1.weight), id(m.l2.weight)}
    xs = inputs(3, 3)
    loss_of(m, xs[0]).backward()
    for p in m.parameters():  # the hooks ran in backward; the tiny ones wait for step()
        if offload_gradients:
            assert (p.grad is None) == (id(p) in hooked)
        else:
            assert pl._slot[id(p)].copied(p.grad) == (id(p) in hooked)  # the buffer holds p.grad as it is
    opt.step()
    if offload_gradients:
        assert all(p.grad is None for p in m.parameters())
    opt.zero_grad()
    train(m, opt, xs[1:])
    train(r, ref, xs)  # the reference takes xs[0]'s step here
    assert_same(m, r)
    opt.close()


def test_worker_budget_does_not_leak_into_the_training_thread(run_group):
    """Note [Thread budget]: torch.set_num_threads on the worker also sets the process-wide value
    that a thread adopts on its first parallel op, which would hand a training thread under
    OMP_NUM_THREADS=1 the worker's budget. The worker keeps its budget; the training thread and a
    thread started later keep theirs."""
    import os
    import sys

    code = (
        "import threading, torch\n"
        "from annotate_offload import HybridDeviceOptimizer\n"
        "from annotate_offload.optim._hybrid import CpuWorker\n"
        "m = torch.nn.Linear(64, 64)\n"
        "opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=1.0, cpu_threads=2)\n"
        "w = CpuWorker(2, lambda: None); seen = {}\n"
        "def task():\n"
        "    torch.ones(1 << 16).mul_(2)\n"
        "    seen['worker'] = torch.get_num_threads()\n"
        "w.submit(task); w.drain()\n"
        "t = threading.Thread(target=lambda: seen.__setitem__('fresh', torch.get_num_threads())); t.start(); t.join()\n"
        "print(torch.get_num_threads(), seen['worker'], seen['fresh'])\n"
    )
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = run_group([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["1", "2", "1"]  # training thread, worker, a thread started later


# ---------------------------------------------------------------- one optimizer per parameter
@pytest.mark.parametrize("old_mode", [{"offload_gradients": True}, {"step_in_backward": True}, {}])
def test_a_replaced_optimizer_that_is_still_alive_stands_aside(monkeypatch, old_mode):
    """Note [One optimizer per parameter]: when an older optimizer is still referenced (an LR finder's),
    the newest optimizer owns the hooks and building it warns. Were the older one's hooks kept, with
    offload_gradients it would free p.grad under the new one (weights 0.031 off after 3 steps), and with
    step_in_backward the new one would raise a misleading "second gradient" error."""
    monkeypatch.setattr(_hybrid, "BATCHED_NUMEL", 0)  # a hook for every tensor of the tiny model
    m, r = pair()
    old = HybridDeviceOptimizer(m.parameters(), offload_fraction=0.5, lr=1e-2, **old_mode)
    with pytest.warns(UserWarning, match=r"belong to another HybridDeviceOptimizer that is still alive.*old\.close\(\)"):
        opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=0.5, lr=1e-2)
    ref = torch.optim.AdamW(r.parameters(), lr=1e-2, fused=True)
    xs = inputs(4, 3)
    train(m, opt, xs)
    train(r, ref, xs)
    assert_same(m, r)
    # the superseded one still steps correctly on its own (gradients copied at its step())
    opt.close()
    if not old_mode.get("step_in_backward"):
        train(m, old, xs[:2])
        old_ref = torch.optim.AdamW(r.parameters(), lr=1e-2, fused=True)
        train(r, old_ref, xs[:2])
        assert_same(m, r)
    old.close()


@pytest.mark.parametrize("newer", [{"offload_gradients": True}, {"step_in_backward": True}])
def test_an_older_optimizer_refuses_to_step_while_a_newer_one_takes_the_gradients(newer):
    """A newer optimizer in these modes frees or steps the gradients in backward through the hooks it took
    over: the older one's step() would miss them, so it raises before anything changes; closing the newer
    one lets the older one train exactly."""
    m, r = pair()
    old = HybridDeviceOptimizer(m.parameters(), offload_fraction=1.0, lr=1e-2)
    with pytest.warns(UserWarning, match="still alive"):
        new = HybridDeviceOptimizer(m.parameters(), offload_fraction=1.0, lr=1e-2, **newer)
    loss_of(m, inputs(1, 3)[0]).backward()
    with pytest.raises(OffloadError, match="newer HybridDeviceOptimizer.*close"):
        old.step()
    new.close()
    m.zero_grad()
    r.load_state_dict(m.state_dict())
    ref = torch.optim.AdamW(r.parameters(), lr=1e-2, fused=True)
    xs = inputs(2, 4)
    train(m, old, xs)
    train(r, ref, xs)
    assert_same(m, r)
    old.close()


def test_weights_a_device_half_wrote_reach_another_optimizers_masters():
    """torch's fused step writes the weights without a version bump; the device half bumps them, so an
    optimizer whose host masters hold those weights re-seeds them before its next step."""
    m, r = pair()
    first = HybridDeviceOptimizer(m.parameters(), offload_fraction=1.0, lr=1e-2)
    ref_first = torch.optim.AdamW(r.parameters(), lr=1e-2, fused=True)
    xs = inputs(5, 3)
    train(m, first, xs[:1])
    train(r, ref_first, xs[:1])
    second = HybridDeviceOptimizer(m.parameters(), offload_fraction=0.0, lr=1e-2)
    ref_second = torch.optim.AdamW(r.parameters(), lr=1e-2, fused=True)
    train(m, second, xs[1:4])
    train(r, ref_second, xs[1:4])
    train(m, first, xs[4:])
    train(r, ref_first, xs[4:])
    assert_same(m, r)


def test_no_ownership_warning_after_close_or_release(recwarn):
    m, _ = pair()
    first = HybridDeviceOptimizer(m.parameters(), offload_fraction=1.0)
    first.close()
    second = HybridDeviceOptimizer(m.parameters(), offload_fraction=1.0)
    del second  # unreferenced: gone at once (no reference cycle keeps it alive)
    HybridDeviceOptimizer(m.parameters(), offload_fraction=1.0).close()
    assert not [w for w in recwarn if "still alive" in str(w.message)]


@pytest.mark.parametrize("offload_gradients", [False, True])
def test_step_retried_after_a_device_half_error_steps_the_host_half_once(offload_gradients):
    """The default mode steps the device half first; when its optimizer raises, no host chunk has
    stepped, and a retried step() must step them once with the held gradients (with
    offload_gradients, p.grad no longer holds them: the failed step must not consume them)."""
    fail = {"on": False}

    class Flaky(torch.optim.AdamW):
        def step(self, closure=None):
            if fail["on"]:
                fail["on"] = False
                raise RuntimeError("device half failed")
            return super().step(closure)

    m, r = pair()
    opt = HybridDeviceOptimizer(m.parameters(), offload_fraction=0.5, chunk_bytes=512, lr=1e-2, fused=True,
                                gpu_optimizer_cls=Flaky, offload_gradients=offload_gradients)
    ref = torch.optim.AdamW(r.parameters(), lr=1e-2, fused=True)
    x = inputs(1, 3)[0]
    for model in (m, r):
        loss_of(model, x).backward()
    fail["on"] = True
    with pytest.raises(RuntimeError, match="device half failed"):
        opt.step()
    opt.step()
    ref.step()
    assert_same(m, r)
    opt.zero_grad()
    ref.zero_grad()
    train(m, opt, inputs(2, 3))  # and training goes on in step
    train(r, ref, inputs(2, 3))
    assert_same(m, r)
    opt.close()
