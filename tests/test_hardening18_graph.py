"""Session 44, from the list earlier sessions noticed and left alone: an ONNX graph output
declared DOUBLE that the graph computes as float32 was handed out as float32 under the
declared name (onnxruntime refuses such a file at load: "Type Error")."""

from __future__ import annotations

import numpy as np
import pytest

import leanrnn
from leanrnn.errors import ModelFormatError

onnx = pytest.importorskip("onnx")


def _relu(tmp_path, out_type):
    from onnx import TensorProto as P
    from onnx import helper as h

    x = h.make_tensor_value_info("x", P.FLOAT, [2, 3])
    y = h.make_tensor_value_info("y", out_type, [2, 3])
    g = h.make_graph([h.make_node("Relu", ["x"], ["y"])], "g", [x], [y])
    path = str(tmp_path / "relu.onnx")
    onnx.save(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]), path)
    return path


def test_an_output_declared_double_but_computed_float32_is_refused(tmp_path):
    from onnx import TensorProto as P

    path = _relu(tmp_path, P.DOUBLE)
    ort = pytest.importorskip("onnxruntime")
    with pytest.raises(Exception, match="Type Error"):  # the oracle refuses it too
        ort.InferenceSession(path)
    m = leanrnn.load(path)
    with pytest.raises(ModelFormatError, match=r"'y' is declared float64.*computes it as float32"):
        m(np.ones((2, 3), np.float32))
    # the model stays usable for what it can tell: the same error again, not a broken state
    with pytest.raises(ModelFormatError, match="declared float64"):
        m(np.ones((2, 3), np.float32))


def test_a_correctly_declared_output_still_runs(tmp_path):
    from onnx import TensorProto as P

    x = np.array([[-1.0, 0.5, 2.0], [3.0, -4.0, 0.0]], np.float32)
    out = leanrnn.load(_relu(tmp_path, P.FLOAT))(x)
    assert out.dtype == np.float32
    np.testing.assert_array_equal(out, np.maximum(x, 0))
