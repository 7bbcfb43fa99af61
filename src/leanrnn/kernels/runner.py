"""Runs the jobs (abi.ARGS) for the engine: on the ahead-of-time compiled module when this
machine has one (kernels.native), else on numba's JIT (kernels.ops) — same code, same results.

Backend (``LEANRNN_BACKEND``, or config.set_backend):
- ``auto`` (default): the native module; built on first use in a subprocess (``python -m
  leanrnn.kernels.aot``, BUILD_TIME, its progress shown on stderr) so this process never loads
  numba at all. If it cannot be built (no C compiler), the reason is kept in the build
  directory's FAILED file (native.failure), logged, and the JIT runs instead. If the cache
  cannot be written, the build goes to config.temp_cache_dir(), with a warning.
- ``native``: the native module or an error; ``jit``: numba's JIT only.

One multi-threaded launch runs at a time in the process (threads.POOL_LAUNCH, with the rest of
the threading policy); sessions on different Python threads take turns. A launch made on a
thread that is inside one already (a signal handler running a model, between two bytecodes of
a run) runs its jobs on that thread alone: waiting for the launch it interrupted would wait for
ever. The native kernels allow it (threads=1 runs every job in turn, without the team, which
is idle whenever Python code runs on the launching thread); on the JIT, whose pool may still be
running the interrupted launch's jobs, not on that launch's own session (a LeanRNNError).

Cache upkeep (kernels.native): each process marks the fingerprint folders it uses, and a
successful build prunes those of other fingerprints unused for native.PRUNE_AFTER_DAYS days.

Programs (native backend only): ``program`` binds the ops of one call once — their arguments
marshalled into slots, the state copies around them as address ranges — and ``run_program``
runs them passing only a new x and y, checked in C (a streaming step: engine.stream).
"""

from __future__ import annotations

import contextlib
import logging
import os
import queue
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

from .. import config
from .. import threads as _threads
from ..errors import LeanRNNError
from . import abi, native

_log = logging.getLogger("leanrnn")
# What a cold build (numba's cache cold too) costs, as told to whoever waits for one. `leanrnn
# compile` into empty caches, on the README's 2-core VM: ~120 s of CPU (121 s and 127 s, in 216 s
# and 499 s of wall time while other jobs loaded it), split over the 2 cores with float32 the
# larger half; a first `leanrnn demo` on an idle new machine took 82 s. Since then the reduced-
# precision jobs (bf16, int8, int8-dynamic with its VNNI/AMX tiles) roughly tripled it: 2026-12-01
# on an idle 2-core Xeon, 340 s of CPU in 213 s of wall time (about 5 minutes on a Zen 3). The
# help texts of commands/compile.py and info.py show this string. Session 22, a Sapphire
# Rapids-class Xeon VM (2 vCPU): 807 s of CPU in 483 s of wall time, idle; session 24, the same
# VM in a slow phase: 969 s of CPU in 647 s; session 27, the same VM: 816 s of CPU in 412 s, and
# 380 s in CI with the test extras installing beside it.
BUILD_TIME = "about 3-11 minutes on 2 cores"
# + directory, fingerprint. -P: the caller's working directory stays off the child's sys.path
# (a json.py or grp.py lying there would stand in for the standard library's; it did for bench).
_BUILD = [sys.executable, "-P", "-m", "leanrnn.kernels.aot"]
_RESOLVE = threading.Lock()
_launch: tuple = ()  # (job, args) of the multi-threaded launch in progress, if any (_nested)
pool_threads = _threads.pool_threads  # looked up here at each launch (tests replace it)


def _renew_lock() -> None:
    """In a forked child: another thread of the parent may have been resolving the backend, and
    no thread of the child will ever release its lock (threads renews POOL_LAUNCH itself), or
    inside a launch (which the child is not)."""
    global _RESOLVE, _launch
    _RESOLVE, _launch = threading.Lock(), ()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_lock)


