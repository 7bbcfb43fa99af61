"""The benchmark harness itself: a tiny suite end to end, the JSON's fields, a wrong engine is
flagged (not hidden), the tables render. No timing assertions: this machine is shared."""

from __future__ import annotations

import importlib.util
import json
import textwrap

import numpy as np
import pytest

from leanrnn.bench import harness, report
from leanrnn.bench.harness import Options, run_suite
from leanrnn.bench.problem import Config, compare, make_problem, reference, reference_file
from leanrnn.errors import LeanRNNError
from tolerances import ATOL_FLOAT64_TWINS

HAVE = {m: importlib.util.find_spec(m) is not None for m in ("torch", "onnxruntime", "onnx")}
HAVE_MEMRAY = importlib.util.find_spec("memray") is not None

ROW_FIELDS = {
    "engine", "config", "label", "status", "reason", "files", "verify", "timing", "memory",
    "import_s", "cold_s", "threadpools", "thread_info", "os_threads", "background_cores",
    "child_wall_s", "loadavg_start", "loadavg_end",
}  # fmt: skip
TIMING_FIELDS = {"unit", "samples_s", "inner", "warmup", "median_s", "min_s", "p25_s", "p75_s",
                 "cpu_util"}  # fmt: skip
MEMORY_FIELDS = {"cold_peak", "cold_retained", "warm_peak", "warm_growth"}
STREAM_FIELDS = {"stream_growth_rss", "stream_peak_rss"}
TOP_FIELDS = {"schema", "created", "argv", "options", "machine", "engines", "bandwidth", "rows",
              "fields"}  # fmt: skip


def tiny(tmp_path, engines, **kw) -> Options:
    base = dict(
        engines=tuple(engines), cells=("lstm", "gru"), hidden=(8,), shapes=((2, 5),),
        stream_steps=5, threads=(1,), warmup=1, repeats=3, min_repeats=2, max_time_s=0.1,
        min_sample_s=0.001, bandwidth=False, out=tmp_path / "out", timeout_s=300,
    )  # fmt: skip
    return Options(**(base | kw))


# ------------------------------------------------------------------ the reference is right
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_bench_reference_matches_leanrnn_oracle(cell):
    """The bench's batched float64 loop equals the project's per-sample float64 oracle."""
    import leanrnn
    from leanrnn.kernels.reference import reference_forward

    p = make_problem(Config(cell, 6, 3, 4))
    m = leanrnn.from_state_dict(p.sd)
    want = reference_forward(m.spec, m.weights.unpack(), p.x, p.h0, p.c0)
    got = reference(p)
    for g, w in zip(got, want, strict=True):
        if w is None:
            assert g is None
        else:
            np.testing.assert_allclose(g, w, rtol=0, atol=ATOL_FLOAT64_TWINS[np.float64])


@pytest.mark.torch
@pytest.mark.skipif(not HAVE["torch"], reason="torch not installed")
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_bench_reference_matches_torch(cell):
    import torch

    p = make_problem(Config(cell, 6, 3, 4))
    mod = (torch.nn.LSTM if cell == "lstm" else torch.nn.GRU)(6, 6).double()
    mod.load_state_dict({k: torch.from_numpy(v.astype(np.float64)) for k, v in p.sd.items()})
    h0 = torch.from_numpy(p.h0.astype(np.float64))
    hx = (h0, torch.from_numpy(p.c0.astype(np.float64))) if cell == "lstm" else h0
    with torch.no_grad():
        y, _ = mod(torch.from_numpy(p.x.astype(np.float64)), hx)
    np.testing.assert_allclose(
        reference(p)[0], y.numpy(), rtol=0, atol=ATOL_FLOAT64_TWINS[np.float64]
    )


def test_compare_flags_wrong_and_nan(tmp_path):
    cfg = Config("lstm", 4, 1, 3)
    ref = reference_file(cfg, tmp_path)
    y, h, c = (a.astype(np.float32) for a in reference(make_problem(cfg)))
    assert compare((y, h, c), ref)["ok"]
    assert not compare((y + 1e-2, h, c), ref)["ok"]
    y[0, 0, 0] = np.nan
    assert not compare((y, h, c), ref)["ok"]
    assert not compare((y[:1], h, c), ref)["ok"]  # wrong size is a mismatch, not a crash


