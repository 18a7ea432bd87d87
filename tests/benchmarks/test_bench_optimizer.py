"""benchmarks/optimizer.py on the CPU backend (tiny shapes; the numbers carry no claim)."""

from __future__ import annotations

import math

import pytest
import torch

import optimizer as bench

MODES = ["W3 exact", "W3 step_in_backward", "W3 delayed_param_update", "W3 overlap off"]


@pytest.mark.slow
def test_tiny_rows_and_table(capsys):
    assert bench.main(["--tiny", "--fractions", "0,1", "--steps", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("**CPU backend: a smoke run")
    for name in ["fraction 0.0", "fraction 1.0"] + MODES:
        assert f"| {name} |" in out
    assert "| W3 overlap off | - |" in out  # no target, no floor


@pytest.mark.slow
def test_rows_are_judged_against_t_cpu_timed_around_them_in_rotated_rounds():
    # Note [T_cpu around each row]: every judged row bracketed, the rounds rotated
    rows = bench.run(tiny=True, fractions=(0.0, 1.0), steps=1, warmup=0, rounds=3, around=True)
    ref = rows[0]
    assert rows[1]["offloaded_numel"] == 0 and rows[2]["offloaded_numel"] == ref["numel"]
    w3 = rows[3:]
    assert [(r["mode"], r["round"]) for r in w3] == [(m, 1) for m in MODES] + [(m, 2) for m in MODES[1:3] + MODES[:1]] + [
        (m, 3) for m in MODES[2:3] + MODES[:2]]
    for r in w3:
        assert r["step_ms"] > 0 and math.isfinite(r["step_ms"]) and "skip" not in r
        if r["mode"] == "W3 overlap off":
            assert r.get("floor") is None
            continue
        before, after = r["around"]
        assert r["floor"] > 0 and before > 0 and after > 0
        assert ("floor_copies" in r) == (r["mode"] != "W3 exact")  # the overlapped modes' limit
    exact = w3[0]
    assert exact["floor"] == pytest.approx(ref["fwd"] + ref["bwd"] + sum(exact["around"]) / 2)
    table = bench.format_table(rows)
    assert "Medians over 3 rotated rounds" in table and "| W3 delayed_param_update | 3 |" in table
    assert "| W3 overlap off | 1 |" not in table  # not judged


def test_a_peer_that_does_not_step_is_flagged():
    from annotate_offload.models import GPTConfig, GPTStack

    m = GPTStack(GPTConfig(hidden=32, heads=2, layers=1))
    x, cpu = torch.randn(1, 4, 32), torch.device("cpu")
    assert "skip" not in bench._measure("adamw", lambda ps: torch.optim.AdamW(ps, lr=1e-3), m, x, cpu, 1, 0)
    row = bench._measure("frozen", lambda ps: torch.optim.SGD(ps, lr=0.0), m, x, cpu, 1, 0)
    assert row["skip"] == "weights unchanged: it did not step"
    assert bench._measure("absent", lambda ps: None, m, x, cpu, 1, 0)["skip"] == "not importable"


def test_expected_peak_with_offloaded_gradients_never_below_forward_floor():
    # f=0 peaks at the end of forward (weights + state + activations): offloading gradients cannot
    # lower it below weights + activations
    G, n = 1 << 30, 1_209_000_000
    base, ref = {"peak_bytes": int(22.78 * G)}, {"weights_bytes": 4 * n, "activation_bytes": int(22.78 * G) - 12 * n}
    row = {"offloaded_numel": n}
    assert bench._expected_peak(row, base, ref, True) == 4 * n + ref["activation_bytes"]
    assert bench._expected_peak(row, base, ref, False) == base["peak_bytes"] - 8 * n


@pytest.mark.parametrize("argv", [["--tiny", "--fractions", "2"], ["--tiny", "--rounds", "0"], ["--tiny", "--steps", "0"]])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2


@pytest.mark.cuda
def test_host_probe_frees_its_gpu_copy_buffers():
    # Note [T_cpu around each row]: the probes run between rows; their GPU copy buffers must not
    # stay allocated and add to every later row's peak
    before = torch.cuda.memory_allocated()
    probe = bench.HostProbe(1 << 20, 2, copies=True)
    assert probe.ms(1) > 0 and torch.cuda.memory_allocated() == before
