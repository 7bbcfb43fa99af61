"""Every environment knob in one place: threads, kernel backend, caches, logging.

Environment variables (read once at import; the setters below change them at run time):

- ``LEANRNN_NUM_THREADS``: threads for leanrnn kernels (default: all cores). BLAS keeps its
  own (OPENBLAS_NUM_THREADS / OMP_NUM_THREADS, or set_num_threads, which sets both): read
  at import, this never loads threadpoolctl.
- ``LEANRNN_BACKEND``: ``auto`` (default), ``native`` or ``jit``: which compiled kernels run
  (kernels.runner).
- ``LEANRNN_CACHE_DIR``: where the ahead-of-time compiled kernels live (kernels.native); else
  ``$XDG_CACHE_HOME/leanrnn`` (an absolute one), else ``~/.cache/leanrnn``; a relative
  ``LEANRNN_CACHE_DIR`` is under the working directory leanrnn was imported in. If it cannot be
  written, a build goes to a private directory in the temp dir instead (temp_cache_dir), with
  a warning. A folder per
  fingerprint; those of other fingerprints unused for native.PRUNE_AFTER_DAYS days go after a
  successful build (kernels.native.prune; ``leanrnn compile --prune`` on demand).
- ``LEANRNN_LOG``: comma-separated log topics; ``memory`` logs every arena acquire and release.
- ``NUMBA_CACHE_DIR``: where numba caches its JIT kernels (numba's own variable). Left unset,
  leanrnn caches numba's kernels in ``<cache>/numba/<fingerprint>`` (kernels._jit: keyed by
  every kernel source, so an edit of one never runs another's stale cached code); set, in
  ``$NUMBA_CACHE_DIR/<fingerprint>``.
  ``NUMBA_NUM_THREADS`` caps the cores leanrnn uses, as it caps numba's pool.

Nothing here imports numba: a process running the native kernels never loads it.
"""

from __future__ import annotations

import logging
import os
import stat
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

from .errors import LeanRNNError

_log = logging.getLogger("leanrnn")


