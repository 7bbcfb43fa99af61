"""Stream.feed's bound single step (Session._step_program, runner.Program): after the first step
of a stream, steps of x [N, C] run a native program bound once instead of run()'s path. It
must give the very same numbers as that path, and decline — so that run()'s checks raise their
usual errors, and leave the stream usable — whenever x, out or the session are not what it was
bound for."""

import os

import numpy as np
import pytest

import leanrnn
from helpers import random_layers
from leanrnn import errors
from leanrnn.engine import Pool, Session
from leanrnn.formats.packing import pack
from leanrnn.kernels import runner
from leanrnn.kernels.reference import reference_forward
from leanrnn.spec import RNNSpec
from tolerances import atol


@pytest.fixture(autouse=True)
def native():
    """Programs need the native module (resolved here, not at collection: it may build)."""
    if not runner.binds():
        pytest.skip(f"no native module: {runner._failure()}")


# (cell, layers, C, H, proj, batch_first, N, dtype): padded units (H=20 -> 32 columns), a
# projection, stacks, batch-first, float64; and H=128, N=1, the bench's streaming row.
CASES = [
    ("lstm", 1, 128, 128, 0, False, 1, np.float32),
    ("lstm", 3, 6, 20, 7, False, 2, np.float64),
    ("lstm", 2, 6, 20, 0, True, 3, np.float32),
    ("gru", 1, 128, 128, 0, False, 1, np.float32),
    ("gru", 2, 5, 20, 0, True, 2, np.float64),
    ("rnn", 2, 6, 20, 0, False, 3, np.float32),
]


def _model(cell, layers=1, C=6, H=20, proj=0, bf=False, dtype=np.float32, seed=0):
    spec = RNNSpec(cell, C, H, num_layers=layers, proj_size=proj, batch_first=bf)
    layers = random_layers(spec, np.random.default_rng(seed), dtype, scale=1 / np.sqrt(H))
    return leanrnn.Model(pack(spec, layers, dtype))


def _general(model, N, xs):
    """The same steps through run()'s path: [1, N, C] chunks (never bound)."""
    s = model.session.stream(N)
    bf = model.spec.batch_first
    ys = [s.feed(x[:, None] if bf else x[None]) for x in xs]
    assert s._step is None
    return [y[:, 0] if bf else y[0] for y in ys], s.state


def _count_runs(monkeypatch) -> list:
    calls = []
    general = Session._run

    def counted(self, *a):
        calls.append(1)
        return general(self, *a)

    monkeypatch.setattr(Session, "_run", counted)
    return calls


@pytest.mark.parametrize("case", CASES, ids=lambda c: f"{c[0]}-L{c[1]}-H{c[3]}-p{c[4]}-bf{c[5]}")
def test_bound_steps_equal_the_general_path_bit_for_bit(case, monkeypatch):
    cell, L, C, H, proj, bf, N, dt = case
    model = _model(cell, L, C, H, proj, bf, dt)
    xs = list(np.random.default_rng(1).standard_normal((6, N, C)).astype(dt))
    runs = _count_runs(monkeypatch)
    s = model.session.stream(N)
    outs = list(np.empty((3, N, model.spec.output_size), dt))
    ys = [s.feed(x) for x in xs[:3]] + [s.feed(x, out=o) for x, o in zip(xs[3:], outs, strict=True)]
    # Only the first step took run()'s path (it plans the session, then binds the step).
    assert len(runs) == 1 and s._step is not None and s.steps == 6
    assert all(y is o for y, o in zip(ys[3:], outs, strict=True))
    want, (wh, wc) = _general(_model(cell, L, C, H, proj, bf, dt), N, xs)
    for y, w in zip(ys, want, strict=True):
        np.testing.assert_array_equal(y, w)
    h, c = s.state
    np.testing.assert_array_equal(h, wh)
    if c is not None:
        np.testing.assert_array_equal(c, wc)
    # and both against the float64 oracle
    spec = model.spec
    x = np.stack(xs, axis=1 if bf else 0)
    ref = reference_forward(spec, model.weights.unpack(), x)[0]
    got = np.stack(ys, axis=1 if bf else 0)
    np.testing.assert_allclose(got, ref, rtol=0, atol=atol(dt))


def test_bound_steps_on_the_thread_team(monkeypatch):
    """A step big enough to split (parts > 1): the program launches the native team, as
    run() does, with the same result; more parts than cores run some after others."""
    monkeypatch.setattr(leanrnn.config, "max_threads", lambda: 3)
    model = _model("lstm", 2, C=128, H=128)
    model.session.threads = 3
    xs = list(np.random.default_rng(5).standard_normal((5, 1, 128)).astype(np.float32))
    s = model.session.stream(1)
    ys = [s.feed(x).copy() for x in xs]
    assert s._step is not None and s._step.program.parts == 3
    want, (wh, wc) = _general(model, 1, xs)
    np.testing.assert_array_equal(np.stack(ys), np.stack(want))
    np.testing.assert_array_equal(s.state[0], wh)
    np.testing.assert_array_equal(s.state[1], wc)


