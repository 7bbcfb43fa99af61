"""Every environment knob in one place: threads, logging, numba cache.

Environment variables (read once at import; the setters below change them at run time):

- ``LEANRNN_NUM_THREADS``: threads for leanrnn kernels and BLAS (default: all cores numba sees).
- ``LEANRNN_LOG``: comma-separated log topics; ``memory`` logs every arena acquire and release.
- ``NUMBA_CACHE_DIR``: where compiled kernels are cached (numba's own variable; we only report it).
"""

from __future__ import annotations

import logging
import os
import sys

import numba

from .errors import LeanRNNError

_log = logging.getLogger("leanrnn")


def _env_threads() -> int:
    raw = os.environ.get("LEANRNN_NUM_THREADS", "").strip()
    if not raw:
        return int(numba.config.NUMBA_NUM_THREADS)
    try:
        n = int(raw)
    except ValueError:
        raise LeanRNNError(
            f"[config] LEANRNN_NUM_THREADS={raw!r} is not an integer; expected 1..."
            f"{numba.config.NUMBA_NUM_THREADS}"
        ) from None
    return max(1, min(n, int(numba.config.NUMBA_NUM_THREADS)))


_threads = _env_threads()
_log_topics = frozenset(
    t.strip().lower() for t in os.environ.get("LEANRNN_LOG", "").split(",") if t.strip()
)


def max_threads() -> int:
    """The most threads leanrnn runs: the cores numba saw at start-up. More would make the
    recurrence's threads, which spin-wait for each other every step, wait on descheduled ones."""
    return int(numba.config.NUMBA_NUM_THREADS)


def threads_for(requested: int | None) -> int:
    """Threads to run with: ``requested`` (a session's own setting) or else the global one,
    at most max_threads()."""
    return min(requested or _threads, max_threads())


def get_num_threads() -> int:
    """Threads leanrnn kernels (and BLAS, through threadpoolctl) use."""
    return _threads


def set_num_threads(n: int) -> None:
    """Set the threads for leanrnn kernels and for BLAS libraries loaded in this process.

    ``n`` is clamped to ``1..numba.config.NUMBA_NUM_THREADS`` (the cores numba saw at start-up).
    """
    global _threads
    if not isinstance(n, int | numba.np.numpy_support.np.integer) or isinstance(n, bool):
        raise LeanRNNError(f"[set_num_threads] n={n!r}; expected a positive int")
    if n < 1:
        raise LeanRNNError(f"[set_num_threads] n={n}; expected >= 1")
    _threads = min(int(n), int(numba.config.NUMBA_NUM_THREADS))
    numba.set_num_threads(_threads)
    _limit_blas(_threads)


_blas_limiter = None


def _limit_blas(n: int) -> None:
    # threadpoolctl keeps a handle per loaded BLAS; limiting is process-wide and cheap.
    global _blas_limiter
    try:
        from threadpoolctl import ThreadpoolController
    except ImportError:  # pragma: no cover - threadpoolctl is a declared dependency
        return
    if _blas_limiter is None:
        _blas_limiter = ThreadpoolController()
    _blas_limiter.limit(limits=n, user_api="blas")


def log_enabled(topic: str) -> bool:
    return topic in _log_topics


def set_log(*topics: str) -> None:
    """Enable log topics at run time (same as ``LEANRNN_LOG=topic,...``)."""
    global _log_topics
    _log_topics = frozenset(t.lower() for t in topics)
    if _log_topics and not _log.handlers:
        h = logging.StreamHandler(sys.stderr)
        h.setFormatter(logging.Formatter("leanrnn %(message)s"))
        _log.addHandler(h)
        _log.setLevel(logging.INFO)


def numba_cache_dir() -> str:
    d = numba.config.CACHE_DIR
    return d if d else "(next to the package sources, in __pycache__)"


if _log_topics:
    set_log(*_log_topics)
