"""Constant subgraphs that compute weights are folded at load, then packed.

torch's dynamo exporter leaves an RNN's W and R as Slice/Concat of initializers once they pass
its folding size limit (LSTM from hidden 48 on, GRU from 56) while B stays an initializer; the
TorchScript exporter and hand-written graphs compute weights, initial states, sequence lengths
and head matrices with other ops. Whatever computes them from constants alone, a loaded model
has every RNN node packed and every MatMul/Gemm weight a constant, and matches the oracle
(onnxruntime for hand-built graphs, torch for exported ones).
"""

from __future__ import annotations

import numpy as np
import pytest

from helpers import max_err, torch_export, torch_tagger, traced_peak
from tolerances import atol

onnx = pytest.importorskip("onnx")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from leanrnn import GraphModel  # noqa: E402
from leanrnn.formats.onnx_import import read_onnx  # noqa: E402
from leanrnn.ir import RNN_OPS  # noqa: E402
from leanrnn.loading import load  # noqa: E402

pytestmark = pytest.mark.onnx


def _assert_folded(model: GraphModel) -> None:
    """Nothing computable from constants is left to run time: every RNN node has packed weights
    and its other inputs besides X are constants or follow from input shapes (zero initial
    states of batch size), every MatMul/Gemm right side is a constant, and no node has only
    constant inputs."""
    g = model.graph
    for node in g.nodes:
        ins = [i for i in node.inputs if i]
        assert not all(i in g.constants for i in ins), f"{node.name} ({node.op}) was not folded"
        if node.op in RNN_OPS:
            assert node.name in g.packed, f"{node.name} ({node.op}) was not packed"
            slots = list(node.inputs) + [""] * (8 - len(node.inputs))
            assert not any(slots[k] for k in (1, 2, 3, 7)), node.inputs
            assert all(model._kind[i] in ("const", "shape") for i in slots[4:] if i), node.inputs
        if node.op in ("MatMul", "Gemm"):
            assert node.inputs[1] in g.constants, f"{node.name} weight {node.inputs[1]!r}"


# ------------------------------------------------------------------ hand-built, vs onnxruntime
def _const_subgraph_model(rng) -> tuple[bytes, dict]:
    """A bidirectional LSTM whose W (Concat of two initializers), R (Transpose), initial states
    (Mul/Unsqueeze/Concat, Slice), sequence_lens (Cast of a Constant) and head matrix
    (Transpose) and bias (Add) are computed by constant subgraphs; B is a plain initializer."""
    T, N, C, H, K, D = 4, 3, 5, 6, 7, 2
    G = 4 * H

    def w(*shape, scale=0.5):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    W, R, B = w(D, G, C), w(D, G, H, scale=0.3), w(D, 2 * G, scale=0.2)
    inits = {
        "Wa": W[:, : 2 * H],
        "Wb": W[:, 2 * H :],
        "Rt": np.ascontiguousarray(R.transpose(0, 2, 1)),
        "B": B,
        "h0_half": w(N, H),
        "half": np.array(0.5, np.float32),
        "axes0": np.array([0], np.int64),
        "c0_big": w(D + 1, N, H + 2),
        "starts": np.array([1, 0, 2], np.int64),
        "ends": np.array([3, N, H + 2], np.int64),
        "head_t": w(K, D * H),
        "b1": w(K),
        "b2": w(K),
        "shape_tnk": np.array([T, N, D * H], np.int64),
    }
    nodes = [
        helper.make_node("Concat", ["Wa", "Wb"], ["W"], axis=1),
        helper.make_node("Transpose", ["Rt"], ["R"], perm=[0, 2, 1]),
        helper.make_node(
            "Constant",
            [],
            ["seq_f"],
            value=numpy_helper.from_array(np.array([4.0, 2.0, 3.0], np.float32)),
        ),
        helper.make_node("Cast", ["seq_f"], ["seq"], to=TensorProto.INT32),
        helper.make_node("Mul", ["h0_half", "half"], ["h0_one"]),
        helper.make_node("Unsqueeze", ["h0_one", "axes0"], ["h0_u"]),
        helper.make_node("Concat", ["h0_u", "h0_u"], ["h0"], axis=0),
        helper.make_node("Slice", ["c0_big", "starts", "ends"], ["c0"]),
        helper.make_node(
            "LSTM",
            ["X", "W", "R", "B", "seq", "h0", "c0"],
            ["Y"],
            hidden_size=H,
            direction="bidirectional",
        ),
        helper.make_node("Transpose", ["Y"], ["Yt"], perm=[0, 2, 1, 3]),
        helper.make_node("Reshape", ["Yt", "shape_tnk"], ["feat"]),
        helper.make_node("Transpose", ["head_t"], ["head"], perm=[1, 0]),
        helper.make_node("MatMul", ["feat", "head"], ["proj"]),
        helper.make_node("Add", ["b1", "b2"], ["bias"]),
        helper.make_node("Add", ["proj", "bias"], ["logits"]),
    ]
    g = helper.make_graph(
        nodes,
        "folded",
        [helper.make_tensor_value_info("X", TensorProto.FLOAT, [T, N, C])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(v, k) for k, v in inits.items()],
    )
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    return model.SerializeToString(), {"X": w(T, N, C, scale=1.0)}


