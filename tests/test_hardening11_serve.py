"""Session 37, from a red-team pass of leanrnn serve under concurrent load: a restart
(sequence_start on a live id) at --max-streams was refused for want of a second slot, and the
new sequence's next steps, accepted as the old one's, silently continued it. A restart now
reuses its sequence's slot: the old sequence's queued steps run first, then the new one's from
its own initial state. Each test failed before."""

from __future__ import annotations

import queue

import numpy as np
import pytest

import leanrnn
from leanrnn.engine.session import Pool
from leanrnn.serve.scheduler import Lane, Scheduler

C, H = 3, 6
LSTM = leanrnn.LSTM(C, H, num_layers=2, seed=11)


def _x(T: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((T, C)).astype(np.float32)


def _offline(x, h0=None, c0=None):
    hx = None if h0 is None else (h0[:, None], c0[:, None])
    return LSTM(x[:, None], hx)[0][:, 0]


def _run(max_streams: int, submits) -> list:
    """Queue ``submits`` [(key, start, end, x, h0, c0)] before the engine takes any, run them,
    and return their requests (each with y, or error)."""
    lane = Lane("m", LSTM, Pool(), threads=1, max_streams=max_streams, max_batch=4,
                max_chunk=4, idle_timeout=60.0)  # fmt: skip
    lane.warm_up()
    sched = Scheduler({"m": lane}, max_wait=0.001)
    done: queue.Queue = queue.Queue()
    with sched.cond:
        reqs = [sched.submit("m", key, start, end, x, h0, c0, on_done=done.put)
                for key, start, end, x, h0, c0 in submits]  # fmt: skip
    sched.start()
    try:
        for _ in reqs:
            done.get(timeout=60)
    finally:
        sched.stop()
    assert len(lane.free) == max_streams - len(lane.seqs)
    return reqs, lane


@pytest.mark.parametrize("ended_first", [False, True], ids=["live", "end-queued"])
def test_a_restart_at_the_stream_cap_runs_the_new_sequence_from_its_own_state(ended_first):
    rng = np.random.default_rng(0)
    old, new = _x(9, 1), _x(6, 2)
    h0 = rng.standard_normal((2, H)).astype(np.float32)
    c0 = rng.standard_normal((2, H)).astype(np.float32)
    other = _x(5, 3)
    key, busy = ("i", 1), ("i", 2)
    reqs, lane = _run(2, [
        (busy, True, False, other, None, None),  # the other slot: the cap is reached
        (key, True, False, old[:4], None, None),
        (key, False, ended_first, old[4:], None, None),
        (key, True, False, new[:2], h0, c0),  # a restart, at the cap, old steps queued
        (key, False, False, new[2:5], None, None),
        (key, False, True, new[5:], None, None),
    ])  # fmt: skip
    assert all(r.error is None for r in reqs), [r.error for r in reqs]
    np.testing.assert_allclose(reqs[0].y, _offline(other), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.concatenate([reqs[1].y, reqs[2].y]), _offline(old), rtol=0,
                               atol=1e-6)  # fmt: skip
    got_new = np.concatenate([r.y for r in reqs[3:]])
    np.testing.assert_allclose(got_new, _offline(new, h0, c0), rtol=0, atol=1e-6)
    assert key not in lane.seqs and busy in lane.seqs  # the restarted one ended: its slot freed


def test_a_restart_with_zero_state_and_state_snapshots_of_both_lives():
    old, new = _x(5, 4), _x(4, 5)
    key = ("s", "abc")
    reqs, _ = _run(1, [
        (key, True, False, old, None, None),
        (key, True, True, new, None, None),
    ])  # fmt: skip
    np.testing.assert_allclose(reqs[0].y, _offline(old), rtol=0, atol=1e-6)
    np.testing.assert_allclose(reqs[1].y, _offline(new), rtol=0, atol=1e-6)
