"""One model protocol (engine.model.RunnableModel): whatever ``leanrnn.load`` returns answers run,
resize, stream, describe and save, so callers never branch on the kind of model."""

import numpy as np
import pytest

import leanrnn
from leanrnn.engine.model import RunnableModel, parameter_count
from leanrnn.errors import ModelFormatError, ShapeError, SpecError
from leanrnn.kernels.reference import reference_forward
from tolerances import atol

T, N, C, H = 6, 3, 4, 5
F64, F32 = np.float64, np.float32


def _stack_file(tmp_path) -> str:
    m = leanrnn.LSTM(C, H, seed=1).astype(F64)
    return leanrnn.save(m, tmp_path / "stack.lrnn")


def _graph_model():
    """ONNX GRU(x, W, R, B, sequence_lens) -> final h, float32 (onnxruntime's GRU has no
    float64)."""
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(7)
    W, R, B = (
        (rng.standard_normal(s) * 0.4).astype(F32)
        for s in ((1, 3 * H, C), (1, 3 * H, H), (1, 6 * H))
    )
    node = helper.make_node("GRU", ["x", "W", "R", "B", "lens"], ["", "h"], hidden_size=H)
    graph = helper.make_graph(
        [node], "gru",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "N", C]),
         helper.make_tensor_value_info("lens", TensorProto.INT32, ["N"])],
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, "N", H])],
        [numpy_helper.from_array(a, n) for a, n in ((W, "W"), (R, "R"), (B, "B"))],
    )  # fmt: skip
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])


def _graph_file(tmp_path) -> str:
    path = tmp_path / "gru.onnx"
    path.write_bytes(_graph_model().SerializeToString())
    return str(path)


def _feeds(model) -> dict:
    """x (in the model's float dtype) and per-sample lengths, under the model's own names."""
    rng = np.random.default_rng(3)
    dtype = F64 if model.lengths_input == "lengths" else F32  # the stack is float64
    feeds = {"x": rng.standard_normal((T, N, C)).astype(dtype)}
    feeds[model.lengths_input] = np.array([T, 2, 0][:N], np.int32)
    return feeds


@pytest.fixture(params=["stack", "graph"])
def loaded(request, tmp_path):
    make = _stack_file if request.param == "stack" else _graph_file
    return leanrnn.load(make(tmp_path))


def test_every_loaded_model_answers_the_protocol(loaded, tmp_path):
    assert isinstance(loaded, RunnableModel)
    feeds = _feeds(loaded)
    outs = loaded.run(feeds)
    assert len(outs) == len(loaded.output_names)
    # save -> load gives the same model, whichever kind it is
    again = leanrnn.load(loaded.save(str(tmp_path / "again.lrnn")))
    for a, b in zip(outs, again.run(feeds), strict=True):
        np.testing.assert_array_equal(a, b)
    plan = loaded.resize({k: np.shape(v) for k, v in feeds.items()})
    assert plan is loaded.session.plan
    info = loaded.describe(N, T)
    assert info["batch"] == N and info["steps"] == T and info["arena"]["total_bytes"] > 0
    assert info["weight_bytes"] > 0


def test_stack_runs_as_the_reference(tmp_path):
    m = leanrnn.load(_stack_file(tmp_path))
    feeds = _feeds(m)
    y, h_n, c_n = m.run(feeds)
    want = reference_forward(m.spec, m.weights.unpack(), feeds["x"], lengths=feeds["lengths"])
    for got, ref in zip((y, h_n, c_n), want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=0, atol=atol(F64))
    # positional feeds follow the names x, h0, c0, lengths
    np.testing.assert_array_equal(m.run([feeds["x"]])[0], m(feeds["x"])[0])
    with pytest.raises(ShapeError, match=r"unexpected inputs \['lens'\]"):
        m.run({"x": feeds["x"], "lens": feeds["lengths"]})


def test_graph_runs_as_onnxruntime(tmp_path):
    ort = pytest.importorskip("onnxruntime")
    m = leanrnn.load(_graph_file(tmp_path))
    feeds = _feeds(m)
    sess = ort.InferenceSession(
        _graph_model().SerializeToString(), providers=["CPUExecutionProvider"]
    )
    (want,) = sess.run(None, feeds)
    (got,) = m.run(feeds)
    np.testing.assert_allclose(got, want, rtol=0, atol=atol(F32))
    assert m.lengths_input == "lens"


def test_describe_counts_parameters_by_arithmetic(loaded):
    G = 4 * H if loaded.describe(1, 1)["kind"] == "rnn" else 3 * H
    assert loaded.describe(1, 1)["parameters"] == G * C + G * H + 2 * G
    spec = leanrnn.RNNSpec("lstm", C, H, num_layers=2, direction="bidirectional")
    per_layer = [4 * H * (C + H) + 8 * H, 4 * H * (2 * H + H) + 8 * H]
    assert parameter_count(spec) == 2 * sum(per_layer)


def test_stack_streams_and_a_graph_says_why_not(tmp_path):
    m = leanrnn.load(_stack_file(tmp_path))
    x = _feeds(m)["x"]
    s = m.stream(N)
    ys = [s.feed(x[:2]).copy(), s.feed(x[2:]).copy()]
    want = reference_forward(m.spec, m.weights.unpack(), x)[0]
    np.testing.assert_allclose(np.concatenate(ys), want, rtol=0, atol=atol(F64))
    g = leanrnn.load(_graph_file(tmp_path))
    with pytest.raises(SpecError, match=r"\[GraphModel.stream\].*run\(\)"):
        g.stream(N)


def test_save_rejects_what_is_no_model(tmp_path):
    with pytest.raises(ModelFormatError, match=r"\[save\] got a dict"):
        leanrnn.save({}, tmp_path / "x.lrnn")
