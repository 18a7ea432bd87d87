"""``annotate-offload train | plan``: parity table, exit status, bad input (exit 2, nothing written)."""

from __future__ import annotations

import importlib.util
import os
import re
import sys

import pytest
import torch

from annotate_offload import _recipes
from annotate_offload.cli import main

SMALL = ["model.seq_length=32", "train.micro_batch_size=2"]


def _train(capsys, *args):
    code = main(["train", "--no-progress", *args])
    out, err = capsys.readouterr()
    return code, out, err


def _losses(out: str, column: int) -> list[float]:
    rows = re.findall(r"^\| (\d+) \| ([\d.]+) \| ([\d.]+) \|", out, flags=re.M)
    return [float(r[column]) for r in rows]


@pytest.mark.slow
def test_llama_tiny_three_steps_both_offloads_with_baseline_and_plot(capsys, tmp_path):
    png = tmp_path / "run.png"
    code, out, err = _train(capsys, "train.train_iters=3", "--plot", str(png))
    assert code == 0, out + err
    assert "recipe llama-tiny on cpu" in out
    assert "activations of the first 3 of 4 layers; optimizer: 0.5 of parameters stepped on the host" in out
    offload, baseline = _losses(out, 1), _losses(out, 2)
    assert len(offload) == 3 and len(baseline) == 3
    assert offload[-1] < offload[0]  # it trains
    assert max(abs(a - b) for a, b in zip(offload, baseline)) < 1e-3
    assert "criterion: < 0.001 (optimizer offload)) -> PASS" in out
    peak = re.search(r"\| peak device memory \(CPU: runtime accounting.*\| ([\d.]+) MiB \| ([\d.]+) MiB \|", out)
    assert peak and float(peak.group(1)) < float(peak.group(2))  # offloading lowered the accounted peak
    moved = re.search(r"\| bytes offloaded per step \| ([\d.]+) MiB \| 0 B \|", out)
    assert moved and float(moved.group(1)) > 1
    assert "OffloadPlan(" in out and "offloaded=3" in out
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and f"wrote {png}" in out


@pytest.mark.slow
def test_a_memory_budget_prints_the_plan_predicted_and_measured_beside_the_single_strategies(capsys):
    code, out, err = _train(capsys, *SMALL, "train.train_iters=2", "model.cpu_offloading_num_layers=None",
                            "model.memory_budget=12MiB", "--compare-strategies", "--rounds", "2")
    assert code == 0, out + err
    assert "activations planned for memory_budget=12MiB" in out
    assert re.search(r"^\| \| offload \| baseline \| full recompute \| offload only \|$", out, flags=re.M)
    assert "median of 2 rounds, order rotated" in out and "| predicted peak |" in out and "| predicted step time |" in out
    assert "plan for memory_budget=12.00 MiB" in out and "pred. ms" in out and "meas. ms" in out
    assert re.search(r"the plan is -?[\d.]+% faster than the best single strategy", out) or "does not fit" in out


@pytest.mark.slow
def test_activation_offload_only_losses_are_identical(capsys):
    code, out, err = _train(capsys, *SMALL, "train.train_iters=2", "optimizer.optimizer_cpu_offload=False")
    assert code == 0, out + err
    assert "-> PASS: identical losses" in out
    assert _losses(out, 1) == _losses(out, 2)
    assert "optimizer: on device" in out


@pytest.mark.slow
def test_no_compare_baseline(capsys):
    code, out, _ = _train(capsys, *SMALL, "train.train_iters=1", "--no-compare-baseline")
    assert code == 0 and "PASS (no baseline" in out and "loss (baseline)" not in out


@pytest.mark.slow
def test_baseline_out_of_memory_is_reported_not_raised(capsys, monkeypatch):
    real = _recipes._optimizer

    def optimizer(model, cfg, fraction):
        if not hasattr(model, "offload_plan"):  # the baseline
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 20.00 GiB")
        return real(model, cfg, fraction)

    monkeypatch.setattr(_recipes, "_optimizer", optimizer)
    code, out, err = _train(capsys, *SMALL, "train.train_iters=1")
    assert code == 0, out + err
    assert "out of memory: CUDA out of memory. Tried to allocate 20.00 GiB" in out
    assert "PASS (baseline: out of memory" in out


