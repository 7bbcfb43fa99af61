"""Session 39, from a red-team pass on the benchmark harness: a failed peer turned a bar FAIL
into a pass (the faster of torch and onnxruntime was taken among those left), thread counts
above the cores ran leanrnn on fewer threads than its peers while the report said otherwise,
and --warmup 0 sized the samples from the load and first call."""

from __future__ import annotations

import pytest

from leanrnn import cli, config
from leanrnn.bench import report


def _row(engine: str, median_s: float, status: str = "ok") -> dict:
    return {"engine": engine, "status": status,
            "config": {"cell": "lstm", "H": 64, "stream": False, "N": 1, "T": 100, "threads": 1},
            "timing": {"median_s": median_s}}  # fmt: skip


@pytest.mark.parametrize("status", ["error", "mismatch"])
def test_a_peer_that_did_not_run_right_fails_the_bar(status):
    # onnxruntime 2x faster than leanrnn: a FAIL; with onnxruntime's row failed it read "pass"
    rows = [_row("leanrnn", 2e-3), _row("torch", 5e-3), _row("onnxruntime", 1e-3, status)]
    (bar,) = report.bar_rows({"rows": rows})
    assert not bar["passed"] and bar["peer_failed"] == ["onnxruntime"]
    assert "onnxruntime did not run right" in report.bars_table({"rows": rows})
    ok = [_row("leanrnn", 2e-3), _row("torch", 5e-3), _row("onnxruntime", 3e-3)]
    assert report.bar_rows({"rows": ok})[0]["passed"]


def test_bench_refuses_more_threads_than_cores_and_no_warmup(tmp_path, capsys):
    over = str(config.cores() + 1)
    assert cli.main(["bench", "--threads", over, "--out", str(tmp_path / "b")]) != 0
    assert f"compare at {config.cores()} threads or fewer" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["bench", "--warmup", "0", "--out", str(tmp_path / "b")])
    assert "argument --warmup: 0" in capsys.readouterr().err
    assert not (tmp_path / "b").exists()


def test_repeated_list_entries_are_one_row():
    # --hidden 16,16 measured the row twice and the report merged the two as if rounds
    args = cli.build_parser().parse_args(["bench", "--hidden", "16,32,16", "--cells", "gru,gru"])
    assert args.hidden == (16, 32) and args.cells == ("gru",)


def test_busy_marks_use_the_measuring_machines_cores(monkeypatch):
    # a row measured on a 2-core machine with 0.9 cores busy elsewhere is not busy at 1 thread;
    # rendered on a 1-core machine it was marked busy (and vice versa)
    monkeypatch.setattr(report.os, "cpu_count", lambda: 1)
    row = {**_row("leanrnn", 1e-3), "background_cores": 0.9, "cores": 2}
    assert not report.busy(row)
    assert report.busy({**row, "cores": 1})


def test_the_report_says_when_leanrnn_ran_on_the_jit():
    rows = [{**_row("leanrnn", 1e-3), "ran_on": {"kernels": "jit"}}]
    machine = {"settings": {"LEANRNN_BACKEND": "jit"}}
    line = report.machine_line({"rows": rows, "machine": machine})
    assert "LEANRNN_BACKEND=jit." in line and "ran on its jit kernels" in line
    native = [{**_row("leanrnn", 1e-3), "ran_on": {"kernels": "native"}}]
    assert "kernels" not in report.machine_line({"rows": native, "machine": {}})


def test_a_run_none_of_whose_engines_can_run_is_refused(tmp_path, capsys, monkeypatch):
    # before: it measured nothing, said "nowhere in this run" and exited 0
    from leanrnn.bench import engines

    monkeypatch.setattr(engines.importlib.util, "find_spec", lambda name: None)
    out = tmp_path / "b"
    assert cli.main(["bench", "--engines", "torch,onnxruntime", "--out", str(out)]) != 0
    err = capsys.readouterr().err
    assert "none of the engines asked for can run here" in err
    assert "torch: not installed: torch (pip install 'leanrnn[bench]')" in err


def test_the_report_says_why_plots_and_heap_columns_are_missing(tmp_path, monkeypatch):
    def no_matplotlib(results, out):
        raise ImportError("No module named 'matplotlib'")

    monkeypatch.setattr(report, "plot", no_matplotlib)
    results = {"rows": [], "machine": {"versions": {"memray": None}}}
    report.write(results, tmp_path)
    md = (tmp_path / "report.md").read_text()
    assert "Not drawn: matplotlib is not installed" in md
    assert "memray was not installed" in md
    import importlib.util

    monkeypatch.setattr(importlib.util, "find_spec", lambda name: None)
    assert report.no_plots_reason() == report.NO_PLOTS  # what the CLI prints
