"""Dot-product GEMM tiles: out[i, j] = sum_k A[i, k] * W[j, k] (A times W transposed).

Weights are stored row-per-output ("dot form", see formats.packing), so a 4x4 tile keeps 16
accumulators that LLVM turns into 16 vector registers over k: 8 loads feed 16 FMAs. At N=1 the
4x1 tile is a GEMV that streams each weight row exactly once per step. No BLAS is involved: the
weights are packed once at load, and nothing is re-packed per call the way a BLAS sgemm does.
"""

from __future__ import annotations

from numba import prange

from ._jit import inline, twins

COLS = 16  # weight rows per parallel task in the input projection
ROWS = 128  # input rows per parallel task in the input projection


@inline
def gemm_nt_block(A, i0, i1, W, j0, j1, K, out, zero, out_bf_T, out_N):
    """out[r(i), j] = sum_{k<K} A[i, k] * W[j, k] for i0 <= i < i1, j0 <= j < j1.

    A: [M, >=K] rows of inputs; W: [J, >=K] weight rows, (j1 - j0) % 4 == 0;
    out: [rows, >=j1]. r(i) = i, or, when out_bf_T > 0 (batch-first source rows i = n*T + t),
    r(i) = t*out_N + n so the output is time-major. out must not alias A or W.
    """
    for j in range(j0, j1, 4):
        i = i0
        while i + 4 <= i1:
            s00 = zero
            s01 = zero
            s02 = zero
            s03 = zero
            s10 = zero
            s11 = zero
            s12 = zero
            s13 = zero
            s20 = zero
            s21 = zero
            s22 = zero
            s23 = zero
            s30 = zero
            s31 = zero
            s32 = zero
            s33 = zero
            for k in range(K):
                w0 = W[j, k]
                w1 = W[j + 1, k]
                w2 = W[j + 2, k]
                w3 = W[j + 3, k]
                a0 = A[i, k]
                a1 = A[i + 1, k]
                a2 = A[i + 2, k]
                a3 = A[i + 3, k]
                s00 += w0 * a0
                s01 += w0 * a1
                s02 += w0 * a2
                s03 += w0 * a3
                s10 += w1 * a0
                s11 += w1 * a1
                s12 += w1 * a2
                s13 += w1 * a3
                s20 += w2 * a0
                s21 += w2 * a1
                s22 += w2 * a2
                s23 += w2 * a3
                s30 += w3 * a0
                s31 += w3 * a1
                s32 += w3 * a2
                s33 += w3 * a3
            r0 = i
            r1 = i + 1
            r2 = i + 2
            r3 = i + 3
            if out_bf_T > 0:
                r0 = (r0 % out_bf_T) * out_N + r0 // out_bf_T
                r1 = (r1 % out_bf_T) * out_N + r1 // out_bf_T
                r2 = (r2 % out_bf_T) * out_N + r2 // out_bf_T
                r3 = (r3 % out_bf_T) * out_N + r3 // out_bf_T
            out[r0, j] = s00
            out[r1, j] = s01
            out[r2, j] = s02
            out[r3, j] = s03
            out[r0, j + 1] = s10
            out[r1, j + 1] = s11
            out[r2, j + 1] = s12
            out[r3, j + 1] = s13
            out[r0, j + 2] = s20
            out[r1, j + 2] = s21
            out[r2, j + 2] = s22
            out[r3, j + 2] = s23
            out[r0, j + 3] = s30
            out[r1, j + 3] = s31
            out[r2, j + 3] = s32
            out[r3, j + 3] = s33
            i += 4
        while i < i1:
            s0 = zero
            s1 = zero
            s2 = zero
            s3 = zero
            for k in range(K):
                a = A[i, k]
                s0 += W[j, k] * a
                s1 += W[j + 1, k] * a
                s2 += W[j + 2, k] * a
                s3 += W[j + 3, k] * a
            r = i
            if out_bf_T > 0:
                r = (r % out_bf_T) * out_N + r // out_bf_T
            out[r, j] = s0
            out[r, j + 1] = s1
            out[r, j + 2] = s2
            out[r, j + 3] = s3
            i += 1


def _input_projection(x, W, b, K, bf_T, N, xw, consts):
    """The input projection of all timesteps as one blocked GEMM: xw = x W^T + b.

    x:  [M, >=K] inputs, rows t*N + n (time-major) or n*T + t when bf_T = T > 0 (batch-first)
    W:  [Gp, >=K] packed input weights; b: [Gp] folded bias
    xw: [M, Gp] output, always time-major (row t*N + n); must not alias x
    consts: [zero, one, tiny, clip] in the working dtype
    """
    zero = consts[0]
    M = x.shape[0]
    Gp = W.shape[0]
    nj = Gp // COLS
    nm = (M + ROWS - 1) // ROWS
    for task in prange(nj * nm):
        jb = task % nj
        mb = task // nj
        j0 = jb * COLS
        i0 = mb * ROWS
        i1 = min(M, i0 + ROWS)
        gemm_nt_block(x, i0, i1, W, j0, j0 + COLS, K, xw, zero, bf_T, N)
        for i in range(i0, i1):
            r = i
            if bf_T > 0:
                r = (i % bf_T) * N + i // bf_T
            for j in range(j0, j0 + COLS):
                xw[r, j] += b[j]


input_projection_serial, input_projection_parallel = twins(_input_projection)
