"""Engine API hardening (round 5): a rejected state assignment changes nothing, run_slots refuses
an x laid over its states, SlotStates.put validates before it writes, settings are checked when
set, and errors name the shapes the caller passes (batch-first, one streaming step)."""

import numpy as np
import pytest

import leanrnn
from leanrnn import errors
from leanrnn.engine.session import Pool, Session


# ------------------------------------------------------------ 1. Stream.state = (h, c)
def test_rejected_stream_state_changes_nothing():
    m = leanrnn.LSTM(3, 4, num_layers=2, seed=0)
    st = m.stream(2)
    st.feed(np.ones((5, 2, 3), np.float32))
    h0, c0 = st.state
    with pytest.raises(errors.DTypeError, match=r"\[Stream.state\] c has dtype float64"):
        st.state = (np.zeros((2, 2, 4), np.float32), np.zeros((2, 2, 4), np.float64))
    with pytest.raises(errors.ShapeError, match=r"\[Stream.state\] c has shape"):
        st.state = (np.zeros((2, 2, 4), np.float32), np.zeros((2, 2, 5), np.float32))
    h1, c1 = st.state
    np.testing.assert_array_equal(h1, h0)
    np.testing.assert_array_equal(c1, c0)
    st.state = (np.zeros((2, 2, 4), np.float32), np.ones((2, 2, 4), np.float32))  # still works
    assert not st.state[0].any() and (st.state[1] == 1).all()


# ------------------------------------------------------------ 2. run_slots: x over the states
def test_run_slots_refuses_x_sharing_memory_with_states():
    m = leanrnn.GRU(4, 4, num_layers=2, seed=0)
    s = Session(m.weights, chunk=1)
    st = s.slot_states(3)
    st.h[...] = np.random.default_rng(0).standard_normal(st.h.shape)
    before = st.h.copy()
    with pytest.raises(errors.LayoutError, match=r"\[Session.run_slots\] x shares memory with"):
        s.run_slots(st.h, st, np.arange(3))  # x [T=2, N=3, C=4] is the states' h
    with pytest.raises(errors.LayoutError, match=r"\[Session.run_slots\] x shares memory with"):
        s.run_slots(st.h[1:], st, np.arange(3))  # a part of it
    np.testing.assert_array_equal(st.h, before)  # nothing ran
    y = s.run_slots(st.h.copy(), st, np.arange(3))  # a copy: fine, and the session works
    assert y.shape == (2, 3, 4) and np.isfinite(y).all()


def test_run_slots_refuses_lstm_x_over_cell_states():
    m = leanrnn.LSTM(4, 4, seed=0)
    s = m.session
    st = s.slot_states(2)
    x = st._c.reshape(-1)[:8].reshape(1, 2, 4)  # x [T=1, N=2, C=4] over the cell states
    with pytest.raises(errors.LayoutError, match=r"x shares memory with states.c"):
        s.run_slots(x, st, np.arange(2))


# ------------------------------------------------------------ 3. SlotStates.put
@pytest.fixture
def lstm_slots():
    m = leanrnn.LSTM(3, 4, num_layers=2, seed=0)
    s = m.session
    st = s.slot_states(3)
    s.run_slots(np.ones((4, 3, 3), np.float32), st, np.array([0, 1, 2]))
    return st


def test_put_wrong_c_shape_writes_nothing(lstm_slots):
    st = lstm_slots
    h0, c0 = st.h.copy(), st._c.copy()
    with pytest.raises(errors.ShapeError, match=r"\[SlotStates.put\] c has shape \(2, 3\)"):
        st.put(1, np.full((2, 4), 5.0, np.float32), np.zeros((2, 3), np.float32))
    np.testing.assert_array_equal(st.h, h0)
    np.testing.assert_array_equal(st._c, c0)


def test_put_refuses_conversion_and_broadcast(lstm_slots):
    st = lstm_slots
    h0 = st.h.copy()
    with pytest.raises(errors.DTypeError, match=r"\[SlotStates.put\] h has dtype float64"):
        st.put(2, np.ones((2, 4)))
    with pytest.raises(errors.ShapeError, match=r"\[SlotStates.put\] h has shape \(4,\)"):
        st.put(2, np.array([1, 2, 3, 4], np.float32))  # one layer's worth, broadcast before
    with pytest.raises(errors.DTypeError, match=r"h is a list"):
        st.put(2, [[1.0] * 4] * 2)
    np.testing.assert_array_equal(st.h, h0)


