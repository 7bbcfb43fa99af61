"""Register-blocked GEMM tiles written as LLVM vector IR (numba intrinsics).

Weights live in *block panels* (formats.packing): for unit block u, a [K, ng*16] panel whose row k
holds the weights of all ng*16 gate rows of the block for input k. A tile keeps MR input rows x
nvec 16-wide vectors of outputs in registers, broadcasts one input A[r, k] at a time and does
MR*nvec FMAs per 1 + nvec loads — no horizontal sums, no re-packing per call (what a BLAS sgemm
does on every call). LLVM lowers the 16-wide vectors to one zmm (AVX-512), two ymm (AVX2) or
four xmm, so the same IR serves every x86-64 (and NEON) machine.

One intrinsic per panel width (nvec = 1..4 groups of 16 outputs) computes a whole block:

    C[coff + i*ldc + j] = init + sum_{k<K} A[i*lda + acol + k] * P[poff + k*kstride + j]
    for i0 <= i < i1, j < nvec*16   (flat element offsets into C-contiguous arrays)

    The ``panel_gemm_t`` tiles read A transposed in place, ``A[(acol + k)*lda + i]`` (A's
    columns are the tile's rows; float panels only): a weight gradient x^T G with x as it
    lies (kernels.gemm.weight_gradient).

    init by ``mode``: 0 → 0;  1 → C's old value (the caller blocks K, so later K slices add
    to the first);  2 → bias[boff + j], the same for every row (the input projection's folded
    bias, added in the tile's final store rather than in a second pass over C).

    Two more arguments, ``pf, nlines``: the float tiles of more than one row ask for the
    ``nlines`` cache lines from P's flat element ``pf`` on into L2, spread evenly over their k
    loop (nlines <= 0: none). A step's GEMM asks so for the next unit block's panel (gemm.panel4):
    asked for in bursts between the rows' updates instead, the prefetches waited for fill
    buffers (~10% of an LSTM H=512 N=64 step on a Sapphire Rapids-class Xeon, 2026-12-03), and
    spread over the loop they ride in its shadow.

The tile's shape comes from the CPU (``_cpu.tile_for``: its register count and width): MR rows
x NG groups of 16 columns of accumulators, e.g. 6 x 64 float32 on AVX-512 (24 zmm of 32), 6 x 16
on AVX2 (12 ymm of 16). A panel slice wider than NG groups is done NG groups at a time within
each row block, so the accumulators stay in registers (6 x 64 on AVX2 needs 48 ymm: LLVM spilled
them, and the step GEMM at H=512, N=64 ran at 12-19 GFLOP/s instead of 70-89 on a Zen 3). The
1..MR-1 leftover rows go as one shorter tile. A single row (N=1, a GEMV) takes the widest slice
whose accumulators fit, splitting its k loop S ways into independent accumulator sets when
registers are left — with too few FMA chains it would wait on FMA latency instead of streaming
weights.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import _bf16amx, _cpu, _qdot
from ._ir import prefetch_ahead, prefetch_line, row_tiles, split_loop, store_by_mode
from ._qsimd import WEIGHT_FORMATS, bf16_pair_loader, scale_base, weight_loader
from .abi import SPLIT_MIN_ROWS

_DTYPES = {types.float32: 4, types.float64: 8}


def tiles(isa: _cpu.Isa | None = None) -> dict:
    """{numba dtype: _cpu.Tile} for ``isa`` (default: the one the kernels are compiled for)."""
    isa = isa or _cpu.isa()
    return {dt: _cpu.tile_for(isa, size) for dt, size in _DTYPES.items()}


TILES = tiles()


def _codegen(nvec: int, tiles_: dict, bf16: str = "fma", a_trans: bool = False):
    def gen(context, builder, signature, args):
        P_, poff, kstride, A_, acol, i0, i1, lda, K, C_, coff, ldc, mode, bias_, boff = args[:15]
        pf, nlines = args[15:]
        dt = signature.args[3].dtype  # A's: the working dtype (P may hold reduced weights)
        wfmt = WEIGHT_FORMATS.get(signature.args[0].dtype)  # None: P in the working dtype
        tile = tiles_[dt]
        lanes = 16 // tile.vecs
        MR, S = tile.rows, tile.split

        def chunks_of(ng):
            """The slice's column chunks of ng groups, in vectors: (first vector, vectors)."""
            ng = min(ng, nvec)
            return [(g * tile.vecs, min(ng, nvec - g) * tile.vecs) for g in range(0, nvec, ng)]

        chunks, gemv_chunks = chunks_of(tile.groups), chunks_of(tile.gemv_groups)
        nvmax = max(nv for _, nv in chunks + gemv_chunks)
        pa = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=P_).data
        aa = cgutils.create_struct_proxy(signature.args[3])(context, builder, value=A_).data
        ca = cgutils.create_struct_proxy(signature.args[9])(context, builder, value=C_).data
        ba = cgutils.create_struct_proxy(signature.args[13])(context, builder, value=bias_).data
        fty = context.get_value_type(dt)
        vt = ir.VectorType(fty, lanes)
        i64, i32 = ir.IntType(64), ir.IntType(32)
        fma_name = f"llvm.fma.v{lanes}{'f32' if dt == types.float32 else 'f64'}"
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vt, [vt] * 3), fma_name
        )
        splat = ir.Constant(ir.VectorType(i32, lanes), [0] * lanes)
        esize = 4 if dt == types.float32 else 8
        zero = ir.Constant(vt, [0.0] * lanes)
        # Accumulators as entry-block allocas: mem2reg/SROA turn them into registers.
        acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(nvmax)]
               for _ in range(max(MR, S))]  # fmt: skip
        if wfmt == "bf16":  # 2 inputs per panel row: the k loop walks pairs of inputs
            load_pair, load_w = bf16_pair_loader(builder, pa, vt), None
        else:
            load_pair, load_w = None, weight_loader(builder, wfmt, pa, vt)
        # int8 panels carry their column scales (see _qsimd): one multiply per output at the
        # store, since a per-column scale factors out of the sum over k.
        sa = scale_base(builder, wfmt, pa, P_, signature.args[0], poff, context)

        def const(v):
            return ir.Constant(i64, v)

        pf_mask, pf_line = _prefetch_plan(builder, i0, i1, K, MR, len(chunks), nlines)

        def prefetch_spread(k):
            """Step k's share of the next panel (see the module docstring): a line on the k
            steps that are multiples of pf_mask + 1, until nlines are asked for."""
            line = builder.load(pf_line)
            go = builder.and_(builder.icmp_signed("==", builder.and_(k, pf_mask), const(0)),
                              builder.icmp_signed("<", line, nlines))  # fmt: skip
            with builder.if_then(go):
                prefetch_line(builder, builder.gep(pa, [pf]), builder.mul(line, const(64)))
                builder.store(builder.add(line, const(1)), pf_line)

        def load_c(ptr, v):  # a store's init in mode 1: what C holds
            return builder.load(ptr, align=4)

        def bias_at(col):  # a store's init in mode 2: the bias vector of C column ``col``
            bp = builder.gep(ba, [builder.add(boff, col)])
            return builder.load(builder.bitcast(bp, vt.as_pointer()), align=4)

        # A lone row of a bf16 panel prefetches even where the float32 one does not (split
        # GEMVs): interleaved in one process on a Xeon (Emerald Rapids), 2026-12-02, the
        # float32 GEMV gained nothing at H=128-512, the bf16 one 15% on an LSTM's H=512 panels
        # (2 MiB, the size of L2), 5% on a GRU's (1.5 MiB), 1-2% from L3 (H=1024).
        bf16_prefetch = tile.prefetch or _cpu.GEMV_PREFETCH

        def prefetch_row(first, nbytes, dist):  # the panel row slice at flat element ``first``
            prefetch_ahead(builder, builder.gep(pa, [first]), nbytes, dist)

        def prefetch_pairs(krow, v0, nv):  # a lone row's bf16 pair row slice: 4 bytes a column
            prefetch_row(builder.add(krow, const(2 * v0 * lanes)), nv * lanes * 4, bf16_prefetch)

        def splat_load(base, index):
            """base[index], a scalar, in every lane: an input the tile multiplies a row by."""
            x = builder.load(builder.gep(base, [index]))
            v = ir.Constant(ir.VectorType(x.type, lanes), ir.Undefined)
            return builder.shuffle_vector(builder.insert_element(v, x, ir.Constant(i32, 0)), v,
                                          splat)  # fmt: skip

        def a_at(arow_r, k):
            """Flat index of input k of the row whose first input is at ``arow_r``: the next
            element, or with ``a_trans`` the next row of A (A holds the tile's rows as its
            columns: a weight gradient's x^T read in place, no transposed copy)."""
            return builder.add(arow_r, builder.mul(k, lda) if a_trans else k)

        def rows_block(i, nrows, nsplit, terms=0):
            """Emit C rows i..i+nrows-1 with nsplit accumulator sets per row, one column chunk
            after another (the rows of A stay in L1 across the chunks); ``terms`` 1 or 2: A is
            a split operand of that many bf16 terms, multiplied by vdpbf16ps (dp_loop)."""
            if a_trans:  # row r's input k at (acol + k) * lda + i + r: see a_at
                arow = [builder.add(builder.mul(acol, lda), builder.add(i, const(r)))
                        for r in range(nrows)]  # fmt: skip
            else:
                arow = [builder.add(builder.mul(builder.add(i, const(r)), lda), acol)
                        for r in range(nrows)]  # fmt: skip
            for v0, nv in gemv_chunks if nrows == 1 else chunks:
                chunk(i, nrows, nsplit, arow, v0, nv, terms)

        def dp_loop(nrows, nsplit, arow, v0, nv, terms):
            """The k loop of a bf16 panel slice times a split operand (_bf16amx.split_rows:
            row r's hi terms from float arow[r], its lo terms round_up(K, 32) / 2 floats on)
            by AVX512-BF16's vdpbf16ps: one instruction multiplies a pair row of 16 columns
            (32 bf16 weights, the panel's layout) by a pair of inputs broadcast (a 32-bit word
            of the split row) and adds both products to the float32 sums — per pair row and
            term half the instructions of the float32 tile, which also widens each weight.
            The pairs past K are zero in the split row and the panel's padding is zero. As on
            AMX, a weight of +-inf gives NaN where the float32 tile gives +-inf (its lo term
            multiplies inf by 0 or by the opposite sign: non-finite either way). A lone
            row takes turns over nsplit accumulator sets, as the float32 GEMV: with one set its
            few chains of dependent vdpbf16ps ran a two-term GEMV slower than the widening
            FMAs (Zen 5)."""
            vi = ir.VectorType(i32, lanes)
            dp_t = ir.FunctionType(vt, [vt, vi, vi])
            a32 = builder.bitcast(aa, i32.as_pointer())  # a 32-bit word: two bf16 terms
            half = _bf16amx.lo_offset(builder, K)

            def dp_step(k2, s):
                krow = builder.add(poff, builder.mul(k2, kstride))
                if nrows == 1:  # a GEMV streams its panel: as pair_step's
                    prefetch_pairs(krow, v0, nv)
                ws = []
                for v in range(nv):
                    ptr = builder.gep(pa, [builder.add(krow, const(2 * (v0 + v) * lanes))])
                    ws.append(builder.load(builder.bitcast(ptr, vi.as_pointer()), align=4))
                for r in range(nrows):
                    xs = [splat_load(a32, builder.add(arow[r], k2))]
                    if terms == 2:
                        xs.append(splat_load(a32, builder.add(builder.add(arow[r], half), k2)))
                    for v in range(nv):
                        slot = acc[r * nsplit + s][v]
                        a = builder.load(slot)
                        for x in xs:
                            a = builder.asm(dp_t, "vdpbf16ps $3, $2, $0", "=v,0,v,v",
                                            [a, x, ws[v]], side_effect=False)  # fmt: skip
                        builder.store(a, slot)

            split_loop(builder, builder.sdiv(builder.add(K, const(1)), const(2)), nsplit, dp_step)

        def chunk(i, nrows, nsplit, arow, v0, nv, terms=0):
            for a in acc[: nrows * nsplit]:
                for v in range(nv):
                    builder.store(zero, a[v])

            def pair_step(k2, s, both=True):
                """Inputs 2*k2 and 2*k2 + 1 (``both``; else only the first: an odd K's last)
                into accumulator set s."""
                krow = builder.add(poff, builder.mul(k2, kstride))
                if nrows == 1:
                    prefetch_pairs(krow, v0, nv)
                ws = [load_pair(krow, (v0 + v) * lanes) for v in range(nv)]
                k = builder.mul(k2, const(2))
                for r in range(nrows):
                    xs = []
                    for h in range(2 if both else 1):
                        xs.append(splat_load(aa, builder.add(arow[r], builder.add(k, const(h)))))
                    for v in range(nv):
                        slot = acc[r * nsplit + s][v]
                        a = builder.load(slot)
                        for h, xv in enumerate(xs):
                            a = builder.call(fma, [xv, ws[v][h], a])
                        builder.store(a, slot)

            def step(k, s):
                krow = builder.add(poff, builder.mul(k, kstride))
                if nrows > 1 and wfmt is None:
                    prefetch_spread(k)
                if nrows == 1 and tile.prefetch and wfmt is None:
                    prefetch_row(builder.add(krow, const(v0 * lanes)), nv * lanes * esize,
                                 tile.prefetch)  # fmt: skip
                ws = [load_w(krow, (v0 + v) * lanes) for v in range(nv)]
                for r in range(nrows):
                    xv = splat_load(aa, a_at(arow[r], k))
                    for v in range(nv):
                        slot = acc[r * nsplit + s][v]
                        builder.store(builder.call(fma, [xv, ws[v], builder.load(slot)]), slot)

            if terms:
                dp_loop(nrows, nsplit, arow, v0, nv, terms)
            elif load_pair is None:
                split_loop(builder, K, nsplit, step)
            else:
                k2s = builder.sdiv(K, const(2))
                split_loop(builder, k2s, nsplit, pair_step)
                with builder.if_then(builder.icmp_signed("<", builder.mul(k2s, const(2)), K)):
                    pair_step(k2s, 0, both=False)

            def store_rows(init_of):
                for r in range(nrows):
                    base = builder.add(coff, builder.mul(builder.add(i, const(r)), ldc))
                    tots = []
                    for v in range(nv):
                        tot = builder.load(acc[r * nsplit][v])
                        for s in range(1, nsplit):
                            tot = builder.fadd(tot, builder.load(acc[r * nsplit + s][v]))
                        tots.append(tot)
                    for v in range(nv):
                        tot = tots[v]
                        if sa is not None:
                            sp = builder.gep(sa, [const((v0 + v) * lanes)])
                            sv = builder.load(builder.bitcast(sp, vt.as_pointer()), align=4)
                            tot = builder.fmul(tot, sv)
                        ptr = builder.bitcast(
                            builder.gep(ca, [builder.add(base, const((v0 + v) * lanes))]),
                            vt.as_pointer(),
                        )
                        builder.store(builder.fadd(tot, init_of(ptr, v)), ptr, align=4)

            store_by_mode(builder, mode, store_rows, load_c,
                          lambda ptr, v: bias_at(const((v0 + v) * lanes)),
                          lambda ptr, v: zero)  # fmt: skip

        def amx_store(i, rows, sum_at, g0, ng, more):
            """C rows i..i+rows-1, groups g0..g0+ng-1, from the AMX block's float32 sums (int8
            codes' sums times their column scales), by the tile's mode, or adding to C where
            ``more`` (a later chunk of K)."""

            def store_rows(init_of):
                with cgutils.for_range(builder, rows) as loop:
                    r = loop.index
                    base = builder.add(coff, builder.mul(builder.add(i, r), ldc))
                    for v in range(g0, g0 + ng):
                        tot = builder.load(sum_at(r, v), align=64)
                        if sa is not None:
                            sp = builder.gep(sa, [const(16 * v)])
                            tot = builder.fmul(tot, builder.load(
                                builder.bitcast(sp, vt.as_pointer()), align=4))  # fmt: skip
                        ptr = builder.bitcast(builder.gep(ca, [builder.add(base, const(16 * v))]),
                                              vt.as_pointer())  # fmt: skip
                        builder.store(builder.fadd(tot, init_of(ptr, v)), ptr, align=4)

            m = mode if more is None else builder.select(more, ir.Constant(mode.type, 1), mode)
            store_by_mode(builder, m, store_rows, load_c, lambda ptr, v: bias_at(const(16 * v)),
                          lambda ptr, v: zero)  # fmt: skip

        def fma_rows():  # a 1-row tile: every row is a GEMV, split S ways
            row_tiles(builder, i0, i1, MR, lambda i, r: rows_block(i, r, S if r == 1 else 1))

        if bf16 == "amx" and wfmt in ("bf16", "int8") and lanes == 16:
            # An operand gemm.operand split (from SPLIT_MIN_ROWS rows) runs on AMX (_bf16amx);
            # its row stride, split_row_floats(K, one_term), tells it apart and says whether it
            # holds lo terms: the engine's plain operands are at most 15 floats wider than K
            # (abi). Its K is whole (gemm._kc), acol 0. int8 panels' codes are widened to
            # bfloat16 there (exact); their operands are split in two terms.
            two = builder.icmp_signed("==", lda, _bf16amx.split_ld(builder, K))
            terms = two
            if wfmt == "bf16":
                one = builder.icmp_signed("==", lda, _bf16amx.split_ld(builder, K, True))
                terms = builder.or_(two, one)
            split = builder.and_(
                builder.icmp_signed(">=", builder.sub(i1, i0), const(SPLIT_MIN_ROWS)), terms
            )
            with builder.if_else(split) as (then, otherwise):
                with then:
                    _bf16amx.emit_rows(builder, nvec, pa, poff, kstride, aa, lda, K, i0, i1,
                                       two, amx_store, int8=wfmt == "int8")  # fmt: skip
                with otherwise:
                    fma_rows()
        elif bf16 == "dpbf16" and wfmt == "bf16" and lanes == 16:
            # An operand gemm.operand split (every row count here: abi.split_min_rows), known
            # by its row stride as on AMX, runs on vdpbf16ps (dp_loop); others on the float32
            # tile.
            two = builder.icmp_signed("==", lda, _bf16amx.split_ld(builder, K))
            one = builder.icmp_signed("==", lda, _bf16amx.split_ld(builder, K, True))
            with builder.if_else(builder.or_(two, one)) as (then, otherwise):
                with then:
                    with builder.if_else(two) as (two_terms, one_term):
                        for body, terms in ((two_terms, 2), (one_term, 1)):
                            with body:
                                row_tiles(builder, i0, i1, MR, lambda i, r, t=terms:
                                          rows_block(i, r, S if r == 1 else 1, t))  # fmt: skip
                with otherwise:
                    fma_rows()
        else:
            fma_rows()
        return context.get_dummy_value()

    return gen


