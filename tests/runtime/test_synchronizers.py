"""Schedules and state machines of the default and manual synchronizers."""

from __future__ import annotations

import pytest
import torch

from annotate_offload import OffloadError
from annotate_offload.runtime import DefaultOffloadSynchronizer, ManualOffloadSynchronizer


def _layer(sync, i, x, w):
    sync.enter_layer(i)
    y = torch.tanh(x @ w)
    return sync.commit_layer(y, i)


def test_release_points_follow_transformer_engines_bound_or_the_lag():
    te = DefaultOffloadSynchronizer(5, 2, device="cpu")
    # TE: layer i released at the entry of L-N+i, reloaded when backward reaches L-1-N+i
    assert [te.release_point(i) for i in range(2)] == [3, 4] and te.prefetch_layers == 2
    lagged = DefaultOffloadSynchronizer(8, 7, device="cpu", release_lag=1, prefetch_layers=1)
    assert lagged.release_point(0) == 2 and lagged.release_point(6) == 8  # 8: the end of forward


def test_release_and_prefetch_happen_at_the_scheduled_layers():
    L = 4
    s = DefaultOffloadSynchronizer(L, 3, device="cpu", min_offload_numel=0, release_lag=1,
                                   prefetch_layers=1)
    w = torch.nn.Parameter(torch.randn(64, 64))
    h = torch.randn(8, 64)
    resident = []
    for i in range(L):
        h = _layer(s, i, h, w)
        resident.append(s.stats.resident_bytes)
    unit = 8 * 64 * 4  # per layer: its input and its tanh output (w is a parameter, never offloaded)
    # layer 0 is released at the entry of 2 (lag 1) or earlier once its copy is done (CPU: at once)
    assert max(resident) <= 2 * 2 * unit
    reloaded = []
    h.register_hook(lambda g: reloaded.append(s.stats.bytes_reloaded))
    h.sum().backward()
    # each layer's tanh output is the next layer's input: copied once (the next layer borrows
    # the host copy), so 3 layers move x + 3 outputs, and each unit is reloaded once
    assert s.stats.bytes_reloaded == s.stats.bytes_offloaded == (1 + 3) * unit
    assert s.stats.tensors_deduplicated == 2
    assert s.stats.on_demand_reloads == 0
    assert s.stats.resident_bytes == 0


def _two_op_layer(sync, i, x, w1, w2):
    sync.enter_layer(i)
    y = torch.tanh(x @ w1)
    z = torch.tanh(y @ w2)
    return sync.commit_layer(z, i)


@pytest.mark.parametrize("k", [1, 2])
def test_each_reload_starts_once_half_of_the_layer_above_is_used(monkeypatch, k):
    """Note [Paced prefetch]: at N = L-1 with a look-ahead of one layer, the kept last layer paces
    the first reload (layer L-2 starts once half of layer L-1's saved activations were unpacked),
    and each reload below starts once half of the layer above's reloads were used up, not at that
    layer's first backward node. A longer look-ahead starts them at the layer boundaries."""
    from annotate_offload.runtime._layer_state import _LayerState

    L = 4
    w1, w2 = torch.nn.Parameter(torch.randn(64, 64)), torch.nn.Parameter(torch.randn(64, 64))
    x0 = torch.randn(8, 64, requires_grad=True)

    def run(sync):
        h = x0
        for i in range(L):
            h = _two_op_layer(sync, i, h, w1, w2) if sync else torch.tanh(torch.tanh(h @ w1) @ w2)
        return h

    ref = torch.autograd.grad(run(None).sum(), (x0, w1, w2))
    s = DefaultOffloadSynchronizer(L, L - 1, device="cpu", min_offload_numel=0, release_lag=1, prefetch_layers=k)
    starts = []  # (layer, (bytes used, bytes held) of the layer above) at each layer's reload
    real = _LayerState.start_reload

    def spy(state):
        if state.state != "reload_started":
            above = s._step.layers.get(state.index + 1)
            pacer = above.pacer if above is not None else s._step.kept.get(state.index + 1)
            starts.append((state.index, None if pacer is None else (pacer.used, pacer.total)))
        return real(state)

    monkeypatch.setattr(_LayerState, "start_reload", spy)
    got = torch.autograd.grad(run(s).sum(), (x0, w1, w2))
    for a, b in zip(got, ref):
        torch.testing.assert_close(a, b, rtol=0, atol=0)
    assert [i for i, _ in starts] == [2, 1, 0]
    if k == 1:
        for _, (used, held) in starts:
            assert held > 0 and held <= 2 * used < 2 * held  # half of the layer above, not all of it
    else:
        assert starts[0][1] is None and all(used == 0 for _, (used, _) in starts[1:])
    assert s.stats.on_demand_reloads == 0 and s.stats.resident_bytes == 0


