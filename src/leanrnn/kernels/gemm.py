"""GEMMs on gate-fused block panels (formats.packing): the recurrent step and the input
projection of all timesteps as one blocked GEMM, both on the register tiles of ``_simd``.

``panelN(P, u, v0, A, i0, i1, K, C, ccol, bias, boff)`` computes, for a panel slice of N groups
of 16 columns,

    C[i, ccol + j] = bias[boff + j] + sum_{k<K} A[i, k] * P[u, k, v0*16 + j]
    i0 <= i < i1, j < N*16;  boff < 0: no bias (any array of the dtype may be passed)

P: [U, Kp, Wd] panels; A: [rows, >=K] and C: [rows, >=ccol+N*16], both C-contiguous; C must
not alias A or P. There are four of them, not one taking N, because each must name its
intrinsic statically: a branch on N would expand all four tile bodies into every caller. With
more than one row, K is cut into KC-long slices so the panel slice the row tiles share stays in
L2 (the tile needs 256 B of weights per 12 cycles, which L2 sustains; L1 residency does not
matter); a single row (GEMV) streams the whole panel once instead. KC and ROWS come from this
CPU's L2 (_cpu.kc, _cpu.row_chunk: the panel slice a quarter of it, the chunk of x the rest);
the rule reproduces what a sweep found on a Zen 5 (1 MiB L2): KC 64 -> 256 and ROWS 96 -> 192
took the H=1024 projection from 195 to 234 GFLOP/s; KC 256 -> 1024 (no slicing up to K = 1024)
gained another 1-3% at H=1024.
"""

from __future__ import annotations

import math

from . import _cpu
from ._jit import inline, kernel
from ._simd import TILES, panel_gemm1, panel_gemm2, panel_gemm3, panel_gemm4
from ._sync import take, task_done, wait_tasks
from .abi import B

# Row chunks are a multiple of every dtype's tile height, so only the last one has leftovers.
ALIGN = math.lcm(*(t.rows for t in TILES.values()))
KC = _cpu.kc(_cpu.caches()["L2"])  # inputs per K slice of the multi-row panel GEMM
ROWS = _cpu.row_chunk(_cpu.caches()["L2"], KC, ALIGN)  # input rows per projection task


@inline
def _kc(K, i0, i1):
    return K if i1 - i0 == 1 else KC


@inline
def _mode(k0, boff):
    # the tile's init (see _simd): later K slices add to C; the first starts from 0 or the bias
    return 1 if k0 > 0 else (2 if boff >= 0 else 0)


@inline
def _off(P, u, v0, k0):
    return (u * P.shape[1] + k0) * P.shape[2] + v0 * B


@inline
def panel1(P, u, v0, A, i0, i1, K, C, ccol, bias, boff):
    kc = _kc(K, i0, i1)
    for k0 in range(0, K, kc):
        panel_gemm1(P, _off(P, u, v0, k0), P.shape[2], A, k0, i0, i1, A.shape[1],
                    min(kc, K - k0), C, ccol, C.shape[1], _mode(k0, boff), bias, boff)  # fmt: skip


@inline
def panel2(P, u, v0, A, i0, i1, K, C, ccol, bias, boff):
    kc = _kc(K, i0, i1)
    for k0 in range(0, K, kc):
        panel_gemm2(P, _off(P, u, v0, k0), P.shape[2], A, k0, i0, i1, A.shape[1],
                    min(kc, K - k0), C, ccol, C.shape[1], _mode(k0, boff), bias, boff)  # fmt: skip


@inline
def panel3(P, u, v0, A, i0, i1, K, C, ccol, bias, boff):
    kc = _kc(K, i0, i1)
    for k0 in range(0, K, kc):
        panel_gemm3(P, _off(P, u, v0, k0), P.shape[2], A, k0, i0, i1, A.shape[1],
                    min(kc, K - k0), C, ccol, C.shape[1], _mode(k0, boff), bias, boff)  # fmt: skip


@inline
def panel4(P, u, v0, A, i0, i1, K, C, ccol, bias, boff):
    kc = _kc(K, i0, i1)
    for k0 in range(0, K, kc):
        panel_gemm4(P, _off(P, u, v0, k0), P.shape[2], A, k0, i0, i1, A.shape[1],
                    min(kc, K - k0), C, ccol, C.shape[1], _mode(k0, boff), bias, boff)  # fmt: skip


@kernel
def input_projection(x, W, b, K, xw, sync):
    """xw = x W^T + b for every input row at once (rows in x's own order).

    x:  [M, >=K] inputs (rows t*N + n, or n*T + t for batch-first input — the recurrent kernels
        are told which); W: [U, Cp, Wd] panels; b: [U*Wd] folded bias; xw: [M, U*Wd] output.
    Tasks (a chunk of rows x one panel) are handed out by ticket from ``sync`` (see _sync), so
    any number of threads may call this at once on the same arrays: each returns when all
    tasks are done. Row chunks are the outer order: a chunk of x stays in cache while the
    panels stream past it (panel-major order re-read all of x from L3 for every panel).
    """
    M = x.shape[0]
    U, _, Wd = W.shape
    # Even row chunks, a multiple of the tile heights.
    nm = (M + ROWS - 1) // ROWS
    rows = ((M + nm - 1) // nm + ALIGN - 1) // ALIGN * ALIGN
    ntasks = U * nm
    while True:
        task = take(sync)
        if task >= ntasks:
            break
        u = task % U
        i0 = (task // U) * rows
        i1 = min(M, i0 + rows)
        c0 = u * Wd
        # The tile adds the bias in its final store: a second pass over xw adding it cost a
        # quarter of the time at H=128. Rounding rows up to the tile height can leave the
        # last chunk empty.
        if i0 < i1 and Wd == 4 * B:
            panel4(W, u, 0, x, i0, i1, K, xw, c0, b, c0)
        elif i0 < i1 and Wd == 3 * B:
            panel3(W, u, 0, x, i0, i1, K, xw, c0, b, c0)
        elif i0 < i1:
            panel1(W, u, 0, x, i0, i1, K, xw, c0, b, c0)
        task_done(sync)
    wait_tasks(sync, ntasks)
