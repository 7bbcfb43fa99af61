"""Streaming, chunked runs, shared pools and memory budgets against one full run."""

import threading
import tracemalloc

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import leanrnn
from helpers import random_layers
from leanrnn import errors
from leanrnn.engine import Pool, Session
from leanrnn.formats.packing import pack
from leanrnn.spec import RNNSpec
from tolerances import ATOL_SAME_ARITHMETIC, atol


def _model(cell, layers=2, H=20, C=6, proj=0, bf=False, seed=0, dtype=np.float32,
           direction="forward"):  # fmt: skip
    spec = RNNSpec(cell, C, H, num_layers=layers, proj_size=proj, batch_first=bf,
                   direction=direction)  # fmt: skip
    # torch-like weight scale: chunk boundaries change float32 summation order, and large
    # weights would amplify that rounding past the float32 tolerance over many steps
    layers = random_layers(spec, np.random.default_rng(seed), dtype, scale=1 / np.sqrt(H))
    return leanrnn.Model(pack(spec, layers, dtype))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    cell=st.sampled_from(["lstm", "gru", "rnn"]),
    layers=st.integers(1, 3),
    bf=st.booleans(),
    cuts=st.lists(st.integers(1, 5), min_size=1, max_size=6),
    seed=st.integers(0, 1000),
)
def test_any_chunking_equals_one_run(cell, layers, bf, cuts, seed):
    model = _model(cell, layers, bf=bf, seed=seed)
    T, N = sum(cuts), 3
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((N, T, 6) if bf else (T, N, 6)).astype(np.float32)
    y, h_n, c_n = model.session.run(x)
    stream = model.session.stream(batch=N)
    parts, t = [], 0
    for c in cuts:
        xs = np.ascontiguousarray(x[:, t : t + c] if bf else x[t : t + c])
        parts.append(stream.feed(xs))
        t += c
    ys = np.concatenate(parts, axis=1 if bf else 0)
    np.testing.assert_allclose(ys, y, rtol=0, atol=atol(np.float32))
    h, c = stream.state
    np.testing.assert_allclose(h, h_n, rtol=0, atol=atol(np.float32))
    if c_n is not None:
        np.testing.assert_allclose(c, c_n, rtol=0, atol=atol(np.float32))


def test_single_step_feed_reset_and_restore():
    model = _model("lstm", 2)
    x = np.random.default_rng(0).standard_normal((8, 2, 6)).astype(np.float32)
    y, _, _ = model.session.run(x)
    s = model.session.stream(batch=2)
    for t in range(4):
        np.testing.assert_allclose(s.feed(x[t]), y[t], atol=atol(np.float32), rtol=0)
    saved = s.state
    s.reset(1)
    assert not s.state[0][:, 1].any() and s.state[0][:, 0].any()
    s.state = saved
    for t in range(4, 8):
        np.testing.assert_allclose(s.feed(x[t]), y[t], atol=atol(np.float32), rtol=0)
    # reset(i) starts a fresh sequence in slot i: it now matches a run from t=0 for that sample
    s.reset(1)
    y1, _, _ = model.session.run(np.ascontiguousarray(x[:3, 1:2]))
    for t in range(3):
        np.testing.assert_allclose(s.feed(x[t])[1], y1[t, 0], atol=atol(np.float32), rtol=0)
    with pytest.raises(errors.ShapeError, match="batch=2"):
        s.feed(x[0, :1])


def test_stream_rejects_bidirectional_and_reverse():
    m = leanrnn.LSTM(4, 8, bidirectional=True, seed=0)
    with pytest.raises(errors.SpecError, match="bidirectional stack cannot stream"):
        m.session.stream(1)
    rev = _model("gru", 1, direction="reverse")
    with pytest.raises(errors.SpecError, match="reverse stack cannot stream"):
        rev.session.stream(1)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_reverse_stacks_ignore_chunking(cell):
    """Regression: chunks advance forward in time, which is wrong for a reverse direction;
    chunk and return_sequences=False must fall back to the whole sequence there."""
    model = _model(cell, 2, direction="reverse")
    x = np.random.default_rng(0).standard_normal((70, 2, 6)).astype(np.float32)
    lengths = np.array([70, 45])
    y, h, _ = model.session.run(x, lengths=lengths)
    s = Session(model.weights, chunk=32)
    yc, hc, _ = s.run(x, lengths=lengths)
    np.testing.assert_allclose(yc, y, rtol=0, atol=ATOL_SAME_ARITHMETIC[np.float32])
    _, hl, _ = Session(model.weights).run(x, lengths=lengths, return_sequences=False)
    np.testing.assert_allclose(hl, h, rtol=0, atol=ATOL_SAME_ARITHMETIC[np.float32])