@pytest.mark.parametrize("manual", [False, True])
def test_a_reload_is_dropped_once_each_of_its_handles_was_unpacked(manual):
    s = (ManualOffloadSynchronizer(1, device="cpu", min_offload_numel=0) if manual
         else DefaultOffloadSynchronizer(2, 1, device="cpu", min_offload_numel=0, prefetch_layers=1))
    a, b = torch.randn(8, 16), torch.randn(8, 16)
    assert s.fwd_step() == 0
    ha1, ha2, hb = s.push_tensor(a), s.push_tensor(a), s.push_tensor(b)  # a: one unit, two handles
    if manual:
        s.start_offload_layer(0)
        s.release_activation_forward_gpu_memory(0)
        s.start_reload_layer(0)
    else:
        s.fwd_step()  # releases layer 0 (CPU: its copy is done)
        s.bwd_step(1)  # reloads it
    unit = a.nbytes
    assert s.stats.resident_bytes == 2 * unit
    assert torch.equal(s.pop_tensor(hb), b) and s.stats.resident_bytes == unit  # b's only handle
    for _ in range(2):  # a handle unpacked twice counts once
        assert torch.equal(s.pop_tensor(ha1), a) and s.stats.resident_bytes == unit
    assert torch.equal(s.pop_tensor(ha2), a) and s.stats.resident_bytes == 0
    reloaded = s.stats.bytes_reloaded
    assert torch.equal(s.pop_tensor(hb), b)  # unpacked again once dropped: its unit alone comes back
    assert s.stats.bytes_reloaded == reloaded + unit and s.stats.on_demand_reloads == 1
    s.finish_part_of_bwd()
    assert s.stats.resident_bytes == 0


def test_explicit_offloaded_layers_and_validation():
    s = DefaultOffloadSynchronizer(6, offloaded_layers=[1, 3], device="cpu")
    assert s.offloaded_layers == {1, 3}
    with pytest.raises(ValueError, match="last layer"):
        DefaultOffloadSynchronizer(4, offloaded_layers=[3], device="cpu")
    with pytest.raises(ValueError, match=r"offloaded_layers item=7"):
        DefaultOffloadSynchronizer(4, offloaded_layers=[7], device="cpu")
    with pytest.raises(ValueError, match="num_offloaded_layers=4"):
        DefaultOffloadSynchronizer(4, 4, device="cpu")


def test_entering_a_layer_twice_without_commit_raises():
    s = DefaultOffloadSynchronizer(3, 1, device="cpu")
    s.enter_layer(0)
    with pytest.raises(OffloadError, match="still open"):
        s.enter_layer(1)
    assert s._scope is None and s._step is None  # the refused entry dropped the step
    s.enter_layer(0)
    with pytest.raises(OffloadError, match="commit the layer that was entered"):
        s.commit_layer(torch.zeros(1, requires_grad=True), 2)
    assert s._scope is None and s._step is None


