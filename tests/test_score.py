"""leanrnn.score / `leanrnn score` (issue 12): every input format, skewed and uniform lengths,
length-0 and empty inputs, files larger than the memory limit, and bad input. The oracle is the
model run on each sequence alone (no batch, no padding)."""

import os
import subprocess
import sys

import numpy as np
import pytest

import leanrnn
from leanrnn import tuning
from leanrnn.errors import DTypeError, LeanRNNError, LengthsError, PlanError, ShapeError, SpecError
from tolerances import ATOL_SCORE

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")

C = 5


def _seqs(kind: str, n: int = 60, seed: int = 0, dtype=np.float32):
    rng = np.random.default_rng(seed)
    if kind == "skewed":  # log-normal, like utterance lengths, plus length-0 sequences
        lens = np.minimum(rng.lognormal(2.2, 0.8, n).astype(int), 120)
        lens[[3, 17]] = 0
    else:
        lens = np.full(n, 13)
    return [rng.standard_normal((int(t), C)).astype(dtype) for t in lens]


def _oracle(model, x):
    """(h_n [L*D, K], c_n or None, y [T, D*K]) of one sequence run alone."""
    s = model.spec
    LD, K, H = s.num_layers * s.num_directions, s.output_size, s.hidden_size
    if len(x) == 0:
        c = np.zeros((LD, H), model.dtype) if s.cell == "lstm" else None
        return np.zeros((LD, K), model.dtype), c, np.zeros((0, s.num_directions * K))
    y, st = model(x)
    h, c = st if s.cell == "lstm" else (st, None)
    return h, c, y


def _check(model, seqs, out_path):
    s = model.spec
    if out_path.endswith(".npz"):
        z = np.load(out_path)
        lengths, h, y = z["length"], z.get("h_n"), z.get("y")
        c = z.get("c_n")
        ys = None if y is None else [y[i, :t] for i, t in enumerate(lengths)]
    else:
        t = pq.read_table(out_path)
        lengths = np.asarray(t["length"])
        cols = t.column_names
        h = np.array(t["h_n"].to_pylist(), model.dtype) if "h_n" in cols else None
        c = np.array(t["c_n"].to_pylist(), model.dtype) if "c_n" in cols else None
        ys = [np.array(v, model.dtype).reshape(-1, s.num_directions * s.output_size)
              for v in t["y"].to_pylist()] if "y" in cols else None  # fmt: skip
    assert list(lengths) == [len(x) for x in seqs]
    assert h is not None or ys is not None
    for i, x in enumerate(seqs):
        oh, oc, oy = _oracle(model, x)
        if h is not None:
            np.testing.assert_allclose(h[i], oh, rtol=0, atol=ATOL_SCORE[np.float32])
            if oc is not None:
                np.testing.assert_allclose(c[i], oc, rtol=0, atol=ATOL_SCORE[np.float32])
        if ys is not None:
            np.testing.assert_allclose(ys[i], oy, rtol=0, atol=ATOL_SCORE[np.float32])


# -------------------------------------------------------------------------- writing inputs
def write_parquet(path, seqs, kind="nested", row_group_size=16, pad=0, float_type=None):
    ft = float_type or pa.float32()
    if kind == "nested":
        col = pa.array([s.tolist() for s in seqs], pa.list_(pa.list_(ft)))
        pq.write_table(pa.table({"x": col}), path, row_group_size=row_group_size)
    elif kind == "fixed":
        col = pa.array([s.tolist() for s in seqs], pa.list_(pa.list_(ft, C)))
        pq.write_table(pa.table({"feats": col, "id": np.arange(len(seqs))}), path,
                       row_group_size=row_group_size)  # fmt: skip
    else:  # flat T*C values, padded by `pad` steps, with a length column
        rows = [np.concatenate([s, np.full((pad, C), 7.0, s.dtype)]).reshape(-1) for s in seqs]
        col = pa.array([r.tolist() for r in rows], pa.list_(ft))
        lens = pa.array([len(s) for s in seqs], pa.int32())
        pq.write_table(pa.table({"x": col, "length": lens}), path, row_group_size=row_group_size)
    return path


def padded(seqs, dtype=np.float32):
    T = max([len(s) for s in seqs] + [1])
    x = np.zeros((len(seqs), T, C), dtype)
    for i, s in enumerate(seqs):
        x[i, : len(s)] = s
    return x, np.array([len(s) for s in seqs], np.int64)


