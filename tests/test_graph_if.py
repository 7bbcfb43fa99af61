"""ONNX ``If`` (session 39): torch's TorchScript exporter writes ``x.squeeze(d)`` of a dimension
it cannot prove is 1 as ``If(Equal(Shape(x)[d], 1), then: Squeeze, else: Identity)``; such a
model did not load ("node 'If' has op 'If', which leanrnn does not implement") while
onnxruntime runs it. An If whose condition comes from shapes and constants is planned as its
taken branch (ir.Node's ``when``); one whose condition depends on input values is refused at
load, naming the node. Every case against onnxruntime, with the branch taken both ways."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from onnx import helper, numpy_helper  # noqa: E402

import leanrnn  # noqa: E402
from _onnx_graphs import check, load, model, node, run_ort, save  # noqa: E402
from helpers import torch_export  # noqa: E402
from leanrnn.errors import ModelFormatError, UnsupportedOpError  # noqa: E402

pytestmark = pytest.mark.onnx

F32, I64 = np.float32, np.int64


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("graph_if")


def _branch(nodes, outputs, name, inits=()):
    return helper.make_graph(nodes, name, [], [helper.make_empty_tensor_value_info(o)
                                               for o in outputs], list(inits))  # fmt: skip


def _dim_is(x: str, axis: int, value: int):
    """Nodes and constants of c = (Shape(x)[axis] == value)."""
    nodes = [node("Shape", [x], ["s"]), node("Gather", ["s", "ax"], ["d"], axis=0),
             node("Equal", ["d", "v"], ["c"])]  # fmt: skip
    return nodes, {"ax": np.array(axis, I64), "v": np.array(value, I64)}


def _squeeze_if(axis: int = 1):
    """y = x.squeeze(axis) as TorchScript exports it for a dynamic dim: an If on the dim."""
    then = _branch([node("Squeeze", ["x", "sq_axes"], ["sq"], name="sq")], ["sq"], "then",
                   [numpy_helper.from_array(np.array([axis], I64), "sq_axes")])  # fmt: skip
    other = _branch([node("Identity", ["x"], ["id"], name="id")], ["id"], "else")
    cond, consts = _dim_is("x", axis, 1)
    nodes = [
        *cond,
        node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other),
        node("Relu", ["y"], ["out"]),
    ]
    return nodes, consts


@pytest.mark.parametrize("T", [1, 3])
def test_squeeze_if_both_branches_against_onnxruntime(T, tmp):
    nodes, consts = _squeeze_if()
    x = np.random.default_rng(T).standard_normal((2, T, 4)).astype(F32)
    m = model(nodes, {"x": x}, consts, out_dtypes=[F32], dynamic=True)
    got = check(m, {"x": x}, tmp)
    assert got[0].shape == ((2, 4) if T == 1 else (2, 3, 4))


def test_one_model_takes_each_branch_per_run_and_after_save(tmp):
    """The plan follows the shapes of each run (one session, shapes alternating), and a .lrnn
    written from it keeps the If."""
    nodes, consts = _squeeze_if()
    x1 = np.random.default_rng(1).standard_normal((2, 1, 4)).astype(F32)
    x3 = np.random.default_rng(3).standard_normal((2, 3, 4)).astype(F32)
    m = model(nodes, {"x": x1}, consts, out_dtypes=[F32], dynamic=True)
    g = load(m, tmp)
    path = tmp / "if.lrnn"
    g.save(path)
    again = leanrnn.load(path)
    assert any(n.op == "If" for n in again.graph.nodes)
    for lm in (g, again):
        for x in (x1, x3, x1):
            (y,) = lm.run({"x": x})
            np.testing.assert_array_equal(y, run_ort(m, {"x": x})[0])


def test_nested_if_and_branch_initializers(tmp):
    """An If inside a branch: the inner condition exists only where the outer branch runs."""
    inner_then = _branch([node("Add", ["x", "k"], ["a"], name="a")], ["a"], "it",
                         [numpy_helper.from_array(np.array(10, F32), "k")])  # fmt: skip
    inner_else = _branch([node("Neg", ["x"], ["b"], name="b")], ["b"], "ie")
    outer_then = _branch(
        [
            node("Shape", ["x"], ["s0"], name="s0"),
            node("Gather", ["s0", "zero"], ["n"], name="n", axis=0),
            node("Equal", ["n", "two"], ["c2"], name="c2"),
            node("If", ["c2"], ["r"], name="inner", then_branch=inner_then, else_branch=inner_else),
        ],
        ["r"],
        "ot",
    )
    outer_else = _branch([node("Abs", ["x"], ["e"], name="e")], ["e"], "oe")
    nodes = [
        node("Shape", ["x"], ["s"]),
        node("Gather", ["s", "one_i"], ["t"], axis=0),
        node("Greater", ["t", "one_i"], ["c"]),
        node("If", ["c"], ["y"], name="outer", then_branch=outer_then, else_branch=outer_else),
    ]
    consts = {"one_i": np.array(1, I64), "zero": np.array(0, I64), "two": np.array(2, I64)}
    for shape in [(2, 3), (4, 3), (2, 1), (5, 1)]:
        x = np.random.default_rng(sum(shape)).standard_normal(shape).astype(F32)
        m = model(nodes, {"x": x}, consts, out_dtypes=[F32], dynamic=True)
        check(m, {"x": x}, tmp)


def test_condition_from_values_is_refused_at_load_naming_the_node(tmp):
    then = _branch([node("Neg", ["x"], ["n"], name="n")], ["n"], "t")
    other = _branch([node("Identity", ["x"], ["i"], name="i")], ["i"], "e")
    nodes = [
        node("ReduceSum", ["x"], ["s"], keepdims=0),
        node("Greater", ["s", "zero"], ["c"]),
        node("If", ["c"], ["y"], name="by_value", then_branch=then, else_branch=other),
    ]
    x = np.ones((2, 3), F32)
    m = model(nodes, {"x": x}, {"zero": np.array(0, F32)}, out_dtypes=[F32])
    run_ort(m, {"x": x})  # a valid model: onnxruntime runs it
    with pytest.raises(UnsupportedOpError, match=r"If node 'by_value'.*depends on input values"):
        leanrnn.load(save(m, tmp))


def test_branch_output_count_mismatch_is_refused(tmp):
    then = _branch([node("Neg", ["x"], ["n"], name="n")], ["n"], "t")
    other = _branch([node("Identity", ["x"], ["i"], name="i"), node("Abs", ["x"], ["j"],
                     name="j")], ["i", "j"], "e")  # fmt: skip
    nodes = [
        node("Shape", ["x"], ["s"]),
        node("Gather", ["s", "zero"], ["d"], axis=0),
        node("Equal", ["d", "one"], ["c"]),
        node("If", ["c"], ["y"], name="bad", then_branch=then, else_branch=other),
    ]
    consts = {"zero": np.array(0, I64), "one": np.array(1, I64)}
    x = np.ones((2, 3), F32)
    m = model(nodes, {"x": x}, consts, out_dtypes=[F32])
    with pytest.raises(ModelFormatError, match=r"'bad'.*else_branch has 2 outputs"):
        leanrnn.load(save(m, tmp))


def test_lrnn_with_a_condition_no_node_defines_is_refused(tmp):
    """A graph .lrnn is untrusted: a node's `when` must name a tensor defined before it."""
    nodes, consts = _squeeze_if()
    x = np.ones((2, 1, 4), F32)
    g = load(model(nodes, {"x": x}, consts, out_dtypes=[F32], dynamic=True), tmp)
    g.graph.nodes[-2].when = (("nowhere", True),)  # the If itself
    path = tmp / "bad_when.lrnn"
    g.save(path)
    with pytest.raises(ModelFormatError, match="runs when 'nowhere'"):
        leanrnn.load(path)


