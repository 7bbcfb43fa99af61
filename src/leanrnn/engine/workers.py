"""The worker threads of the process: one pool, shared by every session and graph.

Kernels release the GIL, so a job per thread over the same op runs truly in parallel; idle
workers sleep (no spinning between runs), so they never starve whoever else owns the cores.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

_lock = threading.Lock()
_pool: ThreadPoolExecutor | None = None


def _workers(n: int) -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None or _pool._max_workers < n:
            _pool = ThreadPoolExecutor(max_workers=n, thread_name_prefix="leanrnn")
        return _pool


def run_jobs(job: Callable[[int], object], parts: int):
    """job(0) on this thread and job(1..parts-1) on workers; returns job(0)'s result once all
    are done (a worker's exception is raised here). Jobs must not wait for one another to
    start: a worker may begin late (see kernels._sync for how the kernels cope)."""
    if parts == 1:
        return job(0)
    pool = _workers(parts - 1)
    futures = [pool.submit(job, i) for i in range(1, parts)]
    try:
        return job(0)
    finally:
        for f in futures:
            f.result()
