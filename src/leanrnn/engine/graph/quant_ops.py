"""The dynamic-quantization graph ops that ``onnxruntime.quantization.quantize_dynamic`` puts
around a model's heads, with onnxruntime's CPU semantics: ``DynamicQuantizeLinear`` and
``MatMulInteger`` (ONNX), ``com.microsoft::MatMulIntegerToFloat`` and
``com.microsoft::DynamicQuantizeMatMul`` (what onnxruntime's graph optimizer fuses them into),
and ``DequantizeLinear`` (after an embedding's Gather from an int8 table).

Activations are quantized to uint8 as onnxruntime's ``GetQuantizationParameter`` and MLAS's
``MlasQuantizeLinear`` do it, all in float32: the range [min(0, min x), max(0, max x)],
``scale = (max - min) / 255`` (1 when the range is empty), ``zero_point =
round_half_even(clamp(-min / scale, 0, 255))``, ``q = clamp(round_half_even(x / scale), -zp,
255 - zp) + zp`` where a NaN quotient clamps to the low end (SSE ``maxps`` keeps its second
operand), i.e. quantizes to 0. NaN is left out of the range, as onnxruntime's min/max leave it
out wherever it is not the last element (there its scale comes out NaN, all codes 0).
Integer products accumulate exactly (in a float32 GEMM while its bound allows, else in
float64, which holds every sum of K < 2**37 products of 8-bit values) and wrap to int32 as
onnxruntime's int32 accumulators do.
The float results are ``float32(acc) * float32(a_scale * b_scale) + bias``, onnxruntime's
output processor. Each op's ``run`` computes into the arena views it is handed (outputs and
``scratch`` buffers); nothing here allocates at run time beyond a few scalars.
"""

from __future__ import annotations

import numpy as np

from ...errors import DTypeError, ModelFormatError, ShapeError
from .base import Out, _axis

U8, I8, I32, F32, F64 = (np.dtype(t) for t in (np.uint8, np.int8, np.int32, np.float32, np.float64))
_EIGHT_BITS = (U8, I8)


def _fail(node, msg: str, cls=ModelFormatError):
    raise cls(f"[graph] node {node.name!r} ({node.op}): {msg}")


def _input(node, ins, i: int, what: str, dtypes, shapes=None):
    """Input ``i`` (``what``) as an ``Out``, checked against the allowed dtypes and, when
    ``shapes`` is given, a list of allowed shapes (tuples); absent optional inputs give None."""
    m = ins[i] if i < len(ins) else None
    if m is None:
        return None
    if m.dtype not in dtypes:
        want = " or ".join(str(d) for d in dtypes)
        _fail(node, f"{what} has dtype {m.dtype}; expected {want}", DTypeError)
    if shapes is not None and tuple(m.shape) not in shapes:
        want = " or ".join(str(list(s)) for s in shapes)
        _fail(node, f"{what} has shape {list(m.shape)}; expected {want}")
    return m


def _require(node, ins, n_required: int, n_max: int) -> None:
    if len(ins) > n_max or len(ins) < n_required or any(m is None for m in ins[:n_required]):
        _fail(node, f"has {len(ins)} inputs; expected {n_required}..{n_max} with the first "
                    f"{n_required} present")  # fmt: skip


def _matmul_shape(node, sa: tuple, sb: tuple) -> tuple[int, ...]:
    """Output shape of numpy/ONNX MatMul of [.., M, K] @ [.., K, N] (rank >= 1 each)."""
    if not sa or not sb:
        _fail(node, f"inputs have shapes {list(sa)} and {list(sb)}; expected rank >= 1", ShapeError)
    a = (1, *sa) if len(sa) == 1 else sa
    b = (*sb, 1) if len(sb) == 1 else sb
    if a[-1] != b[-2]:
        _fail(node, f"inner dims differ: {list(sa)} @ {list(sb)}", ShapeError)
    try:
        batch = tuple(int(d) for d in np.broadcast_shapes(a[:-2], b[:-2]))
    except ValueError:
        _fail(node, f"batch dims of {list(sa)} and {list(sb)} do not broadcast", ShapeError)
    shape = [*batch, a[-2], b[-1]]
    if len(sb) == 1:
        shape.pop(-1)
    if len(sa) == 1:
        shape.pop(-2 if len(sb) != 1 else -1)
    return tuple(shape)