# ------------------------------------------------------------------ end to end
@pytest.mark.slow
def test_tiny_suite_end_to_end(tmp_path):
    engines = ["leanrnn", "numpy-naive", "numpy-prealloc"]
    engines += [e for e, m in (("torch", "torch"), ("onnxruntime", "onnxruntime")) if HAVE[m]]
    opts = tiny(tmp_path, engines, bandwidth=True, bandwidth_bytes=1 << 20)
    results = run_suite(opts, progress=False)

    saved = json.loads((opts.out / "results.json").read_text())  # strict JSON: no NaN
    assert TOP_FIELDS <= saved.keys()
    assert len(saved["rows"]) == len(engines) * 4  # 2 cells x (one shape + streaming)
    assert saved["bandwidth"]["1"]["ok"] and saved["bandwidth"]["1"]["dram_copy_Bps"] > 0
    for row in saved["rows"]:
        assert row["status"] == "ok", (row["engine"], row["label"], row.get("reason"))
        assert ROW_FIELDS <= row.keys()
        assert TIMING_FIELDS <= row["timing"].keys()
        assert len(row["timing"]["samples_s"]) >= 2
        assert MEMORY_FIELDS <= row["memory"].keys()
        assert row["verify"]["worst"] <= row["verify"]["tolerance"]
        if row["config"]["stream"]:
            assert row["timing"]["unit"] == "step"
            assert STREAM_FIELDS <= row["memory"].keys()
        if HAVE_MEMRAY:
            assert "heap_peak" in row["memory"]
        assert all(pool["num_threads"] == 1 for pool in row["threadpools"])  # BLAS/OpenMP
    by_engine = {r["engine"]: r for r in saved["rows"]}
    if "torch" in by_engine:
        assert by_engine["torch"]["thread_info"]["torch"] == 1

    files = report.write(results, opts.out)
    text = files["report"].read_text()
    for section in ("## Latency", "## Memory", "## The physical limit", "## The seed's table"):
        assert section in text
    if importlib.util.find_spec("matplotlib"):
        assert (opts.out / "latency_ratio.png").stat().st_size > 0
        assert (opts.out / "memory.png").stat().st_size > 0


@pytest.mark.skipif(
    not (importlib.util.find_spec("MNN") and HAVE["onnx"]), reason="MNN or onnx not installed"
)
def test_mnn_converts_and_runs(tmp_path):
    """MNN through the converter extension in a subprocess (never MNN.tools), fixed shapes."""
    results = run_suite(tiny(tmp_path, ["mnn"], cells=("gru",)), progress=False)
    for row in results["rows"]:
        assert row["status"] == "ok", (row["label"], row.get("reason"))
        assert row["files"]["mnn"].endswith(".mnn")
    assert {r["files"]["mnn"] for r in results["rows"]} == {
        str(tmp_path / "out" / "models" / f"gru-H8-N{n}-T{t}.mnn") for n, t in ((2, 5), (1, 1))
    }


WRONG = '''
from leanrnn.bench.engines import NumpyPrealloc


class Wrong(NumpyPrealloc):
    """NumPy done right, then every output nudged: must be flagged, never hidden."""

    name = "wrong"

    def forward(self):
        y, h, c = super().forward()
        return y + 0.01, h, c

    def stream(self, steps):
        y, h, c = super().stream(steps)
        return y, h + 0.01, c


class Missing(NumpyPrealloc):
    name = "missing"
    requires = ("no_such_module_for_leanrnn_bench",)
'''


def test_wrong_engine_is_flagged_and_missing_is_unavailable(tmp_path, monkeypatch):
    plug = tmp_path / "plug"
    plug.mkdir()
    (plug / "bench_plugin_wrong.py").write_text(textwrap.dedent(WRONG))
    monkeypatch.syspath_prepend(str(plug))
    monkeypatch.setenv("PYTHONPATH", str(plug))  # the children import it too
    engines = ("numpy-naive", "bench_plugin_wrong:Wrong", "bench_plugin_wrong:Missing")
    results = run_suite(tiny(tmp_path, engines, cells=("lstm",)), progress=False)

    rows = {(r["engine"], r["config"]["stream"]): r for r in results["rows"]}
    for stream in (False, True):
        wrong = rows["bench_plugin_wrong:Wrong", stream]
        assert wrong["status"] == "mismatch"
        assert wrong["verify"]["worst"] > wrong["verify"]["tolerance"]
        assert wrong["timing"]["median_s"] > 0  # still measured
        missing = rows["bench_plugin_wrong:Missing", stream]
        assert missing["status"] == "unavailable"
        assert "no_such_module_for_leanrnn_bench" in missing["reason"]
    table = report.latency_table(results)
    assert "⚠ mismatch" in table and "n/a" in table
    assert any("mismatch" in line for line in report.summary(results))


