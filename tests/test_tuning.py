"""leanrnn.tuning.tune (``leanrnn tune``, ``Session.resize(batch="auto")``, serve's default
batch): the choice meets the latency target and the memory limit on a machine model the test
controls (the measurement is injected: no timing is asserted), and an auto-sized session gives
the results of a fixed-batch one."""

from __future__ import annotations

import json

import numpy as np
import pytest

import leanrnn
from leanrnn import cli, tuning
from leanrnn.engine.session import Session
from leanrnn.errors import PlanError, ShapeError
from tolerances import ATOL_SAME_ARITHMETIC


class Machine:
    """A model of a machine: a call costs ``fixed`` plus ``per`` per stream-step, a little less
    per row as the batch grows (weights read once per step, as on a real core). Records the
    calls it was asked to time."""

    def __init__(self, fixed=50e-6, per=20e-6) -> None:
        self.fixed, self.per = fixed, per
        self.asked: list[tuple[int, int]] = []

    def __call__(self, batch: int, chunk: int) -> float:
        self.asked.append((batch, chunk))
        return self.fixed + chunk * (100e-6 + self.per * batch)


def truth(machine: Machine, target: float, limit: int, session, most=256, chunk_most=16):
    """The answer by brute force over every candidate: largest batch at one step, then the
    largest power-of-two chunk at that batch."""

    def ok(b, c):
        return machine.fixed + c * (100e-6 + machine.per * b) <= target and (
            tuning.call_bytes(session, b, c) <= limit
        )

    batches = [b for b in tuning.batch_candidates(most) if ok(b, 1)]
    batch = max(batches, default=1)
    chunks = [1 << i for i in range(chunk_most.bit_length()) if ok(batch, 1 << i)]
    return batch, max(chunks, default=1)


@pytest.mark.parametrize("target_ms", [0.1, 0.5, 2.0, 10.0, 100.0])
def test_tune_picks_the_largest_batch_then_chunk_meeting_the_target(target_ms):
    m = leanrnn.LSTM(6, 16, num_layers=2, seed=0)
    machine = Machine()
    got = tuning.tune(m.session, latency=target_ms / 1e3, measure=machine)
    batch, chunk = truth(machine, target_ms / 1e3, got.memory_limit, m.session)
    assert (got.batch, got.chunk) == (batch, chunk)
    chosen = [p for p in got.points if (p.batch, p.chunk) == (got.batch, got.chunk)]
    if target_ms >= 0.5:  # batch 1 meets it: the choice is measured and within the target
        assert chosen and got.fits(chosen[0])
    assert len(machine.asked) <= 16  # a binary search, not a sweep: seconds on a real machine
    assert "chosen" in got.table()


def test_tune_respects_the_memory_limit_and_never_runs_what_does_not_fit():
    m = leanrnn.GRU(8, 64, seed=1)
    machine = Machine(per=1e-9)  # latency never binds: only memory does
    limit = tuning.call_bytes(m.session, 40, 1) + 1
    got = tuning.tune(m.session, latency=1.0, memory_limit=limit, measure=machine)
    assert got.batch == 40  # bucket candidates: 40 fits, 48 does not
    assert tuning.call_bytes(m.session, got.batch, got.chunk) <= limit
    assert all(tuning.call_bytes(m.session, b, c) <= limit for b, c in machine.asked)
    assert any(p.seconds == float("inf") for p in got.points)  # over the limit: not run


def test_tune_refuses_a_memory_limit_that_not_even_batch_1_fits():
    # It chose batch 1 (which holds more than the limit) and marked it "over", as for latency
    m = leanrnn.LSTM(4, 8, seed=2)
    need = tuning.call_bytes(m.session, 1, 1)
    machine = Machine()
    with pytest.raises(PlanError, match=f"memory_limit={need - 1} bytes.*at least {need}"):
        tuning.tune(m.session, latency=1.0, memory_limit=need - 1, measure=machine)
    assert machine.asked == []  # refused before timing anything
    assert tuning.tune(m.session, latency=1.0, memory_limit=need, measure=machine).batch == 1


def test_tune_with_nothing_meeting_the_target_still_serves_one_row():
    m = leanrnn.RNN(4, 8, seed=2)
    got = tuning.tune(m.session, latency=1e-6, measure=Machine())
    assert (got.batch, got.chunk) == (1, 1)
    assert "over" in got.table()