def _b_params(node, ins, b, i_scale: int | None, i_zp: int) -> None:
    """Check B's scale (if the op has one) and zero point: one value (scalar or [1]) or one per
    column of a 2-D B ([N]), as MatMulInteger allows and onnxruntime's quantizer writes with
    ``per_channel=True``."""
    n = b.shape[-1] if len(b.shape) >= 2 else 1
    shapes = [(), (1,), (n,)]
    if i_scale is not None:
        _input(node, ins, i_scale, "b_scale", (F32,), shapes)
    _input(node, ins, i_zp, "b_zero_point", (b.dtype,), shapes)


# ----------------------------------------------------------------------------------- kernels
def quantize_uint8(x, q, scale, zp, tmp) -> None:
    """Dynamic uint8 quantization of ``x``, onnxruntime's (see the module docstring).

    x: [...] float32 input; q: [...] uint8 out; scale: [] float32 out; zp: [] uint8 out;
    tmp: [...] float32 scratch (x / scale). x may not alias q or tmp."""
    f = np.float32
    lo = hi = f(0)
    if x.size:
        # NaN left out of the range, as onnxruntime's min/max leave it out (but where a NaN
        # is the last element: its vector reduction then gives scale NaN); x.min() would give
        # NaN, read here as an empty range: scale 1, every value rounded to an integer
        with np.errstate(invalid="ignore"):
            mn, mx = np.fmin.reduce(x, axis=None), np.fmax.reduce(x, axis=None)
        if not np.isnan(mn):
            lo, hi = min(f(0), f(mn)), max(f(0), f(mx))
    s = f(1) if hi == lo else f(f(hi - lo) / f(255))
    with np.errstate(invalid="ignore"):
        zf = f(0) - f(lo / s)  # NaN for an infinite range (-inf / inf)
    # rint: round half to even; a NaN zero point clamps to the high end, as onnxruntime's
    # std::min(255, NaN) returns 255
    z = f(255) if np.isnan(zf) else np.rint(np.clip(zf, f(0), f(255)))
    scale[()] = s
    zp[()] = z
    with np.errstate(invalid="ignore"):  # inf / inf: NaN, clamped low below
        np.divide(x, s, out=tmp)
    np.fmax(tmp, -z, out=tmp)  # fmax/fmin: a NaN quotient takes the bound, as SSE max/min do
    np.fmin(tmp, f(255) - z, out=tmp)
    np.rint(tmp, out=tmp)
    tmp += z
    np.copyto(q, tmp, casting="unsafe")


def _leading(buf, dtype, shape):
    """The first bytes of the contiguous scratch ``buf`` as a ``dtype`` array of ``shape``."""
    n = int(np.prod(shape)) * np.dtype(dtype).itemsize
    return buf.reshape(-1).view(np.uint8)[:n].view(dtype).reshape(shape)


# Every partial sum of integer products is exact in float32 while K * max|a - za| * max|b - zb|
# stays below 2**24, whatever the summation order: then the (3x faster) float32 GEMM is exact.
_F32_EXACT = 1 << 24


def integer_matmul(a, b, a_zp, b_zp, out, tmp, matmul=np.matmul) -> None:
    """out = (a - a_zp) @ (b - b_zp) accumulated exactly, wrapped to int32 as onnxruntime's
    int32 accumulators do.

    a: [.., M, K] uint8/int8; b: [.., K, N] uint8/int8; a_zp: scalar; b_zp: scalar or [N];
    out: [.., M, N] int32; tmp: scratch from ``_integer_scratch``: "a_f" float64 like a, "b32"
    float32 and "b_f" float64 like b, "acc_f" float64 and "acc64" int64 like out. The float32
    GEMM runs in the leading halves of the float64 buffers when it is exact. ``matmul(x, y,
    out)`` is the float product (the graph's row-parallel one for 2-D operands)."""
    b32 = tmp["b32"]
    np.subtract(b, b_zp, out=b32, dtype=F32)  # exact: |b - zb| <= 255
    K = a.shape[-1]
    bmax = max(float(b32.max()), -float(b32.min())) if b32.size else 0.0
    if K * 255 * bmax < _F32_EXACT:  # |a - za| <= 255 for 8-bit a and zero point
        a32 = _leading(tmp["a_f"], F32, a.shape)
        acc32 = _leading(tmp["acc_f"], F32, out.shape)
        np.subtract(a, a_zp, out=a32, dtype=F32)
        matmul(a32, b32, out=acc32)
        np.copyto(out, acc32, casting="unsafe")  # integers below 2**24: exact
        return
    a64, b64, acc = tmp["a_f"], tmp["b_f"], tmp["acc_f"]
    np.subtract(a, a_zp, out=a64, dtype=F64)
    np.copyto(b64, b32)
    matmul(a64, b64, out=acc)  # exact: |sum| < 2**53
    np.copyto(tmp["acc64"], acc, casting="unsafe")
    np.copyto(out, tmp["acc64"], casting="unsafe")  # int64 -> int32 keeps the low 32 bits


