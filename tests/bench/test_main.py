"""annotate_offload.bench.main: argument handling and dispatch to the optimizer benchmark."""

import subprocess
import sys
import types

import pytest

import annotate_offload.bench as bench


@pytest.fixture
def fake_optimizer(monkeypatch):
    calls = []
    module = types.ModuleType("annotate_offload.bench.optimizer")
    module.main = lambda argv: calls.append(list(argv)) or 0
    monkeypatch.setitem(sys.modules, "annotate_offload.bench.optimizer", module)
    monkeypatch.setattr(bench, "optimizer", module, raising=False)
    return calls


def test_optimizer_arguments_pass_through_unchanged(fake_optimizer):
    assert bench.main(["optimizer", "--tiny", "--fraction", "0.5", "--whatever"]) == 0
    assert fake_optimizer == [["--tiny", "--fraction", "0.5", "--whatever"]]


def test_all_runs_activations_then_optimizer_and_saves_its_table(fake_optimizer, monkeypatch, tmp_path, capsys):
    ran = []
    monkeypatch.setattr(bench, "_run_activations", lambda args, command: ran.append(command) or 0)
    sys.modules["annotate_offload.bench.optimizer"].main = lambda argv: fake_optimizer.append(argv) or print("| W3 |")
    assert bench.main(["all", "--tiny", "--out", str(tmp_path)]) == 0
    assert ran == [f"annotate-offload bench all --tiny --out {tmp_path}"]
    assert fake_optimizer == [["--tiny"]]
    assert capsys.readouterr().out == "| W3 |\n"
    assert (tmp_path / "optimizer.md").read_text() == "| W3 |\n"


def test_default_is_all(fake_optimizer, monkeypatch):
    ran = []
    monkeypatch.setattr(bench, "_run_activations", lambda args, command: ran.append(args.what) or 0)
    assert bench.main(["--tiny"]) == 0
    assert ran == ["all"] and fake_optimizer == [["--tiny"]]


@pytest.mark.parametrize(
    "argv, match",
    [
        (["activations", "--tiny", "--workloads", "W9"], "unknown workload 'W9'; choose from W1, W2"),
        (["activations", "--tiny", "--steps", "0"], "--steps must be >= 1, got 0"),
        (["activations", "--tiny", "--warmup", "-1"], "--warmup must be >= 0, got -1"),
        (["activations", "--tiny", "--release-lag", "-1"], "--release-lag values must be >= 0"),
        (["activations", "--tiny", "--prefetch-layers", "0"], "--prefetch-layers values must be >= 1"),
        (["activations", "--tiny", "--release-lag", "x"], r"--release-lag 'x': 'x' is not an integer"),
    ],
)
def test_bad_arguments_raise_value_error_naming_the_flag(argv, match):
    with pytest.raises(bench.BenchUsageError, match=match):
        bench.main(argv)


def test_cuda_run_without_cuda_says_to_use_tiny(monkeypatch):
    import torch

    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(bench.BenchUsageError, match=r"no CUDA device here; pass --tiny .*--device cpu"):
        bench.main(["activations"])
    ran = []
    monkeypatch.setattr(bench, "_run_optimizer", lambda *a, **k: ran.append(a) or 0)
    with pytest.raises(bench.BenchUsageError, match="no CUDA device here"):
        bench.main([])  # "all": refused before the optimizer suite runs
    assert ran == []


def test_unknown_subcommand_is_an_argparse_error():
    with pytest.raises(SystemExit):
        bench.main(["memory"])


def test_importing_bench_does_not_initialise_cuda():
    code = (
        "import torch, annotate_offload.bench, annotate_offload.bench.activations, annotate_offload.bench._peers;"
        "print(torch.cuda.is_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"


def test_benchmark_wrappers_run_from_a_checkout(tmp_path):
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    for script in ("bench.py", "bench_activations.py"):
        out = subprocess.run(
            [sys.executable, os.path.join(root, "benchmarks", script), "--help"],
            capture_output=True, text=True, cwd=tmp_path,
        )
        assert out.returncode == 0, out.stderr
        assert "--tiny" in out.stdout