@pytest.fixture(scope="module")
def lstm():
    return leanrnn.LSTM(C, 12, num_layers=2, seed=3)


FORMATS = ["parquet-nested", "parquet-fixed", "parquet-flat", "npy", "npz", "npz-compressed",
           "directory"]  # fmt: skip


def make_input(tmp_path, fmt, seqs):
    if fmt == "parquet-nested":
        return write_parquet(str(tmp_path / "in.parquet"), seqs), {}
    if fmt == "parquet-fixed":
        return write_parquet(str(tmp_path / "in.parquet"), seqs, "fixed"), {"column": "feats"}
    if fmt == "parquet-flat":
        return write_parquet(str(tmp_path / "in.parquet"), seqs, "flat", pad=2), {}
    x, lens = padded(seqs)
    if fmt == "npy":
        np.save(tmp_path / "x.npy", x)
        np.save(tmp_path / "l.npy", lens)
        return str(tmp_path / "x.npy"), {"lengths": str(tmp_path / "l.npy")}
    if fmt == "npz":
        np.savez(tmp_path / "in.npz", x=x, lengths=lens)
        return str(tmp_path / "in.npz"), {}
    if fmt == "npz-compressed":
        np.savez_compressed(tmp_path / "in.npz", x=x, lengths=lens)
        return str(tmp_path / "in.npz"), {}
    d = tmp_path / "data"  # directory: files in name order, mixed kinds
    d.mkdir()
    k = len(seqs) // 3
    write_parquet(str(d / "a.parquet"), seqs[:k])
    x1, l1 = padded(seqs[k : 2 * k])
    np.savez(d / "b.npz", x=x1, lengths=l1)
    write_parquet(str(d / "c.parquet"), seqs[2 * k :], "flat")
    (d / "_SUCCESS").write_text("")  # marker files are skipped
    return str(d), {}


# ------------------------------------------------------------------------------ correctness
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("lengths", ["skewed", "uniform"])
def test_every_format_matches_the_model_run_per_sequence(tmp_path, lstm, fmt, lengths):
    seqs = _seqs(lengths)
    src, kw = make_input(tmp_path, fmt, seqs)
    out = str(tmp_path / "out.parquet")
    s = leanrnn.score(lstm, src, out, outputs="both", **kw)
    assert s.sequences == len(seqs) and s.steps == sum(len(x) for x in seqs)
    _check(lstm, seqs, out)


@pytest.mark.parametrize("outputs", ["final", "steps", "both"])
def test_npz_output_and_output_choice(tmp_path, lstm, outputs):
    seqs = _seqs("skewed", 40)
    src = write_parquet(str(tmp_path / "in.parquet"), seqs)
    out = str(tmp_path / "out.npz")
    leanrnn.score(lstm, src, out, outputs=outputs)
    z = np.load(out)
    want = {"final": {"length", "h_n", "c_n"}, "steps": {"length", "y"},
            "both": {"length", "h_n", "c_n", "y"}}[outputs]  # fmt: skip
    assert set(z.files) == want
    _check(lstm, seqs, out)


@pytest.mark.parametrize(
    "make",
    [
        lambda: leanrnn.GRU(C, 9, bidirectional=True, seed=1),
        lambda: leanrnn.RNN(C, 7, num_layers=2, nonlinearity="relu", seed=2),
        lambda: leanrnn.LSTM(C, 10, proj_size=4, batch_first=True, seed=4),
        lambda: leanrnn.GRU(C, 8, dtype=np.float64, seed=5),
    ],
    ids=["gru-bidir", "rnn-relu", "lstm-proj-batch-first", "gru-float64"],
)
def test_other_cells_directions_and_layouts(tmp_path, make):
    m = make()
    seqs = _seqs("skewed", 30, dtype=m.dtype)
    src = write_parquet(str(tmp_path / "in.parquet"), seqs, float_type=pa.float64())
    out = str(tmp_path / "out.parquet")
    leanrnn.score(m, src, out, outputs="both")
    _check(m, seqs, out)


