"""Importing the package or its integrations package imports no framework and does not initialise CUDA."""

import sys


def test_integrations_import_no_framework(run_group):
    code = ("import sys, torch, annotate_offload, annotate_offload.integrations; "
            "assert not torch.cuda.is_initialized(); "
            "loaded = {'transformers', 'lightning', 'accelerate', 'trl', 'peft'} & set(sys.modules); "
            "assert not loaded, loaded; "
            "assert annotate_offload.integrations.__all__ == []")
    run_group([sys.executable, "-c", code], check=True)
