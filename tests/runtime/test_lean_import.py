"""Importing the package must not initialise CUDA."""

import sys


def test_import_does_not_initialise_cuda(run_group):
    code = (
        "import torch, annotate_offload, annotate_offload.runtime;"
        "import annotate_offload.optim;"
        "print(torch.cuda.is_initialized())"
    )
    out = run_group([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
