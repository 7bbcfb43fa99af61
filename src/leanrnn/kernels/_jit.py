"""How kernels are compiled: one place for numba flags."""

from __future__ import annotations

import numba

# Fast-math without 'nnan'/'ninf': NaN and Inf in the input must propagate to the output
# (documented behaviour), and those two flags would let LLVM assume they never occur.
FASTMATH = frozenset({"reassoc", "contract", "arcp", "nsz", "afn"})


def jit(fn):
    """A cached, fast-math kernel compiled on first call."""
    return numba.njit(cache=True, fastmath=set(FASTMATH), error_model="numpy")(fn)


def inline(fn):
    """A tiny helper inlined at numba's IR level. Only for a few lines: IR inlining multiplies
    compile time, and LLVM inlines ordinary ``jit`` callees where it pays anyway."""
    return numba.njit(cache=True, fastmath=set(FASTMATH), error_model="numpy", inline="always")(fn)


def kernel(fn):
    """An entry point called from Python: like ``jit``, and it releases the GIL, because the
    engine runs one job per thread over the same op (see _sync)."""
    return numba.njit(cache=True, fastmath=set(FASTMATH), error_model="numpy", nogil=True)(fn)
