"""What both examples share: threads, a progress line, peak memory, the result record, the
loss-curve plot and ``--compare`` (each engine in its own process, since peak memory is per
process). Nothing here knows about a model; the examples own their models and loops.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ENGINES = ("torch", "leanrnn-torch", "numpy")
LABELS = {
    "torch": "torch.nn",
    "leanrnn-torch": "leanrnn.torch",
    "numpy": "leanrnn numpy-only",
}


def seed(text: str) -> int:
    """argparse type: a seed numpy and torch both take (-1 failed in numpy once training had
    started, 2**70 in torch)."""
    v = _int(text)
    if not 0 <= v < 2**63:
        raise argparse.ArgumentTypeError(f"{v}: expected a seed in 0..2**63-1")
    return v


def threads(text: str) -> int:
    """argparse type: threads, at least 1 and at most 4x this machine's cores (100000 crashed
    torch.set_num_threads)."""
    v = count(text)
    most = 4 * (os.cpu_count() or 1)
    if v > most:
        raise argparse.ArgumentTypeError(f"{v}: expected at most {most} threads (4x this "
                                         f"machine's {os.cpu_count()} cores)")  # fmt: skip
    return v


def _int(text: str) -> int:
    try:
        return int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None


def count(text: str) -> int:
    """argparse type: an integer >= 1 (a size, a count of steps, threads, windows)."""
    v = _int(text)
    if v < 1:  # 0 steps ran nothing in silence; 0 windows divided by zero; 0 units crashed
        raise argparse.ArgumentTypeError(f"{v}: expected an integer >= 1")
    return v


def rate(text: str) -> float:
    """argparse type: a finite number >= 0 (learning rate, gradient clip)."""
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0 <= v < float("inf"):
        raise argparse.ArgumentTypeError(f"{text}: expected a finite number >= 0")
    return v


def out_file(text: str) -> str:
    """argparse type: a file path in an existing directory that takes a new file (checked
    before training by making one there, not found out after it: a directory of /sys or
    /proc passes every permission check as root, then refuses the write)."""
    parent = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text) or not os.path.isdir(parent):
        raise argparse.ArgumentTypeError(f"{text!r}: expected a file path in an existing directory")
    try:
        with tempfile.NamedTemporaryFile(dir=parent, prefix=".write-test-"):
            pass
    except OSError as e:
        raise argparse.ArgumentTypeError(
            f"{text!r}: cannot write in {parent!r} ({e.strerror or e})"
        ) from None
    return text


# what matplotlib's savefig writes without extra packages (.pgf needs a LaTeX install: it
# failed after training)
PLOT_SUFFIXES = (".png", ".pdf", ".svg", ".svgz", ".jpg", ".jpeg", ".webp", ".eps", ".ps", ".tif",
                 ".tiff")  # fmt: skip


def plot_file(text: str) -> str:
    """argparse type: ``out_file`` with a suffix matplotlib writes (``curve`` became
    ``curve.png``, and ``curve.txt`` failed after training)."""
    if not text.lower().endswith(PLOT_SUFFIXES):
        raise argparse.ArgumentTypeError(
            f"{text!r}: expected an image path ending in {', '.join(PLOT_SUFFIXES)}"
        )
    if not have("matplotlib"):  # (found out after training, as an ImportError)
        raise argparse.ArgumentTypeError("--plot needs matplotlib: pip install matplotlib")
    return out_file(text)


def in_file(text: str) -> str:
    """argparse type: an existing file."""
    if not os.path.isfile(text):
        raise argparse.ArgumentTypeError(f"{text!r} does not exist or is not a file")
    return text


def add_common_args(p: argparse.ArgumentParser, steps: int) -> None:
    p.add_argument("--engine", choices=ENGINES, default="numpy",
                   help="torch.nn module, leanrnn.torch module (same script, module swapped) or "
                        "numpy-only leanrnn (leanrnn.train; no torch import)")  # fmt: skip
    p.add_argument("--steps", type=count, default=steps, help="optimizer steps")
    p.add_argument("--seed", type=seed, default=0, help="seeds the weights and the data order")
    p.add_argument("--threads", type=threads, default=2, help="threads of the engine's kernels")
    p.add_argument("--lr", type=rate, default=None, help="Adam's learning rate")
    p.add_argument("--eval-every", type=count, default=None, help="steps between validations")
    p.add_argument("--plot", type=plot_file, metavar="PNG", help="write the loss curve(s) here")
    p.add_argument(
        "--json",
        type=out_file,
        metavar="FILE",
        help="write the run's record (curves, timings) here",
    )
    p.add_argument("--init", type=in_file, metavar="NPZ", help="initial weights (torch-named arrays); default: "
                   "torch's initialisation under --seed, made in a child process for numpy")  # fmt: skip
    p.add_argument("--compare", action="store_true",
                   help="run the three engines, each in its own process, and plot them together")  # fmt: skip
    p.add_argument("--engines", default=",".join(ENGINES),
                   help="with --compare: which engines, comma-separated")  # fmt: skip
    p.add_argument("--quiet", action="store_true", help="no progress output")


def have(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def leanrnn_torch_available() -> bool:
    """leanrnn.torch needs torch and the module itself (it lands with the torch face)."""
    if not have("torch"):
        return False
    try:
        return importlib.util.find_spec("leanrnn.torch") is not None
    except ImportError:
        return False


def import_leanrnn_torch():
    try:
        import leanrnn.torch as lt
    except ImportError as e:
        raise SystemExit(f"[examples] --engine leanrnn-torch needs leanrnn.torch ({e}); "
                         "pip install 'leanrnn[torch]', or pick --engine numpy") from None  # fmt: skip
    return lt


def set_threads(n: int, engine: str):
    """``n`` threads for the recurrent layers and for torch's ops. leanrnn.torch's kernels run
    on torch's own OpenMP team (threads.openmp_team), so both share one team of ``n``. The
    numpy-only loop keeps BLAS (embedding, head, loss: small) on one thread: OpenBLAS's idle
    workers spin after every call and took the core that leanrnn's kernel team needed next
    (char_lm's numpy-only loop on 2 threads ran 35 ms a step, slower than on 1; 20 ms with
    one BLAS thread). Returns a function that puts the previous counts back (main() run
    in-process)."""
    import leanrnn

    if engine != "numpy" and not have("torch"):  # (a bare ModuleNotFoundError before)
        raise SystemExit(f"[examples] --engine {engine} needs torch: pip install -e '.[torch]' "
                         "(or run --engine numpy, which needs numpy and leanrnn only)")  # fmt: skip
    before = leanrnn.get_num_threads()
    leanrnn.set_num_threads(n)  # leanrnn's kernels, and BLAS...
    if engine == "numpy":
        from threadpoolctl import threadpool_limits

        threadpool_limits(1, user_api="blas")  # ...but not BLAS here (above)
    torch_before = None
    if engine != "numpy":
        import torch

        torch_before = torch.get_num_threads()
        torch.set_num_threads(n)

    def restore() -> None:
        leanrnn.set_num_threads(before)
        if torch_before is not None:
            import torch

            torch.set_num_threads(torch_before)

    return restore


def peak_mib() -> float | None:
    """This process's peak resident memory (VmHWM, Linux), in MiB; None elsewhere."""
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024
    except OSError:
        pass
    return None


