"""Aligned host steps (Note [Aligned host steps], ``distributed/_align.py``), gloo, 2 processes.

Rank 1 reaches ``step()`` 0.6 s after rank 0. With ``align_host_step`` (the default) rank 0's
``step()`` waits for it (the barrier comes before the host step), the result is unchanged, and
``detach()`` removes the barrier; with it off, or in ``step_in_backward`` mode, rank 0 does not wait.
"""

from __future__ import annotations

import pytest

from _dist_harness import run_ranks
from _dist_workers import align_suite

LATE = 0.6


@pytest.fixture(scope="module")
def runs() -> list[dict]:
    return run_ranks(align_suite)


@pytest.mark.parametrize("case", ["fsdp_on", "plain_on"])
def test_step_waits_for_the_late_rank(runs, case):
    r0, r1 = (r[case] for r in runs)
    assert r0["step_s"] >= 0.8 * LATE, r0["step_s"]
    assert r0["alignment"][0] == 1 and r0["alignment"][1] >= 0.8 * LATE
    assert r1["alignment"][1] < 0.5 * LATE  # the late rank finds the other one waiting
    assert r0["after_detach_s"] < 0.5 * LATE  # detach() removed the barrier


def test_off_or_step_in_backward_does_not_wait(runs):
    for case in ("fsdp_off", "step_in_backward"):
        r0 = runs[0][case]
        assert r0["alignment"] is None, case
        assert r0["step_s"] < 0.5 * LATE, (case, r0["step_s"])


def test_alignment_changes_no_bits(runs):
    on, off = runs[0]["fsdp_on"]["weights"], runs[0]["fsdp_off"]["weights"]
    assert on.keys() == off.keys()
    for k in on:
        assert on[k].equal(off[k]), k
