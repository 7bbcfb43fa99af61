"""One op on every thread at once: the input projection of a (layer, direction), then its
recurrence, with numba's pool started once per op instead of once per step.

Each of the ``parts`` iterations of the one ``prange`` below runs the projection (tasks handed
out by ticket, see _sync) and then its share of the recurrence: a slice of every step's unit
blocks, all samples (the threads meet through atomics at each phase). Should the pool run two
iterations one after the other on one thread, the later one finds its work claimed and done:
correct either way, only slower. Splitting the blocks rather than the batch also at N=64 was
faster on 2 threads (H=1024: 258 vs 283 ms): each thread streams half the weights, and its GEMM
tiles cover all 64 rows instead of 32 (5 tiles of 6 and a 2-row remainder).

Arguments are the recurrent kernel's (recurrent.py) from xw_bf_T on, with
the projection's x [M, >=C], W, b, C (gemm.input_projection) in front, and sync, parts at the
end. Returns the recurrent kernel's parity (T % 2).
"""

from __future__ import annotations

import numba
from numba import prange

from ._jit import FASTMATH
from .gemm import input_projection
from .recurrent import gru, lstm, rnn


def _op(fn):
    return numba.njit(
        cache=True, fastmath=set(FASTMATH), error_model="numpy", parallel=True, nogil=True
    )(fn)


@_op
def lstm_op(
    x, W, b, C, xw, xw_bf_T, Rt, K, peep, use_peep, proj, P, h_a, h_b, c, gates, hfull, lengths, T,
    reverse, y, y_off, y_bf_T, acts, alphas, betas, input_forget, consts, sync, parts,
):  # fmt: skip
    for me in prange(parts):
        input_projection(x, W, b, C, xw, sync)
        lstm(xw, xw_bf_T, Rt, K, peep, use_peep, proj, P, h_a, h_b, c, gates, hfull,
             lengths, T, reverse, y, y_off, y_bf_T, acts, alphas, betas, input_forget, consts, me,
             parts, sync)  # fmt: skip
    return T % 2


@_op
def gru_op(
    x, W, b, C, xw, xw_bf_T, Rt, K, rb, linear_before_reset, h_a, h_b, gates, rh, lengths, T,
    reverse, y, y_off, y_bf_T, acts, alphas, betas, consts, sync, parts,
):  # fmt: skip
    for me in prange(parts):
        input_projection(x, W, b, C, xw, sync)
        gru(xw, xw_bf_T, Rt, K, rb, linear_before_reset, h_a, h_b, gates, rh, lengths, T,
            reverse, y, y_off, y_bf_T, acts, alphas, betas, consts, me, parts, sync)  # fmt: skip
    return T % 2


@_op
def rnn_op(
    x, W, b, C, xw, xw_bf_T, Rt, K, h_a, h_b, gates, lengths, T, reverse, y, y_off, y_bf_T, acts,
    alphas, betas, consts, sync, parts,
):  # fmt: skip
    for me in prange(parts):
        input_projection(x, W, b, C, xw, sync)
        rnn(xw, xw_bf_T, Rt, K, h_a, h_b, gates, lengths, T, reverse, y, y_off, y_bf_T,
            acts, alphas, betas, consts, me, parts, sync)  # fmt: skip
    return T % 2


@_op
def matmul_op(x, W, b, K, y, sync, parts):
    """y = x W^T + b (gemm.input_projection) on ``parts`` threads sharing the tasks."""
    for _ in prange(parts):
        input_projection(x, W, b, K, y, sync)
