"""bf16 (and weight-only int8) panels on AMX: a panel GEMM of SPLIT_MIN_ROWS rows or more as
AMX-BF16's ``tdpbf16ps`` (16 x 16 outputs, 32 inputs, float32 sums) instead of one FMA per
weight (int8 below the second-to-last paragraph).

The float32 tile of ``_simd`` widens every bf16 weight and does one multiply-add per weight:
at 16 rows and more the GEMM is compute-bound, and halving the weight bytes gains nothing
there. AMX multiplies bf16 by bf16, so the activations must be bf16 too. Rounding them once
would cost accuracy a float32 activation keeps; instead each activation a is split in two:

    hi = bf16(a)  (nearest, ties to even),   lo = bf16(a - hi),   |a - hi - lo| <= 2**-16 |a|

and both terms are multiplied (two tile products per tile of work): the sums carry the
weights' rounding only (2**-8, as on the float32 tile), not the activations'. A non-finite
hi (a inf, NaN or past bfloat16's range) gets lo = 0, so an infinite input stays infinite.

The split (AVX512-BF16's ``vcvtneps2bf16``) is done once per operand: kernels.gemm.operand
splits a step's rows, or a projection task's chunk of rows, into the thread's scratch
(``split_rows``: hi terms, then lo terms from round_up(K, 32), rows of
abi.split_row_floats(K) floats — a stride the engine's plain operands never have, by which
the tile knows it), and every panel multiplies them. Splitting per panel, in the tile (this
module's first version), cost ~35% of the input projection's time: one split per 64 columns.
A plain operand (fewer than abi.SPLIT_MIN_ROWS rows) goes to the float32 tile.
bf16-act (the ``bf16_act`` job argument) rounds the activations instead, as torch's autocast
does: ``split_rows(..., one_term=True)`` writes the hi terms only, at a row stride of
abi.split_row_floats(K, True), and for that stride the block skips the lo product — half the
tile loads and products (kernels.gemm.round_rows rounds the operands the float32 tile takes).
The two-term split is exact to 2**-16 for |a| from ~2**-117 (AMX and the conversion flush
bfloat16 denormals, so smaller lo terms and inputs count as 0) up to bfloat16's largest
(beyond, hi is inf). A weight of +-inf (bf16 keeps non-finite weights) gives NaN here where the
float32 tile gives +-inf: its lo term multiplies inf by 0 or by the opposite sign; both are
non-finite.

Per block of 32 rows (or a last 1..31), every 2-group column pair of the panel slice is
multiplied: C tiles 0-3 (2 x 2), hi and lo tiles 4 and 5, weight tiles 6 and 7, loaded
straight from the panel (a bf16 panel row of a 16-column group is 16 columns x 2 inputs x 2
bytes, AMX's B layout). Float32 sums go through a stack buffer (``sums``) to the caller's
store, which applies the tile's ``mode``. The
last k step of a K not a multiple of 32 reads the panel through a zero-filled copy of its
rows (in ``wide``): the rows past K belong to the next panel or lie past the array. The
activations past K are zero in the split rows; the panel's own padding is zero too
(packing writes it so; formats.quantize.check_loaded refuses a file that does not).
"""

from __future__ import annotations

import llvmlite.binding as llvm
from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from ._ir import amx_ops
from .abi import SPLIT_PAD

# vcvtneps2bf16 goes in as inline asm (see split_ir), which LLVM assembles only with the
# native asm parser, which numba does not initialize.
llvm.initialize_native_asmparser()

TR = 16  # rows of an AMX tile (of A and C) and input pairs of a B tile
KSTEP = 2 * TR  # inputs per tile product
# int8 panels (emit_rows(int8=True)): inputs per widened chunk of a column pair — 2 x 16
# columns x 512 inputs x 2 bytes = 32 KiB of stack, which stays in L1 while the row blocks
# multiply it.
KCH = 512
# Rows from which a panel GEMM runs on AMX: abi.SPLIT_MIN_ROWS = 4. Measured (JIT, bf16 LSTM
# H=512 T=100, 1 thread, this Xeon): the step on 2 rows 6.3 ms on the float32 tile, 9.7 on AMX;
# on 3 rows 8.1 and 9.3; 4 rows on AMX 10.0 (a 16-row tile product costs the same for 4 rows
# as for 16; a stream's lone row stays on the float32 tile's GEMV).


def _round_up(builder, K, step: int):
    """round_up(K, step) of an integer IR value."""
    c = ir.Constant(K.type, step)
    return builder.mul(builder.sdiv(builder.add(K, ir.Constant(K.type, step - 1)), c), c)


