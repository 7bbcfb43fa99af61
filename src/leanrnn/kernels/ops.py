"""One op on every thread at once: the input projection of a (layer, direction), then its
recurrence, with numba's pool started once per op instead of once per step.

Each of the ``parts`` iterations of the one ``prange`` below runs the projection (tasks handed
out by ticket, see _sync) and then its share of the recurrence: a slice of every step's unit
blocks (the threads meet through atomics at each phase) or, with ``split``, a batch slice of its
own (the threads never meet). Should the pool run two iterations one after the other on one
thread, the later one finds its work claimed and done: correct either way, only slower.

Arguments are the recurrent kernel's (recurrent.py) plus the projection's x [M, >=C], W, b, C
(gemm.input_projection) and sync, parts, split. Returns the recurrent kernel's parity (T % 2).
"""

from __future__ import annotations

import numba
from numba import prange

from ._jit import FASTMATH, inline
from .gemm import input_projection
from .recurrent import gru, lstm, rnn


def _op(fn):
    return numba.njit(
        cache=True, fastmath=set(FASTMATH), error_model="numpy", parallel=True, nogil=True
    )(fn)


@inline
def _share(N, me, parts, split):
    """(n0, n1, me, parts) the recurrence of job ``me`` gets: a batch slice of its own with
    ``split``, else every sample and slice ``me`` of each step's blocks."""
    if split:
        return N * me // parts, N * (me + 1) // parts, 0, 1
    return 0, N, me, parts


@_op
def lstm_op(
    x, W, b, C, xw, xw_bf_T, Rt, K, peep, use_peep, proj, P, h_a, h_b, c, gates, hfull, lengths, T,
    reverse, y, y_off, y_bf_T, acts, alphas, betas, input_forget, consts, sync, parts, split,
):  # fmt: skip
    N = h_a.shape[0]
    for me in prange(parts):
        input_projection(x, W, b, C, xw, sync)
        n0, n1, who, among = _share(N, me, parts, split)
        lstm(xw, xw_bf_T, n0, N, Rt, K, peep, use_peep, proj, P, h_a[n0:n1], h_b[n0:n1],
             c[n0:n1], gates[n0:n1], hfull[n0:n1], lengths, T, reverse, y, y_off, y_bf_T, acts,
             alphas, betas, input_forget, consts, who, among, sync)  # fmt: skip
    return T % 2


@_op
def gru_op(
    x, W, b, C, xw, xw_bf_T, Rt, K, rb, linear_before_reset, h_a, h_b, gates, rh, lengths, T,
    reverse, y, y_off, y_bf_T, acts, alphas, betas, consts, sync, parts, split,
):  # fmt: skip
    N = h_a.shape[0]
    for me in prange(parts):
        input_projection(x, W, b, C, xw, sync)
        n0, n1, who, among = _share(N, me, parts, split)
        gru(xw, xw_bf_T, n0, N, Rt, K, rb, linear_before_reset, h_a[n0:n1], h_b[n0:n1],
            gates[n0:n1], rh[n0:n1], lengths, T, reverse, y, y_off, y_bf_T, acts, alphas, betas,
            consts, who, among, sync)  # fmt: skip
    return T % 2


@_op
def rnn_op(
    x, W, b, C, xw, xw_bf_T, Rt, K, h_a, h_b, gates, lengths, T, reverse, y, y_off, y_bf_T, acts,
    alphas, betas, consts, sync, parts, split,
):  # fmt: skip
    N = h_a.shape[0]
    for me in prange(parts):
        input_projection(x, W, b, C, xw, sync)
        n0, n1, who, among = _share(N, me, parts, split)
        rnn(xw, xw_bf_T, n0, N, Rt, K, h_a[n0:n1], h_b[n0:n1], gates[n0:n1], lengths, T,
            reverse, y, y_off, y_bf_T, acts, alphas, betas, consts, who, among, sync)  # fmt: skip
    return T % 2