def test_torchscript_export_of_a_dynamic_squeeze_loads_and_matches_torch(tmp):
    torch = pytest.importorskip("torch")

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.LSTM(8, 16, batch_first=True)
            self.head = torch.nn.Linear(16, 3)

        def forward(self, x):
            y, (h, _) = self.rnn(x)
            return self.head(y[:, -1:, :].squeeze(1)), h.squeeze(0)

    torch.manual_seed(0)
    m = Tagger().eval()
    path = torch_export(m, (torch.randn(2, 5, 8),), tmp / "squeeze.onnx", dynamo=False,
                        names=(["x"], ["logits", "h"]),
                        dynamic={"x": {0: "N", 1: "T"}})  # fmt: skip
    assert "If" in {n.op_type for n in onnx.load(str(path)).graph.node}
    lm = leanrnn.load(path)
    for N, T in [(2, 5), (1, 1), (3, 7)]:
        x = torch.randn(N, T, 8)
        with torch.no_grad():
            want = m(x)
        got = lm.run({"x": x.numpy()})
        for g, w in zip(got, want, strict=True):
            np.testing.assert_allclose(g, w.numpy(), rtol=0, atol=1e-5)


def test_lrnn_reading_a_branch_tensor_outside_its_branch_is_refused(tmp):
    """A node after the If reading the then-branch's own tensor directly would read what the
    plan never made when the else branch runs: refused at load, not a KeyError at run."""
    nodes, consts = _squeeze_if()
    x = np.ones((2, 1, 4), F32)
    g = load(model(nodes, {"x": x}, consts, out_dtypes=[F32], dynamic=True), tmp)
    relu = g.graph.nodes[-1]
    assert relu.op == "Relu"
    branch_out = next(n for n in g.graph.nodes if n.when and n.when[0][1]).outputs[0]
    relu.inputs = (branch_out,)
    path = tmp / "bad_scope.lrnn"
    g.save(path)
    with pytest.raises(ModelFormatError, match="made only when"):
        leanrnn.load(path)


