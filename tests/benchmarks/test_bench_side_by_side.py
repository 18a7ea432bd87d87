"""benchmarks/side_by_side.py: argument checks before anything runs (the runs themselves need a GPU)."""

import sys

import pytest
from conftest import BENCHMARKS


@pytest.mark.parametrize("args, message", [(["--cases", "W9"], "unknown case 'W9'"),
                                           (["--cases", "W3-fast"], "unknown case 'W3-fast'"),
                                           (["--rounds", "0"], "--rounds must be >= 1"),
                                           (["--time-limit", "0"], "--time-limit must be > 0")])
def test_bad_arguments_exit_2_naming_the_problem(tmp_path, args, message, run_group):
    out = run_group([sys.executable, f"{BENCHMARKS}/side_by_side.py", "--old", str(tmp_path), *args],
                    capture_output=True, text=True)
    assert out.returncode == 2 and message in out.stderr
