"""Reduced-precision weight panels for the register tiles of ``_simd``: the vector IR that widens
one panel row segment to float32, and where an int8 panel keeps its column scales.

The tiles stay float32 throughout (activations, states, accumulators); only the bytes each step
streams shrink. A weight vector is widened right after its load:

- ``bf16`` (panel dtype uint16, the top half of a float32): zero-extend to 32 bits, shift left
  by 16, reinterpret as float32 — exact, one shift per lane;
- ``int8`` (panel dtype int8, symmetric): sign-extend and convert to float32 — exact too; the
  sum over k is then multiplied once by the column's scale s_j at the store, since
  ``sum_k h_k * (s_j q_kj) = s_j * sum_k h_k q_kj``.

LLVM lowers the 16-lane widenings to what the CPU has (vpmovsxbd / vpmovzxwd + vcvtdq2ps on
two ymm with AVX2, one zmm with AVX-512), so this one IR is the AVX2 fallback and the AVX-512
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
    """A function (flat element index of P) -> one float vector ``vt`` of weights from P's
    data pointer ``pa``, widened from the panel's format."""
    lanes = vt.count
    if wfmt is None:

        def load(index):
            ptr = builder.gep(pa, [index])
            return builder.load(builder.bitcast(ptr, vt.as_pointer()), align=4)

        return load
    if wfmt == "int8":
        qt = ir.VectorType(ir.IntType(8), lanes)

        def load(index):
            ptr = builder.bitcast(builder.gep(pa, [index]), qt.as_pointer())
            return builder.sitofp(builder.load(ptr, align=1), vt)

        return load
    wt = ir.VectorType(ir.IntType(16), lanes)
    it = ir.VectorType(ir.IntType(32), lanes)
    sixteen = ir.Constant(it, [16] * lanes)

    def load(index):  # bf16
        ptr = builder.bitcast(builder.gep(pa, [index]), wt.as_pointer())
        bits = builder.shl(builder.zext(builder.load(ptr, align=2), it), sixteen)
        return builder.bitcast(bits, vt)

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
