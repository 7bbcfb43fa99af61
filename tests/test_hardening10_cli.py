"""Hardening, tenth pass: a new user's first hour with the README (a red team that followed it
from a fresh clone). Each test failed before its fix."""

from __future__ import annotations

import re
import sys
import time

import numpy as np
import pytest

import leanrnn
from leanrnn import cli
from leanrnn.kernels import runner
from leanrnn.score import DataError, score


def test_demo_times_the_kernels_apart_from_its_first_run(monkeypatch, capsys):
    """On a new machine the first run's figure included the kernels' build: "first run
    713130.6 ms". The kernels are made ready first now, and timed on their own line."""
    slow = runner._resolve

    def resolve(choice):
        time.sleep(0.5)  # a build, in miniature
        return slow(choice)

    monkeypatch.setattr(runner, "_backend", None)  # (both: the hot path trusts the pair)
    monkeypatch.setattr(runner, "_choice", "")
    monkeypatch.setattr(runner, "_resolve", resolve)
    assert cli.main(["demo", "--hidden", "16", "--steps", "4", "--repeat", "2"]) == 0
    out = capsys.readouterr().out
    first = float(re.search(r"first run\s+([\d.]+) ms", out).group(1))
    ready = float(re.search(r"kernels\s+\w+, ready in ([\d.]+) s", out).group(1))
    assert ready >= 0.5 and first < 400, out


def test_score_to_parquet_without_pyarrow_says_so_before_any_work(tmp_path, monkeypatch):
    """An .npz scored into a .parquet without pyarrow ran the whole dataset, then failed in the
    writer with a ModuleNotFoundError traceback."""
    x = np.random.default_rng(0).standard_normal((6, 5, 4)).astype(np.float32)
    np.savez(tmp_path / "in.npz", x=x, lengths=np.full(6, 5))
    model = leanrnn.GRU(4, 8, seed=0)
    ran = []
    monkeypatch.setattr(type(model), "run", lambda *a, **k: ran.append(1))
    monkeypatch.setitem(sys.modules, "pyarrow", None)  # import pyarrow: ImportError
    with pytest.raises(DataError, match=r"pyarrow: pip install 'leanrnn\[score\]'"):
        score(model, str(tmp_path / "in.npz"), str(tmp_path / "out.parquet"))
    assert not ran and not (tmp_path / "out.parquet").exists()
    monkeypatch.undo()
    summary = score(model, str(tmp_path / "in.npz"), str(tmp_path / "out.npz"))  # no Parquet
    assert summary.sequences == 6
