"""Turn a results dict (``results.json``) into what people read: markdown tables with each
engine's ratio to leanrnn, the memory table, the physical-limit table, the seed table, a summary
of where leanrnn is not yet the best, and PNG plots. Works on a saved JSON as well as a live run.
"""

from __future__ import annotations

import math
import os
from collections import defaultdict
from pathlib import Path

from .._files import write_text
from .problem import Config

BASE = "leanrnn"

# Quoted, not measured: the MNN article's ARM figures for an LSTM H=512 (MB per forward, MB of
# growth over 100 steps). Shown next to our measurements for context only.
SEED_QUOTED = (("MNN", 3.2, 0.8), ("TFLite", 5.8, 2.3), ("PyTorch Mobile", 6.5, 3.1))
SEED_ENGINES = ("leanrnn", "torch", "torch-nodnnl", "onnxruntime", "mnn")


# ------------------------------------------------------------------------- helpers
def config_key(row: dict) -> tuple:
    c = row["config"]
    return (c["cell"], c["H"], c["stream"], c["N"], c["T"], c["threads"])


def grouped(results: dict) -> dict[tuple, dict[str, dict]]:
    """{config key: {engine: row}} in suite order."""
    out: dict[tuple, dict[str, dict]] = {}
    for row in results["rows"]:
        out.setdefault(config_key(row), {})[row["engine"]] = row
    return out


def engines_of(results: dict) -> list[str]:
    seen = []
    for row in results["rows"]:
        if row["engine"] not in seen:
            seen.append(row["engine"])
    return seen


def median(row: dict | None) -> float | None:
    if not row or row.get("status") not in ("ok", "mismatch"):
        return None
    return row["timing"]["median_s"]


def per_step(row: dict | None) -> float | None:
    """Median seconds per timestep (N=1 rows: the time the recurrent weights bound)."""
    m = median(row)
    if m is None:
        return None
    return m if row["config"]["stream"] else m / row["config"]["T"]


def fmt_time(s: float | None) -> str:
    """Three significant digits in the largest unit that keeps the number below 1000."""
    if s is None or not math.isfinite(s):
        return "–"
    for scale, unit in ((1e6, "µs"), (1e3, "ms")):
        if float(f"{s * scale:.3g}") < 1000:
            return f"{s * scale:.3g} {unit}"
    return f"{s:.3g} s"


def fmt_bytes(b: float | None) -> str:
    if b is None:
        return "–"
    sign = "-" if b < 0 else ""
    b = abs(b)
    if b < 1024:
        return f"{sign}{b:.0f} B"
    if b < 1 << 20:
        return f"{sign}{b / 1024:.3g} KiB"
    if b < 1 << 30:
        return f"{sign}{b / (1 << 20):.3g} MiB"
    return f"{sign}{b / (1 << 30):.3g} GiB"


def fmt_ratio(r: float) -> str:
    return f"{r:.2f}×" if r < 10 else f"{r:.0f}×"


def config_label(key: tuple) -> str:
    cell, H, stream, N, T, threads = key
    return Config(cell, H, N, T, stream, threads).label


def busy(row: dict | None) -> bool:
    """Whether other processes left this row fewer free cores than it had threads."""
    # (None: not measured; the harness writes a NaN as JSON's null)
    if not row or not isinstance(row.get("background_cores"), int | float):
        return False
    cores = row.get("cores") or os.cpu_count() or 1  # the measuring machine's (older JSON: ours)
    return row["background_cores"] > cores - row["config"]["threads"] + 0.25


def _cell(row: dict | None, base: dict | None) -> str:
    if row is None:
        return ""
    st = row.get("status")
    if st == "unavailable":
        return "n/a"
    if st == "error":
        return "error"
    m = median(row)
    text = fmt_time(m)
    b = median(base)
    if row["engine"] != BASE and b:
        text += f" ({fmt_ratio(m / b)})"
    if st == "mismatch":
        text = f"⚠ mismatch {text}"
    if busy(row):
        text += " †"
    return text


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "|".join("---" for _ in header) + "|"]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