def scale_to_float(acc, multiplier, bias, out) -> None:
    """out = float32(acc) * multiplier + bias (onnxruntime's QGEMM scale-bias output).

    acc: [.., N] int32; multiplier: scalar or [N] float32; bias: [N] float32 or None;
    out: [.., N] float32."""
    np.multiply(acc, multiplier, out=out, dtype=F32, casting="unsafe")
    if bias is not None:
        out += bias


# --------------------------------------------------------------------------------------- ops
def _dql_infer(ctx, node, ins, vals):

    _require(node, ins, 1, 1)
    x = _input(node, ins, 0, "x", (F32,))
    return [Out(x.shape, U8), Out((), F32), Out((), U8)][: len(node.outputs)]


def _dql_scratch(ctx, node, ins, metas, needed):
    tmp = {"quotient": (ins[0].shape, F32)}
    names = [*node.outputs, "", ""]
    if not names[1]:  # an unnamed scale / zero point still needs a place to go
        tmp["scale"] = ((), F32)
    if not names[2]:
        tmp["zp"] = ((), U8)
    return tmp


def _zp_or_zero(arr, dtype):
    return dtype.type(0) if arr is None else arr


def _dql_run(ctx, node, ins, outs, metas, tmp):
    outs = list(outs) + [None] * (3 - len(outs))
    scale = outs[1] if outs[1] is not None else tmp["scale"]
    zp = outs[2] if outs[2] is not None else tmp["zp"]
    quantize_uint8(ins[0], outs[0], scale, zp, tmp["quotient"])
    return [outs[0], scale, zp][: len(node.outputs)]


def _matmul_integer_infer(ctx, node, ins, vals):

    _require(node, ins, 2, 4)
    a = _input(node, ins, 0, "A", _EIGHT_BITS)
    b = _input(node, ins, 1, "B", _EIGHT_BITS)
    _input(node, ins, 2, "a_zero_point", (a.dtype,), [(), (1,)])
    _b_params(node, ins, b, None, 3)
    return [Out(_matmul_shape(node, a.shape, b.shape), I32)]


def _integer_scratch(a_shape, b_shape, out_shape) -> dict:
    # [.., M, K] @ [K, N] runs as one [rows, K] @ [K, N] product (one BLAS call, not one per
    # leading index) on flattened views of the same buffers
    return {
        "a_f": (a_shape, F64),
        "b32": (b_shape, F32),
        "b_f": (b_shape, F64),
        "acc_f": (out_shape, F64),
        "acc64": (out_shape, np.dtype(np.int64)),
    }


def _run_integer_matmul(ctx, a, b, a_zp, b_zp, out, tmp) -> None:
    """``integer_matmul``; a [.., M, K] @ [K, N] as one [rows, K] @ [K, N] product on the
    graph's row-parallel matmul (the threading of float MatMul)."""
    if b.ndim != 2 or a.ndim < 2:
        integer_matmul(a, b, a_zp, b_zp, out, tmp)
        return
    from .ops import _row_parallel_matmul

    rows = int(np.prod(a.shape[:-1]))
    a, out = a.reshape(rows, a.shape[-1]), out.reshape(rows, out.shape[-1])
    flat = {
        **tmp,
        "a_f": tmp["a_f"].reshape(a.shape),
        "acc_f": tmp["acc_f"].reshape(out.shape),
        "acc64": tmp["acc64"].reshape(out.shape),
    }
    integer_matmul(
        a, b, a_zp, b_zp, out, flat, lambda x, y, out: _row_parallel_matmul(ctx, x, y, out)
    )


def _matmul_integer_scratch(ctx, node, ins, metas, needed):
    return _integer_scratch(ins[0].shape, ins[1].shape, metas[0].shape)


def _opt(ins, i):
    return ins[i] if i < len(ins) else None


def _matmul_integer_run(ctx, node, ins, outs, metas, tmp):
    a, b = ins[0], ins[1]
    a_zp = _zp_or_zero(_opt(ins, 2), a.dtype)
    b_zp = _zp_or_zero(_opt(ins, 3), b.dtype)
    _run_integer_matmul(ctx, a, b, a_zp, b_zp, outs[0], tmp)
    return outs


