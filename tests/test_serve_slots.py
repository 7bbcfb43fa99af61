"""States by slot (issue 11): ``Session.run_slots`` runs on the states where they live, by a slot
table — the kernels gather h_{t-1} from the slots, write each sample's h back at its last valid
step and update c in its slot — and must give the very bits of the gathered path (states copied
into contiguous rows, ``Session.run``, copied back), close to the float64 reference, touching no
other slot. leanrnn.serve's scheduler runs every call that way."""

from __future__ import annotations

import threading

import numpy as np
import pytest

import leanrnn
from helpers import random_layers
from leanrnn import config
from leanrnn.engine.session import Pool, Session
from leanrnn.errors import DTypeError, LeanRNNError, LengthsError, ShapeError
from leanrnn.formats.packing import pack
from leanrnn.kernels import runner
from leanrnn.kernels.reference import reference_forward
from leanrnn.serve.scheduler import Lane, Scheduler
from leanrnn.spec import RNNSpec
from tolerances import ATOL_SAME_ARITHMETIC, RTOL, atol

N = 12  # rows per call: every case below is past threads.PARALLEL_MIN_MACS, so 2 threads split
CASES = {
    # the fused LSTM update, 2 layers
    "lstm": (RNNSpec("lstm", 5, 20, num_layers=2), np.float32),
    # per-gate passes (peepholes) and the projection phase, where h is written
    "lstm-proj-peep": (
        RNNSpec("lstm", 5, 40, num_layers=2, proj_size=7, peepholes=True),
        np.float32,
    ),
    "gru-f64": (RNNSpec("gru", 5, 21, num_layers=2), np.float64),
    # the r*h phase (linear_before_reset=0) and the clipped per-gate path
    "gru-lbr0-clip": (RNNSpec("gru", 5, 40, linear_before_reset=False, clip=2.0), np.float32),
    "gru-clip": (RNNSpec("gru", 5, 40, clip=2.0), np.float32),
    "rnn": (RNNSpec("rnn", 5, 60, num_layers=2), np.float32),
    "rnn-clip": (RNNSpec("rnn", 5, 60, clip=2.0), np.float32),
    # both directions (each op its own rows of the store), batch-first x and y
    "lstm-bi-batch-first": (
        RNNSpec("lstm", 5, 20, direction="bidirectional", batch_first=True),
        np.float32,
    ),
}


def _backend(name: str, monkeypatch, request) -> None:
    if name == "native" and runner.native_module(build=True) is None:
        pytest.skip(f"no native module: {runner._failure()}")
    if name == "jit":
        request.getfixturevalue("jit_compiled")  # conftest: compiled aside while others run
    monkeypatch.setattr(config, "_backend", name)


def _model(spec, dtype, seed):
    layers = random_layers(spec, np.random.default_rng(seed), dtype, scale=0.2)
    return leanrnn.Model(pack(spec, layers, dtype)), layers


def _fill(st, rng, dtype) -> None:
    """Every slot a random state (so a wrong slot, or a zero, shows)."""
    LD, K = st.h.shape[0], st.h.shape[2]
    for q in range(st.S):
        c = None if st.c is None else rng.standard_normal((LD, st.c.shape[2])).astype(dtype)
        st.put(q, rng.standard_normal((LD, K)).astype(dtype), c)


def _tables(rng, S: int):
    """Three calls' slot tables and lengths: shuffled, non-contiguous slots; the second call the
    first's slots reversed (each slot again in the very next call, at another row); padding
    rows (-1, length 0), real slots of length 0 (frozen from the start) and < T (frozen later)."""
    first = rng.permutation(S)[:N]
    out = []
    for call, T in enumerate((5, 3, 6)):
        slot = (first if call == 0 else first[::-1] if call == 1 else rng.permutation(S)[:N]).copy()
        lengths = rng.integers(1, T + 1, N)
        lengths[rng.choice(N, 3, replace=False)] = 0
        slot[np.flatnonzero(lengths == 0)[:2]] = -1  # two padding rows, one real length 0
        out.append((T, slot.astype(np.int64), lengths.astype(np.int64)))
    return out


def _gathered(session, x, h, c, slot, lengths):
    """The path before slots: the rows' states copied out of the store, run, copied back."""
    real = slot >= 0
    h0 = np.zeros((h.shape[0], len(slot), h.shape[2]), h.dtype)
    h0[:, real] = h[:, slot[real]]
    c0 = None
    if c is not None:
        c0 = np.zeros((c.shape[0], len(slot), c.shape[2]), c.dtype)
        c0[:, real] = c[:, slot[real]]
    y, hn, cn = session.run(x, h0, c0, lengths)
    h[:, slot[real]] = hn[:, real]
    if c is not None:
        c[:, slot[real]] = cn[:, real]
    return y, h0, c0


