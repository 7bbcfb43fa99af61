"""Session 42, from a red-team pass over numpy-only training's memory planning: after a change of
step shape a trainer under ``memory_limit`` kept an arena that fitted the limit alone and held
1.4x it beside the new shape's other buffers; a used tape kept the shared arena alive beside the
next shape's; a change of ``threads`` left plans made for the old count in use. Each test
failed before."""

from __future__ import annotations

import numpy as np
import pytest

import leanrnn
from leanrnn.errors import PlanError
from leanrnn.train import TapeError, Trainer


def _held(tr: Trainer, N: int, T: int) -> int:
    """Bytes the trainer holds for a step of N x T: its arena and what the plan keeps beside it."""
    p = tr.plan(N, T)
    return (tr._arena.nbytes + p["checkpoint_bytes"] + p["dense_weight_bytes"]
            + p["layout_copy_bytes"])  # fmt: skip


def test_an_arena_kept_from_a_larger_step_is_held_to_the_limit_with_the_rest():
    m = leanrnn.LSTM(16, 16, num_layers=2, batch_first=True, seed=0)
    rng = np.random.default_rng(0)
    shapes = [(64, 10), (1, 1500)]  # the second spends most of the limit outside the arena
    probe = Trainer(m)
    limit = max(probe.plan(N, T)["total_bytes"] for N, T in shapes[:1]) + (64 << 10)
    tr = Trainer(m, memory_limit=limit)
    for N, T in shapes:
        x = rng.standard_normal((N, T, 16)).astype(np.float32)
        tape = tr.forward(x)
        tr.backward(tape, np.ones_like(tape.y), input_grad=False)
        assert tr.plan(N, T)["total_bytes"] <= limit
        assert _held(tr, N, T) <= limit  # was 1.4x the limit at the second shape
    fresh = Trainer(m, memory_limit=limit)
    tape = fresh.forward(x)
    fresh.backward(tape, np.ones_like(tape.y), input_grad=False)
    assert tr._arena.nbytes == fresh._arena.nbytes


def test_a_used_tape_lets_go_of_the_shared_arena():
    m = leanrnn.GRU(8, 8, seed=0)
    tr = Trainer(m)
    x = np.random.default_rng(1).standard_normal((5, 3, 8)).astype(np.float32)
    tape = tr.forward(x)
    first = tr._arena
    y = tape.y.copy()
    tr.backward(tape, np.ones_like(tape.y))
    assert "mem" not in tape._saved  # was: the arena, alive beside the next shape's
    np.testing.assert_array_equal(tape.y, y)  # what was read from it stays
    with pytest.raises(TapeError, match="backward already ran"):
        tr.backward(tape, np.ones_like(tape.y))
    tr.forward(np.zeros((50, 3, 8), np.float32))  # a larger shape: a new arena
    assert tr._arena is not first
    own = tr.forward(x, own_memory=True)
    tr.release(own)
    with pytest.raises(TapeError, match="was released"):
        tr.backward(own, np.ones_like(own.y))


def test_plans_follow_a_change_of_threads():
    m = leanrnn.LSTM(64, 64, num_layers=2, seed=0, dtype=np.float64)
    N, T = 8, 60
    tr = Trainer(m, threads=1)
    one = tr.plan(N, T)
    tr.threads = 2
    two = Trainer(m, threads=2).plan(N, T)
    assert two["arena_bytes"] != one["arena_bytes"]  # (else this test would see nothing)
    assert tr.plan(N, T)["arena_bytes"] == two["arena_bytes"]  # was: one's, kept
    # under a memory limit: the least memory for one thread is too little for two
    least = min(Trainer(m, threads=1)._need(N, T, S, True, False) for S in range(1, T))
    tr = Trainer(m, threads=1, memory_limit=least)
    tr.plan(N, T)
    tr.threads = 2
    with pytest.raises(PlanError, match="memory_limit"):
        Trainer(m, threads=2, memory_limit=least).plan(N, T)
    with pytest.raises(PlanError, match="memory_limit"):  # was: the one-thread plan, kept
        tr.plan(N, T)


def test_a_used_tape_of_an_earlier_shape_lets_go_of_its_arena():
    """Forward A, forward B of a larger shape (a new arena), backward A, backward B: tape A
    kept the earlier arena (the fix above looked at the trainer's current arena only)."""
    import gc
    import weakref

    tr = Trainer(leanrnn.GRU(8, 8, seed=0))
    a = tr.forward(np.ones((5, 3, 8), np.float32))
    first = weakref.ref(tr._arena)
    b = tr.forward(np.ones((50, 3, 8), np.float32))
    assert tr._arena is not first()
    tr.backward(a, np.ones_like(a.y))
    tr.backward(b, np.ones_like(b.y))
    gc.collect()
    assert first() is None


def test_backwards_dense_copies_follow_the_thread_count():
    """The dense copies of the weights backward multiplies by (their RT panels as wide as the
    thread count allows) were kept for the first thread count: after a change of threads the
    panels were the old width's, and the memory counted the new width's."""
    m = leanrnn.LSTM(64, 64, seed=0)
    tr = Trainer(m, threads=1)
    x = np.random.default_rng(0).standard_normal((4, 2, 64)).astype(np.float32)
    widths = []
    for threads in (1, 2, 1, 2):
        tr.threads = threads
        tape = tr.forward(x)
        tr.backward(tape, np.ones_like(tape.y))
        assert [k[1] for k in tr._dense] == [tr._dh_groups()]  # one width: this count's
        widths.append(tr._dh_groups())
    assert len(set(widths)) == 2  # (else this test would see nothing)
