"""Runs the jobs (abi.ARGS) for the engine: on the ahead-of-time compiled module when this
machine has one (kernels.native), else on numba's JIT (kernels.ops) — same code, same results.

Backend (``LEANRNN_BACKEND``, or config.set_backend):
- ``auto`` (default): the native module; built on first use in a subprocess (``python -m
  leanrnn.kernels.aot``, ~15 s with a warm numba cache, ~30 s cold on 2 cores) so this process
  never loads numba at all. If it cannot be built (no C compiler), the reason is kept in the
  build directory's FAILED file (native.failure), logged, and the JIT runs instead.
- ``native``: the native module or an error; ``jit``: numba's JIT only.

One multi-threaded launch runs at a time in the process (POOL_LAUNCH): two at once would
oversubscribe the cores, and threads that spin-wait for each other every step (kernels._sync)
would then wait on descheduled ones; numba's fallback threading layer also aborts the process
on concurrent launches. Sessions on different Python threads take turns.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading

from .. import config
from ..errors import LeanRNNError
from . import abi, native

_log = logging.getLogger("leanrnn")
POOL_LAUNCH = threading.Lock()
_RESOLVE = threading.Lock()


def _renew_locks() -> None:
    """In a forked child: another thread of the parent may have held a lock mid-op (the GIL is
    released while kernels run), and no thread of the child will ever release it."""
    global POOL_LAUNCH, _RESOLVE
    POOL_LAUNCH, _RESOLVE = threading.Lock(), threading.Lock()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_locks)


def pool_threads(parts: int) -> int:
    """Threads for ``parts`` jobs: never more than the cores (fewer just run some jobs after
    others, see kernels._sync)."""
    return min(parts, config.cores())


class _Native:
    name = "native"

    def __init__(self, mod) -> None:
        self._run = mod.run
        self.path = mod.__file__
        # (job, dtype char) -> entry index; checked against abi so a stale build cannot run.
        rows = {symbol: (i, kinds) for i, (symbol, kinds) in enumerate(mod.entries())}
        self._index = {}
        for job in abi.ARGS:
            for dtype, letter in abi.DTYPES.items():
                symbol = abi.entry_name(job, dtype)
                if symbol not in rows:
                    raise ImportError(f"{self.path} lacks entry {symbol}")
                i, kinds = rows[symbol]
                if kinds != abi.entry_kinds(job, dtype):
                    raise ImportError(f"{self.path}: {symbol} has kinds {kinds}")
                self._index[job, letter] = i

    def run(self, job: str, args: tuple, parts: int, threads: int) -> None:
        self._run(self._index[job, args[0].dtype.char], args, parts, threads)


class _Jit:
    name = "jit"
    path = None

    def __init__(self) -> None:
        import numba

        from . import ops

        self._numba, self._jobs, self._ops = numba, ops.JOBS, ops.OPS

    def run(self, job: str, args: tuple, parts: int, threads: int) -> None:
        if parts == 1:  # no pool launch: the job itself, on this thread
            self._jobs[job](*args, 0)
            return
        self._numba.set_num_threads(threads)
        self._ops[job](*args)


_backend: _Native | _Jit | None = None
_choice = ""  # the config.backend() that _backend was resolved for


def run(job: str, args: tuple, parts: int) -> None:
    """Job ``job`` (abi.ARGS; ``args`` ends with sync, parts) as ``parts`` jobs."""
    b = _backend if _choice == config.backend() else backend()
    if parts == 1:
        b.run(job, args, 1, 1)
        return
    with POOL_LAUNCH:
        b.run(job, args, parts, pool_threads(parts))


def backend() -> _Native | _Jit:
    """The backend this process runs on (resolved on first use)."""
    global _backend, _choice
    with _RESOLVE:
        choice = config.backend()
        if _backend is None or choice != _choice:
            _backend, _choice = _resolve(choice), choice
        return _backend


def _resolve(choice: str) -> _Native | _Jit:
    if choice == "jit":
        return _Jit()
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
    return _Jit()


def _failure() -> str:
    return native.failure(native.build_dir()) or "not built"


@contextlib.contextmanager
def _exclusive(f):
    """Hold an exclusive lock on file ``f``: another process may be building right now (where
    there is no fcntl, concurrent builds just both publish, atomically)."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - not POSIX
        yield
        return
    fcntl.flock(f, fcntl.LOCK_EX)
    try:
        yield
    finally:
        fcntl.flock(f, fcntl.LOCK_UN)


def native_module(build: bool):
    """The native module for this machine, building it first (in a subprocess, one process at
    a time) if ``build`` and no failure stands (native.failure); None if there is none. A
    broken or foreign module is never run: ImportError, or with ``build`` it is rebuilt."""
    fp = native.fingerprint()
    d = native.build_dir(fp)
    try:
        mod = native.load(d, fp)
    except ImportError:
        if not build:
            raise
        mod = None
    if mod is not None or not build or native.failure(d):
        return mod
    d.mkdir(parents=True, exist_ok=True)
    with open(d / ".lock", "w") as lock, _exclusive(lock):
        try:
            mod = native.load(d, fp)  # another process may have built it meanwhile
        except ImportError as e:
            _log.warning("leanrnn: rebuilding a broken native module: %s", e)
            native.module_path(d).unlink(missing_ok=True)
            mod = None
        if mod is None and not native.failure(d):
            _log.warning("leanrnn: compiling the kernels for this machine (once, ~30-60 s) ...")
            res = subprocess.run([sys.executable, "-m", "leanrnn.kernels.aot", str(d), fp],
                                 capture_output=True, text=True, check=False)  # fmt: skip
            if res.returncode and not native.failure(d):  # it died before saying why
                native.record_failure(d, f"exit {res.returncode}: {res.stderr[-2000:]}", True)
            mod = native.load(d, fp)
    return mod