# ------------------------------------------------------------------------- tables
def latency_table(results: dict) -> str:
    """Median time per forward (per step when streaming) and each engine's ratio to leanrnn."""
    engines = engines_of(results)
    rows = []
    for key, by_engine in grouped(results).items():
        base = by_engine.get(BASE)
        rows.append(
            [config_label(key), str(key[-1])] + [_cell(by_engine.get(e), base) for e in engines]
        )
    legend = (
        "Median time per forward (per step for streaming rows). (r×) = engine time / leanrnn "
        "time: above 1 leanrnn is faster. ⚠ mismatch = outputs differ from the float64 "
        "reference (timed anyway); n/a = unavailable; error = the child failed (reasons below). "
        "† = other processes kept more cores busy than the row had to spare (noisy)."
    )
    cpu = results.get("machine", {}).get("cpu_detail")
    legend += f"\nCPU: {cpu}" if cpu else ""
    return _table(["config", "threads", *engines], rows) + "\n\n" + legend + _reasons(results)


def _reasons(results: dict) -> str:
    seen: dict[str, set] = defaultdict(set)
    for row in results["rows"]:
        if row.get("status") in ("unavailable", "error", "mismatch") and row.get("reason"):
            seen[row["engine"]].add(f"{row['status']}: {row['reason']}")
    if not seen:
        return ""
    lines = ["", ""]
    for engine, reasons in seen.items():
        for r in sorted(reasons)[:4]:
            lines.append(f"- {engine}: {r}")
        if len(reasons) > 4:
            lines.append(f"- {engine}: … {len(reasons) - 4} more (see results.json)")
    return "\n".join(lines)


def memory_table(results: dict) -> str:
    """One line per (config, engine) at the smallest thread count measured."""
    engines = engines_of(results)
    groups = grouped(results)
    tmin = min((k[-1] for k in groups), default=1)
    rows = []
    for key, by_engine in groups.items():
        if key[-1] != tmin:
            continue
        for e in engines:
            row = by_engine.get(e)
            if not row or row.get("status") not in ("ok", "mismatch"):
                continue
            m = row["memory"]
            growth = "–"
            if key[2]:
                growth = (
                    f"{fmt_bytes(m.get('stream_growth_rss'))} / "
                    f"{fmt_bytes(m.get('stream_growth_heap'))}"
                )
            rows.append(
                [
                    config_label(key),
                    e,
                    fmt_bytes(m.get("cold_peak")),
                    fmt_bytes(m.get("warm_peak")),
                    fmt_bytes(m.get("heap_peak")),
                    growth,
                ]
            )
    legend = (
        f"{tmin} thread(s). cold = peak RSS increase over model load + first forward (imports "
        "excluded; for leanrnn this includes loading its compiled kernels). warm = peak RSS "
        "increase over the warm timed forwards (engines with memory pools show ~0: they took it "
        "cold). heap = memray's peak of live native allocations in one warm forward (one step "
        "when streaming); memory reused from pools is not counted. growth = over the streaming "
        "steps after warm-up, RSS / bytes allocated and not freed (memray). RSS counts memory "
        "the allocator keeps after free."
    )
    versions = results.get("machine", {}).get("versions", {})
    if "memray" in versions and not versions["memray"]:  # (say why the columns are empty)
        legend += " The heap columns are empty: memray was not installed (pip install memray)."
    header = ["config", "engine", "cold peak", "warm peak", "heap peak", "growth (RSS / heap)"]
    return _table(header, rows) + "\n\n" + legend


def bandwidth_for(results: dict, threads: int, nbytes: int) -> float | None:
    """Best STREAM copy bandwidth (bytes/s) at ``nbytes`` arrays with at most ``threads``."""
    best = None
    for t, bw in results.get("bandwidth", {}).items():
        if int(t) > threads or not bw.get("ok", True) or "copy_Bps" not in bw:
            continue
        v = bw["copy_Bps"].get(str(nbytes))
        if v and (best is None or v > best):
            best = v
    return best


