"""How kernels are compiled: one place for numba flags, and where numba caches what it compiles."""

from __future__ import annotations

import logging
import os

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
    """Whether kernels are cached. numba caches next to these sources, else in ~/.cache/numba,
    and raises for every cached kernel when it can write neither (a read-only install, an
    unwritable HOME); then, unless NUMBA_CACHE_DIR was set, point it at leanrnn's own cache
    (or the private temp dir; in os.environ too, so numba's config reloads and the build
    subprocess keep it), else compile without a cache."""
    if _can_cache():
        return True
    if not os.environ.get("NUMBA_CACHE_DIR"):
        for root in (config.cache_dir(), config.temp_cache_dir()):
            if root is not None and config.writable(root / "numba"):
                os.environ["NUMBA_CACHE_DIR"] = numba.config.CACHE_DIR = str(root / "numba")
                if _can_cache():
                    _log.warning("leanrnn: numba cannot cache the kernels next to their sources "
                                 "or in ~/.cache/numba; caching them in %s (set NUMBA_CACHE_DIR "
                                 "to choose)", root / "numba")  # fmt: skip
                    return True
                del os.environ["NUMBA_CACHE_DIR"]
                numba.config.CACHE_DIR = ""
    _log.warning("leanrnn: numba has nowhere to cache the compiled kernels (NUMBA_CACHE_DIR=%r, "
                 "LEANRNN_CACHE_DIR=%s): every process compiles them anew; set NUMBA_CACHE_DIR to "
                 "a writable directory", os.environ.get("NUMBA_CACHE_DIR", ""),
                 config.cache_dir())  # fmt: skip
    return False


CACHE = _cache()


def jit(fn):
    """A cached, fast-math kernel compiled on first call."""
    return numba.njit(cache=CACHE, fastmath=set(FASTMATH), error_model="numpy")(fn)


def inline(fn):
    """A tiny helper inlined at numba's IR level. Only for a few lines: IR inlining multiplies
    compile time, and LLVM inlines ordinary ``jit`` callees where it pays anyway."""
    return numba.njit(cache=CACHE, fastmath=set(FASTMATH), error_model="numpy", inline="always")(fn)


def kernel(fn):
    """An entry point called from Python: like ``jit``, and it releases the GIL, because the
    engine runs one job per thread over the same op (see _sync)."""
    return numba.njit(cache=CACHE, fastmath=set(FASTMATH), error_model="numpy", nogil=True)(fn)