@pytest.mark.parametrize("backend", ["native", "jit"])
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("case", sorted(CASES))
def test_slots_equal_the_gathered_path_and_the_reference(case, threads, backend, monkeypatch,
                                                         request):  # fmt: skip
    _backend(backend, monkeypatch, request)
    spec, dtype = CASES[case]
    model, layers = _model(spec, dtype, seed=len(case))
    session = model.session
    session.threads = threads
    rng = np.random.default_rng(7)
    S = 2 * N + 3
    st = session.slot_states(S)
    _fill(st, rng, dtype)
    h, c = st.h.copy(), None if st.c is None else st.c.copy()  # the gathered path's store
    for T, slot, lengths in _tables(rng, S):
        shape = (N, T, spec.input_size) if spec.batch_first else (T, N, spec.input_size)
        x = rng.standard_normal(shape).astype(dtype)
        stores = [a for a in (st.h, st._c) if a is not None]  # c with its padding units
        before = [a.copy() for a in stores]
        y = session.run_slots(x, st, slot, lengths)
        want, h0, c0 = _gathered(session, x, h, c, slot, lengths)
        np.testing.assert_array_equal(y, want)  # the same bits
        np.testing.assert_array_equal(st.h, h)
        if c is not None:
            np.testing.assert_array_equal(st.c, c)
        y64, h64, c64 = reference_forward(spec, layers, x, h0, c0, lengths)
        tol = atol(dtype)
        np.testing.assert_allclose(y, y64, rtol=RTOL[dtype], atol=tol)
        moved = slot[lengths > 0]
        np.testing.assert_allclose(st.h[:, moved], h64[:, lengths > 0], RTOL[dtype], tol)
        if c is not None:
            np.testing.assert_allclose(st.c[:, moved], c64[:, lengths > 0], RTOL[dtype], tol)
        # every other slot (not in the table, or length 0) keeps its bytes, padding units too
        kept = np.setdiff1d(np.arange(S), moved)
        for a, b in zip(stores, before, strict=True):
            assert a[:, kept].tobytes() == b[:, kept].tobytes()


def test_chunked_runs_carry_the_states_in_their_slots():
    """A session planned for 2 steps runs 7 in chunks: each chunk reads and writes the slots."""
    spec = RNNSpec("lstm", 5, 20, num_layers=2)
    layers = random_layers(spec, np.random.default_rng(1), np.float32)
    session = Session(pack(spec, layers, np.float32), chunk=2)
    rng = np.random.default_rng(2)
    st = session.slot_states(9)
    _fill(st, rng, np.float32)
    h, c = st.h.copy(), st.c.copy()
    slot, lengths = np.array([6, 0, -1, 3]), np.array([7, 4, 0, 1])
    x = rng.standard_normal((7, 4, 5)).astype(np.float32)
    y = session.run_slots(x, st, slot, lengths)
    assert session._T == 2
    want, h0, c0 = _gathered(session, x, h, c, slot, lengths)
    np.testing.assert_array_equal(y, want)
    np.testing.assert_array_equal(st.h, h)
    np.testing.assert_array_equal(st.c, c)
    y64 = reference_forward(spec, layers, x, h0, c0, lengths)[0]
    np.testing.assert_allclose(y, y64, rtol=RTOL[np.float32], atol=atol(np.float32))


def test_bad_slot_tables_are_refused_and_the_session_stays_usable():
    model = leanrnn.LSTM(3, 5, num_layers=2, seed=1)
    session = model.session
    st = session.slot_states(4)
    _fill(st, np.random.default_rng(0), np.float32)
    x = np.ones((2, 2, 3), np.float32)
    other = leanrnn.GRU(3, 5, seed=2).session.slot_states(4)
    bad = [
        (dict(slot=[0, 4]), ShapeError, r"slot \[4\] out of range; expected 0 <= slot < S=4"),
        (dict(slot=[0, -2]), ShapeError, r"slot \[-2\] out of range"),
        (dict(slot=[2, 2]), ShapeError, r"slot \[2\] appears more than once; expected distinct"),
        (dict(slot=np.array([0.0, 1.0])), DTypeError, r"slot has dtype float64; expected int"),
        (dict(slot=[[0, 1]]), ShapeError, r"slot has shape \(1, 2\); expected \[N=2\]"),
        (dict(slot=[-1, 0]), ShapeError, r"rows \[0\] have slot -1 \(padding\) but steps"),
        (dict(slot=[-1, 0], lengths=[1, 2]), ShapeError, r"rows \[0\] have slot -1"),
        (dict(slot=[0, 1], lengths=[3, 1]), LengthsError, r"lengths \[3\] out of range"),
        (dict(slot=[0, 1], states=other), ShapeError, r"states hold float32 states of "
         r"\[L\*D=1, K=5, H=5\]; expected float32 \[L\*D=2, K=5, H=5\]"),
        (dict(slot=[0, 1], states=st.h), ShapeError, r"states is a ndarray; expected the "
         r"SlotStates of this model"),
        (dict(slot=[0, 1], out=np.empty((2, 2, 4), np.float32)), ShapeError, r"out \(y\)"),
    ]  # fmt: skip
    before = (st.h.copy(), st._c.copy())
    for kw, error, words in bad:
        args = dict(states=st, lengths=None, out=None) | kw
        with pytest.raises(error, match=words) as e:
            session.run_slots(x, args["states"], args["slot"], args["lengths"], args["out"])
        assert isinstance(e.value, LeanRNNError) and str(e.value).startswith("[Session.run_")
        np.testing.assert_array_equal(st.h, before[0])  # refused before anything ran
        np.testing.assert_array_equal(st._c, before[1])
    with pytest.raises(LeanRNNError, match=r"streams=0; expected a positive int"):
        session.slot_states(0)
    slot = np.array([3, 1])
    y = session.run_slots(x, st, slot)  # still usable
    want, _, _ = _gathered(session, x, before[0], before[1][:, :, :5], slot, None)
    np.testing.assert_array_equal(y, want)