class _Native:
    name = "native"

    def __init__(self, mod) -> None:
        self._run, self._bind, self._run_program = mod.run, mod.bind, mod.run_program
        self._set_openmp, self._openmp_set = mod.set_openmp, False
        self.path = mod.__file__
        # (job, dtype char) -> entry index; checked against abi so a stale build cannot run.
        rows = {symbol: (i, kinds) for i, (symbol, kinds) in enumerate(mod.entries())}
        self._index, self._kinds = {}, {}
        for job in abi.ARGS:
            for dtype in abi.JOBS[job].dtypes:
                letter = abi.DTYPES[dtype]
                symbol = abi.entry_name(job, dtype)
                if symbol not in rows:
                    raise ImportError(f"{self.path} lacks entry {symbol}")
                i, kinds = rows[symbol]
                if kinds != abi.entry_kinds(job, dtype):
                    raise ImportError(f"{self.path}: {symbol} has kinds {kinds}")
                self._index[job, letter] = i
                self._kinds[i] = kinds

    def run(self, job: str, args: tuple, parts: int, threads: int, openmp: bool = False) -> None:
        if openmp and not self._openmp_set:  # once: a forked child keeps its own threads
            self._set_openmp(_threads.gnu_openmp_parallel())
            self._openmp_set = True
        self._run(self._index[job, args[0].dtype.char], args, parts, threads, openmp)

    def program(self, ops: list, x_at: tuple[int, str], y_at: tuple[int, str]) -> Program:
        """See program(); the layout is native.c's (programs)."""
        words, keep, at = [len(ops), -1, 0, 0, -1, 0, 0], [], {}
        for i, (job, args, parts, pre, post) in enumerate(ops):
            entry = self._index[job, args[0].dtype.char]
            slots = self._bind(entry, args)  # checks every argument, as run does
            kinds, base = self._kinds[entry], len(words) + 3
            for where, (op, name) in ((1, x_at), (4, y_at)):
                if op == i:  # the slot of the array passed at each run, and its kind
                    k = abi.JOBS[job].names().index(name)
                    offset = sum(1 + int(kinds[2 * j + 1]) for j in range(k))
                    at[where] = (base + offset, args[k].ndim, args[k].dtype.num)
            words += [entry, parts, len(slots), *slots.tolist()]
            for side in (pre, post):
                triples = [t for dst, src in side for t in _copies(dst, src)]
                words += [len(triples), *(v for t in triples for v in t)]
            keep.append((args, pre, post))  # the slots and copies point into them
        for where, (slot, nd, num) in at.items():
            words[where : where + 3] = [slot, nd, num]
        return Program(np.array(words, np.int64), self, max(op[2] for op in ops), keep)


class _Jit:
    """numba's JIT: each job (kernels.ops) runs on a Python thread of threads.job_pool, the GIL
    released (nogil), as the native module runs them on its C team. Not on numba's own pool (a
    ``prange`` over the jobs, as it once was): compiling that op cost as much again as the job
    itself, for every job and dtype (the tests' JIT warm-up on an idle 2-core Xeon: 338 s of
    compiling with the ops, 129 s without), and one more thread pool came into the process."""

    name = "jit"
    path = None

    def __init__(self) -> None:
        from . import ops

        self._jobs = ops.JOBS

    def run(self, job: str, args: tuple, parts: int, threads: int, openmp: bool = False) -> None:
        # (openmp: the native team's mode; these threads are Python's in either case)
        fn = self._jobs[job]
        threads = min(threads, parts)

        def jobs(first: int) -> None:  # as a static prange schedule: me = first, first+threads..
            for me in range(first, parts, threads):  # (each finds what the others left)
                fn(*args, me)

        if threads < 2:  # every job on this thread, in turn
            jobs(0)
            return
        futures = [_threads.job_pool(threads - 1).submit(jobs, i) for i in range(1, threads)]
        try:
            jobs(0)
        finally:
            for f in futures:
                f.result()


_backend: _Native | _Jit | None = None
_choice = ""  # the config.backend() that _backend was resolved for


