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
