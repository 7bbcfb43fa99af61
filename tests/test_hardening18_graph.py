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
    [({"tail": "Relu"}, "made by a Relu op, which the stack does not explain"),
     ({"tail": "MatMul"}, "made by a MatMul op"),
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


# A red-team pass on as_stack and a review: an x declared of rank 2 ran no probe at all (a
# Reshape of [T, C] rows into T sequences of one step was taken as one sequence, and served);
# probes at T=3/N=2 and T=5/N=3 only; and a one-layer stack shared the graph's packed weights
# (training it changed the graph model's outputs).


def _lstm_after(tmp_path, x_shape, pre, inits_extra=()):
    """An LSTM (C=3, H=4) whose X is ``pre`` (nodes) applied to graph input x of ``x_shape``,
    its Y squeezed to output y."""
    from onnx import TensorProto as P
    from onnx import helper as h
    from onnx import numpy_helper as nh

    rng = np.random.default_rng(4)
    inits = [nh.from_array((rng.standard_normal(s) * 0.5).astype(np.float32), n)
             for n, s in (("W", (1, 16, 3)), ("R", (1, 16, 4)))]  # fmt: skip
    inits += [nh.from_array(np.array([1], np.int64), "ax"), *inits_extra]
    nodes = [*pre, h.make_node("LSTM", ["xs", "W", "R"], ["Y"], hidden_size=4),
             h.make_node("Squeeze", ["Y", "ax"], ["y"])]  # fmt: skip
    g = h.make_graph(nodes, "g", [h.make_tensor_value_info("x", P.FLOAT, x_shape)],
                     [h.make_tensor_value_info("y", P.FLOAT, None)], inits)  # fmt: skip
    path = str(tmp_path / "pre.onnx")
    onnx.save(h.make_model(g, opset_imports=[h.make_opsetid("", 17)]), path)
    return path


def test_rows_reshaped_into_sequences_of_one_step_are_not_a_stack(tmp_path):
    from onnx import helper as h
    from onnx import numpy_helper as nh

    from leanrnn.errors import SpecError

    path = _lstm_after(tmp_path, ["R", 3], [h.make_node("Reshape", ["x", "to"], ["xs"])],
                       [nh.from_array(np.array([1, -1, 3], np.int64), "to")])  # fmt: skip
    with pytest.raises(SpecError, match="declared of rank 2"):
        leanrnn.load(path).as_stack()


def test_glue_that_swaps_time_and_batch_is_caught_by_the_probes(tmp_path):
    """A Reshape of x [T, N, C] to [N, T, C] from x's own shape: a batch read as time, which
    only the probes can tell (every tensor name and op on the path is as a stack's)."""
    from onnx import helper as h
    from onnx import numpy_helper as nh

    from leanrnn.errors import SpecError

    pre = [h.make_node("Shape", ["x"], ["s"]),
           h.make_node("Gather", ["s", "swap"], ["to"], axis=0),
           h.make_node("Reshape", ["x", "to"], ["xs"])]  # fmt: skip
    path = _lstm_after(tmp_path, ["T", "N", 3], pre,
                       [nh.from_array(np.array([1, 0, 2], np.int64), "swap")])  # fmt: skip
    with pytest.raises(SpecError, match=r"not the stack's y .*probe input"):
        leanrnn.load(path).as_stack()


def test_a_reshape_to_a_shape_read_off_the_input_values_is_refused(tmp_path):
    from onnx import helper as h

    from leanrnn.errors import SpecError

    pre = [h.make_node("Cast", ["x"], ["xi"], to=7),
           h.make_node("ReduceMax", ["xi"], ["m"], keepdims=0),
           h.make_node("Reshape", ["x", "m"], ["xs"])]  # fmt: skip
    with pytest.raises(SpecError, match="shape computed from the inputs' values"):
        leanrnn.load(_lstm_after(tmp_path, ["T", "N", 3], pre)).as_stack()


def test_training_the_stack_leaves_the_graph_as_it_was(tmp_path):
    from leanrnn.train import SGD, Trainer

    path = _lstm_graph(tmp_path)
    g = leanrnn.load(path)
    x = np.random.default_rng(5).standard_normal((4, 2, 3)).astype(np.float32)
    before = g.run({"x": x})[0].copy()
    stack = g.as_stack()
    tr = Trainer(stack)
    opt = SGD(tr.parameters(), lr=0.5)
    tape = tr.forward(x)
    tr.backward(tape, np.ones_like(tape.y))
    opt.step()
    assert np.abs(stack(x)[0] - before).max() > 1e-3  # the stack did change
    np.testing.assert_array_equal(g.run({"x": x})[0], before)