def test_the_scheduler_runs_every_call_on_the_slots(monkeypatch):
    """Lane.run hands the engine its slot table (no gathered copies through Session.run, which
    is made to fail here), and interleaved streams of different lengths — frozen rows, padding
    rows, slots reused by new streams — equal the offline model per stream."""
    model = leanrnn.LSTM(3, 6, num_layers=2, seed=4)
    rng = np.random.default_rng(5)
    xs = [rng.standard_normal((int(rng.integers(1, 11)), 3)).astype(np.float32) for _ in range(7)]
    wants = [model(x[:, None])[0][:, 0] for x in xs]
    lane = Lane("m", model, Pool(), threads=1, max_streams=4, max_batch=3, max_chunk=4,
                idle_timeout=60.0)  # fmt: skip
    lane.warm_up()

    def gathered(*args, **kw):
        raise AssertionError("Session.run called: states copied in and out of a call")

    monkeypatch.setattr(Session, "run", gathered)
    sched = Scheduler({"m": lane}, max_wait=0.0)
    sched.start()
    done = threading.Semaphore(0)
    got = []
    for group in (range(4), range(4, 7)):  # 4 streams (every slot), then 3 on freed slots
        sent = 0
        for i in group:
            x, cut = xs[i], len(xs[i]) // 2
            parts = [x] if cut == 0 else [x[:cut], x[cut:]]
            got.append([sched.submit("m", i, j == 0, j == len(parts) - 1, p,
                                     on_done=lambda r: done.release())
                        for j, p in enumerate(parts)])  # fmt: skip
            sent += len(parts)
        for _ in range(sent):
            assert done.acquire(timeout=60)
    sched.stop()
    assert lane.rows > lane.calls and not lane.seqs  # batched; every stream ended
    for want, reqs in zip(wants, got, strict=True):
        assert all(r.error is None for r in reqs), [r.error for r in reqs]
        y = np.concatenate([r.y for r in reqs])
        np.testing.assert_allclose(y, want, rtol=0, atol=ATOL_SAME_ARITHMETIC[np.float32])


@pytest.mark.parametrize("backend", ["native", "jit"])
@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn"])
def test_slots_on_batch_slices(cell, backend, monkeypatch, request):
    """A batch large enough that 2 threads each run their own samples (kernels._sync.share, no
    barrier): each gathers only its own rows from the store (gathering all of them raced with
    the other thread, whose rows may be past their first step)."""
    from leanrnn.kernels._cpu import batch_slices

    _backend(backend, monkeypatch, request)
    n = 96
    assert batch_slices(n, 2)
    spec = RNNSpec(cell, 5, 24)
    model, layers = _model(spec, np.float32, seed=3)
    session = model.session
    session.threads = 2
    rng = np.random.default_rng(5)
    S = n + 9
    st = session.slot_states(S)
    _fill(st, rng, np.float32)
    h, c = st.h.copy(), None if st.c is None else st.c.copy()
    for T in (4, 3, 5):
        slot = rng.permutation(S)[:n].astype(np.int64)
        lengths = rng.integers(0, T + 1, n).astype(np.int64)
        x = rng.standard_normal((T, n, 5)).astype(np.float32)
        y = session.run_slots(x, st, slot, lengths)
        want, h0, c0 = _gathered(session, x, h, c, slot, lengths)
        np.testing.assert_array_equal(y, want)
        np.testing.assert_array_equal(st.h, h)
        y64 = reference_forward(spec, layers, x, h0, c0, lengths)[0]
        np.testing.assert_allclose(y, y64, rtol=RTOL[np.float32], atol=atol(np.float32))