def limit_table(results: dict) -> str:
    """N=1 rows: the time to read the recurrent weights once per step at the measured copy
    bandwidth, and the fraction of that floor each engine reaches (100% = at the limit)."""
    engines = engines_of(results)
    rows = []
    for key, by_engine in grouped(results).items():
        cell, H, _, N, _, threads = key
        if N != 1:
            continue
        wbytes = H * H * (4 if cell == "lstm" else 3) * 4
        bw = bandwidth_for(results, threads, wbytes)
        if not bw:
            continue
        floor = wbytes / bw
        cells = []
        for e in engines:
            s = per_step(by_engine.get(e))
            cells.append("–" if s is None else f"{fmt_time(s)} ({100 * floor / s:.0f}%)")
        rows.append(
            [
                config_label(key),
                str(threads),
                fmt_bytes(wbytes),
                f"{bw / 1e9:.0f} GB/s",
                fmt_time(floor),
                *cells,
            ]
        )
    if not rows:
        return "(no N=1 rows, or bandwidth not measured)"
    dram = []
    for t, bw in sorted(results.get("bandwidth", {}).items()):
        if bw.get("dram_copy_Bps"):
            dram.append(f"{bw['dram_copy_Bps'] / 1e9:.1f} GB/s with {t} thread(s)")
    legend = (
        "STREAM-style copy bandwidth of this machine (arrays of "
        f"{fmt_bytes(_first(results, 'dram_bytes'))}, beyond the caches): {', '.join(dram)}. "
        "floor = bytes of R [H, G] (float32) / copy bandwidth measured with arrays of that size "
        "(so cache-resident weights get the cache's bandwidth): the time just to read the "
        "recurrent weights once per step. Each engine: time per step (floor / time); 100% "
        "would be at the limit."
    )
    header = ["config", "threads", "R bytes", "copy bw", "floor/step", *engines]
    return _table(header, rows) + "\n\n" + legend


def _first(results: dict, key: str):
    for bw in results.get("bandwidth", {}).values():
        if key in bw:
            return bw[key]
    return None


def seed_table(results: dict) -> str:
    """The seed's table: LSTM H=512 per-forward memory and growth over 100 steps, measured here,
    next to the MNN article's ARM figures (quoted, not measured)."""
    groups = grouped(results)
    rows = []
    for key, by_engine in groups.items():
        cell, H, stream, N, _, threads = key
        if cell != "lstm" or H != 512 or N != 1 or threads != 1:
            continue
        for e in by_engine:
            if e not in SEED_ENGINES:
                continue
            row = by_engine[e]
            if row.get("status") not in ("ok", "mismatch"):
                rows.append([config_label(key), e, row.get("status", "?"), "", "", ""])
                continue
            m = row["memory"]
            growth = "–"
            if stream:
                growth = (
                    f"{fmt_bytes(m.get('stream_growth_rss'))} / "
                    f"{fmt_bytes(m.get('stream_growth_heap'))}"
                )
            rows.append(
                [
                    config_label(key),
                    e,
                    fmt_bytes(m.get("heap_peak")),
                    fmt_bytes(m.get("warm_peak")),
                    fmt_bytes(m.get("cold_peak")),
                    growth,
                ]
            )
    measured = _table(
        [
            "config (1 thread)",
            "engine",
            "per forward: heap peak",
            "per forward: warm RSS peak",
            "cold: load + first",
            "growth over 100 steps (RSS / heap)",
        ],
        rows or [["(no LSTM H=512 N=1 rows: run with --seed-table)", "", "", "", "", ""]],
    )
    quoted = _table(
        ["engine (ARM, quoted)", "per forward", "growth over 100 steps"],
        [[name, f"{a} MB", f"{b} MB"] for name, a, b in SEED_QUOTED],
    )
    return (
        "Measured here (x86, this machine):\n\n" + measured + "\n\n"
        "QUOTED from the MNN article, on ARM — not measured here, not comparable row by row "
        "(different hardware, model files and accounting):\n\n" + quoted
    )


BAR_PEERS = ("onnxruntime", "torch")


def bar_rows(results: dict) -> list[dict]:
    """The engine issue's bar, row by row: in every LSTM full-sequence config, leanrnn no slower
    than the faster of onnxruntime and torch (median of repeated runs). ``passed`` is False when
    leanrnn is slower, its output is wrong, or its row failed — or a peer's row failed or gave
    wrong outputs: the faster peer is then unknown, and comparing with the one left turned a
    FAIL into a pass (``peer_failed`` names it)."""
    out = []
    for key, by_engine in grouped(results).items():
        cell, H, stream, N, T, threads = key
        if cell != "lstm" or stream or BASE not in by_engine:
            continue
        rows = {e: by_engine.get(e) for e in BAR_PEERS}
        peers = [(median(r), e) for e, r in rows.items() if r and r.get("status") == "ok"]
        failed = [e for e, r in rows.items() if r and r.get("status") != "ok"]
        if not peers:
            continue
        best_t, best_e = min(peers)
        base = by_engine[BASE]
        b = median(base)
        out.append({
            "key": key, "H": H, "N": N, "T": T, "threads": threads,
            "ratio": None if b is None else b / best_t, "peer": best_e,
            "peer_failed": failed,
            "passed": (b is not None and b <= best_t and base.get("status") == "ok"
                       and not failed),
            "busy": busy(base),
            "cells": [_cell(by_engine.get(e), None) for e in (BASE, *BAR_PEERS)],
        })  # fmt: skip
    return out


