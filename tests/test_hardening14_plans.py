"""Session 40, from a red-team pass on performance cliffs: every change of the sequence length
between calls planned the arena again (plan, views, the kernels' arguments: ~100 us of Python a
call on a Model, 0.3-0.4 ms on a GraphModel), so inputs of varying length ran 2.6-7.6x
onnxruntime's time where a fixed length ran faster than it. A Session now runs a shorter run on
the plan in place, and a GraphModel takes back the plan of a shape it has seen."""

from __future__ import annotations

import numpy as np
import pytest

import leanrnn
from leanrnn.engine import session as S

LENGTHS = [30, 7, 19, 30, 1, 25, 7, 12]


def _count(monkeypatch, cls, name):
    calls = []
    real = getattr(cls, name)

    def counted(self, *a, **k):
        calls.append(a[:2])
        return real(self, *a, **k)

    monkeypatch.setattr(cls, name, counted)
    return calls


def _gru_relu_onnx(path, W, R, **attrs) -> None:
    """An ONNX graph x [T, N, C] -> GRU (W [1, 3H, C], R [1, 3H, H], ``attrs``) -> Squeeze ->
    Relu, saved at ``path``."""
    from onnx import TensorProto, helper, numpy_helper

    H, C = R.shape[2], W.shape[2]
    nodes = [helper.make_node("GRU", ["x", "W", "R"], ["Y"], hidden_size=H, **attrs),
             helper.make_node("Squeeze", ["Y", "ax"], ["s"]),
             helper.make_node("Relu", ["s"], ["out"])]  # fmt: skip
    inits = [numpy_helper.from_array(W, "W"), numpy_helper.from_array(R, "R"),
             numpy_helper.from_array(np.array([1], np.int64), "ax")]  # fmt: skip
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "N", C])],
                          [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits)  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    m.ir_version = 8
    onnx.save(m, path)


def _interrupt_at(obj, stop: str) -> None:
    """A KeyboardInterrupt at ``obj``'s next assignment of attribute ``stop`` (as a Ctrl-C
    landing there), once."""
    armed = [True]

    class Interrupted(type(obj)):
        def __setattr__(self, name, value):
            if armed[0] and name == stop:
                armed[0] = False
                raise KeyboardInterrupt
            object.__setattr__(self, name, value)

    obj.__class__ = Interrupted


@pytest.mark.parametrize("make", [
    lambda: leanrnn.LSTM(5, 8, num_layers=2, seed=0),
    lambda: leanrnn.GRU(5, 8, bidirectional=True, seed=0),
    lambda: leanrnn.RNN(5, 8, batch_first=True, seed=0),
    lambda: leanrnn.LSTM(5, 8, proj_size=3, seed=0),
])  # fmt: skip
def test_shorter_runs_use_the_plan_in_place_and_compute_the_same(monkeypatch, make):
    m, rng = make(), np.random.default_rng(0)
    bf = m.spec.batch_first
    xs = [rng.standard_normal((2, T, 5) if bf else (T, 2, 5)).astype(np.float32)
          for T in LENGTHS]  # fmt: skip
    want = [make()(x) for x in xs]  # each on a fresh model: planned for its own length
    plans = _count(monkeypatch, S.Session, "_resize")
    for x, w in zip(xs, want, strict=True):
        got = m(x)
        for g, e in zip(got[:1] + tuple(got[1]) if isinstance(got[1], tuple) else got,
                        w[:1] + tuple(w[1]) if isinstance(w[1], tuple) else w, strict=True):  # fmt: skip
            np.testing.assert_array_equal(g, e)
    assert len(plans) == 1  # the first (longest) run's plan served the others


def test_a_stream_of_varying_chunks_plans_once_for_the_longest():
    m, r = leanrnn.LSTM(4, 6, seed=0), leanrnn.LSTM(4, 6, seed=0)
    st, ref = m.session.stream(batch=1), r.session.stream(batch=1)
    rng = np.random.default_rng(1)
    for k in (8, 3, 5, 8, 2, 7):
        x = rng.standard_normal((k, 1, 4)).astype(np.float32)
        r.session.resize(1, k)  # the reference planned for each chunk's own length, as before
        np.testing.assert_array_equal(st.feed(x), ref.feed(x))
    np.testing.assert_array_equal(st.state[0], ref.state[0])
    assert m.session._T == 8


onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")


