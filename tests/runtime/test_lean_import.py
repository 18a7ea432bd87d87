"""Importing the package must not initialise CUDA."""

import subprocess
import sys


def test_import_does_not_initialise_cuda():
    code = (
        "import torch, annotate_offload, annotate_offload.runtime;"
        "import annotate_offload.optim;"
        "print(torch.cuda.is_initialized())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "False"
