"""How kernels are compiled: one place for numba flags and for serial/parallel twins."""

from __future__ import annotations

import types

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


def twins(fn):
    """(serial, parallel) dispatchers of one kernel body.

    The parallel one runs ``prange`` loops on numba's thread pool; the serial one runs them as
    plain loops, which avoids the per-step cost of waking the pool when there is little work.
    Each twin gets its own function name so numba's on-disk cache keeps both.
    """
    out = []
    for suffix, parallel in (("_serial", False), ("_parallel", True)):
        code = fn.__code__.replace(
            co_name=fn.__name__ + suffix, co_qualname=fn.__qualname__ + suffix
        )
        twin = types.FunctionType(code, fn.__globals__, fn.__name__ + suffix, fn.__defaults__)
        twin.__qualname__ = fn.__qualname__ + suffix
        twin.__module__ = fn.__module__
        fn.__globals__[twin.__name__] = twin
        # nogil: the engine runs disjoint batch slices of the serial twin on Python threads.
        out.append(
            numba.njit(
                cache=True, fastmath=set(FASTMATH), error_model="numpy", parallel=parallel,
                nogil=True,
            )(twin)
        )
    return tuple(out)
