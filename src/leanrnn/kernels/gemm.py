"""GEMMs on gate-fused block panels (formats.packing): the recurrent step and the input
projection of all timesteps as one blocked GEMM, both on the register tiles of ``_simd``.

``panelN(P, u, v0, A, i0, i1, K, C, ccol)`` computes, for a panel slice of N groups of 16 columns,

    C[i, ccol + j] = sum_{k<K} A[i, k] * P[u, k, v0*16 + j]     i0 <= i < i1, j < N*16

P: [U, Kp, Wd] panels; A: [rows, >=K] and C: [rows, >=ccol+N*16], both C-contiguous; C must
not alias A or P. There are four of them, not one taking N, because each must name its
intrinsic statically: a branch on N would expand all four tile bodies into every caller. With
more than one row, K is cut into KC-long slices so the panel slice a tile
streams stays in L1 (48 KiB here); a single row (GEMV) streams the whole panel once instead.
"""

from __future__ import annotations

from numba import prange

from ..formats.packing import B
from ._jit import inline, twins
from ._simd import panel_gemm1, panel_gemm2, panel_gemm3, panel_gemm4

KC = 64  # inputs per K slice: a [64, 64] float32 panel slice is 16 KiB
ROWS = 96  # input rows per parallel task in the input projection (a multiple of 6 and 3)


@inline
def _kc(K, i0, i1):
    return K if i1 - i0 == 1 else KC


@inline
def _off(P, u, v0, k0):
    return (u * P.shape[1] + k0) * P.shape[2] + v0 * B


@inline
def panel1(P, u, v0, A, i0, i1, K, C, ccol):
    kc = _kc(K, i0, i1)
    for k0 in range(0, K, kc):
        panel_gemm1(P, _off(P, u, v0, k0), P.shape[2], A, k0, i0, i1, A.shape[1],
                    min(kc, K - k0), C, ccol, C.shape[1], k0)  # fmt: skip


@inline
def panel2(P, u, v0, A, i0, i1, K, C, ccol):
    kc = _kc(K, i0, i1)
    for k0 in range(0, K, kc):
        panel_gemm2(P, _off(P, u, v0, k0), P.shape[2], A, k0, i0, i1, A.shape[1],
                    min(kc, K - k0), C, ccol, C.shape[1], k0)  # fmt: skip


@inline
def panel3(P, u, v0, A, i0, i1, K, C, ccol):
    kc = _kc(K, i0, i1)
    for k0 in range(0, K, kc):
        panel_gemm3(P, _off(P, u, v0, k0), P.shape[2], A, k0, i0, i1, A.shape[1],
                    min(kc, K - k0), C, ccol, C.shape[1], k0)  # fmt: skip


@inline
def panel4(P, u, v0, A, i0, i1, K, C, ccol):
    kc = _kc(K, i0, i1)
    for k0 in range(0, K, kc):
        panel_gemm4(P, _off(P, u, v0, k0), P.shape[2], A, k0, i0, i1, A.shape[1],
                    min(kc, K - k0), C, ccol, C.shape[1], k0)  # fmt: skip


def _input_projection(x, W, b, K, xw):
    """xw = x W^T + b for every input row at once (rows in x's own order).

    x:  [M, >=K] inputs (rows t*N + n, or n*T + t for batch-first input — the recurrent kernels
        are told which); W: [U, Cp, Wd] panels; b: [U*Wd] folded bias; xw: [M, U*Wd] output.
    """
    M = x.shape[0]
    U, _, Wd = W.shape
    # Even row chunks (a multiple of 6 rows, the tile height), and task ids ordered panel-major
    # so the contiguous task ranges prange hands each thread hold equal work.
    nm = (M + ROWS - 1) // ROWS
    rows = ((M + nm - 1) // nm + 5) // 6 * 6
    for task in prange(U * nm):
        u = task // nm
        i0 = (task % nm) * rows
        i1 = min(M, i0 + rows)
        c0 = u * Wd
        if i0 >= i1:  # rounding rows up to the tile height can leave the last chunk empty
            continue
        if Wd == 4 * B:
            panel4(W, u, 0, x, i0, i1, K, xw, c0)
        elif Wd == 3 * B:
            panel3(W, u, 0, x, i0, i1, K, xw, c0)
        else:
            panel1(W, u, 0, x, i0, i1, K, xw, c0)
        for i in range(i0, i1):
            for j in range(c0, c0 + Wd):
                xw[i, j] += b[j]


input_projection_serial, input_projection_parallel = twins(_input_projection)
