"""Session 44, from a red-team pass on the automatic choices: a bidirectional stack was timed
at 16 steps and its batch 'met' a 10 ms target its whole-sequence calls took 210 ms over;
score under a small memory limit cut the chunk to 1 step before it shrank the batch (2-6x
slower, and batches like 31 and 63 off the 6-row tile); and `tune` measured on all cores where
serve runs on all but one (batch 1 where serve chose 256 on a loaded machine)."""

from __future__ import annotations

import numpy as np

import leanrnn
from leanrnn import config
from leanrnn.tuning import MIN_CHUNK, choose, tune


def test_an_unchunkable_stack_is_timed_at_the_steps_its_calls_run():
    m = leanrnn.LSTM(4, 8, bidirectional=True, seed=0)
    timed = []

    def measure(batch, chunk):  # a model of the machine: 10 us a row-step
        timed.append(chunk)
        return 1e-5 * batch * chunk

    got = tune(m.session, latency=0.01, max_batch=256, plan_steps=1000, measure=measure)
    assert set(timed) == {1000}  # (16 before: max_chunk's)
    assert got.chunk is None and got.batch == 1 and got.meets_target  # 1 x 1000 x 10 us
    got = tune(m.session, latency=0.01, max_batch=256, plan_steps=100, measure=measure)
    assert got.batch == 10  # the largest whose 100-step call fits 10 ms


def test_a_tight_memory_limit_shrinks_the_batch_before_the_chunk_goes_below_its_floor():
    m = leanrnn.LSTM(32, 128, num_layers=2, seed=0)
    for limit in (1 << 20, 2 << 20, 4 << 20, 8 << 20):
        t = choose(m.session, memory_limit=limit)
        assert t.chunk >= MIN_CHUNK or t.batch == 1, (limit, t)  # (chunk 1 at batch 63)
        assert t.batch < 6 or t.batch % 6 == 0, (limit, t)  # (31: a lone row off the tile)


def test_tune_measures_with_serve_s_threads_and_says_them(capsys, monkeypatch):
    from leanrnn import cli

    seen = []
    real = tune

    def spy(session, **kw):
        seen.append(kw["threads"])
        return real(session, **kw)

    monkeypatch.setattr("leanrnn.tuning.tune", spy)
    assert cli.main(["tune", "lstm:8", "--max-batch", "2", "--max-chunk", "2"]) == 0
    assert seen == [config.serving_threads()]
    out = capsys.readouterr().out
    assert f"leanrnn serve --threads {config.serving_threads()} --max-batch" in out


def test_resize_auto_measures_once_per_question():
    """It measured anew on every call (~1.4 s at H=512, against 0.15 ms for an explicit
    resize); the same question now reuses the answer, another one measures."""
    m = leanrnn.LSTM(4, 8, seed=0)
    s = m.session
    calls = []

    def measure(batch, chunk):
        calls.append((batch, chunk))
        return 1e-5 * batch * chunk

    s.resize("auto", 16, latency=0.01, measure=measure)
    n = len(calls)
    assert n > 0
    s.resize("auto", 16, latency=0.01, measure=measure)
    assert len(calls) == n  # the same question: no measuring
    s.resize("auto", 16, latency=0.001, measure=measure)
    assert len(calls) > n  # another target: measured
    n = len(calls)
    s.tuned = None  # asked to measure again
    s.resize("auto", 16, latency=0.001, measure=measure)
    assert len(calls) > n
    x = np.random.default_rng(0).standard_normal((16, s.tuned.batch, 4)).astype(np.float32)
    np.testing.assert_array_equal(s.run(x)[0], leanrnn.LSTM(4, 8, seed=0)(x)[0])
