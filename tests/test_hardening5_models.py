"""Models, round five: GraphModel.resize refuses sizes that cannot fit before its shape-computed
tensors (a ConstantOfShape initial state [1, N, H]) are allocated; building a model too large for
the machine is refused by arithmetic before any draw or per-layer loop; unbatched calls take
unbatched ``out=`` arrays."""

from __future__ import annotations

import time

import numpy as np
import pytest

import leanrnn
from helpers import traced_peak
from leanrnn.errors import PlanError, ShapeError
from leanrnn.memory import arena

MiB = 1 << 20


# --------------------------------------------------------- 1: GraphModel.resize, refused first
def _gru_encoder(path, C=6, H=12):
    """x [T, N, C] -> GRU (layout 0) from a zero initial state ConstantOfShape([1, N, H]),
    N read off x's shape: what torch.onnx.export writes for a GRU without h0."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(5)
    inits = {
        "W": rng.uniform(-0.3, 0.3, (1, 3 * H, C)).astype(np.float32),
        "R": rng.uniform(-0.3, 0.3, (1, 3 * H, H)).astype(np.float32),
        "B": rng.uniform(-0.3, 0.3, (1, 6 * H)).astype(np.float32),
        "one": np.array([1], np.int64),
        "hid": np.array([H], np.int64),
        "idx": np.array(1, np.int64),
        "ax0": np.array([0], np.int64),
    }
    nodes = [
        helper.make_node("Shape", ["x"], ["s"], name="shape"),
        helper.make_node("Gather", ["s", "idx"], ["n"], name="batch", axis=0),
        helper.make_node("Unsqueeze", ["n", "ax0"], ["n1"], name="unsq"),
        helper.make_node("Concat", ["one", "n1", "hid"], ["hs"], name="cat", axis=0),
        helper.make_node("ConstantOfShape", ["hs"], ["h0"], name="zeros"),
        helper.make_node(
            "GRU",
            ["x", "W", "R", "B", "", "h0"],
            ["y", "h_n"],
            name="gru",
            hidden_size=H,
            linear_before_reset=1,
        ),
    ]
    g = helper.make_graph(
        nodes,
        "enc",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["t", "n", C])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    m.ir_version = 8
    onnx.save(m, str(path))
    return str(path)


def _reference_gru(path, x):
    ort = pytest.importorskip("onnxruntime")
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return sess.run(None, {"x": x})[0]


def test_graph_resize_refuses_before_allocating_shape_computed_tensors(tmp_path, monkeypatch):
    # before: ConstantOfShape's [1, N, 12] zeros (96 MB here) were allocated, then the arena
    # refused: peak memory 254 -> 1169 MB for (2e7, 1e6, 6) on an enc.onnx like this one
    path = _gru_encoder(tmp_path / "enc.onnx")
    gm = leanrnn.load(path)
    monkeypatch.setattr(arena, "machine_memory", lambda: 256 * MiB)
    with traced_peak() as mem, pytest.raises(PlanError) as e:
        gm.resize({"x": (10**6, 2 * 10**6, 6)})  # [T, N, C]
    assert mem.peak < 8 * MiB, mem.peak
    assert "GraphSession.resize" in str(e.value) and "bytes" in str(e.value)
    # each tensor fits, all of a run's together do not: ConstantOfShape's 96 MB zeros and the
    # 192 MB y, against 256 MiB
    with traced_peak() as mem, pytest.raises(PlanError) as e:
        gm.resize({"x": (2, 2 * 10**6, 6)})
    assert mem.peak < 8 * MiB, mem.peak
    assert "of shape-computed tensors" in str(e.value), str(e.value)
    # one shape-computed tensor alone past the machine's memory: refused, not allocated
    with traced_peak() as mem, pytest.raises(PlanError):
        gm.resize({"x": (1, 10**7, 6)})
    assert mem.peak < 8 * MiB, mem.peak


def test_graph_resize_past_numpy_is_plan_error_and_session_recovers(tmp_path):
    # before: numpy's MemoryError "Unable to allocate 44.7 GiB" from ConstantOfShape
    path = _gru_encoder(tmp_path / "enc.onnx")
    gm = leanrnn.load(path)
    with pytest.raises(PlanError):
        gm.resize({"x": (10**6, 10**12, 6)})
    with pytest.raises(PlanError):
        gm.resize({"x": (1, 10**12, 6)})
    x = np.random.default_rng(1).standard_normal((7, 3, 6)).astype(np.float32)
    gm.resize({"x": x.shape})
    np.testing.assert_allclose(gm(x), _reference_gru(path, x), atol=1e-5)
    x2 = x[:4, :2].copy()  # run() re-plans a new shape after the refusals too
    np.testing.assert_allclose(gm(x2), _reference_gru(path, x2), atol=1e-5)


# ------------------------------------------------------------- 2: huge models refused first
def test_huge_hidden_size_is_plan_error_before_drawing_weights():
    # before: numpy's MemoryError "Unable to allocate 2.84 PiB" from the random draws
    leanrnn.LSTM(3, 4)  # first-build imports and caches, outside the measure
    with traced_peak() as mem, pytest.raises(PlanError) as e:
        leanrnn.LSTM(3, 10**7)
    assert mem.peak < 1 * MiB, mem.peak
    msg = str(e.value)
    assert "[LSTM]" in msg and "bytes" in msg and "this machine has" in msg, msg


def test_too_many_layers_refused_before_the_per_layer_loop(monkeypatch):
    # before: RNN(3, 4, num_layers=10**5) took ~20 s and ~780 MB; 10**8 would run for hours.
    # Each layer costs its packed weights and its Python objects while built: past the
    # machine's memory, refused by arithmetic before the first layer is drawn.
    leanrnn.RNN(3, 4)  # first-build imports and caches, outside the measure
    monkeypatch.setattr(arena, "machine_memory", lambda: 4 * MiB)
    with traced_peak() as mem, pytest.raises(PlanError) as e:
        leanrnn.RNN(3, 4, num_layers=2000)
    assert mem.peak < 1 * MiB, mem.peak
    assert "num_layers=2000" in str(e.value)
    t = time.perf_counter()
    with pytest.raises(PlanError):
        leanrnn.RNN(3, 4, num_layers=10**8)
    with pytest.raises(PlanError):
        leanrnn.GRU(3, 4, num_layers=10**8, bidirectional=True)
    assert time.perf_counter() - t < 2.0
    m = leanrnn.RNN(3, 4, num_layers=2, seed=0)  # what fits still builds and runs
    y, h = m(np.ones((5, 2, 3), np.float32))
    assert y.shape == (5, 2, 4) and h.shape == (2, 2, 4)


# --------------------------------------------------------------- 3: unbatched out= arrays
@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_unbatched_call_takes_unbatched_out(cell, batch_first):
    # before: out=(y [T, K], h [L, K], c [L, K]) for x [T, C] was refused: "expected [T=5, N=1,
    # ...]"; only the batched shapes were taken
    T, C, H, L = 5, 3, 4, 2
    cls = leanrnn.LSTM if cell == "lstm" else leanrnn.GRU
    m = cls(C, H, num_layers=L, batch_first=batch_first, bidirectional=True, seed=0)
    x = np.random.default_rng(2).standard_normal((T, C)).astype(np.float32)
    want = m(x)
    want_y, want_states = want[0], (want[1] if cell == "lstm" else (want[1],))
    y = np.full((T, 2 * H), np.nan, np.float32)
    states = tuple(np.full((2 * L, H), np.nan, np.float32) for _ in want_states)
    got = m(x, out=(y, *states))
    got_states = got[1] if cell == "lstm" else (got[1],)
    assert got[0].shape == (T, 2 * H)
    np.testing.assert_array_equal(y, want_y)  # written in the caller's arrays
    np.testing.assert_array_equal(got[0], want_y)
    for s, g, w in zip(states, got_states, want_states, strict=True):
        assert g.shape == (2 * L, H)
        np.testing.assert_array_equal(s, w)
        np.testing.assert_array_equal(g, w)
    # the batched shapes (N=1) are still taken
    yb = np.empty((1, T, 2 * H) if batch_first else (T, 1, 2 * H), np.float32)
    sb = tuple(np.empty((2 * L, 1, H), np.float32) for _ in want_states)
    got = m(x, out=(yb, *sb))
    assert got[0].shape == (T, 2 * H)
    np.testing.assert_array_equal(got[0], want_y)
    # only final states: out holds just the states, unbatched
    hs = tuple(np.empty((2 * L, H), np.float32) for _ in want_states)
    got = m(x, out=hs, return_sequences=False)
    assert got[0] is None
    for s, w in zip(hs, want_states, strict=True):
        np.testing.assert_array_equal(s, w)


def test_unbatched_out_of_a_wrong_shape_names_the_unbatched_shapes():
    m = leanrnn.GRU(3, 4, seed=0)
    x = np.zeros((5, 3), np.float32)
    with pytest.raises(ShapeError) as e:
        m(x, out=(np.empty((5, 7), np.float32), np.empty((1, 4), np.float32)))
    msg = str(e.value)
    assert "unbatched" in msg and "y [T=5, D*K=4]" in msg and "h_n [L*D=1, K=4]" in msg, msg
    assert "(5, 7)" in msg, msg  # the shape that came in, not the one with an axis added


def test_unbatched_x_of_a_wrong_width_is_named_as_given():
    """The error showed the array after the batch axis was added ((5, 1, 2)), a shape the
    caller never made."""
    for bf in (False, True):
        m = leanrnn.LSTM(4, 6, seed=0, batch_first=bf)
        with pytest.raises(
            ShapeError, match=r"x has shape \(5, 2\); expected unbatched \[T, C=4\]"
        ):
            m(np.ones((5, 2), np.float32))
        assert m(np.ones((5, 4), np.float32))[0].shape == (5, 6)
