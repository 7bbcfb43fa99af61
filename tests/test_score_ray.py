"""`leanrnn score --ray` and leanrnn.ray.Predictor on a local 2-CPU Ray (issue 12): the same
outputs as the local path; actors load the native kernels instead of compiling with numba."""

import os

import numpy as np
import pytest

import leanrnn
from test_score import _check, _seqs, write_parquet
from tolerances import ATOL_SCORE

ray = pytest.importorskip("ray")
pytest.importorskip("ray.data")
pq = pytest.importorskip("pyarrow.parquet")


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the whole test session (starting one costs seconds)."""
    started = not ray.is_initialized()
    if started:
        # Workers import leanrnn from wherever the tests do.
        env = {"env_vars": {"PYTHONPATH": os.pathsep.join(p for p in os.sys.path if p)}}
        ray.init(num_cpus=2, log_to_driver=False, include_dashboard=False, runtime_env=env)
    yield ray
    if started:
        ray.shutdown()


@pytest.fixture(scope="module")
def model():
    return leanrnn.LSTM(5, 12, num_layers=2, seed=3)


def test_ray_path_equals_local_path(ray_local, model, tmp_path):
    """Two files of different layouts (each actor reads its row ranges with the local path's
    reader, so files need not share a schema); a row group cut into ranges, others whole."""
    seqs = _seqs("skewed", 300, seed=11)
    d = tmp_path / "data"
    d.mkdir()
    write_parquet(str(d / "a.parquet"), seqs[:150], row_group_size=150)  # one row group: cut
    write_parquet(str(d / "b.parquet"), seqs[150:], "flat", row_group_size=40, pad=2)
    local = str(tmp_path / "local.parquet")
    remote = str(tmp_path / "ray.parquet")
    leanrnn.score(model, str(d), local, outputs="both")
    s = leanrnn.score(model, str(d), remote, outputs="both", ray="auto", ray_actors=2)
    assert s.sequences == 300 and s.workers == 2
    a, b = pq.read_table(local), pq.read_table(remote)
    assert a.column_names == b.column_names and a.num_rows == b.num_rows
    assert np.asarray(a["length"]).tolist() == np.asarray(b["length"]).tolist()
    for c in ("h_n", "c_n"):
        np.testing.assert_allclose(np.array(a[c].to_pylist()), np.array(b[c].to_pylist()),
                                   rtol=0, atol=ATOL_SCORE[np.float32])  # fmt: skip
    _check(model, seqs, remote)
    assert not [n for n in os.listdir(tmp_path) if n.startswith(".")]


def test_predictor_actor_loads_native_kernels_once(ray_local, model, tmp_path):
    from leanrnn.ray import Predictor

    path = leanrnn.save(model, str(tmp_path / "m.lrnn"))
    actor = ray.remote(num_cpus=0.5)(Predictor).remote(path, outputs="final")
    info = ray.get(actor.kernel_info.remote())
    from leanrnn.kernels import runner

    if runner.backend().name == "native":  # the driver has native kernels: so must the actor
        assert info["backend"] == "native" and not info["numba_imported"], info
    import pyarrow as pa

    seqs = _seqs("skewed", 20, seed=5)
    table = pa.table({"x": pa.array([s.tolist() for s in seqs], pa.list_(pa.list_(pa.float32())))})
    out = ray.get(actor.__call__.remote(table))
    h = np.array(out["h_n"].to_pylist(), np.float32)
    for i, x in enumerate(seqs):
        if len(x):
            _, (oh, _) = model(x)
            np.testing.assert_allclose(h[i], oh, rtol=0, atol=ATOL_SCORE[np.float32])
    ray.kill(actor)


def test_ray_path_refuses_npz_and_bad_columns(ray_local, model, tmp_path):
    from leanrnn.errors import LeanRNNError

    np.savez(tmp_path / "in.npz", x=np.zeros((2, 3, 5), np.float32))
    with pytest.raises(LeanRNNError, match="Parquet only"):
        leanrnn.score(model, str(tmp_path / "in.npz"), str(tmp_path / "o.parquet"), ray="auto")
    src = write_parquet(str(tmp_path / "in.parquet"), _seqs("uniform", 4))
    with pytest.raises(LeanRNNError, match="'nope'"):
        leanrnn.score(model, src, str(tmp_path / "o.parquet"), ray="auto", column="nope")
    assert not os.path.exists(tmp_path / "o.parquet")
    # an .npz OUTPUT became a directory of Parquet files named out.npz (session 34's red team)
    with pytest.raises(LeanRNNError, match="writes Parquet"):
        leanrnn.score(model, src, str(tmp_path / "o.npz"), ray="auto")
    assert not os.path.exists(tmp_path / "o.npz")


def test_ray_path_bad_data_raises_leanrnn_error_and_leaves_nothing(ray_local, model, tmp_path):
    """An actor's DataError reaches the caller as itself (Ray's RayTaskError(DataError) is a
    DataError too, but its message is the worker's traceback), naming file, row group and row."""
    from leanrnn.score.data import DataError

    seqs = _seqs("uniform", 30)
    seqs[20] = np.full((4, 5), np.nan, np.float32)
    d = tmp_path / "data"
    d.mkdir()
    write_parquet(str(d / "a.parquet"), seqs)
    out = tmp_path / "o.parquet"
    with pytest.raises(DataError) as e:
        leanrnn.score(model, str(d), str(out), ray="auto", ray_actors=2)
    assert type(e.value) is DataError, type(e.value)
    msg = str(e.value)
    assert msg.startswith("[score] ") and "a.parquet', row group 1" in msg, msg
    assert "row 4, step 0: NaN" in msg, msg
    assert "\n" not in msg and "transient" not in msg, msg  # not Ray's retry advice
    assert not out.exists() and not [n for n in os.listdir(tmp_path) if n.startswith(".")]
    # a directory OUTPUT: the part files its write tasks had finished were left behind
    outdir = tmp_path / "outdir"
    with pytest.raises(DataError, match="row 4, step 0"):
        leanrnn.score(model, str(d), str(outdir), ray="auto", ray_actors=2)
    assert sorted(os.listdir(tmp_path)) == ["data"], os.listdir(tmp_path)
    # the next good job works: the failed jobs' actors gave their CPU slots back (held
    # through the raised error's context until a garbage collection, two failed jobs took
    # both of this Ray's CPUs and this job waited for a slot forever)
    ok = str(tmp_path / "ok.parquet")
    leanrnn.score(model, write_parquet(str(tmp_path / "in.parquet"), seqs[:20]), ok, ray="auto")
    _check(model, seqs[:20], ok)


