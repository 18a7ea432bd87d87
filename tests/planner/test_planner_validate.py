"""The GPU validation script runs end to end on CPU (a smoke run: the CPU timings mean nothing)."""

import pytest

from annotate_offload.planner import _validate_gpu


def test_validation_script_smoke_on_cpu(capsys):
    rc = _validate_gpu.main(
        ["--device", "cpu", "--dtype", "float32", "--layers", "3", "--hidden", "32", "--heads", "2", "--batch", "1",
         "--seq", "32", "--budgets-gib", "0.0003", "--iters", "1", "--warmup", "0"]
    )
    out = capsys.readouterr().out
    assert rc in (0, 1)
    assert "| budget GiB | variant |" in out
    for row in ("| - | keep-all | K K K |", "| 0.0003 | planned |", "| 0.0003 | recompute-only |",
                "offload_transform('auto')"):
        assert row in out
    assert "predicted step time" in out and "vs own prediction" in out


def test_validation_script_needs_cuda_or_cpu_flag(capsys, monkeypatch):
    monkeypatch.setattr(_validate_gpu.torch.cuda, "is_available", lambda: False)
    assert _validate_gpu.main(["--device", "cuda"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


@pytest.mark.cuda
def test_validation_script_small_on_gpu(capsys):
    rc = _validate_gpu.main(["--layers", "4", "--hidden", "512", "--heads", "8", "--seq", "1024",
                             "--budgets-gib", "0.05", "--iters", "3", "--warmup", "1"])
    assert rc in (0, 1)
    assert "| 0.05 | planned |" in capsys.readouterr().out