def _prefetch_plan(builder, i0, i1, K, rows: int, nchunks: int, nlines):
    """(mask, line) for the tile's spread prefetch: its multi-row k steps (row tiles x column
    chunks x K) ask for a line on each k that is a multiple of mask + 1, the largest power of
    two that spreads nlines over them (with fewer steps than lines, a line a step: the first
    of them); line: an alloca, the next line to ask for. (A count-down across the row tiles
    instead of the k test, or several lines a step in a loop inside the k loop, ran the H=512
    N=64 LSTM step 2% slower.)"""
    i64 = ir.IntType(64)

    def const(v):
        return ir.Constant(i64, v)

    def at_least(a, b):
        return builder.select(builder.icmp_signed("<", a, b), b, a)

    tiles = builder.sdiv(builder.add(builder.sub(i1, i0), const(rows - 1)), const(rows))
    steps = builder.mul(builder.mul(tiles, const(nchunks)), K)
    every = at_least(builder.sdiv(steps, at_least(nlines, const(1))), const(1))
    ctlz = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(i64, [i64, ir.IntType(1)]), "llvm.ctlz.i64"
    )
    top = builder.sub(const(63), builder.call(ctlz, [every, ir.Constant(ir.IntType(1), 1)]))
    mask = builder.sub(builder.shl(const(1), top), const(1))
    return mask, cgutils.alloca_once_value(builder, const(0))


