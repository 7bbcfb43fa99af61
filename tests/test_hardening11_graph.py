"""Session 37: torch's ONNX export of ``pack_padded_sequence(..., enforce_sorted=False)`` —
the usual way to feed a batch of unsorted lengths — did not load ("node '/TopK' has op 'TopK',
which leanrnn does not implement"). The export sorts the lengths with TopK, gathers the batch in
that order, and builds the inverse permutation with Range + ScatterElements (ReduceProd counts
the batch). Those ops (and the Reduce family beside ReduceProd), against onnxruntime op by op,
and the exported models against torch and onnxruntime."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from _onnx_graphs import check, load, model, node, run_ort  # noqa: E402
from helpers import torch_export  # noqa: E402
from leanrnn.errors import LeanRNNError, ModelFormatError  # noqa: E402

pytestmark = pytest.mark.onnx

F32, F64, I32, I64 = np.float32, np.float64, np.int32, np.int64


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("hardening11_graph")


def _values(shape, dtype, seed=0, ties=True):
    rng = np.random.default_rng(seed)
    v = rng.integers(-3, 4, size=shape) if ties else rng.permutation(np.prod(shape))
    return np.asarray(v, dtype).reshape(shape)  # few distinct values: many ties


# ------------------------------------------------------------------------------------- TopK
@pytest.mark.parametrize("dtype", [F32, F64, I64, I32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("largest", [1, 0])
@pytest.mark.parametrize("shape,axis,k", [((7,), -1, 7), ((7,), 0, 3), ((4, 6), 1, 2),
                                          ((4, 6), 0, 4), ((3, 5, 2), 1, 0)])  # fmt: skip
def test_topk_against_onnxruntime_ties_in_index_order(dtype, largest, shape, axis, k, tmp):
    x = _values(shape, dtype, seed=len(shape) + k)
    m = model([node("TopK", ["x", "k"], ["v", "i"], axis=axis, largest=largest)], {"x": x},
              {"k": np.array([k], I64)}, opset=11)  # fmt: skip
    check(m, {"x": x}, tmp)


def test_topk_largest_first_equal_values_by_index(tmp):
    """ONNX's rule, written out: equal values keep their index order (a numpy oracle beside
    onnxruntime)."""
    x = np.array([1, 3, 3, 0, 3, 1], I64)
    m = model([node("TopK", ["x", "k"], ["v", "i"])], {"x": x}, {"k": np.array([4], I64)},
              opset=11)  # fmt: skip
    check(m, {"x": x}, tmp, [np.array([3, 3, 3, 1], I64), np.array([1, 2, 4, 0], I64)])


def test_topk_with_k_from_the_data_is_refused_clearly(tmp):
    x, k = np.arange(5, dtype=F32), np.array([2], I64)
    m = model([node("TopK", ["x", "k"], ["v", "i"])], {"x": x, "k": k}, opset=11)
    with pytest.raises(ModelFormatError, match=r"K must be a constant or computable from input"):
        load(m, tmp).run({"x": x, "k": k})


# --------------------------------------------------------------------------- ScatterElements
@pytest.mark.parametrize("axis", [0, 1, -1])
@pytest.mark.parametrize(
    "reduction,opset", [("none", 13), ("add", 16), ("mul", 16), ("max", 18), ("min", 18)]
)
def test_scatter_elements_against_onnxruntime(axis, reduction, opset, tmp):
    rng = np.random.default_rng(1)
    data = rng.standard_normal((3, 4)).astype(F32)
    n = data.shape[axis]
    shape = (2, 4) if axis == 0 else (3, 2)
    # distinct targets along the axis for 'none' (duplicates' order is undefined in ONNX)
    idx = (np.stack([rng.permutation(n)[: shape[axis]] for _ in range(shape[1 - axis % 2])],
                    axis=1 - axis % 2) if reduction == "none"
           else rng.integers(-n, n, size=shape)).astype(I64)  # fmt: skip
    upd = rng.standard_normal(shape).astype(F32)
    attrs = {"axis": axis} | ({} if reduction == "none" else {"reduction": reduction})
    feeds = {"data": data, "i": idx, "u": upd}
    m = model([node("ScatterElements", ["data", "i", "u"], **attrs)], feeds, opset=opset)
    check(m, feeds, tmp, fold=True)


def test_scatter_elements_index_out_of_range_refused_as_by_onnxruntime(tmp):
    feeds = {"data": np.zeros(3, F32), "i": np.array([3], I64), "u": np.ones(1, F32)}
    m = model([node("ScatterElements", ["data", "i", "u"])], feeds)
    with pytest.raises(Exception):  # noqa: B017 (onnxruntime's own error types vary)
        run_ort(m, feeds)
    with pytest.raises(LeanRNNError, match=r"index 3 is out of range \[-3, 3\)"):
        load(m, tmp).run(feeds)


# ------------------------------------------------------------------------------------- Range
@pytest.mark.parametrize("dtype", [F32, F64, I32, I64], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("start,limit,delta", [(0, 5, 1), (2, 11, 3), (5, -3, -2), (4, 4, 1),
                                               (3, 1, 1)])  # fmt: skip
def test_range_against_onnxruntime(dtype, start, limit, delta, tmp):
    consts = {k: np.array(v, dtype) for k, v in (("s", start), ("l", limit), ("d", delta))}
    x = np.zeros(1, F32)  # a graph input; the Range is computed from constants at load
    m = model([node("Range", ["s", "l", "d"])], {"x": x}, consts, opset=11)
    want = run_ort(m, {"x": x})
    got = load(m, tmp).run({"x": x})
    assert got[0].dtype == want[0].dtype and np.array_equal(got[0], want[0])


def test_range_from_a_shape(tmp):
    """The export's form: Range(0, ReduceProd(Shape(x)), 1) as int64, fed at run."""
    x = np.zeros((2, 3), F32)
    nodes = [node("Shape", ["x"], ["s"]), node("ReduceProd", ["s"], ["n"], keepdims=0),
             node("Range", ["zero", "n", "one"])]  # fmt: skip
    m = model(nodes, {"x": x}, {"zero": np.array(0, I64), "one": np.array(1, I64)}, opset=13)
    check(m, {"x": x}, tmp, [np.arange(6, dtype=I64)])


