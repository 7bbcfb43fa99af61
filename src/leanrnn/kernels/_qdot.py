"""The integer register tile of the ``int8-dynamic`` precision: u8 activations x s8 weights,
summed exactly in int32, scaled to float32 once at the store.

Where ``_simd``'s tiles widen each weight to float32 and do one FMA per weight (8 per
instruction on AVX2), this one multiplies 32 byte pairs per instruction. Where the CPU has
AVX-512 VNNI (Ice Lake / Sapphire Rapids and later Xeons, Zen 4 and later), ``vpdpbusd``
multiplies u8 codes by s8 weights and sums each 4 into an int32 lane in one instruction on
64-byte vectors (64 multiply-adds, a 16-column group per register), and AMX's ``tdpbusd``
does the same for 16 x 16 x 64 tiles; _cpu.int8_dot picks the path. AVX2 has only
``vpmaddubsw`` (u8 x s8, adjacent pairs summed to int16 *with saturation*) then ``vpmaddwd``
by ones (pairs of int16 to int32): u8 codes up to 255 against 8-bit weights would saturate, so
there each code becomes d = code - 128 in [-127, 127] and ``vpmaddubsw(|d|, sign(w, d))``
multiplies |d| by w with d's sign — pair sums <= 2 * 127 * 127 fit int16, the sum is exact, and
no offset is to be taken out. Four instructions per 32 multiply-adds, against four FMAs and
four widenings. Panels of 7-bit codes (``reduce_range``, abi.DOT_NARROW set in their
corrections) take AVX2's direct path instead: ``vpmaddubsw(code, w)``, pair sums <= 2 * 255 * 63,
then the offset taken out as VNNI does — three instructions, and no |d| and sign per row (on
a Zen 3, 2026-12-03, the tile of 7-bit codes before 8-bit ones came ran the 100-row projection
at 77-96 GMAC/s against the sign trick's 40-50, the GEMV at 64-95 GB/s against 52-64). The
tile branches on the flag once per call.

Operands (formats.quantize has the packing side):

- **weights** P, uint8 [U, X/4 + DOT_TAIL_ROWS, 4*Wd] (uint8 is only the tag that selects this
  tile: the bytes are int8 codes, and LLVM's integers are signless): row k4 of panel u holds,
  for each column j, its 4 weights of inputs 4*k4..4*k4+3. Codes are in [-127, 127]. Row X/4
  holds the Wd float32 column scales, row X/4 + 1 the Wd int32 corrections 128 * sum_k q_kj
  (the activations' offset, below; the AVX2 path on 8-bit codes, summing d * w, does not need
  them), bit 0 of each the panel's DOT_NARROW flag (masked off before use).
- **activations** A, uint8 [rows, lda]: row i holds round(a_ik / s_i) + 128 for its inputs
  (kernels.gemm.quantize_rows; symmetric per row, s_i = max_k |a_ik| / 127, codes 1..255) and
  its float32 scale s_i in its last 4 bytes.

    C[i, j] = init + float(sum_k A[i, k] * q_kj - corr_j) * (s_i * s_j)
            = init + float(sum_k (A[i, k] - 128) * q_kj) * (s_i * s_j)

No k loop is split (the caller never slices K: an int8 panel of 1024 inputs is 64 KiB, it
stays in L2 whole), so the correction covers exactly the inputs summed.

On CPUs without AVX2 the same IR is written with plain integer ops (widen, multiply, add
groups of 4): exact as well, the same numbers, slower; ``LEANRNN_ISA=sse`` selects it anywhere.
"""

from __future__ import annotations

from llvmlite import ir
from numba.core import cgutils

from . import _cpu
from ._ir import amx_ops, prefetch_ahead, row_tiles, split_loop, store_by_mode
from .abi import DOT_NARROW, DOT_TAIL_ROWS

TR = 16  # rows of an AMX tile: of A and C, and the k4 steps of a B tile


