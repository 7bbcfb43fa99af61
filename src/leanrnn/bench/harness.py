"""Fair measurement: every (engine, config) runs in a fresh child process with its thread count
enforced; outputs are checked against the float64 reference before any timing; then warm-up,
repeated samples, and the memory figures. The parent plans jobs, prepares model files and
references, shows progress and collects rows. A config's engines take their samples in
interleaved turns, their children alive together (``interleaved``; ``Options.interleave``).

Child protocol: ``python -m leanrnn.bench.harness JOB.json RESULT.json``. Thread variables are set
in the child's environment by the parent, so they are in place before any library is imported.
An interleaved child also says READY on stdout and takes a turn's samples per "sample" line on
stdin.

Memory figures per row (Linux /proc; bytes):
- ``cold_peak``: peak RSS increase from just before ``load`` to the end of the first forward
  (model load + first run, one step when streaming: weights, pools, JIT caches, first
  outputs). Imports excluded.
- ``warm_peak``: peak RSS increase over the warm timed forwards, the peak reset right before
  (``/proc/self/clear_refs``). Engines with pools show ~0 here: their memory was taken cold.
- ``warm_growth``: RSS after the timed forwards minus before.
- ``heap_peak``: memray's peak of live native allocations during one warm forward (one step
  for streaming rows); counts malloc/mmap made during that call only, not memory reused from
  pools or held by the allocator.
- ``stream_growth_rss`` / ``stream_growth_heap`` (streaming rows): RSS growth over T more
  steps (T = 100 by default), and bytes memray saw allocated but not freed during them.
RSS counts pages the allocator keeps after ``free``; memray counts live allocations only.
"""

from __future__ import annotations

import gc
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path

from .. import config
from .._files import write_text
from .problem import Config

SCHEMA = "leanrnn-bench/1"

# Every variable a BLAS or OpenMP runtime reads for its thread count, set in the child's env.
THREAD_ENV = (
    "OMP_NUM_THREADS",
    "MKL_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
    "NUMBA_NUM_THREADS",
    "LEANRNN_NUM_THREADS",
)


