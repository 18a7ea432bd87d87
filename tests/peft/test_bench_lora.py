"""The LoRA benchmark's CPU smoke run (--tiny) and its argument checks."""

from __future__ import annotations

import pytest

from annotate_offload.bench import lora


def test_tiny_run_offloads_and_is_exact(capsys, tmp_path):
    out = tmp_path / "lora.md"
    rc = lora.main(["--tiny", "--num-layers", "2", "--policy", "opt_out,opt_in", "--steps", "1", "--warmup", "0",
                    "--out", str(out)])
    text = capsys.readouterr().out
    assert rc == 0 and out.read_text().strip() == text.strip()
    rows = [line for line in text.splitlines() if line.startswith("| offload")]
    assert len(rows) == 2 and all(line.endswith("| yes |") for line in rows)
    d2h = [float(line.split("|")[9]) for line in rows]
    assert all(v > 0 for v in d2h), text  # something really moved in both policies
    assert "Command: `python -m annotate_offload.bench.lora --tiny" in text


@pytest.mark.parametrize("argv, match", [
    (["--tiny", "--policy", "sometimes"], r"--policy 'sometimes'"),
    (["--tiny", "--steps", "0"], r"--steps must be >= 1"),
    (["--tiny", "--warmup", "-1"], r"--warmup must be >= 0"),
])
def test_bad_arguments(argv, match):
    with pytest.raises(ValueError, match=match):
        lora.main(argv)


@pytest.mark.cuda
def test_gpu_offload_lowers_activation_memory_exactly():
    """On the GPU machine: llama-tiny in bf16, 8 x 512 tokens, N = 3 of 4 layers: bit-exact and less memory."""
    import torch

    rows = lora.run(preset="llama-tiny", batch=8, seq=512, device=torch.device("cuda"), dtype=torch.bfloat16,
                    targets=["q_proj", "v_proj"], r=8, alpha=16.0, num_layers=[3], policies=["opt_out", "opt_in"],
                    prefetch_layers=1, release_lag=None, min_offload_numel=0, warmup=1, steps=2)
    base, out, inn = rows
    assert out.exact and inn.exact
    assert out.offloaded_bytes > 0 and out.times.peak_bytes < base.times.peak_bytes