# ------------------------------------------------------------------ rendering only
def fake_row(engine, cfg: Config, median_s, status="ok", mem=None):
    row = {"engine": engine, "config": cfg.as_dict(), "label": cfg.label, "status": status,
           "reason": None if status == "ok" else "because", "background_cores": 0.0}  # fmt: skip
    if status in ("ok", "mismatch"):
        row["timing"] = {"median_s": median_s, "samples_s": [median_s], "unit": "forward"}
        row["memory"] = {"cold_peak": 1 << 20, "warm_peak": 0, "heap_peak": 4096} | (mem or {})
        row["verify"] = {"ok": status == "ok", "worst": 0.0, "tolerance": 1e-4}
    return row


def fake_results():
    rows = []
    for cfg in (Config("lstm", 512, 1, 100), Config("lstm", 512, 1, 100, stream=True)):
        rows += [
            fake_row("leanrnn", cfg, 0.010),
            fake_row("torch", cfg, 0.020),
            fake_row("onnxruntime", cfg, 0.005, mem={"heap_peak": 0}),
            fake_row("mnn", cfg, 0.0, status="unavailable"),
            fake_row("numpy-naive", cfg, 0.5, status="mismatch"),
        ]
    bw = {"1": {"ok": True, "threads": 1, "dram_bytes": 1 << 27, "dram_copy_Bps": 4e10,
                "copy_Bps": {str(512 * 2048 * 4): 1e11}}}  # fmt: skip
    return {"rows": rows, "bandwidth": bw, "machine": {}, "created": "now"}


def test_children_ignore_modules_in_the_working_directory(tmp_path, monkeypatch):
    """A bench run from a directory holding a module named like a standard one (a scratch
    grp.py did it: every torch row failed with a KeyError) runs its children as from anywhere
    else: they start with -P, so the working directory is not on their sys.path."""
    for name in ("json", "grp", "numpy"):
        (tmp_path / f"{name}.py").write_text("raise SystemExit('the shadowing module ran')\n")
    monkeypatch.chdir(tmp_path)
    res = harness.spawn({"kind": "bandwidth", "threads": 1, "sizes": [1 << 16], "big": 1 << 20},
                        1, 120)  # fmt: skip
    assert res["ok"], res


def test_a_timed_out_child_is_reported_with_the_timeout_it_was_given():
    """``bench --timeout 0.01`` reported "timed out after 0 s"."""
    res = harness.spawn({"kind": "bandwidth", "threads": 1, "sizes": [1 << 16], "big": 1 << 20},
                        1, 0.01)  # fmt: skip
    assert not res["ok"] and res["error"] == "timed out after 0.01 s", res


def test_time_format_keeps_three_digits():
    assert [report.fmt_time(s) for s in (1.5e-6, 0.0009996, 0.0123, 0.9996, 12.3)] == [
        "1.5 µs", "1 ms", "12.3 ms", "1 s", "12.3 s"
    ]  # fmt: skip


def test_tables_render():
    res = fake_results()
    table = report.latency_table(res)
    lines = table.splitlines()
    assert lines[0].startswith("| config | threads | leanrnn | torch | onnxruntime | mnn |")
    assert "| LSTM H=512 N=1 T=100 | 1 | 10 ms | 20 ms (2.00×) | 5 ms (0.50×) | n/a |" in table
    assert "⚠ mismatch 500 ms (50×)" in table
    summ = report.summary(res)
    assert any("onnxruntime 2.00× faster" in s for s in summ)
    assert not any(s.startswith("heap peak per forward") for s in summ)  # 4 KiB: below noise
    limit = report.limit_table(res)
    assert "41.9 µs" in limit  # 4 MiB of R at 100 GB/s
    seed = report.seed_table(res)
    assert "QUOTED" in seed and "3.2 MB" in seed and "| LSTM H=512" in seed
    bars = report.bars_table(res)
    assert bars is not None and "pass" not in bars.splitlines()[2]  # ORT faster: FAIL
    assert "FAIL" in bars
    md = report.render(res)
    assert md.count("|---") >= 4


def test_cli_registers_and_rerenders(tmp_path, capsys):
    from leanrnn.cli import build_parser, main

    args = build_parser().parse_args(["bench", "--quick", "--engines", "leanrnn,torch"])
    from leanrnn.bench.cli import options_from_args

    opts = options_from_args(args)
    assert opts.engines == ("leanrnn", "torch") and opts.threads == (1,)
    args = build_parser().parse_args(["bench", "--batch", "1,8", "--steps", "10", "--hidden", "4"])
    opts = options_from_args(args)
    assert opts.shapes == ((1, 10), (8, 10)) and opts.hidden == (4,)
    assert {c.threads for c in opts.configs()} == {1, 2}
    with pytest.raises(LeanRNNError, match="onnxrt: unknown"):
        options_from_args(build_parser().parse_args(["bench", "--engines", "onnxrt"]))

    path = tmp_path / "results.json"
    path.write_text(json.dumps(fake_results()))
    assert main(["bench", "--from-json", str(path), "--no-plots"]) == 0
    out = capsys.readouterr().out
    assert "| LSTM H=512 N=1 T=100 |" in out
    assert (tmp_path / "report.md").exists()


