"""Session 41, from a red-team pass on resources over long runs: scoring a directory of
Parquet files opened every file at once and left them open after score() returned (until a
GC cycle): a directory of 1,100 files ran out of descriptors, as did the sixth score of 300."""

from __future__ import annotations

import gc
import os

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

import leanrnn  # noqa: E402


def _fds() -> int:
    return len(os.listdir("/proc/self/fd"))


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="counts /proc/self/fd (Linux)")
def test_scoring_parquet_files_keeps_no_file_open(tmp_path):
    rng = np.random.default_rng(0)
    d = tmp_path / "in"
    d.mkdir()
    xs = [rng.standard_normal((n, 8)).astype(np.float32) for n in (3, 1, 5) * 20]
    for i, x in enumerate(xs):
        pq.write_table(pa.table({"x": [x.tolist()], "length": [len(x)]}), d / f"p{i:03d}.parquet")
    m = leanrnn.LSTM(8, 16, seed=0)
    gc.disable()  # (a GC cycle closed them: the count must not depend on one)
    try:
        before = _fds()
        for k in range(3):
            leanrnn.score(m, str(d), str(tmp_path / f"out{k}.npz"))
            assert _fds() == before  # (60 more after each call)
    finally:
        gc.enable()
    with np.load(tmp_path / "out2.npz") as z:
        h_n = z["h_n"]  # final states, a row per input sequence in input order
    want = np.stack([m(x[:, None])[1][0][:, 0] for x in xs])  # h_n: [rows, L*D, H]
    np.testing.assert_allclose(h_n.reshape(want.shape), want, atol=1e-6, rtol=0)


def _batch(lengths, C=4, T=5):
    x = np.random.default_rng(1).standard_normal((len(lengths), T, C)).astype(np.float32)
    col = pa.array([s.tolist() for s in x], pa.list_(pa.list_(pa.float32(), C)))
    return x, col


@pytest.mark.parametrize(
    "lengths", [[5.0, 2.9, 4.0], [5.0, float("nan"), 4.0], [True, True, False]]
)
def test_a_predictor_refuses_a_length_column_that_is_not_integers(lengths):
    """A Ray batch reached the lengths unchecked: 2.9 ran as 2, NaN as 0 (a pandas integer
    column with one missing value is float64); the file readers refuse such a column."""
    from leanrnn.ray import Predictor
    from leanrnn.score.data import DTypeError

    _, col = _batch(lengths)
    p = Predictor(leanrnn.GRU(4, 8, seed=0))
    with pytest.raises(DTypeError, match="length column 'length' has type"):
        p(pa.table({"x": col, "length": pa.array(lengths)}))


def test_a_predictor_keeps_the_columns_it_is_asked_to():
    from leanrnn.ray import Predictor
    from leanrnn.score.data import DataError

    m = leanrnn.GRU(4, 8, seed=0)
    x, col = _batch([5, 2, 4])
    t = pa.table({"utt_id": ["a", "b", "c"], "x": col, "length": pa.array([5, 2, 4])})
    out = Predictor(m, keep=("utt_id",))(t)
    assert out.column("utt_id").to_pylist() == ["a", "b", "c"]
    h = np.stack([np.asarray(v, np.float32).reshape(-1) for v in out.column("h_n").to_pylist()])
    want = np.stack([m(x[i, :n][:, None])[1][0, 0] for i, n in enumerate([5, 2, 4])])
    np.testing.assert_allclose(h, want, atol=1e-6, rtol=0)
    with pytest.raises(DataError, match=r"no columns \['id'\] to keep"):
        Predictor(m, keep=("id",))(t)


def test_the_ray_job_bounds_an_actors_restarts_and_names_its_death(monkeypatch, tmp_path):
    """Ray Data's default (-1) restarted an actor that died on an item, and retried the item,
    for ever: the job neither ended nor said why (120 s, 24 deaths, in the red-team's run)."""
    ray = pytest.importorskip("ray")
    from leanrnn import ray as lray

    seen = {}

    class Job:  # what the job's dataset does, with no Ray started: its actor dies
        def map_batches(self, fn, **kw):
            seen.update(kw)  # the job's options
            return self

        def iter_batches(self, **kw):
            raise ray.exceptions.ActorDiedError()
            yield

    monkeypatch.setattr(ray.data, "from_items", lambda items, **kw: Job())
    monkeypatch.setattr(lray, "_init", lambda address: None)
    monkeypatch.setattr(ray, "cluster_resources", lambda: {"CPU": 2.0})
    src = tmp_path / "in.parquet"
    _, col = _batch([5, 2, 4])
    pq.write_table(pa.table({"x": col}), src)
    with pytest.raises(lray.DataError, match=r"an actor died \(restarted up to 2 times"):
        lray.score_on_ray(leanrnn.GRU(4, 8, seed=0), str(src), str(tmp_path / "o.parquet"))
    assert seen["max_restarts"] == seen["max_task_retries"] == lray.ACTOR_RETRIES == 2


@pytest.mark.parametrize("keep", [None, 5, "utt_id", ("a", "a"), ("h_n",)])
def test_a_predictor_checks_keep_when_made(keep):
    from leanrnn.errors import SpecError
    from leanrnn.ray import Predictor

    with pytest.raises(SpecError, match=r"\[Predictor\] keep"):
        Predictor(leanrnn.GRU(4, 8, seed=0), keep=keep)