def test_streaming_steps_do_not_grow_memory():
    model = _model("lstm", 1, H=64, C=64)
    s = model.session.stream(batch=1)
    x = np.ones((1, 64), np.float32)
    out = np.empty((1, 64), np.float32)
    for _ in range(5):
        s.feed(x, out=out)
    tracemalloc.start()
    try:
        for _ in range(5):
            s.feed(x, out=out)
        before, _ = tracemalloc.get_traced_memory()
        for _ in range(100):
            s.feed(x, out=out)
        after, _ = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert after <= before, after - before


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("bf", [False, True])
def test_chunked_run_equals_full_run(cell, bf):
    model = _model(cell, 3, bf=bf, proj=7 if cell == "lstm" else 0)
    T, N = 23, 4
    rng = np.random.default_rng(1)
    x = rng.standard_normal((N, T, 6) if bf else (T, N, 6)).astype(np.float32)
    lengths = np.array([23, 5, 17, 1])
    y, h, c = model.session.run(x, lengths=lengths)
    chunked = Session(model.weights, chunk=5)
    yc, hc, cc = chunked.run(x, lengths=lengths)
    np.testing.assert_allclose(yc, y, rtol=0, atol=atol(np.float32))
    np.testing.assert_allclose(hc, h, rtol=0, atol=atol(np.float32))
    assert chunked.plan.total < model.session.plan.total / 2
    _, hl, cl = chunked.run(x, lengths=lengths, return_sequences=False)
    np.testing.assert_allclose(hl, h, rtol=0, atol=atol(np.float32))


def test_return_sequences_false_memory_does_not_depend_on_T():
    model = _model("lstm", 2, H=32, C=8)
    s = model.session
    x_short = np.zeros((100, 1, 8), np.float32)
    x_long = np.zeros((5000, 1, 8), np.float32)
    _, h1, _ = s.run(x_short, return_sequences=False)
    a1 = s.plan.total
    _, h2, _ = s.run(x_long, return_sequences=False)
    assert s.plan.total == a1
    y, h_full, _ = s.run(x_long)
    np.testing.assert_allclose(h2, h_full, rtol=0, atol=atol(np.float32))


def test_memory_limit_picks_the_largest_chunk_that_fits():
    model = _model("gru", 2, H=48, C=16)
    s = Session(model.weights)
    full = s.resize(8, 200).total
    p = s.resize(8, 200, memory_limit=full // 4)
    assert p.total <= full // 4 and s.chunk is not None and s.chunk < 200
    bigger = Session(model.weights)
    bigger.chunk = s.chunk + 1
    assert bigger.resize(8, 200).total > full // 4  # one step more would not fit
    x = np.random.default_rng(0).standard_normal((200, 8, 16)).astype(np.float32)
    np.testing.assert_allclose(s.run(x)[0], model.session.run(x)[0], rtol=0, atol=atol(np.float32))
    with pytest.raises(errors.PlanError, match="even one step needs"):
        Session(model.weights).resize(8, 200, memory_limit=1000)
    bi = leanrnn.LSTM(16, 16, bidirectional=True, seed=0)
    with pytest.raises(errors.PlanError, match="bidirectional stack needs the whole sequence"):
        Session(bi.weights).resize(8, 200, memory_limit=10_000)


def test_pool_shares_one_arena_and_is_thread_safe():
    a = _model("lstm", 2, H=40, C=6, seed=1)
    b = _model("gru", 1, H=24, C=6, seed=2)
    pool = Pool()
    sa, sb = Session(a.weights, pool=pool), Session(b.weights, pool=pool)
    x = np.random.default_rng(0).standard_normal((30, 5, 6)).astype(np.float32)
    ya, yb = a.session.run(x)[0], b.session.run(x)[0]
    sa.resize(5, 30)
    sb.resize(5, 30)
    assert pool.nbytes == max(sa.plan.total, sb.plan.total)
    assert sa._arena is sb._arena
    errs = []

    def work(sess, want):
        try:
            for _ in range(20):
                np.testing.assert_allclose(sess.run(x)[0], want, rtol=0, atol=atol(np.float32))
        except AssertionError as e:  # pragma: no cover - reported below
            errs.append(e)

    threads = [threading.Thread(target=work, args=(s, w)) for s, w in ((sa, ya), (sb, yb)) * 2]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errs
    # A member planning something bigger grows the pool; the other re-makes its views.
    sb.run(np.zeros((300, 5, 6), np.float32))
    np.testing.assert_allclose(sa.run(x)[0], ya, rtol=0, atol=atol(np.float32))


def test_automatic_chunk_keeps_the_projection_within_budget_and_changes_nothing():
    """chunk=None: time-major runs go in chunks whose input projection fits XW_BUDGET (at least
    MIN_AUTO_CHUNK steps); batch-first runs stay whole; results equal an unchunked run."""
    from leanrnn.engine import session as session_mod

    for bf in (False, True):
        model = _model("lstm", 2, bf=bf)
        s = model.session
        N, T = 8, 40
        step_bytes = N * model.weights.Gp * 4
        budget_steps = max(session_mod.MIN_AUTO_CHUNK, session_mod.XW_BUDGET // step_bytes)
        x = np.random.default_rng(2).standard_normal((N, T, 6) if bf else (T, N, 6))
        x = x.astype(np.float32)
        old = session_mod.XW_BUDGET
        try:
            session_mod.XW_BUDGET = 7 * step_bytes  # force chunks of 7 steps at this size
            y, h, c = s.run(x)
            planned = s._T
        finally:
            session_mod.XW_BUDGET = old
        assert planned == (T if bf else 7)
        whole = Session(model.weights, chunk=T)
        yw, hw, cw = whole.run(x)
        np.testing.assert_allclose(y, yw, rtol=0, atol=atol(np.float32))
        np.testing.assert_allclose(h, hw, rtol=0, atol=atol(np.float32))
        assert s.auto_chunk(N) == (None if bf else budget_steps)