@pytest.mark.parametrize("slot", [-1, 3, 7, True, 1.0, np.int64(-2)])
def test_put_refuses_slots_out_of_range(lstm_slots, slot):
    st = lstm_slots
    h0, c0 = st.h.copy(), st._c.copy()
    with pytest.raises(
        errors.ShapeError, match=r"\[SlotStates.put\] slot .*expected an int in 0..2"
    ):
        st.put(slot)
    np.testing.assert_array_equal(st.h, h0)
    np.testing.assert_array_equal(st._c, c0)


def test_put_good_and_gru_c(lstm_slots):
    st = lstm_slots
    st.put(np.int64(2), np.full((2, 4), 3.0, np.float32), np.full((2, 4), 2.0, np.float32))
    assert (st.h[:, 2] == 3).all() and (st.c[:, 2] == 2).all() and not st._c[:, 2, 4:].any()
    st.put(0)
    assert not st.h[:, 0].any() and not st._c[:, 0].any()
    g = leanrnn.GRU(3, 4, seed=0).session.slot_states(2)
    with pytest.raises(errors.ShapeError, match=r"c was given but a GRU has no cell state"):
        g.put(0, np.zeros((1, 4), np.float32), np.zeros((1, 4), np.float32))


# ------------------------------------------------------------ 4. settings and arguments
@pytest.mark.parametrize("bad", [0, -5, 2.5, True, "4"])
def test_chunk_is_checked_when_set(bad):
    m = leanrnn.LSTM(3, 4, seed=0)
    s = Session(m.weights)
    with pytest.raises(errors.ShapeError, match=r"\[Session\] chunk="):
        s.chunk = bad
    assert s.chunk is None
    s.chunk = np.int64(2)
    assert s.chunk == 2 and type(s.chunk) is int
    y, _, _ = s.run(np.ones((5, 2, 3), np.float32))
    assert y.shape == (5, 2, 4)


@pytest.mark.parametrize("bad", ["4M", True, 0, -1, 2.5])
def test_memory_limit_is_checked(bad):
    s = Session(leanrnn.LSTM(3, 4, seed=0).weights)
    with pytest.raises(errors.SpecError, match=r"\[Session.resize\] memory_limit="):
        s.resize(2, 100, memory_limit=bad)
    assert s.resize(2, 100, memory_limit=1 << 20).total <= 1 << 20


def test_pool_type_is_checked():
    w = leanrnn.LSTM(3, 4, seed=0).weights
    with pytest.raises(errors.SpecError, match=r"\[Session\] pool is a object"):
        Session(w, pool=object())
    assert Session(w, pool=Pool()).run(np.ones((2, 1, 3), np.float32))[0].shape == (2, 1, 4)


def test_unsigned_slots_are_range_checked_before_the_cast():
    m = leanrnn.LSTM(3, 4, seed=0)
    s = m.session
    st = s.slot_states(4)
    x = np.ones((2, 3, 3), np.float32)
    with pytest.raises(errors.ShapeError, match=r"slot \[18446744073709551615\] out of range"):
        s.run_slots(x, st, np.array([2**64 - 1, 0, 1], np.uint64), lengths=np.array([0, 2, 2]))
    with pytest.raises(errors.ShapeError, match=r"slot \[9223372036854775808\] out of range"):
        s.run_slots(x, st, np.array([2**63, 0, 1], np.uint64))
    assert not st.h.any()
    y = s.run_slots(x, st, np.array([3, 0, 1], np.uint64))  # in range: fine
    assert y.shape == (2, 3, 4) and st.h[:, 3].any() and not st.h[:, 2].any()


# ------------------------------------------------------------ 5. batch-first names
def test_batch_first_out_names_n_then_t():
    m = leanrnn.GRU(4, 6, seed=0, batch_first=True)
    x = np.ones((2, 5, 4), np.float32)
    with pytest.raises(errors.ShapeError, match=r"expected \[N=2, T=5, D\*K=6\]"):
        m.session.run(x, out=(np.empty((5, 2, 6), np.float32), np.empty((1, 2, 6), np.float32)))
    st = m.session.slot_states(2)
    with pytest.raises(errors.ShapeError, match=r"expected \[N=2, T=5, D\*K=6\]"):
        m.session.run_slots(x, st, np.arange(2), out=np.empty((5, 2, 6), np.float32))


