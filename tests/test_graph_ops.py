"""Every non-RNN op of the graph engine on its own: tiny one-node (or few-node) ONNX models run
through leanrnn and onnxruntime (the oracle; numpy as a second one where it is simpler), over
shapes, broadcasting, every axis (negative too), dtypes and the attribute vs input forms ONNX
used across opsets. Each model is also run constant-folded (every input an initializer), which
leanrnn evaluates once at load instead of in the planned arena. Bad graphs fail with a leanrnn
error naming the node."""

from __future__ import annotations

import math
import time

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from _onnx_graphs import (  # noqa: E402
    TensorProto,
    assert_same,
    check,
    folded,
    load,
    model,
    node,
    onnx_type,
)
from leanrnn.errors import DTypeError, LeanRNNError, UnsupportedOpError  # noqa: E402

pytestmark = pytest.mark.onnx

F32, F64, I64, I32 = np.float32, np.float64, np.int64, np.int32
FLOATS = [F32, F64]
INT_MAX, INT_MIN = np.iinfo(np.int64).max, np.iinfo(np.int64).min


def arr(shape, dtype=F32, kind: str = "any", seed: int = 0) -> np.ndarray:
    """A few values of ``dtype``: ``any`` in [-2, 2], ``pos`` in [0.5, 2], ``nonzero`` with
    magnitude in [0.5, 2] (safe divisors); integers in [-9, 9] (nonzero: no 0)."""
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "iu":
        v = rng.integers(-9, 10, size=shape)
        if kind != "any":
            v = np.where(v == 0, 3, np.abs(v) if kind == "pos" else v)
        return np.asarray(v, dtype)
    if kind == "any":
        v = rng.uniform(-2, 2, size=shape)
    else:
        v = rng.uniform(0.5, 2, size=shape)
        if kind == "nonzero":
            v *= rng.choice([-1.0, 1.0], size=shape)
    return np.asarray(v, dtype)


def ints(*v, dtype=I64) -> np.ndarray:
    return np.array(v, dtype)


def both(m, feeds, tmp, expected=None, with_ort=True):
    """Check ``m`` as given (inputs fed at run) and constant-folded (inputs as initializers)."""
    return check(m, feeds, tmp, expected, with_ort, fold=True)


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    """One directory for the module's many tiny model files (a tmp_path per test costs more
    than the test)."""
    return tmp_path_factory.mktemp("graph_ops")


def _id(v) -> str:
    if isinstance(v, type) and issubclass(v, np.generic):
        return np.dtype(v).name
    return None


# --------------------------------------------------------------------------------- unary ops
UNARY = {
    "Abs": (np.abs, "any"),
    "Exp": (np.exp, "any"),
    "Log": (np.log, "pos"),
    "Neg": (np.negative, "any"),
    "Reciprocal": (np.reciprocal, "nonzero"),
    "Relu": (lambda x: np.maximum(x, 0), "any"),
    "Sigmoid": (lambda x: 1 / (1 + np.exp(-x)), "any"),
    "Sqrt": (np.sqrt, "pos"),
    "Tanh": (np.tanh, "any"),
    "Identity": (lambda x: x, "any"),
}


@pytest.mark.parametrize("shape", [(), (3,), (2, 3), (2, 1, 3)], ids=str)
@pytest.mark.parametrize("dtype", FLOATS, ids=_id)
@pytest.mark.parametrize("op", sorted(UNARY))
def test_unary(op, dtype, shape, tmp):
    fn, kind = UNARY[op]
    x = arr(shape, dtype, kind)
    ref = np.asarray(fn(x.astype(F64))).astype(dtype)
    both(model([node(op, ["x"])], {"x": x}), {"x": x}, tmp, [ref])


@pytest.mark.parametrize("op", ["Abs", "Neg", "Relu", "Identity"])
def test_unary_int64(op, tmp):
    x = arr((2, 3), I64)
    ref = np.asarray(UNARY[op][0](x)).astype(I64)
    m = model([node(op, ["x"])], {"x": x}, opset=14)
    check(m, {"x": x}, tmp, [ref], with_ort=op != "Relu")  # onnxruntime: no int64 Relu


@pytest.mark.parametrize("dtype", FLOATS, ids=_id)
@pytest.mark.parametrize("op", ["Sigmoid", "Tanh", "Relu", "Abs", "Neg"])
def test_unary_extremes(op, dtype, tmp):
    """Saturating inputs: Sigmoid's exp(-x) overflows to inf and must give the limit 0."""
    x = np.array([-1000, -100, -20, -1, 0, 1, 20, 100, 1000], dtype)
    with np.errstate(over="ignore"):
        ref = np.asarray(UNARY[op][0](x.astype(F64))).astype(dtype)
    check(model([node(op, ["x"])], {"x": x}), {"x": x}, tmp, [ref])


