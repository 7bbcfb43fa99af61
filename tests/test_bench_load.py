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


def test_breakdown_gives_each_engines_time_per_node(monkeypatch, tmp_path):
    """--breakdown (issue 13 asked where the tagger's N=64 time goes against onnxruntime): the
    LSTMs, the head and the embedding by their ONNX names, with both engines' times."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_load

    path = str(tmp_path / "tagger.onnx")
    bench_load._tagger_onnx(path)
    rows = {key.split(" ", 1)[-1]: (a, b) for key, a, b in bench_load.breakdown(path, 2, 3, 1, 2)}
    lstms = [k for k in rows if k.startswith("/lstm/LSTM")]
    assert len(lstms) == 2, rows
    for name in [*lstms, "/head/MatMul", "/emb/Gather"]:
        a, b = rows[name]
        assert a is not None and b is not None and 0 < a < 5 and 0 < b < 5, (name, a, b)
    total = rows.pop("total")
    assert total[0] >= sum(a or 0 for a, _ in rows.values()) * 0.999
