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
    LSTMs, the head and the embedding, paired by node name, with both engines' times, and
    each engine's sum of nodes within its wall time of a run."""
    pytest.importorskip("onnxruntime")
    pytest.importorskip("onnx")
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_load

    path = str(tmp_path / "tagger.onnx")
    bench_load._tagger_onnx(path)
    rows = bench_load.breakdown(bench_load._named_copy(path), 2, 3, 1, 2)
    summed, wall = rows[-2], rows[-1]
    assert summed[0] == "sum of nodes" and wall[0] == bench_load.RUN_WALL
    nodes = rows[:-2]
    for engine in (1, 2):
        total = sum(r[engine] or 0.0 for r in nodes)
        assert summed[engine] == pytest.approx(total) and 0 < total <= wall[engine] * 1.001
    paired: dict = {}  # op -> [(leanrnn s, onnxruntime s)] of the nodes both engines ran
    for key, a, b in nodes:
        if a is not None and b is not None:
            paired.setdefault(key.split(" ", 1)[0], []).append((a, b))
    # both LSTM layers, the head and the embedding, whatever the exporter named them (the
    # shape arithmetic's Gathers leanrnn folds at load: onnxruntime's only)
    assert [len(paired.get(op, ())) for op in ("LSTM", "MatMul", "Gather")] == [2, 1, 1], rows
    for op, pairs in paired.items():
        assert all(0 < a < 5 and 0 <= b < 5 for a, b in pairs), (op, pairs)


def test_ort_node_times_takes_the_last_runs_by_their_spans(monkeypatch):
    """onnxruntime's profile: the node events of the last ``runs`` runs, each assigned to the
    run whose "model_run" span holds it (not by counting events, which a run logging more or
    fewer would shift), medians over those runs, kernel times only, a missing op_name or args
    tolerated; a profile without a warm-up run before them is refused."""
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import bench_load

    def run(ts, dur):
        return {"cat": "Session", "name": "model_run", "ts": ts, "dur": dur}

    def node(name, ts, dur, **args):
        return {"cat": "Node", "name": name, "ts": ts, "dur": dur, "args": args}

    def bare(ts):
        return {"cat": "Node", "name": "noargs_kernel_time", "ts": ts, "dur": 4}

    events = [
        run(0, 100), node("mm_kernel_time", 10, 80, op_name="MatMul"),
        node("extra_kernel_time", 95, 5, op_name="Relu"),  # only in the warm-up
        run(200, 50), node("mm_fence_before", 201, 1), bare(202),
        node("mm_kernel_time", 205, 30, op_name="MatMul"),
        run(300, 70), node("mm_kernel_time", 305, 50, op_name="MatMul"), bare(360),
        run(400, 40), node("mm_kernel_time", 401, 35, op_name="MatMul"), bare(437),
    ]  # fmt: skip
    got = bench_load.ort_node_times(events, 3)
    assert got == pytest.approx({"MatMul mm": 35e-6, "? noargs": 4e-6,
                                 bench_load.RUN_WALL: 50e-6})  # fmt: skip
    with pytest.raises(RuntimeError, match="holds 4 runs, not 4 and a warm-up"):
        bench_load.ort_node_times(events, 4)
