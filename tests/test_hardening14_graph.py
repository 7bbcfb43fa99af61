"""Session 40, from a red-team pass on the graph engine's ops against onnxruntime: an optional
output named "" (Dropout's mask, a Split part, TopK's values or indices) loaded and then failed
every run; Slice's ends of INT_MAX with a negative step sliced nothing where onnxruntime slices
to the start; a graph output declared by name only was refused as "not a tensor"; Concat of
scalars raised a bare IndexError; feeding an initializer listed among the inputs said only
"unexpected inputs"."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
pytest.importorskip("onnxruntime")
from onnx import helper  # noqa: E402

import leanrnn  # noqa: E402
from _onnx_graphs import check, load, model, node  # noqa: E402
from leanrnn.errors import ModelFormatError, ShapeError  # noqa: E402

pytestmark = pytest.mark.onnx
X = np.arange(2 * 3 * 4, dtype=np.float32).reshape(2, 3, 4) - 7


@pytest.mark.parametrize("opset", [7, 12, 13])
def test_dropout_with_an_unnamed_mask_runs(tmp_path, opset):
    m = model([node("Dropout", ["x"], ["y", ""])], {"x": X}, outputs=["y"], opset=opset)
    check(m, {"x": X}, tmp_path)


@pytest.mark.parametrize(
    "outs, parts",
    [(["a", "", "b"], [(0, 1), (2, 4)]), (["", "b"], [(2, 4)]), (["a", ""], [(0, 2)])],
)
def test_split_with_unnamed_parts_runs(tmp_path, outs, parts):
    # (onnxruntime refuses or crashes on these: numpy is the oracle)
    n = len(outs)
    split = {3: [1, 1, 2], 2: [2, 2]}[n]
    m = model([node("Split", ["x"], outs, axis=2, split=split)], {"x": X},
              outputs=[o for o in outs if o], opset=11, out_dtypes=[np.float32] * len(parts))  # fmt: skip
    got = load(m, tmp_path).run({"x": X})
    for g, (lo, hi) in zip(got, parts, strict=True):
        np.testing.assert_array_equal(g, X[:, :, lo:hi])


@pytest.mark.parametrize("outs", [["v", ""], ["", "i"]])
def test_topk_with_an_unnamed_output_runs(tmp_path, outs):
    k = np.array([2], np.int64)
    dt = [np.float32] if outs[0] else [np.int64]
    m = model([node("TopK", ["x", "k"], outs, axis=-1)], {"x": X}, consts={"k": k},
              outputs=[o for o in outs if o], out_dtypes=dt)  # fmt: skip
    (got,) = load(m, tmp_path).run({"x": X})
    idx = np.argsort(-X, axis=-1, kind="stable")[..., :2]
    want = np.take_along_axis(X, idx, -1) if outs[0] else idx
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("end", [2**31 - 1, 2**63 - 1])
def test_slice_to_int_max_with_a_negative_step_runs_to_the_start(tmp_path, end):
    # onnxruntime's reading: x[3:INT_MAX:-1] is x[3::-1] (the clamp gave an empty slice)
    x = np.arange(5, dtype=np.float32)
    consts = {"s": np.array([3]), "e": np.array([end]), "a": np.array([0]), "t": np.array([-1])}
    m = model([node("Slice", ["x", "s", "e", "a", "t"])], {"x": x}, consts=consts)
    (got,) = check(m, {"x": x}, tmp_path)
    np.testing.assert_array_equal(got, x[3::-1])


def test_a_graph_output_declared_by_name_only_loads(tmp_path):
    g = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                          [helper.make_tensor_value_info("x", 1, ["n"])],
                          [onnx.ValueInfoProto(name="y")])  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    x = np.array([-1.0, 2.0], np.float32)
    check(m, {"x": x}, tmp_path)
    m.graph.input[0].ClearField("type")  # an input with no type cannot be fed: said so
    with pytest.raises(ModelFormatError, match="graph input 'x' declares no type"):
        load(m, tmp_path)


def test_concat_of_scalars_is_refused_by_name(tmp_path):
    a = np.array(1.0, np.float32)
    m = model([node("Concat", ["a", "b"], axis=0)], {"a": a, "b": a}, out_dtypes=[np.float32])
    with pytest.raises(ShapeError, match="concatenates scalars"):
        load(m, tmp_path).run({"a": a, "b": a})


def test_feeding_an_initializer_listed_as_an_input_says_why(tmp_path):
    g = helper.make_graph(
        [helper.make_node("Add", ["x", "bias"], ["y"])], "g",
        [helper.make_tensor_value_info("x", 1, [2]), helper.make_tensor_value_info("bias", 1, [2])],
        [helper.make_tensor_value_info("y", 1, [2])],
        [onnx.numpy_helper.from_array(np.array([10, 20], np.float32), "bias")],
    )  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 13)])
    m.ir_version = 8
    lm = load(m, tmp_path)
    x = np.ones(2, np.float32)
    np.testing.assert_array_equal(lm.run({"x": x})[0], [11, 21])
    with pytest.raises(ShapeError, match=r"\[.bias.\] are initializers of the ONNX file"):
        lm.run({"x": x, "bias": x})
    with pytest.raises(ShapeError) as typo:  # a misspelt input is not told it is a constant
        lm.run({"X": x})
    assert "initializer" not in str(typo.value)
    assert isinstance(lm, leanrnn.GraphModel)


def test_graph_threads_set_after_a_run_take_effect_and_are_checked(tmp_path):
    # before: the planned session kept its threads while the property said otherwise, and -1
    # was accepted until the next run
    H = 4
    rng = np.random.default_rng(0)
    consts = {"W": rng.standard_normal((1, 3 * H, 3)).astype(np.float32),
              "R": rng.standard_normal((1, 3 * H, H)).astype(np.float32)}  # fmt: skip
    x = rng.standard_normal((5, 2, 3)).astype(np.float32)
    m = model([node("GRU", ["x", "W", "R"], ["Y"], hidden_size=H)], {"x": x}, consts=consts)
    g = load(m, tmp_path)
    want = g.run({"x": x})[0]
    g.threads = 1
    np.testing.assert_array_equal(g.run({"x": x})[0], want)
    assert [s.threads for s in g.session._sessions.values()] == [1]
    with pytest.raises(leanrnn.errors.LeanRNNError, match="threads=-1"):
        g.threads = -1
    with pytest.raises(leanrnn.errors.LeanRNNError, match="threads=0"):
        leanrnn.GraphModel(g.graph, threads=0)