def test_files_larger_than_the_memory_limit_stream_in_windows(tmp_path, lstm):
    """3 MiB of input with a 1 MiB limit: read, scored and written in several windows (each
    window is one write: several row groups in the output), outputs still exact."""
    seqs = _seqs("skewed", 1500, seed=7)
    x, lens = padded(seqs)
    assert x.nbytes > 2 * tuning.MIN_MEMORY_LIMIT
    np.savez(tmp_path / "in.npz", x=x, lengths=lens)
    out = str(tmp_path / "out.parquet")
    s = leanrnn.score(lstm, str(tmp_path / "in.npz"), out, memory_limit=tuning.MIN_MEMORY_LIMIT)
    assert pq.ParquetFile(out).metadata.num_row_groups >= 3
    assert s.memory_limit == tuning.MIN_MEMORY_LIMIT
    t = pq.read_table(out)
    h = np.array(t["h_n"].to_pylist(), np.float32)
    for i in range(0, len(seqs), 37):
        oh, _, _ = _oracle(lstm, seqs[i])
        np.testing.assert_allclose(h[i], oh, rtol=0, atol=ATOL_SCORE[np.float32])


def test_only_length_zero_and_empty_inputs(tmp_path, lstm):
    zero = [np.zeros((0, C), np.float32)] * 4
    src = write_parquet(str(tmp_path / "zero.parquet"), zero)
    out = str(tmp_path / "zero_out.parquet")
    s = leanrnn.score(lstm, src, out, outputs="both")
    assert s.sequences == 4 and s.steps == 0
    _check(lstm, zero, out)
    np.savez(tmp_path / "empty.npz", x=np.zeros((0, 3, C), np.float32))
    for name in ("e.parquet", "e.npz"):
        out = str(tmp_path / name)
        s = leanrnn.score(lstm, str(tmp_path / "empty.npz"), out, outputs="both")
        assert s.sequences == 0
        n = len(np.load(out)["length"]) if name.endswith("npz") else pq.read_table(out).num_rows
        assert n == 0


def test_bucketing_cuts_padding_and_keeps_outputs(tmp_path, lstm):
    seqs = _seqs("skewed", 300, seed=9)
    src = write_parquet(str(tmp_path / "in.parquet"), seqs, row_group_size=300)
    a = leanrnn.score(lstm, src, str(tmp_path / "a.parquet"), batch_size=24)
    b = leanrnn.score(lstm, src, str(tmp_path / "b.parquet"), batch_size=24, bucket=False)
    assert a.padding < b.padding / 3
    assert b.padding == pytest.approx(b.padding_in_order)
    ha = np.array(pq.read_table(tmp_path / "a.parquet")["h_n"].to_pylist())
    hb = np.array(pq.read_table(tmp_path / "b.parquet")["h_n"].to_pylist())
    np.testing.assert_allclose(ha, hb, rtol=0, atol=ATOL_SCORE[np.float32])


# ------------------------------------------------------------------------------- tuning
def test_tuning_respects_the_memory_limit(lstm):
    from leanrnn.memory.planner import plan

    s = leanrnn.Session(lstm.weights)
    hw = tuning.Hardware(cores=2, l1d=32 << 10, l2=512 << 10, l3=32 << 20, available=8 << 30)
    t = tuning.choose(s, memory_limit=2 << 20, per_step=True, hw=hw)
    assert 1 <= t.batch <= tuning.MAX_BATCH and t.chunk >= 1
    arena = plan(s.buffers(t.batch, t.chunk, False, False)).total
    assert arena <= (2 << 20) * tuning.ARENA_SHARE
    for T in (1, 100, 10_000, 10**7):
        n = t.batch_for(T)
        assert n >= 1 and (n == 1 or n * T * t.step_bytes <= t.batch_bytes)
    assert t.batch_for(10**7) == 1 < t.batch_for(1)
    with pytest.raises(PlanError, match="memory_limit"):
        tuning.choose(s, memory_limit=1000, hw=hw)
    # A bidirectional stack cannot be chunked: its whole-sequence scratch counts per step.
    bi = leanrnn.Session(leanrnn.LSTM(C, 12, bidirectional=True, seed=0).weights)
    tb = tuning.choose(bi, memory_limit=2 << 20, per_step=True, hw=hw)
    assert tb.chunk is None and tb.step_bytes > t.step_bytes


def test_tuning_reads_this_machine():
    hw = tuning.hardware()
    assert hw.cores >= 1 and hw.l2 >= 64 << 10 and hw.l3 >= hw.l2
    assert tuning.MIN_MEMORY_LIMIT <= tuning.default_memory_limit(hw) <= 256 << 20


# ---------------------------------------------------------------------------- bad input
def _no_leftovers(d, out):
    assert not os.path.exists(out)
    left = [n for n in os.listdir(d) if n.startswith(".")]
    assert not left, left