@pytest.mark.slow
def test_parity_failure_exits_1(capsys, monkeypatch):
    real = _recipes._optimizer

    def optimizer(model, cfg, fraction):  # a baseline that trains differently
        if not hasattr(model, "offload_plan"):
            return torch.optim.SGD(model.parameters(), lr=0.5)
        return real(model, cfg, fraction)

    monkeypatch.setattr(_recipes, "_optimizer", optimizer)
    code, out, err = _train(capsys, *SMALL, "train.train_iters=2", "optimizer.optimizer_cpu_offload=False")
    assert code == 1
    assert "FAIL: losses differ" in out and "parity check failed" in err


@pytest.mark.slow
@pytest.mark.skipif(importlib.util.find_spec("transformers") is None, reason="needs transformers (the hf extra)")
def test_hf_llama_recipe_losses_are_identical(capsys):
    code, out, err = _train(capsys, "--recipe", "hf-llama", *SMALL, "train.train_iters=2",
                            "optimizer.optimizer_cpu_offload=False")
    assert code == 0, out + err
    assert "OffloadPlan(" in out and "PASS: identical losses" in out


@pytest.mark.slow
def test_plan_prints_plan_and_predicted_memory(capsys):
    code = main(["plan", *SMALL])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "OffloadPlan(" in out and "layers=4, offloaded=3" in out
    assert re.search(r"\| optimizer state \(fp32 Adam moments\) \| [\d.]+ [KM]iB \| [\d.]+ [KM]iB \|", out)


# ------------------------------------------------------------------------- bad input: exit 2


@pytest.mark.parametrize(
    "args, message",
    [
        (["--recipe", "llama-7b"], r"unknown recipe 'llama-7b'; valid: llama-tiny, llama-1b, hf-llama\."),
        (["model.cpu_offload=True"], r"unknown key 'model\.cpu_offload'; did you mean 'model\.cpu_offloading'\?"),
        (["train.train_iters=many"], r"override train\.train_iters='many': expected an int; e\.g\. train\.train_iters=100\."),
        (["model.cpu_offloading_num_layers=None"],
         r"model\.cpu_offloading_num_layers=None with model\.cpu_offloading=True: give a number 0\.\.3 .*"
         r"or set model\.cpu_offloading=False\."),
        (["--plot", "{tmp}/adir.png"], r"--plot '.*adir\.png' cannot be written"),  # a folder by that name
        (["optimizer.optimizer_offload_fraction=2"], r"optimizer_offload_fraction must be in \[0, 1\]"),
        (["model.pipeline_model_parallel_size=2"], r"Currently there is no support for Pipeline parallelism"),
        (["cpu_offloading"], r"not of the form section\.field=value"),
        (["--data", "{tmp}/missing.txt"], r"data file '.*missing\.txt' does not exist"),
        (["--data", "{tmp}/empty.txt"], r"data file '.*empty\.txt' is empty"),
        (["--plot", "{tmp}/no/such/dir/out.png"], r"--plot .*folder .* does not exist"),
        (["--plot", "{tmp}/out.txt"], r"use a \.png, \.pdf or \.svg"),
        (["--bogus"], r"unrecognized arguments: --bogus"),
        (["model.memory_budget=abc"], r"memory_budget must be a positive size \(model\.memory_budget='abc'\)"),
        (["--compare-strategies"], r"--compare-strategies sizes the strategies for model\.memory_budget"),
        (["--rounds", "0"], r"--rounds 0: give at least 1"),
    ],
)
def test_bad_input_exits_2_with_one_line_and_writes_nothing(capsys, tmp_path, args, message):
    (tmp_path / "empty.txt").write_bytes(b"")
    (tmp_path / "adir.png").mkdir()
    before = sorted(os.listdir(tmp_path))
    argv = [a.format(tmp=tmp_path) for a in args]
    if "--plot" not in argv:  # ask for a plot too: the error must come before anything is written
        argv += ["--plot", str(tmp_path / "p.png")]
    code, out, err = _train(capsys, *argv)
    assert code == 2
    assert out == ""
    assert err.count("\n") == 1 and err.startswith("annotate-offload: error: ")
    assert re.search(message, err), err
    assert sorted(os.listdir(tmp_path)) == before