def test_explicit_indices_resynchronise_after_skipped_layers_and_eval():
    s = DefaultOffloadSynchronizer(4, 3, device="cpu", min_offload_numel=0, prefetch_layers=1)
    w = torch.nn.Parameter(torch.randn(32, 32))
    for _ in range(3):
        with torch.no_grad():
            _layer(s, 0, torch.randn(4, 32), w)  # eval pass: nothing happens
        h = torch.randn(4, 32)
        for i in (0, 2, 3):  # layer 1 skipped
            h = _layer(s, i, h, w)
        h.sum().backward()
        # layers 0 and 2 offloaded (3 is last): layer 0 moves its input and output, layer 2
        # borrows layer 0's output (its input, layer 1 being skipped) and moves its own output
        assert s.stats.bytes_offloaded == s.stats.bytes_reloaded == 3 * 4 * 32 * 4


def _manual(L=3):
    s = ManualOffloadSynchronizer(L, device="cpu", min_offload_numel=0)
    w = torch.randn(32, 32, requires_grad=True)
    h = torch.randn(4, 32)
    for i in range(L):
        h = _layer(s, i, h, w)
    return s, h


def test_manual_state_machine_order():
    s, h = _manual()
    with pytest.raises(OffloadError, match="expected 'offload_started'"):
        s.release_activation_forward_gpu_memory(0)
    with pytest.raises(OffloadError, match="expected 'offload_finished'"):
        s.start_reload_layer(0)
    s.start_offload_layer(0)
    with pytest.raises(OffloadError, match="expected 'not_offloaded'"):
        s.start_offload_layer(0)
    s.release_activation_forward_gpu_memory(0)
    s.start_reload_layer(0)
    with pytest.raises(OffloadError, match="expected 'offload_finished'"):
        s.start_reload_layer(0)
    with pytest.raises(ValueError, match="layer_id=9"):
        s.start_offload_layer(9)
    h.sum().backward()


def test_manual_pop_before_reload_raises():
    s, h = _manual()
    s.start_offload_layer(0)
    s.release_activation_forward_gpu_memory(0)
    with pytest.raises(OffloadError, match="start_reload_layer\\(0\\)"):
        h.sum().backward()


def test_manual_layers_never_offloaded_keep_their_tensors():
    s, h = _manual()
    h.sum().backward()
    assert s.stats.bytes_offloaded == 0 and s.stats.tensors_offloaded > 0


def test_manual_before_forward_raises():
    s = ManualOffloadSynchronizer(3, device="cpu")
    with pytest.raises(OffloadError, match="has not run a forward"):
        s.start_offload_layer(0)


def test_opt_in_policy_offloads_only_marked_tensors():
    from annotate_offload import mark_activation_offload

    s = DefaultOffloadSynchronizer(2, 1, device="cpu", min_offload_numel=0, policy="opt_in")
    x = torch.randn(16, 16)
    marked = torch.randn(16, 16)
    mark_activation_offload(marked)
    w = torch.randn(16, 16, requires_grad=True)
    s.enter_layer(0)
    y = (x * w).sum() + (marked * w).sum()
    s.commit_layer(y, 0)
    y.backward()
    assert s.stats.bytes_offloaded == marked.nbytes
    assert s.stats.kept["not_selected"] == 1