def run(job: str, args: tuple, parts: int) -> None:
    """Job ``job`` (abi.ARGS; ``args`` ends with sync, parts) as ``parts`` jobs."""
    global _launch
    b = _backend if _choice == config.backend() else backend()
    if parts == 1:
        b.run(job, args, 1, 1)
        return
    if _threads.launching():  # re-entered on this thread (module docstring)
        _nested(b, job, args)
        b.run(job, args, parts, 1)
        return
    with _threads.POOL_LAUNCH:
        _launch = (job, args)
        try:
            b.run(job, args, parts, pool_threads(parts), _threads.on_openmp())
        finally:
            _launch = ()


def _nested(b: _Native | _Jit, job: str, args: tuple) -> None:
    """Check that a launch re-entered on the launching thread can run there alone: not on the
    JIT while the launch it interrupted, which the JIT's pool may still be running, works on
    the same sync array (the same session: both would claim from it and wait on each other's
    counts)."""
    if not isinstance(b, _Jit) or not _launch:
        return
    outer_job, outer_args = _launch
    outer = outer_args[abi.JOBS[outer_job].names().index("sync")]
    if np.may_share_memory(outer, args[abi.JOBS[job].names().index("sync")]):
        raise LeanRNNError(
            "[run] a model was run while a run of the same model was in progress on this thread "
            "(from a signal handler, or other code that interrupts a run): on the JIT backend "
            "that cannot be done; run another model object there (one with the same weights), "
            "or defer the work until the run returns"
        )


class Program:
    """The ops of one engine call bound once in the native module (native.c, programs): each
    op's arguments marshalled into slots, and the copies around it (state in, state out) as
    address ranges. ``run_program`` then passes only the call's x and y: a streaming step's
    ~30 arguments per op and its numpy copies cost nothing per call. ``keep`` holds every
    array the slots and copies point into."""

    __slots__ = ("array", "backend", "keep", "parts")

    def __init__(self, array: np.ndarray, backend: _Native, parts: int, keep: list) -> None:
        self.array, self.backend, self.parts, self.keep = array, backend, parts, keep


def _address(a: np.ndarray) -> int:
    return a.__array_interface__["data"][0]


def _copies(dst: np.ndarray, src: np.ndarray | None) -> list[tuple[int, int, int]]:
    """(dst, src, bytes) address ranges of ``dst[...] = src`` (src None: zeros), for arrays
    of one shape and dtype whose rows (last axis) are contiguous."""
    assert src is None or (src.shape == dst.shape and src.dtype == dst.dtype), (dst, src)
    arrays = [a for a in (dst, src) if a is not None]
    assert all(a.strides[-1] == a.itemsize for a in arrays), "rows must be contiguous"
    if all(a.flags.c_contiguous for a in arrays):
        return [(_address(dst), _address(src) if src is not None else 0, dst.nbytes)]
    assert dst.ndim == 2, dst.shape
    row = dst.shape[1] * dst.itemsize
    return [
        (_address(dst) + r * dst.strides[0],
         _address(src) + r * src.strides[0] if src is not None else 0, row)
        for r in range(dst.shape[0])
    ]  # fmt: skip


def binds() -> bool:
    """Whether this process's backend binds programs (the native module does, the JIT not)."""
    return isinstance(_backend if _choice == config.backend() else backend(), _Native)


def program(ops: list, x_at: tuple[int, str], y_at: tuple[int, str]) -> Program | None:
    """``ops`` bound once for run_program; None when this process runs numba's JIT (the
    caller then takes its general path). ``ops``: (job, args, parts, pre, post) in order,
    ``pre``/``post`` the copies before/after the op as (dst, src) pairs of arrays (src None:
    zero-fill dst; rows contiguous); ``x_at``/``y_at``: (op, argument name) of the input and
    output arrays each run passes anew (bound here to stand-ins of their shape)."""
    b = _backend if _choice == config.backend() else backend()
    if not isinstance(b, _Native):
        return None
    return b.program(ops, x_at, y_at)