@pytest.mark.skipif(not os.path.isdir("/proc/self"), reason="needs Linux /proc")
def test_plot_into_unwritable_folder_fails_before_training(capsys, monkeypatch):
    # /proc exists but takes no new files: refused before the run, not after it
    monkeypatch.setattr(_recipes, "compare", lambda *a, **k: pytest.fail("training started"))
    code, out, err = _train(capsys, *SMALL, "train.train_iters=1", "--plot", "/proc/annotate-offload-x.png")
    assert code == 2 and out == ""
    assert err.count("\n") == 1 and "--plot '/proc/annotate-offload-x.png' cannot be written" in err


def test_plot_check_leaves_an_existing_file_alone_and_creates_none(tmp_path):
    from annotate_offload.cli import _check_plot_target

    png = tmp_path / "old.png"
    png.write_bytes(b"keep")
    _check_plot_target(str(png))
    new = tmp_path / "new.png"
    _check_plot_target(str(new))
    assert png.read_bytes() == b"keep" and not new.exists()


@pytest.mark.slow
def test_plan_of_a_gpu_recipe_runs_without_a_gpu(capsys):
    # plan trains nothing, so llama-1b is planned from uninitialised CPU weights (shape of 1B, 2 layers here)
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code = main(["plan", "--recipe", "llama-1b", "model.num_layers=2", "model.memory_budget=None",
                 "model.cpu_offloading_num_layers=1", "model.seq_length=16", "train.micro_batch_size=1"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    assert "recipe llama-1b on cpu" in out and "planned without a GPU" in out
    assert "OffloadPlan(" in out and "offloaded=1" in out
    assert "| parameters |" in out


@pytest.mark.slow
def test_plan_of_llama_1b_counts_bf16_autocast_activations(capsys):
    """The recipe trains under bf16 autocast; the plan's meta estimate emulates it (Note [Autocast on
    meta]) and gives the 2.07 GiB per layer the runtime moves on a GPU (3.26 GiB in fp32)."""
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code = main(["plan", "--recipe", "llama-1b", "model.num_layers=2", "model.memory_budget=None",
                 "model.cpu_offloading_num_layers=1"])
    out, err = capsys.readouterr()
    assert code == 0, out + err
    row = next(line for line in out.splitlines() if line.strip().startswith("0    layers.0"))
    assert row.rstrip().endswith("2.07 GiB"), row


@pytest.mark.slow
def test_plan_of_llama_1b_with_its_budget_says_the_planner_needs_the_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["plan", "--recipe", "llama-1b", "model.num_layers=2", "model.seq_length=16"]) == 0
    out = capsys.readouterr().out
    assert "model.memory_budget=20GiB: the planner measures the layers on the GPU" in out and "| parameters |" in out


def test_llama_1b_needs_a_gpu(capsys):
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    code, out, err = _train(capsys, "--recipe", "llama-1b")
    assert code == 2 and "recipe 'llama-1b' needs a CUDA GPU" in err


@pytest.mark.slow
def test_python_dash_m_entry_point(tmp_path, run_group):
    proc = run_group([sys.executable, "-m", "annotate_offload", "train", "--recipe", "nope"],
                     capture_output=True, text=True, cwd=tmp_path,
                     env={**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(
                         os.path.abspath(__file__))))})
    assert proc.returncode == 2 and proc.stdout == ""
    assert proc.stderr.strip() == "annotate-offload: error: unknown recipe 'nope'; valid: llama-tiny, llama-1b, hf-llama."


@pytest.mark.slow
@pytest.mark.cuda
def test_llama_tiny_on_cuda_parity(capsys):
    code, out, err = _train(capsys, "--device", "cuda", "train.train_iters=3")
    assert code == 0, out + err
    assert "torch.cuda.max_memory_allocated" in out and "-> PASS" in out
    code, out, err = _train(capsys, "--device", "cuda", "train.train_iters=3", "optimizer.optimizer_cpu_offload=False")
    assert code == 0 and "PASS: identical losses" in out, out + err


@pytest.mark.slow
def test_plan_of_a_one_layer_model(capsys):
    """Following the error's advice for model.num_layers=1 (cpu_offloading_num_layers=0) works: layer
    discovery needs no repeated blocks, the built-in blocks are declared with @offload_layer."""
    assert main(["plan", "model.num_layers=1", "model.cpu_offloading_num_layers=0"]) == 0
    assert "layers=1, offloaded=0" in capsys.readouterr().out
