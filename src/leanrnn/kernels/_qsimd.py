"""Reduced-precision weight panels for the register tiles of ``_simd``: the vector IR that widens
one panel row segment to float32, and where an int8 panel keeps its column scales.

The tiles stay float32 throughout (activations, states, accumulators); only the bytes each step
streams shrink. A weight vector is widened right after its load:

- ``bf16`` (panel dtype uint16, the top half of a float32; 2 inputs per panel row, see
  bf16_pair_loader): shift left by 16 or mask the low half, reinterpret as float32 — exact;
- ``int8`` (panel dtype int8, symmetric): sign-extend and convert to float32 — exact too; the
  sum over k is then multiplied once by the column's scale s_j at the store, since
  ``sum_k h_k * (s_j q_kj) = s_j * sum_k h_k q_kj``.

LLVM lowers the widenings to what the CPU has (vpmovsxbd + vcvtdq2ps, vpslld / vpand on two
ymm with AVX2, zmm with AVX-512), so this one IR is the AVX2 fallback and the AVX-512
path alike; ``LEANRNN_ISA=avx2`` (see _cpu) forces the AVX2 tile anywhere.

An int8 panel array is [U, Kp + SCALE_ROWS, Wd]: rows 0..Kp-1 of panel u hold the weights,
its last SCALE_ROWS rows the Wd float32 scales of its columns (their little-endian bytes). The
scales thus travel with the panel through every job unchanged (no argument of their own) and
the tile can never read past its array.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.core import cgutils

SCALE_ROWS = 4  # int8 rows per panel holding the float32 column scales (4 bytes per column)
# Panel dtypes other than the working float's -> their format name.
WEIGHT_FORMATS = {types.int8: "int8", types.uint16: "bf16"}


def weight_loader(builder, wfmt: str | None, pa, vt: ir.VectorType):
    """A function (flat element index of a panel row segment, column offset within it: a
    multiple of the vector width) -> one float vector ``vt`` of weights from P's data pointer
    ``pa``, widened from the panel's format."""
    lanes = vt.count
    i64 = ir.IntType(64)
    if wfmt is None:

        def load(row, col):
            ptr = builder.gep(pa, [builder.add(row, ir.Constant(i64, col))])
            return builder.load(builder.bitcast(ptr, vt.as_pointer()), align=4)

        return load
    assert wfmt == "int8", "bf16 panels hold input pairs: bf16_pair_loader"
    qt = ir.VectorType(ir.IntType(8), lanes)

    def load(row, col):
        ptr = builder.gep(pa, [builder.add(row, ir.Constant(i64, col))])
        return builder.sitofp(builder.load(builder.bitcast(ptr, qt.as_pointer()), align=1), vt)

    return load


def bf16_pair_loader(builder, pa, vt: ir.VectorType):
    """A function (flat element index of a bf16 panel row, first column: a multiple of the
    vector width) -> (weights of the row's first input, of its second) as float vectors
    ``vt``. A bf16 panel row holds 2 inputs (formats.quantize.bf16_panel): 32-bit lane j is
    column j's pair, the first input in its low half. So one load gives both inputs' columns,
    the first input's as the lanes shifted left by 16 and the second's as the lanes with their
    low half masked off: one integer op per vector of weights."""
    lanes = vt.count
    i64, i32 = ir.IntType(64), ir.IntType(32)
    it = ir.VectorType(i32, lanes)
    sixteen = ir.Constant(it, [16] * lanes)
    high = ir.Constant(it, [-65536] * lanes)  # 0xFFFF0000

    def load(row, col):
        ptr = builder.gep(pa, [builder.add(row, ir.Constant(i64, 2 * col))])
        bits = builder.load(builder.bitcast(ptr, it.as_pointer()), align=2)
        return (builder.bitcast(builder.shl(bits, sixteen), vt),
                builder.bitcast(builder.and_(bits, high), vt))  # fmt: skip

    return load


def scale_base(builder, wfmt: str | None, pa, P_, P_type, poff, context):
    """A float32 pointer to the scale of the first column of the panel slice at flat offset
    ``poff`` of an int8 panel array (None for other formats): panel u = poff // (S1*S2), its
    scale rows start at row S1 - SCALE_ROWS, the slice's first column is poff % S2."""
    if wfmt != "int8":
        return None
    arr = cgutils.create_struct_proxy(P_type)(context, builder, value=P_)
    _, s1, s2 = cgutils.unpack_tuple(builder, arr.shape, 3)
    u = builder.sdiv(poff, builder.mul(s1, s2))
    col = builder.srem(poff, s2)
    row = builder.sub(builder.add(builder.mul(u, s1), s1), ir.Constant(s1.type, SCALE_ROWS))
    byte = builder.add(builder.mul(row, s2), builder.mul(col, ir.Constant(col.type, 4)))
    return builder.bitcast(builder.gep(pa, [byte]), ir.FloatType().as_pointer())