def bars_table(results: dict) -> str | None:
    """``bar_rows`` as markdown; None when the results have no such rows."""
    rows = []
    for b in bar_rows(results):
        ratio = "–" if b["ratio"] is None else f"{b['ratio']:.2f} (vs {b['peer']})"
        verdict = ("pass" if b["passed"] else "FAIL") + (" †" if b["busy"] else "")
        if b["peer_failed"]:  # (not a pass whatever the ratio: the faster peer is unknown)
            verdict = f"FAIL: {', '.join(b['peer_failed'])} did not run right"
        rows.append([str(b["H"]), str(b["N"]), str(b["T"]), str(b["threads"]), *b["cells"],
                     ratio, verdict])  # fmt: skip
    if not rows:
        return None
    header = ["H", "N", "T", "threads", BASE, *BAR_PEERS, "leanrnn / faster peer", "bar ≤ 1"]
    m = results.get("machine", {})
    return _table(header, rows) + (
        "\n\nSingle-layer LSTM, input = hidden; median time per forward. The bar (engine issue): "
        "leanrnn / faster peer ≤ 1 in every row. † = the machine was busy during leanrnn's row."
        f"\nCPU: {m.get('cpu_detail') or m.get('cpu', '?')}"
    )


MEMORY_FIELDS = (
    ("heap_peak", "heap peak per forward"),
    ("warm_peak", "warm peak RSS"),
    ("cold_peak", "cold (load + first run)"),
    ("stream_growth_rss", "RSS growth over the streaming steps"),
    ("stream_growth_heap", "heap growth over the streaming steps"),
)


def reduced(results: dict, engine: str) -> bool:
    """Whether ``engine`` runs reduced-precision weights (``--precision``): such rows are shown
    beside leanrnn's float32 ones but not counted against them in the summary."""
    return results.get("engines", {}).get(engine, {}).get("precision", "float") != "float"


def summary(results: dict) -> list[str]:
    """Plain sentences: each config where a float32 engine is faster than leanrnn, each memory
    figure where one needs clearly less (by 16 KiB and 10% at least), and every row not ok.
    Reduced-precision engines (``reduced``) are compared only in the tables."""
    groups = {
        key: {e: r for e, r in by_engine.items() if not reduced(results, e)}
        for key, by_engine in grouped(results).items()
    }
    out = []
    for key, by_engine in groups.items():
        base = by_engine.get(BASE)
        if base is None or base.get("status") != "ok":
            continue
        b = median(base)
        faster = sorted(
            (median(r), e)
            for e, r in by_engine.items()
            if e != BASE and r.get("status") == "ok" and median(r) < b
        )
        if faster:
            peers = ", ".join(f"{e} {b / t:.2f}× faster ({fmt_time(t)})" for t, e in faster)
            mark = " †" if busy(base) else ""
            out.append(
                f"{config_label(key)}, {key[-1]} thread(s): {peers}; leanrnn {fmt_time(b)}{mark}"
            )
    for field, what in MEMORY_FIELDS:
        lower: dict[str, list[tuple[float, float]]] = defaultdict(list)
        compared = 0
        for by_engine in groups.values():
            base = by_engine.get(BASE)
            bm = base["memory"].get(field) if base and base.get("status") == "ok" else None
            if bm is None:
                continue
            compared += 1
            for e, r in by_engine.items():
                v = r["memory"].get(field) if e != BASE and r.get("status") == "ok" else None
                if v is not None and v < bm - max(16 << 10, 0.1 * abs(bm)):
                    lower[e].append((v, bm))
        for e, pairs in lower.items():
            vs, bs = [p[0] for p in pairs], [p[1] for p in pairs]
            out.append(
                f"{what}: {e} needs less in {len(pairs)} of {compared} configs "
                f"({_span(vs)} vs leanrnn {_span(bs)})"
            )
    for row in results["rows"]:
        if row.get("status") in ("mismatch", "error") or (
            row["engine"] == BASE and row.get("status") != "ok"
        ):
            out.append(
                f"{row['engine']} on {row['label']}, {row['config']['threads']} thread(s): "
                f"{row['status']}: {row.get('reason')}"
            )
    return out