def test_rounds_report_the_median_process_and_never_hide_a_failure():
    from leanrnn.bench.harness import _merge_rounds

    def row(engine, median, status="ok"):
        r = {"engine": engine, "config": {"H": 8}, "status": status}
        return r | ({"timing": {"median_s": median}} if status == "ok" else {})

    rows = []
    for m in (3.0, 1.0, 2.0):  # rounds arrive one at a time, merged after each
        rows = _merge_rounds([*rows, row("a", m)])
    (merged,) = rows
    assert merged["timing"]["median_s"] == 2.0
    assert merged["timing"]["round_medians_s"] == [3.0, 1.0, 2.0]

    rows = _merge_rounds([row("a", 1.0), row("a", 0.0, status="mismatch"), row("b", 5.0)])
    assert {r["engine"]: r["status"] for r in rows} == {"a": "mismatch", "b": "ok"}


@pytest.mark.parametrize("interleave", [0, 3])
def test_interleaved_turns_alternate_between_the_engines(tmp_path, interleave):
    """With interleave K, every engine's turn k starts before any engine's turn k + 1 and the
    order rotates (a slow spell of the machine then lands on every engine alike); each turn
    adds its samples; with 0, one process after another, no turns. Both keep the rows' checks
    and figures."""
    engines = ("leanrnn", "numpy-naive", "numpy-prealloc")
    opts = tiny(tmp_path, engines, cells=("lstm",), stream_steps=0, interleave=interleave,
                memray=False, repeats=6)  # fmt: skip
    rows = run_suite(opts, progress=False)["rows"]
    assert [r["engine"] for r in rows] == list(engines)
    for r in rows:
        assert r["status"] == "ok", (r["engine"], r.get("reason"))
        assert len(r["timing"]["turns"]) == interleave
        assert len(r["timing"]["samples_s"]) >= opts.min_repeats
        assert r["background_cores"] >= 0 and r["memory"]["cold_peak"] > 0
    if interleave:
        turns = [r["timing"]["turns"] for r in rows]
        for k in range(interleave - 1):
            assert max(t[k] for t in turns) < min(t[k + 1] for t in turns)
        firsts = [min(range(len(rows)), key=lambda i, k=k: turns[i][k]) for k in range(interleave)]
        assert firsts == [0, 1, 2]  # turn k opens with engine k (rotated)


def test_an_interleaved_child_that_dies_is_an_error_row_and_the_others_finish(tmp_path):
    """A child lost between turns (killed: a crash, the OOM killer) gives its row an error that
    says how it exited; the other engines' turns and rows go on."""
    from leanrnn.bench import harness

    real_tell = harness._Child.tell

    def tell(self, line):  # the numpy-naive child dies as its second turn is asked for
        self.turns_asked = getattr(self, "turns_asked", 0) + 1
        if self.turns_asked == 2 and "naive" in (self.result.parent / "job.json").read_text():
            self.proc.kill()
            self.proc.wait()
        return real_tell(self, line)

    opts = tiny(tmp_path, ("leanrnn", "numpy-naive"), cells=("lstm",), stream_steps=0,
                interleave=3, memray=False)  # fmt: skip
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(harness._Child, "tell", tell)
        rows = {r["engine"]: r for r in run_suite(opts, progress=False)["rows"]}
    assert rows["leanrnn"]["status"] == "ok" and len(rows["leanrnn"]["timing"]["turns"]) == 3
    assert rows["numpy-naive"]["status"] == "error"
    assert "child exited -9" in rows["numpy-naive"]["reason"]


# ------------------------------------------------------------- progress and the memory plot
def test_progress_off_a_terminal_is_one_plain_line_per_finished_row(tmp_path, monkeypatch, capsys):
    """Redirected to a file, a redrawn bar left only its last truncated frame: each finished
    row must be its own line (stderr under capsys is not a terminal)."""
    from leanrnn.bench import harness

    def measured(jobs, *args):
        return {name: {"ok": True, "verify": {"ok": True}, "timing": {"median_s": 0.0015}}
                for name in jobs}  # fmt: skip

    monkeypatch.setattr(harness, "interleaved", measured)
    monkeypatch.setattr(harness, "machine_info", lambda: {})
    opts = tiny(tmp_path, ["numpy-naive"])  # 2 cells x (one shape + streaming) = 4 rows
    harness.run_suite(opts, progress=True)
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 4, lines
    for i, line in enumerate(lines, 1):
        assert line.startswith(f"[{i}/4] numpy-naive") and line.endswith("ok, median 1.5 ms")
    assert "\r" not in "".join(lines) and "\x1b" not in "".join(lines)


