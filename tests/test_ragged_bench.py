"""benchmarks/ragged_bench.py at a tiny size: every engine's outputs are checked before it is
timed, and longest first must give leanrnn's input-order bits."""

import importlib
from pathlib import Path

import pytest


def test_tiny_run_checks_every_engine(monkeypatch, capsys):
    pytest.importorskip("torch")
    pytest.importorskip("onnxruntime")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    bench = importlib.import_module("ragged_bench")
    args = ["--hidden", "24", "--input", "5", "--batch", "9", "--steps", "7", "--rounds", "2",
            "--repeats", "1"]  # fmt: skip
    assert bench.main(args) == 0
    rows = {ln[:28].strip(): ln[28:].split() for ln in capsys.readouterr().out.splitlines()}
    assert float(rows["leanrnn, longest first"][-1]) == 0.0  # the same bits
    for name in ("torch packed", "onnxruntime sequence_lens"):
        assert float(rows[name][-1]) < 1e-5  # the same model, other summation orders
    assert "leanrnn, random order" in rows and "leanrnn, all T steps" in rows
