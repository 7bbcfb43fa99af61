"""Session 39, from a red-team pass on memory figures: a graph's Conv and MaxPool allocate their
window blocks themselves (numpy temporaries, up to tens of MiB), outside the arena, and neither
``describe`` nor ``resize(memory_limit=)`` counted them: a Conv front-end planned at 16 MiB in
all took 26.5 MiB more. They are counted now (``working_bytes``)."""

from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

pytest.importorskip("onnx")

from _onnx_graphs import load, model, node
from leanrnn.errors import PlanError

F32 = np.float32


@pytest.mark.parametrize("op", ["Conv", "MaxPool"])
def test_window_ops_working_memory_is_counted(op, tmp_path):
    rng = np.random.default_rng(0)
    x = rng.standard_normal((4, 16, 3000)).astype(F32)
    if op == "Conv":
        w = rng.standard_normal((24, 16, 5)).astype(F32)
        nodes = [node("Conv", ["x", "w"], ["y"], pads=[2, 2]), node("Relu", ["y"], ["out"])]
        g = load(model(nodes, {"x": x}, {"w": w}, out_dtypes=[F32]), tmp_path)
    else:
        nodes = [node("MaxPool", ["x"], ["y"], kernel_shape=[5], pads=[2, 2]),
                 node("Relu", ["y"], ["out"])]  # fmt: skip
        g = load(model(nodes, {"x": x}, out_dtypes=[F32]), tmp_path)
    est = g.session.estimate({"x": x.shape})
    assert est["working_bytes"] > 0
    d = g.describe(4, 3000)["arena"]
    assert d["working_bytes"] == est["working_bytes"]
    assert d["total_bytes"] >= d["graph_arena_bytes"] + d["working_bytes"]
    g.run({"x": x})  # planned and warm: what a run takes beyond its output is measured now
    tracemalloc.start()
    (y,) = g.run({"x": x})
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    assert peak - y.nbytes <= est["working_bytes"] + (64 << 10), (peak, est)
    with pytest.raises(PlanError, match=f"\\({op}\\) works in"):
        g.resize({"x": x.shape}, memory_limit=est["arena_bytes"] + est["working_bytes"] // 2)


def test_memory_log_frees_a_replaced_arena(caplog, monkeypatch):
    """LEANRNN_LOG=memory logged an arena's allocation but never its free: a session whose
    arena grew logged both sizes while holding only the second. Each allocation now has its
    free, once the buffer is gone."""
    import gc
    import logging

    import leanrnn
    from leanrnn import config

    enabled = config.log_enabled
    monkeypatch.setattr(config, "log_enabled", lambda topic: topic == "memory" or enabled(topic))
    m = leanrnn.LSTM(4, 8, seed=0)
    with caplog.at_level(logging.INFO, logger="leanrnn"):
        m.session.resize(2, 10)
        m.session.resize(64, 500)  # a larger arena replaces the first
        del m
        gc.collect()
    lines = [r.getMessage() for r in caplog.records]
    allocated = [ln.split(" at ")[-1] for ln in lines if ": allocate " in ln]
    freed = [ln.split(" at ")[-1] for ln in lines if ": free " in ln]
    assert len(allocated) >= 2 and sorted(allocated) == sorted(freed), lines
