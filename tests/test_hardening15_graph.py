"""Session 41, from a red-team pass fuzzing ONNX LSTM/GRU/RNN nodes against onnxruntime (1,360
random models agreed): a valid ONNX file whose ninth byte is '{' was taken for a truncated
safetensors file; a GRU or RNN node naming a third output returned the arena's old bytes there,
and extra inputs (a GRU's "P") or an opset-7 node's layout attribute were ignored, where
onnx.checker and onnxruntime refuse them; model bytes passed to load were quoted whole as a
file name; feeding an RNN weight listed among the graph inputs said only "unexpected"."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

import leanrnn  # noqa: E402
from leanrnn.errors import ModelFormatError, ShapeError  # noqa: E402
from tolerances import atol  # noqa: E402

pytestmark = pytest.mark.onnx
# onnxruntime's refusals at session creation
_S = ort.capi.onnxruntime_pybind11_state
ORT_ERRORS = (_S.Fail, _S.InvalidGraph, _S.InvalidArgument)
T, N, C, H = 2, 1, 3, 4
RNG = np.random.default_rng(15)
W = RNG.standard_normal((1, 4 * H, C)).astype(np.float32)
R = RNG.standard_normal((1, 4 * H, H)).astype(np.float32)
X = RNG.standard_normal((T, N, C)).astype(np.float32)


def _lstm_model(node, inputs=("X",), opset=14, inits=None, x=(T, N, C)) -> onnx.ModelProto:
    shapes = {"X": list(x), "W": [1, 4 * H, C]}
    g = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info(k, TensorProto.FLOAT, shapes[k]) for k in inputs],
        [onnx.ValueInfoProto(name=o) for o in node.output if o],
        [numpy_helper.from_array(v, k) for k, v in (inits or {"W": W, "R": R}).items()],
    )  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", opset)])
    m.ir_version = 8
    for o in m.graph.output:
        o.CopyFrom(helper.make_tensor_value_info(o.name, TensorProto.FLOAT, None))
    return m


def test_an_onnx_file_whose_ninth_byte_is_a_brace_loads(tmp_path):
    """The safetensors sniff looked at byte 8 alone ('{'); such an ONNX file then failed as
    "declares a 17008408669047097352-byte header". A long node name puts the brace there."""
    for k in range(15600, 16000):
        node = helper.make_node("LSTM", ["X", "W", "R"], ["Y"], hidden_size=H, name="n" * k)
        m = _lstm_model(node)
        data = m.SerializeToString()
        if data[8:9] == b"{":
            break
    else:
        pytest.fail("no node name put '{' at byte 8 (the serializer changed?)")
    path = tmp_path / "brace.onnx"
    path.write_bytes(data)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"X": X})
    got = leanrnn.load(str(path)).run({"X": X})
    np.testing.assert_allclose(got[0], want[0], atol=atol(np.float32), rtol=0)


def test_a_truncated_safetensors_file_is_still_named_as_one(tmp_path):
    path = tmp_path / "cut.safetensors"
    path.write_bytes((1000).to_bytes(8, "little") + b'{"a": 1}')
    with pytest.raises(ModelFormatError, match="1000-byte header"):
        leanrnn.load(str(path))


@pytest.mark.parametrize("op, gates", [("GRU", 3), ("RNN", 1)])
def test_a_gru_or_rnn_node_with_a_third_output_is_refused(tmp_path, op, gates):
    # (its Y_c was never written: the arena's old bytes, 7.65e+12 in one run)
    node = helper.make_node(op, ["X", "W", "R"], ["Y", "Yh", "Yc"], hidden_size=H)
    inits = {"W": W[:, : gates * H], "R": R[:, : gates * H]}
    path = tmp_path / "m.onnx"
    onnx.save(_lstm_model(node, inits=inits), str(path))
    with pytest.raises(ORT_ERRORS):  # the oracle refuses it too
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with pytest.raises(ModelFormatError, match="at most 2 outputs"):
        leanrnn.load(str(path))


@pytest.mark.parametrize(
    "op, n_inputs", [("GRU", 7), ("RNN", 7), ("LSTM", 9)]
)  # fmt: skip
def test_an_rnn_node_with_inputs_beyond_onnx_s_is_refused(tmp_path, op, n_inputs):
    gates = {"GRU": 3, "RNN": 1, "LSTM": 4}[op]
    inits = {"W": W[:, : gates * H], "R": R[:, : gates * H], "P": np.ones((1, 3 * H), np.float32)}
    ins = ["X", "W", "R", "", "", "", "", "", ""][:n_inputs]
    ins[-1] = "P"  # (a GRU's P was ignored)
    node = helper.make_node(op, ins, ["Y"], hidden_size=H)
    path = tmp_path / "m.onnx"
    onnx.save(_lstm_model(node, inits=inits), str(path))
    with pytest.raises(ModelFormatError, match=f"{n_inputs} inputs"):
        leanrnn.load(str(path))


def test_layout_before_opset_14_is_refused(tmp_path):
    # (it ran batch-first: Y (3, 2, 1, 5) where the node's schema has no layout at all)
    node = helper.make_node("LSTM", ["X", "W", "R"], ["Y"], hidden_size=H, layout=1)
    path = tmp_path / "m.onnx"
    onnx.save(_lstm_model(node, opset=7), str(path))
    with pytest.raises(ORT_ERRORS):
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    with pytest.raises(ModelFormatError, match="layout is an attribute of LSTM from opset 14"):
        leanrnn.load(str(path))
    ok = tmp_path / "ok.onnx"
    onnx.save(_lstm_model(node, opset=14, x=(N, T, C)), str(ok))  # from 14 on: the node's own
    # (onnxruntime runs no layout=1 RNN: its layout-0 twin is the oracle, transposed)
    ref = tmp_path / "ref.onnx"
    node0 = helper.make_node("LSTM", ["X", "W", "R"], ["Y"], hidden_size=H)
    onnx.save(_lstm_model(node0, opset=14), str(ref))
    want = ort.InferenceSession(str(ref), providers=["CPUExecutionProvider"]).run(None, {"X": X})
    xb = np.ascontiguousarray(X.transpose(1, 0, 2))
    np.testing.assert_allclose(leanrnn.load(str(ok)).run({"X": xb})[0],
                               want[0].transpose(2, 0, 1, 3), atol=atol(np.float32), rtol=0)  # fmt: skip


def test_model_bytes_given_to_load_get_a_short_message():
    data = _lstm_model(helper.make_node("LSTM", ["X", "W", "R"], ["Y"], hidden_size=H))
    data = data.SerializeToString()
    with pytest.raises(ModelFormatError, match="cannot be a file path") as e:
        leanrnn.load(data)
    assert len(str(e.value)) < 300  # (it quoted the bytes: 4x the model's size)


def test_feeding_a_packed_rnn_weight_says_it_is_an_initializer(tmp_path):
    node = helper.make_node("LSTM", ["X", "W", "R"], ["Y"], hidden_size=H)
    path = tmp_path / "m.onnx"
    onnx.save(_lstm_model(node, inputs=("X", "W")), str(path))
    g = leanrnn.load(str(path))
    with pytest.raises(ShapeError, match=r"\['W'\] are initializers"):
        g.run({"X": X, "W": W})
    np.testing.assert_allclose(
        g.run({"X": X})[0],
        ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"X": X})[0],
        atol=atol(np.float32), rtol=0,
    )  # fmt: skip
