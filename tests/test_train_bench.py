"""benchmarks/train_bars.py at toy sizes: the rows, ratios and bars it reports and the JSON it
writes; its gradient check flags a wrong engine. No timing assertions: this machine is shared."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import numpy as np
import pytest

from leanrnn.bench.problem import TOLERANCE

pytest.importorskip("torch")

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "train_bars.py"


def _load():
    spec = importlib.util.spec_from_file_location("train_bars", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


tb = _load()


def _row(cell, H, times, N=2, threads=1):
    samples = {k: [v] * 3 for k, v in times.items()}
    cpu = {k: [v / 2] * 3 for k, v in times.items()}
    return dict(cell=cell, H=H, N=N, T=5, threads=threads, samples=samples, cpu_samples=cpu,
                grad_rel_error={k: 0.0 for k in times}, grad_reference="torch-nodnnl")  # fmt: skip


def test_merge_takes_faster_torch_and_applies_the_bar_per_hidden_size():
    rounds = [{"rows": [
        _row("lstm", 128, {"leanrnn": 0.010, "torch": 0.020, "torch-nodnnl": 0.015}),
        _row("lstm", 512, {"leanrnn": 0.100, "torch": 0.105, "torch-nodnnl": 0.300}),
    ]}]  # fmt: skip
    small, big = tb.merge_speed(rounds)
    assert (small["peer"], big["peer"]) == ("torch-nodnnl", "torch")
    assert small["ratio"] == pytest.approx(1.5) and small["bar"] == 1.3 and small["passed"]
    assert big["ratio"] == pytest.approx(1.05) and big["bar"] == 1.1 and not big["passed"]
    assert big["speedup_needed"] == pytest.approx(1.1 / 1.05)
    assert small["cpu_ratio"] == pytest.approx(1.5)  # CPU seconds of the same (wall) peer
    assert "miss: leanrnn needs 1.05x" in tb.speed_table([small, big])


def test_fingerprint_check_flags_a_wrong_gradient():
    rng = np.random.default_rng(0)
    g = {"dx": rng.standard_normal((5, 2, 3)), "weight_hh_l0": rng.standard_normal((12, 3))}
    right = {k: v * (1 + 1e-7) for k, v in g.items()}
    wrong = dict(g, weight_hh_l0=g["weight_hh_l0"] * 1.01)
    ref = tb._fingerprint(g)
    assert tb.rel_error(tb._fingerprint(right), ref) <= TOLERANCE
    assert tb.rel_error(tb._fingerprint(wrong), ref) > TOLERANCE
    assert tb.rel_error({"dx": ref["dx"]}, ref) == float("inf")


def test_autocast_table_reports_both_leanrnn_modes_and_judges_each_error():
    times = {"torch": 0.8, "torch-bf16": 0.6, "leanrnn": 0.8, "leanrnn-bf16": 0.8,
             "leanrnn-bf16act": 0.5}  # fmt: skip
    errors = {"torch-bf16": 6e-3, "leanrnn-bf16": 2e-3, "leanrnn-bf16act": 3e-3}
    row = dict(cell="lstm", H=512, N=64, threads=1, median_s=times, grad_rel_error=errors)
    text, ok = tb.autocast_table([row])
    assert ok
    assert "| 0.75x / 1.20x | 1.00x / 1.60x | 6.0e-03 / 2.0e-03 / 3.0e-03 |" in text
    row["grad_rel_error"]["leanrnn-bf16act"] = 7e-3  # one mode less accurate than torch's
    assert not tb.autocast_table([row])[1]
    assert tb._make("leanrnn-bf16act", tb._state_dict("lstm", 8, 8, 1),
                    *tb._inputs(3, 2, 8, 8), 1, "lstm").tr.autocast == "bf16-act"  # fmt: skip


@pytest.mark.slow
def test_toy_run_writes_rows_ratios_and_json(tmp_path):
    out = tmp_path / "out"
    args = ["--hidden", "16", "--batch", "2", "--threads", "1", "--rounds", "1", "--max-time",
            "0", "--speed-steps", "5", "--steps", "5", "--out", str(out)]  # fmt: skip
    rc = tb.main(args)
    assert rc in (0, 1)  # bars are not asserted: toy sizes on a shared machine
    res = json.loads((out / "train_bars.json").read_text())
    assert (out / "train_bars.md").read_text().startswith("CPU: ")
    rows = res["speed"]["rows"]
    assert [(r["cell"], r["H"], r["N"], r["threads"]) for r in rows] == [
        ("gru", 16, 2, 1), ("lstm", 16, 2, 1)]  # fmt: skip
    for r in rows:
        assert set(r["median_s"]) == set(tb.ENGINES)
        assert all(n >= tb.MIN_REPS for n in r["reps"].values())
        assert r["ratio"] > 0 and r["peer"] in tb.TORCHES and r["bar"] == 1.3
        assert r["cpu_ratio"] > 0
        assert r["grads_ok"], r["grad_rel_error"]
    mem = res["memory"]
    assert (mem["H"], mem["N"], mem["T"], mem["layers"]) == (16, 2, 5, 2)
    for v in ("torch", "leanrnn", "leanrnn-recompute"):
        assert mem["variants"][v]["seconds"] > 0 and mem["variants"][v]["peak"] >= 0
    assert mem["variants"]["leanrnn-recompute"]["plan"]["recompute"]
    assert not mem["variants"]["leanrnn"]["plan"]["recompute"]
    assert [b["target"] for b in mem["bars"]] == [0.1, 1.35, 1.0]
    assert mem["grads_ok"]


def _record(train, val, wall, peak=100.0):
    return dict(steps=3, train_loss=[1.0, train], val_loss=[1.0, val], wall_s=wall,
                peak_mib=peak)  # fmt: skip


def test_examples_rows_judge_losses_against_torch_and_wall_time():
    runs = {"forecast": {
        "torch": [_record(0.5, 0.7, 2.0), _record(0.5, 0.7, 4.0)],
        "leanrnn-torch": [_record(0.5 * (1 + 1e-5), 0.7, 1.0), _record(0.5, 0.7, 2.0)],
        "numpy": [_record(0.5 * (1 + 10 * tb.LOSS_RTOL), 0.7, 0.5)],  # fast, wrong loss
    }, "char_lm": {
        "torch": [_record(2.0, 2.1, 10.0)],
        "leanrnn-torch": [_record(2.0, 2.1, 11.0)],  # same loss, slower
        "numpy": [{"error": "boom"}],
    }}  # fmt: skip
    rows = {(r["example"], r["engine"]): r for r in tb.merge_examples(runs)}
    lt = rows["forecast", "leanrnn-torch"]
    assert lt["wall_s"] == pytest.approx(1.5) and lt["ratio"] == pytest.approx(2.0)
    assert lt["train_rel_diff"] == pytest.approx(1e-5) and lt["passed"]
    assert not rows["forecast", "numpy"]["passed"]  # loss off by 10x the noise bound
    assert not rows["char_lm", "leanrnn-torch"]["passed"]  # slower than torch
    assert not rows["char_lm", "numpy"]["passed"] and rows["char_lm", "numpy"]["error"] == "boom"
    table = tb.examples_table(list(rows.values()))
    assert table.count("| pass |") == 1 and table.count("MISS") == 2 and "error: boom" in table
