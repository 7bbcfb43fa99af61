"""GEMMs on gate-fused block panels (formats.packing): the recurrent step and the input
projection of all timesteps as one blocked GEMM, both on the register tiles of ``_simd``.

``panelN(P, u, v0, A, i0, i1, K, C, ccol, bias, boff)`` computes, for a panel slice of N groups
of 16 columns,

    C[i, ccol + j] = bias[boff + j] + sum_{k<K} A[i, k] * P[u, k, v0*16 + j]
    i0 <= i < i1, j < N*16;  boff < 0: no bias (any array of the dtype may be passed)

P: [U, Kp, Wd] panels; A: [rows, >=K] and C: [rows, >=ccol+N*16], both C-contiguous; C must
not alias A or P. int8-dynamic panels (uint8, kernels._qdot) take A as operand() makes it: the
rows quantized into a flat uint8 scratch; bf16 and int8 panels on AMX (kernels._bf16amx) from
4 rows the rows split into two bfloat16 terms, or for bf16-act rounded to one (a stride of its
own, abi.split_row_floats(K, True)); K is then never sliced; bf16-act's other operands rounded
into float32 rows of K (round_rows). A plain A's row stride must not be a split one (the
engine's are at most 15 wider than K). There are four of them, not one taking N, because
each must name its intrinsic statically: a branch on N would expand all four tile bodies into
every caller. With more than one row, K is cut into KC-long slices so the panel slice the
row tiles share stays in L2 (the tile needs 256 B of weights per 12 cycles, which L2
sustains; L1 residency does not matter: KC 128 or 256 instead of the whole K = 512 gained
nothing on a Xeon with 48 KiB of L1, 2026-12-01); a single row (GEMV) streams the whole panel
once instead. KC and ROWS come from this CPU's L2 (_cpu.kc,
_cpu.row_chunk: the panel slice a quarter of it, the chunk of x the rest); the rule
reproduces what a sweep found on a Zen 5 (1 MiB L2): KC 64 -> 256 and ROWS 96 -> 192 took the
H=1024 projection from 195 to 234 GFLOP/s; KC 256 -> 1024 (no slicing up to K = 1024) gained
another 1-3% at H=1024.
"""

from __future__ import annotations

import numba
import numpy as np
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic, overload

from . import _cpu
from ._bf16amx import split_rows
from ._cells import block_add
from ._ir import prefetch_l2
from ._jit import CACHE, inline, kernel
from ._simd import (
    panel_gemm1,
    panel_gemm2,
    panel_gemm3,
    panel_gemm4,
    panel_gemm_t1,
    panel_gemm_t2,
    panel_gemm_t3,
    panel_gemm_t4,
)
from ._sync import take, task_done, wait_tasks
from .abi import (
    CODE_OFFSET,
    SPLIT_PRECISIONS,
    B,
    quantized_row_bytes,
    split_min_rows,
    split_row_floats,
)

_row_bytes = numba.njit(quantized_row_bytes)  # the engine sizes q with the same functions
_split_ld = numba.njit(split_row_floats)
# bf16 panels' GEMMs of split_min_rows rows or more run on AMX (_bf16amx) or vdpbf16ps
# (_simd's dp_loop) where compiled so: their operand is then split once per call of operand()
# (a step, a projection chunk), not once per panel by the tile.
_BF16_DOT = _cpu.bf16_dot(_cpu.isa())
_BF16_AMX = _BF16_DOT == "amx"
# Panels of reduced weights (bf16, weight-only int8), whose operand may be held in q.
_REDUCED = (types.uint16, types.int8)
# Those whose GEMMs of _SPLIT_FROM rows or more multiply a split operand here (abi).
_SPLIT = tuple({"bf16": types.uint16, "int8": types.int8}[p]
               for p in SPLIT_PRECISIONS.get(_BF16_DOT, ()))  # fmt: skip
_SPLIT_FROM = split_min_rows(_BF16_DOT)

