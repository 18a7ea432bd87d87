"""benchmarks/lora.py: the CPU smoke run (--tiny), its argument checks, and a small GPU run."""

from __future__ import annotations

import pytest

import lora


@pytest.mark.slow
def test_tiny_run_offloads_and_is_exact(capsys):
    assert lora.main(["--tiny", "--num-layers", "2", "--policy", "opt_out,opt_in", "--steps", "1", "--warmup", "0"]) == 0
    text = capsys.readouterr().out
    rows = [line for line in text.splitlines() if line.startswith("| offload")]
    assert len(rows) == 2 and all(line.endswith("| yes |") for line in rows)
    assert all(float(line.split("|")[9].split()[0]) > 0 for line in rows), text  # something moved in both policies
    assert "`python benchmarks/lora.py --tiny" in text


@pytest.mark.parametrize("argv", [["--tiny", "--policy", "sometimes"], ["--tiny", "--steps", "0"],
                                  ["--tiny", "--num-layers", "4"]])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        lora.main(argv)
    assert e.value.code == 2


@pytest.mark.cuda
def test_gpu_offload_lowers_activation_memory_exactly():
    """llama-tiny in bf16, 8 x 512 tokens, N = 3 of 4 layers: bit-exact and less memory."""
    import torch

    rows = lora.run(preset="llama-tiny", batch=8, seq=512, device=torch.device("cuda"), dtype=torch.bfloat16,
                    num_layers=[3], policies=["opt_out", "opt_in"], min_offload_numel=0, warmup=1, steps=2)
    (_, _, _, base, _, _), out, inn = rows
    assert out[5] and inn[5]
    assert out[4] > 0 and out[3].peak_bytes < base.peak_bytes
