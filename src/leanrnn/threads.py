"""Threading policy in one place: when work is worth splitting, how many threads a launch gets,
the BLAS limits, the Python pool for row-split matrix products, and the lock that lets one
multi-threaded kernel launch run at a time.

Below the thresholds, threads wait on each other longer than they work. Launches are serialized
(POOL_LAUNCH): two at once would oversubscribe the cores, and threads that spin-wait for each
other every step (kernels._sync) would then wait on descheduled ones; numba's fallback
threading layer also aborts the process on concurrent launches. Sessions on different Python
threads take turns.

Nothing here imports numba or engine code: kernels.runner, the engine and config all use it.
"""

from __future__ import annotations

import os
import threading

from . import config

# A session's recurrence splits over threads from this many multiply-adds per step on.
PARALLEL_MIN_MACS = 1 << 15
# A graph's numpy matrix product splits its rows over Python threads from this many on.
PARALLEL_MATMUL_MACS = 1 << 24
# A graph's packed (engine GEMM tile) matrix product runs on the kernel team from this many on.
PACKED_MATMUL_PARALLEL_MACS = 1 << 20

POOL_LAUNCH = threading.Lock()  # one multi-threaded kernel launch at a time (module docstring)
_POOL_MADE = threading.Lock()  # guards the creation of the matmul pool
_controller = None
_matmul_pool = None


def _renew_locks() -> None:
    """In a forked child: another thread of the parent may have held a lock mid-op (the GIL is
    released while kernels run), and no thread of the child will ever release it. The matmul
    pool's threads do not exist in the child either."""
    global POOL_LAUNCH, _POOL_MADE, _matmul_pool
    POOL_LAUNCH, _POOL_MADE, _matmul_pool = threading.Lock(), threading.Lock(), None


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_locks)


def pool_threads(parts: int) -> int:
    """Threads for ``parts`` jobs: never more than the cores (fewer just run some jobs after
    others, see kernels._sync)."""
    return min(parts, config.cores())


def blas_controller():
    """The process's one threadpoolctl controller (it keeps a handle per loaded BLAS; limiting
    is process-wide and cheap), made on first use; None without threadpoolctl."""
    global _controller
    if _controller is None:
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:  # pragma: no cover - threadpoolctl is a declared dependency
            return None
        _controller = ThreadpoolController()
    return _controller


def limit_blas(n: int) -> None:
    """Limit every loaded BLAS library to ``n`` threads, process-wide."""
    c = blas_controller()
    if c is not None:
        c.limit(limits=n, user_api="blas")


def matmul_pool(threads: int):
    """A ThreadPoolExecutor of at least ``threads`` workers for row-split numpy matrix products
    (engine graphs): idle Python threads sleep instead of spinning like BLAS's own pool, so they
    never starve the RNN kernels' threads. Made on first use, grown when asked for more."""
    global _matmul_pool
    pool = _matmul_pool
    if pool is not None and pool._max_workers >= threads:
        return pool
    with _POOL_MADE:
        if _matmul_pool is None or _matmul_pool._max_workers < threads:
            from concurrent.futures import ThreadPoolExecutor

            _matmul_pool = ThreadPoolExecutor(max_workers=threads,
                                              thread_name_prefix="leanrnn-matmul")  # fmt: skip
        return _matmul_pool
