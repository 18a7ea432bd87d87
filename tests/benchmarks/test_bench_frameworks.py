"""benchmarks/frameworks.py: the CPU smoke run (--tiny) and its argument checks."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers")
pytest.importorskip("lightning")
pytest.importorskip("trl")

import frameworks  # noqa: E402


@pytest.mark.slow
def test_tiny_run_trains_every_framework_and_offloads(capsys):
    assert frameworks.main(["--tiny", "--steps", "1", "--warmup", "1"]) == 0
    rows = [line.split("|")[1:-1] for line in capsys.readouterr().out.splitlines() if line.startswith("| ")][2:]
    assert {r[0].strip() for r in rows} == {"Trainer", "accelerate", "Lightning", "SFTTrainer"}
    ours = [r for r in rows if "offload" in r[1].lower() and "TRL" not in r[1]]
    assert len(ours) == 7 and all(r[6].strip().endswith("MiB") for r in ours), rows  # each moved bytes


@pytest.mark.parametrize("argv", [["--tiny", "--steps", "0"], ["--tiny", "--num-layers", "4"]])
def test_bad_arguments_exit_2(argv):
    with pytest.raises(SystemExit) as e:
        frameworks.main(argv)
    assert e.value.code == 2
