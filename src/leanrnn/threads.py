"""Threading policy in one place: when work is worth splitting, how many threads a launch gets,
the BLAS limits, the Python pools (row-split matrix products; the JIT backend's job launches),
and the lock that lets one multi-threaded kernel launch run at a time.

Below the thresholds, threads wait on each other longer than they work. Launches are serialized
(POOL_LAUNCH): two at once would oversubscribe the cores, and threads that spin-wait for each
other every step (kernels._sync) would then wait on descheduled ones. Sessions on different
Python threads take turns. The thread holding it may be interrupted by a signal handler that
runs a model: that launch must not wait for the one it interrupted (launching; kernels.runner
runs it on the thread alone).

Nothing here imports numba or engine code: kernels.runner, the engine and config all use it.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading

from . import config

# A session's recurrence splits over threads from this many multiply-adds per step on.
PARALLEL_MIN_MACS = 1 << 15
# A graph's numpy matrix product splits its rows over Python threads from this many on.
PARALLEL_MATMUL_MACS = 1 << 24
# A graph's packed (engine GEMM tile) matrix product runs on the kernel team from this many on.
PACKED_MATMUL_PARALLEL_MACS = 1 << 20

# One multi-threaded kernel launch at a time (module docstring). Reentrant only so that its owner
# can be asked (launching): taken and released in C, the owner is known with no bytecode
# between, where a signal handler could run with the lock held but no owner noted yet.
POOL_LAUNCH = threading.RLock()
_POOL_MADE = threading.Lock()  # guards the creation of the Python pools
_controller = None
_pools: dict = {}  # purpose -> ThreadPoolExecutor (_pool)
_forked = False  # this process is a fork's child (_renew_locks)
# blas_alone: the threads inside it, the limiter of the first (its saved limits are restored
# when the last leaves), and a limit_blas asked for meanwhile (applied then instead)
_ALONE = threading.Lock()
_alone = {"count": 0, "limiter": None, "wanted": None}
_openmp_library: str | None = None  # use_openmp_of
_modules = [0]  # len(sys.modules) when the controller was made (blas_controller)


def _renew_locks() -> None:
    """In a forked child: another thread of the parent may have held a lock mid-op (the GIL is
    released while kernels run), and no thread of the child will ever release it. The Python
    pools' threads do not exist in the child either."""
    global POOL_LAUNCH, _POOL_MADE, _pools, _forked, _ALONE
    POOL_LAUNCH, _POOL_MADE, _pools = threading.RLock(), threading.Lock(), {}
    _forked = True  # GNU OpenMP's teams do not survive a fork: no openmp_team here
    _ALONE = threading.Lock()
    if _alone["count"]:  # forked mid-run: no thread of the child will leave blas_alone
        _alone["count"] = 0
        _leave_alone()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_renew_locks)


def launching() -> bool:
    """Whether this thread is inside a multi-threaded launch (holds POOL_LAUNCH): code that
    interrupted it there (a signal handler) and launches again must not wait for that lock."""
    return POOL_LAUNCH._is_owned()  # (threading.Condition asks its RLock the same way)


_launches = threading.local()  # .openmp: this thread's launches run on its OpenMP team


@contextlib.contextmanager
def openmp_team():
    """Within: this thread's multi-threaded kernel launches run on the GNU OpenMP team of the
    thread (kernels/native.c: GOMP_parallel) instead of leanrnn's own threads, where the
    process has loaded GNU OpenMP (gnu_openmp_parallel) and the native backend runs.

    For callers that interleave the kernels with a framework's OpenMP ops on this thread
    (leanrnn.torch): that team's workers spin for milliseconds after each op, on the cores
    leanrnn's threads need, so the two teams took turns instead of running together. Bound
    programs (engine streaming steps, runner.run_program) keep leanrnn's threads."""
    before = getattr(_launches, "openmp", False)
    _launches.openmp = True
    try:
        yield
    finally:
        _launches.openmp = before


def on_openmp() -> bool:
    """Whether this thread's launches go to its OpenMP team (openmp_team)."""
    return getattr(_launches, "openmp", False)


def use_openmp_of(library: str | None) -> None:
    """Resolve ``GOMP_parallel`` (gnu_openmp_parallel) through ``library``, a loaded shared
    library that links GNU OpenMP (leanrnn.torch: libtorch_cpu): the runtime *it* uses, where a
    process may hold several (MNN and scikit-learn bundle their own libgomp)."""
    global _openmp_library
    _openmp_library = library


def gnu_openmp_parallel() -> int:
    """The address of ``GOMP_parallel`` in the GNU OpenMP runtime of the library named by
    use_openmp_of, else of the one libgomp this process has mapped; 0 if there is none, or
    several and no library says which. Loads nothing (RTLD_NOLOAD: a library not yet mapped is
    not opened). Always 0 in a fork's child: a parent's OpenMP team hangs there (the native
    team starts afresh instead)."""
    import ctypes

    if _forked:
        return 0
    try:
        mode = os.RTLD_NOLOAD | os.RTLD_LAZY
        if _openmp_library is not None:
            paths = [_openmp_library]  # dlsym searches the library, then what it links
        else:
            with open("/proc/self/maps") as f:  # address perms offset dev inode [path]
                rows = [line.split(None, 5) for line in f]
            paths = sorted({r[5].strip() for r in rows if len(r) == 6 and "/libgomp" in r[5]})
            if len(paths) != 1:  # none, or which one would be a guess
                return 0
        lib = ctypes.CDLL(paths[0], mode=mode)
        return ctypes.cast(lib.GOMP_parallel, ctypes.c_void_p).value or 0
    except (OSError, AttributeError):  # no /proc or RTLD_NOLOAD (not Linux), not loaded, no symbol
        return 0