def test_ray_path_checks_the_output_directory_before_starting(ray_local, model, tmp_path):
    """The driver writes a .parquet OUTPUT itself: a missing directory is refused as on the
    local path, before any actor starts (it surfaced as a bare FileNotFoundError)."""
    from leanrnn.score.data import DataError

    src = write_parquet(str(tmp_path / "in.parquet"), _seqs("uniform", 4))
    with pytest.raises(DataError, match="does not exist"):
        leanrnn.score(model, src, str(tmp_path / "nope" / "o.parquet"), ray="auto")


def test_ray_path_empty_input_and_directory_output(ray_local, model, tmp_path):
    """No rows: an empty file with the local path's columns (no actor starts). A directory
    OUTPUT: Ray's write tasks write it, in input order."""
    src = write_parquet(str(tmp_path / "empty.parquet"), [])
    out = str(tmp_path / "o.parquet")
    s = leanrnn.score(model, src, out, ray="auto")
    local = str(tmp_path / "local.parquet")
    leanrnn.score(model, src, local)
    assert s.sequences == 0 and pq.read_table(out).schema.equals(pq.read_table(local).schema)
    # (to a directory: one file of no rows with the columns; the directory was left empty)
    s = leanrnn.score(model, src, str(tmp_path / "emptydir"), ray="auto")
    got = pq.read_table(str(tmp_path / "emptydir"))
    assert got.num_rows == 0 and got.schema.equals(pq.read_table(local).schema)
    seqs = _seqs("skewed", 90, seed=4)
    src = write_parquet(str(tmp_path / "in.parquet"), seqs, row_group_size=10)
    d = str(tmp_path / "outdir")
    s = leanrnn.score(model, src, d, ray="auto", ray_actors=2)
    assert s.steps == sum(len(x) for x in seqs)
    files = sorted(os.listdir(d))
    t = pq.read_table([os.path.join(d, f) for f in files if f.endswith(".parquet")])
    assert np.asarray(t["length"]).tolist() == [len(x) for x in seqs]
    # a directory that holds Parquet files already: refused (a second run doubled the rows)
    from leanrnn.ray import score_on_ray
    from leanrnn.score.data import DataError

    for run in (lambda: leanrnn.score(model, src, d, ray="auto", ray_actors=2),
                lambda: score_on_ray(model, src, d)):  # (called directly too)  # fmt: skip
        with pytest.raises(DataError, match="already holds Parquet files"):
            run()
    assert sorted(os.listdir(d)) == files
    # an existing directory without: the job's files move in beside what is there
    d2 = tmp_path / "outdir2"
    d2.mkdir()
    (d2 / "README").write_text("kept")
    leanrnn.score(model, src, str(d2), ray="auto", ray_actors=2)
    names = sorted(os.listdir(d2))
    t = pq.read_table([str(d2 / n) for n in names if n.endswith(".parquet")])
    assert "README" in names and not [n for n in names if n.startswith(".")]
    assert np.asarray(t["length"]).tolist() == [len(x) for x in seqs]
    assert sorted(os.listdir(tmp_path)) == sorted(["empty.parquet", "o.parquet", "local.parquet",
                                                   "in.parquet", "outdir", "outdir2",
                                                   "emptydir"])  # fmt: skip
    # a file where the directory should go: refused before the work (it was a raw OS error
    # after it)
    (tmp_path / "afile").write_text("x")
    with pytest.raises(DataError, match="is a file"):
        leanrnn.score(model, src, str(tmp_path / "afile"), ray="auto")


