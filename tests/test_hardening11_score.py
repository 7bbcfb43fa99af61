"""Session 37, from a red-team pass of ``leanrnn score``: a Parquet file of many short or empty
sequences made pieces of millions of rows (623 MiB under a 16 MiB memory limit: each row's
Python view and output states were not counted), a 128-byte .npy declaring 2**40 sequences of
T=0 steps ran forever, spooling states to disk, and negative .npy dimensions gave an empty
"complete" output or a bare ValueError. Each test failed before."""

from __future__ import annotations

import os

import numpy as np
import pytest

import leanrnn
from helpers import traced_peak
from leanrnn.score.data import DataError

MODEL = leanrnn.LSTM(8, 16, num_layers=2, seed=3)


def _npy_header_only(path, shape) -> None:
    with open(path, "wb") as f:
        np.lib.format.write_array_header_1_0(
            f, {"descr": "<f4", "fortran_order": False, "shape": shape})  # fmt: skip


@pytest.mark.parametrize("shape", [(-1, 5, 8), (3, -1, 8), (2**40, 0, 8)], ids=str)
def test_npy_headers_that_no_data_backs_are_refused(shape, tmp_path):
    src, out = tmp_path / "x.npy", tmp_path / "o.npz"
    _npy_header_only(src, shape)
    with pytest.raises(DataError, match=r"negative dimension|sequences of T=0 steps"):
        leanrnn.score(MODEL, str(src), str(out), memory_limit=16 << 20)
    assert not out.exists() and os.listdir(tmp_path) == ["x.npy"]


def test_many_empty_sequences_stay_within_the_memory_limit(tmp_path):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    N = 400_000  # one row group of empty sequences: a few KB of Parquet
    steps = pa.FixedSizeListArray.from_arrays(pa.array(np.zeros(0, np.float32)), 8)
    col = pa.ListArray.from_arrays(pa.array(np.zeros(N + 1, np.int32)), steps)
    src = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"x": col}), str(src), row_group_size=N)
    with traced_peak() as mem:
        s = leanrnn.score(MODEL, str(src), str(tmp_path / "o.npz"), memory_limit=16 << 20)
    peak = mem.peak
    assert s.sequences == N
    # before: every row's view and states in one piece, ~380 bytes a row (150 MB here)
    assert peak < 48 << 20, f"{peak / 2**20:.0f} MiB of Python allocations at a 16 MiB limit"
    h = np.load(tmp_path / "o.npz")["h_n"]
    assert h.shape == (N, 2, 16) and not h.any()


def test_sigterm_cleans_up_as_ctrl_c_does(tmp_path):
    """SIGTERM (`timeout`, a scheduler's stop) killed `leanrnn score` without its cleanup: the
    hidden spool directory stayed beside OUTPUT (312 MB in the report, 43 GB in another)."""
    import signal
    import subprocess
    import sys
    import time

    from helpers import src_env

    model = tmp_path / "m.lrnn"
    leanrnn.LSTM(8, 64, num_layers=2, seed=1).save(str(model))
    n = 40_000
    np.savez(tmp_path / "x.npz", x=np.ones((n, 50, 8), np.float32), lengths=np.full(n, 50))
    out_dir = tmp_path / "out"
    out_dir.mkdir()
    cmd = [sys.executable, "-m", "leanrnn", "score", str(model), str(tmp_path / "x.npz"),
           str(out_dir / "o.npz"), "--outputs", "both", "--threads", "1", "--quiet"]  # fmt: skip
    proc = subprocess.Popen(cmd, env=src_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    t0 = time.monotonic()
    while not any(p.name.startswith(".leanrnn-score-") for p in out_dir.iterdir()):
        assert proc.poll() is None, "finished before the test could stop it"
        assert time.monotonic() - t0 < 60
        time.sleep(0.02)
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=60)
    assert proc.returncode == 128 + signal.SIGTERM
    assert list(out_dir.iterdir()) == []


def test_an_unreachable_ray_address_is_refused_at_once(tmp_path):
    pytest.importorskip("ray")
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    import time

    from leanrnn.errors import SpecError

    rows = [np.zeros((3, 8), np.float32).tolist()]
    pq.write_table(pa.table({"x": rows}), str(tmp_path / "in.parquet"))
    t0 = time.monotonic()
    with pytest.raises(SpecError, match=r"nothing answers at '127.0.0.1:1'"):
        leanrnn.score(MODEL, str(tmp_path / "in.parquet"), str(tmp_path / "o.parquet"),
                      ray="127.0.0.1:1")  # fmt: skip
    assert time.monotonic() - t0 < 30  # (Ray retried for ever)


def test_cli_main_in_process_gives_sigterm_back():
    import signal

    from leanrnn import cli

    before = signal.signal(signal.SIGTERM, signal.SIG_DFL)  # (Ray, in this worker, sets one)
    try:
        assert cli.main(["plan", "lstm:8", "--batch", "1", "--steps", "2"]) == 0
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
    finally:
        signal.signal(signal.SIGTERM, before)