def split_ld(builder, K, one_term: bool = False):
    """abi.split_row_floats(K, one_term) of an integer IR value: a split operand's row stride
    in floats, by which the tile (_simd) and gemm's operand view know one (and which kind)."""
    pad = 2 * SPLIT_PAD if one_term else SPLIT_PAD
    return builder.add(_round_up(builder, K, KSTEP), ir.Constant(K.type, pad))


def lo_offset(builder, K):
    """Floats from a split row's start to its lo terms (round_up(K, 32) / 2) of an integer IR
    value K."""
    return builder.sdiv(_round_up(builder, K, KSTEP), ir.Constant(K.type, 2))


def split_ir(builder, v):
    """(hi, lo) <16 x i16> bfloat16 bits of the float32 vector ``v`` (see the module
    docstring). vcvtneps2bf16 through inline asm: llvmlite has no bfloat type for the
    intrinsic's result."""
    f32, i16, i32 = ir.FloatType(), ir.IntType(16), ir.IntType(32)
    vf, vh, vi = ir.VectorType(f32, 16), ir.VectorType(i16, 16), ir.VectorType(i32, 16)
    cvt_t = ir.FunctionType(vh, [vf])

    def cvt(x):
        return builder.asm(cvt_t, "vcvtneps2bf16 $1, $0", "=v,v", [x], side_effect=False)

    hi = cvt(v)
    hi_f = builder.bitcast(builder.shl(builder.zext(hi, vi), ir.Constant(vi, [16] * 16)), vf)
    fabs = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(vf, [vf]), "llvm.fabs.v16f32"
    )
    finite = builder.fcmp_ordered("<", builder.call(fabs, [hi_f]),
                                  ir.Constant(vf, [float("inf")] * 16))  # fmt: skip
    lo = builder.select(finite, builder.fsub(v, hi_f), ir.Constant(vf, [0.0] * 16))
    return hi, cvt(lo)


def split_row(builder, aa, src, kb, dst, lo_off, kpad) -> None:
    """Emit: inputs src..src+kb-1 of the float pointer ``aa`` split into bfloat16 hi at the
    i16 pointer ``dst`` and lo at dst + lo_off (lo_off None: hi only, the inputs rounded),
    then zeros up to kpad (a multiple of 16); i64 values. Whole vectors of 16, the last 0..15
    inputs read one by one (nothing past the row is read)."""
    f32, i16, i64 = ir.FloatType(), ir.IntType(16), ir.IntType(64)
    vf, vh = ir.VectorType(f32, 16), ir.VectorType(i16, 16)
    zero = ir.Constant(vf, [0.0] * 16)

    def put(k, v):
        hi, lo = split_ir(builder, v)
        terms = [(k, hi)] if lo_off is None else [(k, hi), (builder.add(k, lo_off), lo)]
        for off, vec in terms:
            builder.store(vec, builder.bitcast(builder.gep(dst, [off]), vh.as_pointer()), align=2)

    sixteen = ir.Constant(i64, 16)
    whole = builder.mul(builder.sdiv(kb, sixteen), sixteen)
    with cgutils.for_range_slice(builder, ir.Constant(i64, 0), whole, sixteen) as (k, _):
        p = builder.gep(aa, [builder.add(src, k)])
        put(k, builder.load(builder.bitcast(p, vf.as_pointer()), align=4))
    with builder.if_then(builder.icmp_signed("<", whole, kpad)):
        vec = cgutils.alloca_once_value(builder, zero)
        builder.store(zero, vec)
        fp = builder.bitcast(vec, f32.as_pointer())
        with cgutils.for_range_slice(builder, whole, kb, ir.Constant(i64, 1)) as (k, _):
            x = builder.load(builder.gep(aa, [builder.add(src, k)]))
            builder.store(x, builder.gep(fp, [builder.sub(k, whole)]))
        put(whole, builder.load(vec))
        with cgutils.for_range_slice(builder, builder.add(whole, sixteen), kpad, sixteen) as (
            k,
            _,
        ):
            put(k, zero)


