"""Importing the package or its integrations package imports no framework and does not initialise CUDA."""

import subprocess
import sys


def test_integrations_import_no_framework():
    code = ("import sys, torch, annotate_offload, annotate_offload.integrations; "
            "assert not torch.cuda.is_initialized(); "
            "loaded = {'transformers', 'lightning', 'accelerate', 'trl', 'peft'} & set(sys.modules); "
            "assert not loaded, loaded; "
            "assert annotate_offload.integrations.__all__ == []")
    subprocess.run([sys.executable, "-c", code], check=True)