def _span(values: list[float]) -> str:
    lo, hi = min(values), max(values)
    return fmt_bytes(lo) if fmt_bytes(lo) == fmt_bytes(hi) else f"{fmt_bytes(lo)}–{fmt_bytes(hi)}"


# ------------------------------------------------------------------------- plots
def plot(results: dict, out: Path) -> list[Path]:
    """latency_ratio.png (engine time / leanrnn time per config) and memory.png (cold peak,
    warm peak and heap peak per engine). Needs matplotlib; returns the files written."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    out = Path(out)
    all_engines = engines_of(results)
    engines = [e for e in all_engines if e != BASE]
    cmap = plt.get_cmap("tab10")
    color = {e: cmap(i % 10) for i, e in enumerate(all_engines)}
    groups = grouped(results)
    threads = sorted({k[-1] for k in groups})
    written = []
    nice = [v * 10.0**p for p in range(-4, 6) for v in (1, 2, 5)]

    def log_axis(ax, unit: str) -> None:
        lo, hi = ax.get_ylim()
        ax.yaxis.set_major_locator(FixedLocator([v for v in nice if lo <= v <= hi]))
        ax.yaxis.set_minor_locator(NullLocator())
        ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}{unit}"))

    fig, axes = plt.subplots(
        len(threads), 1, figsize=(max(8, 0.9 * len(groups)), 4.5 * len(threads)), squeeze=False
    )
    for ax, t in zip(axes[:, 0], threads, strict=True):
        keys = [k for k in groups if k[-1] == t]
        width = 0.8 / max(1, len(engines))
        for j, e in enumerate(engines):
            xs, ys = [], []
            for i, k in enumerate(keys):
                b, m = median(groups[k].get(BASE)), median(groups[k].get(e))
                if b and m:
                    xs.append(i + (j - (len(engines) - 1) / 2) * width)
                    ys.append(m / b)
            ax.bar(xs, ys, width, label=e, color=color[e])
        ax.axhline(1.0, color="black", linewidth=1)
        ax.set_yscale("log")
        log_axis(ax, "×")
        ax.set_xticks(
            range(len(keys)), [config_label(k) for k in keys], rotation=30, ha="right", fontsize=8
        )
        ax.set_ylabel("time / leanrnn time (log; >1 = leanrnn faster)")
        ax.set_title(f"latency ratio to leanrnn, {t} thread(s)")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path = out / "latency_ratio.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)

    tmin = threads[0] if threads else 1
    keys = [k for k in groups if k[-1] == tmin]
    metrics = (
        ("cold_peak", "cold: load + first forward"),
        ("warm_peak", "warm peak RSS increase"),
        ("heap_peak", "heap peak of one forward (memray)"),
    )
    fig, axes = plt.subplots(
        len(metrics), 1, figsize=(max(8, 0.9 * len(keys)), 4 * len(metrics)), squeeze=False
    )
    for ax, (field, title) in zip(axes[:, 0], metrics, strict=True):
        width = 0.8 / max(1, len(all_engines))
        nothing = []  # (x, label, engine): measured, but 0 (or less) has no bar on a log axis
        for j, e in enumerate(all_engines):
            xs, ys = [], []
            for i, k in enumerate(keys):
                r = groups[k].get(e)
                if r and r.get("status") in ("ok", "mismatch"):
                    v = r["memory"].get(field)
                    x = i + (j - (len(all_engines) - 1) / 2) * width
                    if v is not None and v <= 0:
                        nothing.append((x, "0" if v == 0 else "<0", e))
                    elif v is not None:
                        xs.append(x)
                        ys.append(max(v, 1024) / (1 << 20))  # floor at 1 KiB for the log axis
            ax.bar(xs, ys, width, label=e, color=color[e])
        ax.set_yscale("log")
        log_axis(ax, "")
        for x, label, e in nothing:  # written at the axis floor, in the engine's colour
            ax.text(x, 0.01, label, transform=ax.get_xaxis_transform(), ha="center",
                    va="bottom", fontsize=7, color=color[e])  # fmt: skip
        ax.set_xticks(
            range(len(keys)), [config_label(k) for k in keys], rotation=30, ha="right", fontsize=8
        )
        ax.set_ylabel("MiB (log; under 1 KiB drawn at 1 KiB; '0' = none)")
        ax.set_title(f"{title}, {tmin} thread(s)")
        ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    path = out / "memory.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    written.append(path)
    return written


# ------------------------------------------------------------------------- the report
def cpu_line() -> str:
    """This machine's CPU, vector ISA and caches (what the kernels' tiles were derived from),
    for the benchmarks to print beside their tables: speed ratios differ between CPUs."""
    from ..kernels._cpu import describe

    return f"CPU: {describe()}"


def machine_line(results: dict) -> str:
    m = results.get("machine", {})
    vers = ", ".join(f"{k} {x}" for k, x in m.get("versions", {}).items() if x)
    load = [f"{(m.get(k) or [math.nan])[0]:.2f}" for k in ("loadavg", "loadavg_end")]
    cpu = m.get("cpu_detail") or f"{m.get('cpu', '?')}, {m.get('cores', '?')} cores"
    return (
        f"{cpu}; Python {m.get('python', '?')}; "
        f"{vers}. Load average {load[0]} at start, {load[1]} at end.{_settings(results)}"
    )


def _settings(results: dict) -> str:
    """The LEANRNN_* switches the run was measured under and the kernels leanrnn's rows ran on,
    when either is not the default: a JIT run (asked for, or a failed native build's fallback)
    is slower, and its table must not pass for the native build's."""
    env = results.get("machine", {}).get("settings") or {}
    kernels = sorted({
        (r.get("ran_on") or {}).get("kernels") for r in results.get("rows", [])
        if str(r.get("engine", "")).startswith(BASE)
    } - {None})  # fmt: skip
    text = "".join(f" {k}={v}." for k, v in sorted(env.items()))
    if kernels and kernels != ["native"]:
        text += f" leanrnn's rows ran on its {' and '.join(kernels)} kernels, not the native build."
    return text


def render(results: dict, plots: list[Path] | None = None, no_plots: str | None = None) -> str:
    bars = bars_table(results)
    parts = [
        "# leanrnn bench",
        "",
        f"{results.get('created', '')} — {machine_line(results)}",
        "",
        "Each (engine, config) ran in a fresh process with its thread count enforced; outputs "
        "were checked against a float64 reference before timing.",
        "",
        "## Latency",
        "",
        latency_table(results),
        "",
        *(["## Engine bars (LSTM vs onnxruntime and torch)", "", bars, ""] if bars else []),
        "## Where leanrnn is not yet the best",
        "",
        "\n".join(f"- {s}" for s in summary(results)) or "- nowhere in this run",
        "",
        "## Memory",
        "",
        memory_table(results),
        "",
        "## The physical limit (N=1)",
        "",
        limit_table(results),
        "",
        "## The seed's table (LSTM H=512)",
        "",
        seed_table(results),
        "",
    ]
    if plots:
        parts += ["## Plots", ""] + [f"![{p.stem}]({p.name})" for p in plots] + [""]
    elif no_plots:
        parts += ["## Plots", "", f"Not drawn: {no_plots}.", ""]
    return "\n".join(parts)


NO_PLOTS = "matplotlib is not installed (pip install 'leanrnn[plot]')"


def no_plots_reason() -> str | None:
    """Why ``write`` will draw no plots here (NO_PLOTS), or None."""
    import importlib.util

    return NO_PLOTS if importlib.util.find_spec("matplotlib") is None else None


def write(results: dict, out: Path, plots: bool = True) -> dict[str, Path]:
    """report.md (+ PNGs when matplotlib is installed) next to results.json."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, Path] = {}
    pngs: list[Path] = []
    why = None
    if plots:
        try:
            pngs = plot(results, out)
        except ImportError:
            why = NO_PLOTS  # said in the report (and by the CLI: no_plots_reason)
        files |= {p.stem: p for p in pngs}
    md = out / "report.md"
    write_text(md, render(results, pngs, why))
    files["report"] = md
    return files