# Row chunks are a multiple of every dtype's tile height, so only the last one has leftovers;
# KC inputs per K slice of the multi-row panel GEMM, ROWS input rows per projection task.
ALIGN, KC, ROWS = _cpu.blocking(_cpu.isa())
_QMAX = np.float32(127.0)  # activation codes: round(a / s) in [-127, 127], s = max|a| / 127
_RINT = np.float32(12582912.0)  # 1.5 * 2**23: x + _RINT - _RINT rounds x to an integer


def _kc(P, K, i0, i1):  # pragma: no cover - replaced by the overload inside kernels
    pass


@overload(_kc)
def _kc_impl(P, K, i0, i1):
    if P.dtype == types.uint8 or P.dtype in _SPLIT:
        # int8-dynamic, and split operands: K whole (_qdot; _bf16amx and dp_loop read a
        # split operand from its first input: they take no K offset)
        return lambda P, K, i0, i1: K
    return lambda P, K, i0, i1: K if i1 - i0 == 1 else KC


@inline
def _mode(k0, boff):
    # the tile's init (see _simd): later K slices add to C; the first starts from 0 or the bias
    return 1 if k0 > 0 else (2 if boff >= 0 else 0)


def _off(P, u, v0, k0):  # pragma: no cover - replaced by the overload inside kernels
    pass


