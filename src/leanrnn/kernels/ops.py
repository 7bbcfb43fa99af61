"""One op on every thread at once: the input projection of a (layer, direction), then its
recurrence, with numba's pool started once per op instead of once per step.

Each of the ``parts`` iterations of the one ``prange`` below runs the projection (tasks handed
out by ticket, see _sync) and then its share of the recurrence: a slice of every step's unit
blocks, all samples (the threads meet through atomics at each phase). Should the pool run two
iterations one after the other on one thread, the later one finds its work claimed and done:
correct either way, only slower. Splitting the blocks rather than the batch also at N=64 was
faster on 2 threads (H=1024: 258 vs 283 ms): each thread streams half the weights, and its GEMM
tiles cover all 64 rows instead of 32 (5 tiles of 6 and a 2-row remainder).

The *jobs* are what one thread runs (abi.ARGS lists their arguments: the recurrent kernel's,
recurrent.py, from xw_bf_T on, with the projection's x [M, >=C], W, b, C in front, then sync,
parts and the thread's index me). The *ops* start ``parts`` jobs on numba's pool and return the
recurrence's parity (T % 2). kernels.aot compiles the same jobs ahead of time.
"""

from __future__ import annotations

import inspect

import numba
from numba import prange

from . import abi
from ._jit import CACHE, FASTMATH, kernel
from .gemm import input_projection
from .recurrent import gru, lstm, rnn


def _op(fn):
    return numba.njit(
        cache=CACHE, fastmath=set(FASTMATH), error_model="numpy", parallel=True, nogil=True
    )(fn)


@kernel
def lstm_job(
    x, W, b, C, xw, xw_bf_T, Rt, K, peep, use_peep, proj, P, h_a, h_b, c, gates, hfull, lengths, T,
    reverse, y, y_off, y_bf_T, acts, alphas, betas, input_forget, consts, sync, parts, me,
):  # fmt: skip
    input_projection(x, W, b, C, xw, sync)
    lstm(xw, xw_bf_T, Rt, K, peep, use_peep, proj, P, h_a, h_b, c, gates, hfull, lengths, T,
         reverse, y, y_off, y_bf_T, acts, alphas, betas, input_forget, consts, me, parts,
         sync)  # fmt: skip


@kernel
def gru_job(
    x, W, b, C, xw, xw_bf_T, Rt, K, rb, linear_before_reset, h_a, h_b, gates, rh, lengths, T,
    reverse, y, y_off, y_bf_T, acts, alphas, betas, consts, sync, parts, me,
):  # fmt: skip
    input_projection(x, W, b, C, xw, sync)
    gru(xw, xw_bf_T, Rt, K, rb, linear_before_reset, h_a, h_b, gates, rh, lengths, T, reverse,
        y, y_off, y_bf_T, acts, alphas, betas, consts, me, parts, sync)  # fmt: skip


@kernel
def rnn_job(
    x, W, b, C, xw, xw_bf_T, Rt, K, h_a, h_b, gates, lengths, T, reverse, y, y_off, y_bf_T, acts,
    alphas, betas, consts, sync, parts, me,
):  # fmt: skip
    input_projection(x, W, b, C, xw, sync)
    rnn(xw, xw_bf_T, Rt, K, h_a, h_b, gates, lengths, T, reverse, y, y_off, y_bf_T, acts,
        alphas, betas, consts, me, parts, sync)  # fmt: skip


@kernel
def matmul_job(x, W, b, K, y, sync, parts, me):
    """y = x W^T + b (gemm.input_projection); any number of threads share the tasks."""
    input_projection(x, W, b, K, y, sync)


JOBS = {"lstm": lstm_job, "gru": gru_job, "rnn": rnn_job, "matmul": matmul_job}
for _name, _job in JOBS.items():
    _have = list(inspect.signature(_job.py_func).parameters)
    _want = [n for n, _ in abi.params(_name)] + ["me"]
    assert _have == _want, f"ops.{_name}_job parameters {_have} differ from abi.ARGS {_want}"


@_op
def lstm_op(
    x, W, b, C, xw, xw_bf_T, Rt, K, peep, use_peep, proj, P, h_a, h_b, c, gates, hfull, lengths, T,
    reverse, y, y_off, y_bf_T, acts, alphas, betas, input_forget, consts, sync, parts,
):  # fmt: skip
    for me in prange(parts):
        lstm_job(x, W, b, C, xw, xw_bf_T, Rt, K, peep, use_peep, proj, P, h_a, h_b, c, gates,
                 hfull, lengths, T, reverse, y, y_off, y_bf_T, acts, alphas, betas, input_forget,
                 consts, sync, parts, me)  # fmt: skip


@_op
def gru_op(
    x, W, b, C, xw, xw_bf_T, Rt, K, rb, linear_before_reset, h_a, h_b, gates, rh, lengths, T,
    reverse, y, y_off, y_bf_T, acts, alphas, betas, consts, sync, parts,
):  # fmt: skip
    for me in prange(parts):
        gru_job(x, W, b, C, xw, xw_bf_T, Rt, K, rb, linear_before_reset, h_a, h_b, gates, rh,
                lengths, T, reverse, y, y_off, y_bf_T, acts, alphas, betas, consts, sync, parts,
                me)  # fmt: skip


@_op
def rnn_op(
    x, W, b, C, xw, xw_bf_T, Rt, K, h_a, h_b, gates, lengths, T, reverse, y, y_off, y_bf_T, acts,
    alphas, betas, consts, sync, parts,
):  # fmt: skip
    for me in prange(parts):
        rnn_job(x, W, b, C, xw, xw_bf_T, Rt, K, h_a, h_b, gates, lengths, T, reverse, y, y_off,
                y_bf_T, acts, alphas, betas, consts, sync, parts, me)  # fmt: skip


@_op
def matmul_op(x, W, b, K, y, sync, parts):
    for me in prange(parts):
        matmul_job(x, W, b, K, y, sync, parts, me)


OPS = {"lstm": lstm_op, "gru": gru_op, "rnn": rnn_op, "matmul": matmul_op}