def _mitf_infer(ctx, node, ins, vals):
    """MatMulIntegerToFloat(A, B, a_scale, b_scale, a_zero_point?, b_zero_point?, bias?)."""

    _require(node, ins, 4, 7)
    a = _input(node, ins, 0, "A", _EIGHT_BITS)
    b = _input(node, ins, 1, "B", _EIGHT_BITS)
    _input(node, ins, 2, "a_scale", (F32,), [(), (1,)])
    _input(node, ins, 4, "a_zero_point", (a.dtype,), [(), (1,)])
    _b_params(node, ins, b, 3, 5)
    shape = _matmul_shape(node, a.shape, b.shape)
    _input(node, ins, 6, "bias", (F32,), [(shape[-1],)] if shape else [()])
    return [Out(shape, F32)]


def _mitf_scratch(ctx, node, ins, metas, needed):
    return {
        **_integer_scratch(ins[0].shape, ins[1].shape, metas[0].shape),
        "acc32": (metas[0].shape, I32),
    }


def _mitf_run(ctx, node, ins, outs, metas, tmp):
    a, b = ins[0], ins[1]
    a_zp = _zp_or_zero(_opt(ins, 4), a.dtype)
    b_zp = _zp_or_zero(_opt(ins, 5), b.dtype)
    acc = tmp["acc32"]
    _run_integer_matmul(ctx, a, b, a_zp, b_zp, acc, tmp)
    multiplier = np.multiply(ins[2], ins[3], dtype=F32)  # a_scale * b_scale in float32
    scale_to_float(acc, multiplier.reshape(-1) if multiplier.ndim else multiplier,
                   _opt(ins, 6), outs[0])  # fmt: skip
    return outs


def _dqmm_infer(ctx, node, ins, vals):
    """DynamicQuantizeMatMul(A float32, B, b_scale, b_zero_point?, bias?)."""

    _require(node, ins, 3, 5)
    a = _input(node, ins, 0, "A", (F32,))
    b = _input(node, ins, 1, "B", _EIGHT_BITS)
    _b_params(node, ins, b, 2, 3)
    shape = _matmul_shape(node, a.shape, b.shape)
    _input(node, ins, 4, "bias", (F32,), [(shape[-1],)] if shape else [()])
    return [Out(shape, F32)]


def _dqmm_scratch(ctx, node, ins, metas, needed):
    return {
        **_integer_scratch(ins[0].shape, ins[1].shape, metas[0].shape),
        "quotient": (ins[0].shape, F32),
        "a_q": (ins[0].shape, U8),
        "a_scale": ((), F32),
        "a_zp": ((), U8),
        "acc32": (metas[0].shape, I32),
    }


def _dqmm_run(ctx, node, ins, outs, metas, tmp):
    a, b = ins[0], ins[1]
    quantize_uint8(a, tmp["a_q"], tmp["a_scale"], tmp["a_zp"], tmp["quotient"])
    b_zp = _zp_or_zero(_opt(ins, 3), b.dtype)
    acc = tmp["acc32"]
    _run_integer_matmul(ctx, tmp["a_q"], b, tmp["a_zp"][()], b_zp, acc, tmp)
    multiplier = np.multiply(tmp["a_scale"], ins[2], dtype=F32)
    scale_to_float(acc, multiplier.reshape(-1) if multiplier.ndim else multiplier,
                   _opt(ins, 4), outs[0])  # fmt: skip
    return outs


def _dequantize_linear_infer(ctx, node, ins, vals):
    """DequantizeLinear(x, x_scale, x_zero_point?) -> float32 (x - zero_point) * scale, per
    tensor or per slice along ``axis`` (what quantize_dynamic writes after an embedding's
    Gather from an int8 table)."""

    _require(node, ins, 2, 3)
    x = _input(node, ins, 0, "x", (U8, I8, I32))
    if int(node.attrs.get("block_size", 0)):
        _fail(node, f"block_size={node.attrs['block_size']}; leanrnn supports per-tensor and "
                    "per-axis scales only")  # fmt: skip
    shapes = [(), (1,)]
    scale = ins[1] if len(ins) > 1 else None
    if x.shape and scale is not None and tuple(scale.shape) not in shapes:
        # per axis: only then does axis (default 1) matter; a rank-1 x with a per-tensor
        # scale is valid with the default
        shapes.append((x.shape[_axis(node, node.attrs.get("axis", 1), len(x.shape))],))
    _input(node, ins, 1, "x_scale", (F32,), shapes)
    zp = _input(node, ins, 2, "x_zero_point", (x.dtype,))
    per_tensor = {(), (1,)}  # a scalar and a one-element vector alike, as onnxruntime reads them
    if (
        zp is not None
        and tuple(zp.shape) != tuple(ins[1].shape)
        and not (tuple(zp.shape) in per_tensor and tuple(ins[1].shape) in per_tensor)
    ):
        _fail(node, f"x_zero_point has shape {list(zp.shape)}; expected x_scale's "
                    f"{list(ins[1].shape)}")  # fmt: skip
    return [Out(x.shape, F32)]