# --------------------------------------------- a red-team pass over the above (session 39)
@pytest.mark.parametrize("T", [1, 3])
def test_lstm_in_a_branch_with_weights_built_in_the_branch_is_packed_at_load(T, tmp):
    """TorchScript builds a branch's W and R with Concat of constants inside the branch;
    those nodes were never folded, so the LSTM was packed again on every run (5x slower at
    H=512), could not be quantized and refused memory_limit."""
    rng = np.random.default_rng(0)
    H, C = 5, 3
    Wa, Wb = (rng.standard_normal((1, 2 * H, C)).astype(F32) * 0.3 for _ in range(2))
    R = rng.standard_normal((1, 4 * H, H)).astype(F32) * 0.3
    then = _branch([node("Concat", ["wa", "wb"], ["W"], name="cat", axis=1),
                    node("LSTM", ["x", "W", "r"], ["", "lh"], name="lstm", hidden_size=H)],
                   ["lh"], "t", [numpy_helper.from_array(a, k) for k, a in
                                 (("wa", Wa), ("wb", Wb), ("r", R))])  # fmt: skip
    other = _branch([node("ReduceSum", ["x", "ax0"], ["rs"], name="rs", keepdims=1)], ["rs"], "e")
    cond, consts = _dim_is("x", 0, 1)
    nodes = [*cond, node("If", ["c"], ["h"], name="if", then_branch=then, else_branch=other)]
    x = rng.standard_normal((T, 2, C)).astype(F32)
    m = model(nodes, {"x": x}, {**consts, "ax0": np.array([0], I64)}, out_dtypes=[F32],
              dynamic=True)  # fmt: skip
    g = load(m, tmp)
    assert "if/then_branch/lstm" in g.graph.packed
    check(m, {"x": x}, tmp)
    leanrnn.quantize(g, "int8")  # refused before: "W and R as graph inputs"


