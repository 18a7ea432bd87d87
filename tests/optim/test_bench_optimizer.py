"""The optimizer benchmark runs end to end on the CPU backend (tiny shapes, no timing claims)."""

from __future__ import annotations

import math

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
    table = bench.format_table(rows, "cmd")
    assert "| W3 step_in_backward |" in table and "`cmd`" in table


def test_main_prints_table(capsys):
    assert bench.main(["--tiny", "--fractions", "0.5", "--no-modes", "--steps", "1", "--warmup", "0"]) == 0
    out = capsys.readouterr().out
    assert "| fraction 0.5 |" in out