def test_tune_of_a_bidirectional_stack_measures_whole_sequences():
    m = leanrnn.LSTM(4, 8, bidirectional=True, seed=3)
    machine = Machine()
    got = tuning.tune(m.session, latency=2e-3, max_chunk=8, measure=machine)
    assert got.chunk is None
    assert {c for _, c in machine.asked} == {8}


def test_bad_targets_are_refused():
    m = leanrnn.GRU(4, 8, seed=4)
    with pytest.raises(PlanError, match="latency"):
        tuning.tune(m.session, latency=0, measure=Machine())
    with pytest.raises(ShapeError, match="'auto'"):
        Session(m.session.weights).resize("big", 10)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_resize_auto_gives_a_session_equal_to_a_fixed_batch_session(cell):
    cls = {"lstm": leanrnn.LSTM, "gru": leanrnn.GRU}[cell]
    m = cls(5, 12, num_layers=2, seed=5)
    s = Session(m.session.weights, threads=1)
    plan = s.resize("auto", 40, latency=1e-3, measure=Machine())
    batch, chunk = s.tuned.batch, s.tuned.chunk
    assert (batch, chunk) == truth(Machine(), 1e-3, s.tuned.memory_limit, s)
    assert plan.total == s.arena_bytes and s.chunk == chunk
    rng = np.random.default_rng(0)
    x = rng.standard_normal((40, batch, 5)).astype(np.float32)
    h0 = rng.standard_normal((2, batch, 12)).astype(np.float32)
    got = s.run(x, h0)
    want = Session(m.session.weights, threads=1).run(x, h0)  # fixed batch, default chunk
    for g, w in zip(got, want, strict=True):
        if w is not None:
            np.testing.assert_allclose(g, w, rtol=0, atol=ATOL_SAME_ARITHMETIC[np.float32])
    # the session stays usable at other batch sizes
    y, *_ = s.run(x[:, :1].copy(), h0[:, :1].copy())
    np.testing.assert_allclose(y, want[0][:, :1], rtol=0, atol=ATOL_SAME_ARITHMETIC[np.float32])


def test_the_real_timer_measures_a_tiny_model():
    """No timing asserted: the default measure runs real calls and returns a usable choice."""
    m = leanrnn.LSTM(3, 4, seed=6)
    got = tuning.tune(m.session, latency=1.0, max_batch=8, max_chunk=2, threads=1)
    assert (got.batch, got.chunk) == (8, 2)  # a 1 s target: everything fits
    assert all(0 < p.seconds < 1.0 for p in got.points)


def test_tune_command_prints_the_choice(capsys):
    assert cli.main(["tune", "gru:8", "--max-batch", "4", "--max-chunk", "2",
                     "--latency-ms", "1000", "--threads", "1", "--json"]) == 0  # fmt: skip
    out = json.loads(capsys.readouterr().out)
    assert (out["batch"], out["chunk"]) == (4, 2) and out["points"]
    assert cli.main(["tune", "gru:8", "--max-batch", "4", "--max-chunk", "2",
                     "--latency-ms", "1000", "--threads", "1"]) == 0  # fmt: skip
    text = capsys.readouterr().out
    assert "chosen" in text and "--max-batch 4 --max-chunk 2" in text


def test_serve_takes_the_tuned_batch_unless_told(monkeypatch):
    from leanrnn.serve.server import ServeConfig, build, tuned_batch

    machine = Machine()
    monkeypatch.setattr(tuning, "_Timer", lambda session, threads: machine)
    m = leanrnn.LSTM(3, 6, seed=7)
    cfg = ServeConfig(max_call=1e-3, max_streams=512, threads=1, max_chunk=2)
    want, _ = truth(machine, 1e-3, tuning.default_memory_limit(), m.session, chunk_most=1)
    assert tuned_batch("m", m, cfg) == want
    assert machine.asked and {c for _, c in machine.asked} == {1}
    core, sched, _ = build(cfg, {"m": m})
    assert sched.lanes["m"].max_batch == want
    cfg.max_batch = 3
    core, sched, _ = build(cfg, {"m": m})
    assert sched.lanes["m"].max_batch == 3


def test_a_huge_max_batch_costs_a_few_more_measurements_not_a_sweep():
    """Bounded time for any --max-batch: candidates grow with log(max_batch), and calls over
    the memory limit are never run."""
    m = leanrnn.GRU(4, 8, seed=8)
    machine = Machine()
    got = tuning.tune(m.session, latency=1e-3, max_batch=10**18, measure=machine)
    assert len(tuning.batch_candidates(10**18)) < 300
    assert len(machine.asked) < 16
    assert got.batch == truth(machine, 1e-3, got.memory_limit, m.session, most=10**6)[0]
