"""Session 37, from a red-team pass of ``leanrnn score``: a Parquet file of many short or empty
sequences made pieces of millions of rows (623 MiB under a 16 MiB memory limit: each row's
Python view and output states were not counted), a 128-byte .npy declaring 2**40 sequences of
T=0 steps ran forever, spooling states to disk, and negative .npy dimensions gave an empty
"complete" output or a bare ValueError. Each test failed before."""

from __future__ import annotations

import os
import tracemalloc

import numpy as np
import pytest

import leanrnn
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
    tracemalloc.start()
    try:
        s = leanrnn.score(MODEL, str(src), str(tmp_path / "o.npz"), memory_limit=16 << 20)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert s.sequences == N
    # before: every row's view and states in one piece, ~380 bytes a row (150 MB here)
    assert peak < 48 << 20, f"{peak / 2**20:.0f} MiB of Python allocations at a 16 MiB limit"
    h = np.load(tmp_path / "o.npz")["h_n"]
    assert h.shape == (N, 2, 16) and not h.any()
