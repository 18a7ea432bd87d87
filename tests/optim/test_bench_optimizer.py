"""The optimizer benchmark runs end to end on the CPU backend (tiny shapes, no timing claims)."""

from __future__ import annotations

import math

import pytest

from annotate_offload.bench import optimizer as bench


def test_tiny_bench_rows_and_table():
    rows = bench.run(tiny=True, fractions=(0.0, 1.0), steps=1, warmup=0, log=lambda s: None)
    names = [r["name"] for r in rows]
    assert names == ["reference", "fraction 0.0", "fraction 1.0", "W3 exact (offload_gradients)", "W3 step_in_backward",
                     "W3 delayed_param_update", "W3 overlap off"]
    ref = rows[0]
    assert ref["numel"] > 0
    assert rows[1]["offloaded_numel"] == 0 and rows[2]["offloaded_numel"] == ref["numel"]
    for r in rows[1:]:
        assert r["step_ms"] > 0 and math.isfinite(r["step_ms"])
    for r in rows[1:]:
        ph = r["phases"]
        assert ph["return_ms"] >= 0 and "host_busy_ms" in ph and "h2d_done_ms" in ph
        if r["offloaded_numel"]:
            assert ph["chunks"] >= 1 and ph["host_busy_ms"] > 0
    table = bench.format_table(rows, "cmd")
    assert "| W3 step_in_backward |" in table and "`cmd`" in table
    assert "| run | return | last D2H done |" in table  # the phases table
    assert table.startswith("**CPU backend: a smoke run")


def test_expected_peak_with_offloaded_gradients_never_below_forward_floor():
    # W3 on the H200: f=0 peak 22.78 GiB at the end of forward (weights + state + activations), so
    # offloading gradients cannot lower it below weights + activations (13.78 GiB)
    G = 1 << 30
    n = 1_209_000_000
    base = {"peak_bytes": int(22.78 * G)}
    row = {"offloaded_numel": n, "offload_gradients": True, "weights_bytes": 4 * n, "gpu_state_bytes": 0,
           "activation_bytes": int(22.78 * G) - 12 * n}
    assert bench._expected_peak(row, base) == 4 * n + row["activation_bytes"]
    row["offload_gradients"] = False
    assert bench._expected_peak(row, base) == base["peak_bytes"] - 8 * n


def test_main_prints_table(capsys):
    assert bench.main(["--tiny", "--fractions", "0.5", "--no-modes", "--steps", "1", "--warmup", "0", "--cpu-threads", "1",
                       "--chunk-mib", "1"]) == 0
    out = capsys.readouterr().out
    assert "| fraction 0.5 |" in out


def test_host_adamw_diagnostic_variants_run():
    for _, _, kw in bench._CPU_VARIANTS:  # pinning and DMA fall back to plain host tensors without CUDA
        kw = dict(kw, numels=[3000, 2000]) if kw.get("numels") == "model" else kw
        assert bench._cpu_adamw_ms(5000, 1, 1, **kw) > 0