def _dequantize_linear_scratch(ctx, node, ins, metas, needed):
    return {"diff": (ins[0].shape, np.dtype(np.int64))}


def dequantize_linear(x, scale, zp, out, diff) -> None:
    """out = float32(x - zp) * scale, the difference exact (onnxruntime's int32 one).

    x: [...] uint8/int8/int32; scale, zp: broadcastable to x (zp may be 0); out: [...]
    float32; diff: [...] int64 scratch."""
    np.subtract(x, zp, out=diff, dtype=np.int64)
    np.multiply(diff, scale, out=out, dtype=F32, casting="unsafe")


def _dequantize_linear_run(ctx, node, ins, outs, metas, tmp):
    x, scale = ins[0], ins[1]
    zp = _zp_or_zero(_opt(ins, 2), x.dtype)
    if scale.size == 1:  # per tensor, whatever axis says, as onnxruntime reads it; a [1]
        # scale must not make a scalar x's output [1]
        scale, zp = scale.reshape(()), np.reshape(zp, ())
    elif x.ndim > 1:  # per axis: along `axis`
        axis = _axis(node, node.attrs.get("axis", 1), x.ndim)
        shape = [1] * x.ndim
        shape[axis] = scale.size
        scale = scale.reshape(shape)
        zp = zp.reshape(shape) if np.ndim(zp) else zp
    dequantize_linear(x, scale, zp, outs[0], tmp["diff"])
    return outs


# (op, input positions) of the quantization parameters of weights: scales and zero points.
_QUANT_PARAMETER_INPUTS = {
    "DequantizeLinear": (1, 2),
    "MatMulInteger": (2, 3),
    "com.microsoft::MatMulIntegerToFloat": (2, 3, 4, 5),  # (A, B, a/b scales, a/b zps, bias)
    "com.microsoft::DynamicQuantizeMatMul": (2, 3),  # (A, B, b_scale, b_zero_point, bias)
}


def quantization_constants(graph) -> set[str]:
    """Names of ``graph``'s constants that are scales or zero points of quantized weights, not
    weights: the inputs those ops read them from, and a constant weight scale multiplied by a
    DynamicQuantizeLinear's activation scale (quantize_dynamic's MatMulInteger head). What a
    count of parameters leaves out, as torch counts the float model's."""
    found = set()
    act_scales = {n.outputs[1] for n in graph.nodes
                  if n.op == "DynamicQuantizeLinear" and len(n.outputs) > 1}  # fmt: skip
    for n in graph.nodes:
        found.update(
            n.inputs[i] for i in _QUANT_PARAMETER_INPUTS.get(n.op, ()) if i < len(n.inputs)
        )
        if n.op == "Mul" and act_scales.intersection(n.inputs):
            found.update(n.inputs)
    return found & set(graph.constants)


# The ops here that call BLAS (numpy's matmul): GraphSession keeps BLAS on one thread around
# RNN nodes for them as for MatMul/Gemm.
BLAS_OPS = frozenset(
    ["MatMulInteger", "com.microsoft::MatMulIntegerToFloat", "com.microsoft::DynamicQuantizeMatMul"]
)


def quant_ops(OpDef) -> dict:
    """The ops of this module as ``OpDef``s for ``ops.OPS`` (passed in: ops imports us)."""
    return {
        "DynamicQuantizeLinear": OpDef(_dql_infer, _dql_run, _dql_scratch),
        "DequantizeLinear": OpDef(
            _dequantize_linear_infer, _dequantize_linear_run, _dequantize_linear_scratch
        ),
        "MatMulInteger": OpDef(_matmul_integer_infer, _matmul_integer_run, _matmul_integer_scratch),
        "com.microsoft::MatMulIntegerToFloat": OpDef(_mitf_infer, _mitf_run, _mitf_scratch),
        "com.microsoft::DynamicQuantizeMatMul": OpDef(_dqmm_infer, _dqmm_run, _dqmm_scratch),
    }