BAD = {
    "missing column": (
        lambda d: write_parquet(str(d / "in.parquet"), _seqs("uniform", 5)),
        {"column": "nope"}, LeanRNNError, ["in.parquet", "'nope'", "columns are ['x']"],
    ),
    "missing length column": (
        lambda d: write_parquet(str(d / "in.parquet"), _seqs("uniform", 5)),
        {"length_column": "len"}, LeanRNNError, ["in.parquet", "'len'"],
    ),
    "ragged features": (
        lambda d: pq.write_table(pa.table({"x": pa.array(
            [[[1.0] * C] * 3, [[1.0] * C, [1.0] * (C - 1)]], pa.list_(pa.list_(pa.float32())))}),
            str(d / "in.parquet")) or str(d / "in.parquet"),
        {}, ShapeError, ["in.parquet", "row group 0", "'x'", "row 1", "ragged"],
    ),
    "NaN": (
        lambda d: write_parquet(str(d / "in.parquet"),
                                [*_seqs("uniform", 20)[:19], np.full((4, C), np.nan, np.float32)],
                                row_group_size=8),
        {}, LeanRNNError, ["in.parquet", "row group 2", "'x'", "row 3", "NaN"],
    ),
    "integer features": (
        lambda d: pq.write_table(pa.table({"x": pa.array([[[1] * C] * 2], pa.list_(pa.list_(
            pa.int64())))}), str(d / "in.parquet")) or str(d / "in.parquet"),
        {}, DTypeError, ["in.parquet", "'x'", "int64", "float"],
    ),
    "string column": (
        lambda d: pq.write_table(pa.table({"x": ["a", "b"]}), str(d / "in.parquet"))
        or str(d / "in.parquet"),
        {"column": "x"}, DTypeError, ["in.parquet", "'x'", "string"],
    ),
    "length longer than data": (
        lambda d: pq.write_table(pa.table({"x": pa.array([[[1.0] * C] * 2]), "length": [5]}),
                                 str(d / "in.parquet")) or str(d / "in.parquet"),
        {}, LengthsError, ["in.parquet", "row group 0", "'length'", "row 0", "length 5"],
    ),
    "wrong feature size": (
        lambda d: np.save(d / "x.npy", np.zeros((2, 3, C + 1), np.float32)) or str(d / "x.npy"),
        {}, ShapeError, ["x.npy", "C=5"],
    ),
    "unreadable parquet": (
        lambda d: ((d / "in.parquet").write_bytes(b"PAR1 not really"), str(d / "in.parquet"))[1],
        {}, LeanRNNError, ["in.parquet", "not a readable Parquet"],
    ),
    "truncated npy": (
        lambda d: ((d / "x.npy").write_bytes(_npy_bytes()[:-40]), str(d / "x.npy"))[1],
        {}, LeanRNNError, ["x.npy", "truncated"],
    ),
    "lengths out of range": (
        lambda d: np.savez(d / "in.npz", x=np.zeros((2, 3, C), np.float32), lengths=[1, 4])
        or str(d / "in.npz"),
        {}, LengthsError, ["in.npz", "row 1", "length 4"],
    ),
}  # fmt: skip


def _npy_bytes():
    import io

    b = io.BytesIO()
    np.save(b, np.ones((4, 3, C), np.float32))
    return b.getvalue()


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_input_names_file_and_leaves_no_output(tmp_path, lstm, case):
    make, kw, cls, words = BAD[case]
    d = tmp_path / "in"
    d.mkdir()
    src = make(d)
    for out in (str(tmp_path / "out.parquet"), str(tmp_path / "out.npz")):
        with pytest.raises(cls) as e:
            leanrnn.score(lstm, src, out, **kw)
        for w in words:
            assert w in str(e.value), (w, str(e.value))
        _no_leftovers(tmp_path, out)
    # the model still works afterwards
    ok = write_parquet(str(tmp_path / "ok.parquet"), _seqs("uniform", 3))
    leanrnn.score(lstm, ok, str(tmp_path / "ok_out.parquet"))


