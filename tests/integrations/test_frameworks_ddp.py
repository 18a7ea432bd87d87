"""Trainer and Lightning under DDP (torchrun, 2 CPU processes, gloo): offload equals AdamW(fused=True) without
it, the checkpoint the framework saves halfway resumes to the uninterrupted run (``_ddp_worker.py``)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from ._tiny import same

HERE = Path(__file__).parent


@pytest.mark.slow
@pytest.mark.timeout(660)  # past the 300 s default: the torchrun child below may take its 600 s
@pytest.mark.parametrize("framework", ["hf", "lightning"])
def test_ddp_equals_adamw_and_resumes(framework, tmp_path, torchrun, run_group):
    pytest.importorskip({"hf": "accelerate", "lightning": "lightning"}[framework])
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(HERE.parent.parent), os.environ.get("PYTHONPATH", "")]),
           "OMP_NUM_THREADS": "1"}
    proc = run_group(torchrun(HERE / "_ddp_worker.py", framework, tmp_path), env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    r = torch.load(tmp_path / "results.pt")
    base, ours, resumed = r["base"], r["ours"], r["resumed"]
    for key in ("loss", "grad_norm"):
        same(base[key], ours[key])
        half = len(ours[key]) // 2  # Trainer's log history carries the first half over from the checkpoint
        same(ours[key][half:], resumed[key][-half:])
    for run in (ours, resumed):
        assert all(torch.equal(a, b) for a, b in zip(base["weights"], run["weights"]))
        assert run["hooks"] == 1 and run["bytes"] > 0  # attached to the framework's DDP model, offloaded
    assert base["hooks"] == 0
