"""Session 40, from a red-team pass on library concurrency: two threads inside leanrnn's "BLAS on
one thread" at once (a graph with RNN and MatMul nodes, a Trainer's backward) left BLAS at one
thread for the rest of the process, each thread's threadpoolctl limiter restoring the limits it
found; a Pool kept the arena of its largest member's plan after that member shrank or was
dropped; a Stream's state read or a chunk fed from two threads could tear."""

from __future__ import annotations

import threading

import numpy as np
import pytest
from threadpoolctl import threadpool_info, threadpool_limits

from leanrnn import config, threads

onnx = pytest.importorskip("onnx")


def _blas_threads() -> set[int]:
    """Threads of the BLAS libraries leanrnn limits (its controller's: a library loaded after
    it was made, torch's own, is torch's to set)."""
    mine = {d["filepath"] for d in threads.blas_controller().info()}
    return {d["num_threads"] for d in threadpool_info()
            if d["user_api"] == "blas" and d["filepath"] in mine}  # fmt: skip


def _lstm_then_matmul(path, H=8):
    """An ONNX graph with an LSTM and a MatMul: its runs keep BLAS on one thread."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("LSTM", ["x", "W", "R"], ["Y"], hidden_size=H),
        helper.make_node("Squeeze", ["Y", "ax"], ["s"]),
        helper.make_node("MatMul", ["s", "M"], ["out"]),
    ]
    inits = [
        numpy_helper.from_array(rng.uniform(-0.5, 0.5, (1, 4 * H, H)).astype(np.float32), "W"),
        numpy_helper.from_array(rng.uniform(-0.5, 0.5, (1, 4 * H, H)).astype(np.float32), "R"),
        numpy_helper.from_array(np.array([1], np.int64), "ax"),
        numpy_helper.from_array(rng.standard_normal((H, 3)).astype(np.float32), "M"),
    ]
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "N", H])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None)], inits,
    )  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    m.ir_version = 8
    onnx.save(m, path)


def test_two_graph_runs_at_once_leave_blas_as_they_found_it(tmp_path):
    # Before, about one round in two ended with BLAS at one thread: A in (saves 2, sets 1), B in
    # (saves 1), A out (2), B out (1). (How OpenBLAS answers a thread's limit depends on which
    # thread set it, so the test runs the real race rather than forcing one order.)
    import leanrnn

    _lstm_then_matmul(tmp_path / "g.onnx")
    models = [leanrnn.load(tmp_path / "g.onnx", threads=2) for _ in range(2)]  # BLAS kept at 1
    x = np.random.default_rng(0).standard_normal((20, 4, 8)).astype(np.float32)
    was = config.get_num_threads()
    leanrnn.set_num_threads(2)  # (and BLAS to 2)
    for m in models:
        m(x)
    try:
        if _blas_threads() != {2}:
            pytest.skip("BLAS runs one thread here whatever is asked")
        for _ in range(5):
            ts = [threading.Thread(target=lambda m=m: [m(x) for _ in range(300)]) for m in models]
            for t in ts:
                t.start()
            for t in ts:
                t.join(60)
            assert _blas_threads() == {2}
    finally:
        leanrnn.set_num_threads(was)


def test_blas_alone_counts_its_threads_and_keeps_a_limit_asked_meanwhile():
    if not _blas_threads():
        pytest.skip("numpy has no BLAS threadpoolctl can limit here")
    with threadpool_limits(limits=2, user_api="blas"):
        outer = threads.blas_alone()
        outer.__enter__()
        with threads.blas_alone():
            assert _blas_threads() == {1}
        assert _blas_threads() == {1}  # the outer one is still in
        threads.limit_blas(2)  # set_num_threads(2) meanwhile: applied when the last leaves
        assert _blas_threads() == {1}
        outer.__exit__(None, None, None)
        assert _blas_threads() == {2}


def test_a_pool_lets_the_arena_of_a_dropped_member_go():
    # before: a big member's arena stayed with the pool after it was dropped, for good
    import gc

    import leanrnn
    from leanrnn import Pool

    pool = Pool()
    small = leanrnn.LSTM(4, 8, seed=0)
    small.session.pool = pool
    x = np.ones((3, 1, 4), np.float32)
    want = small(x)[0]
    alone = pool.nbytes
    big = leanrnn.GRU(64, 256, bidirectional=True, seed=0)
    big.session.pool = pool
    big(np.ones((50, 8, 64), np.float32))
    grown = pool.nbytes
    assert grown > 100 * alone
    small(x)  # a smaller plan does not shrink it (a session's own arena does not either)
    assert pool.nbytes == grown
    del big
    gc.collect()
    np.testing.assert_array_equal(small(x)[0], want)
    assert pool.nbytes == alone


def test_a_streams_state_read_waits_for_a_feed_in_progress():
    # before: read while another thread fed, the state could be half one step's (h of some
    # layers advanced, c of all), a state no sequence of feeds makes
    import leanrnn

    m = leanrnn.LSTM(4, 8, num_layers=2, seed=0)
    st = m.session.stream(batch=1)
    x = np.ones((1, 4), np.float32)
    st.feed(x)  # binds the single step
    in_step, go = threading.Event(), threading.Event()
    real = m.session._step

    def slow_step(*a):
        in_step.set()
        assert go.wait(30)
        return real(*a)

    m.session._step = slow_step
    feeder = threading.Thread(target=st.feed, args=(x,))
    feeder.start()
    assert in_step.wait(30)
    got: list = []
    reader = threading.Thread(target=lambda: got.append(st.state))
    reader.start()
    reader.join(0.3)
    try:
        assert reader.is_alive() and not got  # it waits for the feed
    finally:
        go.set()
        feeder.join(30)
        reader.join(30)
    del m.session._step
    ref = leanrnn.LSTM(4, 8, num_layers=2, seed=0).session.stream(batch=1)
    ref.feed(x)
    ref.feed(x)
    np.testing.assert_array_equal(got[0][0], ref.state[0])  # the state after both feeds
    np.testing.assert_array_equal(got[0][1], ref.state[1])


def test_a_streams_state_read_inside_its_own_feed_is_a_whole_feeds():
    # (review) a signal handler that interrupted a feed and read the state to checkpoint it
    # was refused as "run again while its run is in progress"; a change of the state there is
    # refused, saying why (the feed's end would overwrite it). The read here runs inside a
    # real feed, from the session's run that the feed calls.
    import leanrnn
    from leanrnn.errors import LeanRNNError

    m = leanrnn.GRU(3, 4, seed=0)
    st = m.session.stream(batch=1)
    st.feed(np.ones((2, 1, 3), np.float32))
    before = st.state
    seen, refused = [], []
    real = m.session._run

    def run_and_look(*a, **k):
        seen.append(st.state)  # on the feeding thread, the feed in progress
        for change in (st.reset, lambda: setattr(st, "state", before)):
            try:
                change()
            except LeanRNNError as e:
                refused.append(str(e))
        return real(*a, **k)

    m.session._run = run_and_look
    st.feed(np.ones((3, 1, 3), np.float32))
    del m.session._run
    np.testing.assert_array_equal(seen[0][0], before[0])
    assert not np.array_equal(st.state[0], before[0])
    assert len(refused) == 2 and all("feed is in progress on this thread" in r for r in refused)
    assert refused[0].startswith("[Stream.reset]") and refused[1].startswith("[Stream.state]")
