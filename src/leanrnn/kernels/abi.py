"""The kernels' entry points and their calling convention, written down once, without numba.

The engine calls four *jobs* (kernels.ops): ``lstm``, ``gru``, ``rnn`` (an input projection, then
the recurrence of one layer direction) and ``matmul`` (a projection alone). Every thread of an op
calls the same job with its index ``me`` (see _sync). Each job exists twice, with the same
arguments:

- **jit**: numba dispatchers (kernels.ops), compiled on first use and cached by numba;
- **native**: the same numba code compiled ahead of time into one CPython extension
  (kernels.aot builds it, kernels.native loads it), which runs without importing numba or
  LLVM at all: that is what keeps a process's start-up memory and time small.

ARGS below is the one list of each job's arguments, as ``name:kind``. A kind is ``i`` (int),
``b`` (bool), or an array: ``F`` of the working float dtype or ``L`` of int64, then its number of
dimensions. Arrays are C-contiguous. The native entry receives them as flat int64 *slots*: an
array is its address and then its dimensions, a scalar its value. kernels.ops checks that its
jobs' parameters carry these names, so the two cannot drift apart.
"""

from __future__ import annotations

ARGS = {
    "lstm": "x:F2 W:F3 b:F1 C:i xw:F2 xw_bf_T:i Rt:F3 K:i peep:F2 use_peep:b proj:F3 P:i "
    "h_a:F2 h_b:F2 c:F2 gates:F2 hfull:F2 lengths:L1 T:i reverse:b y:F2 y_off:i y_bf_T:i "
    "acts:L1 alphas:F1 betas:F1 input_forget:b consts:F1 sync:L1 parts:i",
    "gru": "x:F2 W:F3 b:F1 C:i xw:F2 xw_bf_T:i Rt:F3 K:i rb:F1 linear_before_reset:b h_a:F2 "
    "h_b:F2 gates:F2 rh:F2 lengths:L1 T:i reverse:b y:F2 y_off:i y_bf_T:i acts:L1 alphas:F1 "
    "betas:F1 consts:F1 sync:L1 parts:i",
    "rnn": "x:F2 W:F3 b:F1 C:i xw:F2 xw_bf_T:i Rt:F3 K:i h_a:F2 h_b:F2 gates:F2 lengths:L1 T:i "
    "reverse:b y:F2 y_off:i y_bf_T:i acts:L1 alphas:F1 betas:F1 consts:F1 sync:L1 parts:i",
    "matmul": "x:F2 W:F3 b:F1 K:i y:F2 sync:L1 parts:i",
}
DTYPES = {"float32": "f", "float64": "d"}  # working dtype -> its letter in entry names and kinds


def params(job: str) -> list[tuple[str, str]]:
    """[(name, kind)] of a job's arguments."""
    return [tuple(a.split(":")) for a in ARGS[job].split()]  # type: ignore[misc]


def entry_name(job: str, dtype: str) -> str:
    """The native symbol of a job for one working dtype, e.g. ``leanrnn_lstm_f``."""
    return f"leanrnn_{job}_{DTYPES[dtype]}"


def entry_kinds(job: str, dtype: str) -> str:
    """A job's arguments for the native marshaller: one (type, ndim) character pair each, type
    ``f``/``d`` (float32/64 array), ``q`` (int64 array), ``i`` (int) or ``b`` (bool)."""
    out = []
    for _, kind in params(job):
        if kind in ("i", "b"):
            out.append(kind + "0")
        else:
            out.append(("q" if kind[0] == "L" else DTYPES[dtype]) + kind[1])
    return "".join(out)


# ----------------------------------------------------------------------- the sync array layout
LINE = 16  # int64 slots per cache-line pair: slot r lives at index r*LINE, alone in its line
# Slot rows of a sync array (see _sync).
PROJ_TICKET, PROJ_DONE, STEP_DONE, CLAIM0 = 0, 1, 2, 3


def sync_size(parts: int) -> int:
    """Length of the int64 sync array for ``parts`` slices."""
    return (CLAIM0 + parts) * LINE