def test_nvte_cpu_offload_v1_env_selects_opt_in(tmp_path, run_group):
    import sys

    code = (
        "from annotate_offload.runtime import DefaultOffloadSynchronizer as D;"
        "print(D(2, 1, device='cpu').policy)"
    )
    env = {"NVTE_CPU_OFFLOAD_V1": "1", "PATH": "/usr/bin:/bin"}
    import os

    env = {**os.environ, "NVTE_CPU_OFFLOAD_V1": "1"}
    out = run_group([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert out.stdout.strip() == "opt_in", out.stderr


def test_marks_are_honoured_including_te_attribute():
    from annotate_offload import mark_not_offload

    s = DefaultOffloadSynchronizer(2, 1, device="cpu", min_offload_numel=0)
    a, b, c = torch.randn(8, 8), torch.randn(8, 8), torch.randn(8, 8)
    mark_not_offload(a)
    b._TE_do_not_offload = True
    w = torch.randn(8, 8, requires_grad=True)
    s.enter_layer(0)
    y = (a * w).sum() + (b * w).sum() + (c * w).sum()
    s.commit_layer(y, 0)
    y.backward()
    assert s.stats.kept["marked"] == 2 and s.stats.bytes_offloaded == c.nbytes
    with pytest.raises(TypeError, match="mark_not_offload\\(\\) takes tensors"):
        mark_not_offload("x")
    with pytest.raises(TypeError, match="got str"):  # checked before any tensor is marked
        mark_not_offload([c], "x")
    assert not hasattr(c, "_TE_do_not_offload")


def test_start_offload_copies_before_save_and_detects_inplace_change():
    from annotate_offload import start_offload

    s = DefaultOffloadSynchronizer(2, 1, device="cpu", min_offload_numel=0)
    w = torch.randn(64, 64, requires_grad=True)
    x = torch.randn(64, 64)
    s.enter_layer(0)
    start_offload(x)
    assert s.stats.bytes_offloaded == x.nbytes  # copy started before autograd saved x
    y = (x * w).sum()
    s.commit_layer(y, 0)
    assert s.stats.bytes_offloaded == x.nbytes  # the save reused the early copy
    y.backward()
    torch.testing.assert_close(w.grad, x, rtol=0, atol=0)


def test_get_offloaded_total_size_mb():
    s = DefaultOffloadSynchronizer(2, 1, device="cpu", min_offload_numel=0)
    w = torch.randn(512, 512, requires_grad=True)
    s.enter_layer(0)
    y = torch.tanh(w * 2).sum()
    s.commit_layer(y, 0)
    assert s.get_offloaded_total_size_mb() == pytest.approx(1.0)
    y.backward()


def test_marks_on_a_base_cover_its_views():
    """nn.Linear on a 3-D input saves a view of it: the mark on the base must still count."""
    from annotate_offload import mark_activation_offload, mark_not_offload

    s = DefaultOffloadSynchronizer(2, 1, device="cpu", min_offload_numel=0)
    x = torch.randn(2, 8, 16)
    mark_not_offload(x)
    lin = torch.nn.Linear(16, 16)
    s.enter_layer(0)
    y = s.commit_layer(lin(x).sum(), 0)
    y.backward()
    assert s.stats.bytes_offloaded == 0 and s.stats.kept["marked"] >= 1
    s = DefaultOffloadSynchronizer(2, 1, device="cpu", min_offload_numel=0, policy="opt_in")
    x = torch.randn(2, 8, 16)
    mark_activation_offload(x)
    s.enter_layer(0)
    y = s.commit_layer(lin(x).sum(), 0)
    y.backward()
    assert s.stats.bytes_offloaded == x.nbytes


def test_deepcopy_gives_a_fresh_runtime_with_the_same_configuration():
    import copy
    import pickle

    from annotate_offload.errors import OffloadError

    s = DefaultOffloadSynchronizer(4, 2, device="cpu", release_lag=1, prefetch_layers=1, min_offload_numel=7)
    s.add_frozen_weights([torch.zeros(3, 5)])
    x = torch.randn(64, 64, requires_grad=True)
    s.enter_layer(0)
    y = s.commit_layer((x * 2).sin(), 0)  # a step in flight: its state must not reach the copy
    c = copy.deepcopy(s)
    assert type(c) is type(s) and c.stats is not s.stats and c._step is None
    assert (c.num_layers, c.offloaded_layers, c.release_lag, c.prefetch_layers, c.min_offload_numel, c.policy) == (
        s.num_layers, s.offloaded_layers, s.release_lag, s.prefetch_layers, s.min_offload_numel, s.policy)
    assert c._frozen_shapes == s._frozen_shapes and c._frozen_shapes is not s._frozen_shapes
    assert c.backend is s.backend and c.pool is s.pool  # process-wide, shared
    y.sum().backward()
    assert s.stats.bytes_offloaded > 0 and c.stats.bytes_offloaded == 0
    with pytest.raises(OffloadError, match="cannot be pickled"):
        pickle.dumps(s)