def run_program(prog: Program, x: np.ndarray, y: np.ndarray) -> bool:
    """Run ``prog`` with ``x`` and ``y``; False, with nothing run, when they do not fit what it
    was bound with (ndarray, dtype, shape, C-contiguous, aligned, y writable and apart from x)
    or the backend has changed since: the caller's general path then checks and runs."""
    if prog.backend is not _backend or _choice != config.backend():
        return False
    b = prog.backend
    if prog.parts == 1 or _threads.launching():  # (launching: re-entered, see run)
        return b._run_program(prog.array, x, y, 1)
    with _threads.POOL_LAUNCH:
        return b._run_program(prog.array, x, y, pool_threads(prog.parts))


def backend() -> _Native | _Jit:
    """The backend this process runs on (resolved on first use)."""
    global _backend, _choice
    with _RESOLVE:
        choice = config.backend()
        if _backend is None or choice != _choice:
            _backend, _choice = _resolve(choice), choice
        return _backend


def _resolve(choice: str) -> _Native | _Jit:
    config.check_env()  # a bad LEANRNN_* variable fails the first kernel call, not the import
    if choice == "jit":
        return _jit()
    try:
        mod = native_module(build=True)
    except (ImportError, OSError) as e:
        mod, why = None, f"{type(e).__name__}: {e}"
    else:
        why = "" if mod else _failure()
    if mod is not None:
        return _Native(mod)
    if choice == "native":
        raise LeanRNNError(f"[backend] LEANRNN_BACKEND=native, but the native kernels are not "
                           f"available: {why.strip()}")  # fmt: skip
    _log.warning("leanrnn: running numba's JIT kernels; the native ones are not available: %s",
                 why.strip())  # fmt: skip
    return _jit()


def _jit() -> _Jit:
    """The JIT backend, its build directory's fingerprint marked used (_mark_used: after
    _Jit(), which picks numba's cache folder)."""
    import warnings

    raw = os.environ.get("NUMBA_NUM_THREADS", "").strip()
    if raw and not (raw.isdecimal() and int(raw) > 0):  # numba's own error is a traceback
        raise LeanRNNError(
            f"[backend] NUMBA_NUM_THREADS={raw!r}: numba's JIT kernels (the backend running "
            "here) need a positive integer; set one, or unset it to use every core"
        )
    from numba.core.errors import NumbaIRAssumptionWarning

    # numba's own note on IR it generated from the kernels (four ~12-line blocks asking the
    # user to report it to numba, at the first compile of a float64 LSTM): not the user's.
    # Only for leanrnn's kernels (numba names their source in the message); the user's own
    # numba code keeps its warnings
    warnings.filterwarnings("ignore", message=r"(?s).*leanrnn[/\\]kernels",
                            category=NumbaIRAssumptionWarning)  # fmt: skip
    jit = _Jit()
    _mark_used(where())
    return jit


def _mark_used(d: Path) -> None:
    """This process uses the build directory ``d`` and numba's cache of its fingerprint (named
    ``d``): mark both used, so that no prune removes them (native.mark_used: a stat, a touch at
    most daily). After _Jit(), if any: kernels._jit picks numba's cache folder."""
    native.mark_used(d)
    native.mark_used(config.numba_cache_dir(d.name))


def _prune(root: Path, fp: str) -> None:
    """After a successful build: remove the cache folders of other fingerprints (older
    versions, other numba/numpy/Python/CPU) unused for native.PRUNE_AFTER_DAYS days."""
    try:
        removed = native.prune(root, keep=fp)
    except Exception as e:  # pragma: no cover - prune never raises; a build must not fail on it
        _log.debug("leanrnn: pruning the kernel cache %s failed: %s", root, e)
        return
    if removed:
        _log.info("leanrnn: removed %d kernel cache folders unused for %d days from %s (%.1f MB)",
                  len(removed), native.PRUNE_AFTER_DAYS, root,
                  sum(n for _, n in removed) / 1e6)  # fmt: skip


