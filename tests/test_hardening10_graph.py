"""Hardening, tenth pass: the graph ops against onnxruntime (a red team's sweep of each op's
attribute space). Each test failed before its fix: leanrnn ran models onnxruntime refuses with
a result of its own, read an empty Squeeze axes list otherwise, or refused valid models."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import helper, numpy_helper  # noqa: E402

from _onnx_graphs import assert_same, check, load, model, node, run_ort  # noqa: E402
from leanrnn.errors import DTypeError, LeanRNNError  # noqa: E402

pytestmark = pytest.mark.onnx

F32 = np.float32


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("hardening10_graph")


def _refused_by_both(m, feeds, tmp, match: str, cls=LeanRNNError) -> None:
    """onnxruntime refuses ``m`` (at load or at run), and leanrnn refuses it with ``match``."""
    with pytest.raises(Exception):  # noqa: B017 (onnxruntime's own error types vary)
        run_ort(m, feeds)
    with pytest.raises(cls, match=match):
        load(m, tmp).run(feeds)


# -------------------------------------------------------------- Split: equal parts before 18
@pytest.mark.parametrize("opset", [11, 13])
def test_split_without_sizes_needs_equal_parts_before_opset_18(opset, tmp):
    """Split [2, 3] in two along axis 1 ran as parts of 2 and 1 (opset 18's num_outputs rule)
    at every opset; onnxruntime refuses it."""
    x = np.arange(6, dtype=F32).reshape(2, 3)
    m = model([node("Split", ["x"], ["a", "b"], axis=1)], {"x": x}, opset=opset,
              out_dtypes=[F32, F32], dynamic=True)  # fmt: skip
    _refused_by_both(m, {"x": x}, tmp, "does not split into 2 equal parts")
    even = np.arange(8, dtype=F32).reshape(2, 4)  # the even case still runs, as onnxruntime's
    check(m, {"x": even}, tmp)


def test_split_num_outputs_at_opset_18_keeps_the_smaller_last_part(tmp):
    x = np.arange(10, dtype=F32).reshape(2, 5)
    m = model([node("Split", ["x"], ["a", "b"], axis=1, num_outputs=2)], {"x": x}, opset=18)
    check(m, {"x": x}, tmp)


# ------------------------------------------------------------------ Transpose: perm entries
@pytest.mark.parametrize("perm", [[0, -1], [0, 3], [-1, 2], [0, 0]], ids=str)
def test_transpose_perm_must_name_each_axis_once(perm, tmp):
    """perm entries were taken modulo the rank: [0, -1] ran as an identity, [-1, 2] as a
    transpose; onnxruntime refuses each."""
    x = np.arange(6, dtype=F32).reshape(2, 3)
    m = model([node("Transpose", ["x"], perm=perm)], {"x": x}, out_dtypes=[F32])
    _refused_by_both(m, {"x": x}, tmp, "not a permutation")


# -------------------------------------------------------------------- Squeeze: empty axes
def _squeeze_empty(opset: int):
    x = np.arange(3, dtype=F32).reshape(1, 3, 1)
    if opset < 13:
        sq = node("Squeeze", ["x"])
        sq.attribute.append(helper.make_attribute("axes", [], attr_type=onnx.AttributeProto.INTS))
        return model([sq], {"x": x}, opset=opset, out_dtypes=[F32]), x
    nodes = [helper.make_node("Constant", [], ["ax"], value=numpy_helper.from_array(
        np.zeros(0, np.int64))), node("Squeeze", ["x", "ax"])]  # fmt: skip
    return model(nodes, {"x": x}, opset=opset, out_dtypes=[F32]), x


@pytest.mark.parametrize("opset", [11, 13])
def test_squeeze_with_empty_axes_squeezes_every_unit_axis(opset, tmp):
    """axes=[] squeezed nothing ([1, 3, 1] stayed [1, 3, 1]); onnxruntime (and ONNX's
    reference evaluator up to opset 11) read it as no axes given: [3]."""
    m, x = _squeeze_empty(opset)
    (got,) = check(m, {"x": x}, tmp)
    assert got.shape == (3,)


# ------------------------------------------------------------------------ Slice: axes twice
def test_slice_naming_an_axis_twice_is_refused(tmp):
    x = np.arange(12, dtype=F32).reshape(3, 4)
    consts = {"s": np.array([0, 1]), "e": np.array([2, 3]), "a": np.array([0, 0])}
    m = model([node("Slice", ["x", "s", "e", "a"])], {"x": x}, consts, out_dtypes=[F32])
    _refused_by_both(m, {"x": x}, tmp, "more than once")


# ------------------------------------------------------------ arithmetic type constraints
@pytest.mark.parametrize(
    "op, dtype, opset",
    [("Add", np.bool_, 13), ("Add", np.int8, 13), ("Mul", np.uint16, 13), ("MatMul", np.bool_, 13),
     ("MatMul", np.int8, 14), ("Neg", np.uint8, 13), ("Relu", np.int32, 13), ("Abs", np.bool_, 13)],
    ids=str,
)  # fmt: skip
def test_arithmetic_outside_its_onnx_types_is_refused(op, dtype, opset, tmp):
    """numpy ran them: Add of bools as a logical or, Neg of uint8 wrapping (1, 200 -> 255,
    56), Add of int8 before opset 14 allows it; onnxruntime refuses each graph."""
    x = np.array([[1, 0], [1, 1]], dtype)
    binary = op in ("Add", "Mul", "MatMul")
    m = model([node(op, ["x", "x"] if binary else ["x"])], {"x": x}, opset=opset,
              out_dtypes=[dtype])  # fmt: skip
    _refused_by_both(m, {"x": x}, tmp, "does not take", DTypeError)


@pytest.mark.parametrize("op, dtype", [("Add", np.int8), ("Relu", np.int32), ("Neg", np.int16)])
def test_arithmetic_inside_its_onnx_types_still_runs(op, dtype, tmp):
    x = np.array([[3, -2], [1, 5]], dtype)
    m = model([node(op, ["x", "x"] if op == "Add" else ["x"])], {"x": x}, opset=14)
    check(m, {"x": x}, tmp)


# ------------------------------------------------------------------- Dropout's mask type
def test_dropout_mask_before_opset_10_has_the_input_type(tmp):
    """The mask was bool at every opset; Dropout-7's mask is of the input's type T."""
    x = np.array([1.0, -2.0], F32)
    m = model([node("Dropout", ["x"], ["y", "mask"])], {"x": x}, opset=7,
              out_dtypes=[F32, F32])  # fmt: skip
    y, mask = load(m, tmp).run({"x": x})
    assert_same(y, x)
    want = run_ort(m, {"x": x})[1]
    assert mask.dtype == want.dtype == F32 and mask.shape == want.shape
    np.testing.assert_array_equal(mask, np.ones(2, F32))  # all kept (onnxruntime writes 0s)


# ------------------------------------------------------------ DequantizeLinear of rank 1
def test_dequantize_linear_rank_1_with_a_per_tensor_scale(tmp):
    """The default axis=1 was checked against a rank-1 x even with a scalar scale: a valid
    model refused with 'axis 1 is out of range'."""
    x = np.array([-7, -3, 0, 4, 124], np.int8)
    consts = {"s": np.array(0.5, F32), "z": np.array(0, np.int8)}
    m = model([node("DequantizeLinear", ["x", "s", "z"])], {"x": x}, consts)
    check(m, {"x": x}, tmp)


# ---------------------------------------------------------------- a Constant node's size
def test_a_large_constant_node_loads_as_an_initializer_does(tmp):
    """A [300, 256] weight emitted as a Constant node was refused ('holds 76800 values;
    expected a small tensor'); the same tensor as an initializer loaded."""
    rng = np.random.default_rng(0)
    w = rng.uniform(-0.05, 0.05, (300, 256)).astype(F32)  # sums of 300 stay near 1
    x = rng.uniform(-1, 1, (1, 300)).astype(F32)
    nodes = [helper.make_node("Constant", [], ["w"], value=numpy_helper.from_array(w)),
             node("MatMul", ["x", "w"])]  # fmt: skip
    m = model(nodes, {"x": x})
    check(m, {"x": x}, tmp)


# ------------------------------------------------- DynamicQuantizeLinear with NaN in range
@pytest.mark.parametrize("pos", [0, 1, 20])
def test_dynamic_quantize_linear_leaves_nan_out_of_its_range(pos, tmp):
    """One NaN made the range [0, 0] (scale 1, zero point 0: every code wrong); onnxruntime
    leaves the NaN out of its min and max (except where the NaN is last: its scale is NaN)."""
    x = np.linspace(-1, 2, 40).astype(F32)
    x[pos] = np.nan
    m = model([node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"])], {"x": x}, opset=13)
    got = load(m, tmp).run({"x": x})
    want = run_ort(m, {"x": x})
    for g, w, what in zip(got, want, ("q", "scale", "zero point"), strict=True):
        assert_same(g, w, f"{what}: ")


# ----------------------------------------------------------- the review's: Gemm's types
@pytest.mark.parametrize("dtype", [np.bool_, np.int8], ids=str)
def test_gemm_outside_its_onnx_types_is_refused(dtype, tmp):
    """Gemm of bools ran as numpy's boolean product, of int8 wrapped in int8."""
    x = np.array([[1, 0], [1, 1]], dtype)
    m = model([node("Gemm", ["x", "x"])], {"x": x}, opset=13, out_dtypes=[dtype])
    _refused_by_both(m, {"x": x}, tmp, "does not take", DTypeError)


def test_dequantize_linear_one_element_scale_is_per_tensor_whatever_the_axis(tmp):
    """A [1] scale with axis=5 on a rank-2 x loaded (infer reads [1] as per tensor) and then
    failed at run ('axis 5 is out of range'); onnxruntime reads it per tensor."""
    x = np.array([[-7, 3], [0, 124]], np.int8)
    consts = {"s": np.array([0.5], F32), "z": np.array([0], np.int8)}
    m = model([node("DequantizeLinear", ["x", "s", "z"], axis=5)], {"x": x}, consts)
    check(m, {"x": x}, tmp)