def test_quantized_lstm_in_a_branch_stays_in_it(tmp):
    """onnxruntime's DynamicQuantizeLSTM, lowered to an LSTM at load, lost its branch: one
    reading a branch tensor was refused ("made only when ..."), one reading an outer tensor
    ran on every plan."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    rng = np.random.default_rng(1)
    H, C = 5, 3
    W = rng.standard_normal((1, 4 * H, C)).astype(F32) * 0.3
    R = rng.standard_normal((1, 4 * H, H)).astype(F32) * 0.3
    x3 = rng.standard_normal((3, 2, C)).astype(F32)
    src = model([node("LSTM", ["xn", "W", "R"], ["", "lh"], name="lstm", hidden_size=H)],
                {"xn": x3}, {"W": W, "R": R}, out_dtypes=[F32], dynamic=True)  # fmt: skip
    quantize_dynamic(save(src, tmp), str(tmp / "q.onnx"), weight_type=QuantType.QInt8,
                     op_types_to_quantize=["LSTM"])  # fmt: skip
    qm = onnx.load(str(tmp / "q.onnx"))
    g = qm.graph
    qnodes = list(g.node)
    assert {n.op_type for n in qnodes} == {"DynamicQuantizeLSTM"}
    del g.node[:]
    cond, consts = _dim_is("x", 0, 1)
    g.initializer.extend(numpy_helper.from_array(v, k)
                         for k, v in {**consts, "ax0": np.array([0], I64)}.items())  # fmt: skip
    then = _branch([node("Neg", ["x"], ["xn"], name="neg"), *qnodes], ["lh"], "t")
    other = _branch([node("ReduceSum", ["x", "ax0"], ["rs"], name="rs", keepdims=1)], ["rs"], "e")
    g.node.extend([*cond, node("If", ["c"], ["h"], name="if", then_branch=then,
                               else_branch=other)])  # fmt: skip
    del g.input[:]
    g.input.append(helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ("T", "N", C)))
    del g.output[:]
    g.output.append(helper.make_tensor_value_info("h", onnx.TensorProto.FLOAT, None))
    lm = leanrnn.load(save(qm, tmp))
    for x in (x3, x3[:1]):
        (got,) = lm.run({"x": x})
        (want,) = run_ort(qm, {"x": x})
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-3)


def test_a_later_tensor_named_like_a_renamed_branch_tensor_loads(tmp):
    """A branch's tensors are renamed "<node>:<name>"; a top-level tensor of that name
    defined after the If was refused as redefined, though onnxruntime runs the model."""
    cond, consts = _dim_is("x", 0, 1)
    nodes = [*cond,
             node("If", ["c"], ["y"], name="if",
                  then_branch=_branch([node("Neg", ["x"], ["n"], name="n")], ["n"], "t"),
                  else_branch=_branch([node("Abs", ["x"], ["a"], name="a")], ["a"], "e")),
             node("Relu", ["y"], ["if/then_branch/n:n"], name="relu"),
             node("Neg", ["if/then_branch/n:n"], ["z"], name="z")]  # fmt: skip
    for shape in [(1, 3), (2, 3)]:
        x = np.random.default_rng(2).standard_normal(shape).astype(F32)
        check(model(nodes, {"x": x}, consts, out_dtypes=[F32], dynamic=True), {"x": x}, tmp)


def test_float_condition_and_duplicate_outputs_are_refused(tmp):
    """onnxruntime refuses a float condition at load; leanrnn ran it (a NaN read as true).
    An If naming one output twice let the last branch output win, silently."""
    nodes, consts = _squeeze_if()
    nodes[2] = node("Cast", ["d"], ["c"], to=onnx.TensorProto.FLOAT)
    x = np.ones((2, 1, 4), F32)
    with pytest.raises(ModelFormatError, match="condition 'c' has dtype float32; expected bool"):
        load(model(nodes, {"x": x}, consts, out_dtypes=[F32], dynamic=True), tmp).run({"x": x})
    nodes, consts = _squeeze_if()
    g = load(model(nodes, {"x": x}, consts, out_dtypes=[F32], dynamic=True), tmp)
    sq = next(n for n in g.graph.nodes if n.op == "Squeeze")
    sq.outputs = (sq.outputs[0], sq.outputs[0])
    g.save(tmp / "twice.lrnn")
    with pytest.raises(ModelFormatError, match="names an output twice"):
        leanrnn.load(tmp / "twice.lrnn")


def test_a_refusal_quotes_a_bounded_number_of_conditions(tmp):
    """A hostile file's 400,000 conditions made a 5 MB error message."""
    nodes, consts = _squeeze_if()
    x = np.ones((2, 1, 4), F32)
    g = load(model(nodes, {"x": x}, consts, out_dtypes=[F32], dynamic=True), tmp)
    branch = next(n for n in g.graph.nodes if n.when)
    branch.when = branch.when * 5000
    g.save(tmp / "many.lrnn")
    with pytest.raises(ModelFormatError, match=r"5000 in all") as e:
        leanrnn.load(tmp / "many.lrnn")
    assert len(str(e.value)) < 400