@pytest.mark.parametrize("piece_bytes", [1, 300, 1 << 20])
def test_parquet_row_ranges_read_exactly_those_rows(tmp_path, piece_bytes):
    """Source.range_pieces (what a Ray actor reads): ranges starting and ending inside pieces
    and row groups give those rows, in order; errors count rows within the row group, as a
    whole read does."""
    from leanrnn.score.data import Source

    seqs = _seqs("skewed", 50, seed=9)
    path = write_parquet(str(tmp_path / "in.parquet"), seqs, row_group_size=20)
    src = Source(path, C, np.float32)
    ranges = [[0, 3, 17], [1, 0, 20], [2, 9, 10], [2, 10, 99]]
    got = [s for p in src.range_pieces(piece_bytes, ranges) for s in p.seqs]
    want = seqs[3:17] + seqs[20:40] + seqs[49:50]
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        np.testing.assert_array_equal(a, b)
    firsts = [p.first_row for p in src.range_pieces(piece_bytes, [[1, 5, 20]])]
    assert firsts[0] == 5 and firsts == sorted(firsts)
    seqs[27] = np.full((3, C), np.nan, np.float32)  # row group 1, row 7
    bad = write_parquet(str(tmp_path / "bad.parquet"), seqs, row_group_size=20)
    src = Source(bad, C, np.float32)
    with pytest.raises(LeanRNNError, match="row group 1, column 'x', row 7, step 0: NaN"):
        list(src.range_pieces(piece_bytes, [[1, 5, 20]]))
    assert sum(len(p.seqs) for p in src.range_pieces(piece_bytes, [[1, 8, 20]])) == 12


def test_error_mid_file_removes_the_partial_output(tmp_path, lstm):
    """A bad row after many good windows: the writer had already written row groups."""
    seqs = _seqs("uniform", 400, seed=2)
    seqs[-1] = np.full((13, C), np.inf, np.float32)
    src = write_parquet(str(tmp_path / "in.parquet"), seqs, row_group_size=50)
    out = str(tmp_path / "out.parquet")
    with pytest.raises(LeanRNNError, match="row group 7"):
        leanrnn.score(lstm, src, out, memory_limit=tuning.MIN_MEMORY_LIMIT)
    _no_leftovers(tmp_path, out)
    s = leanrnn.score(lstm, src, out, allow_nonfinite=True)
    assert s.sequences == 400
    h = np.array(pq.read_table(out)["h_n"].to_pylist())
    assert np.isfinite(h[:-1]).all() and not np.isfinite(h[-1]).all()


def test_graph_model_and_bad_options_are_refused_clearly(tmp_path, lstm):
    src = write_parquet(str(tmp_path / "in.parquet"), _seqs("uniform", 3))
    from leanrnn import GraphModel

    g = GraphModel.__new__(GraphModel)
    with pytest.raises(SpecError, match="GraphModel"):
        leanrnn.score(g, src, str(tmp_path / "o.parquet"))
    with pytest.raises(SpecError, match="outputs="):
        leanrnn.score(lstm, src, str(tmp_path / "o.parquet"), outputs="all")
    with pytest.raises(LeanRNNError, match=r"\.parquet or \.npz"):
        leanrnn.score(lstm, src, str(tmp_path / "o.csv"))
    with pytest.raises(LeanRNNError, match="does not exist"):
        leanrnn.score(lstm, str(tmp_path / "missing.parquet"), str(tmp_path / "o.parquet"))


