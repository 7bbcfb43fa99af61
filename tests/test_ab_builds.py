"""benchmarks/ab_builds.py at a tiny size: builds whose outputs agree are timed in turns and
reported with their ratio; a tree that is not leanrnn's is refused before any process starts."""

from __future__ import annotations

from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def ab(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "benchmarks"))
    import ab_builds

    return ab_builds


def test_two_copies_of_this_tree_agree_and_are_timed(ab, capsys):
    rc = ab.main([f"a={ROOT}", f"b={ROOT}", "--cell", "gru", "--hidden", "16", "--batch", "3",
                  "--steps", "4", "--rounds", "3", "--reps", "1"])  # fmt: skip
    out = capsys.readouterr().out
    assert rc == 0, out
    lines = [line.split() for line in out.splitlines()[1:]]
    assert [row[0] for row in lines] == ["a", "b"]
    assert lines[0][-1] == "1.000"
    assert float(lines[1][-1]) > 0


def test_a_tree_without_leanrnn_is_refused(ab, tmp_path):
    with pytest.raises(SystemExit, match="no src/leanrnn"):
        ab.main([f"x={tmp_path}"])
