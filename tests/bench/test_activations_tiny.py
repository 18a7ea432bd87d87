"""The --tiny activation benchmark on CPU: it runs every method end to end and its numbers are consistent."""

import importlib.util
import os

import pytest
import torch

from annotate_offload.bench import main
from annotate_offload.bench._report import format_report, targets
from annotate_offload.bench._timing import Bandwidth, StepTimes
from annotate_offload.bench.activations import MethodResult, WorkloadReport, run_workload
from annotate_offload.bench._workloads import TINY_WORKLOADS, WORKLOADS

_HAS_RUNTIME = importlib.util.find_spec("annotate_offload.runtime._synchronizer") is not None


@pytest.fixture(scope="module")
def tiny_w1():
    return run_workload(
        TINY_WORKLOADS["W1"],
        device=torch.device("cpu"),
        tiny=True,
        command="pytest",
        warmup=0,
        steps=1,
        release_lags=[1],
        prefetch_layers=[1],
        log=None,
    )


def test_workloads_match_issue_7():
    w1, w2 = WORKLOADS["W1"], WORKLOADS["W2"]
    assert (w1.layers, w1.hidden, w1.heads, w1.batch, w1.seq, w1.offload) == (8, 4096, 32, 2, 4096, 7)
    assert (w2.layers, w2.hidden, w2.heads, w2.batch, w2.seq, w2.offload) == (8, 8192, 64, 1, 4096, 2)


def test_every_method_has_a_row_and_baselines_are_exact(tiny_w1):
    names = [r.name for r in tiny_w1.results]
    assert names[0] == "baseline"
    assert {"save_on_cpu", "checkpoint (3 layers)", "OffloadActivations"} <= set(names)
    for r in tiny_w1.results:
        if r.kind in ("baseline", "peer") and r.error is None:
            assert r.exact == "yes", r  # offload/recompute on CPU must reproduce baseline bits
        if r.error is not None:
            assert r.error.startswith(("not run", "failed")), r.error
    for name in ("baseline", "save_on_cpu", "checkpoint (3 layers)"):
        row = next(r for r in tiny_w1.results if r.name == name)
        assert row.times is not None and row.times.step > 0


def test_saved_bytes_count_is_plausible(tiny_w1):
    w = tiny_w1.workload
    layer_input = w.batch * w.seq * w.hidden * 4  # fp32 on CPU
    # every offloaded layer saves at least its LayerNorm input and the 4x-wide MLP activation
    assert tiny_w1.saved_bytes >= w.offload * 5 * layer_input
    # the first layer's LayerNorm saves the workload's own input, which the caller holds
    assert tiny_w1.held_bytes == layer_input


@pytest.mark.skipif(not _HAS_RUNTIME, reason="annotate_offload runtime not landed yet")
def test_ours_rows_offload_and_are_bit_exact(tiny_w1):
    ours = [r for r in tiny_w1.results if r.kind == "ours"]
    assert [r.name for r in ours] == [
        "annotate_offload (TE API)", "annotate_offload lag=1 prefetch=1", "annotate_offload offload_transform"
    ]
    assert "release_lag=1, prefetch_layers=1), path=fx" in ours[2].detail  # knobs of the fastest grid row
    for r in ours:
        assert r.error is None, r.error
        assert r.exact == "yes"
        assert 0 < r.offloaded_bytes <= tiny_w1.saved_bytes
    assert tiny_w1.floor_bytes_source.startswith("annotate_offload")


def test_markdown_lists_ratios_floor_and_context(tiny_w1):
    text = format_report(tiny_w1)
    header = next(line for line in text.splitlines() if line.startswith("| method"))
    cols = [c.strip() for c in header.strip("|").split("|")]
    assert cols[1:4] == ["step / baseline", "step / floor", "act. mem / baseline"]  # ratios first
    assert "copy floor = max(T_fwd, bytes/BW_d2h) + max(T_bwd, bytes/BW_h2d)" in text
    assert "torch " + torch.__version__ in text and "command: `pytest`" in text
    assert "no timing claims" in text