def _failure() -> str:
    return native.failure(where()) or "not built"


_where: Path | None = None  # the build directory native_module last used


def where() -> Path:
    """The build directory this process uses: the cache's (native.build_dir), or the private
    temp one when the cache could not be written."""
    return _where or native.build_dir()


# Seconds between tries of a build lock another process holds.
LOCK_POLL = 0.5


@contextlib.contextmanager
def _exclusive(f):
    """Hold an exclusive lock on file ``f``: another process may be building right now (where
    there is no fcntl, concurrent builds just both publish, atomically)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    # Another process holding it for more than a moment is building: said, with the clock
    # ticking (a process waiting on another's build printed nothing for minutes, and looked
    # hung); a moment's hold (loading what another built) goes unsaid
    shown, tries = None, 0
    try:
        while True:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                tries += 1
                if shown is None and tries * LOCK_POLL >= 1.0:
                    shown = Progress(sys.stderr, "another process is compiling the kernels "
                                     f"for this machine ({BUILD_TIME}); waiting for it")  # fmt: skip
                elif shown is not None:
                    shown.tick()
                time.sleep(LOCK_POLL)
    finally:  # (a Ctrl-C while waiting ends the line too)
        if shown is not None:
            shown.close("its build is over" if sys.exc_info()[0] is None else "stopped waiting")
    try:
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)


def native_module(build: bool):
    """The native module for this machine, building it first (in a subprocess, one process at
    a time) if ``build`` and no failure stands (native.failure); None if there is none. A
    broken or foreign module is never run: ImportError, or with ``build`` it is rebuilt.
    Where the cache cannot be written, builds go to config.temp_cache_dir() (a warning says
    so; OSError if that cannot be written either)."""
    global _where
    fp = native.fingerprint()
    d = _where = native.build_dir(fp)
    try:
        mod = native.load(d, fp)
    except ImportError:
        if not build:
            raise
        mod = None
    if mod is not None:
        _mark_used(d)
        return mod
    if not build:  # a build made in the temp dir by an earlier process, if any
        tmp = config.temp_cache_dir(create=False)
        if tmp is None or not native.build_dir(fp, tmp).is_dir():
            return None
        _where = native.build_dir(fp, tmp)
        mod = native.load(_where, fp)
        if mod is not None:
            _mark_used(_where)
        return mod
    if not config.writable(d):
        d = _where = _temp_build_dir(fp)
        try:
            mod = native.load(d, fp)
        except ImportError:
            mod = None
        if mod is not None:
            _mark_used(d)
            return mod
    if native.failure(d, fp):
        return None
    built = False
    with open(d / ".lock", "w") as lock, _exclusive(lock):
        try:
            mod = native.load(d, fp)  # another process may have built it meanwhile
        except ImportError as e:
            _log.warning("leanrnn: rebuilding a broken native module: %s", e)
            native.discard(d)
            mod = None
        if mod is None and not native.failure(d, fp):
            _build(d, fp)
            mod = native.load(d, fp)
            built = mod is not None
    if mod is not None:
        _mark_used(d)
    if built:  # (our lock released: prune takes other fingerprints' locks only)
        _prune(d.parent.parent, fp)
    return mod


def _temp_build_dir(fp: str) -> Path:
    root = config.temp_cache_dir()
    d = native.build_dir(fp, root) if root else None
    if d is None or not config.writable(d):
        raise OSError(f"[native] cannot write the kernel cache {native.cache_root()} nor a "
                      f"private temp dir ({d}); set LEANRNN_CACHE_DIR to a writable directory")  # fmt: skip
    _log.warning("leanrnn: cannot write the kernel cache %s (LEANRNN_CACHE_DIR); using %s "
                 "instead, which the OS may clear: set LEANRNN_CACHE_DIR to a writable directory "
                 "to keep the build", native.cache_root(), root)  # fmt: skip
    return d


def _dies_with_us():
    """A preexec_fn asking Linux to kill the build when this thread's process dies (prctl
    PR_SET_PDEATHSIG; its pool workers already die with it, aot._die_with_parent): a SIGTERM
    or SIGKILL to this process alone (kill PID, a supervisor, the OOM killer) left the build
    running, orphaned, until its next progress line broke the pipe and it recorded a failure
    that kept the native kernels off for RETRY_AFTER. None off Linux. The libc function is
    looked up here, before the fork: the child only calls it."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes
    import signal

    try:
        prctl = ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None
    set_pdeathsig, kill = 1, int(signal.SIGKILL)  # PR_SET_PDEATHSIG (linux/prctl.h)

    def preexec() -> None:
        prctl(set_pdeathsig, kill, 0, 0, 0)

    return preexec