def test_a_graph_takes_back_the_plan_of_a_shape_it_has_seen(tmp_path, monkeypatch):

    from leanrnn.engine.graph import session as gs

    H, rng = 6, np.random.default_rng(0)
    W = rng.uniform(-0.5, 0.5, (1, 3 * H, 4)).astype(np.float32)
    _gru_relu_onnx(tmp_path / "g.onnx", W, rng.uniform(-0.5, 0.5, (1, 3 * H, H)).astype(np.float32),
                   linear_before_reset=1)  # fmt: skip
    lm, sess = leanrnn.load(tmp_path / "g.onnx"), ort.InferenceSession(str(tmp_path / "g.onnx"))
    plans = _count(monkeypatch, gs.GraphSession, "_resize_checked")
    for T in LENGTHS * 2:
        x = rng.standard_normal((T, 2, 4)).astype(np.float32)
        np.testing.assert_allclose(lm(x), sess.run(None, {"x": x})[0], rtol=1e-5, atol=1e-6)
    assert len(plans) == len(set(LENGTHS))  # one plan per shape, taken back after


def test_single_steps_after_a_chunk_still_run_bound():
    # the plan in place serves one step too: the stream's single steps bind to it (before the
    # change they re-planned for T=1 and bound; a plan kept for the chunk must not lose that)
    from leanrnn.kernels import runner

    m, r = leanrnn.GRU(4, 6, num_layers=2, seed=0), leanrnn.GRU(4, 6, num_layers=2, seed=0)
    st, ref = m.session.stream(batch=2), r.session.stream(batch=2)
    rng = np.random.default_rng(2)
    for k in (5, 1, 1, 3, 1, 1, 1):
        x = rng.standard_normal((k, 2, 4) if k > 1 else (2, 4)).astype(np.float32)
        r.session.resize(2, k)
        np.testing.assert_array_equal(st.feed(x), ref.feed(x))
    np.testing.assert_array_equal(st.state[0], ref.state[0])
    if runner.binds():
        assert st._step is not None and m.session._T == 5


def test_kept_graph_plans_hold_a_bounded_total_of_shape_computed_tensors(tmp_path):
    # (review) each kept plan holds its own shape-computed values: 64 plans of just under the
    # per-plan cap held 62 MiB that no figure reported
    from onnx import TensorProto, helper

    from leanrnn.engine.graph import session as gs

    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("ConstantOfShape", ["s"], ["z"],
                              value=helper.make_tensor("v", TensorProto.FLOAT, [1], [1.0])),
             helper.make_node("Mul", ["x", "z"], ["y"])]  # fmt: skip
    g = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", 64])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)])  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    m.ir_version = 8
    onnx.save(m, tmp_path / "g.onnx")
    lm = leanrnn.load(tmp_path / "g.onnx")
    for T in range(900, 1000, 7):  # ~230-250 KiB of ConstantOfShape each
        x = np.full((T, 64), 2.0, np.float32)
        np.testing.assert_array_equal(lm(x), x)
    s = lm.session
    kept = sum(p[s._KEPT.index("resize_constant_bytes")] for p in s._plans.values())
    assert 0 < kept <= gs.GraphSession.KEPT_CONSTANT_BYTES and len(s._plans) < 15


def test_a_trainer_keeps_the_plans_of_the_lengths_it_has_seen(monkeypatch):
    # its 16 plans, all cleared when full, re-planned 49 of 60 steps of lengths in 5..60
    from leanrnn.train import Trainer
    from leanrnn.train import session as ts

    tr = Trainer(leanrnn.LSTM(4, 6, seed=0))
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((T, 2, 4)).astype(np.float32) for T in range(5, 45)]
    grads = []
    for x in xs:
        tape = tr.forward(x)
        grads.append(tr.backward(tape, np.ones_like(tape.y))[0])
    planned = []
    real = ts.plan
    monkeypatch.setattr(ts, "plan", lambda *a, **k: planned.append(1) or real(*a, **k))
    for x, g in zip(xs, grads, strict=True):
        tape = tr.forward(x)
        np.testing.assert_array_equal(tr.backward(tape, np.ones_like(tape.y))[0], g)
    assert not planned


def test_a_session_takes_back_the_plans_of_batches_it_has_seen(monkeypatch):
    # (red team on leanrnn.torch) a batch that changes between calls planned every call: a
    # beam search's shrinking batch ran 2.1x its fixed-batch loop, slower than torch.nn
    m, rng = leanrnn.LSTM(5, 8, num_layers=2, seed=0), np.random.default_rng(3)
    xs = [rng.standard_normal((6, N, 5)).astype(np.float32) for N in (16, 17, 16, 17, 4, 16)]
    want = [leanrnn.LSTM(5, 8, num_layers=2, seed=0)(x) for x in xs]
    plans = _count(monkeypatch, S.Session, "_resize")
    for rounds in range(2):
        for x, w in zip(xs, want, strict=True):
            got = m(x)
            np.testing.assert_array_equal(got[0], w[0])
            np.testing.assert_array_equal(got[1][0], w[1][0])
        if rounds == 0:
            first = len(plans)  # N=16, then 17 (a larger arena: 16's plan goes), 16, 4
    assert first == 4 and len(plans) == first  # the second round plans nothing
    m.session.resize(16, 6, memory_limit=1 << 20)  # a limit: the kept plans go
    assert not m.session._plans


