"""benchmarks/distributed.py end to end on CPU processes (gloo): every run happens, and the 2-process
loss equals the accumulated 1-process loss (CPU/gloo is exact). The numbers carry no claim."""

from __future__ import annotations

import os

import pytest

import distributed as bench

SCRIPT = os.path.join(os.path.dirname(bench.__file__), "distributed.py")


def _two_processes(torchrun, run_group, *argv: str, cwd) -> str:
    proc = run_group(torchrun(SCRIPT, "--tiny", *argv), cwd=cwd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


@pytest.mark.slow
def test_tiny_single_process(capsys):
    assert bench.main(["--tiny"]) == 0
    out = capsys.readouterr().out
    assert "| 1 GPU | 1 |" in out and "1 process" in out


@pytest.mark.slow
def test_two_processes_fsdp_units_of_two_blocks_with_traces(tmp_path, torchrun, run_group):
    out = _two_processes(torchrun, run_group, "--parallel", "fsdp", "--fsdp-unit-layers", "2",
                         "--profile", str(tmp_path / "traces"), cwd=tmp_path)
    assert "| 2 GPUs FSDP2 | 2 |" in out and "| 1 GPU, FSDP2 at world size 1 | 1 |" in out
    assert "fully_shard units of 2 blocks" in out and "Weak-scaling efficiency" in out
    assert "max relative difference 0.00e+00 (passes" in out
    assert sorted(os.listdir(tmp_path / "traces")) == ["fsdp_rank0.json", "fsdp_rank1.json"]


@pytest.mark.slow
def test_two_processes_ddp_host_step_sharded(tmp_path, torchrun, run_group):
    out = _two_processes(torchrun, run_group, "--parallel", "ddp", cwd=tmp_path)
    assert "| 2 GPUs DDP (host step sharded) | 2 |" in out and "| 1 GPU, DDP at world size 1 | 1 |" in out
    assert "max relative difference 0.00e+00 (passes" in out


@pytest.mark.parametrize("argv", [["--tiny", "--fraction", "1.5"], ["--tiny", "--offload-layers", "2"],
                                  ["--tiny", "--parallel", "fsdp", "--replicate-host-step"],
                                  ["--tiny", "--fsdp-unit-layers", "2"]])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        bench.main(argv)
    assert e.value.code == 2
