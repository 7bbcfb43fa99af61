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


def _squeeze_if(axis: int = 1):
    """y = x.squeeze(axis) as TorchScript exports it for a dynamic dim: an If on the dim."""
    then = _branch([node("Squeeze", ["x", "ax"], ["sq"], name="sq")], ["sq"], "then",
                   [numpy_helper.from_array(np.array([axis], I64), "ax")])  # fmt: skip
    other = _branch([node("Identity", ["x"], ["id"], name="id")], ["id"], "else")
    nodes = [
        node("Shape", ["x"], ["s"]),
        node("Gather", ["s", "d"], ["dim"], axis=0),
        node("Equal", ["dim", "one"], ["c"]),
        node("If", ["c"], ["y"], name="if", then_branch=then, else_branch=other),
        node("Relu", ["y"], ["out"]),
    ]
    consts = {"d": np.array(axis, I64), "one": np.array(1, I64)}
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
    with pytest.raises(UnsupportedOpError, match=r"by_value.*depends on input values"):
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