def make(nvec: int, tiles_: dict | None = None, isa: _cpu.Isa | None = None,
         dot: str | None = None, bf16: str | None = None, a_trans: bool = False):  # fmt: skip
    """The tile intrinsic for panel slices of ``nvec`` groups of 16 columns, on ``tiles_``
    (default TILES) and, for int8-dynamic panels, ``isa``'s integer tile with the dot product
    ``dot`` (default the compiled one, _cpu.int8_dot); bf16 and weight-only int8 panels' rows
    on ``bf16`` ("amx": _bf16amx in whole tiles of 16, "dpbf16": vdpbf16ps, or "fma";
    default _cpu.bf16_dot's).
    The tests pass others to run every ISA's tile on any machine. ``a_trans``: A is read
    transposed in place (module docstring; panels and A of the working dtype only)."""
    tiles_ = tiles_ or TILES
    if bf16 == "amx" and _cpu.bf16_dot(_cpu.ISAS["avx512"]) != "amx":  # else SIGILL
        raise ValueError("bf16's AMX block asked for where this process cannot run AMX-BF16")
    if bf16 == "dpbf16" and not _cpu.has_avx512_bf16():
        raise ValueError("bf16's vdpbf16ps tile asked for on a CPU without AVX512-BF16")

    def typer(typingctx, P, poff, kstride, A, acol, i0, i1, lda, K, C, coff, ldc, mode, bias, boff,
              pf, nlines):  # fmt: skip
        if not isinstance(P, types.Array) or not isinstance(A, types.Array):
            return None
        i = types.intp
        if P.dtype == types.uint8 or A.dtype == types.uint8:  # int8-dynamic: both or neither
            if P.dtype != A.dtype or C.dtype != types.float32:
                return None
            gen = _qdot.codegen(nvec, isa or _cpu.isa(), dot)
            return types.void(P, i, i, A, i, i, i, i, i, C, i, i, i, bias, i, i, i), gen
        if P.dtype not in _DTYPES and not (P.dtype in WEIGHT_FORMATS and A.dtype == types.float32):
            return None
        if a_trans and P.dtype != A.dtype:
            return None
        gen = _codegen(nvec, tiles_, bf16 or _cpu.bf16_dot(isa or _cpu.isa()), a_trans)
        return types.void(P, i, i, A, i, i, i, i, i, C, i, i, i, bias, i, i, i), gen

    typer.__name__ = f"panel_gemm{'_t' if a_trans else ''}{nvec}"
    return intrinsic(typer)


panel_gemm1, panel_gemm2, panel_gemm3, panel_gemm4 = (make(n) for n in (1, 2, 3, 4))
panel_gemm_t1, panel_gemm_t2, panel_gemm_t3, panel_gemm_t4 = (
    make(n, a_trans=True) for n in (1, 2, 3, 4)
)