# ---------------------------------------------------------------------------------- CLI
def test_cli_scores_and_reports(tmp_path, lstm):
    model = leanrnn.save(lstm, str(tmp_path / "m.lrnn"))
    seqs = _seqs("skewed", 50)
    src = write_parquet(str(tmp_path / "in.parquet"), seqs)
    out = str(tmp_path / "out.npz")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    r = subprocess.run(
        [sys.executable, "-m", "leanrnn", "score", model, src, out, "--outputs", "both",
         "--memory-limit", "64M"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr
    for w in ("sequences/s", "padding", "peak memory", "50/50 sequences"):
        assert w in r.stdout + r.stderr, w
    _check(lstm, seqs, out)
    r = subprocess.run(
        [sys.executable, "-m", "leanrnn", "score", model, src, str(tmp_path / "x.parquet"),
         "--column", "nope", "--quiet"],
        capture_output=True, text=True, env=env,
    )  # fmt: skip
    assert r.returncode == 1 and "in.parquet" in r.stderr and "'nope'" in r.stderr
    assert not os.path.exists(tmp_path / "x.parquet")


def test_sorted_batches_cut_wide_length_ranges(lstm):
    """A log-normal window sorted and cut into batches of 126: the last batches would span
    lengths from ~100 to ~1000 (60% padding); they are cut where padding passes MAX_PADDING."""
    from leanrnn.score.batching import MAX_PADDING, Scorer

    lengths = np.random.default_rng(0).lognormal(3.7, 0.8, 2000).astype(np.int64) + 1
    sc = Scorer(lstm, batch_size=126)
    batches = sc.batches(lengths)
    assert sorted(np.concatenate(batches).tolist()) == list(range(len(lengths)))
    for b in batches:
        lens = lengths[b]
        assert 1 - lens.sum() / (len(b) * lens.max()) <= MAX_PADDING
    assert max(len(b) for b in batches) == 126


@pytest.mark.parametrize("form", ["npz", "npy+lengths", "parquet-flat", "parquet-nested"])
def test_a_nan_is_named_by_its_row_and_step(form, tmp_path, lstm):
    """With per-row lengths the check ran a row at a time and reported the step as a row: a
    NaN at row 1, step 4 of a 4-row file was "row 5" (a red team's finding, session 34)."""
    seqs = [np.ones((L, C), np.float32) for L in (6, 5, 6, 6)]
    seqs[1][4, 2] = np.nan
    x, lens = padded(seqs)
    if form == "npz":
        np.savez(tmp_path / "in.npz", x=x, lengths=lens)
        src, kw = str(tmp_path / "in.npz"), {}
    elif form == "npy+lengths":
        np.save(tmp_path / "x.npy", x)
        np.save(tmp_path / "l.npy", lens)
        src, kw = str(tmp_path / "x.npy"), {"lengths": str(tmp_path / "l.npy")}
    else:
        src = write_parquet(str(tmp_path / "in.parquet"), seqs, form.split("-")[1], pad=1)
        kw = {}
    with pytest.raises(LeanRNNError, match=r"row 1, step 4: NaN or Inf"):
        leanrnn.score(lstm, src, str(tmp_path / "out.npz"), **kw)
    x[1, 4, 2] = 0.0  # without lengths the padded rows are checked whole: the same words
    x[2, 5, 0] = np.inf
    np.save(tmp_path / "whole.npy", x)
    with pytest.raises(LeanRNNError, match=r"row 2, step 5: NaN or Inf"):
        leanrnn.score(lstm, str(tmp_path / "whole.npy"), str(tmp_path / "out.npz"))


def test_an_output_that_is_a_directory_or_a_device_is_refused_before_any_work(tmp_path, lstm,
                                                                               monkeypatch):  # fmt: skip
    """Before: a directory failed at the final rename with IsADirectoryError, after all the
    scoring; a device such as /dev/null would have been replaced by a regular file."""
    from leanrnn.score import data

    x, lens = padded([np.ones((3, C), np.float32)] * 2)
    np.savez(tmp_path / "in.npz", x=x, lengths=lens)
    (tmp_path / "out.parquet").mkdir()
    read = []
    monkeypatch.setattr(data, "check_values", lambda *a, **k: read.append(1))
    os.mkfifo(tmp_path / "fifo.npz")  # (not /dev/null: the old code, as root, replaced it)
    for out, words in ((tmp_path / "out.parquet", "is a directory"),
                       (tmp_path / "fifo.npz", "not a regular file")):  # fmt: skip
        with pytest.raises(LeanRNNError, match=words):
            leanrnn.score(lstm, str(tmp_path / "in.npz"), str(out))
    assert read == [] and not os.path.isfile(tmp_path / "fifo.npz")


def test_a_uint64_length_past_int64_is_named_as_it_is(tmp_path, lstm):
    """2**64 - 1 was reported as "length -1" (cast to int64 before the check)."""
    x = np.ones((2, 3, C), np.float32)
    np.savez(tmp_path / "in.npz", x=x, lengths=np.array([2**64 - 1, 1], np.uint64))
    with pytest.raises(LengthsError, match="row 0: length 18446744073709551615; expected"):
        leanrnn.score(lstm, str(tmp_path / "in.npz"), str(tmp_path / "o.npz"))
    seqs = [np.ones((2, C), np.float32)] * 2
    path = write_parquet(str(tmp_path / "in.parquet"), seqs, "flat")
    t = pq.read_table(path)
    t = t.set_column(1, "length", pa.array([1, 2**64 - 1], pa.uint64()))
    pq.write_table(t, path)
    with pytest.raises(LengthsError, match="row 1: length 18446744073709551615 but"):
        leanrnn.score(lstm, path, str(tmp_path / "o.npz"))
    np.savez(tmp_path / "ok.npz", x=x, lengths=np.array([3, 1], np.uint64))  # still taken
    assert leanrnn.score(lstm, str(tmp_path / "ok.npz"), str(tmp_path / "o.npz")).sequences == 2