# ------------------------------------------------------------ 6. Stream.feed messages
@pytest.mark.parametrize("bf", [False, True])
def test_stream_feed_errors_name_the_callers_shapes(bf):
    m = leanrnn.LSTM(4, 6, seed=0, batch_first=bf)
    st = m.stream(3)
    chunk = r"\[N=3, T, C=4\]" if bf else r"\[T, N=3, C=4\]"
    with pytest.raises(errors.ShapeError, match=r"\[Stream.feed\] x has shape \(4,\); expected "
                       r"\[N=3, C=4\] \(one step\) or " + chunk):  # fmt: skip
        st.feed(np.zeros(4, np.float32))
    with pytest.raises(errors.LayoutError, match=r"\[Stream.feed\] x is not C-contiguous "
                       r"\(strides \(32, 8\)\)"):  # fmt: skip
        st.feed(np.zeros((3, 8), np.float32)[:, ::2])
    with pytest.raises(errors.DTypeError, match=r"\[Stream.feed\] x has dtype float64"):
        st.feed(np.zeros((3, 4)))
    with pytest.raises(errors.ShapeError, match=r"\[Stream.feed\] x has shape \(3, 5\); "
                       r"expected \[N=3, C=4\]"):  # fmt: skip
        st.feed(np.zeros((3, 5), np.float32))
    with pytest.raises(errors.ShapeError, match=r"\[Stream.feed\] out has shape \(3, 5\); "
                       r"expected \[N=3, D\*K=6\]"):  # fmt: skip
        st.feed(np.zeros((3, 4), np.float32), out=np.empty((3, 5), np.float32))
    x3 = np.zeros((3, 2, 5) if bf else (2, 3, 5), np.float32)
    with pytest.raises(errors.ShapeError, match=r"\[Stream.feed\] x has shape"):
        st.feed(x3)
    assert st.steps == 0 and not st.state[0].any()
    y = st.feed(np.ones((3, 4), np.float32))  # the stream still works
    assert y.shape == (3, 6) and st.steps == 1
    y = st.feed(np.ones((3, 4), np.float32))  # the bound step too
    assert y.shape == (3, 6) and st.steps == 2
    with pytest.raises(errors.ShapeError, match=r"\[Stream.feed\] x has shape \(3, 5\)"):
        st.feed(np.zeros((3, 5), np.float32))  # after the step was bound


def test_stream_feed_chunk_errors_name_stream_feed():
    m = leanrnn.GRU(4, 6, seed=0)
    st = m.stream(2)
    with pytest.raises(errors.ShapeError, match=r"\[Stream.feed\] out has shape \(3, 2, 5\); "
                       r"expected \[T=3, N=2, D\*K=6\]"):  # fmt: skip
        st.feed(np.ones((3, 2, 4), np.float32), out=np.empty((3, 2, 5), np.float32))
    with pytest.raises(errors.ShapeError, match=r"\[Stream.feed\] x has batch 3"):
        st.feed(np.ones((3, 3, 4), np.float32), out=np.empty((3, 3, 6), np.float32))
    with pytest.raises(errors.ShapeError, match=r"\[Stream.feed\] x has shape \(3, 2, 5\)"):
        st.feed(np.ones((3, 2, 5), np.float32))
    assert st.steps == 0
    assert st.feed(np.ones((3, 2, 4), np.float32)).shape == (3, 2, 6) and st.steps == 3


@pytest.mark.parametrize("cell", ["GRU", "RNN"])
def test_stream_state_refuses_a_c_for_a_cell_without_one(cell):
    """A GRU/RNN stream has no c: (h, c) was taken with c silently dropped, so a caller who
    mixed up models restored half a state and never knew."""
    st = getattr(leanrnn, cell)(3, 4, seed=0).stream(2)
    st.feed(np.ones((5, 2, 3), np.float32))
    h, _ = st.state
    with pytest.raises(errors.ShapeError, match="has none"):
        st.state = (np.zeros_like(h), np.zeros_like(h))
    assert np.array_equal(st.state[0], h)  # unchanged
    st.state = (np.zeros_like(h), None)
    assert not st.state[0].any()
