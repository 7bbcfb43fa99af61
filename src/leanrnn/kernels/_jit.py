"""How kernels are compiled: one place for numba flags, and where numba caches what it compiles."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import numba

from .. import config

_log = logging.getLogger("leanrnn")

# Fast-math without 'nnan'/'ninf': NaN and Inf in the input must propagate to the output
# (documented behaviour), and those two flags would let LLVM assume they never occur.
FASTMATH = frozenset({"reassoc", "contract", "arcp", "nsz", "afn"})


def _probe():  # pragma: no cover - decorated to ask numba for a cache location, never run
    pass


def _can_cache() -> bool:
    try:
        numba.njit(cache=True)(_probe)  # numba picks the cache location here, as for a kernel
    except RuntimeError:  # "cannot cache function ...: no locator available for file ..."
        return False
    return True


def _cache() -> bool:
    """Whether kernels are cached, and where. numba re-checks a cached kernel against its own
    source file only, not against the files of helpers it inlined: after an edit to _simd.py
    the recurrence cached from recurrent.py would still run the old tile. So the cache is a
    directory named by the fingerprint of every kernel source, the CPU and the versions
    (kernels.native, as the native build is): ``$NUMBA_CACHE_DIR/<fp>``, else
    ``<leanrnn cache>/numba/<fp>``, else (an unwritable cache or HOME) the private temp dir's;
    set in os.environ too, so numba's config reloads and the build subprocess keep it. If none
    can be written, kernels compile without a cache."""
    from .native import fingerprint

    fp = fingerprint()
    user = os.environ.get("NUMBA_CACHE_DIR", "")
    if user and Path(user).name == fp:  # a parent process keyed it already
        bases = [Path(user).parent]
    elif user:
        bases = [Path(user)]
    else:
        home = config.cache_dir()
        bases = [home / "numba"] if home else []
        if not bases or not config.writable(bases[0] / fp):  # (made only when needed: it was
            tmp = config.temp_cache_dir()  # left behind, empty, beside a writable cache)
            bases += [tmp / "numba"] if tmp else []
    for i, base in enumerate(bases):
        d = base / fp
        if not config.writable(d):
            continue
        os.environ["NUMBA_CACHE_DIR"] = numba.config.CACHE_DIR = str(d)
        if _can_cache():
            if i > 0:
                _log.warning("leanrnn: cannot write the numba cache in %s; caching the kernels "
                             "in %s (set NUMBA_CACHE_DIR to choose)", bases[0], d)  # fmt: skip
            return True
    if user:
        os.environ["NUMBA_CACHE_DIR"] = user
    else:
        os.environ.pop("NUMBA_CACHE_DIR", None)
    numba.config.CACHE_DIR = user
    _log.warning("leanrnn: numba has nowhere to cache the compiled kernels (NUMBA_CACHE_DIR=%r, "
                 "LEANRNN_CACHE_DIR=%s): every process compiles them anew; set NUMBA_CACHE_DIR to "
                 "a writable directory", user, config.cache_dir())  # fmt: skip
    return False


CACHE = _cache()


# Every kernel compiles without numba's reference counting (_nrt=False): a kernel only ever
# takes views of memory it is handed, never allocates, and no array it sees outlives the call,
# so the counts would guard nothing — while each NRT_incref / NRT_decref numba emits stays an
# out-of-line call (its refcount pruning needs that), and one left in a loop spills every
# vector register around it (the recurrence's step loop, which passes arrays to inlined hooks,
# ran 1.2-2x slower with them). The price: such a function can return no array but one of its
# arguments (see gemm.operand).
_FLAGS = {"cache": CACHE, "fastmath": set(FASTMATH), "error_model": "numpy", "_nrt": False}


def jit(fn):
    """A cached, fast-math kernel compiled on first call."""
    return numba.njit(**_FLAGS)(fn)


def inline(fn):
    """A tiny helper inlined at numba's IR level. Only for a few lines: IR inlining multiplies
    compile time, and LLVM inlines ordinary ``jit`` callees where it pays anyway."""
    return numba.njit(inline="always", **_FLAGS)(fn)


def kernel(fn):
    """An entry point called from Python: like ``jit``, and it releases the GIL, because the
    engine runs one job per thread over the same op (see _sync)."""
    return numba.njit(nogil=True, **_FLAGS)(fn)