# ------------------------------------------------------------------------------ Reduce ops
REDUCE_OPS = ["ReduceProd", "ReduceSum", "ReduceMax", "ReduceMin", "ReduceMean"]


@pytest.mark.parametrize("op", REDUCE_OPS)
@pytest.mark.parametrize("axes", [None, [1], [0, -1], [-2]], ids=str)
@pytest.mark.parametrize("keepdims", [1, 0])
@pytest.mark.parametrize("opset", [13, 18])
def test_reduce_against_onnxruntime(op, axes, keepdims, opset, tmp):
    x = np.random.default_rng(2).uniform(0.5, 1.5, size=(2, 3, 4)).astype(F32)
    feeds, consts, ins = {"x": x}, {}, ["x"]
    attrs = {"keepdims": keepdims}
    as_input = opset >= (13 if op == "ReduceSum" else 18)
    if axes is not None:
        if as_input:
            consts["axes"] = np.array(axes, I64)
            ins.append("axes")
        else:
            attrs["axes"] = axes
    check(model([node(op, ins, **attrs)], feeds, consts, opset=opset), feeds, tmp)


@pytest.mark.parametrize("dtype", [I64, I32, F64], ids=lambda d: np.dtype(d).name)
def test_reduce_integer_and_double(dtype, tmp):
    x = np.arange(1, 13, dtype=dtype).reshape(3, 4)
    for op in ("ReduceProd", "ReduceSum", "ReduceMax", "ReduceMin"):
        check(model([node(op, ["x"], axes=[1], keepdims=0)], {"x": x}, opset=11), {"x": x}, tmp)


def test_reduce_axes_attribute_where_the_opset_wants_an_input_is_refused(tmp):
    x = np.arange(6, dtype=F32).reshape(2, 3)
    m = model([node("ReduceSum", ["x"], axes=[1])], {"x": x}, opset=13, out_dtypes=[F32])
    with pytest.raises(Exception):  # noqa: B017 (onnxruntime's own error types vary)
        run_ort(m, {"x": x})
    with pytest.raises(ModelFormatError, match=r"'axes' attribute; at opset 13"):
        load(m, tmp).run({"x": x})


def test_reduce_sum_empty_axes_noop(tmp):
    x = np.arange(6, dtype=F32).reshape(2, 3)
    m = model([node("ReduceSum", ["x", "axes"], noop_with_empty_axes=1)], {"x": x},
              {"axes": np.zeros(0, I64)}, opset=13)  # fmt: skip
    check(m, {"x": x}, tmp, [x])


