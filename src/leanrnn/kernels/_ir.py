"""LLVM IR pieces every register tile shares (the float tiles of _simd, the integer tile of
_qdot): how a tile's stores start (its ``mode``), how a lone row splits its k loop and
prefetches its panel, and how rows are cut into tiles."""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic


def store_by_mode(builder, mode, store_rows, old, bias, zero) -> None:
    """Emit ``store_rows(init)`` three times, picked at run time by the tile's ``mode``: 1 ->
    init ``old`` (C's value), 2 -> ``bias``, else ``zero``. Three store paths, so modes 0 and 2
    never read C: a load of a line not yet in cache (a fresh xw row) would stall the tile for
    nothing; mode 0 never reads the bias either (boff may not be valid then)."""
    with builder.if_else(builder.icmp_signed("==", mode, ir.Constant(mode.type, 1))) as (
        then,
        otherwise,
    ):
        with then:
            store_rows(old)
        with otherwise:
            add_bias = builder.icmp_signed("==", mode, ir.Constant(mode.type, 2))
            with builder.if_else(add_bias) as (then2, otherwise2):
                with then2:
                    store_rows(bias)
                with otherwise2:
                    store_rows(zero)


def amx_ops(builder):
    """(tile_op(name, *args): a call of the AMX intrinsic ``name``, tmm(n): tile register n as
    the immediate operand the intrinsics take) for the AMX blocks of _qdot and _bf16amx."""
    i8 = ir.IntType(8)

    def tile_op(name, *args):
        fn = cgutils.get_or_insert_function(
            builder.module, ir.FunctionType(ir.VoidType(), [a.type for a in args]), name
        )
        return builder.call(fn, list(args))

    def tmm(n):
        return ir.Constant(i8, n)

    return tile_op, tmm


def prefetch_ahead(builder, ptr, nbytes: int, dist: int) -> None:
    """Emit a prefetch of every cache line of the ``nbytes`` at ``ptr`` (any pointer), ``dist``
    bytes further on: a lone row's (GEMV's) panel row segment, asked for before its loads
    need it (past a panel's last row: the next panel's first, which comes next)."""
    for off in range(0, max(64, nbytes), 64):
        # high locality: into L1; a prefetch never faults (past the array either)
        prefetch_line(builder, ptr, ir.Constant(ir.IntType(64), dist + off), locality=3)


def prefetch_line(builder, ptr, offset, locality: int = 2) -> None:
    """Emit a read prefetch of the cache line ``offset`` bytes (an i64 value) past ``ptr`` (any
    pointer) into the data cache: locality 2 into L2, 3 into L1."""
    i8p, i32 = ir.IntType(8).as_pointer(), ir.IntType(32)
    fn = cgutils.get_or_insert_function(
        builder.module, ir.FunctionType(ir.VoidType(), [i8p, i32, i32, i32]), "llvm.prefetch.p0i8"
    )
    line = builder.gep(builder.bitcast(ptr, i8p), [offset])
    builder.call(fn, [line, i32(0), i32(locality), i32(1)])


def split_loop(builder, n, sets: int, step) -> None:
    """Steps 0..n-1 (an i64 value) with ``sets`` accumulator sets taking turns: ``step(k,
    s)`` for k in whole rounds of ``sets`` (set s gets k = round + s), then the 0..sets-1 steps
    left over on set 0. A lone row's k loop is split this way so its multiply-add chains do
    not wait on each other (the float tiles' GEMV, and the int8 one's with VNNI)."""
    i64 = ir.IntType(64)
    sc = ir.Constant(i64, sets)
    main = builder.mul(builder.sdiv(n, sc), sc)
    with cgutils.for_range_slice(builder, ir.Constant(i64, 0), main, sc) as (k, _):
        for s in range(sets):
            step(builder.add(k, ir.Constant(i64, s)), s)
    with cgutils.for_range_slice(builder, main, n, ir.Constant(i64, 1)) as (k, _):
        step(k, 0)


def row_tiles(builder, i0, i1, rows: int, rows_block) -> None:
    """Rows i0..i1 as tiles of ``rows``: ``rows_block(i, rows)`` in a loop, then the 1..rows-1
    leftover rows as one shorter tile, ``rows_block(end, r)`` with its own straight-line body
    per count (at N=64, 4 rows one at a time ran at half the speed of a 4-row tile)."""
    i64 = ir.IntType(64)
    step = ir.Constant(i64, rows)
    full_end = builder.add(i0, builder.mul(builder.sdiv(builder.sub(i1, i0), step), step))
    with cgutils.for_range_slice(builder, i0, full_end, step) as (i, _):
        rows_block(i, rows)
    rem = builder.sub(i1, full_end)
    for r in range(1, rows):
        with builder.if_then(builder.icmp_signed("==", rem, ir.Constant(i64, r))):
            rows_block(full_end, r)


@intrinsic
def prefetch_l2(typingctx, a, row, col, nbytes):
    """Ask for the cache lines of the ``nbytes`` bytes of 2-D array ``a`` from a[row, col] on
    into L2 (no bounds check: a prefetch never faults): the recurrences ask
    for the next unit block's xw rows while they update this one's, so the update after the
    next block's GEMM finds them near (xw, written by the input projection a chunk before,
    lies in L3 or the other core's L2: its loads were a quarter of an N=64 LSTM step's time
    on a Zen 5). Locality 2: into L2, not L1, which the GEMM's panel streams through."""
    if not isinstance(a, types.Array) or a.ndim != 2:
        return None

    def codegen(context, builder, sig, args):
        arr = context.make_array(sig.args[0])(context, builder, args[0])
        ptr = cgutils.get_item_pointer(context, builder, sig.args[0], arr, [args[1], args[2]],
                                       wraparound=False, boundscheck=False)  # fmt: skip
        i64 = ir.IntType(64)
        n = args[3] if args[3].type == i64 else builder.sext(args[3], i64)
        with cgutils.for_range_slice(builder, ir.Constant(i64, 0), n, ir.Constant(i64, 64)) as (
            off,
            _,
        ):
            prefetch_line(builder, ptr, off)
        return context.get_dummy_value()

    return types.void(a, row, col, nbytes), codegen