def test_ray_quieting_drops_only_records_of_leanrnn_errors():
    """Ray Data logged an actor's leanrnn error with the worker's traceback on the console;
    the caller gets the error itself. Other records pass."""
    import logging

    from leanrnn.ray import _OwnError
    from leanrnn.score.data import DataError

    def record(exc):
        try:
            raise exc
        except BaseException as e:
            return logging.LogRecord("ray.data", logging.ERROR, __file__, 1, "task failed", (),
                                     (type(e), e, e.__traceback__))  # fmt: skip

    outer = RuntimeError("a wrapper")
    outer.__cause__ = DataError("[score] 'a.parquet', row 1, step 0: NaN or Inf")
    f = _OwnError()
    assert not f.filter(record(outer)) and not f.filter(record(outer.__cause__))
    assert f.filter(record(ValueError("something else")))
    plain = logging.LogRecord("ray.data", logging.INFO, __file__, 1, "started", (), None)
    assert f.filter(plain)


def _covered(items):
    """(path, row group, row) of every row the items name, in item order."""
    return [(it["path"], g, r) for it in items for g, r0, r1 in it["ranges"] for r in range(r0, r1)]


def test_work_items_cover_every_row_once_in_order(tmp_path):
    """The driver's plan (no Ray needed): ITEMS_PER_ACTOR items of about equal bytes per
    actor, never across files, empty row groups left out, a row group larger than an item cut
    into row ranges (a file of one row group still feeds every actor)."""
    from leanrnn.ray import ITEMS_PER_ACTOR, _work
    from leanrnn.score.data import Source

    d = tmp_path / "data"
    d.mkdir()
    seqs = _seqs("uniform", 100)
    write_parquet(str(d / "a.parquet"), seqs[:60], row_group_size=4)  # 15 equal groups
    write_parquet(str(d / "b.parquet"), seqs[60:], row_group_size=10)  # 4 groups
    with pq.ParquetWriter(str(d / "c.parquet"), pq.read_schema(str(d / "a.parquet"))) as w:
        w.write_table(pq.read_table(str(d / "a.parquet")).slice(0, 0))  # one empty group
    src = Source(str(d), 5, np.float32)
    want = [(p, g, r) for p, g, rows, _ in src.row_groups() for r in range(rows)]
    assert len(want) == 100 and len(src.row_groups()) == 19
    for actors in (1, 2, 3, 10):
        items = _work(src, actors)
        assert _covered(items) == want
        assert all(it["ranges"] for it in items)
        assert len(items) <= ITEMS_PER_ACTOR * actors + 1  # + 1: the file boundary
    one = Source(str(d / "a.parquet"), 5, np.float32)
    for actors in (1, 2, 3):  # equal row groups: items differ by one group at most
        sizes = [len(it["ranges"]) for it in _work(one, actors)]
        assert len(sizes) == min(15, ITEMS_PER_ACTOR * actors), sizes
        assert max(sizes) - min(sizes) <= 1, sizes
    whole = write_parquet(str(tmp_path / "whole.parquet"), seqs, row_group_size=1000)
    src = Source(whole, 5, np.float32)
    for actors in (1, 2):  # one row group: cut into ITEMS_PER_ACTOR * actors row ranges
        items = _work(src, actors)
        assert _covered(items) == [(whole, 0, r) for r in range(100)]
        rows = [r1 - r0 for it in items for _, r0, r1 in it["ranges"]]
        assert len(items) == ITEMS_PER_ACTOR * actors and max(rows) - min(rows) <= 1, rows
