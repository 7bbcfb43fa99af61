"""Session 44, from the list earlier sessions noticed and left alone: an ONNX graph output
declared DOUBLE that the graph computes as float32 was handed out as float32 under the
declared name (onnxruntime refuses such a file at load: "Type Error")."""

from __future__ import annotations

import numpy as np
import pytest

import leanrnn
from helpers import torch_export
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


# ---------------------------------------------------------------------------------------------
# An ONNX export of a torch.nn.LSTM (one LSTM node per layer, and the glue around them) could
# not be served, nor turned into the stack it is: `serve` refused every graph, advising a
# conversion no tool made. GraphModel.as_stack() is that stack when the graph is only that.


def _ort(path, feeds):
    ort = pytest.importorskip("onnxruntime")
    s = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    return s.run(None, dict(zip([i.name for i in s.get_inputs()], feeds, strict=False)))


@pytest.mark.parametrize(
    ("cls", "kw", "with_state"),
    [("LSTM", {"num_layers": 1}, False), ("LSTM", {"num_layers": 2}, False),
     ("LSTM", {"num_layers": 2}, True), ("GRU", {"num_layers": 3, "batch_first": True}, False),
     ("GRU", {"num_layers": 1}, True), ("RNN", {"num_layers": 2, "nonlinearity": "relu"}, False)],
)  # fmt: skip
def test_a_torch_export_is_the_stack_onnxruntime_runs(tmp_path, cls, kw, with_state):
    torch = pytest.importorskip("torch")
    torch.manual_seed(0)
    mod = getattr(torch.nn, cls)(3, 5, **kw)
    bf = kw.get("batch_first", False)
    L = kw["num_layers"]
    x = torch.randn(2, 6, 3) if bf else torch.randn(6, 2, 3)
    h0 = torch.randn(L, 2, 5)
    state = ((h0, torch.randn(L, 2, 5)) if cls == "LSTM" else h0) if with_state else None
    args = (x, state) if with_state else (x,)
    path = str(torch_export(mod.eval(), args, tmp_path / "m.onnx", dynamo=False))
    stack = leanrnn.load(path).as_stack()
    assert type(stack).__name__ == cls and stack.num_layers == L and stack.batch_first == bf
    feeds = [x.numpy()]
    if with_state:
        feeds += [s.numpy() for s in (state if isinstance(state, tuple) else (state,))]
    want = _ort(path, feeds)
    hx = None
    if with_state:
        hx = tuple(feeds[1:]) if cls == "LSTM" else feeds[1]
    y, h = stack(feeds[0], hx)
    got = [y, *(h if isinstance(h, tuple) else (h,))]
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=0, atol=1e-5)


def _lstm_graph(tmp_path, tail=None, direction="forward", initial=None, **attrs):
    """An ONNX LSTM node (C=3, H=4) with Y squeezed to the output, ``tail`` an op after it."""
    from onnx import TensorProto as P
    from onnx import helper as h
    from onnx import numpy_helper as nh

    D = 2 if direction == "bidirectional" else 1
    rng = np.random.default_rng(0)
    inits = [nh.from_array((rng.standard_normal(s) * 0.4).astype(np.float32), n)
             for n, s in (("W", (D, 16, 3)), ("R", (D, 16, 4)), ("B", (D, 32)))]  # fmt: skip
    inputs = ["x", "W", "R", "B", "", ""]
    nodes = []
    if initial is not None:
        inits.append(nh.from_array(np.full((D, 2, 4), initial, np.float32), "h0"))
        inputs[5] = "h0"
    nodes.append(h.make_node("LSTM", inputs, ["Y", "Yh", "Yc"], hidden_size=4,
                             direction=direction, **attrs))  # fmt: skip
    inits.append(nh.from_array(np.array([1], np.int64), "ax"))
    nodes.append(h.make_node("Squeeze", ["Y", "ax"], ["ys" if tail else "y"]))
    if tail == "Relu":
        nodes.append(h.make_node("Relu", ["ys"], ["y"]))
    elif tail == "MatMul":
        inits.append(nh.from_array(np.ones((4 * D, 2), np.float32), "Wo"))
        nodes.append(h.make_node("MatMul", ["ys", "Wo"], ["y"]))
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", P.FLOAT, ["T", 2, 3])],
                     [h.make_tensor_value_info("y", P.FLOAT, None),
                      h.make_tensor_value_info("Yc", P.FLOAT, None)], inits)  # fmt: skip
    path = str(tmp_path / "g.onnx")
    onnx.save(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]), path)
    return path


def test_an_onnx_node_s_own_attributes_come_with_the_stack(tmp_path):
    path = _lstm_graph(tmp_path, clip=0.7, activations=["HardSigmoid", "Tanh", "Softsign"],
                       activation_alpha=[0.3], activation_beta=[0.4])  # fmt: skip
    x = np.random.default_rng(1).standard_normal((7, 2, 3)).astype(np.float32)
    y, (_, c) = leanrnn.load(path).as_stack()(x)
    want = _ort(path, [x])
    np.testing.assert_allclose(y, want[0], rtol=0, atol=1e-5)
    np.testing.assert_allclose(c, want[1], rtol=0, atol=1e-5)


@pytest.mark.parametrize(
    ("kw", "words"),
    [({"tail": "Relu"}, "made by an Relu op"), ({"tail": "MatMul"}, "made by an MatMul op"),
     ({"direction": "bidirectional"}, "is bidirectional"),
     ({"initial": 0.5}, "neither zeros nor a graph input")],
)  # fmt: skip
def test_a_graph_that_computes_more_is_not_a_stack(tmp_path, kw, words):
    from leanrnn.errors import SpecError

    with pytest.raises(SpecError, match=words):
        leanrnn.load(_lstm_graph(tmp_path, **kw)).as_stack()


def test_zeros_as_initial_state_constants_are_the_stack_s_default(tmp_path):
    path = _lstm_graph(tmp_path, initial=0.0)
    x = np.random.default_rng(2).standard_normal((5, 2, 3)).astype(np.float32)
    np.testing.assert_allclose(leanrnn.load(path).as_stack()(x)[0], _ort(path, [x])[0],
                               rtol=0, atol=1e-5)  # fmt: skip