def test_constant_subgraphs_feeding_rnn_and_matmul_fold_and_match_onnxruntime():
    ort = pytest.importorskip("onnxruntime")
    data, feeds = _const_subgraph_model(np.random.default_rng(0))
    want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, feeds)[0]
    model = GraphModel(read_onnx(data))
    _assert_folded(model)
    got = model.run(feeds)[0]
    assert got.shape == want.shape
    assert max_err(got, want) <= atol(np.float32)


def test_initializer_bias_with_weights_as_graph_inputs():
    """B an initializer while W and R come in at run time: packed per run, not refused."""
    ort = pytest.importorskip("onnxruntime")
    rng = np.random.default_rng(1)
    T, N, C, H = 3, 2, 4, 5
    tensors = {
        "X": rng.standard_normal((T, N, C)).astype(np.float32),
        "W": (rng.standard_normal((1, 3 * H, C)) * 0.5).astype(np.float32),
        "R": (rng.standard_normal((1, 3 * H, H)) * 0.3).astype(np.float32),
    }
    B = (rng.standard_normal((1, 6 * H)) * 0.2).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("GRU", ["X", "W", "R", "B"], ["Y"], hidden_size=H)],
        "gru",
        [
            helper.make_tensor_value_info(k, TensorProto.FLOAT, list(v.shape))
            for k, v in tensors.items()
        ],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(B, "B")],
    )
    data = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    data.ir_version = 8
    data = data.SerializeToString()
    want = ort.InferenceSession(data, providers=["CPUExecutionProvider"]).run(None, tensors)[0]
    got = GraphModel(read_onnx(data)).run(tensors)[0]
    assert max_err(got, want) <= atol(np.float32)


# ------------------------------------------------------------------- torch exporters, vs torch
torch = pytest.importorskip("torch")

# (cell, hidden, layers, bidirectional, input size or None for C = H). LSTM's dynamo export
# switches to computed W/R between hidden 40 and 48, GRU's between 48 and 56; torch.nn.RNN
# is unrolled by the dynamo exporter (MatMul/Add/Tanh per step, weights behind Transposes).
CASES = [
    ("LSTM", 8, 1, False, None),
    ("LSTM", 40, 1, False, None),
    ("LSTM", 48, 1, False, None),
    ("LSTM", 64, 1, False, None),
    ("LSTM", 256, 1, False, None),
    ("GRU", 8, 1, False, None),
    ("GRU", 48, 1, False, None),
    ("GRU", 64, 1, False, None),
    ("GRU", 256, 1, True, 12),
    ("RNN", 8, 1, False, None),
    ("RNN", 64, 1, False, None),
    ("LSTM", 48, 2, True, 12),
    ("GRU", 40, 2, True, 12),
    ("RNN", 48, 2, True, 12),
    ("LSTM", 64, 2, False, None),
]
T, N = 3, 2


