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

    init by ``mode``: 0 → 0;  1 → C's old value (the caller blocks K, so later K slices add
    to the first);  2 → bias[boff + j], the same for every row (the input projection's folded
    bias, added in the tile's final store rather than in a second pass over C).

Rows go MR at a time (6 for float32, 3 for float64: MR*nvec accumulators stay within the 32
vector registers); the 1..MR-1 leftover rows go as one shorter tile, and a single row (N=1, a
GEMV) splits its k loop S ways into independent accumulator sets — with one set it would wait
on FMA latency instead of streaming weights.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

TILE_ROWS = {types.float32: 6, types.float64: 3}
_LANES = {types.float32: 16, types.float64: 8}
_SPLIT = {types.float32: 4, types.float64: 2}


def _codegen(nvec: int):
    def gen(context, builder, signature, args):
        P_, poff, kstride, A_, acol, i0, i1, lda, K, C_, coff, ldc, mode, bias_, boff = args
        dt = signature.args[0].dtype
        lanes = _LANES[dt]
        nv = nvec * (16 // lanes)  # vectors per row of output
        MR, S = TILE_ROWS[dt], _SPLIT[dt]
        pa = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=P_).data
        aa = cgutils.create_struct_proxy(signature.args[3])(context, builder, value=A_).data
        ca = cgutils.create_struct_proxy(signature.args[9])(context, builder, value=C_).data
        ba = cgutils.create_struct_proxy(signature.args[13])(context, builder, value=bias_).data
        add_old = builder.icmp_signed("==", mode, ir.Constant(mode.type, 1))
        add_bias = builder.icmp_signed("==", mode, ir.Constant(mode.type, 2))
        fty = context.get_value_type(dt)
        vt = ir.VectorType(fty, lanes)
        i64, i32 = ir.IntType(64), ir.IntType(32)
        fma_name = f"llvm.fma.v{lanes}{'f32' if dt == types.float32 else 'f64'}"
        fma = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(vt, [vt] * 3), fma_name
        )
        splat = ir.Constant(ir.VectorType(i32, lanes), [0] * lanes)
        undef = ir.Constant(vt, ir.Undefined)
        zero = ir.Constant(vt, [0.0] * lanes)
        # Accumulators as entry-block allocas: mem2reg/SROA turn them into registers.
        acc = [[cgutils.alloca_once_value(builder, zero) for _ in range(nv)] for _ in range(MR * S)]

        def const(v):
            return ir.Constant(i64, v)

        def rows_block(i, nrows, nsplit):
            """Emit C rows i..i+nrows-1 with nsplit accumulator sets per row."""
            for a in acc[: nrows * nsplit]:
                for v in range(nv):
                    builder.store(zero, a[v])
            arow = [builder.add(builder.mul(builder.add(i, const(r)), lda), acol)
                    for r in range(nrows)]  # fmt: skip

            def step(k, s):
                krow = builder.add(poff, builder.mul(k, kstride))
                ws = []
                for v in range(nv):
                    ptr = builder.gep(pa, [builder.add(krow, const(v * lanes))])
                    ws.append(builder.load(builder.bitcast(ptr, vt.as_pointer()), align=4))
                for r in range(nrows):
                    x = builder.load(builder.gep(aa, [builder.add(arow[r], k)]))
                    xv = builder.insert_element(undef, x, ir.Constant(i32, 0))
                    xv = builder.shuffle_vector(xv, undef, splat)
                    for v in range(nv):
                        slot = acc[r * nsplit + s][v]
                        builder.store(builder.call(fma, [xv, ws[v], builder.load(slot)]), slot)

            sc = const(nsplit)
            kmain = builder.mul(builder.sdiv(K, sc), sc)
            with cgutils.for_range_slice(builder, const(0), kmain, sc) as (k, _):
                for s in range(nsplit):
                    step(builder.add(k, const(s)), s)
            with cgutils.for_range_slice(builder, kmain, K, const(1)) as (k, _):
                step(k, 0)

            def store_rows(with_old):
                for r in range(nrows):
                    base = builder.add(coff, builder.mul(builder.add(i, const(r)), ldc))
                    for v in range(nv):
                        tot = builder.load(acc[r * nsplit][v])
                        for s in range(1, nsplit):
                            tot = builder.fadd(tot, builder.load(acc[r * nsplit + s][v]))
                        ptr = builder.bitcast(
                            builder.gep(ca, [builder.add(base, const(v * lanes))]),
                            vt.as_pointer(),
                        )
                        init = builder.load(ptr, align=4) if with_old else builder.load(bvec[v])
                        builder.store(builder.fadd(tot, init), ptr, align=4)

            # Two store paths, so modes 0 and 2 never read C: a load of a line not yet in
            # cache (a fresh xw row) would stall the tile for nothing.
            with builder.if_else(add_old) as (then, otherwise):
                with then:
                    store_rows(True)
                with otherwise:
                    store_rows(False)

        # mode 2's bias vectors, loaded once per call (zero otherwise: boff may not be valid then)
        bvec = [cgutils.alloca_once_value(builder, zero) for _ in range(nv)]
        with builder.if_then(add_bias):
            for v in range(nv):
                ptr = builder.gep(ba, [builder.add(boff, const(v * lanes))])
                builder.store(builder.load(builder.bitcast(ptr, vt.as_pointer()), align=4), bvec[v])
        n = builder.sub(i1, i0)
        full_end = builder.add(i0, builder.mul(builder.sdiv(n, const(MR)), const(MR)))
        with cgutils.for_range_slice(builder, i0, full_end, const(MR)) as (i, _):
            rows_block(i, MR, 1)
        # The 1..MR-1 leftover rows as one shorter tile (its own straight-line body per count):
        # at N=64, 4 rows one at a time ran at half the speed of a 4-row tile.
        rem = builder.sub(i1, full_end)
        for r in range(1, MR):
            with builder.if_then(builder.icmp_signed("==", rem, const(r))):
                rows_block(full_end, r, S if r == 1 else 1)
        return context.get_dummy_value()

    return gen


def _make(nvec: int):
    def typer(typingctx, P, poff, kstride, A, acol, i0, i1, lda, K, C, coff, ldc, mode, bias, boff):
        if not isinstance(P, types.Array) or P.dtype not in _LANES:
            return None
        i = types.intp
        return types.void(P, i, i, A, i, i, i, i, i, C, i, i, i, bias, i), _codegen(nvec)

    typer.__name__ = f"panel_gemm{nvec}"
    return intrinsic(typer)


panel_gemm1, panel_gemm2, panel_gemm3, panel_gemm4 = (_make(n) for n in (1, 2, 3, 4))