@overload(_off)
def _off_impl(P, u, v0, k0):
    """Flat offset of panel u's row k0, column group v0 (int8-dynamic panels hold 4 inputs per
    row and 4 bytes per column, see _qdot; bf16 ones 2 and 2, see _simd; k0 is a multiple)."""
    if P.dtype == types.uint8:
        return lambda P, u, v0, k0: (u * P.shape[1] + k0 // 4) * P.shape[2] + v0 * B * 4
    if P.dtype == types.uint16:  # bf16: 2 inputs per row, each column's side by side
        return lambda P, u, v0, k0: (u * P.shape[1] + k0 // 2) * P.shape[2] + v0 * B * 2
    return lambda P, u, v0, k0: (u * P.shape[1] + k0) * P.shape[2] + v0 * B


# No fast-math: the codes must be exactly what numpy's float32 arithmetic gives. Said
# explicitly: numba compiles a callee that leaves fastmath unset with its caller's flags (the
# fast-math kernels'), and reassociated, a * (127 / amax) became (a * 127) / amax, inf for
# every |a| past ~2.7e36 (codes 0); the cache then kept that build for direct calls too.
@numba.njit(cache=CACHE, error_model="numpy", nogil=True, fastmath=False)
def quantize_rows(A, i0, i1, K, out):
    """Rows i0..i1 of float32 A [rows, >=K] -> int8-dynamic activation rows in the flat uint8
    ``out``, row r at r * ld, ld = quantized_row_bytes(K) (kernels._qdot): symmetric per row,
    s = max_k |a_k| / 127, code round(a_k / s) + 128 (ties to even), s in the row's last 4
    bytes. An all-zero row gets codes 128 and s = 0, and so does a row too small for
    127 / max|a| to be a float32 (max|a| < ~3.7e-37: its outputs then err by less than that;
    converting the inf codes to integers would be undefined); a row holding NaN or inf gets
    s = NaN, so its outputs are NaN (non-finite input propagates). Flat, not [rows, ld]: a reshape
    needs a numba runtime helper the native build does not link."""
    ld = _row_bytes(K)
    for r in range(i1 - i0):
        # max |a| as the largest of the bits with the sign cleared: for floats that are not
        # NaN the same order, and an integer max is a reduction LLVM vectorizes without
        # fast-math (a float compare-and-select is not: 5x slower at K = 512, 1.1 us per row,
        # a tenth of an int8-dynamic LSTM H=512 step). NaN and inf have the largest bits.
        a = A[i0 + r].view(np.uint32)
        m = np.uint32(0)
        for k in range(K):
            m = max(m, a[k] & np.uint32(0x7FFFFFFF))
        finite = m < np.uint32(0x7F800000)
        slot = out[(r + 1) * ld - 4 : (r + 1) * ld]  # the row's scale, scratch until then
        slot.view(np.uint32)[0] = m
        amax = slot.view(np.float32)[0]
        scale = np.float32(np.nan)
        inv = _QMAX / amax if amax > 0 else np.float32(np.inf)
        if finite and inv < np.inf:
            for k in range(K):
                # round to nearest, ties to even, as np.rint, by adding and taking away
                # 1.5 * 2**23 (|a * inv| <= 127 + a rounding: exact there), which vectorizes
                x = A[i0 + r, k] * inv
                out[r * ld + k] = np.uint8(np.int32((x + _RINT) - _RINT) + CODE_OFFSET)
            scale = amax / _QMAX
        else:
            for k in range(K):
                out[r * ld + k] = CODE_OFFSET
            if finite:
                scale = np.float32(0.0)
        out[(r + 1) * ld - 4 : (r + 1) * ld].view(np.float32)[0] = scale


# No fast-math, as quantize_rows: the rounding is done on the bits.
@numba.njit(cache=CACHE, error_model="numpy", nogil=True, fastmath=False)
def round_rows(A, i0, i1, K, out):
    """Rows i0..i1 of float32 A [rows, >=K] rounded to bfloat16 as vcvtneps2bf16 rounds
    (nearest, ties to even; subnormals to a zero of their sign; NaN stays NaN), as float32
    rows of K in the flat uint8 ``out``: bf16-act's operand where the float32 tile multiplies
    (fewer than _SPLIT_FROM rows, or no split), so that its activations are rounded on every
    path (a bf16 x bf16 product is exact in float32)."""
    o = out.view(np.uint32)
    for r in range(i1 - i0):
        a = A[i0 + r].view(np.uint32)
        for k in range(K):
            u = a[k]
            e = u & 0x7F800000
            if e == 0x7F800000:  # inf stays; NaN stays NaN, made quiet (its payload may
                v = u & 0xFFFF0000  # lie in the low bits alone)
                if u & 0x7FFFFF:
                    v |= 0x400000
            elif e == 0:
                v = u & 0x80000000
            else:
                v = (u + 0x7FFF + ((u >> 16) & 1)) & 0xFFFF0000
            o[r * K + k] = v


def _prepare_operand(P, A, q, me, i0, i1, K, fresh, bf16_act):  # pragma: no cover - overloaded
    pass


@overload(_prepare_operand)
def _prepare_operand_impl(P, A, q, me, i0, i1, K, fresh, bf16_act):
    """Fill q[me] for the panels' tile and return the row stride (floats) of the operand it
    holds there, 0 if the operand is A itself: int8-dynamic's codes always (any stride: they
    are flat); bf16 and weight-only int8 (_SPLIT) from _SPLIT_FROM rows on the split rows
    (for bf16 rounded ones where bf16_act; split_row_floats(K, bf16_act)); bf16_act's other
    operands rounded into float32 rows of K (round_rows). q holds them where the engine sized
    it so."""
    if P.dtype == types.uint8:

        def quantized(P, A, q, me, i0, i1, K, fresh, bf16_act):
            if fresh:
                quantize_rows(A, i0, i1, K, q[me])
            return 1

        return quantized
    if P.dtype in _SPLIT:  # chosen here: split_rows is AVX512-BF16 code
        one_term = P.dtype == types.uint16  # int8's codes take two terms: float32 activations

        def split(P, A, q, me, i0, i1, K, fresh, bf16_act):
            act = bf16_act and one_term
            if i1 - i0 >= _SPLIT_FROM:
                # 32 rows' room: an AMX block of the last 1..31 rows reads whole tiles of 16
                ld = _split_ld(K, act)
                if q.shape[1] >= (i1 - i0 + 31) // 32 * 32 * 4 * ld:
                    if fresh:
                        split_rows(A, i0, i1, K, q[me], act)
                    return ld
            return _rounded(A, q, me, i0, i1, K, fresh, act)

        return split
    if P.dtype == types.uint16:

        def rounded(P, A, q, me, i0, i1, K, fresh, bf16_act):
            return _rounded(A, q, me, i0, i1, K, fresh, bf16_act)

        return rounded
    return lambda P, A, q, me, i0, i1, K, fresh, bf16_act: 0


@inline
def _rounded(A, q, me, i0, i1, K, fresh, bf16_act):
    """bf16 panels' operand for the float32 tile: bf16_act's rows rounded into q[me] (stride
    K), else A itself (0)."""
    if bf16_act and q.shape[1] >= (i1 - i0) * 4 * K:
        if fresh:
            round_rows(A, i0, i1, K, q[me])
        return K
    return 0


@intrinsic
def _operand_view(typingctx, P, A, q, me, i0, ld):
    """Rows i0.. of A, or for int8-dynamic panels (uint8) row ``me`` of q, or for bf16 and
    int8 ones where ``ld`` > 0 row ``me`` of q as float32 rows of ld: a view made in IR, since the
    kernels compile without numba's reference counting, and a function compiled so may
    return no array but its argument."""
    quantized = P.dtype == types.uint8
    rt = types.Array(types.uint8, 1, "C") if quantized else A

    def rows_of(context, builder, src, row):
        """(data, shape, strides) of rows ``row``.. of array ``src``."""
        shape = cgutils.unpack_tuple(builder, src.shape)
        strides = cgutils.unpack_tuple(builder, src.strides)
        base = builder.ptrtoint(src.data, strides[0].type)
        data = builder.inttoptr(builder.add(base, builder.mul(row, strides[0])), src.data.type)
        return data, shape, strides

    def gen(context, builder, sig, args):
        out = context.make_array(rt)(context, builder)
        if quantized:
            src = context.make_array(sig.args[2])(context, builder, args[2])
            data, shape, strides = rows_of(context, builder, src, args[3])
            context.populate_array(out, data=data, shape=[shape[1]], strides=[strides[1]],
                                   itemsize=src.itemsize, meminfo=src.meminfo)  # fmt: skip
        else:
            src = context.make_array(sig.args[1])(context, builder, args[1])
            data, shape, strides = rows_of(context, builder, src, args[4])
            shape, strides = [builder.sub(shape[0], args[4]), *shape[1:]], list(strides)
            if P.dtype in _REDUCED:  # bf16, int8: q[me] as rows of ld where ld > 0
                qa = context.make_array(sig.args[2])(context, builder, args[2])
                qdata, qshape, _ = rows_of(context, builder, qa, args[3])
                i64 = shape[0].type
                ld = builder.sext(args[5], i64) if args[5].type.width < 64 else args[5]
                four = i64(4)
                use = builder.icmp_signed(">", ld, i64(0))
                row = builder.mul(builder.select(use, ld, i64(1)), four)
                data = builder.select(use, builder.bitcast(qdata, data.type), data)
                shape[0] = builder.select(use, builder.sdiv(qshape[1], row), shape[0])
                shape[1] = builder.select(use, ld, shape[1])
                strides[0] = builder.select(use, row, strides[0])
                strides[1] = builder.select(use, four, strides[1])
            context.populate_array(out, data=data, shape=shape, strides=strides,
                                   itemsize=src.itemsize, meminfo=src.meminfo)  # fmt: skip
        view = out._getvalue()
        if context.enable_nrt:  # a caller that counts references (a test's) owns one more
            context.nrt.incref(builder, rt, view)
        return view

    return rt(P, A, q, me, i0, ld), gen


@inline
def operand(P, A, q, me, i0, i1, K, fresh, bf16_act):
    """What the panel GEMMs of P multiply: rows i0.. of A itself; for int8-dynamic panels
    (uint8) those rows quantized into this thread's scratch q[me] (flat, quantize_rows); for
    bf16 and int8 ones (_SPLIT), from _SPLIT_FROM rows, those rows split into two bfloat16
    terms in q[me] (split_rows; for bf16 rounded to one where ``bf16_act``), as float32 rows
    of split_row_floats(K, one term or two) — row strides no plain A has, by which the tile
    tells them apart; bf16_act's other operands rounded to bfloat16 in q[me] as float32 rows of K
    (round_rows). q[me] is refilled only when ``fresh``, else it holds the rows of the last
    call. Row 0 of the result is A's row i0; _lda gives its row stride."""
    ld = _prepare_operand(P, A, q, me, i0, i1, K, fresh, bf16_act)
    return _operand_view(P, A, q, me, i0, ld)


def slice_rows(P):  # pragma: no cover - replaced by the overload inside kernels
    pass


@overload(slice_rows)
def _slice_rows_impl(P):
    """Rows a thread's batch slice is cut at a multiple of (_sync.share) for GEMMs on P: the
    float32 tiles' ALIGN, or for bf16 and int8 on AMX an AMX tile's 16 — at N=64 on 2
    threads, 6-row cuts gave 30 / 34 rows, and the 34 ran a 32-row AMX block and a 2-row one
    costing 16."""
    if P.dtype in _SPLIT and _BF16_AMX:
        return lambda P: 16
    return lambda P: ALIGN


def _columns(P):  # pragma: no cover - replaced by the overload inside kernels
    pass


@overload(_columns)
def _columns_impl(P):
    """Output columns per panel (an int8-dynamic panel row holds 4 bytes per column, a bf16
    one 2 inputs)."""
    if P.dtype == types.uint8:
        return lambda P: P.shape[2] // 4
    if P.dtype == types.uint16:
        return lambda P: P.shape[2] // 2
    return lambda P: P.shape[2]


def _lda(A, K):  # pragma: no cover - replaced by the overload inside kernels
    pass


@overload(_lda)
def _lda_impl(A, K):
    """Row stride of a panel GEMM's A: its own, or a flat quantized operand's (operand)."""
    if A.ndim == 1:
        return lambda A, K: _row_bytes(K)
    return lambda A, K: A.shape[1]


@inline
def _ahead(P, nb, rows):
    """(P's flat element offset of block nb's panel, its cache lines): what a GEMM of ``rows``
    rows on a float panel spreads its prefetch over (_simd), or (0, 0): no next block (nb <
    0), too few rows, P small enough to stay in L2 (next_panel_share), or reduced panels
    (their tiles do not spread; _phase asks for theirs between the rows' updates)."""
    if nb < 0 or not _spreads(P) or not _panel_prefetch_pays(P, rows):
        return 0, 0
    return _off(P, nb, 0, 0), (P.shape[1] * P.shape[2] * P.itemsize + 63) // 64


def _spreads(P):  # pragma: no cover - replaced by the overload inside kernels
    pass


@overload(_spreads)
def _spreads_impl(P):
    """Whether P's GEMM tile spreads a next-panel prefetch over its k loop: float panels'."""
    spreads = P.dtype in (types.float32, types.float64)
    return lambda P: spreads


@inline
def panel1(P, u, v0, A, i0, i1, K, C, ccol, bias, boff, nb):
    kc = _kc(P, K, i0, i1)
    pf, lines = _ahead(P, nb, i1 - i0)
    for k0 in range(0, K, kc):
        panel_gemm1(P, _off(P, u, v0, k0), P.shape[2], A, k0, i0, i1, _lda(A, K),
                    min(kc, K - k0), C, ccol, C.shape[1], _mode(k0, boff), bias, boff, pf,
                    lines if k0 == 0 else 0)  # fmt: skip


@inline
def panel2(P, u, v0, A, i0, i1, K, C, ccol, bias, boff, nb):
    kc = _kc(P, K, i0, i1)
    pf, lines = _ahead(P, nb, i1 - i0)
    for k0 in range(0, K, kc):
        panel_gemm2(P, _off(P, u, v0, k0), P.shape[2], A, k0, i0, i1, _lda(A, K),
                    min(kc, K - k0), C, ccol, C.shape[1], _mode(k0, boff), bias, boff, pf,
                    lines if k0 == 0 else 0)  # fmt: skip


@inline
def panel3(P, u, v0, A, i0, i1, K, C, ccol, bias, boff, nb):
    kc = _kc(P, K, i0, i1)
    pf, lines = _ahead(P, nb, i1 - i0)
    for k0 in range(0, K, kc):
        panel_gemm3(P, _off(P, u, v0, k0), P.shape[2], A, k0, i0, i1, _lda(A, K),
                    min(kc, K - k0), C, ccol, C.shape[1], _mode(k0, boff), bias, boff, pf,
                    lines if k0 == 0 else 0)  # fmt: skip


@inline
def panel4(P, u, v0, A, i0, i1, K, C, ccol, bias, boff, nb):
    kc = _kc(P, K, i0, i1)
    pf, lines = _ahead(P, nb, i1 - i0)
    for k0 in range(0, K, kc):
        panel_gemm4(P, _off(P, u, v0, k0), P.shape[2], A, k0, i0, i1, _lda(A, K),
                    min(kc, K - k0), C, ccol, C.shape[1], _mode(k0, boff), bias, boff, pf,
                    lines if k0 == 0 else 0)  # fmt: skip


@inline
def _row_chunk(rows):
    """Rows of a row-chunk task (input_projection's, weight_gradient's): ``rows`` in even
    chunks of at most ROWS, each a multiple of ALIGN (the tile heights)."""
    n = (rows + ROWS - 1) // ROWS
    return ((rows + n - 1) // n + ALIGN - 1) // ALIGN * ALIGN


@inline
def _row_live(r, lengths, T, N, xw_bf_T):
    """Whether input row r is a step within its sample's length: rows t*N + n, or n*T + t
    where xw_bf_T > 0 (batch-first input)."""
    if xw_bf_T > 0:
        return r % T < lengths[r // T]
    return r // N < lengths[r % N]


@inline
def _group_live(g0, g1, lengths, T, N, xw_bf_T):
    """Whether a row of g0..g1 is live (_row_live)."""
    r = g0
    while r < g1 and not _row_live(r, lengths, T, N, xw_bf_T):
        r += 1
    return r < g1


@inline
def _live_run(i, i1, base, G, lengths, T, N, xw_bf_T, ragged):
    """The next run of rows from i (< i1) that has a live row in each of its G-row groups —
    the groups on a grid from ``base`` (the chunk's first row), so each row keeps the tile it
    has in a product of the whole chunk, and its bits (see _live_end in recurrent.py; a last
    group of fewer than G rows is taken with the group before it, so that no product is a
    lone short tail). Returns (start, end); start == i1 if no row from i is live."""
    if not ragged:
        return i, i1
    a = i
    while a < i1 and not _group_live(a, min(i1, a + G), lengths, T, N, xw_bf_T):
        a = min(i1, a + G)
    if a >= i1:
        return i1, i1
    e = a
    while e < i1 and _group_live(e, min(i1, e + G), lengths, T, N, xw_bf_T):
        e = min(i1, e + G)
    if e == i1 and i1 - a < G and a > base:  # a short tail on its own: with the group before
        a = max(base, a - G)
    return a, e


@kernel
def input_projection(x, W, b, K, xw, lengths, T, xw_bf_T, sync, q, bf16_act, me):
    """xw = x W^T + b for every input row that is a step within its sample's length (rows in
    x's own order); rows past a length are left as they are, since no kernel reads them.

    x:  [M, >=K] inputs (rows t*N + n, or n*T + t for batch-first input, xw_bf_T > 0);
    W: [U, Cp, Wd] panels; b: [U*Wd] folded bias; xw: [M, U*Wd] output;
    lengths: [N] int64 steps per sample and T the steps (M = T*N); T = 0 or no lengths: every
        row (graph heads' products). A padded batch of rows sorted longest first (serve's
        calls, score's buckets) then computes its live steps only, as a packed sequence does:
        each task multiplies the runs of its chunk's row groups that hold a live row (_live_run);
    q:  [threads, bytes] uint8 scratch, row ``me`` this thread's: int8-dynamic panels (uint8
        W) multiply its quantized copy of the task's rows (operand), bf16 and int8 ones on AMX
        its split (bf16 with bf16_act: rounded) copy; unused otherwise.
    Tasks (a chunk of rows x one panel) are handed out by ticket from ``sync`` (see _sync), so
    any number of threads may call this at once on the same arrays: each returns when all
    tasks are done. Row chunks are the outer order: a chunk of x stays in cache while the
    panels stream past it (panel-major order re-read all of x from L3 for every panel), and a
    thread quantizes a chunk once for all the panels it takes of it.
    """
    M = x.shape[0]
    U, Wd = W.shape[0], _columns(W)
    rows = _row_chunk(M)
    nm = (M + rows - 1) // rows  # chunks: none empty
    ntasks = U * nm
    N = lengths.shape[0]
    ragged = T > 0 and N > 0 and M == T * N
    G = slice_rows(W)
    last = -1  # the first row of the rows this thread's q[me] holds
    while True:
        task = take(sync)
        if task >= ntasks:
            break
        u = task % U
        i0 = (task // U) * rows
        i1 = min(M, i0 + rows)
        c0 = u * Wd
        i = i0
        while i < i1:
            a, e = _live_run(i, i1, i0, G, lengths, T, N, xw_bf_T, ragged)
            i = e
            if a >= e:
                break
            # The tile adds the bias in its final store: a second pass over xw adding it
            # cost a quarter of the time at H=128. Row 0 of A and of C is row a.
            A = operand(W, x, q, me, a, e, K, a != last, bf16_act)
            last = a
            C = xw[a:]
            if Wd == 4 * B:
                panel4(W, u, 0, A, 0, e - a, K, C, c0, b, c0, -1)
            elif Wd == 3 * B:
                panel3(W, u, 0, A, 0, e - a, K, C, c0, b, c0, -1)
            else:
                panel1(W, u, 0, A, 0, e - a, K, C, c0, b, c0, -1)
        task_done(sync)
    wait_tasks(sync, ntasks)


# A step's panel GEMMs (the recurrences' and backward's dh) ask for the next unit block's
# panel into L2 while they run this block's, where W is larger than half of this core's L2
# (below that, the walk over the blocks finds it there) and the GEMM has at least this many
# rows (a lone row streams its panel with its own prefetch). On a Sapphire Rapids-class Xeon
# (L2 2 MiB; an LSTM H=512's R is 4 MiB) the first row tile's panel loads, from L3, were the
# step GEMM's hottest instructions. Float panels' tiles spread the prefetch over their k loop
# (panelN's nb, _ahead); reduced panels' ask for a share per row between the rows' updates
# (next_panel_share, prefetch_next_panel): in those bursts the prefetches waited for fill
# buffers, ~10% of the float LSTM H=512 N=64 step (spread: 5% faster, interleaved processes).
PANEL_L2 = _cpu.caches()["L2"] // 2
PANEL_PREFETCH_ROWS = 4


@inline
def _panel_prefetch_pays(W, rows):
    """Whether a GEMM of ``rows`` rows on W asks for the next block's panel ahead (above)."""
    return rows >= PANEL_PREFETCH_ROWS and W.nbytes > PANEL_L2


@inline
def next_panel_share(W, rows):
    """Panel rows of W ([U, Kp, Wd]) each of ``rows`` finished rows asks for ahead, 0 where
    it is not worth it (PANEL_L2) or the GEMM's tile asks for them (_ahead)."""
    if not _panel_prefetch_pays(W, rows) or _spreads(W):
        return 0
    return (W.shape[1] + rows - 1) // rows


@inline
def prefetch_next_panel(W, nb, r, per):
    """Ask for share ``r`` (``per`` rows) of W's panel ``nb`` into L2; nothing if per is 0
    or nb < 0 (no next block)."""
    if per > 0 and nb >= 0:
        r0 = r * per
        if r0 < W.shape[1]:
            prefetch_l2(W[nb], r0, 0, min(per, W.shape[1] - r0) * W.shape[2] * W.itemsize)


# Rows of G per K slice of a weight-gradient product (weight_gradient): 256 (KC on a Zen 5)
# ran the H=128 LSTM's products 10% slower than 64; 32 and 16 were no faster than 64.
WG_ROWS = 64


@inline
def _tgemm(P, pcol, A, i0, i1, M, C, u, ccol, ng):
    """C[u, i, ccol + j] += sum_{k<M} A[k, i] * P[k, pcol + j] for i0 <= i < i1, j < ng*16:
    A read transposed and P's columns read as a panel (its rows at P's row stride), both in
    place, in slices of WG_ROWS rows."""
    ldp, lda, ldc = P.shape[1], A.shape[1], C.shape[2]
    cbase = u * C.shape[1] * ldc + ccol
    for k0 in range(0, M, WG_ROWS):
        k = min(WG_ROWS, M - k0)
        poff = k0 * ldp + pcol
        if ng == 4:
            panel_gemm_t4(P, poff, ldp, A, k0, i0, i1, lda, k, C, cbase, ldc, 1, P, -1, 0, 0)
        elif ng == 3:
            panel_gemm_t3(P, poff, ldp, A, k0, i0, i1, lda, k, C, cbase, ldc, 1, P, -1, 0, 0)
        elif ng == 2:
            panel_gemm_t2(P, poff, ldp, A, k0, i0, i1, lda, k, C, cbase, ldc, 1, P, -1, 0, 0)
        else:
            panel_gemm_t1(P, poff, ldp, A, k0, i0, i1, lda, k, C, cbase, ldc, 1, P, -1, 0, 0)


@inline
def _column_sums(P, pcol, ng, M, out, ocol):
    """out[0, ocol + j] += sum_{k<M} P[k, pcol + j], j < ng*16 (a bias's gradient), k in
    order."""
    for k in range(M):
        for v in range(ng):
            block_add(out, 0, ocol + v * B, out, 0, ocol + v * B, P, k, pcol + v * B)


@kernel
def weight_gradient(x, X, h, Kh, G, ghn, dW, dR, bW, bR, sync):
    """dW += x^T G and dR += h^T G: the weight gradients of one (layer, direction) over a
    segment's rows (t*N + n), added straight into their panels. The tile reads x and h
    transposed in place and a unit block's columns of G as a panel whose rows lie at G's row
    stride, so nothing is copied: for small layers (the trainer picks them) the transposes of
    x and h, the packing of G and the scratch products added into the panels afterwards
    (engine.products), all serial numpy, were a fifth of the backward.

    x: [M, >=X] the inputs of every row; h: [M, >=Kh] h_prev of every row; G: [M, U*Wd] the
    gate gradients (packed column order: unit block u's gates are columns u*Wd..); ghn: a
    GRU's [M, >=U*B] d(R_n h + bR_n), the n gate's columns of dR (the reset gate sits between
    h and them), else [0, *]; dW: [U, >=X, Wd], dR: [U, >=Kh, Wd] the gradient panels (rows
    past X and Kh untouched); bW, bR: [1, U*Wd] the bias gradients, += G's column sums (GRU's
    bR n columns: ghn's), or [1, 0] for none. Tasks (a panel of dW or dR x a chunk of its
    rows, the first chunk adding its panel's bias sums) by ticket from ``sync``; each output
    is summed over M in one order whatever the thread count."""
    M = G.shape[0]
    U, Wd = dW.shape[0], dW.shape[2]
    ng = Wd // B
    rx, rh = _row_chunk(X), _row_chunk(Kh)
    tw = U * ((X + rx - 1) // rx)
    ntasks = tw + U * ((Kh + rh - 1) // rh)
    while True:
        task = take(sync)
        if task >= ntasks:
            break
        if task < tw:
            u = task % U
            i0 = (task // U) * rx
            _tgemm(G, u * Wd, x, i0, min(X, i0 + rx), M, dW, u, 0, ng)
            if i0 == 0 and bW.shape[1] > 0:
                _column_sums(G, u * Wd, ng, M, bW, u * Wd)
        else:
            u = (task - tw) % U
            i0 = ((task - tw) // U) * rh
            i1 = min(Kh, i0 + rh)
            bias = i0 == 0 and bR.shape[1] > 0
            if ghn.shape[0] > 0:  # GRU: z and r from G, n from ghn
                _tgemm(G, u * Wd, h, i0, i1, M, dR, u, 0, 2)
                _tgemm(ghn, u * B, h, i0, i1, M, dR, u, 2 * B, 1)
                if bias:
                    _column_sums(G, u * Wd, 2, M, bR, u * Wd)
                    _column_sums(ghn, u * B, 1, M, bR, u * Wd + 2 * B)
            else:
                _tgemm(G, u * Wd, h, i0, i1, M, dR, u, 0, ng)
                if bias:
                    _column_sums(G, u * Wd, ng, M, bR, u * Wd)
        task_done(sync)
    wait_tasks(sync, ntasks)