def _bound_stream():
    model = _model("lstm", 2, C=6, H=20)
    s = model.session.stream(2)
    x = np.random.default_rng(2).standard_normal((4, 2, 6)).astype(np.float32)
    s.feed(x[0])
    s.feed(x[1])
    assert s._step is not None
    return model, s, x


def _wider(shape, dtype=np.float32):
    """A non-contiguous array of ``shape``: every other column of a wider one."""
    return np.ones((shape[0], 2 * shape[1]), dtype)[:, ::2]


def _read_only(shape):
    a = np.empty(shape, np.float32)
    a.flags.writeable = False
    return a


BAD = [
    ("x float64", lambda x: (x.astype(np.float64), None), errors.DTypeError, "dtype float64"),
    ("x a list", lambda x: (x.tolist(), None), errors.DTypeError, "is a list"),
    ("x not contiguous", lambda x: (_wider(x.shape), None), errors.LayoutError, "C-contiguous"),
    ("x other batch", lambda x: (x[:1].copy(), None), errors.ShapeError, "batch=2"),
    ("x other C", lambda x: (np.ones((2, 5), np.float32), None), errors.ShapeError, "C=6"),
    ("out float64", lambda x: (x, np.empty((2, 20))), errors.DTypeError, "dtype float64"),
    ("out shape", lambda x: (x, np.empty((2, 21), np.float32)), errors.ShapeError, "D\\*K=20"),
    ("out not contiguous", lambda x: (x, _wider((2, 20))), errors.LayoutError, "C-contiguous"),
    ("out read-only", lambda x: (x, _read_only((2, 20))), errors.LayoutError, "read-only"),
    ("out over x", None, errors.LayoutError, "shares memory with x"),
]


@pytest.mark.parametrize("what, make, error, match", BAD, ids=[b[0] for b in BAD])
def test_bad_input_after_bound_steps_raises_the_usual_error(what, make, error, match):
    model, s, x = _bound_stream()
    before = s.state
    if make is None:  # out overlapping x: one buffer, x its first 6 columns, y the rest
        buf = np.empty((2, 26), np.float32).reshape(-1)
        xx, out = buf[:12].reshape(2, 6), buf[6:46].reshape(2, 20)
        xx[...] = x[2]
    else:
        xx, out = make(x[2])
    with pytest.raises(error, match=match):
        s.feed(xx, out=out)
    # nothing ran: the state is untouched, the stream still bound and right
    np.testing.assert_array_equal(s.state[0], before[0])
    np.testing.assert_array_equal(s.state[1], before[1])
    assert s.steps == 2
    ys = [s.feed(x[2]), s.feed(x[3])]
    assert s._step is not None
    want, _ = _general(model, 2, list(x))
    np.testing.assert_array_equal(np.stack(ys), np.stack(want[2:]))


def test_nan_propagates_as_on_the_general_path():
    model, s, x = _bound_stream()
    x = x.copy()
    x[2, 1, 3] = np.nan  # sample 1 only: its outputs and state go NaN, sample 0's do not
    ys = [s.feed(x[2]), s.feed(x[3])]
    want, (wh, wc) = _general(model, 2, list(x))
    np.testing.assert_array_equal(np.stack(ys), np.stack(want[2:]))  # NaN where want has NaN
    assert np.isnan(ys[1][1]).all() and not np.isnan(ys[1][0]).any()
    np.testing.assert_array_equal(s.state[0], wh)
    np.testing.assert_array_equal(s.state[1], wc)


def _steps_equal_general(model, s, xs, between):
    """Feed xs one step at a time, calling between(i) before step i; compare bit for bit."""
    ys = []
    for i, x in enumerate(xs):
        between(i)
        ys.append(s.feed(x).copy())
    want, (wh, wc) = _general(model, s.batch, xs)
    np.testing.assert_array_equal(np.stack(ys), np.stack(want))
    np.testing.assert_array_equal(s.state[0], wh)
    if wc is not None:
        np.testing.assert_array_equal(s.state[1], wc)


def test_steps_stay_right_across_replans_state_changes_and_thread_counts(monkeypatch):
    """What invalidates a bound step: run() re-planning the session (its arena views move),
    threads set on the session or globally; what it must see: state set or reset in between."""
    model = _model("gru", 2, C=6, H=20)
    model.session.threads = 1
    xs = list(np.random.default_rng(3).standard_normal((8, 3, 6)).astype(np.float32))
    s = model.session.stream(3)
    other = np.ones((5, 4, 6), np.float32)

    def between(i):
        if i == 2:
            model.session.run(other)  # another plan
        if i == 3:
            model.session.threads = 2
        if i == 5:
            model.session.threads = None
            leanrnn.set_num_threads(1)

    monkeypatch.setattr(leanrnn.config, "_threads", leanrnn.config._threads)  # restored after
    _steps_equal_general(model, s, xs, between)
    assert s._step is not None and s._step.threads == 1
    # state set and reset between bound steps are seen by the next one
    saved = s.state
    y1 = s.feed(xs[0]).copy()
    s.state = saved
    np.testing.assert_array_equal(s.feed(xs[0]), y1)
    s.reset()
    np.testing.assert_array_equal(s.feed(xs[0]), _general(model, 3, xs[:1])[0][0])


