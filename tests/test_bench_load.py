"""benchmarks/bench_load.py's run timing at a tiny size: the two engines loaded in their own
worker processes and taking turns on one tagger file (``interleaved``). Before, each engine's
times came from its own processes one after the other, and a slow spell of the machine fell on
whichever ran then (the tagger's N=64 ratio moved 0.85 -> 0.78 between two runs on a Zen 3)."""

from pathlib import Path

import pytest


def test_run_timing_takes_turns_in_two_workers(monkeypatch, tmp_path):
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_load

    path = str(tmp_path / "tagger.onnx")
    bench_load._tagger_onnx(path)
    got = bench_load.interleaved(path, batch=2, steps=3, threads=1, rounds=3, per_turn=2)
    assert set(got) == {"leanrnn", "onnxruntime"}
    for e, r in got.items():
        assert 0 < r["best_s"] <= r["median_s"] < 5, (e, r)