def _build(d: Path, fp: str) -> None:
    """Build into ``d`` in a subprocess (kernels.aot), showing its progress on stderr; a death
    without a reason (killed, out of memory) is recorded as a transient failure."""
    shown = Progress(sys.stderr, f"compiling the kernels for this machine, once ({BUILD_TIME})")
    proc = subprocess.Popen([*_BUILD, str(d), fp], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True,
                            preexec_fn=_dies_with_us())  # fmt: skip
    lines: queue.Queue = queue.Queue()
    errors: list[str] = []

    def pump_out() -> None:  # the build's progress lines, one per event
        for line in proc.stdout:
            lines.put(line.strip())
        lines.put(None)

    def pump_err() -> None:  # both pipes drain, so neither can fill and stall the build
        errors.append(proc.stderr.read())

    threads = [threading.Thread(target=f, daemon=True) for f in (pump_out, pump_err)]
    for t in threads:
        t.start()
    try:
        while (line := _next(lines, shown)) is not None:
            if line:
                shown.event(line)
        code = proc.wait()
    finally:  # interrupted (Ctrl-C, an exception): the build stops with us
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    for t in threads:
        t.join()
    shown.close("done" if code == 0 else f"failed (exit {code})")
    if code and not native.failure(d, fp):  # it died before saying why
        native.record_failure(d, f"exit {code}: {''.join(errors)[-2000:]}", True, fp)


def _next(lines: queue.Queue, shown: Progress) -> str | None:
    """The build's next line (None: it closed its output), ticking the clock while it waits."""
    while True:
        try:
            return lines.get(timeout=1.0)
        except queue.Empty:
            shown.tick()


class Progress:
    """A long step's progress on ``stream``: a title line, then its events, each with the seconds
    since the start. On a terminal the event line is rewritten in place, every second; otherwise
    each event is a plain line, plus one after every ``quiet`` seconds without any, so a log
    never goes silent for minutes."""

    def __init__(self, stream, title: str, quiet: float = 30.0, clock=time.monotonic) -> None:
        self._stream, self._quiet, self._clock = stream, quiet, clock
        try:
            self._tty = stream.isatty()
        except (AttributeError, ValueError):  # a closed or file-less stream
            self._tty = False
        self._t0 = self._said = clock()
        self._status = "starting"
        self._write(f"leanrnn: {title}\n")

    def _write(self, text: str) -> None:
        try:
            self._stream.write(text)
            self._stream.flush()
        except (AttributeError, OSError, ValueError):  # nowhere to show it (no or a closed
            pass  # stream): the work goes on regardless

    def _show(self, status: str, end: str = "") -> None:
        line = f"leanrnn: {status} ... {self._clock() - self._t0:.0f} s"
        self._write(f"\r\033[K{line}{end}" if self._tty else line + "\n")

    def event(self, status: str) -> None:
        self._status, self._said = status, self._clock()
        self._show(status)

    def tick(self) -> None:
        """Called about every second while nothing happens."""
        if self._tty:
            self._show(self._status)
        elif self._clock() - self._said >= self._quiet:
            self._said = self._clock()
            self._show("still running")

    def close(self, status: str) -> None:
        self._show(status, end="\n")