def test_a_pools_members_take_back_plans_only_on_the_arena_in_place():
    pool = leanrnn.Pool()
    a, b = leanrnn.GRU(3, 4, seed=0), leanrnn.GRU(3, 4, seed=1)
    a.session.pool = b.session.pool = pool
    rng = np.random.default_rng(0)
    small = rng.standard_normal((3, 2, 3)).astype(np.float32)
    big = rng.standard_normal((40, 64, 3)).astype(np.float32)
    want_a = leanrnn.GRU(3, 4, seed=0)(small)[0]
    a(small)
    a(np.ones((3, 5, 3), np.float32))
    b(big)  # grows the pool's arena: a's kept plans viewed the old one
    assert not a.session._plans
    np.testing.assert_array_equal(a(small)[0], want_a)


def test_an_interrupted_take_back_never_runs_a_mix_of_two_plans():
    # (review) the key of the plan in place stayed while a kept plan's views were being put
    # back: a Ctrl-C there left the next run of that key on a mix of the two plans (wrong
    # results, or a broadcast error for good). Interrupted at each attribute in turn.
    rng = np.random.default_rng(0)
    big, first, then = (rng.standard_normal(s).astype(np.float32)
                        for s in ((9, 8, 5), (9, 3, 5), (6, 2, 5)))  # fmt: skip
    want = leanrnn.LSTM(5, 8, num_layers=2, seed=0)(then)

    for stop in S.Session._KEPT[1:]:
        m = leanrnn.LSTM(5, 8, num_layers=2, seed=0)
        m(big)  # the arena for all three
        m(first)
        m(then)
        _interrupt_at(m.session, stop)
        with pytest.raises(KeyboardInterrupt):
            m(first)  # first's plan being taken back
        got = m(then)
        np.testing.assert_array_equal(got[0], want[0], err_msg=stop)
        np.testing.assert_array_equal(got[1][0], want[1][0], err_msg=stop)


def test_no_plans_are_kept_under_a_memory_limit():
    # (review) each batch's resize sets the chunk there: a plan taken back would not redo it
    m = leanrnn.LSTM(5, 8, seed=0)
    m.session.resize(4, 50, memory_limit=60_000)
    for N in (4, 32, 4):
        m(np.ones((50, N, 5), np.float32))
    assert not m.session._plans


def test_batches_and_lengths_that_change_together_take_back_a_covering_plan(monkeypatch):
    # (README check) with both changing, the kept plans were looked up by exact shape: 165 of
    # 200 warm calls planned again (N alternating 1/2, T in 5..60)
    m, rng = leanrnn.GRU(5, 8, seed=0), np.random.default_rng(4)
    shapes = [(1 + i % 2, int(T)) for i, T in enumerate(rng.integers(5, 40, 60))]
    xs = [rng.standard_normal((T, N, 5)).astype(np.float32) for N, T in shapes]
    for x in xs:
        m(x)
    fresh = leanrnn.GRU(5, 8, seed=0)
    want = [fresh(x)[0] for x in xs]
    plans = _count(monkeypatch, S.Session, "_resize")
    for x, w in zip(xs, want, strict=True):
        np.testing.assert_array_equal(m(x)[0], w)
    assert not plans


def test_an_interrupted_graph_take_back_never_runs_a_mix_of_two_plans(tmp_path):
    # (reading the change again) GraphSession's take-back set its key last without clearing it
    # first, as Session's did before its review: a Ctrl-C part way left the previous shape's
    # key over the other shape's steps and views

    from leanrnn.engine.graph import session as gs

    rng = np.random.default_rng(0)
    W = rng.standard_normal((1, 12, 3)).astype(np.float32)
    _gru_relu_onnx(tmp_path / "g.onnx", W, rng.standard_normal((1, 12, 4)).astype(np.float32))
    big, first, then = (rng.standard_normal(s).astype(np.float32)
                        for s in ((9, 8, 3), (9, 3, 3), (6, 2, 3)))  # fmt: skip
    sess = ort.InferenceSession(str(tmp_path / "g.onnx"))
    want = sess.run(None, {"x": then})[0]
    for stop in gs.GraphSession._KEPT:
        lm = leanrnn.load(tmp_path / "g.onnx")
        for x in (big, first, then):
            lm(x)
        _interrupt_at(lm.session, stop)
        with pytest.raises(KeyboardInterrupt):
            lm(first)  # first's plan being taken back
        np.testing.assert_allclose(lm(then), want, rtol=1e-5, atol=1e-6, err_msg=stop)
