"""The examples run (small sizes, CPU backend) and offload what they say."""

from __future__ import annotations

import importlib.util
import pathlib

import pytest

EXAMPLES = pathlib.Path(__file__).resolve().parents[2] / "examples"


def _load(name):
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_offload_gpt_example(capsys):
    model = _load("offload_gpt").main(["--hidden", "256", "--layers", "3", "--tokens", "1024", "--offload", "1", "--steps", "2"])
    plan = model.offload_plan
    assert plan.offloaded_layers == (0,) and plan.bytes_source == "measured"
    assert plan.layers[0].bytes_per_step > 0
    assert "step 1: loss" in capsys.readouterr().out


def test_offload_hf_llama_example():
    pytest.importorskip("transformers")
    model = _load("offload_hf_llama").main(["--hidden", "64", "--seq", "32", "--steps", "1"])
    assert model.offload_plan.bytes_source == "measured"