class _Many(torch.nn.Module):
    """Every case side by side, one input and one output each: one export per exporter."""

    def __init__(self):
        super().__init__()
        self.rnns = torch.nn.ModuleList(
            getattr(torch.nn, cell)(c or h, h, num_layers=layers, bidirectional=bi)
            for cell, h, layers, bi, c in CASES
        )

    def forward(self, *xs):
        return tuple(rnn(x)[0] for rnn, x in zip(self.rnns, xs, strict=True))


@pytest.fixture(scope="module", params=[False, True], ids=["torchscript", "dynamo"])
def many(request, tmp_path_factory):
    """(torch outputs, leanrnn outputs, loaded model) of ``_Many`` for one exporter."""
    if request.param:
        pytest.importorskip("onnxscript")
    torch.manual_seed(0)
    module = _Many().eval()
    rng = np.random.default_rng(0)
    xs = [rng.standard_normal((T, N, c or h)).astype(np.float32) for _, h, _, _, c in CASES]
    path = tmp_path_factory.mktemp("fold") / f"many_{request.param}.onnx"
    torch_export(module, tuple(map(torch.from_numpy, xs)), path, request.param)
    model = load(path)
    with torch.no_grad():
        want = [t.numpy() for t in module(*map(torch.from_numpy, xs))]
    return want, model.run(xs), model


def test_exported_models_are_folded_and_packed(many):
    _assert_folded(many[2])


@pytest.mark.parametrize("case", CASES, ids=["-".join(map(str, c[:4])) for c in CASES])
def test_exported_rnn_matches_torch(many, case):
    want, got, _ = many
    k = CASES.index(case)
    assert got[k].shape == want[k].shape
    assert max_err(got[k], want[k]) <= atol(np.float32)


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_tagger_hidden_128_matches_torch(tmp_path, dynamo):
    if dynamo:
        pytest.importorskip("onnxscript")
    torch.manual_seed(1)
    tagger = torch_tagger(vocab=50, emb=32, hidden=128, classes=9)  # the model
    tokens = np.random.default_rng(1).integers(0, 50, (5, 2))
    path = torch_export(tagger, (torch.from_numpy(tokens),), tmp_path / "tagger.onnx", dynamo)
    model = load(path)
    _assert_folded(model)
    with torch.no_grad():
        want = tagger(torch.from_numpy(tokens)).numpy()
    got = model(tokens)
    assert got.shape == want.shape
    assert max_err(got, want) <= atol(np.float32)


def test_folding_frees_each_intermediate_constant():
    """A weight rearranged by a chain of constant ops holds about one copy at a time while
    folding, not one per op (dynamo exports hold W three times: Slices, Concat, Unsqueeze)."""
    rng = np.random.default_rng(3)
    K, M, steps = 512, 512, 6
    nodes = [
        helper.make_node("Transpose", [f"w{k}"], [f"w{k + 1}"], perm=[1, 0]) for k in range(steps)
    ]
    nodes.append(helper.make_node("MatMul", ["x", f"w{steps}"], ["y"]))
    w0 = (rng.standard_normal((K, M)) / np.sqrt(K)).astype(np.float32)
    g = helper.make_graph(
        nodes,
        "chain",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, K])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(w0, "w0")],
    )
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    m.ir_version = 8
    graph = read_onnx(m.SerializeToString())
    with traced_peak() as mem:
        model = GraphModel(graph)
    _assert_folded(model)
    assert mem.peak < 3 * w0.nbytes, (mem.peak, w0.nbytes)
    x = rng.standard_normal((2, K)).astype(np.float32)
    want = x.astype(np.float64) @ w0.astype(np.float64)
    assert max_err(model(x), want) <= atol(np.float32)