def _quota_cores(root: str = "/") -> int | None:
    """The CPUs a cgroup CPU quota allows this process, rounded up (``docker --cpus=1.5``:
    2), or None if there is none: cgroup v2's ``cpu.max`` and v1's ``cpu.cfs_quota_us`` /
    ``cpu.cfs_period_us``, of the process's own cgroup and each one above it (the smallest
    counts), under ``root`` (tests give a fake tree). Threads past the quota are descheduled
    for the rest of each period, and the recurrence's threads spin-wait for each other every
    step: a 2-thread launch under a 1-CPU quota waits on the throttled one."""
    base = os.path.join(root, "sys", "fs", "cgroup")
    try:
        with open(os.path.join(root, "proc", "self", "cgroup")) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    # (dir under base, quota file, period file or None: v2 holds both in one)
    places: list[tuple[str, str, str | None]] = []
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        _, controllers, path = parts
        if not controllers:  # v2: "0::/path"
            places.append((os.path.join(base, path.lstrip("/")), "cpu.max", None))
        elif "cpu" in controllers.split(","):  # v1: "4:cpu,cpuacct:/path"
            for mount in (controllers, "cpu", "cpu,cpuacct"):
                d = os.path.join(base, mount, path.lstrip("/"))
                places.append((d, "cpu.cfs_quota_us", "cpu.cfs_period_us"))
    if not places:  # no /proc: the namespace's root, both versions
        places = [(base, "cpu.max", None),
                  (os.path.join(base, "cpu"), "cpu.cfs_quota_us", "cpu.cfs_period_us")]  # fmt: skip
    best = None
    for d, quota_file, period_file in places:
        d = os.path.normpath(d)
        while d.startswith(base):  # the cgroup and its ancestors up to the mount
            try:
                with open(os.path.join(d, quota_file)) as f:
                    words = f.read().split()
                if period_file is not None:
                    with open(os.path.join(d, period_file)) as f:
                        words = [words[0], f.read().strip()]
                quota, period = int(words[0]), int(words[1])
            except (OSError, ValueError, IndexError):  # absent, "max", unreadable: no quota
                quota = period = -1
            if quota > 0 and period > 0:
                n = max(1, -(-quota // period))
                best = n if best is None else min(best, n)
            if d == base:
                break
            d = os.path.dirname(d)
    return best


def _cores() -> int:
    """The cores this process may run on now: its affinity mask, a cgroup CPU quota
    (_quota_cores) and NUMBA_NUM_THREADS, which caps numba's pool (so both backends use the
    same number)."""
    try:
        n = max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # not Linux
        n = max(1, os.cpu_count() or 1)
    quota = _quota_cores()
    if quota is not None:
        n = min(n, quota)
    raw = os.environ.get("NUMBA_NUM_THREADS", "").strip()
    # a cap: 64 on 2 cores ran 64 threads on 2 (10x slower); decimal digits, as numba's int()
    # reads them ('²' isdigit, and int() refused it)
    if raw.isdecimal() and int(raw) > 0:
        return min(n, int(raw))
    return n


# The cores at start-up: the most parts any launch splits into, for the life of the process
# (the kernels' per-thread buffers are sized for this many). cores() follows the mask and
# quota down from there, and launches run on at most that many threads (pool_threads): a
# process pinned to fewer CPUs after import (a fork's child pinning itself, a container's
# quota lowered) runs its parts on fewer threads, not 2 spinning threads on 1 CPU.
_CORES = _cores()
try:
    _START_DIR = os.getcwd()  # what a relative LEANRNN_CACHE_DIR is relative to (cache_dir)
except OSError:  # (started in a deleted directory: relative paths mean nothing there)
    _START_DIR = "/"
_seen = [_CORES, time.monotonic()]  # cores(): the last count, and when


def _count_again() -> None:
    _seen[1] = float("-inf")


if hasattr(os, "register_at_fork"):  # a fork's child counts at once (it may pin itself)
    os.register_at_fork(after_in_child=_count_again)
_RECOUNT_SECONDS = 0.25  # (a count costs ~0.5 us of affinity and ~20 us of cgroup files)


def _env_threads() -> int:
    raw = os.environ.get("LEANRNN_NUM_THREADS", "").strip()
    if not raw:
        return _CORES
    try:
        n = int(raw)
    except ValueError:
        raise LeanRNNError(
            f"[config] LEANRNN_NUM_THREADS={raw!r} is not an integer; expected 1...{_CORES}"
        ) from None
    if n < 1:  # 0 or -3 used to run silently on one thread
        raise LeanRNNError(
            f"[config] LEANRNN_NUM_THREADS={raw!r}; expected 1...{_CORES} (unset it to use "
            "every core)"
        )
    # More than the cores is not an error (a setting shared between machines): the cores.
    return min(n, _CORES)


BACKENDS = ("auto", "native", "jit")


def _env_backend() -> str:
    raw = os.environ.get("LEANRNN_BACKEND", "auto").strip().lower() or "auto"
    if raw not in BACKENDS:
        raise LeanRNNError(f"[config] LEANRNN_BACKEND={raw!r}; expected one of {BACKENDS}")
    return raw


LOG_TOPICS = ("memory",)


def _env_log() -> frozenset[str]:
    raw = os.environ.get("LEANRNN_LOG", "")
    topics = frozenset(t.strip().lower() for t in raw.split(",") if t.strip())
    if topics - set(LOG_TOPICS):  # a typo ("memroy") logged nothing, without a word
        raise LeanRNNError(f"[config] LEANRNN_LOG={raw!r}; expected comma-separated topics "
                           f"from {LOG_TOPICS} (or unset)")  # fmt: skip
    return topics


def serve_log_level() -> str:
    """LEANRNN_SERVE_LOG, the level of ``leanrnn serve``'s JSON log (default INFO, also when
    set empty); a name logging does not know is an error naming the variable."""
    raw = os.environ.get("LEANRNN_SERVE_LOG", "").strip().upper() or "INFO"
    if raw not in logging.getLevelNamesMapping():
        raise LeanRNNError(f"[serve] LEANRNN_SERVE_LOG={raw!r}; expected a logging level such "
                           "as DEBUG, INFO, WARNING or ERROR")  # fmt: skip
    return raw


def _read_env() -> tuple[int, str, str]:
    """(threads, backend, error): a bad value must not break ``import leanrnn`` (the CLI could
    not then print a one-line error), so it is recorded and raised by check_env(), which
    the first kernel call and ``leanrnn info`` run; defaults stand in until then."""
    errors = []
    try:
        threads = _env_threads()
    except LeanRNNError as e:
        threads, errors = _CORES, [*errors, str(e)]
    try:
        backend = _env_backend()
    except LeanRNNError as e:
        backend, errors = "auto", [*errors, str(e)]
    for read in (_env_log, serve_log_level):
        try:
            read()
        except LeanRNNError as e:
            errors = [*errors, str(e)]
    return threads, backend, "; ".join(errors)


_threads, _backend, _env_error = _read_env()


def check_env(reread: bool = False) -> None:
    """Raise the error of a bad ``LEANRNN_*`` variable read at import, if there was one
    (``reread``: of the environment as it is now, which child processes will read)."""
    error = _read_env()[2] if reread else _env_error
    if error:
        raise LeanRNNError(error)


try:
    _log_topics = _env_log()
except LeanRNNError:  # reported by check_env(); the known topics still log
    _log_topics = frozenset(
        t.strip().lower() for t in os.environ.get("LEANRNN_LOG", "").split(",") if t.strip()
    ) & set(LOG_TOPICS)


def cores() -> int:
    """The cores this process may use now (affinity mask, cgroup CPU quota,
    NUMBA_NUM_THREADS), never more than at start-up (max_threads); counted again at most
    every 0.25 s, and at once in a fork's child. No launch runs more threads than this: more
    would make the recurrence's threads, which spin-wait for each other every step, wait on
    descheduled ones."""
    now = time.monotonic()
    if now - _seen[1] > _RECOUNT_SECONDS:
        _seen[:] = [min(_cores(), _CORES), now]
    return int(_seen[0])


def serving_threads() -> int:
    """The engine threads ``leanrnn serve`` runs by default, and ``leanrnn tune`` measures
    with: all cores but one, left to the front ends (HTTP, gRPC) and the clients' bytes."""
    return max(1, cores() - 1)


def max_threads() -> int:
    """The cores at start-up: the most threads a launch may ever run, which the kernels'
    per-thread buffers are sized for (cores() may be fewer by the time one runs)."""
    return _CORES


def threads_for(requested: int | None) -> int:
    """Threads a session splits its work into: ``requested`` (its own setting) or else the
    global one, at most max_threads(). (The OS threads that run those parts are at most
    cores() at each launch, threads.pool_threads: a mask narrowed after the plan runs the
    same parts, so the same bits, on fewer threads.)"""
    return min(requested or _threads, max_threads())


def get_num_threads() -> int:
    """Threads leanrnn kernels use: the setting (set_num_threads, LEANRNN_NUM_THREADS), at
    most cores() (BLAS is limited to the setting itself)."""
    return min(_threads, cores())


def set_num_threads(n: int | np.integer) -> None:
    """Set the threads for leanrnn kernels and for BLAS libraries loaded in this process.

    ``n`` >= 1; more than ``cores()`` runs ``cores()`` (0 or less is an error).
    """
    global _threads
    if not isinstance(n, int | np.integer) or isinstance(n, bool):
        raise LeanRNNError(f"[set_num_threads] n={n!r}; expected a positive int")
    if n < 1:
        raise LeanRNNError(f"[set_num_threads] n={n}; expected >= 1")
    _threads = min(int(n), _CORES)
    from . import threads  # (it imports this module)

    threads.limit_blas(_threads)


def backend() -> str:
    """The kernel backend asked for: ``auto``, ``native`` or ``jit`` (kernels.runner)."""
    return _backend


def set_backend(name: str) -> None:
    """Choose the kernel backend (as ``LEANRNN_BACKEND``); takes effect at the next kernel call."""
    global _backend
    if name not in BACKENDS:
        raise LeanRNNError(f"[set_backend] {name!r}; expected one of {BACKENDS}")
    _backend = name


def log_enabled(topic: str) -> bool:
    return topic in _log_topics


def set_log(*topics: str) -> None:
    """Enable log topics at run time (same as ``LEANRNN_LOG=topic,...``)."""
    global _log_topics
    unknown = sorted({str(t).lower() for t in topics} - set(LOG_TOPICS))
    if unknown:
        raise LeanRNNError(f"[set_log] unknown topics {unknown}; expected some of {LOG_TOPICS}")
    _log_topics = frozenset(t.lower() for t in topics)
    if _log_topics and not _log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("leanrnn %(message)s"))
        _log.addHandler(h)
        _log.setLevel(logging.INFO)


def cache_dir() -> Path:
    """Where leanrnn keeps what it builds (LEANRNN_CACHE_DIR, see the module docstring)."""
    # ~ expanded: a quoted value (a Dockerfile's ENV, an .env file) reaches us unexpanded and
    # made a directory named "~" in the working directory, and a build there
    # A relative LEANRNN_CACHE_DIR is the import's working directory's: resolved against the
    # directory of the moment, a chdir (Hydra's per-run directories) sent every run to build
    # the kernels anew, 3-11 minutes. A relative XDG_CACHE_HOME is invalid (the XDG spec:
    # ignored).
    d = os.environ.get("LEANRNN_CACHE_DIR")
    if d:
        return Path(_START_DIR, Path(d).expanduser())
    xdg = os.environ.get("XDG_CACHE_HOME")
    if xdg and Path(xdg).expanduser().is_absolute():
        return Path(xdg).expanduser() / "leanrnn"
    return Path.home() / ".cache" / "leanrnn"


def writable(directory: Path) -> bool:
    """Whether files can be created in ``directory`` (made if missing). Tried, not inferred from
    the mode bits: those say nothing on a read-only file system, nor to root."""
    try:
        directory.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=directory).close()
    except OSError:
        return False
    return True