def tile(isa: _cpu.Isa, dot: str | None = None):
    """The register tile (rows x groups of 16 columns) for ``isa`` and its dot product ``dot``
    (default _cpu.int8_dot's): the float32 rule of _cpu.tile_for — on 64-byte vectors with
    VNNI (one int32 accumulator per 16-column group, as float32 on AVX-512), else on 32-byte
    vectors (the intrinsics below are AVX2's, which AVX-512 machines without VNNI run too)
    with two registers kept back, chosen for the ones of vpmaddwd and a product (since the
    8-bit codes each row also holds |d| beside d, see the module docstring). With AMX, the rows
    AMX tiles leave over (fewer than 16) run on the VNNI tile."""
    if (dot or _cpu.int8_dot(isa)) in ("vnni", "amx"):
        return _cpu.tile_for(isa, 4)
    return _cpu.tile_for(_cpu.Isa(isa.name, isa.regs - 2, 32), 4)


def codegen(nvec: int, isa: _cpu.Isa, dot: str | None = None):
    """The tile's IR generator for panel slices of ``nvec`` groups on ``isa`` with the dot
    product ``dot`` (default _cpu.int8_dot's; the tests pass each one this CPU runs)."""
    dot = dot or _cpu.int8_dot(isa)
    t = tile(isa, dot)
    amx = dot == "amx"
    if amx and not _cpu.amx_usable():  # SIGILL at the first tile instruction otherwise
        raise ValueError("int8-dynamic's AMX tile asked for where this process cannot run AMX")
    if amx:
        dot = "vnni"  # AMX's leftover rows, K tail and lone rows
    lanes = 16 if dot == "vnni" else 8  # int32 accumulators (= output columns) per vector
    vbytes = 4 * lanes
    vecs_per_group = 16 // lanes
    # A lone row (GEMV) with VNNI has one vpdpbusd per vector and k step, so its accumulator
    # chains are latency-bound (~5 cycles each): split its k loop over GEMV_SETS sets of
    # accumulators, summed at the store, for enough products in flight.
    gemv_sets = 2 if dot == "vnni" else 1
    # ... and its weights stream from L2 (an H=512 LSTM's recurrent panels are 1 MiB) faster
    # when each panel row's lines are asked for _cpu.GEMV_PREFETCH bytes ahead: the VNNI GEMV
    # at H=512 ran 10-13% faster (2048 or 4096 ahead alike; H=256 ~9%, H=1024 from L3 level),
    # interleaved in one process on a Xeon (Emerald Rapids), 2026-12-02.
    gemv_prefetch = _cpu.GEMV_PREFETCH if dot == "vnni" else 0

    def gen(context, builder, signature, args):
        # the last two, a spread prefetch (see _simd), are the float tiles' only
        P_, poff, kstride, A_, acol, i0, i1, lda, K, C_, coff, ldc, mode, bias_, boff = args[:15]
        MR = t.rows

        def chunks_of(ng):
            ng = min(ng, nvec)
            return [(g * vecs_per_group, min(ng, nvec - g) * vecs_per_group)
                    for g in range(0, nvec, ng)]  # fmt: skip

        chunks, gemv_chunks = chunks_of(t.groups), chunks_of(t.gemv_groups)
        nvmax = max(nv for _, nv in chunks + gemv_chunks)
        parr = cgutils.create_struct_proxy(signature.args[0])(context, builder, value=P_)
        pa = parr.data
        aa = cgutils.create_struct_proxy(signature.args[3])(context, builder, value=A_).data
        ca = cgutils.create_struct_proxy(signature.args[9])(context, builder, value=C_).data
        ba = cgutils.create_struct_proxy(signature.args[13])(context, builder, value=bias_).data
        _, s1, s2 = cgutils.unpack_tuple(builder, parr.shape, 3)
        i8, i16, i32, i64 = (ir.IntType(n) for n in (8, 16, 32, 64))
        f32 = ir.FloatType()
        vqi8 = ir.VectorType(i8, vbytes)
        vqi32 = ir.VectorType(i32, lanes)
        vqf = ir.VectorType(f32, lanes)
        zero_i = ir.Constant(vqi32, [0] * lanes)
        zero_f = ir.Constant(vqf, [0.0] * lanes)
        splat = ir.Constant(vqi32, [0] * lanes)
        # The store's sum * scale + init as one explicit FMA: numba's fast-math pass marks
        # every float op "contract", and LLVM then fused the multiply and the add in some
        # tiles and not others, so the same int32 sums gave outputs 1 ulp apart by path.
        fma = cgutils.get_or_insert_function(builder.module, ir.FunctionType(vqf, [vqf] * 3),
                                             f"llvm.fma.v{lanes}f32")  # fmt: skip

        def const(v):
            return ir.Constant(i64, v)

        if dot == "vnni":
            dpbusd = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vqi32, [vqi32, vqi8, vqi8]),
                "llvm.x86.avx512.vpdpbusd.512",
            )  # fmt: skip

            def dot_add(acc, a, w):
                return builder.call(dpbusd, [acc, a, w])

            prep = None
        elif dot == "avx2":
            v16i16 = ir.VectorType(i16, 16)
            maddubs = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(v16i16, [vqi8, vqi8]), "llvm.x86.avx2.pmadd.ub.sw"
            )
            maddwd = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vqi32, [v16i16, v16i16]), "llvm.x86.avx2.pmadd.wd"
            )
            sign = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vqi8, [vqi8, vqi8]), "llvm.x86.avx2.psign.b"
            )
            absb = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(vqi8, [vqi8, ir.IntType(1)]), "llvm.abs.v32i8"
            )
            ones = ir.Constant(v16i16, [1] * 16)
            flip = ir.Constant(vqi8, [-128] * vbytes)  # code ^ 0x80 = code - 128 as a signed byte

            def prep(a):
                """A row's broadcast codes -> (|d|, d), d = code - 128 in [-127, 127]; as they
                are for a narrow panel (the direct loop)."""
                if direct[0]:
                    return a
                d = builder.xor(a, flip)
                return builder.call(absb, [d, ir.Constant(ir.IntType(1), 0)]), d

            def dot_add(acc, a, w):
                if direct[0]:  # code * w, each <= 255 * 63: a pair sum fits int16
                    prod = builder.call(maddubs, [a, w])
                else:  # |d| * (w with d's sign) = d * w, each <= 127 * 127: likewise
                    mag, d = a
                    prod = builder.call(maddubs, [mag, builder.call(sign, [w, d])])
                return builder.add(acc, builder.call(maddwd, [prod, ones]))
        else:
            vwide = ir.VectorType(i32, vbytes)

            def dot_add(acc, a, w):
                prod = builder.mul(builder.zext(a, vwide), builder.sext(w, vwide))
                for m in range(4):
                    lane = builder.shuffle_vector(
                        prod, prod, ir.Constant(vqi32, [4 * j + m for j in range(lanes)])
                    )
                    acc = builder.add(acc, lane)
                return acc

            prep = None

        # The panel slice's column scales and corrections (its tail rows, see the docstring):
        # panel u = poff // (S1*S2), the slice's first column byte poff % S2 (4 per column).
        u = builder.sdiv(poff, builder.mul(s1, s2))
        colbyte = builder.srem(poff, s2)
        tail = builder.mul(
            builder.add(builder.mul(u, s1), builder.sub(s1, const(DOT_TAIL_ROWS))), s2
        )
        scale_p = builder.bitcast(builder.gep(pa, [builder.add(tail, colbyte)]), f32.as_pointer())
        corr_p = builder.bitcast(
            builder.gep(pa, [builder.add(builder.add(tail, s2), colbyte)]), i32.as_pointer()
        )
        # direct[0]: the loop being generated multiplies the codes as they are, so its sums
        # include their offset, taken out at the store. Every path but AVX2's sign trick, which
        # a narrow panel's flag (bit 0 of its corrections, abi.DOT_NARROW) makes unneeded: the
        # AVX2 tile generates both loops and branches on the flag.
        direct = [dot != "avx2"]
        if dot == "avx2":
            flag = builder.and_(builder.load(corr_p, align=1), ir.Constant(i32, DOT_NARROW))
            is_narrow = builder.icmp_unsigned("!=", flag, ir.Constant(i32, 0))
        corr_mask = ir.Constant(vqi32, [~DOT_NARROW] * lanes)
        k4s = builder.sdiv(builder.add(K, const(3)), const(4))
        nsets = max(MR, gemv_sets)
        acc = [[cgutils.alloca_once_value(builder, zero_i) for _ in range(nvmax)]
               for _ in range(nsets)]  # fmt: skip

        def rows_block(i, nrows):
            arow = [builder.add(builder.mul(builder.add(i, const(r)), lda), acol)
                    for r in range(nrows)]  # fmt: skip
            for v0, nv in gemv_chunks if nrows == 1 else chunks:
                if dot != "avx2":
                    chunk(i, nrows, arow, v0, nv)
                    continue
                with builder.if_else(is_narrow) as (as_is, signed):
                    for direct[0], block in ((True, as_is), (False, signed)):
                        with block:
                            chunk(i, nrows, arow, v0, nv)

        def k_step(k4, nrows, arow, v0, nv, sets):
            """One k4 step (4 inputs) of every row into accumulator set ``sets`` (a lone row's
            set) or rows 0..nrows-1 (a row tile)."""
            wrow = builder.add(builder.add(poff, builder.mul(k4, kstride)), const(v0 * vbytes))
            if nrows == 1 and gemv_prefetch:
                prefetch_ahead(builder, builder.gep(pa, [wrow]), nv * vbytes, gemv_prefetch)
            ws = []
            for v in range(nv):
                p = builder.gep(pa, [builder.add(wrow, const(v * vbytes))])
                ws.append(builder.load(builder.bitcast(p, vqi8.as_pointer()), align=1))
            for r in range(nrows):
                p = builder.gep(aa, [builder.add(arow[r], builder.mul(k4, const(4)))])
                quad = builder.load(builder.bitcast(p, i32.as_pointer()), align=1)
                av = builder.insert_element(ir.Constant(vqi32, ir.Undefined), quad,
                                            ir.Constant(i32, 0))  # fmt: skip
                av = builder.bitcast(builder.shuffle_vector(av, av, splat), vqi8)
                if prep is not None:
                    av = prep(av)
                for v in range(nv):
                    slot = acc[sets if nrows == 1 else r][v]
                    builder.store(dot_add(builder.load(slot), av, ws[v]), slot)

        def chunk(i, nrows, arow, v0, nv):
            used = gemv_sets if nrows == 1 else nrows
            for a in acc[:used]:
                for v in range(nv):
                    builder.store(zero_i, a[v])
            if nrows == 1 and gemv_sets > 1:
                split_loop(builder, k4s, gemv_sets, lambda k4, st: k_step(k4, 1, arow, v0, nv, st))
            else:
                with cgutils.for_range_slice(builder, const(0), k4s, const(1)) as (k4, _):
                    k_step(k4, nrows, arow, v0, nv, 0)

            def store_rows(init_of):
                for r in range(nrows):

                    def total(v, r=r):
                        sets = range(gemv_sets) if nrows == 1 else (r,)
                        tot = None
                        for st in sets:
                            part = builder.load(acc[st][v])
                            tot = part if tot is None else builder.add(tot, part)
                        return tot

                    store_row(builder.add(i, const(r)), v0, nv, total, init_of)

            store_by_mode(builder, mode, store_rows, old, bias, zero)

        def store_row(row, v0, nv, total, init_of):
            """C's row ``row``, vectors v0..v0+nv-1, from their int32 sums ``total(v)``."""
            sp = builder.gep(aa, [builder.sub(builder.mul(builder.add(row, const(1)), lda),
                                              const(4))])  # fmt: skip
            s_row = builder.load(builder.bitcast(sp, f32.as_pointer()), align=1)
            s_rowv = builder.shuffle_vector(
                builder.insert_element(ir.Constant(vqf, ir.Undefined), s_row,
                                       ir.Constant(i32, 0)), ir.Constant(vqf, ir.Undefined),
                splat,
            )  # fmt: skip
            base = builder.add(coff, builder.mul(row, ldc))
            for v in range(nv):
                col = (v0 + v) * lanes
                s_col = builder.load(builder.bitcast(builder.gep(scale_p, [const(col)]),
                                                     vqf.as_pointer()), align=1)  # fmt: skip
                tot = total(v)
                if direct[0]:  # the sums include the codes' offset 128: take it back out
                    corr = builder.load(builder.bitcast(builder.gep(corr_p, [const(col)]),
                                                        vqi32.as_pointer()), align=1)  # fmt: skip
                    tot = builder.sub(tot, builder.and_(corr, corr_mask))
                tot = builder.sitofp(tot, vqf)
                ptr = builder.bitcast(builder.gep(ca, [builder.add(base, const(col))]),
                                      vqf.as_pointer())  # fmt: skip
                out = builder.call(fma, [tot, builder.fmul(s_rowv, s_col), init_of(ptr, col)])
                builder.store(out, ptr, align=4)

        def old(ptr, col):
            return builder.load(ptr, align=4)

        def bias(ptr, col):
            bp = builder.gep(ba, [builder.add(boff, const(col))])
            return builder.load(builder.bitcast(bp, vqf.as_pointer()), align=4)

        def zero(ptr, col):
            return zero_f

        if amx:
            i8p = i8.as_pointer()
            tile_op, tmm = amx_ops(builder)

            with builder.goto_entry_block():  # not cgutils.alloca_once: it zero-fills them
                cfg = builder.alloca(ir.ArrayType(i8, 64))
                sums = builder.alloca(ir.ArrayType(i32, 2 * TR * 2 * TR))
            cfg.align = sums.align = 64
            k4_main = builder.mul(builder.sdiv(k4s, const(TR)), const(TR))
            sum_ld = 2 * TR  # int32 per row of ``sums``: two tiles of C side by side

            def sums_at(r, v):
                """&sums[r, v*16]: row r (an i64 value) of the block's int32 sums, vector v."""
                off = builder.add(builder.mul(r, const(sum_ld)), const(v * lanes))
                return builder.bitcast(builder.gep(builder.bitcast(sums, i32.as_pointer()),
                                                   [off]), vqi32.as_pointer())  # fmt: skip

            def amx_block(i, mr, c0, nc):
                """Rows i..i+16*mr-1 x groups c0..c0+nc-1: C tile 2r+c += A tile 4+r x B tile
                6+c over the k4 steps in whole tiles of 16, stored into ``sums``, which the
                k4 steps past them then finish on VNNI; then the store, from ``sums``."""
                for r in range(mr):
                    for c in range(nc):
                        tile_op("llvm.x86.tilezero", tmm(2 * r + c))
                with cgutils.for_range_slice(builder, const(0), k4_main, const(TR)) as (k4, _):
                    for r in range(mr):
                        row = builder.add(i, const(TR * r))
                        off = builder.add(builder.add(builder.mul(row, lda), acol),
                                          builder.mul(k4, const(4)))  # fmt: skip
                        tile_op("llvm.x86.tileloadd64", tmm(4 + r),
                                builder.bitcast(builder.gep(aa, [off]), i8p), lda)  # fmt: skip
                    for c in range(nc):
                        off = builder.add(builder.add(poff, builder.mul(k4, kstride)),
                                          const((c0 + c) * vbytes))  # fmt: skip
                        tile_op("llvm.x86.tileloadd64", tmm(6 + c),
                                builder.bitcast(builder.gep(pa, [off]), i8p), kstride)  # fmt: skip
                    for r in range(mr):
                        for c in range(nc):
                            tile_op("llvm.x86.tdpbusd", tmm(2 * r + c), tmm(4 + r), tmm(6 + c))
                for r in range(mr):
                    for c in range(nc):
                        tile_op("llvm.x86.tilestored64", tmm(2 * r + c),
                                builder.bitcast(sums_at(const(TR * r), c), i8p),
                                const(4 * sum_ld))  # fmt: skip
                with builder.if_then(builder.icmp_signed("<", k4_main, k4s)):
                    # The K tail (fewer than 16 k4 steps): A tile rows would need another
                    # tile configuration, which would clear the C tiles.
                    with cgutils.for_range(builder, const(TR * mr)) as loop:
                        r = loop.index
                        for v in range(nc):
                            builder.store(builder.load(sums_at(r, v), align=64), acc[0][v])
                        arow = [builder.add(builder.mul(builder.add(i, r), lda), acol)]
                        with cgutils.for_range_slice(builder, k4_main, k4s, const(1)) as (k4, _):
                            k_step(k4, 1, arow, c0, nc, 0)
                        for v in range(nc):
                            builder.store(builder.load(acc[0][v]), sums_at(r, v), align=64)

                def store_rows(init_of):
                    with cgutils.for_range(builder, const(TR * mr)) as loop:
                        r = loop.index
                        store_row(builder.add(i, r), c0, nc,
                                  lambda v: builder.load(sums_at(r, v), align=64), init_of)  # fmt: skip

                store_by_mode(builder, mode, store_rows, old, bias, zero)

            def amx_rows(a0, a1):
                """Rows a0..a1 (whole tiles of 16) in blocks of 2 x 2 AMX tiles, 32 rows x 32
                columns (C in tiles 0-3, A in 4-5, B in 6-7: all eight), loads per tdpbusd 1;
                a last 16 rows as 1 x 2. B tiles are the panel's rows as they are: 16 k4 rows
                x 64 bytes of a 16-column group is AMX's VNNI layout for B. The configuration
                is loaded per call and released after it: the pool's threads all run tiles."""
                conf = [0] * 64
                conf[0] = 1  # palette 1; every tile 16 rows x 64 bytes
                for n in range(8):
                    conf[16 + 2 * n], conf[48 + n] = 4 * TR, TR
                builder.store(ir.Constant(ir.ArrayType(i8, 64), conf), cfg)
                tile_op("llvm.x86.ldtilecfg", builder.bitcast(cfg, i8p))
                pair_end = builder.add(
                    a0, builder.mul(builder.sdiv(builder.sub(a1, a0), const(2 * TR)),
                                    const(2 * TR)))  # fmt: skip
                for c0 in range(0, nvec, 2):
                    with cgutils.for_range_slice(builder, a0, pair_end, const(2 * TR)) as (i, _):
                        amx_block(i, 2, c0, min(2, nvec - c0))
                    with builder.if_then(builder.icmp_signed("<", pair_end, a1)):
                        amx_block(pair_end, 1, c0, min(2, nvec - c0))
                tile_op("llvm.x86.tilerelease")

            # Rows in whole AMX tiles of 16 (amx_rows), the 0..15 left over on the register
            # tile; a lone row (GEMV) never touches AMX.
            whole = builder.mul(builder.sdiv(builder.sub(i1, i0), const(TR)), const(TR))
            with builder.if_then(builder.icmp_signed(">", whole, const(0))):
                amx_rows(i0, builder.add(i0, whole))
            i0 = builder.add(i0, whole)
        row_tiles(builder, i0, i1, MR, rows_block)
        return context.get_dummy_value()

    return gen
