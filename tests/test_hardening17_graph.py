"""Session 43, from a red-team pass over ONNX files as other exporters and tools write them
(onnxruntime running the same file is the oracle): a default-domain opset listed twice ran
the first (onnxruntime takes the last: Softmax 0.55 off); input dims written as -1 refused
every input; a tensor named like a node's scratch buffer ("lstm#c") failed planning; nodes
out of topological order (tools that append nodes) were refused where onnxruntime sorts."""

from __future__ import annotations

import numpy as np
import pytest

import leanrnn
from leanrnn.errors import ModelFormatError

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

H, C = 5, 4


def _weights(rng, cin=C):
    return [numpy_helper.from_array((rng.standard_normal(s) * 0.5).astype(np.float32), n)
            for n, s in (("W", (1, 4 * H, cin)), ("R", (1, 4 * H, H)))]  # fmt: skip


def _both(model, path, feeds):
    """(leanrnn's outputs, onnxruntime's) for the saved ``model``."""
    onnx.save(model, str(path))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    return leanrnn.load(str(path)).run(feeds), sess.run(None, feeds)


def _close(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_the_last_default_opset_listed_is_the_one(tmp_path):
    # Softmax over axis 1 of [2, 3, 4]: opset 11 flattens from axis 1, opset 13 is per axis
    g = helper.make_graph(
        [helper.make_node("Softmax", ["x"], ["y"], axis=1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3, 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 11)])
    m.opset_import.append(helper.make_opsetid("", 13))  # a hand "upgrade"
    x = np.random.default_rng(0).standard_normal((2, 3, 4)).astype(np.float32)
    got, want = _both(m, tmp_path / "m.onnx", {"x": x})
    _close(got, want)
    np.testing.assert_allclose(got[0].sum(axis=1), 1.0, rtol=1e-5)  # (was 0.14)


def test_a_file_without_a_default_opset_says_so(tmp_path):
    g = helper.make_graph(
        [helper.make_node("Relu", ["x"], ["y"])], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
    )  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("com.example", 1)])
    onnx.save(m, str(tmp_path / "m.onnx"))
    with pytest.raises(ModelFormatError, match="imports no opset of the default ONNX domain"):
        leanrnn.load(str(tmp_path / "m.onnx"))


def test_dims_declared_minus_one_take_any_size(tmp_path):
    rng = np.random.default_rng(1)
    g = helper.make_graph(
        [helper.make_node("LSTM", ["x", "W", "R"], ["Y"], hidden_size=H)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [7, 1, C])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], _weights(rng),
    )  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    dims = m.graph.input[0].type.tensor_type.shape.dim
    dims[0].dim_value = -1  # "make it dynamic"
    dims[1].dim_value = -1
    x = rng.standard_normal((6, 3, C)).astype(np.float32)
    got, want = _both(m, tmp_path / "m.onnx", {"x": x})  # every input was refused
    _close(got, want)


def test_a_tensor_named_like_a_nodes_scratch(tmp_path):
    rng = np.random.default_rng(2)
    T, N = 4, 2
    nodes = [helper.make_node("Relu", ["x"], ["lstm#c"], name="relu"),
             helper.make_node("LSTM", ["x", "W", "R"], ["", "Yh"], hidden_size=H, name="lstm"),
             helper.make_node("ReduceSum", ["lstm#c", "ax"], ["s"], keepdims=1, name="rs"),
             helper.make_node("Concat", ["s", "Yh"], ["out"], axis=2, name="cat")]  # fmt: skip
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [T, N, C])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, [1, N, C + H])],
        [*_weights(rng), numpy_helper.from_array(np.array([0], np.int64), "ax")],
    )  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    x = rng.standard_normal((T, N, C)).astype(np.float32)
    got, want = _both(m, tmp_path / "m.onnx", {"x": x})  # was "duplicate buffer names"
    _close(got, want)


def test_nodes_out_of_order_are_sorted(tmp_path):
    rng = np.random.default_rng(3)
    nodes = [helper.make_node("Relu", ["Yh"], ["out"], name="relu"),
             helper.make_node("LSTM", ["xt", "W", "R"], ["", "Yh"], hidden_size=H, name="lstm"),
             helper.make_node("Transpose", ["x"], ["xt"], perm=[1, 0, 2], name="tr"),
             helper.make_node("Neg", ["x"], ["nx"], name="neg")]  # fmt: skip
    g = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", "T", C])],
        [helper.make_tensor_value_info("out", TensorProto.FLOAT, None),
         helper.make_tensor_value_info("nx", TensorProto.FLOAT, None)], _weights(rng),
    )  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    x = rng.standard_normal((2, 3, C)).astype(np.float32)
    got, want = _both(m, tmp_path / "m.onnx", {"x": x})  # was refused: "not in topological order"
    _close(got, want)
    # a cycle has no order: refused, naming it
    cyc = [helper.make_node("Relu", ["b"], ["a"]), helper.make_node("Relu", ["a"], ["b"])]
    g = helper.make_graph(
        cyc, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
        [helper.make_tensor_value_info("a", TensorProto.FLOAT, None)],
    )  # fmt: skip
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)]),
              str(tmp_path / "cyc.onnx"))  # fmt: skip
    with pytest.raises(ModelFormatError, match="not in topological order"):
        leanrnn.load(str(tmp_path / "cyc.onnx"))


def test_run_of_one_array_feeds_a_one_input_graph(tmp_path):
    rng = np.random.default_rng(4)
    g = helper.make_graph(
        [helper.make_node("LSTM", ["x", "W", "R"], ["Y"], hidden_size=H)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "N", C])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)], _weights(rng),
    )  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    x = rng.standard_normal((6, 2, C)).astype(np.float32)
    got, want = _both(m, tmp_path / "m.onnx", {"x": x})
    _close(leanrnn.load(str(tmp_path / "m.onnx")).run(x), want)  # was "got 6 inputs"