def _fake_report(name, base_ms, base_fwd, base_bwd, rows, nbytes, bw_gbps=50.0, tiny=False):
    base = MethodResult("baseline", "baseline", times=StepTimes([base_fwd], [base_bwd], [base_ms], 100))
    return WorkloadReport(
        workload=WORKLOADS[name],
        device="fake",
        torch_version="x",
        command="c",
        tiny=tiny,
        bandwidth=Bandwidth(bw_gbps, bw_gbps, 1 << 30, True),
        saved_bytes=nbytes,
        floor_bytes=nbytes,
        floor_bytes_source="test",
        results=[base] + rows,
        peers=[],
    )


def test_floor_formula_uses_max_of_compute_and_copy_each_way():
    # 5e9 bytes at 50 GB/s = 100 ms each way; fwd 40 ms, bwd 150 ms -> floor = 100 + 150
    rep = _fake_report("W1", 190.0, 40.0, 150.0, [], 5_000_000_000)
    assert rep.floor_terms() == pytest.approx((40.0, 100.0, 150.0, 100.0))
    assert rep.floor_ms == pytest.approx(250.0)


def test_targets_w1_pass_and_fail():
    ours = MethodResult("annotate_offload x", "ours", times=StepTimes([1], [1], [270.0], 40))
    trl = MethodResult("OffloadActivations", "peer", detail="trl", times=StepTimes([1], [1], [400.0], 50))
    rep = _fake_report("W1", 190.0, 40.0, 150.0, [ours, trl], 5_000_000_000)
    verdicts = [ok for _, ok in targets(rep)]
    assert verdicts == [True, True, True]  # 270/250 = 1.08; 400/270 = 1.48; 40 <= 50
    ours.times = StepTimes([1], [1], [300.0], 60)
    assert [ok for _, ok in targets(rep)] == [False, False, False]


def test_targets_w2_memory_rule():
    ours = MethodResult("annotate_offload x", "ours", times=StepTimes([1], [1], [101.0], 77))
    rep = _fake_report("W2", 100.0, 30.0, 70.0, [ours], 25)
    # need 0.9 * 2/8 * 100 = 22.5 bytes saved; 23 saved; 1.01x <= 1.02
    assert [ok for _, ok in targets(rep)] == [True, True]
    ours.times = StepTimes([1], [1], [103.0], 78)
    assert [ok for _, ok in targets(rep)] == [False, False]  # the layers hold 25 >= 22.5: no limit line


def test_targets_w2_memory_limit_line_when_the_layers_hold_less_than_the_target():
    # Note [W2's memory limit], H4 of session 10: baseline 8.89 GiB, the two layers save 2.00 GiB of
    # which 64 MiB is the caller's input; the TE row saved 1.88 GiB
    G = 1 << 30
    ours = MethodResult("annotate_offload x", "ours", times=StepTimes([1], [1], [101.0], int(7.01 * G)))
    rep = _fake_report("W2", 100.0, 30.0, 70.0, [ours], 2 * G)
    rep.results[0].times = StepTimes([30.0], [70.0], [100.0], int(8.89 * G))
    rep.held_bytes = 64 << 20
    (t, ok_t), (m, ok_m), (lim, ok_lim) = targets(rep)
    assert ok_t and not ok_m and ok_lim
    assert "save 2.00 GiB" in lim and "64.0 MiB of it the input the caller holds" in lim and "1.94 GiB" in lim
    assert "0.97x of it" in lim
    ours.times = StepTimes([1], [1], [101.0], int(7.30 * G))  # 1.59 GiB saved = 0.82 of the limit
    assert targets(rep)[2][1] is False


def test_tiny_targets_are_not_judged():
    rep = _fake_report("W1", 1.0, 0.5, 0.5, [], 10, tiny=True)
    assert [ok for _, ok in targets(rep)] == [None]


def test_main_tiny_writes_markdown_png_and_profile(tmp_path, capsys):
    rc = main(
        ["activations", "--tiny", "--workloads", "W2", "--warmup", "0", "--steps", "1",
         "--release-lag", "1", "--prefetch-layers", "2", "--profile", "--out", str(tmp_path)]
    )
    assert rc == 0
    out = capsys.readouterr().out
    assert out.startswith("# annotate_offload activation benchmark")
    assert "## W2 compute-bound (tiny)" in out
    files = set(os.listdir(tmp_path))
    assert (tmp_path / "activations.md").read_text().strip() == out.strip()
    if importlib.util.find_spec("matplotlib"):
        assert (tmp_path / "activations.png").stat().st_size > 1000
    if _HAS_RUNTIME:
        assert {"W2_profile.txt", "W2_profile_trace.json.gz"} <= files
        assert "one step of annotate_offload" in (tmp_path / "W2_profile.txt").read_text()