def pool_threads(parts: int) -> int:
    """Threads for ``parts`` jobs: never more than the cores (fewer just run some jobs after
    others, see kernels._sync)."""
    return min(parts, config.cores())


def blas_controller():
    """The process's one threadpoolctl controller (it keeps a handle per loaded BLAS; limiting
    is process-wide and cheap), made on first use, and again once modules were imported since
    (a controller lists the libraries of its making: scipy's OpenBLAS, loaded after leanrnn's
    first limit, kept whatever limit it had, and ran its own threads inside blas_alone; a
    limiter already made keeps the handles it limited); None without threadpoolctl."""
    global _controller
    if _controller is None or _modules[0] != len(sys.modules):
        try:
            from threadpoolctl import ThreadpoolController
        except ImportError:  # pragma: no cover - threadpoolctl is a declared dependency
            return None
        _controller = ThreadpoolController()
        _modules[0] = len(sys.modules)
    return _controller


def _for_the_process(call):
    """``call()`` (a threadpoolctl limit or restore) made for the whole process from whichever
    thread runs it. threadpoolctl >= 3.8 lets only the first Python thread that limits a
    process-wide OpenBLAS pool change it again, and silently drops every other thread's
    calls: a restore from the thread that left blas_alone last, or set_num_threads from a
    worker, did nothing (BLAS stayed at 1 thread for the rest of the process). leanrnn's
    calls are counted under _ALONE, for the process, so its thread takes control for the
    call and gives it back after it (older threadpoolctl has no such rule, nor this state)."""
    try:
        from threadpoolctl import OpenBLASController

        state = OpenBLASController._SHARED_STATE
        state.lock, state.controlling_thread  # noqa: B018 - the attributes this relies on
    except (ImportError, AttributeError):
        return call()
    me = threading.current_thread()
    with state.lock:  # (set_num_threads takes it only to claim control: no deadlock)
        before = state.controlling_thread
        state.controlling_thread = me
    try:
        return call()
    finally:
        # control goes back to the thread that had it (a user's threadpool_limits block on
        # another thread keeps its restore), else to none
        with state.lock:
            if state.controlling_thread in (me, None):
                alive = before is not None and before.is_alive()  # (this thread too)
                state.controlling_thread = before if alive else None


def blas_threads() -> int:
    """The most threads any loaded BLAS runs with now (1 when none is known)."""
    c = blas_controller()
    if c is None:
        return 1
    return max((i["num_threads"] for i in c.info() if i["user_api"] == "blas"), default=1)


def limit_blas(n: int) -> None:
    """Limit every loaded BLAS library to ``n`` threads, process-wide (inside ``blas_alone``:
    once the last thread leaves it)."""
    c = blas_controller()
    if c is None:
        return
    with _ALONE:
        if _alone["count"]:
            _alone["wanted"] = n
        else:
            _for_the_process(lambda: c.limit(limits=n, user_api="blas"))


@contextlib.contextmanager
def blas_alone():
    """BLAS on one thread while the block runs (its calls sit between leanrnn's spinning kernel
    threads, or are split over Python threads already), then back to the limits it found.
    Process-wide, so counted: the first thread in limits, the last one out restores. (A
    threadpoolctl limiter per thread saved and restored the limits each found: two threads in
    at once left BLAS at 1 thread for the rest of the process, the user's own numpy too.)"""
    c = blas_controller()
    if c is None:
        yield
        return
    with _ALONE:
        if not _alone["count"]:
            _alone["limiter"] = _for_the_process(lambda: c.limit(limits=1, user_api="blas"))
        _alone["count"] += 1
    try:
        yield
    finally:
        with _ALONE:
            _alone["count"] -= 1
            if not _alone["count"]:
                _leave_alone()


def _leave_alone() -> None:
    """The last thread out of blas_alone (with _ALONE held): the limits it found, or the ones
    limit_blas asked for meanwhile."""
    limiter, wanted = _alone["limiter"], _alone["wanted"]
    _alone["limiter"] = _alone["wanted"] = None
    if limiter is not None:
        _for_the_process(limiter.restore_original_limits)
    if wanted is not None:
        _for_the_process(lambda: blas_controller().limit(limits=wanted, user_api="blas"))


def _pool(purpose: str, threads: int):
    """The ThreadPoolExecutor for ``purpose``, of at least ``threads`` workers: made on first
    use, replaced by a larger one when asked for more (the smaller one's idle threads exit)."""
    pool = _pools.get(purpose)
    if pool is not None and pool._max_workers >= threads:
        return pool
    with _POOL_MADE:
        pool = _pools.get(purpose)
        if pool is None or pool._max_workers < threads:
            from concurrent.futures import ThreadPoolExecutor

            pool = _pools[purpose] = ThreadPoolExecutor(
                max_workers=threads, thread_name_prefix=f"leanrnn-{purpose}"
            )
        return pool


def matmul_pool(threads: int):
    """A pool of at least ``threads`` workers for row-split numpy matrix products (engine
    graphs, training's GEMMs): idle Python threads sleep instead of spinning like BLAS's own
    pool, so they never starve the RNN kernels' threads."""
    return _pool("matmul", threads)


def job_pool(threads: int):
    """A pool of at least ``threads`` workers that run the JIT backend's jobs (kernels.runner):
    one of its own, so a job launch never waits behind matrix products queued by its caller."""
    return _pool("jit", threads)