# -------------------------------------------------- the exported model, against its oracles
@pytest.mark.torch
@pytest.mark.parametrize("cell", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("bidirectional", [False, True])
@pytest.mark.parametrize("batch_first", [False, True])
def test_packed_unsorted_export_loads_and_matches_torch(cell, bidirectional, batch_first, tmp):
    torch = pytest.importorskip("torch")
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = getattr(torch.nn, cell)(4, 6, num_layers=2, batch_first=batch_first,
                                               bidirectional=bidirectional)  # fmt: skip
            self.head = torch.nn.Linear(12 if bidirectional else 6, 3)

        def forward(self, x, lengths):
            T = x.shape[1] if batch_first else x.shape[0]
            p = pack_padded_sequence(x, lengths, batch_first=batch_first, enforce_sorted=False)
            y, _ = self.rnn(p)
            y, _ = pad_packed_sequence(y, batch_first=batch_first, total_length=T)
            return self.head(y)

    torch.manual_seed(0)
    m = Tagger().eval()
    tn = (1, 0) if batch_first else (0, 1)
    x0 = torch.randn(*((3, 5) if batch_first else (5, 3)), 4)
    path = torch_export(m, (x0, torch.tensor([2, 5, 4])), tmp / f"packed_{cell}.onnx",
                        dynamo=False, names=(["x", "lengths"], ["y"]),
                        dynamic={"x": {tn[0]: "T", tn[1]: "N"}, "lengths": {0: "N"}})  # fmt: skip
    ours = pytest.importorskip("leanrnn").load(str(path))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(3)
    for T, lengths in [(5, [2, 5, 4]), (7, [7, 1, 3, 7, 2]), (4, [4])]:
        shape = (len(lengths), T, 4) if batch_first else (T, len(lengths), 4)
        x = rng.standard_normal(shape).astype(F32)
        L = np.array(lengths, I64)
        with torch.no_grad():
            want = m(torch.from_numpy(x), torch.from_numpy(L)).numpy()
        got = ours.run({"x": x, "lengths": L})[0]
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(got, sess.run(None, {"x": x, "lengths": L})[0], rtol=1e-5,
                                   atol=1e-5)  # fmt: skip


@pytest.mark.torch
@pytest.mark.parametrize("enforce_sorted", [True, False])
def test_cli_run_lengths_reaches_sequence_lens_through_the_exporters_ops(enforce_sorted, tmp):
    """`leanrnn run M.onnx --lengths l.npy` found the lengths input only when it fed
    sequence_lens directly: torch's exports put Cast (and, unsorted, TopK) between them, and
    the command refused ("no graph input feeds an RNN node's sequence_lens")."""
    torch = pytest.importorskip("torch")
    from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence

    from leanrnn import cli

    class Packed(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.GRU(4, 5)

        def forward(self, x, lengths):
            p = pack_padded_sequence(x, lengths, enforce_sorted=enforce_sorted)
            return pad_packed_sequence(self.rnn(p)[0], total_length=x.shape[0])[0]

    torch.manual_seed(1)
    m = Packed().eval()
    lengths = np.array([6, 4, 2] if enforce_sorted else [2, 6, 4], I64)
    x = np.random.default_rng(4).standard_normal((6, 3, 4)).astype(F32)
    path = torch_export(m, (torch.from_numpy(x), torch.from_numpy(lengths)),
                        tmp / f"cli_packed_{enforce_sorted}.onnx", dynamo=False,
                        names=(["x", "lengths"], ["y"]),
                        dynamic={"x": {0: "T", 1: "N"}, "lengths": {0: "N"}})  # fmt: skip
    np.save(tmp / "x.npy", x)
    np.save(tmp / "l.npy", lengths)
    out = tmp / f"out_{enforce_sorted}.npz"
    argv = ["run", str(path), "--input", str(tmp / "x.npy"), "--lengths", str(tmp / "l.npy"),
            "--output", str(out)]  # fmt: skip
    assert cli.main(argv) == 0
    with torch.no_grad():
        want = m(torch.from_numpy(x), torch.from_numpy(lengths)).numpy()
    np.testing.assert_allclose(np.load(out)["y"], want, rtol=1e-5, atol=1e-6)