def emit_rows(builder, nvec, pa, poff, kstride, aa, lda, K, a0, a1, two_terms, store_block,
              int8: bool = False):  # fmt: skip
    """Rows a0..a1 (i64 values) of the panel slice on AMX, in blocks of 32 rows and a last
    block of 1..31 (its tiles' rows past a1 multiply whatever the split rows' scratch holds
    there: each C row depends on its own A row only, and those C rows are not stored).
    ``pa``: the panel's data pointer, ``poff``/``kstride`` its flat offset and row stride
    (elements); ``aa``: the split operand's float pointer (split_rows: row r at r * lda
    floats, hi terms then lo terms from round_up(K, 32); ``two_terms`` an i1 value, false for
    rows of hi terms only, whose lo product is skipped), K whole. ``store_block(i, rows,
    sum_at, v0, nv, more)`` stores C rows i..i+rows-1 (rows an i64 value) of groups
    v0..v0+nv-1, ``sum_at(r, v)`` giving the <16 x float> pointer to the float32 sums of row
    r (0-based within the block) and group v; ``more`` (an i1 value, or None: false) says
    the sums add to C's (a later chunk of K).

    ``int8``: ``pa`` points at an int8 panel (one input per row, one byte per column:
    kernels._qsimd) and its codes are widened to bfloat16 — exactly: |q| <= 127 needs 7
    significant bits, bfloat16 has 8 — a column pair and KCH inputs at a time into a stack
    buffer, which every row block of the slice then multiplies (so the widening is paid once
    per weight and call, not once per row block); the sums are the codes', the caller's store
    scales them. K is taken in chunks of KCH there, the pair's sums stored after each."""
    i8, i16, i32, i64 = ir.IntType(8), ir.IntType(16), ir.IntType(32), ir.IntType(64)
    f32 = ir.FloatType()
    vf, vh, vi = ir.VectorType(f32, 16), ir.VectorType(i16, 16), ir.VectorType(i32, 16)
    i8p = i8.as_pointer()
    ld = nvec * 16  # floats per row of ``sums``

    def const(v):
        return ir.Constant(i64, v)

    tile_op, tmm = amx_ops(builder)
    with builder.goto_entry_block():  # not cgutils.alloca_once: it zero-fills them
        cfg = builder.alloca(ir.ArrayType(i8, 64))
        sums = builder.alloca(ir.ArrayType(f32, 2 * TR * ld))
        if int8:  # two groups' widened pair rows of a K chunk
            wide = builder.alloca(ir.ArrayType(i32, 2 * (KCH // 2) * 16))
        else:
            wide = builder.alloca(ir.ArrayType(i16, 2 * TR * 32))  # two groups' last k step
    cfg.align = sums.align = wide.align = 64
    sbase = builder.bitcast(sums, f32.as_pointer())
    a16 = builder.bitcast(aa, i16.as_pointer())
    kp = _round_up(builder, K, KSTEP)

    def sum_at(r, v):
        off = builder.add(builder.mul(r, const(ld)), const(16 * v))
        return builder.bitcast(builder.gep(sbase, [off]), vf.as_pointer())

    def a_tile(i, r, s, lo):
        """&(the hi or lo terms of rows i + 16r.., k step s) as an i8 pointer."""
        row = builder.mul(builder.add(i, const(TR * r)), builder.mul(lda, const(2)))
        k = builder.add(builder.mul(s, const(KSTEP)), kp if lo else const(0))
        return builder.bitcast(builder.gep(a16, [builder.add(row, k)]), i8p)

    def product(i, r, s, nc, lo):
        """Rows i + 16r.. (hi or lo terms, A tile 4 or 5) times weight tiles 6.. into C."""
        t = 5 if lo else 4
        tile_op("llvm.x86.tileloadd64", tmm(t), a_tile(i, r, s, lo), builder.mul(lda, const(4)))
        for c in range(nc):
            tile_op("llvm.x86.tdpbf16ps", tmm(2 * r + c), tmm(t), tmm(6 + c))

    def products(i, mr, s, nc):
        for r in range(mr):
            product(i, r, s, nc, False)
            with builder.if_then(two_terms, likely=True):
                product(i, r, s, nc, True)

    def zero_c(mr, nc):
        for r in range(mr):
            for c in range(nc):
                tile_op("llvm.x86.tilezero", tmm(2 * r + c))

    def store_c(mr, c0, nc):
        for r in range(mr):
            for c in range(nc):
                p = builder.bitcast(sum_at(const(TR * r), c0 + c), i8p)
                tile_op("llvm.x86.tilestored64", tmm(2 * r + c), p, const(4 * ld))

    def block(i, mr, rows):
        """Rows i..i+rows-1 (rows <= 16*mr) in mr tiles of rows, by every column pair."""
        for c0 in range(0, nvec, 2):
            nc = min(2, nvec - c0)
            zero_c(mr, nc)
            with cgutils.for_range(builder, builder.sdiv(kp, const(KSTEP))) as loop:
                s = loop.index
                k = builder.mul(s, const(KSTEP))  # even: a pair row
                inside = builder.icmp_signed("<=", builder.add(k, const(KSTEP)), K)
                for c in range(nc):
                    wp = builder.add(builder.add(poff, builder.mul(builder.sdiv(k, const(2)),
                                                                   kstride)),
                                     const(32 * (c0 + c)))  # fmt: skip
                    with builder.if_else(inside) as (then, otherwise):
                        with then:
                            tile_op("llvm.x86.tileloadd64", tmm(6 + c),
                                    builder.bitcast(builder.gep(pa, [wp]), i8p),
                                    builder.mul(kstride, const(2)))  # fmt: skip
                        with otherwise:
                            tail_b(wp, builder.sub(K, k), c)
                products(i, mr, s, nc)
            store_c(mr, c0, nc)
        store_block(i, rows, sum_at, 0, nvec, None)

    def tail_b(wp, left, c):
        """Weight tile 6+c from the panel's pair rows holding inputs k..K-1 (``left`` of them),
        copied into ``wide`` after zeros."""
        base = builder.gep(builder.bitcast(wide, i16.as_pointer()), [const(c * TR * 32)])
        zero = ir.Constant(vh, [0] * 16)
        for n in range(2 * TR):
            builder.store(zero, builder.bitcast(builder.gep(base, [const(16 * n)]),
                                                vh.as_pointer()))  # fmt: skip
        pairs = builder.sdiv(builder.add(left, const(1)), const(2))
        with cgutils.for_range(builder, pairs) as loop:
            q = loop.index
            src = builder.gep(pa, [builder.add(wp, builder.mul(q, kstride))])
            dst = builder.gep(base, [builder.mul(q, const(32))])
            for h in (0, 16):
                v = builder.load(builder.bitcast(builder.gep(src, [const(h)]), vh.as_pointer()),
                                 align=2)  # fmt: skip
                builder.store(v, builder.bitcast(builder.gep(dst, [const(h)]), vh.as_pointer()))
        tile_op("llvm.x86.tileloadd64", tmm(6 + c), builder.bitcast(base, i8p), const(64))

    wbase = builder.bitcast(wide, vi.as_pointer())

    def widen(kc0, klen, nrows, c0, nc):
        """Inputs kc0..kc0+klen-1 of groups c0..c0+nc-1 as bfloat16 pair rows in ``wide``
        (group c's pair row p at c * KCH/2 + p; lane j: column j's two inputs, the first in
        the low half, as a bf16 panel holds them), zeros after them up to pair row nrows.
        A code's float32 has its low 16 bits zero, so its top half is its bfloat16."""
        vb = ir.VectorType(i8, 16)
        high = ir.Constant(vi, [-65536] * 16)  # 0xFFFF0000
        sixteen = ir.Constant(vi, [16] * 16)
        full = builder.sdiv(klen, const(2))  # pair rows with both inputs

        def bits(k, col):  # input k's codes of the 16 columns from ``col``, as float32 bits
            off = builder.add(builder.add(poff, builder.mul(k, kstride)), const(col))
            codes = builder.load(builder.bitcast(builder.gep(pa, [off]), vb.as_pointer()),
                                 align=1)  # fmt: skip
            return builder.bitcast(builder.sitofp(codes, vf), vi)

        def put(row0, p, v):
            builder.store(v, builder.gep(wbase, [builder.add(const(row0), p)]))

        for c in range(nc):
            col, row0 = 16 * (c0 + c), c * (KCH // 2)
            with cgutils.for_range(builder, full) as loop:
                k = builder.add(kc0, builder.mul(loop.index, const(2)))
                pair = builder.or_(builder.and_(bits(builder.add(k, const(1)), col), high),
                                   builder.lshr(bits(k, col), sixteen))  # fmt: skip
                put(row0, loop.index, pair)
            odd = builder.icmp_signed("<", builder.mul(full, const(2)), klen)
            with builder.if_then(odd):
                last = builder.add(kc0, builder.mul(full, const(2)))
                put(row0, full, builder.lshr(bits(last, col), sixteen))
            start = builder.sdiv(builder.add(klen, const(1)), const(2))
            with cgutils.for_range_slice(builder, start, nrows, const(1)) as (p, _):
                put(row0, p, ir.Constant(vi, [0] * 16))

    def block8(i, mr, rows, kc0, steps, c0, nc, more):
        """An int8 slice's rows i..i+rows-1, column pair c0, the K chunk at kc0 (``steps``
        tile steps, widened into ``wide``)."""
        zero_c(mr, nc)
        s0 = builder.sdiv(kc0, const(KSTEP))
        with cgutils.for_range(builder, steps) as loop:
            s = loop.index
            for c in range(nc):
                p = builder.gep(wbase, [builder.add(const(c * (KCH // 2)),
                                                    builder.mul(s, const(TR)))])  # fmt: skip
                tile_op("llvm.x86.tileloadd64", tmm(6 + c), builder.bitcast(p, i8p), const(64))
            products(i, mr, builder.add(s0, s), nc)
        store_c(mr, c0, nc)
        store_block(i, rows, sum_at, c0, nc, more)

    def by_blocks(body):
        """body(i, mr, rows) for rows a0..a1: blocks of 2 tiles of 16, then the last 1..31."""
        pair_end = builder.add(a0, builder.mul(builder.sdiv(builder.sub(a1, a0), const(2 * TR)),
                                               const(2 * TR)))  # fmt: skip
        with cgutils.for_range_slice(builder, a0, pair_end, const(2 * TR)) as (i, _):
            body(i, 2, const(2 * TR))
        rest = builder.sub(a1, pair_end)
        with builder.if_else(builder.icmp_signed(">", rest, const(TR))) as (two, one):
            with two:
                body(pair_end, 2, rest)
            with one:
                with builder.if_then(builder.icmp_signed(">", rest, const(0))):
                    body(pair_end, 1, rest)

    conf = [0] * 64
    conf[0] = 1  # palette 1; every tile 16 rows x 64 bytes
    for n in range(8):
        conf[16 + 2 * n], conf[48 + n] = 64, TR
    builder.store(ir.Constant(ir.ArrayType(i8, 64), conf), cfg)
    tile_op("llvm.x86.ldtilecfg", builder.bitcast(cfg, i8p))
    if not int8:
        by_blocks(block)
    else:
        nch = builder.sdiv(builder.add(K, const(KCH - 1)), const(KCH))
        with cgutils.for_range(builder, nch) as chunk:
            kc0 = builder.mul(chunk.index, const(KCH))
            left = builder.sub(K, kc0)
            klen = builder.select(builder.icmp_signed("<", left, const(KCH)), left, const(KCH))
            steps = builder.sdiv(builder.add(klen, const(KSTEP - 1)), const(KSTEP))
            more = builder.icmp_signed(">", kc0, const(0))
            for c0 in range(0, nvec, 2):
                nc = min(2, nvec - c0)
                widen(kc0, klen, builder.mul(steps, const(TR)), c0, nc)
                by_blocks(lambda i, mr, rows, c0=c0, nc=nc: block8(i, mr, rows, kc0, steps, c0,
                                                                   nc, more))  # fmt: skip
    tile_op("llvm.x86.tilerelease")


@intrinsic
def split_rows(typingctx, A, i0, i1, K, out, one_term):
    """Rows i0..i1 of float32 A [rows, >=K] (C-contiguous) split into the flat uint8 ``out``
    as kernels.gemm.operand hands them to the tile: row r at r * 4 * ld bytes, ld =
    abi.split_row_floats(K, one_term); its hi terms at uint16 element 0.., its lo terms at
    kp = round_up(K, 32).. (none where ``one_term``: the rows rounded to bfloat16), each zero
    from K to kp. One split per operand, for every panel."""
    if not (
        isinstance(A, types.Array) and A.dtype == types.float32 and isinstance(out, types.Array)
    ):
        return None

    def gen(context, builder, sig, args):
        A_, i0_, i1_, K_, out_, one_ = args
        arr = context.make_array(sig.args[0])(context, builder, A_)
        lda = cgutils.unpack_tuple(builder, arr.shape)[1]
        i16, i64 = ir.IntType(16), ir.IntType(64)
        dst0 = builder.bitcast(context.make_array(sig.args[4])(context, builder, out_).data,
                               i16.as_pointer())  # fmt: skip
        kp = _round_up(builder, K_, KSTEP)
        one = builder.icmp_unsigned("!=", one_, ir.Constant(one_.type, 0))
        with builder.if_else(one) as (hi_only, both):
            for lo_off, branch in ((None, hi_only), (kp, both)):
                with branch:
                    ld = split_ld(builder, K_, one_term=lo_off is None)
                    row16 = builder.mul(ld, i64(2))  # uint16 per row
                    with cgutils.for_range(builder, builder.sub(i1_, i0_)) as loop:
                        r = loop.index
                        src = builder.mul(builder.add(i0_, r), lda)
                        dst = builder.gep(dst0, [builder.mul(r, row16)])
                        split_row(builder, arr.data, src, K_, dst, lo_off, kp)
        return context.get_dummy_value()

    sig = types.void(A, types.intp, types.intp, types.intp, out, types.boolean)
    return sig, gen
