"""Session 39, from a red-team pass on memory figures: `leanrnn score` on Parquet written with
pandas' or pyarrow's default row groups (one group up to 1Mi rows) went 2.6-24x past its memory
limit in silence, since pyarrow decodes a row group whole. The file cannot be read in less; the
run now says so, naming the fix."""

from __future__ import annotations

import logging

import numpy as np
import pytest

import leanrnn

pa = pytest.importorskip("pyarrow")
pq = pytest.importorskip("pyarrow.parquet")


def _write(path, n, T, row_group_size):
    rng = np.random.default_rng(0)
    x = [rng.standard_normal((T, 4)).astype(np.float32).tolist() for _ in range(n)]
    pq.write_table(pa.table({"x": x}), path, row_group_size=row_group_size)


@pytest.mark.parametrize("row_group_size, warned", [(4000, True), (16, False)])
def test_row_groups_past_the_memory_limit_are_named(tmp_path, caplog, row_group_size, warned):
    path = tmp_path / "d.parquet"
    _write(path, 4000, 20, row_group_size)
    with caplog.at_level(logging.WARNING, logger="leanrnn"):
        s = leanrnn.score(leanrnn.GRU(4, 8, seed=0), path, tmp_path / "out.npz",
                          memory_limit=int(2e6), progress=False)  # fmt: skip
    assert s.sequences == 4000
    said = [r.getMessage() for r in caplog.records if "row group" in r.getMessage()]
    assert bool(said) == warned, said
    if warned:
        assert "row_group_size" in said[0] and "d.parquet" in said[0]