def test_memory_plot_draws_no_stub_for_zero(tmp_path, monkeypatch):
    """A measured 0 (no heap, no growth) used to be drawn as a 1 KiB bar, which reads like a
    real value; now it has no bar and a '0' label at the axis floor."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    figs = []
    monkeypatch.setattr(plt, "close", figs.append)
    res = fake_results()  # onnxruntime: heap_peak 0; everyone: warm_peak 0
    report.plot(res, tmp_path)
    cold, warm, heap = figs[1].axes
    kib = 1024 / (1 << 20)

    def bars(ax):
        return [r.get_height() for r in ax.patches if r is not ax.patch]

    def zeros(ax):
        return [t for t in ax.texts if t.get_text() == "0"]

    measured = [r for r in res["rows"] if r["status"] in ("ok", "mismatch")]
    assert len(bars(cold)) == len(measured) and not zeros(cold)
    assert bars(warm) == [] and len(zeros(warm)) == len(measured)
    assert kib not in bars(heap) and len(zeros(heap)) == 2  # onnxruntime, in both configs


# ------------------------------------------------------------------ reduced precision (issue 14)
def test_precision_option_adds_the_reduced_engines():
    from leanrnn.bench.cli import options_from_args
    from leanrnn.cli import build_parser

    def engines(*argv):
        return options_from_args(build_parser().parse_args(["bench", *argv])).engines

    assert engines("--engines", "leanrnn,onnxruntime", "--precision", "f32,int8-dynamic") == (
        "leanrnn", "onnxruntime", "leanrnn-int8-dynamic", "leanrnn-int8-dynamic-7bit",
        "onnxruntime-int8")  # fmt: skip
    assert engines("--engines", "leanrnn,torch", "--precision", "bf16,int8-dynamic") == (
        "leanrnn-bf16", "leanrnn-int8-dynamic", "leanrnn-int8-dynamic-7bit", "torch-qint8")  # fmt: skip
    with pytest.raises(LeanRNNError, match="int4: unknown"):
        engines("--precision", "int4")


@pytest.mark.slow
def test_reduced_rows_run_checked_to_their_own_tolerance(tmp_path):
    """The reduced engines run beside float32 leanrnn, checked to the loose reduced tolerance
    (their int8 outputs are far outside the float32 one), onnxruntime-int8's GRU rows marked
    unavailable (its quantize_dynamic leaves a GRU float32), and none of them is reported as
    "faster than leanrnn" in the summary (that compares float32 engines)."""
    from leanrnn.bench.problem import REDUCED_TOLERANCE, TOLERANCE

    engines = ["leanrnn", "leanrnn-int8-dynamic", "leanrnn-int8-dynamic-7bit", "leanrnn-bf16"]
    engines += [e for e, m in (("torch-qint8", "torch"), ("onnxruntime-int8", "onnxruntime"))
                if HAVE[m]]  # fmt: skip
    opts = tiny(tmp_path, engines, hidden=(32,), stream_steps=0, memray=False)
    results = run_suite(opts, progress=False)
    assert results["engines"]["leanrnn"]["precision"] == "float"
    assert results["engines"]["leanrnn-int8-dynamic"]["precision"] == "int8-dynamic"
    for row in results["rows"]:
        cell, e = row["config"]["cell"], row["engine"]
        if e == "onnxruntime-int8" and cell == "gru":
            assert row["status"] == "unavailable" and "LSTM only" in row["reason"]
            continue
        assert row["status"] == "ok", (e, row["label"], row.get("reason"))
        want = TOLERANCE if e == "leanrnn" else REDUCED_TOLERANCE
        assert row["verify"]["tolerance"] == want
        if e in ("leanrnn-int8-dynamic", "leanrnn-int8-dynamic-7bit", "torch-qint8",
                 "onnxruntime-int8"):  # fmt: skip
            assert row["verify"]["worst"] > TOLERANCE  # really quantized, not float32 again
    lines = report.summary(results)
    assert not any(e in line for line in lines for e in engines[1:]), lines
    assert "leanrnn-int8-dynamic" in report.latency_table(results)