def test_peer_that_does_not_step_is_flagged():
    import torch

    from annotate_offload.models.gpt import GPTConfig, GPTStack

    m = GPTStack(GPTConfig(hidden=32, heads=2, layers=1))
    x = torch.randn(1, 4, 32)
    cpu = torch.device("cpu")
    assert bench._measure_peer("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-3), m, x, cpu, 1, 0)["stepped"]
    row = bench._measure_peer("frozen", lambda ps: torch.optim.SGD(ps, lr=0.0), m, x, cpu, 1, 0)
    assert not row["stepped"] and "not stepping" in row["name"]


def test_overlapped_modes_are_judged_against_floors_with_copies():
    # B4 on the H200: host AdamW alone 299.0 ms, with one step's D2H+H2D running 345.2 ms
    ref = {"t_fwd_ms": 25.0, "t_bwd_ms": 52.5, "t_gpu_step_ms": 87.3, "t_cpu_stepdma_ms": 345.2}
    rows = [ref, {"name": "W3 delayed_param_update", "step_ms": 350.5}, {"name": "W3 step_in_backward", "step_ms": 400.0}]
    delayed, sib = bench._floors_with_copies(ref, rows)
    assert "= 345.2 ms: delayed_param_update 1.02x (within 1.05x) of it." in delayed
    assert "T_fwd + max(T_bwd, T_cpu with copies) = 370.2 ms: step_in_backward 1.08x (within 1.10x) of it." in sib
    rows[2]["step_ms"] = 420.0
    assert "1.13x (above 1.10x) of it" in bench._floors_with_copies(ref, rows)[1]
    assert bench._floors_with_copies({"t_fwd_ms": 1.0}, rows) == []  # no diagnostics: no floor lines
    only = bench._floors_with_copies(ref, [ref])  # modes not run: the floors alone
    assert len(only) == 2 and all(line.endswith("ms.") for line in only)


def test_host_memory_roofline_line():
    # 1 G params; add_ over them (12 GB) in 100 ms = 120 GB/s alone, 150 ms = 80 GB/s beside the copies
    ref = {"numel": 1_000_000_000, "t_cpu_ms": 280.0, "t_add_ms": 100.0, "t_add_stepdma_ms": 150.0}
    (line,) = bench._roofline(ref)
    assert "in-place add 120.0 GB/s alone, 80.0 GB/s with one step's D2H+H2D running" in line
    assert "fused AdamW moves 28 B/param = 100.0 GB/s measured alone (83% of the add's)" in line
    assert "at least 233.3 ms alone and 350.0 ms beside the copies" in line
    assert bench._roofline({"numel": 1, "t_cpu_ms": 1.0}) == []  # no diagnostics: no line


def test_mode_rows_are_judged_against_t_cpu_timed_around_them():
    # Note [T_cpu around each row]: tiny model, probes on, every mode row bracketed
    rows = bench.run(tiny=True, fractions=(), steps=1, warmup=0, log=lambda s: None, adjacent=True)
    named = {r["name"]: r for r in rows}
    for name, target in (("W3 exact (offload_gradients)", 1.10), ("W3 step_in_backward", 1.10),
                         ("W3 delayed_param_update", 1.05)):
        r = named[name]
        before, after = r["t_cpu_around_ms"]
        assert before > 0 and after > 0 and r["target"] == target
        assert r["bound_ms"] > 0 and r["floor_copies_ms"] > 0 and min(r["t_cpu_h2d_around_ms"]) > 0
    ref, ex = named["reference"], named["W3 exact (offload_gradients)"]
    assert ex["bound_ms"] == ref["t_fwd_ms"] + ref["t_bwd_ms"] + sum(ex["t_cpu_around_ms"]) / 2
    assert "t_cpu_around_ms" not in named["W3 overlap off"] and named["W3 overlap off"]["bound_ms"] is None
    table = bench.format_table(rows)
    assert "(timed around the row)" in table and "| step / floor (target) |" in table
    assert bench._judged(110.0, 100.0, 1.05) == "1.10x (above 1.05x)"
    assert bench._judged(100.0, 100.0, 1.10) == "1.00x (within 1.10x)" and bench._judged(1.0, None, 1.1) == "-"


def test_around_probes_skip_when_host_memory_is_short(monkeypatch):
    import os

    lines = []
    monkeypatch.setattr(os, "sysconf", lambda name: 1 if name == "SC_AVPHYS_PAGES" else 4096)
    assert bench._AroundProbes.fit(10**9, 1, 1, lines.append) is None
    assert "T_cpu around each row skipped" in lines[0] and "the rows use the reference T_cpu" in lines[0]


def test_peer_rows_are_judged_against_the_exact_floor_timed_around_them():
    # Note [Peers against the same floor]: G7 of session 9 (torchao 351.3 ms in the run's last minutes)
    ref = {"name": "reference", "t_fwd_ms": 22.4, "t_bwd_ms": 53.2, "t_gpu_step_ms": 85.6, "t_cpu_ms": 303.9, "numel": 10,
           "threads": 16, "t_adamw_gpu_ms": 10.0, "cpu_gparams_s": 3.98}
    peer = {"name": "torchao CPUOffloadOptimizer (offload_gradients)", "peer": True, "step_ms": 351.3,
            "peak_bytes": 13 << 30}
    exact_rule = bench._W3_FLOORS["W3 exact (offload_gradients)"][1]
    bench._judge(peer, ref, exact_rule, None, (260.0, 300.0, 280.0), (270.0, 310.0, 290.0), copies=2)
    assert peer["t_cpu_around_ms"] == (260.0, 270.0) and peer["target"] is None
    assert math.isclose(peer["bound_ms"], 22.4 + 53.2 + 265.0)
    assert math.isclose(peer["floor_copies_ms"], 22.4 + 53.2 + 285.0)
    lone = {"name": "Megatron", "peer": True, "step_ms": 450.0, "peak_bytes": 13 << 30}
    bench._judge(lone, ref, exact_rule, None, None, None, copies=2)  # no probes: the reference's T_cpu
    assert math.isclose(lone["bound_ms"], 22.4 + 53.2 + 303.9) and "t_cpu_around_ms" not in lone
    table = bench.format_table([ref, peer, lone])
    assert "| torchao CPUOffloadOptimizer (offload_gradients) | 1.03x | 351.3 | 340.6 | 260.0 / 270.0 | 0.97x of 360.6 | 13.00 |" in table
    assert "| Megatron | 1.19x | 450.0 | 379.5 | - | - | 13.00 |" in table
    assert "Peers: the exact mode's floor" in table


def test_rounds_repeat_the_judged_rows_in_rotated_order_and_report_medians():
    # Note [Rounds]: tiny model on the CPU backend (no peers there)
    rows = bench.run(tiny=True, fractions=(), steps=1, warmup=0, log=lambda s: None, rounds=3)
    names = [r["name"] for r in rows[1:]]
    ex, sib, dl, off = ("W3 exact (offload_gradients)", "W3 step_in_backward", "W3 delayed_param_update",
                        "W3 overlap off")
    assert names == [f"{n}, round 1" for n in (ex, sib, dl, off)] + [f"{n}, round 2" for n in (sib, dl, ex)] + [
        f"{n}, round 3" for n in (dl, ex, sib)]
    assert all(r["mode"] + f", round {r['round']}" == r["name"] for r in rows[1:])
    table = bench.format_table(rows)
    assert "| run | rounds | step / floor, median (target) | per round |" in table
    assert "against the reference's T_cpu (no probes around the rows" in table  # adjacent is off on tiny
    summary = {line.split(" | ")[0][2:]: line for line in table.splitlines() if line.startswith("| W3 ") and "round" not in line}
    assert set(summary) == {ex, sib, dl}  # overlap off ran once and has no target
    r = [x for x in rows if x.get("mode") == dl]
    ratios = sorted(x["step_ms"] / x["bound_ms"] for x in r)
    assert f"| {dl} | 3 | {ratios[1]:.2f}x (" in summary[dl] and "1.05x)" in summary[dl]
    assert bench._rounds_summary(bench.run(tiny=True, fractions=(), steps=1, warmup=0, log=lambda s: None)) == []
    assert bench._floors_with_copies(rows[0], rows) == []  # the rounds table judges the copies floors


def test_rounds_table_counts_only_rounds_that_stepped_and_only_judged_jobs():
    # a peer round that did not step (or failed) must not enter its median; round-1-only peers
    # (Megatron) are not summarised as one-sample "medians"
    def row(mode, k, step, **kw):
        return dict(dict(name=f"{mode}, round {k}", mode=mode, round=k, judged=True, step_ms=step, bound_ms=100.0,
                         t_cpu_around_ms=(1.0, 1.0)), **kw)

    ta = "torchao CPUOffloadOptimizer (offload_gradients)"
    rows = [{"name": "reference"}, row(ta, 1, 110.0, peer=True, stepped=True), row(ta, 2, 90.0, peer=True, stepped=False),
            row(ta, 3, 130.0, peer=True, stepped=True), row(ta, 4, 1.0, skip=True),
            row("Megatron HybridDeviceOptimizer f=1 (fused CPU AdamW)", 1, 120.0, peer=True, judged=False)]
    lines = bench._rounds_summary(rows)
    body = [line for line in lines if line.startswith("| torchao") or line.startswith("| Megatron")]
    assert len(body) == 1 and body[0].startswith(f"| {ta} | 2 | 1.20x | 1.10 / 1.30 |")
    assert "each time against T_cpu timed around it" in "".join(lines)


def test_rounds_refuse_a_run_without_the_judged_fraction_before_timing_anything():
    seen = []
    with pytest.raises(ValueError, match=r"no 1.0"):
        bench.run(tiny=True, fractions=(), mode_fractions=(0.5,), rounds=2, log=seen.append)
    with pytest.raises(ValueError, match=r"mode_fractions=.*empty"):
        bench.run(tiny=True, fractions=(), mode_fractions=(), log=seen.append)
    assert seen == []  # refused before the reference
    for argv in (["--tiny", "--mode-fractions=", "--rounds", "2"], ["--tiny", "--mode-fractions", "0.5", "--rounds", "2"],
                 ["--tiny", "--fractions", "2"]):
        with pytest.raises(SystemExit):
            bench.main(argv)
    rows = bench.run(tiny=True, fractions=(), steps=1, warmup=0, mode_fractions=(1, 1.0), log=lambda s: None)
    assert [r["name"] for r in rows[1:]].count("W3 exact (offload_gradients)") == 1  # (1, 1.0) is one fraction


@pytest.mark.parametrize("bad, exc", [(0, ValueError), (1.5, TypeError), (True, TypeError)])
def test_rounds_must_be_a_positive_int(bad, exc):
    with pytest.raises(exc, match=r"rounds"):
        bench.run(tiny=True, fractions=(), rounds=bad, log=lambda s: None)
    with pytest.raises(SystemExit):
        bench.main(["--tiny", "--rounds", "0"])


def test_modes_at_other_fractions_are_named_by_fraction_and_not_timed_against_a_floor():
    rows = bench.run(tiny=True, fractions=(0.0,), steps=1, warmup=0, log=lambda s: None, mode_fractions=(0.5, 1.0))
    named = {r["name"]: r for r in rows}
    for mode in ("W3 exact (offload_gradients)", "W3 step_in_backward", "W3 delayed_param_update", "W3 overlap off"):
        half = named[f"{mode}, f=0.5"]
        assert half["fraction"] == 0.5 and 0 < half["offloaded_numel"] < named[mode]["offloaded_numel"]
        assert half["bound_ms"] is None and "target" not in half
    assert named["W3 step_in_backward"]["target"] == 1.10
    assert "| W3 delayed_param_update, f=0.5 | - |" in bench.format_table(rows)
    with pytest.raises(ValueError, match=r"mode_fractions=.*1.5"):
        bench.run(tiny=True, mode_fractions=(1.5,), log=lambda s: None)