def test_two_streams_of_one_session_and_a_shared_pool():
    """Two bound streams alternate on one session (same plan), and two pooled sessions, whose
    runs overwrite each other's arena, alternate too: each keeps its own state."""
    model = _model("lstm", 2, C=6, H=20, proj=5)
    xs = np.random.default_rng(4).standard_normal((6, 2, 6)).astype(np.float32)
    pool = Pool()
    a = model.session.stream(2)
    b = model.session.stream(2)
    p = Session(model.weights, pool=pool).stream(2)
    q = Session(_model("lstm", 2, C=6, H=20, proj=5, seed=9).weights, pool=pool).stream(2)
    got = {k: [] for k in "abpq"}
    for t in range(6):
        for k, st in zip("abpq", (a, b, p, q), strict=True):
            got[k].append(st.feed(xs[t] if k != "b" else xs[5 - t]).copy())
    assert all(st._step is not None for st in (a, b, p, q))
    want = _general(model, 2, list(xs))[0]
    for k in "ap":
        np.testing.assert_array_equal(np.stack(got[k]), np.stack(want))
    np.testing.assert_array_equal(
        np.stack(got["b"]), np.stack(_general(model, 2, list(xs[::-1]))[0])
    )
    other = _model("lstm", 2, C=6, H=20, proj=5, seed=9)
    np.testing.assert_array_equal(np.stack(got["q"]), np.stack(_general(other, 2, list(xs))[0]))


def test_unaligned_x_and_lengths_take_the_general_path():
    model, s, x = _bound_stream()
    buf = bytearray(x[2].nbytes + 1)
    ux = np.frombuffer(buf, np.float32, count=12, offset=1).reshape(2, 6)
    ux[...] = x[2]
    assert not ux.flags.aligned
    ys = [s.feed(ux), s.feed(x[3], lengths=np.array([1, 0]))]
    want = _general(model, 2, list(x))[0]
    np.testing.assert_array_equal(ys[0], want[2])
    np.testing.assert_array_equal(ys[1][0], want[3][0])
    assert s._step is not None


def test_no_program_without_the_native_module(monkeypatch):
    """On numba's JIT (no native module) nothing is bound: every step takes run()'s path."""
    monkeypatch.setattr(runner, "binds", lambda: False)
    model = _model("rnn", 1)
    s = model.session.stream(1)
    s.feed(np.ones((1, 6), np.float32))
    s.feed(np.ones((1, 6), np.float32))
    assert s._step is None


def test_memory_log_is_still_written(monkeypatch, caplog):
    """LEANRNN_LOG=memory logs every op of every run (Session._execute): bound steps stand
    aside while it is on."""
    model, s, x = _bound_stream()
    monkeypatch.setattr(leanrnn.config, "_log_topics", frozenset({"memory"}))
    with caplog.at_level("INFO", logger="leanrnn"):
        for t in (2, 3):
            caplog.clear()
            s.feed(x[t])
            assert any("op 1 acquire" in r.getMessage() for r in caplog.records)
    monkeypatch.setattr(leanrnn.config, "_log_topics", frozenset())
    s.feed(x[0])
    assert s._step is not None  # bound again once the log is off


@pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")
def test_forked_child_steps_a_stream_bound_in_the_parent():
    from test_session_fork import _in_child

    model, s, x = _bound_stream()
    want = _general(model, 2, list(x))[0][2]
    got = _in_child(lambda: s.feed(x[2]), want.nbytes)
    np.testing.assert_array_equal(np.frombuffer(got, np.float32).reshape(want.shape), want)
    np.testing.assert_array_equal(s.feed(x[2]), want)  # the parent, unchanged by the child


def test_malformed_programs_are_refused():
    """run_program reads raw addresses from its program: its structure is checked first."""
    b = runner.backend()
    x, y = np.ones((1, 2), np.float32), np.ones((1, 2), np.float32)
    for bad in (np.zeros(3, np.int64), np.array([1, -1, 0, 0, -1, 0, 0, 0], np.int64),
                np.array([0, 7, 2, 11, -1, 0, 0], np.int64)):  # fmt: skip
        with pytest.raises(ValueError, match="malformed program"):
            b._run_program(bad, x, y, 1)
    with pytest.raises(TypeError, match="writable int64"):
        b._run_program(np.zeros(7, np.int32), x, y, 1)
    # an empty program runs nothing: True
    assert b._run_program(np.array([0, -1, 0, 0, -1, 0, 0], np.int64), x, y, 1) is True