@pytest.mark.skipif(not _HAS_RUNTIME, reason="annotate_offload runtime not landed yet")
def test_transform_runner_restores_the_shared_model():
    from annotate_offload.bench import _methods
    from annotate_offload.bench._workloads import build

    model, x, grad = build(TINY_WORKLOADS["W1"], torch.device("cpu"))
    expected = model(x)
    runner = _methods.make_transform(model, 3, release_lag=1, prefetch_layers=1, min_offload_numel=1024)
    torch.autograd.backward(runner.forward(x), grad)
    assert runner.offloaded_bytes() > 0
    runner.close()
    assert "forward" not in model.__dict__ and not hasattr(model, "offload_plan")
    assert torch.equal(model(x), expected)


def _row(name, kind, step, peak, bwd=1.0):
    from annotate_offload.bench._timing import StepTimes

    return MethodResult(name, kind, times=StepTimes([1.0], [bwd], [step], peak))


def test_targets_are_judged_on_one_row_that_meets_the_time_target():
    """Issue 7: one configuration must be within 1.10 x floor *and* lean: the judged row is the
    least-memory row within the time target, not simply the fastest."""
    from annotate_offload.bench._timing import Bandwidth
    from annotate_offload.bench._workloads import WORKLOADS

    base = _row("baseline", "baseline", 150.0, 8 << 30)
    fast_fat = _row("lag=1 prefetch=2", "ours", 275.0, 3 << 30)
    lean = _row("lag=1 prefetch=1", "ours", 278.0, 2 << 30)
    slow_lean = _row("TE schedule", "ours", 310.0, 1 << 30)  # leanest but beyond 1.10 x floor
    bw = Bandwidth(d2h_gbps=55.0, h2d_gbps=55.0, nbytes=1 << 30, pinned=True)
    rep = WorkloadReport(WORKLOADS["W1"], "gpu", "x", "cmd", False, bw, 0, int(7.5e9), "stats",
                         [base, fast_fat, lean, slow_lean], [])
    assert 270 < rep.floor_ms < 275
    assert rep.best_ours is lean
    rep.results = [base, fast_fat, slow_lean]
    assert rep.best_ours is fast_fat
    rep.results = [base, _row("slow", "ours", 400.0, 1 << 30)]
    assert rep.best_ours.name == "slow"  # none within the target: the fastest is judged


def test_with_trl_measured_the_judged_row_meets_every_part_of_the_w1_target():
    """F6 (session 8): the leanest row within 1.10 x floor was only 1.31x faster than TRL while
    two other rows met all three parts; the judged row is the leanest of those that meet all."""
    from annotate_offload.bench._timing import Bandwidth
    from annotate_offload.bench._workloads import WORKLOADS

    base = _row("baseline", "baseline", 149.3, 8 << 30)
    te = _row("TE schedule", "ours", 304.6, int(1.57 * 2**30))  # 1.10x floor, the least memory
    lean = _row("lag=1 prefetch=1", "ours", 278.4, int(2.14 * 2**30))
    fat = _row("lag=1 prefetch=2", "ours", 275.4, int(3.57 * 2**30))  # faster, but more memory than TRL
    trl = _row("OffloadActivations", "peer", 398.5, int(2.38 * 2**30))
    bw = Bandwidth(d2h_gbps=55.0, h2d_gbps=55.0, nbytes=1 << 30, pinned=True)
    rep = WorkloadReport(WORKLOADS["W1"], "gpu", "x", "cmd", False, bw, 0, int(7.7e9), "stats",
                         [base, te, lean, fat, trl], [])
    assert te.times.step <= 1.10 * rep.floor_ms
    assert rep.best_ours is lean
    assert all(ok for _, ok in targets(rep))
    rep.results = [base, te, fat, trl]  # no row meets all three: the least-memory row within time
    assert rep.best_ours is te