# ------------------------------------------------------------------------- /proc memory
def _status_kb(key: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(key):
                return int(line.split()[1])
    return -1


def rss() -> int:
    """Resident set size now, bytes."""
    return _status_kb("VmRSS:") * 1024


def hwm() -> int:
    """Peak resident set size since start or the last ``reset_peak``, bytes."""
    return _status_kb("VmHWM:") * 1024


def reset_peak() -> bool:
    """Reset VmHWM to the current RSS (Linux >= 4.0). False where not permitted."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


# ------------------------------------------------------------------------- child side
@dataclass
class Timing:
    unit: str  # "forward" or "step"
    samples: list[float] = field(default_factory=list)  # seconds per unit, one per sample
    inner: int = 1  # units per sample
    warmup: int = 0
    cpu_util: float = float("nan")  # process CPU seconds / wall seconds while sampling
    turns: list[float] = field(default_factory=list)  # interleaved: each turn's start (epoch s)

    def summary(self) -> dict:
        s = sorted(self.samples)
        q = statistics.quantiles(s, n=4) if len(s) >= 2 else [s[0]] * 3
        return {
            "unit": self.unit,
            "samples_s": self.samples,
            "inner": self.inner,
            "warmup": self.warmup,
            "median_s": statistics.median(s),
            "min_s": s[0],
            "p25_s": q[0],
            "p75_s": q[2],
            "cpu_util": self.cpu_util,
            "turns": self.turns,
        }


def _os_threads() -> int:
    return _status_kb("Threads:")


def _limit_threadpools(n: int):
    """Limit every BLAS/OpenMP pool loaded in this process; returns (limiter, info)."""
    try:
        from threadpoolctl import threadpool_info, threadpool_limits
    except ImportError:
        return None, []
    limiter = threadpool_limits(limits=n)
    info = [
        {k: d.get(k) for k in ("internal_api", "num_threads", "version", "filepath")}
        for d in threadpool_info()
    ]
    return limiter, info


def _memray_peak(fn, path: Path) -> dict:
    """Run ``fn`` once under memray; peak live native bytes and allocation count."""
    import memray

    if path.exists():
        path.unlink()
    with memray.Tracker(path, native_traces=False):
        r = fn()
        del r
    reader = memray.FileReader(path)
    meta = reader.metadata
    leaked = sum(a.size for a in reader.get_leaked_allocation_records(merge_threads=True))
    reader.close()
    path.unlink()
    return {
        "peak": int(meta.peak_memory),
        "allocations": int(meta.total_allocations),
        "leaked": int(leaked),
    }


def run_job(job: dict, workdir: Path) -> dict:
    """Measure one (engine, config) in this process; returns the row's measured fields."""
    from . import engines as E
    from .problem import compare, make_problem

    cfg = Config(**job["config"])
    n = cfg.threads
    row: dict = {"pid": os.getpid(), "loadavg_start": os.getloadavg()[0]}

    t0 = time.perf_counter()
    eng = E.resolve(job["engine"])(n)
    limiter, pools = _limit_threadpools(n)
    row["import_s"] = time.perf_counter() - t0
    row["threadpools"] = pools
    row["thread_info"] = eng.thread_info()

    p = make_problem(cfg)
    run_once = (lambda: eng.stream(cfg.T)) if cfg.stream else eng.forward
    # One forward: the whole sequence, or a single step when streaming.
    forward_one = (lambda: eng.stream(1)) if cfg.stream else eng.forward
    gc.collect()

    # Cold: load + first forward, from a reset peak.
    can_reset = reset_peak()
    r0 = rss()
    t0 = time.perf_counter()
    eng.load(p, job["files"])
    out = forward_one()
    cold_s = time.perf_counter() - t0
    mem = {"cold_peak": hwm() - r0, "cold_retained": rss() - r0, "peak_reset": can_reset}
    row["cold_s"] = cold_s
    row["os_threads"] = _os_threads()
    row["ran_on"] = eng.ran_on()

    # Verify before any timing; a mismatch marks the row but the row is still measured.
    if cfg.stream:
        out = run_once()
    row["verify"] = compare(out, Path(job["ref"]), eng.tolerance)
    del out
    gc.collect()

    # Warm-up, then size the samples: each at least min_sample_s, at most max_time_s in total.
    tm = Timing(unit="step" if cfg.stream else "forward")
    units = cfg.T if cfg.stream else 1
    warm_t0 = time.perf_counter()
    est = cold_s * units
    for _ in range(job["warmup"]):
        t = time.perf_counter()
        run_once()
        est = time.perf_counter() - t
        tm.warmup += 1
        if time.perf_counter() - warm_t0 > job["max_time_s"] / 2:
            break
    inner = 1 if cfg.stream else max(1, min(10_000, math.ceil(job["min_sample_s"] / est)))
    repeats = max(job["min_repeats"], min(job["repeats"], int(job["max_time_s"] / (est * inner))))
    tm.inner = inner * units

    def sample(n: int) -> tuple[float, float]:
        c0, w0 = time.process_time(), time.perf_counter()
        for _ in range(n):
            t = time.perf_counter_ns()
            for _ in range(inner):
                run_once()
            tm.samples.append((time.perf_counter_ns() - t) * 1e-9 / (inner * units))
        return time.process_time() - c0, time.perf_counter() - w0

    gc.collect()
    gc.disable()
    reset_peak()
    r0 = rss()
    blocks = job.get("blocks", 0)
    if blocks:
        cpu, wall = _sample_when_told(sample, run_once, repeats, blocks, tm.turns)
    else:
        cpu, wall = sample(repeats)
    tm.cpu_util = cpu / wall if wall > 0 else float("nan")
    mem["warm_peak"] = hwm() - r0
    mem["warm_growth"] = rss() - r0

    if cfg.stream:
        steps = cfg.T
        reset_peak()
        r0 = rss()
        eng.stream(steps)
        mem["stream_growth_rss"] = rss() - r0
        mem["stream_peak_rss"] = hwm() - r0
    gc.enable()

    if job.get("memray", True) and _has("memray"):
        h = _memray_peak(forward_one, workdir / "one.memray")
        mem["heap_peak"], mem["heap_allocations"] = h["peak"], h["allocations"]
        if cfg.stream:
            h = _memray_peak(lambda: eng.stream(cfg.T), workdir / "s.memray")
            mem["stream_growth_heap"] = h["leaked"]
            mem["stream_heap_allocations"] = h["allocations"]
    row["timing"] = tm.summary()
    row["memory"] = mem
    row["loadavg_end"] = os.getloadavg()[0]
    del limiter
    return row


READY = "@@leanrnn-bench ready"  # an interleaved child's line: "I am idle, waiting"


def _sample_when_told(sample, run_once, repeats: int, blocks: int, turns: list):
    """Interleaved sampling (the parent's ``interleaved``): say READY on stdout, then on each
    "sample" line from stdin take turn k's share of the ``repeats`` samples (spread evenly over
    ``blocks`` turns, so the row costs what it would alone) after one untimed call (caches and
    an idle vCPU come back for every engine alike), and say READY again; stop at anything else
    or EOF. Each turn's start goes into ``turns``. Returns (CPU s, wall s) of the samples."""
    cpu = wall = 0.0
    print(READY, flush=True)
    for line in sys.stdin:
        if line.strip() != "sample":
            break
        k = len(turns)
        turns.append(time.time())
        n = repeats * (k + 1) // blocks - repeats * k // blocks
        if n:
            run_once()
            c, w = sample(n)
            cpu, wall = cpu + c, wall + w
        print(READY, flush=True)
    return cpu, wall


def _has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def measure_bandwidth(threads: int, sizes: list[int], big: int = 128 << 20) -> dict:
    """STREAM-style copy bandwidth with ``threads`` threads, (read + written bytes) / second as
    STREAM counts it: best of 5 trials over arrays of ``big`` bytes (beyond the caches) and of
    each size in ``sizes`` (bytes per array). Each thread copies its own slice back and forth
    ``reps`` times inside one compiled call (a plain loop LLVM vectorizes), so small sizes
    measure the cache rather than the call overhead."""
    import threading

    import numba
    import numpy as np

    @numba.njit(nogil=True)
    def copy(a, b, reps):  # a, b: [n] float32; a -> b -> a, reps times in all
        n = a.size
        for _ in range(reps // 2):
            for i in range(n):
                b[i] = a[i]
            for i in range(n):
                a[i] = b[i]

    def best(nbytes: int) -> float:
        n = max(1024, nbytes // 4)
        a = np.ones(n, np.float32)
        b = np.zeros(n, np.float32)
        reps = max(2, min(100_000, int(4e8 // (8 * n)))) // 2 * 2  # ~0.4 GB moved per trial
        step = -(-n // threads)
        parts = [
            (a[k * step : (k + 1) * step], b[k * step : (k + 1) * step]) for k in range(threads)
        ]
        copy(a, b, 2)
        t_best = float("inf")
        for _ in range(5):
            start = threading.Barrier(threads + 1)

            def work(pa, pb, start=start):
                start.wait()
                copy(pa, pb, reps)

            pool = [threading.Thread(target=work, args=ab) for ab in parts]
            for th in pool:
                th.start()
            start.wait()
            t = time.perf_counter()
            for th in pool:
                th.join()
            t_best = min(t_best, (time.perf_counter() - t) / reps)
        return 2 * n * 4 / t_best

    return {
        "threads": threads,
        "dram_bytes": big,
        "dram_copy_Bps": best(big),
        "copy_Bps": {str(s): best(s) for s in sorted(set(sizes))},
    }


def child_main(argv: list[str]) -> int:
    job_path, result_path = Path(argv[0]), Path(argv[1])
    job = json.loads(job_path.read_text())
    try:
        if job["kind"] == "bandwidth":
            bw = measure_bandwidth(job["threads"], job["sizes"], job.get("big", 128 << 20))
            result = {"ok": True, **bw}
        else:
            result = {"ok": True, **run_job(job, job_path.parent)}
    except Exception as e:  # reported in the row; the parent carries on with the suite
        result = {"ok": False, "error": f"{type(e).__name__}: {e}", "trace": traceback.format_exc()}
    result_path.write_text(dumps(result))
    return 0


def _plain(o):
    """JSON-ready copy of ``o``: NumPy scalars to Python, NaN/inf to None (strict JSON)."""
    if isinstance(o, dict):
        return {str(k): _plain(v) for k, v in o.items()}
    if isinstance(o, list | tuple | set):
        return [_plain(v) for v in o]
    if hasattr(o, "item") and not isinstance(o, str | bytes):
        o = o.item()
    if isinstance(o, float) and not math.isfinite(o):
        return None
    if isinstance(o, Path):
        return str(o)
    return o


def dumps(o, indent: int | None = None) -> str:
    return json.dumps(_plain(o), indent=indent, allow_nan=False)


# ------------------------------------------------------------------------- parent side
def child_env(threads: int) -> dict[str, str]:
    env = dict(os.environ)
    for k in THREAD_ENV:
        env[k] = str(threads)
    env["MKL_DYNAMIC"] = "FALSE"
    env["OMP_DYNAMIC"] = "FALSE"
    env["PYTHONUNBUFFERED"] = "1"
    return env


def _mask_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def _busy_cpu_s() -> float:
    """CPU seconds all processes have spent busy since boot (/proc/stat) on the CPUs this
    process may run on (its children inherit the mask): under ``taskset -c 0``, another
    process busy on CPU 0 is in the way and one on CPU 1 is not (the machine's total
    counted both, and missed the first against 2 cores)."""
    try:
        allowed = os.sched_getaffinity(0)
    except AttributeError:  # not Linux
        allowed = None
    busy = 0
    try:
        with open("/proc/stat") as f:
            for line in f:
                name, *rest = line.split()
                if not name.startswith("cpu"):
                    break  # the cpu lines come first
                if (allowed is None and name == "cpu") or (
                    allowed is not None and name[3:].isdigit() and int(name[3:]) in allowed
                ):
                    v = [int(x) for x in rest]
                    busy += sum(v[:8]) - v[3] - (v[4] if len(v) > 4 else 0)  # - idle, iowait
    except (OSError, ValueError):
        return float("nan")
    return busy / os.sysconf("SC_CLK_TCK")


def _children_cpu_s() -> float:
    import resource

    ru = resource.getrusage(resource.RUSAGE_CHILDREN)
    return ru.ru_utime + ru.ru_stime


def spawn(job: dict, threads: int, timeout: float) -> dict:
    """Run ``job`` in a fresh interpreter; returns its result dict (``ok`` False on failure).

    Also reports ``background_cores``: CPU used by everything but the child while it ran, in
    cores (other users of a shared machine make timings noisy; this says how much)."""
    return interleaved({"job": job}, threads, timeout, 0)["job"]


# Before each interleaved turn: time for the previous engine's pool threads to stop spinning
# (OpenMP's and onnxruntime's spin for milliseconds after work) and go to sleep.
TURN_GAP_S = 0.03


class _Child:
    """A child on the spawn protocol whose stdin and stdout stay open (interleaved sampling)."""

    def __init__(self, d: Path, job: dict, threads: int) -> None:
        d.mkdir()
        (d / "job.json").write_text(json.dumps(job))
        self.result, self.err = d / "result.json", open(d / "stderr", "w+")
        self.t0, self.wall, self.pending = time.perf_counter(), 0.0, b""
        # -P: not the caller's working directory on sys.path (a scratch grp.py there stood in
        # for the standard library's and failed every torch row)
        cmd = [sys.executable, "-P", "-m", "leanrnn.bench.harness", str(d / "job.json"),
               str(self.result)]  # fmt: skip
        self.proc = subprocess.Popen(cmd, env=child_env(threads), stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, stderr=self.err)  # fmt: skip

    def ready(self, timeout: float) -> bool:
        """Wait for the child's next READY line (other output is skipped); False if it exited
        or ``timeout`` passed first."""
        import select

        want, deadline = READY.encode(), time.perf_counter() + timeout
        fd = self.proc.stdout.fileno()
        while True:
            lines = self.pending.split(b"\n")
            if any(line.strip() == want for line in lines[:-1]):
                self.pending = b""
                return True
            self.pending = lines[-1]
            left = deadline - time.perf_counter()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                return False
            chunk = os.read(fd, 1 << 16)
            if not chunk:
                return False
            self.pending += chunk

    def tell(self, line: str) -> bool:
        try:
            self.proc.stdin.write(line.encode() + b"\n")
            self.proc.stdin.flush()
            return True
        except OSError:  # it exited
            return False

    def finish(self, timeout: float) -> dict:
        """Close its stdin (an interleaved child then takes its memory figures and exits), wait
        for it, its stdout drained, and read its result."""
        try:
            self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
            return {"ok": False, "error": f"timed out after {timeout:g} s"}
        finally:
            self.wall = time.perf_counter() - self.t0
        if not self.result.exists():
            self.err.seek(0)
            tail = self.err.read().strip().splitlines()[-5:]
            return {
                "ok": False,
                "error": f"child exited {self.proc.returncode}: " + " | ".join(tail),
            }
        res = json.loads(self.result.read_text())
        res["child_wall_s"] = self.wall
        return res


def interleaved(jobs: dict[str, dict], threads: int, timeout: float, blocks: int) -> dict:
    """Run ``jobs`` (engine name -> job, one config) in children alive together and take their
    timed samples in ``blocks`` turns (0: each child runs to the end, one after another): every engine's turn k before any engine's turn k + 1,
    the order rotated every turn, one child busy at a time while the others wait on a pipe.
    A slow spell of a shared machine (seen: a job at 1.3-1.6x its time for seconds at a time,
    on two VMs) then falls on every engine's samples alike, where one process per engine in
    turn put it on whichever engine ran then. Children start one at a time (a load never
    overlaps another's samples) and finish one at a time (their memory figures alone).
    Returns engine name -> result dict, as ``spawn``'s."""
    out: dict[str, dict] = {}
    with tempfile.TemporaryDirectory(prefix="leanrnn-bench-") as d:
        busy0, mine0, t0 = _busy_cpu_s(), _children_cpu_s(), time.perf_counter()
        kids: dict[str, _Child] = {}  # those sampling in turns
        started: list[_Child] = []
        try:
            for i, (name, job) in enumerate(jobs.items()):
                kid = _Child(Path(d) / str(i), job | {"blocks": blocks}, threads)
                started.append(kid)
                if blocks and kid.ready(timeout):
                    kids[name] = kid
                else:  # to the end (blocks 0), or it failed before sampling: its result says
                    out[name] = kid.finish(timeout)
            names = list(kids)
            for b in range(blocks if names else 0):
                for name in names[b % len(names) :] + names[: b % len(names)]:
                    kid = kids[name]
                    if name in out:
                        continue
                    time.sleep(TURN_GAP_S)
                    if not (kid.tell("sample") and kid.ready(timeout)):
                        out[name] = kid.finish(timeout)
            for name, kid in kids.items():
                if name not in out:
                    out[name] = kid.finish(timeout)
        finally:
            for kid in started:
                if kid.proc.poll() is None:
                    kid.proc.kill()
                    kid.proc.wait()
                kid.err.close()
        wall = time.perf_counter() - t0
        others = (_busy_cpu_s() - busy0) - (_children_cpu_s() - mine0)
    for res in out.values():
        res["background_cores"] = max(0.0, others / wall) if wall > 0 else float("nan")
        # busy() reads it, on whatever machine renders: the CPUs _busy_cpu_s counted (the
        # mask's; a cgroup quota of 2 on a 64-CPU host compared 64 CPUs' load against 2)
        res["cores"] = _mask_cpus()
    return out


# ------------------------------------------------------------------------- the suite
DEFAULT_ENGINES = (
    "leanrnn",
    "numpy-naive",
    "numpy-prealloc",
    "torch",
    "torch-nodnnl",
    "onnxruntime",
    "mnn",
)
DEFAULT_SHAPES = ((1, 100), (64, 100), (1, 1000))  # (N, T) full-sequence runs


@dataclass
class Options:
    """What to run and how hard to measure it. ``shapes`` are (N, T) full-sequence runs;
    ``stream_steps`` > 0 adds one streaming config (N=1) per cell and H."""

    engines: tuple[str, ...] = DEFAULT_ENGINES
    cells: tuple[str, ...] = ("lstm", "gru")
    hidden: tuple[int, ...] = (128, 512, 1024)
    shapes: tuple[tuple[int, int], ...] = DEFAULT_SHAPES
    stream_steps: int = 100
    threads: tuple[int, ...] = (1, 2)
    warmup: int = 3
    repeats: int = 15
    min_repeats: int = 3
    min_sample_s: float = 0.005
    max_time_s: float = 3.0  # sampling budget per row (after warm-up)
    # Each row measured in this many processes, rounds interleaved in time (every row once,
    # then every row again...), reported from the process with the median time: one process
    # landing in a slow spell of a shared machine (here: 7.5 vs 9.0 ms for the same job, for
    # seconds at a time) then no longer decides a ratio.
    rounds: int = 1
    # > 0: a config's engines run in children alive together, their samples taken in this
    # many interleaved turns (``interleaved``); 0: one child per engine, one after another.
    interleave: int = 5
    timeout_s: float = 900.0
    memray: bool = True
    bandwidth: bool = True
    bandwidth_bytes: int = 128 << 20  # STREAM arrays: well beyond the last-level cache
    out: Path = Path("bench-out")

    @classmethod
    def quick(cls, **kw) -> Options:
        """LSTM and GRU, H 128 and 512, (N=1, T=100), (N=64, T=100) and streaming, 1 thread,
        shorter sampling: about two minutes on a 2-core machine."""
        base = dict(
            cells=("lstm", "gru"),
            hidden=(128, 512),
            shapes=((1, 100), (64, 100)),
            threads=(1,),
            warmup=2,
            repeats=7,
            max_time_s=1.0,
        )
        return cls(**(base | kw))

    def configs(self) -> list[Config]:
        out = []
        for cell in self.cells:
            for H in self.hidden:
                shapes = [(N, T, False) for N, T in self.shapes]
                if self.stream_steps > 0:
                    shapes.append((1, self.stream_steps, True))
                for N, T, stream in shapes:
                    for n in self.threads:
                        out.append(Config(cell, H, N, T, stream, n))
        return out

    def as_dict(self) -> dict:
        d = dict(self.__dict__)
        d["out"] = str(self.out)
        return d


def _progress(total: int, stream=None):
    """(describe, advance, stop) for ``total`` jobs. On a terminal, a live bar (rich if
    installed, else tqdm); otherwise (a file, a pipe, CI logs) one plain line per finished job,
    since a bar redrawn in place leaves only its last, truncated frame in a file.
    ``advance(note)`` ends the current job; ``note`` (e.g. its status) goes on its line."""
    stream = sys.stderr if stream is None else stream
    if not _is_tty(stream):
        return _plain_progress(total, stream)
    try:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        prog = Progress(
            TextColumn("[bold]bench[/]"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            TextColumn("eta"),
            TimeRemainingColumn(),
            TextColumn("{task.description}"),
            transient=False,
            console=Console(file=stream),
        )
        prog.start()
        task = prog.add_task("", total=total)
        return (
            lambda desc: prog.update(task, description=desc),
            lambda note="": prog.advance(task),
            prog.stop,
        )
    except ImportError:
        pass
    try:
        from tqdm import tqdm

        bar = tqdm(total=total, unit="job", dynamic_ncols=True, file=stream)
        return bar.set_description_str, lambda note="": bar.update(1), bar.close
    except ImportError:
        return _plain_progress(total, stream)


def _is_tty(stream) -> bool:
    try:
        return bool(stream.isatty())
    except (AttributeError, ValueError):  # no isatty, or a closed stream
        return False


def _plain_progress(total: int, stream):
    state = {"done": 0, "desc": "", "t0": time.perf_counter()}

    def describe(desc: str) -> None:
        state["desc"], state["t0"] = desc, time.perf_counter()

    def advance(note: str = "") -> None:
        state["done"] += 1
        took = time.perf_counter() - state["t0"]
        tail = f"  {note}" if note else ""
        print(f"[{state['done']}/{total}] {state['desc']}  {took:.1f} s{tail}", file=stream,
              flush=True)  # fmt: skip

    return describe, advance, lambda: None


def _note(row: dict) -> str:
    """A finished row in a few words: its status and, when measured, its median time."""
    med = (row.get("timing") or {}).get("median_s")
    return row.get("status", "?") + (f", median {med * 1e3:.3g} ms" if med is not None else "")


def machine_info() -> dict:
    import platform
    from importlib import metadata

    versions = {}
    for dist in ("leanrnn", "numpy", "numba", "torch", "onnxruntime", "onnx", "MNN", "memray"):
        try:
            versions[dist] = metadata.version(dist)
        except metadata.PackageNotFoundError:
            versions[dist] = None
    from ..kernels._cpu import cpu_name, describe  # the ISA and caches the kernels were tiled for

    return {
        "cpu": cpu_name(),
        "cpu_detail": describe(),
        "cores": config.cores(),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "versions": versions,
        "loadavg": os.getloadavg(),
        # The switches that change which kernels and tiles leanrnn runs (kernels._cpu, runner,
        # products), as set for this run: the children inherit them.
        "settings": {k: v for k, v in os.environ.items() if k in RUN_SWITCHES},
    }


RUN_SWITCHES = ("LEANRNN_BACKEND", "LEANRNN_ISA", "LEANRNN_AMX", "LEANRNN_GEMM")


def _engine_status(names) -> dict[str, str | None]:
    from .engines import resolve

    status = {}
    for name in names:
        try:
            status[name] = resolve(name).unavailable()
        except Exception as e:  # an unknown plugin is reported, not fatal
            status[name] = f"{type(e).__name__}: {e}"
    return status


def _prepare_models(cfg: Config, need: set[str], models: Path, cache: dict) -> dict[str, str]:
    """ONNX (fixed shapes) and MNN files for ``cfg``; values are paths or 'error: ...'.
    ``cache`` maps model keys to what was already made, so each file is made once."""
    from .engines import convert_mnn_command
    from .problem import write_onnx

    files = cache.setdefault(cfg.model_key, {})
    onnx_path = models / f"{cfg.model_key}.onnx"
    mnn_path = models / f"{cfg.model_key}.mnn"
    if need & {"onnx", "mnn"} and "onnx" not in files:
        try:
            write_onnx(cfg, onnx_path)
            files["onnx"] = str(onnx_path)
        except Exception as e:
            files["onnx"] = f"error: ONNX export failed: {type(e).__name__}: {e}"
    if "mnn" in need and "mnn" not in files:
        if files["onnx"].startswith("error"):
            files["mnn"] = files["onnx"]
        else:
            files["mnn"] = _convert_mnn(convert_mnn_command(onnx_path, mnn_path), mnn_path)
    return files


def _convert_mnn(cmd: list[str], mnn_path: Path) -> str:
    """Run MNNConvert in its own process; the model's path, or 'error: <the converter's last
    words>'."""
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300, env=child_env(1))
    except Exception as e:
        return f"error: MNNConvert failed: {type(e).__name__}: {e}"
    log = (proc.stdout + proc.stderr).strip().splitlines()
    if (
        proc.returncode != 0
        or not mnn_path.exists()
        or not any("Converted Success" in ln for ln in log)
    ):
        return "error: MNNConvert failed: " + " | ".join(log[-3:])
    return str(mnn_path)


def run_suite(opts: Options, progress: bool = True) -> dict:
    """Run every (engine, config) of ``opts`` in its own process; returns the results dict
    (also written to ``opts.out / results.json``)."""
    from .engines import resolve

    out = Path(opts.out)
    (out / "cache").mkdir(parents=True, exist_ok=True)
    configs = opts.configs()
    status = _engine_status(opts.engines)
    needs = {}
    for name in opts.engines:
        needs[name] = set(resolve(name).files) if status[name] is None else set()
    jobs = [(cfg, name) for _ in range(opts.rounds) for cfg in configs for name in opts.engines]
    n_bw = len(opts.threads) if opts.bandwidth else 0
    describe, advance, stop = (
        _progress(len(jobs) + n_bw)
        if progress
        else (lambda d: None, lambda n="": None, lambda: None)
    )
    results: dict = {
        "schema": SCHEMA,
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
        "options": opts.as_dict(),
        "machine": machine_info(),
        "engines": {
            n: {"unavailable": status[n], "description": _describe(n), "precision": _precision(n)}
            for n in opts.engines
        },
        "bandwidth": {},
        "rows": [],
        "fields": FIELDS,
    }
    model_cache: dict = {}
    try:
        if opts.bandwidth:
            sizes = sorted({c.weight_bytes for c in configs})
            for n in opts.threads:
                describe(f"memory bandwidth, {n} thread(s)")
                job = {"kind": "bandwidth", "threads": n, "sizes": sizes}
                job["big"] = opts.bandwidth_bytes
                results["bandwidth"][str(n)] = spawn(job, n, opts.timeout_s)
                advance()
        # One group per (round, config): its engines one after another, or interleaved.
        step = len(opts.engines) if opts.interleave else 1
        for at in range(0, len(jobs), step):
            group = jobs[at : at + step]
            cfg = group[0][0]
            who = group[0][1] if len(group) == 1 else f"{len(group)} engines"
            describe(f"{who:<14} {cfg.label}, {cfg.threads} thread(s)")
            planned = {}
            for _, name in group:
                files: dict[str, str] = {}
                reason = status[name] or resolve(name).unsupported(cfg)
                if reason is None and needs[name]:
                    made = _prepare_models(cfg, needs[name], out / "models", model_cache)
                    files = {k: made[k] for k in needs[name]}
                    bad = [v for v in files.values() if v.startswith("error")]
                    reason = bad[0][len("error: ") :] if bad else None
                planned[name] = _plan_row(opts, cfg, name, files, reason)
            todo = {n: job for n, (_, job) in planned.items() if job is not None}
            if opts.interleave and todo:
                got = interleaved(todo, cfg.threads, opts.timeout_s, opts.interleave)
            else:
                got = {n: spawn(job, cfg.threads, opts.timeout_s) for n, job in todo.items()}
            for name, (row, _) in planned.items():
                row = _finish_row(row, got[name]) if name in got else row
                results["rows"].append(row)
                results["rows"] = _merge_rounds(results["rows"])
                advance(f"{name}: {_note(row)}" if len(group) > 1 else _note(row))
            # Saved after every group: an interrupted run keeps what it measured.
            write_text(out / "results.json", dumps(results, indent=1))
    finally:
        stop()
    for r in results["rows"]:
        r.pop("_rounds", None)
    results["machine"]["loadavg_end"] = os.getloadavg()
    write_text(out / "results.json", dumps(results, indent=1))
    return results


def _merge_rounds(rows: list[dict]) -> list[dict]:
    """One row per (engine, config): of the rounds measured so far, the row whose median time
    is the median (the lower middle for an even count); ``timing.round_medians_s`` keeps
    every round's median. A failed round (error, mismatch) wins, so it is never hidden."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        key = (r["engine"], json.dumps(r["config"], sort_keys=True))
        groups.setdefault(key, []).extend(r.get("_rounds", [r]))
    out = []
    for members in groups.values():
        bad = [m for m in members if m.get("status") != "ok"]
        if bad or len(members) == 1:
            pick = dict(bad[0] if bad else members[0])
        else:
            ranked = sorted(members, key=lambda m: m["timing"]["median_s"])
            pick = dict(ranked[(len(ranked) - 1) // 2])
            pick["timing"] = dict(pick["timing"])
            pick["timing"]["round_medians_s"] = [m["timing"]["median_s"] for m in members]
        pick["_rounds"] = [{k: v for k, v in m.items() if k != "_rounds"} for m in members]
        out.append(pick)
    return out


def _plan_row(opts: Options, cfg: Config, name: str, files: dict, unavailable: str | None):
    """(row, job): the results row's fixed fields and the child's job, or the row marked
    unavailable with the reason and no job."""
    from .problem import reference_file

    row = {"engine": name, "config": cfg.as_dict(), "label": cfg.label, "files": files}
    if unavailable is not None:
        return row | {"status": "unavailable", "reason": unavailable}, None
    job = {
        "kind": "engine",
        "engine": name,
        "config": cfg.as_dict(),
        "files": files,
        "ref": str(reference_file(cfg, Path(opts.out) / "cache")),
        "warmup": opts.warmup,
        "repeats": opts.repeats,
        "min_repeats": opts.min_repeats,
        "min_sample_s": opts.min_sample_s,
        "max_time_s": opts.max_time_s,
        "memray": opts.memray,
    }
    return row, job


def _finish_row(row: dict, res: dict) -> dict:
    """The row with its child's result: measured, or the error / mismatch it hit."""
    if not res.pop("ok"):
        return row | {"status": "error", "reason": res.get("error"), "trace": res.get("trace")}
    v = res["verify"]
    reason = None if v["ok"] else f"max abs error {v['worst']:.3g} > tolerance {v['tolerance']}"
    return row | {"status": "ok" if v["ok"] else "mismatch", "reason": reason} | res


def _describe(name: str) -> str:
    from .engines import resolve

    try:
        return resolve(name).description
    except Exception:
        return ""


def _precision(name: str) -> str:
    """The engine's weight precision ("float" for the float32 engines and unknown plugins)."""
    from .engines import resolve

    try:
        return resolve(name).precision
    except Exception:
        return "float"


FIELDS = {
    "rows[].status": "ok | mismatch (outputs differ from the float64 reference; still timed) | "
    "error (the child failed; see reason) | unavailable (not installed or model conversion failed)",
    "rows[].verify": "max abs error of y, h_n, c_n vs the float64 reference, and the tolerance",
    "rows[].timing.samples_s": "raw samples: seconds per unit (a forward, or a step if streaming)",
    "rows[].timing.median_s": "median of samples_s: the figure in the tables",
    "rows[].timing.round_medians_s": "with rounds > 1: each process's median_s; the row shown "
    "is the process with the median of these",
    "rows[].timing.inner": "units timed together per sample",
    "rows[].timing.cpu_util": "process CPU time / wall time while sampling (≈ threads used)",
    "rows[].import_s": "importing the engine's library in a fresh process (the child harness "
    "imports leanrnn first, so leanrnn's own import is not in its figure)",
    "rows[].files": "model files the engine loaded (ONNX for onnxruntime, MNN for mnn)",
    "rows[].cold_s": "model load + first run (imports excluded)",
    "rows[].memory.cold_peak": "peak RSS increase over load + first run, bytes",
    "rows[].memory.cold_retained": "RSS increase still held after load + first run, bytes",
    "rows[].memory.warm_peak": "peak RSS increase over the warm timed runs (peak reset first)",
    "rows[].memory.warm_growth": "RSS after the timed runs minus before",
    "rows[].memory.heap_peak": "memray: peak live native allocations in one warm forward/step",
    "rows[].memory.stream_growth_rss": "streaming rows: RSS growth over 100 more steps",
    "rows[].memory.stream_growth_heap": "streaming rows: bytes allocated and not freed over 100 "
    "steps (memray)",
    "rows[].threadpools": "threadpoolctl's view of BLAS/OpenMP pools after limiting",
    "rows[].thread_info": "the engine's own thread settings as it reports them",
    "rows[].os_threads": "OS threads in the child after the first run (pools included)",
    "rows[].background_cores": "CPU used by other processes while the row ran, in cores",
    "rows[].cores": "the cores of the machine that measured the row (the busy mark's measure)",
    "rows[].ran_on": "what the engine resolved to run on after its first forward (leanrnn: "
    "kernels native or jit)",
    "bandwidth[threads]": "STREAM-style copy, (read + written bytes)/s, DRAM-sized and per "
    "recurrent-weight size",
}


if __name__ == "__main__":
    sys.exit(child_main(sys.argv[1:]))