# -------------------------------------------------------------------------------- binary ops
def _trunc_div(a, b):
    if a.dtype.kind == "f":
        return (a.astype(F64) / b).astype(a.dtype)
    return (np.sign(a) * np.sign(b) * (np.abs(a) // np.abs(b))).astype(a.dtype)


BINARY = {
    "Add": lambda a, b: (a.astype(F64) + b).astype(a.dtype),
    "Sub": lambda a, b: (a.astype(F64) - b).astype(a.dtype),
    "Mul": lambda a, b: (a.astype(F64) * b).astype(a.dtype),
    "Div": _trunc_div,  # ONNX integer division truncates toward zero
}
PAIRS = [
    ((2, 3), (2, 3)),  # same shape
    ((), (2, 3)),  # scalar
    ((2, 3), ()),
    ((3,), (2, 3)),  # row
    ((2, 3), (3,)),
    ((2, 1), (2, 3)),  # column
    ((2, 3), (2, 1)),
    ((2, 1), (1, 3)),  # both sides broadcast
    ((4, 1, 3), (2, 3)),  # rank mismatch
    ((2, 3), (4, 1, 1, 3)),
    ((1,), (2, 3)),
    ((), ()),
]


@pytest.mark.parametrize("sa,sb", PAIRS, ids=str)
@pytest.mark.parametrize("dtype", [F32, F64, I64], ids=_id)
@pytest.mark.parametrize("op", sorted(BINARY))
def test_binary(op, dtype, sa, sb, tmp):
    a = arr(sa, dtype, "any", seed=1)
    b = arr(sb, dtype, "nonzero" if op == "Div" else "any", seed=2)
    feeds = {"a": a, "b": b}
    both(model([node(op, ["a", "b"])], feeds), feeds, tmp, [BINARY[op](a, b)])


def test_integer_div_truncates_toward_zero(tmp):
    a = ints(7, -7, 7, -7, 6, -6, 0)
    b = ints(2, 2, -2, -2, 4, 4, 3)
    (got,) = check(model([node("Div", ["a", "b"])], {"a": a, "b": b}), {"a": a, "b": b}, tmp)
    np.testing.assert_array_equal(got, ints(3, -3, -3, 3, 1, -1, 0))


@pytest.mark.parametrize("const_first", [False, True], ids=["x_op_c", "c_op_x"])
@pytest.mark.parametrize("op", sorted(BINARY))
def test_binary_with_constant_operand(op, const_first, tmp):
    """One operand an initializer, on either side (a bias, a scale)."""
    x, c = arr((2, 3), F32, "nonzero", seed=3), arr((3,), F32, "nonzero", seed=4)
    ins, ref = (["c", "x"], BINARY[op](c, x)) if const_first else (["x", "c"], BINARY[op](x, c))
    check(model([node(op, ins)], {"x": x}, {"c": c}), {"x": x}, tmp, [ref])


# --------------------------------------------------------------------- Softmax / LogSoftmax
def _softmax(x, axis, opset, log):
    shape = x.shape
    r = x.ndim
    if opset < 13:  # coerced to 2-D at axis: rows are normalized as a whole
        a = (1 if axis is None else axis) % r
        w, ax = x.astype(F64).reshape(math.prod(shape[:a]), -1), 1
    else:
        w, ax = x.astype(F64), -1 if axis is None else axis
    z = w - w.max(axis=ax, keepdims=True)
    s = np.exp(z).sum(axis=ax, keepdims=True)
    out = z - np.log(s) if log else np.exp(z) / s
    return out.reshape(shape).astype(x.dtype)


SOFTMAX_SHAPES = [((2, 3, 4), a) for a in (None, -3, -2, -1, 0, 1, 2)]
SOFTMAX_SHAPES += [((5,), None), ((5,), 0), ((5,), -1), ((3, 4), None), ((3, 4), 0), ((3, 4), -1)]
# Before opset 13 the default axis is 1, which a rank-1 input does not have
SOFTMAX_CASES = [
    (opset, shape, axis)
    for opset in (11, 13)
    for shape, axis in SOFTMAX_SHAPES
    if not (opset < 13 and axis is None and len(shape) < 2)
]


@pytest.mark.parametrize("opset,shape,axis", SOFTMAX_CASES, ids=str)
@pytest.mark.parametrize("dtype", FLOATS, ids=_id)
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax(op, dtype, opset, shape, axis, tmp):
    x = arr(shape, dtype, seed=4) * 3
    attrs = {} if axis is None else {"axis": axis}
    m = model([node(op, ["x"], **attrs)], {"x": x}, opset=opset)
    both(m, {"x": x}, tmp, [_softmax(x, axis, opset, op == "LogSoftmax")])


@pytest.mark.parametrize("dtype", FLOATS, ids=_id)
@pytest.mark.parametrize("op", ["Softmax", "LogSoftmax"])
def test_softmax_extremes(op, dtype, tmp):
    """Rows far from 0 (exp overflows without the max shift) and a row of equal values."""
    x = np.array([[-1000, 0, 1000], [990, 1000, 1000], [-50, -60, -70], [3, 3, 3]], dtype)
    m = model([node(op, ["x"], axis=-1)], {"x": x})
    check(m, {"x": x}, tmp, [_softmax(x, -1, 13, op == "LogSoftmax")])


# ---------------------------------------------------------------------------------- MatMul
MATMUL_SHAPES = [
    ((3,), (3,)),  # 1-D @ 1-D: a scalar
    ((3,), (3, 2)),  # 1-D left: prepended 1 dropped
    ((2, 3), (3,)),  # 1-D right: appended 1 dropped
    ((2, 3), (3, 4)),
    ((2, 2, 3), (3, 4)),  # batched @ 2-D
    ((2, 3), (2, 3, 4)),  # 2-D @ batched
    ((2, 2, 3), (2, 3, 4)),
    ((1, 2, 3), (2, 3, 4)),  # batch broadcast
    ((2, 1, 2, 3), (3, 3, 2)),  # rank-mismatched batch broadcast
    ((3,), (2, 3, 4)),
    ((2, 3, 4), (4,)),
]


@pytest.mark.parametrize("sa,sb", MATMUL_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", FLOATS, ids=_id)
@pytest.mark.parametrize("b_const", [False, True], ids=["B_input", "B_const"])
def test_matmul(b_const, dtype, sa, sb, tmp):
    """A constant 2-D B with a computed A runs on the engine's packed GEMM tiles."""
    a, b = arr(sa, dtype, seed=5), arr(sb, dtype, seed=6)
    ref = np.matmul(a.astype(F64), b).astype(dtype)
    feeds, consts = ({"a": a}, {"b": b}) if b_const else ({"a": a, "b": b}, {})
    both(model([node("MatMul", ["a", "b"])], feeds, consts), feeds, tmp, [ref])


@pytest.mark.parametrize("M", [1, 63, 64, 65])
@pytest.mark.parametrize("dtype", FLOATS, ids=_id)
def test_matmul_packed_widths(dtype, M, tmp):
    """Packed B on and off the 64-column panel, batched A: rows of all batches at once."""
    a, b = arr((2, 3, 5), dtype, seed=7), arr((5, M), dtype, seed=8)
    m = model([node("Relu", ["a"], ["r"]), node("MatMul", ["r", "b"])], {"a": a}, {"b": b})
    assert load(m, tmp)._matmuls  # the product runs packed
    check(m, {"a": a}, tmp, [np.matmul(np.maximum(a, 0).astype(F64), b).astype(dtype)])


def test_run_times_every_node_it_runs_and_changes_no_output(tmp):
    """GraphModel.run(times=...): each node's wall seconds under "op name", added up over
    runs (benchmarks/bench_load.py --breakdown sets them beside onnxruntime's profile)."""
    a, b = arr((4, 5), F32, seed=7), arr((5, 70), F32, seed=8)
    m = model([node("Relu", ["a"], ["r"], name="relu"), node("MatMul", ["r", "b"], name="mm")],
              {"a": a}, {"b": b})  # fmt: skip
    g = load(m, tmp)
    plain = g.run({"a": a})[0]
    times: dict = {}
    t0 = time.perf_counter()
    timed = g.run({"a": a}, times=times)[0]
    wall = time.perf_counter() - t0
    np.testing.assert_array_equal(timed, plain)
    assert set(times) == {"Relu relu", "MatMul mm"}
    assert all(v > 0 for v in times.values()) and sum(times.values()) <= wall
    once = dict(times)
    g.run({"a": a}, times=times)
    assert all(times[k] > once[k] for k in once)  # a second run adds to the first
    with pytest.raises(DTypeError, match=r"\[GraphModel.run\] times=list; expected a dict"):
        g.run({"a": a}, times=[])  # refused before any node runs; the model stays usable
    np.testing.assert_array_equal(g.run({"a": a})[0], plain)


@pytest.mark.parametrize(
    "sa,sb", [((2, 3), (3, 4)), ((2, 2, 3), (2, 3, 4)), ((3,), (3, 2))], ids=str
)
def test_matmul_int64(sa, sb, tmp):
    a, b = arr(sa, I64, seed=5), arr(sb, I64, seed=6)
    m = model([node("MatMul", ["a", "b"])], {"a": a, "b": b})
    check(m, {"a": a, "b": b}, tmp, [np.matmul(a, b)])


# ------------------------------------------------------------------------------------ Gemm
C_SHAPES = [None, (), (1,), (4,), (1, 4), (2, 1), (2, 4)]


def _gemm(a, b, c, trans_a, trans_b, alpha, beta):
    a = a.T if trans_a else a
    b = b.T if trans_b else b
    y = alpha * (a.astype(F64) @ b)
    if c is not None:
        y = y + beta * c.astype(F64)
    return y.astype(a.dtype)


def _gemm_case(dtype, trans_a, trans_b, alpha, beta, c_shape, b_const, tmp):
    a = arr((3, 2) if trans_a else (2, 3), dtype, seed=9)
    b = arr((4, 3) if trans_b else (3, 4), dtype, seed=10)
    c = None if c_shape is None else arr(c_shape, dtype, seed=11)
    feeds, consts = {"a": a}, {}
    (consts if b_const else feeds)["b"] = b
    ins = ["a", "b"]
    if c is not None:
        feeds["c"] = c
        ins.append("c")
    attrs = {"transA": trans_a, "transB": trans_b, "alpha": alpha, "beta": beta}
    m = model([node("Gemm", ins, **attrs)], feeds, consts)
    both(m, feeds, tmp, [_gemm(a, b, c, trans_a, trans_b, alpha, beta)])


@pytest.mark.parametrize("c_shape", C_SHAPES, ids=str)
@pytest.mark.parametrize("alpha,beta", [(1.0, 1.0), (0.5, 2.0), (2.0, 0.0)], ids=str)
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("trans_a", [0, 1])
def test_gemm(trans_a, trans_b, alpha, beta, c_shape, tmp):
    _gemm_case(F32, trans_a, trans_b, alpha, beta, c_shape, False, tmp)


@pytest.mark.parametrize("c_shape", [None, (4,), (2, 4)], ids=str)
@pytest.mark.parametrize("trans_b", [0, 1])
@pytest.mark.parametrize("trans_a", [0, 1])
@pytest.mark.parametrize("dtype", FLOATS, ids=_id)
def test_gemm_constant_b(dtype, trans_a, trans_b, c_shape, tmp):
    """A constant B (packed when transA = 0), float32 and float64."""
    _gemm_case(dtype, trans_a, trans_b, 0.5, 2.0, c_shape, True, tmp)


# ---------------------------------------------------------------------------------- Gather
GATHER_INDICES = {
    "scalar": np.array(1),
    "scalar_neg": np.array(-1),
    "1d_neg": ints(1, -2, 0),
    "2d_neg": ints(0, -1, 1, -2).reshape(2, 2),
}
GATHER_AXES = [((3, 4), a) for a in (-2, -1, 0, 1)] + [((2, 3, 4), a) for a in range(-3, 3)]


@pytest.mark.parametrize("idx", sorted(GATHER_INDICES))
@pytest.mark.parametrize("shape,axis", GATHER_AXES, ids=str)
def test_gather(shape, axis, idx, tmp):
    data, i = arr(shape, F32, seed=12), GATHER_INDICES[idx].astype(I64)
    feeds = {"data": data, "i": i}
    m = model([node("Gather", ["data", "i"], axis=axis)], feeds)
    both(m, feeds, tmp, [np.take(data, i, axis=axis)])


@pytest.mark.parametrize(
    "data_dtype,idx_dtype", [(F64, I64), (I64, I64), (F32, I32), (I64, I32)], ids=str
)
def test_gather_dtypes(data_dtype, idx_dtype, tmp):
    data, i = arr((3, 4), data_dtype, seed=13), ints(2, -1, 0, -3, dtype=idx_dtype).reshape(2, 2)
    feeds = {"data": data, "i": i}
    m = model([node("Gather", ["data", "i"], axis=0)], feeds)
    both(m, feeds, tmp, [np.take(data, i, axis=0)])


def test_gather_embedding(tmp):
    """The embedding case: a constant table, token ids (negative ones too) fed at run."""
    table, ids = arr((5, 3), F32, seed=14), ints(0, 4, -1, 2, -5, 1).reshape(2, 3)
    m = model([node("Gather", ["table", "ids"])], {"ids": ids}, {"table": table})
    check(m, {"ids": ids}, tmp, [table[ids]])


# ------------------------------------------------------------------------------- Transpose
TRANSPOSE_CASES = [
    ((2, 3, 4), p) for p in (None, [0, 1, 2], [0, 2, 1], [1, 0, 2], [1, 2, 0], [2, 0, 1], [2, 1, 0])
]
TRANSPOSE_CASES += [
    ((2, 1, 3), [1, 0, 2]),  # moves only a size-1 axis: a view
    ((2, 1, 3), [2, 1, 0]),
    ((1, 2, 1, 3), [1, 0, 3, 2]),
    ((3,), None),
    ((), None),
]


@pytest.mark.parametrize("shape,perm", TRANSPOSE_CASES, ids=str)
@pytest.mark.parametrize("dtype", [F32, I64], ids=_id)
def test_transpose(dtype, shape, perm, tmp):
    x = arr(shape, dtype, seed=15)
    attrs = {} if perm is None else {"perm": perm}
    both(
        model([node("Transpose", ["x"], **attrs)], {"x": x}), {"x": x}, tmp, [np.transpose(x, perm)]
    )


# ------------------------------------------------------------------ Squeeze / Unsqueeze
def _axes_node(op, axes, opset):
    """``op`` with axes as an attribute (opset < 13) or as a constant input (opset >= 13)."""
    if axes is None:
        return node(op, ["x"]), {}
    if opset < 13:
        return node(op, ["x"], axes=axes), {}
    return node(op, ["x", "axes"]), {"axes": np.array(axes, I64)}


@pytest.mark.parametrize(
    "shape,axes",
    [((1, 3, 1), a) for a in (None, [0], [-1], [0, 2], [2, -3], [-1, 0])]
    + [((1, 1), None), ((1,), [0])],
    ids=str,
)
@pytest.mark.parametrize("opset", [11, 12, 13, 21])
def test_squeeze(opset, shape, axes, tmp):
    x = arr(shape, F32, seed=16)
    n, consts = _axes_node("Squeeze", axes, opset)
    m = model([n], {"x": x}, consts, opset=opset)
    both(m, {"x": x}, tmp, [np.squeeze(x, None if axes is None else tuple(axes))])


@pytest.mark.parametrize(
    "shape,axes",
    [
        ((2, 3), a)
        for a in ([0], [1], [2], [-1], [-3], [0, 3], [3, 0], [2, 0], [-2, 0], [-1, -4], [1, -2])
    ]
    + [((), [0]), ((), [-1, 0])],
    ids=str,
)
@pytest.mark.parametrize("opset", [11, 12, 13, 21])
def test_unsqueeze(opset, shape, axes, tmp):
    x = arr(shape, F32, seed=17)
    n, consts = _axes_node("Unsqueeze", axes, opset)
    m = model([n], {"x": x}, consts, opset=opset)
    both(m, {"x": x}, tmp, [np.expand_dims(x, tuple(axes))])


# --------------------------------------------------------------------- Reshape / Flatten
RESHAPES = [
    ((2, 3, 4), [0, -1]),
    ((2, 3, 4), [-1]),
    ((2, 3, 4), [4, 0, 2]),  # 0 copies the input's dim 1
    ((2, 3, 4), [2, -1, 2]),
    ((2, 3, 4), [0, 0, -1]),
    ((2, 3, 4), [24]),
    ((2, 3, 4), [1, -1, 1, 2]),
    ((2, 3, 4), [-1, 4]),
    ((2, 3, 4), [0, 3, 2, 2]),
    ((1, 1), []),  # to a scalar
    ((), [1]),
    ((), [-1]),
]


@pytest.mark.parametrize("shape,target", RESHAPES, ids=str)
@pytest.mark.parametrize("opset", [13, 14])
def test_reshape(opset, shape, target, tmp):
    x = arr(shape, F32, seed=18)
    want = [shape[i] if d == 0 else d for i, d in enumerate(target)]
    m = model(
        [node("Reshape", ["x", "shape"])], {"x": x}, {"shape": np.array(target, I64)}, opset=opset
    )
    both(m, {"x": x}, tmp, [x.reshape(want)])


def test_reshape_allowzero(tmp):
    """allowzero=1 (opset 14): a 0 in the shape is a real 0, not a copy of the input's dim."""
    x = np.zeros((0, 3), F32)
    m = model(
        [node("Reshape", ["x", "shape"], allowzero=1)], {"x": x}, {"shape": ints(3, 0)}, opset=14
    )
    (got,) = check(m, {"x": x}, tmp)
    assert got.shape == (3, 0)


def test_reshape_shape_fed_as_input_fails_clearly(tmp):
    """A target shape that depends on input values cannot be planned: a clear error."""
    x, s = arr((2, 3), F32), ints(3, 2)
    m = model(
        [node("Reshape", ["x", "s"], name="reshape_by_value")], {"x": x, "s": s}, out_dtypes=[F32]
    )
    _fails(m, {"x": x, "s": s}, tmp, "reshape_by_value")


@pytest.mark.parametrize(
    "shape,axis",
    [((2, 3, 4), a) for a in (None, -3, -2, -1, 0, 1, 2, 3)] + [((5,), 0), ((5,), 1), ((5,), -1)],
    ids=str,
)
def test_flatten(shape, axis, tmp):
    x = arr(shape, F32, seed=19)
    a = 1 if axis is None else axis + len(shape) if axis < 0 else axis
    attrs = {} if axis is None else {"axis": axis}
    ref = x.reshape(math.prod(shape[:a]), -1)
    both(model([node("Flatten", ["x"], **attrs)], {"x": x}), {"x": x}, tmp, [ref])


# --------------------------------------------------------------------- Identity / Dropout
DROPOUTS = {
    # opset: (node inputs, attrs, consts, with mask)
    "opset7": (7, ["x"], {"ratio": 0.3}, {}, False),
    "opset10_mask": (10, ["x"], {"ratio": 0.3}, {}, True),
    "opset12_ratio_input": (12, ["x", "r"], {}, {"r": np.array(0.3, F32)}, False),
    "opset13_training_false_mask": (
        13,
        ["x", "r", "t"],
        {},
        {"r": np.array(0.3, F32), "t": np.array(False)},
        True,
    ),
    "opset13_no_ratio": (13, ["x", "", "t"], {}, {"t": np.array(False)}, True),
}


@pytest.mark.parametrize("case", sorted(DROPOUTS))
@pytest.mark.parametrize("dtype", FLOATS, ids=_id)
def test_dropout_inference(case, dtype, tmp):
    """Inference-mode Dropout passes x through; its mask (when asked for) is all True."""
    opset, ins, attrs, consts, mask = DROPOUTS[case]
    x = arr((2, 3), dtype, seed=20)
    outs = ["y", "mask"] if mask else ["y"]
    m = model([node("Dropout", ins, outs, **attrs)], {"x": x}, consts, opset=opset)
    expected = [x, np.ones((2, 3), bool)] if mask else [x]
    # onnxruntime's Dropout-7/10 kernel returns an all-False mask in inference; ONNX's own
    # reference evaluator (onnx.reference) and opset 12+ return all True, as leanrnn does
    both(m, {"x": x}, tmp, expected, with_ort=not (mask and opset < 12))


@pytest.mark.parametrize("training", ["true", "fed"])
def test_dropout_training_mode_fails_clearly(training, tmp):
    x = arr((2, 3), F32)
    feeds, consts = {"x": x}, {"r": np.array(0.3, F32)}
    if training == "true":
        consts["t"] = np.array(True)
    else:
        feeds["t"] = np.array(False)
    m = model(
        [node("Dropout", ["x", "r", "t"], name="drop_train")], feeds, consts, out_dtypes=[F32]
    )
    _fails(m, feeds, tmp, "drop_train")


# ---------------------------------------------------------------------------------- Concat
@pytest.mark.parametrize("axis", [-3, -2, -1, 0, 1, 2])
@pytest.mark.parametrize("dtype", [F32, F64, I64], ids=_id)
def test_concat_three(dtype, axis, tmp):
    parts = []
    for k, n in enumerate((1, 2, 3)):
        shape = [2, 3, 4]
        shape[axis] = n
        parts.append(arr(tuple(shape), dtype, seed=21 + k))
    feeds = dict(zip("abc", parts, strict=True))
    m = model([node("Concat", ["a", "b", "c"], axis=axis)], feeds)
    both(m, feeds, tmp, [np.concatenate(parts, axis=axis)])


@pytest.mark.parametrize("axis", [0, -1])
def test_concat_with_constant_and_1d(axis, tmp):
    a, c = arr((3,), F32, seed=24), arr((2,), F32, seed=25)
    m = model([node("Concat", ["a", "c", "a"], axis=axis)], {"a": a}, {"c": c})
    check(m, {"a": a}, tmp, [np.concatenate([a, c, a])])


# ----------------------------------------------------------------------------------- Slice
SLICES = {
    # name: (starts, ends, axes, steps)
    "axis0": ([1], [3], [0], None),
    "axes_omitted": ([1], [3], None, None),
    "neg_start_end": ([-3], [-1], [1], [1]),
    "end_clamped": ([2], [1000], [1], [1]),
    "end_int_max": ([1], [INT_MAX], [1], None),
    "start_clamped": ([-1000], [2], [0], [1]),
    "reverse_axis": ([-1], [-1000], [1], [-1]),
    "reverse_int_extremes": ([INT_MAX], [INT_MIN], [0], [-1]),
    "neg_step_2": ([4], [0], [1], [-2]),
    "neg_step_to_start": ([3], [-6], [1], [-2]),
    "two_axes_steps": ([0, 1], [3, 5], [0, 1], [2, 2]),
    "neg_axes": ([1, 0], [-1, 4], [-1, -2], [2, 1]),
    "step_3": ([1], [5], [1], [3]),
    "empty": ([3], [1], [0], [1]),
    "empty_neg_step": ([0], [5], [1], [-3]),
}


@pytest.mark.parametrize(
    "opset,idx_dtype", [(13, I64), (13, I32), (10, I64)], ids=["13-int64", "13-int32", "10-int64"]
)
@pytest.mark.parametrize("case", sorted(SLICES))
def test_slice_inputs(case, opset, idx_dtype, tmp):
    """Opset 10+ form: starts, ends, axes, steps as inputs (axes/steps optional)."""
    starts, ends, axes, steps = SLICES[case]
    x = arr((4, 5), F32, seed=26)
    consts = {"s": starts, "e": ends}
    if idx_dtype == I32:
        clip = np.iinfo(I32)
        consts = {k: np.clip(v, clip.min, clip.max) for k, v in consts.items()}
    consts = {k: np.array(v, idx_dtype) for k, v in consts.items()}
    ins = ["x", "s", "e"]
    if axes is not None or steps is not None:
        ins.append("a" if axes is not None else "")
        if axes is not None:
            consts["a"] = np.array(axes, idx_dtype)
    if steps is not None:
        ins.append("t")
        consts["t"] = np.array(steps, idx_dtype)
    sl = [slice(None)] * 2
    for k, (s, e) in enumerate(zip(starts, ends, strict=True)):
        a = k if axes is None else axes[k]
        st = 1 if steps is None else steps[k]
        n = x.shape[a]
        sl[a] = slice(*slice(s, e, st).indices(n))
        if st < 0 and sl[a].stop < 0:
            sl[a] = slice(sl[a].start, None, st)
    m = model([node("Slice", ins)], {"x": x}, consts, opset=opset)
    both(m, {"x": x}, tmp, [x[tuple(sl)]])


@pytest.mark.parametrize(
    "case", ["axis0", "axes_omitted", "neg_start_end", "end_clamped", "start_clamped", "empty"]
)
def test_slice_attributes(case, tmp):
    """Opset 1-9 form: starts, ends, axes as attributes, no steps."""
    starts, ends, axes, _ = SLICES[case]
    x = arr((4, 5), F32, seed=27)
    attrs = {"starts": starts, "ends": ends}
    if axes is not None:
        attrs["axes"] = axes
    sl = [slice(None)] * 2
    for k, (s, e) in enumerate(zip(starts, ends, strict=True)):
        sl[k if axes is None else axes[k]] = slice(s, e)
    m = model([node("Slice", ["x"], **attrs)], {"x": x}, opset=9)
    both(m, {"x": x}, tmp, [x[tuple(sl)]])


# ----------------------------------------------------------------------------------- Split
SPLITS = {
    # name: (opset, shape, axis, split sizes (None: equal), form, outputs)
    "attr_opset11": (11, (3, 4), 0, [1, 2], "attr", 2),
    "attr_neg_axis": (11, (3, 4), -1, [1, 3], "attr", 2),
    "attr_equal": (12, (3, 4), 1, None, "attr", 2),
    "input_opset13": (13, (3, 4), 1, [1, 2, 1], "input", 3),
    "input_equal": (13, (4, 6), 1, None, "input", 3),
    "input_zero_part": (13, (3, 4), 0, [0, 3], "input", 2),
    "input_opset18": (18, (3, 4), -2, [2, 1], "input", 2),
    "num_outputs_even": (18, (3, 4), 1, None, "num_outputs", 2),
    "num_outputs_uneven": (18, (2, 7), 1, None, "num_outputs", 3),
    "num_outputs_4_of_7": (18, (7,), 0, None, "num_outputs", 4),
    **{f"every_axis_{a}": (13, (2, 4, 6), a, None, "input", 2) for a in range(-3, 3)},
}


@pytest.mark.parametrize("case", sorted(SPLITS))
def test_split(case, tmp):
    opset, shape, axis, sizes, form, k = SPLITS[case]
    x = arr(shape, F32, seed=28)
    outs = [f"y{i}" for i in range(k)]
    consts, attrs, ins = {}, {"axis": axis}, ["x"]
    if form == "num_outputs":
        attrs["num_outputs"] = k
    elif sizes is not None and form == "attr":
        attrs["split"] = sizes
    elif sizes is not None:
        ins.append("split")
        consts["split"] = np.array(sizes, I64)
    n = shape[axis]
    if sizes is None:
        q = -(-n // k)
        sizes = [q] * (k - 1) + [n - q * (k - 1)]
    ref = np.split(x, np.cumsum(sizes)[:-1], axis=axis)
    m = model([node("Split", ins, outs, **attrs)], {"x": x}, consts, opset=opset)
    both(m, {"x": x}, tmp, ref)


# ---------------------------------------------------------------------------------- Expand
EXPANDS = [
    ((3, 1), [2, 1, 4]),
    ((3,), [2, 3]),
    ((3, 1), [1]),  # a smaller target: the result keeps the input's shape
    ((3, 1), [3, 1]),
    ((1,), []),
    ((2, 1), [1, 3]),  # bidirectional: the target's 1 takes the input's 2
    ((), [2, 2]),
    ((1, 3), [2, 1, 1]),
]


@pytest.mark.parametrize("shape,target", EXPANDS, ids=str)
@pytest.mark.parametrize("dtype", [F32, F64, I64], ids=_id)
def test_expand(dtype, shape, target, tmp):
    x = arr(shape, dtype, seed=29)
    ref = x * np.ones(target, dtype)
    m = model([node("Expand", ["x", "shape"])], {"x": x}, {"shape": np.array(target, I64)})
    both(m, {"x": x}, tmp, [ref])


# ------------------------------------------------------------------------ Shape / Cast / ...
@pytest.mark.parametrize("shape", [(), (3,), (2, 3, 4)], ids=str)
def test_shape(shape, tmp):
    x = arr(shape, F32)
    both(model([node("Shape", ["x"])], {"x": x}), {"x": x}, tmp, [np.array(shape, I64)])


@pytest.mark.parametrize(
    "start,end",
    [(0, None), (1, None), (-1, None), (0, -1), (-10, 10), (2, 1), (1, 2), (None, -2)],
    ids=str,
)
def test_shape_start_end(start, end, tmp):
    """Opset 15's start/end attributes: negative, clamped, empty."""
    x = arr((2, 3, 4), F32)
    attrs = {k: v for k, v in (("start", start), ("end", end)) if v is not None}
    ref = np.array((2, 3, 4)[slice(start, end)], I64)
    both(model([node("Shape", ["x"], **attrs)], {"x": x}, opset=15), {"x": x}, tmp, [ref])


COS_VALUES = {
    "default": None,
    "float32": np.array([2.5], F32),
    "float64": np.array([-1.25], F64),
    "int64": np.array([7], I64),
    "int32": np.array([-3], I32),
    "bool": np.array([True]),
}


@pytest.mark.parametrize("target", [[2, 3], [3], []], ids=str)
@pytest.mark.parametrize("value", sorted(COS_VALUES))
@pytest.mark.parametrize("source", ["constant", "shape_of_input"])
def test_constant_of_shape(source, value, target, tmp):
    """ConstantOfShape with and without value, its shape a constant (folded at load) or the
    Shape of an input (evaluated at plan time, as exporters' zero initial states are)."""
    v = COS_VALUES[value]
    attrs = {} if v is None else {"value": onnx.numpy_helper.from_array(v, "value")}
    ref = np.full(target, 0.0 if v is None else v[0], F32 if v is None else v.dtype)
    if source == "constant":
        x = arr((1,), F32)
        nodes = [node("ConstantOfShape", ["s"], **attrs), node("Identity", ["x"], ["xo"])]
        m = model(nodes, {"x": x}, {"s": np.array(target, I64)}, outputs=["y", "xo"])
        check(m, {"x": x}, tmp, [ref, x])
    else:
        x = arr(tuple(target), F32)
        nodes = [node("Shape", ["x"], ["s"]), node("ConstantOfShape", ["s"], **attrs)]
        check(model(nodes, {"x": x}), {"x": x}, tmp, [ref])


CAST_TYPES = [F32, F64, I64, I32, np.bool_]


@pytest.mark.parametrize("to", CAST_TYPES, ids=_id)
@pytest.mark.parametrize("src", CAST_TYPES, ids=_id)
def test_cast(src, to, tmp):
    """Casts between float32/float64/int64 (and int32, bool): float -> int truncates toward
    zero, anything -> bool is 'nonzero'."""
    if np.dtype(src).kind == "f":
        x = np.array([-2.75, -1, -0.5, 0, 0.5, 1.5, 3.25], src)
    elif src is np.bool_:
        x = np.array([True, False, True])
    else:
        x = np.array([-3, -1, 0, 1, 2, 5], src)
    m = model([node("Cast", ["x"], to=onnx_type(to))], {"x": x})
    both(m, {"x": x}, tmp, [x.astype(to)])


# leanrnn's Cast lets numpy's overflow RuntimeWarning through (onnxruntime is silent)
@pytest.mark.filterwarnings("ignore:overflow encountered in cast:RuntimeWarning")
def test_cast_rounds_float64_to_nearest_float32(tmp):
    x = np.array([1 + 2**-30, 1 / 3, -1e-40, 3.4e38, 1e300], F64)
    with np.errstate(over="ignore"):
        ref = x.astype(F32)
    check(model([node("Cast", ["x"], to=TensorProto.FLOAT)], {"x": x}), {"x": x}, tmp, [ref])


CONSTANTS = {
    "value": ({"value": onnx.numpy_helper.from_array(arr((2, 3), F32, seed=30), "v")}, F32),
    "value_float": ({"value_float": 1.5}, F32),
    "value_floats": ({"value_floats": [1.0, -2.0, 0.5]}, F32),
    "value_int": ({"value_int": -4}, I64),
    "value_ints": ({"value_ints": [3, -1, 2]}, I64),
}


@pytest.mark.parametrize("form", sorted(CONSTANTS))
def test_constant(form, tmp):
    """Constant's value forms, added to an input and also returned directly."""
    attrs, dtype = CONSTANTS[form]
    x = arr((2, 3), dtype, seed=31)
    nodes = [node("Constant", [], ["k"], **attrs), node("Add", ["x", "k"])]
    check(model(nodes, {"x": x}, outputs=["y", "k"]), {"x": x}, tmp)


# ------------------------------------------------------------------------ zero-size tensors
def _z(*shape, dtype=F32):
    return np.ones(shape, dtype)


ZERO_SIZE = {
    # name: (node, feeds, consts, opset)
    "add": (node("Add", ["a", "b"]), {"a": _z(0, 3), "b": _z(3)}, {}, 13),
    "relu": (node("Relu", ["a"]), {"a": _z(2, 0)}, {}, 13),
    "concat_empty_part": (
        node("Concat", ["a", "b"], axis=0),
        {"a": _z(0, 3), "b": _z(2, 3)},
        {},
        13,
    ),
    "transpose": (node("Transpose", ["a"]), {"a": _z(0, 3)}, {}, 13),
    "reshape_minus1": (node("Reshape", ["a", "s"]), {"a": _z(0, 3)}, {"s": ints(-1)}, 13),
    "flatten": (node("Flatten", ["a"], axis=0), {"a": _z(0, 3)}, {}, 13),
    "slice_of_empty": (
        node("Slice", ["a", "s", "e", "x", "t"]),
        {"a": _z(0, 3)},
        {"s": ints(-1), "e": ints(-10), "x": ints(0), "t": ints(-1)},
        13,
    ),
    "gather_empty_indices": (node("Gather", ["a", "i"]), {"a": _z(3, 2), "i": ints()}, {}, 13),
    "gather_empty_axis": (node("Gather", ["a", "i"], axis=1), {"a": _z(3, 0), "i": ints()}, {}, 13),
    "expand_to_0": (node("Expand", ["a", "s"]), {"a": _z(1, 3)}, {"s": ints(0, 3)}, 13),
    "split_zero_parts": (
        node("Split", ["a", "s"], ["y0", "y1"]),
        {"a": _z(0, 2)},
        {"s": ints(0, 0)},
        13,
    ),
    "matmul_M0": (node("MatMul", ["a", "b"]), {"a": _z(0, 3), "b": _z(3, 2)}, {}, 13),
    "matmul_M0_const_b": (node("MatMul", ["a", "b"]), {"a": _z(0, 3)}, {"b": _z(3, 2)}, 13),
    "matmul_K0_batched": (node("MatMul", ["a", "b"]), {"a": _z(2, 2, 0), "b": _z(2, 0, 3)}, {}, 13),
    "matmul_K0": (node("MatMul", ["a", "b"]), {"a": _z(2, 0), "b": _z(0, 3)}, {}, 13),
    "matmul_N0": (node("MatMul", ["a", "b"]), {"a": _z(2, 3), "b": _z(3, 0)}, {}, 13),
    "matmul_K0_const_b": (node("MatMul", ["a", "b"]), {"a": _z(2, 0)}, {"b": _z(0, 2)}, 13),
    "gemm_K0": (node("Gemm", ["a", "b", "c"]), {"a": _z(2, 0), "b": _z(0, 3), "c": _z(3)}, {}, 13),
    "gemm_M0_const_b": (node("Gemm", ["a", "b"]), {"a": _z(0, 3)}, {"b": _z(3, 2)}, 13),
    "softmax_rows_of_0": (node("Softmax", ["a"], axis=-1), {"a": _z(0, 3)}, {}, 13),
    "softmax_empty_axis": (node("Softmax", ["a"], axis=0), {"a": _z(0, 3)}, {}, 13),
    "logsoftmax_empty_axis": (node("LogSoftmax", ["a"], axis=0), {"a": _z(0, 3)}, {}, 13),
    "softmax11_empty_rows": (node("Softmax", ["a"]), {"a": _z(3, 0)}, {}, 11),
}


@pytest.mark.parametrize("case", list(ZERO_SIZE))
def test_zero_size(case, tmp):
    """Tensors with a 0 dim (an empty batch, a zero-length slice) give empty or zero outputs,
    as in onnxruntime."""
    n, feeds, consts, opset = ZERO_SIZE[case]
    check(model([n], feeds, consts, opset=opset), feeds, tmp, fold=True)


# ------------------------------------------------------------------------- few-node graphs
def test_exporter_shape_chain(tmp):
    """Shape -> Gather -> Unsqueeze -> Concat -> Reshape, the flatten exporters emit; and a
    zero initial state sized from the input's batch dim by ConstantOfShape."""
    x = arr((2, 3, 4), F32, seed=32)
    nodes = [
        node("Shape", ["x"], ["s"], name="shape"),
        node("Gather", ["s", "zero"], ["n"], name="batch", axis=0),
        node("Unsqueeze", ["n", "ax0"], ["n1"], name="unsq"),
        node("Concat", ["n1", "minus1"], ["target"], name="cat", axis=0),
        node("Reshape", ["x", "target"], ["flat"], name="reshape"),
        node("Concat", ["n1", "four"], ["hs"], name="cat_h", axis=0),
        node("ConstantOfShape", ["hs"], ["h0"], name="zeros"),
        node("Gather", ["s", "last"], ["c"], name="last_dim", axis=0),
    ]
    consts = {
        "zero": np.array(0, I64),
        "ax0": ints(0),
        "minus1": ints(-1),
        "four": ints(4),
        "last": np.array(-1, I64),
    }
    m = model(nodes, {"x": x}, consts, outputs=["flat", "h0", "c", "target"])
    check(
        m, {"x": x}, tmp, [x.reshape(2, 12), np.zeros((2, 4), F32), np.array(4, I64), ints(2, -1)]
    )


X234 = np.arange(24, dtype=F32).reshape(2, 3, 4) / 10
N = node
FEW_NODE = {
    # name: (nodes, feeds, consts, outputs (None: the last node's))
    "shape_slice_concat_reshape": (
        [N("Shape", ["x"], ["s"], "n1"), N("Slice", ["s", "a", "b"], ["t"], "n2"),
         N("Concat", ["m1", "t"], ["u"], "n3", axis=0), N("Reshape", ["x", "u"], ["y"], "n4")],
        {"x": X234}, {"a": ints(-1), "b": ints(1000), "m1": ints(-1)}, None,
    ),
    "shape_cast_mul_cast_constantofshape": (
        [N("Shape", ["x"], ["s"], "n1"), N("Cast", ["s"], ["sf"], "n2", to=TensorProto.FLOAT),
         N("Mul", ["sf", "h"], ["m"], "n3"), N("Cast", ["m"], ["si"], "n4", to=TensorProto.INT64),
         N("ConstantOfShape", ["si"], ["y"], "n5")],
        {"x": X234}, {"h": np.array(0.5, F32)}, None,
    ),
    "shape_div_gather_unsqueeze_reshape": (
        [N("Shape", ["x"], ["s"], "n1"), N("Div", ["s", "two"], ["d"], "n2"),
         N("Gather", ["d", "i0"], ["g"], "n3"), N("Unsqueeze", ["g", "ax"], ["gu"], "n4"),
         N("Concat", ["gu", "m1"], ["u"], "n5", axis=0), N("Reshape", ["x", "u"], ["y"], "n6")],
        {"x": X234}, {"two": np.array(2), "i0": np.array(0), "ax": ints(0), "m1": ints(-1)}, None,
    ),
    "shape_gather_perm_reshape": (
        [N("Shape", ["x"], ["s"], "n1"), N("Gather", ["s", "p"], ["t"], "n2"),
         N("Reshape", ["x", "t"], ["y"], "n3")],
        {"x": X234}, {"p": ints(2, -2, 0)}, None,
    ),
    "shape_expand_constant": (
        [N("Shape", ["x"], ["s"], "n1"), N("Expand", ["c", "s"], ["y"], "n2")],
        {"x": X234}, {"c": np.array(1.5, F32)}, None,
    ),
    "shape_value_added_to_data": (
        [N("Shape", ["x"], ["s"], "n1"), N("Cast", ["s"], ["sf"], "n2", to=TensorProto.FLOAT),
         N("Add", ["sf", "v"], ["y"], "n3")],
        {"x": X234, "v": np.ones(3, F32)}, {}, None,
    ),
    "split_one_output_used": (
        [N("Split", ["x", "sp"], ["y0", "y1"], "n1", axis=2)], {"x": X234}, {"sp": ints(1, 3)},
        ["y1"],
    ),
    "split_then_concat": (
        [N("Exp", ["x"], ["e"], "n0"), N("Split", ["e", "sp"], ["y0", "y1"], "n1", axis=2),
         N("Neg", ["y0"], ["a"], "n2"), N("Concat", ["y1", "a", "y0"], ["y"], "n3", axis=2)],
        {"x": X234}, {"sp": ints(1, 3)}, None,
    ),
    "outputs_input_and_initializer": (
        [N("Relu", ["x"], ["y"], "n1")], {"x": X234}, {"c": np.ones(2, F32)}, ["y", "x", "c"],
    ),
    "view_of_computed_and_its_source": (
        [N("Exp", ["x"], ["e"], "n1"), N("Expand", ["e", "sh"], ["y"], "n2"),
         N("Cast", ["e"], ["z"], "n3", to=TensorProto.FLOAT)],
        {"x": X234}, {"sh": ints(2, 3, 4)}, ["y", "e", "z"],
    ),
    "in_place_op_on_a_view": (
        [N("Exp", ["x"], ["e"], "n1"), N("Reshape", ["e", "sh"], ["r"], "n2"),
         N("Neg", ["r"], ["z"], "n3"), N("Add", ["e", "e"], ["w"], "n4")],
        {"x": X234}, {"sh": ints(-1)}, ["z", "w"],
    ),
    "softmax_input_read_after": (
        [N("Exp", ["x"], ["e"], "n1"), N("Softmax", ["e"], ["s"], "n2"),
         N("Sub", ["e", "s"], ["y"], "n3")],
        {"x": X234}, {}, None,
    ),
    "gemm_packed_transb_then_relu": (
        [N("Exp", ["x"], ["e"], "n0"), N("Gemm", ["e", "w", "b"], ["g"], "n1", transB=1),
         N("Relu", ["g"], ["y"], "n2")],
        {"x": X234.reshape(6, 4)}, {"w": arr((70, 4), seed=40), "b": arr((70,), seed=41)}, None,
    ),
    "matmul_packed_then_in_place_add": (
        [N("Exp", ["x"], ["e"], "n0"), N("MatMul", ["e", "w"], ["g"], "n1"),
         N("Add", ["g", "g"], ["y"], "n2")],
        {"x": X234}, {"w": arr((4, 65), seed=42)}, None,
    ),
    "embedding_then_matmul": (
        [N("Gather", ["t", "ids"], ["e"], "n0"), N("MatMul", ["e", "w"], ["y"], "n1")],
        {"ids": ints(0, 2, 1, -1).reshape(2, 2)}, {"t": arr((3, 4), seed=43), "w": arr((4, 3))},
        None,
    ),
    "transpose_then_packed_matmul": (
        [N("Transpose", ["x"], ["t"], "n0", perm=[0, 2, 1]), N("MatMul", ["t", "w"], ["y"], "n1")],
        {"x": X234}, {"w": arr((3, 5), seed=44)}, None,
    ),
    "slice_then_packed_matmul": (
        [N("Slice", ["x", "a", "b", "c"], ["t"], "n0"), N("MatMul", ["t", "w"], ["y"], "n1")],
        {"x": X234}, {"a": ints(1), "b": ints(3), "c": ints(2), "w": arr((2, 5), seed=45)}, None,
    ),
    "1d_into_packed_matmul": (
        [N("Relu", ["v"], ["r"], "n0"), N("MatMul", ["r", "w"], ["y"], "n1")],
        {"v": arr((4,), seed=46)}, {"w": arr((4, 70), seed=47)}, None,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(FEW_NODE))
def test_few_node_graphs(case, tmp):
    """Shape arithmetic evaluated at plan time, outputs that are inputs, constants or views of
    one another, ops that overwrite their input in place, packed products fed by view ops."""
    nodes, feeds, consts, outputs = FEW_NODE[case]
    check(model(nodes, feeds, consts, outputs=outputs), feeds, tmp)


@pytest.mark.parametrize(
    "op,ins,attrs,consts",
    [
        ("Identity", ["x"], {}, {}),
        ("Dropout", ["x"], {}, {}),
        ("Reshape", ["x", "s"], {}, {"s": ints(-1)}),
        ("Flatten", ["x"], {}, {}),
        ("Squeeze", ["x", "a"], {}, {"a": ints(0)}),
        ("Unsqueeze", ["x", "a"], {}, {"a": ints(0)}),
        ("Transpose", ["x"], {"perm": [1, 0, 2]}, {}),  # moves a size-1 axis only: a view
        ("Cast", ["x"], {"to": TensorProto.FLOAT}, {}),  # to its own dtype: a view
        ("Expand", ["x", "s"], {}, {"s": ints(1, 3)}),  # to its own shape: a view
    ],
    ids=lambda v: v if isinstance(v, str) else "",
)
def test_view_outputs_never_alias_inputs(op, ins, attrs, consts, tmp):
    """Ops that move no data still hand the caller its own array, not the caller's input."""
    x = arr((1, 2, 3), F32, seed=48)
    keep = x.copy()
    g = load(model([node(op, ins, **attrs)], {"x": x}, consts), tmp)
    (y,) = g.run({"x": x})
    assert not np.shares_memory(y, x)
    y[...] = 7
    np.testing.assert_array_equal(x, keep)


def test_elementwise_chain_in_place(tmp):
    """Elementwise ops may overwrite an input nothing reads later; one read later must not be."""
    x, b = arr((2, 3), F32, seed=33), arr((3,), F32, seed=34)
    nodes = [
        node("Exp", ["x"], ["e"], name="exp"),
        node("Neg", ["e"], ["ne"], name="neg"),  # e is read again below: not in place
        node("Add", ["e", "ne"], ["z"], name="add"),  # 0, overwriting e or ne
        node("Add", ["z", "b"], ["zb"], name="bias"),
        node("Mul", ["zb", "e"], ["p"], name="mul"),  # e read after z was computed
        node("Tanh", ["p"], ["t"], name="tanh"),
        node("Softmax", ["t"], ["s"], name="softmax", axis=-1),
        node("Sub", ["s", "s"], ["zero"], name="sub_self"),
        node("Add", ["zero", "t"], ["y"], name="out"),
    ]
    e = np.exp(x.astype(F64))
    ref = np.tanh(b.astype(F64) * e).astype(F32)
    check(model(nodes, {"x": x, "b": b}), {"x": x, "b": b}, tmp, [ref])


def test_outputs_are_fresh_and_independent(tmp):
    """An output, a view of it and an op of it, all graph outputs: three separate arrays, and
    a second run leaves the first run's arrays alone."""
    x = arr((2, 3), F32, seed=35)
    nodes = [
        node("Exp", ["x"], ["e"], name="exp"),
        node("Identity", ["e"], ["i"], name="ident"),
        node("Reshape", ["e", "s"], ["r"], name="reshape"),
        node("Relu", ["e"], ["u"], name="relu"),
    ]
    m = model(nodes, {"x": x}, {"s": ints(-1)}, outputs=["e", "i", "r", "u"])
    first = check(m, {"x": x}, tmp)
    saved = [a.copy() for a in first]
    first[0][...] = -1
    first[2][...] = -2
    np.testing.assert_array_equal(first[1], saved[1])
    np.testing.assert_array_equal(first[3], saved[3])
    g = load(m, tmp)
    a = g.run({"x": x})
    b = g.run({"x": x * 0})
    assert not any(np.shares_memory(p, q) for p in a for q in b)
    assert_same(a[0], saved[0])


def test_dynamic_shapes_replan(tmp):
    """One model run on inputs of several shapes (symbolic dims): each is planned anew."""
    x = arr((2, 3), F32)
    m = model(
        [node("Add", ["a", "b"], ["s"]), node("Softmax", ["s"], axis=-1)],
        {"a": x, "b": x},
        dynamic=True,
    )
    g = load(m, tmp)
    for sa, sb in [((2, 3), (3,)), ((4, 1, 3), (2, 3)), ((5,), (5,)), ((2, 3), (2, 1))]:
        a, b = arr(sa, F32, seed=36), arr(sb, F32, seed=37)
        want = _softmax(BINARY["Add"](a, b), -1, 13, False)
        assert_same(g.run({"a": a, "b": b})[0], want)


# ----------------------------------------------------------------------------------- errors
def _fails(m, feeds, tmp, name: str, cls=LeanRNNError):
    """Loading or running ``m`` raises ``cls`` naming node ``name``; afterwards the model (if
    it loaded) still runs other inputs, so an error leaves the session usable."""
    with pytest.raises(cls) as info:
        load(m, tmp).run(feeds)
    assert name in str(info.value), str(info.value)
    return info.value


def test_unsupported_op_is_named(tmp):
    x = arr((2, 3), F32)
    m = model([node("Det", ["x"], name="my_det")], {"x": x}, out_dtypes=[F32])
    err = _fails(m, {"x": x}, tmp, "my_det", UnsupportedOpError)
    assert "Det" in str(err)


BAD = {
    # name: (nodes, feeds, consts, out dtypes, error class)
    "add_broadcast": (
        [node("Add", ["a", "b"], name="bad_add")],
        {"a": arr((2, 3)), "b": arr((4,))},
        {},
        [F32],
        LeanRNNError,
    ),
    "mul_broadcast_rank": (
        [node("Mul", ["a", "b"], name="bad_mul")],
        {"a": arr((2, 3, 4)), "b": arr((3, 1, 1))},
        {},
        [F32],
        LeanRNNError,
    ),
    "add_dtypes": (
        [node("Add", ["a", "b"], name="mixed_add")],
        {"a": arr((2, 3)), "b": arr((2, 3), F64)},
        {},
        [F32],
        DTypeError,
    ),
    "exp_int": ([node("Exp", ["a"], name="exp_int")], {"a": arr((3,), I64)}, {}, [I64], DTypeError),
    "matmul_inner": (
        [node("MatMul", ["a", "b"], name="bad_mm")],
        {"a": arr((2, 3)), "b": arr((4, 2))},
        {},
        [F32],
        LeanRNNError,
    ),
    "matmul_batch": (
        [node("MatMul", ["a", "b"], name="bad_mm_batch")],
        {"a": arr((2, 2, 3)), "b": arr((3, 3, 4))},
        {},
        [F32],
        LeanRNNError,
    ),
    "gemm_c": (
        [node("Gemm", ["a", "b", "c"], name="bad_gemm")],
        {"a": arr((2, 3)), "b": arr((3, 4)), "c": arr((3,))},
        {},
        [F32],
        LeanRNNError,
    ),
    "reshape": (
        [node("Reshape", ["a", "s"], name="bad_reshape")],
        {"a": arr((2, 3))},
        {"s": ints(4, -1)},
        [F32],
        LeanRNNError,
    ),
    "squeeze_non1": (
        [node("Squeeze", ["a", "ax"], name="bad_squeeze")],
        {"a": arr((1, 3))},
        {"ax": ints(1)},
        [F32],
        LeanRNNError,
    ),
    "gather_range": (
        [node("Gather", ["a", "i"], name="bad_gather")],
        {"a": arr((3, 2)), "i": ints(1, 3)},
        {},
        [F32],
        LeanRNNError,
    ),
    "gather_range_neg": (
        [node("Gather", ["a", "i"], name="bad_gather_neg", axis=1)],
        {"a": arr((3, 2)), "i": ints(-3)},
        {},
        [F32],
        LeanRNNError,
    ),
    "concat_shapes": (
        [node("Concat", ["a", "b"], name="bad_concat", axis=0)],
        {"a": arr((2, 3)), "b": arr((2, 4))},
        {},
        [F32],
        LeanRNNError,
    ),
    "transpose_perm": (
        [node("Transpose", ["a"], name="bad_perm", perm=[0, 0])],
        {"a": arr((2, 3))},
        {},
        [F32],
        LeanRNNError,
    ),
    "split_sizes": (
        [node("Split", ["a", "s"], ["y0", "y1"], name="bad_split")],
        {"a": arr((4, 3))},
        {"s": ints(1, 2)},
        [F32, F32],
        LeanRNNError,
    ),
    "softmax_axis": (
        [node("Softmax", ["a"], name="bad_softmax", axis=3)],
        {"a": arr((2, 3, 4))},
        {},
        [F32],
        LeanRNNError,
    ),
    "flatten_axis": (
        [node("Flatten", ["a"], name="bad_flatten", axis=4)],
        {"a": arr((2, 3, 4))},
        {},
        [F32],
        LeanRNNError,
    ),
    "expand": (
        [node("Expand", ["a", "s"], name="bad_expand")],
        {"a": arr((2, 3))},
        {"s": ints(4, 3, 2)},
        [F32],
        LeanRNNError,
    ),
    "slice_step0": (
        [node("Slice", ["a", "s", "e", "ax", "st"], name="bad_slice")],
        {"a": arr((4,))},
        {"s": ints(0), "e": ints(3), "ax": ints(0), "st": ints(0)},
        [F32],
        LeanRNNError,
    ),
    "gather_float_indices": (
        [node("Gather", ["a", "i"], name="gather_float_idx")],
        {"a": arr((3, 2)), "i": arr((2,))},
        {},
        [F32],
        DTypeError,
    ),
    "gather_axis": (
        [node("Gather", ["a", "i"], name="gather_axis", axis=2)],
        {"a": arr((3, 2)), "i": ints(0)},
        {},
        [F32],
        LeanRNNError,
    ),
    "concat_dtypes": (
        [node("Concat", ["a", "b"], name="concat_dtypes", axis=0)],
        {"a": arr((2, 3)), "b": arr((2, 3), I64)},
        {},
        [F32],
        DTypeError,
    ),
    "matmul_dtypes": (
        [node("MatMul", ["a", "b"], name="matmul_dtypes")],
        {"a": arr((2, 3)), "b": arr((3, 2), F64)},
        {},
        [F32],
        DTypeError,
    ),
    "softmax_int": (
        [node("Softmax", ["a"], name="softmax_int")],
        {"a": arr((2, 3), I64)},
        {},
        [I64],
        DTypeError,
    ),
    "unsqueeze_axis": (
        [node("Unsqueeze", ["a", "ax"], name="unsqueeze_axis")],
        {"a": arr((2, 3))},
        {"ax": ints(3)},
        [F32],
        LeanRNNError,
    ),
    "slice_lengths": (
        [node("Slice", ["a", "s", "e", "ax"], name="slice_lengths")],
        {"a": arr((4, 3))},
        {"s": ints(0, 1), "e": ints(3), "ax": ints(0)},
        [F32],
        LeanRNNError,
    ),
    "int_div_by_zero": (
        [node("Div", ["a", "b"], name="bad_div")],
        {"a": ints(1, 2), "b": ints(1, 0)},
        {},
        [I64],
        LeanRNNError,
    ),
}


@pytest.mark.parametrize("case", sorted(BAD))
def test_bad_graph_fails_naming_node(case, tmp):
    """Shapes that do not fit fail with a leanrnn error naming the node, at run (the shapes
    are symbolic, so nothing is known at load), and the next good run works."""
    nodes, feeds, consts, out_dtypes, cls = BAD[case]
    name = nodes[0].name
    m = model(nodes, feeds, consts, out_dtypes=out_dtypes, dynamic=True)
    _fails(m, feeds, tmp, name, cls)


@pytest.mark.parametrize(
    "case", ["add_broadcast", "matmul_inner", "reshape", "gather_range", "concat_shapes"]
)
def test_bad_graph_fails_naming_node_when_folded(case, tmp):
    """The same graphs with every input a constant fail at load, naming the node."""
    nodes, feeds, consts, out_dtypes, cls = BAD[case]
    m = folded(model(nodes, feeds, consts, out_dtypes=out_dtypes), feeds)
    _fails(m, {}, tmp, nodes[0].name, cls)


def test_session_usable_after_bad_shapes(tmp):
    a = arr((2, 3))
    m = model(
        [node("Add", ["a", "b"], name="add_dyn")], {"a": a, "b": a}, out_dtypes=[F32], dynamic=True
    )
    g = load(m, tmp)
    with pytest.raises(LeanRNNError, match="add_dyn"):
        g.run({"a": a, "b": arr((4,))})
    b = arr((3,), seed=3)
    assert_same(g.run({"a": a, "b": b})[0], a + b)