class Progress:
    """A progress bar with the loss and steps/s: rich's on a terminal (a plain \\r line without
    rich), and a line every tenth of the run when stderr is not a terminal (logs, CI)."""

    def __init__(self, total: int, desc: str, quiet: bool = False) -> None:
        self.total, self.desc, self.quiet = total, desc, quiet
        self.t0 = time.perf_counter()
        self.tty = sys.stderr.isatty()
        self._rich = None
        if not quiet and self.tty and have("rich"):
            from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn

            self._rich = Progress(
                TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                TextColumn("{task.fields[info]}"), transient=False,
            )  # fmt: skip
            self._rich.start()
            self._task = self._rich.add_task(desc, total=total, info="")

    def update(self, step: int, info: str) -> None:
        if self.quiet:
            return
        rate = step / max(time.perf_counter() - self.t0, 1e-9)
        text = f"{info}  {rate:.2f} steps/s"
        if self._rich is not None:
            self._rich.update(self._task, completed=step, info=text)
        elif self.tty:
            print(f"\r{self.desc} {step}/{self.total}  {text}", end="", file=sys.stderr)
        elif step == self.total or step % max(1, self.total // 10) == 0:
            print(f"{self.desc} {step}/{self.total}  {text}", file=sys.stderr, flush=True)

    def close(self) -> None:
        if self._rich is not None:
            self._rich.stop()
        elif self.tty and not self.quiet:
            print(file=sys.stderr)


def finish(args, record: dict) -> dict:
    """Print the run's summary, write its JSON and plot; return the record."""
    record["peak_mib"] = peak_mib()
    if not args.quiet:
        peak = "n/a" if record["peak_mib"] is None else f"{record['peak_mib']:.0f} MiB"
        print(
            f"[{record['engine']}] {record['steps']} steps in {record['wall_s']:.1f} s with "
            f"validations (the steps alone: {record['steps_per_s']:.2f} steps/s), final train loss "
            f"{record['train_loss'][-1]:.4f}, val loss {record['val_loss'][-1]:.4f}, "
            f"peak memory {peak}"
        )
    if args.json:
        Path(args.json).write_text(to_json(record))
    if args.plot:
        plot([record], args.plot, record["title"])
    return record


def _loss(v) -> str:
    """A loss for the tables: a diverged run's (NaN or inf; null in a record read back) too."""
    return "n/a" if v is None else f"{v:.4f}"


def to_json(obj) -> str:
    """Strict JSON: a diverged run's NaN and Infinity losses as null (json.dumps wrote them
    bare, which jq and JSON.parse refuse)."""

    def clean(v):
        if isinstance(v, float) and not math.isfinite(v):
            return None
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        if isinstance(v, list | tuple):
            return [clean(x) for x in v]
        return v

    return json.dumps(clean(obj), allow_nan=False)


def plot(records: list[dict], path: str, title: str) -> None:
    """Training loss per step (thin) and validation loss (markers) of each run on one chart;
    a table of the final numbers under it when there are several runs."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 5.5 if len(records) > 1 else 4.5))
    styles = {"torch": "-", "leanrnn-torch": "--", "numpy": ":"}
    for i, r in enumerate(records):
        color = f"C{i}"
        label = LABELS[r["engine"]]
        ax.plot(range(1, len(r["train_loss"]) + 1), r["train_loss"], styles[r["engine"]],
                color=color, lw=1, alpha=0.8, label=f"{label} train")  # fmt: skip
        ax.plot(r["val_steps"], r["val_loss"], "o" + styles[r["engine"]], color=color, ms=4,
                label=f"{label} validation")  # fmt: skip
    ax.set_xlabel("step")
    ax.set_ylabel(records[0]["loss_name"])
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    if len(records) > 1:
        rows = [[LABELS[r["engine"]], _loss(r["train_loss"][-1]), _loss(r["val_loss"][-1]),
                 f"{r['wall_s']:.1f}", f"{r['steps_per_s']:.2f}",
                 "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"] for r in records]  # fmt: skip
        table = ax.table(cellText=rows, bbox=[0.0, -0.5, 1.0, 0.3],
                         colLabels=["engine", "train loss", "val loss", "wall s", "steps/s",
                                    "peak MiB"])  # fmt: skip
        table.auto_set_font_size(False)
        table.set_fontsize(8)
        fig.subplots_adjust(bottom=0.32)
    else:
        fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def table(records: list[dict]) -> str:
    """The comparison as a markdown table."""
    lines = ["| engine | train loss | val loss | wall s | steps/s | peak MiB |",
             "|---|---:|---:|---:|---:|---:|"]  # fmt: skip
    for r in records:
        peak = "n/a" if r["peak_mib"] is None else f"{r['peak_mib']:.0f}"
        lines.append(f"| {LABELS[r['engine']]} | {_loss(r['train_loss'][-1])} | "
                     f"{_loss(r['val_loss'][-1])} | {r['wall_s']:.1f} | {r['steps_per_s']:.2f} | "
                     f"{peak} |")  # fmt: skip
    return "\n".join(lines)


def strip_args(argv: list[str], drop: dict[str, int]) -> list[str]:
    """argv without the options in ``drop`` (option -> how many values follow it)."""
    out, i = [], 0
    while i < len(argv):
        a = argv[i]
        name = a.split("=", 1)[0]
        if name in drop:
            i += 1 + (drop[name] if "=" not in a else 0)
            continue
        out.append(a)
        i += 1
    return out


def compare(script: str, argv: list[str], args, dump_init) -> list[dict]:
    """Each engine in its own process (peak memory is per process) from the same initial
    weights (written once by ``dump_init(path)``), then one plot and one table."""
    rest = strip_args(argv, {"--compare": 0, "--engine": 1, "--engines": 1, "--json": 1,
                             "--plot": 1, "--init": 1})  # fmt: skip
    wanted = [e.strip() for e in args.engines.split(",") if e.strip()]
    unknown = sorted(set(wanted) - set(ENGINES))
    if unknown:
        raise SystemExit(f"[compare] --engines {args.engines}: unknown {unknown}; expected a "
                         f"comma-separated subset of {', '.join(ENGINES)}")  # fmt: skip
    engines = [e for e in ENGINES if e in wanted and (e == "numpy" or have("torch"))]
    if "leanrnn-torch" in engines and not leanrnn_torch_available():
        print("[compare] leanrnn.torch is not available here; skipping that engine",
              file=sys.stderr)  # fmt: skip
        engines.remove("leanrnn-torch")
    if not engines:
        raise SystemExit(f"[compare] --engines {args.engines!r}: no engine to run here; expected "
                         f"a comma-separated subset of {', '.join(ENGINES)} (torch's need "
                         "torch installed)")  # fmt: skip
    records = []
    with tempfile.TemporaryDirectory() as tmp:
        init = args.init or os.path.join(tmp, "init.npz")
        if not args.init:
            dump_init(init)
        for e in engines:
            out = os.path.join(tmp, f"{e}.json")
            cmd = [sys.executable, script, "--engine", e, "--json", out, "--init", init, *rest]
            print(f"[compare] {' '.join(cmd[1:])}", file=sys.stderr, flush=True)
            code = subprocess.run(cmd).returncode
            if code:  # its own error is printed above; a traceback of this process adds nothing
                raise SystemExit(f"[compare] the {e} run failed (exit status {code})")
            records.append(json.loads(Path(out).read_text()))
    print(table(records))
    if args.json:
        Path(args.json).write_text(to_json(records))
    if args.plot:
        plot(records, args.plot, records[0]["title"])
        print(f"[compare] wrote {args.plot}")
    return records


def init_arrays(
    path: str | None, make_torch, make_numpy, engine: str, script: str, argv: list[str]
) -> dict:
    """The initial weights as torch-named numpy arrays: from ``path`` if given; else torch's
    initialisation under the seed (``make_torch()``), made in this process for the torch
    engines and in a child process for numpy-only (so that process never imports torch);
    ``make_numpy()`` (the same distributions, other draws) when torch is not installed."""
    import numpy as np

    if path:
        try:
            z = np.load(path)
            if isinstance(z, np.ndarray):  # a .npy: one array, no names
                raise ValueError("a single array (.npy), not named arrays")
            with z:
                arrays = {k: z[k] for k in z.files}
        except (OSError, ValueError) as e:  # not an .npz (a pickle, a torch zip, text...)
            # (numpy calls any file that is not .npy/.npz "pickled data", text included)
            why = "not an .npz file" if "pickled" in str(e) else str(e)
            raise SystemExit(f"[examples] --init {path}: cannot read it as .npz ({why}); "
                             "expected torch-named arrays saved with np.savez") from None  # fmt: skip
        # np.load opens any zip, a torch checkpoint too, and hands back its members as bytes
        if not arrays or not all(isinstance(v, np.ndarray) for v in arrays.values()):
            raise SystemExit(f"[examples] --init {path} holds no arrays; expected torch-named "
                             "arrays (weight_ih_l0, ...) saved with np.savez")  # fmt: skip
        # the weights train in float32 in every engine: float64 ones are converted (numpy's
        # engine built a float64 model and refused the float32 data); others are refused
        bad = sorted(k for k, v in arrays.items() if v.dtype.kind != "f")
        if bad:
            raise SystemExit(f"[examples] --init {path}: {bad[:4]} are not float arrays; "
                             "expected float32 weights")  # fmt: skip
        arrays = {k: v.astype(np.float32) for k, v in arrays.items()}
        # another model's weights (the other example's, other sizes) fail here, naming what
        # differs, not deep in a framework's load_state_dict
        want = {k: v.shape for k, v in make_numpy().items()}
        got = {k: v.shape for k, v in arrays.items()}
        if got != want:
            diff = sorted(f"{k}: {got.get(k)} (expected {want.get(k)})"
                          for k in set(got) | set(want) if got.get(k) != want.get(k))  # fmt: skip
            raise SystemExit(f"[examples] --init {path} does not fit this model and its options: "
                             f"{'; '.join(diff[:4])}{' ...' if len(diff) > 4 else ''}")  # fmt: skip
        return arrays
    if engine != "numpy":
        return make_torch()
    if not have("torch"):
        return make_numpy()
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "init.npz")
        subprocess.run([sys.executable, script, *argv, "--dump-init", out], check=True)
        with np.load(out) as z:
            return {k: z[k] for k in z.files}


def loop(args, step, evaluate) -> dict:
    """``--steps`` calls of ``step`` (returns the step's training loss) with a validation at
    the start, every ``--eval-every`` steps and at the end; timings and the curves."""
    train_loss, val_steps, val_loss = [], [0], [evaluate()]
    bar = Progress(args.steps, f"[{args.engine}]", args.quiet)
    t0 = time.perf_counter()
    t_steps = 0.0
    try:
        for i in range(1, args.steps + 1):
            t = time.perf_counter()
            train_loss.append(step())
            t_steps += time.perf_counter() - t
            if i % args.eval_every == 0 or i == args.steps:
                val_steps.append(i)
                val_loss.append(evaluate())
            bar.update(i, f"loss {train_loss[-1]:.3f}  val {val_loss[-1]:.3f}")
    finally:
        bar.close()
    wall = time.perf_counter() - t0
    return dict(train_loss=train_loss, val_steps=val_steps, val_loss=val_loss, wall_s=wall,
                steps=args.steps, steps_per_s=args.steps / max(t_steps, 1e-9))  # fmt: skip