def temp_cache_dir(create: bool = True) -> Path | None:
    """The fallback when cache_dir() cannot be written: ``<tmp>/leanrnn-<uid>``, private to this
    user, as code is loaded from it (a directory someone else made or can write is refused).
    None if there is none (or, with ``create`` False, none yet)."""
    uid = os.getuid() if hasattr(os, "getuid") else None
    d = Path(tempfile.gettempdir()) / f"leanrnn-{uid if uid is not None else 'user'}"
    try:
        if create:
            d.mkdir(mode=0o700, exist_ok=True)
        st = d.lstat()
    except OSError:
        return None
    mine = uid is None or st.st_uid == uid
    if not stat.S_ISDIR(st.st_mode) or not mine or st.st_mode & 0o077:
        _log.warning("leanrnn: not using %s as a cache: it is not a private directory of this "
                     "user; set LEANRNN_CACHE_DIR to a writable directory", d)  # fmt: skip
        return None
    return d


def numba_cache_dir(fingerprint: str) -> Path:
    """Where numba's JIT kernels of the sources with ``fingerprint`` are cached (kernels._jit
    picks it, falling back to the temp dir where this cannot be written): a folder of
    $NUMBA_CACHE_DIR, else of <cache_dir()>/numba, named by the fingerprint."""
    user = os.environ.get("NUMBA_CACHE_DIR", "")
    if user and Path(user).name == fingerprint:  # a parent process keyed it already
        return Path(user)
    return (Path(user) if user else cache_dir() / "numba") / fingerprint


if _log_topics:
    set_log(*_log_topics)
