"""Session 37: the ops real recurrent models put around their RNN nodes, which a survey of 34
deployed-style models found missing (each made its model fail to load): masks from lengths
(Less, Equal, Not, Where), Clip, LeakyRelu, Pow, Erf, Gelu, ArgMax, GatherElements, Tile,
LayerNormalization, BatchNormalization, Conv and MaxPool. Each op against onnxruntime over its
attribute space, and models with them exported by torch against torch."""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")

from _onnx_graphs import check, load, model, node, run_ort, save  # noqa: E402
from helpers import torch_export, traced_peak  # noqa: E402
from leanrnn.errors import LeanRNNError  # noqa: E402

pytestmark = pytest.mark.onnx

F32, F64, I32, I64 = np.float32, np.float64, np.int32, np.int64


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("hardening11_layers")


def _rand(shape, dtype=F32, seed=0, lo=-2.0, hi=2.0):
    rng = np.random.default_rng(seed)
    if np.dtype(dtype).kind in "iu":
        return rng.integers(-4, 5, size=shape).astype(dtype)
    return rng.uniform(lo, hi, size=shape).astype(dtype)


# ---------------------------------------------------------------------- masks and logic
@pytest.mark.parametrize("op", ["Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"])
@pytest.mark.parametrize("dtype", [F32, I64, I32], ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("sa,sb", [((3, 4), (3, 4)), ((1, 4), (3, 1)), ((3, 4), ())], ids=str)
def test_comparisons(op, dtype, sa, sb, tmp):
    feeds = {"a": _rand(sa, dtype, 1), "b": _rand(sb, dtype, 2)}
    check(model([node(op, ["a", "b"])], feeds, opset=13 if "Or" not in op else 16), feeds, tmp)


def test_length_mask_where_not(tmp):
    """The export's form of a padding mask: arange(T)[None] < lengths[:, None], then Where on
    the scores (a -inf fill), Not of it for the fill positions."""
    scores, lengths = _rand((3, 5), F32, 3), np.array([5, 2, 0], I64)
    nodes = [node("Less", ["steps", "lens"], ["mask"]), node("Not", ["mask"], ["pad"]),
             node("Where", ["pad", "fill", "scores"], ["y"])]  # fmt: skip
    consts = {"steps": np.arange(5, dtype=I64)[None], "fill": np.array(-np.inf, F32)}
    feeds = {"scores": scores, "lens": lengths[:, None]}
    want = np.where(np.arange(5)[None] < lengths[:, None], scores, -np.inf).astype(F32)
    check(model(nodes, feeds, consts), feeds, tmp, [want])


@pytest.mark.parametrize("op", ["And", "Or", "Xor"])
def test_logic(op, tmp):
    feeds = {"a": _rand((2, 3), I64, 4) > 0, "b": _rand((1, 3), I64, 5) > 0}
    check(model([node(op, ["a", "b"])], feeds), feeds, tmp)


@pytest.mark.parametrize("dtype", [F32, F64, I64], ids=lambda d: np.dtype(d).name)
def test_where_broadcasts_three_ways(dtype, tmp):
    feeds = {"c": _rand((2, 1, 4), I64, 6) > 0, "a": _rand((3, 1), dtype, 7),
             "b": _rand((1, 3, 4), dtype, 8)}  # fmt: skip
    check(model([node("Where", ["c", "a", "b"])], feeds), feeds, tmp)


# ----------------------------------------------------------------------- elementwise math
# (min > max: every value is max from opset 11; onnxruntime's Clip-6 refuses it)
CLIP_CASES = [(lo, hi, opset) for opset in (6, 11, 13)
              for lo, hi in ((-0.5, 0.7), (None, 0.3), (-0.2, None), (0.5, -0.5), (None, None))
              if opset >= 11 or lo is None or hi is None or lo <= hi]  # fmt: skip


@pytest.mark.parametrize("lo,hi,opset", CLIP_CASES, ids=str)
def test_clip(lo, hi, opset, tmp):
    x = _rand((4, 5), F32, 9)
    if opset < 11:
        attrs = {k: v for k, v in (("min", lo), ("max", hi)) if v is not None}
        m = model([node("Clip", ["x"], **attrs)], {"x": x}, opset=opset)
    else:
        consts = {k: np.array(v, F32) for k, v in (("lo", lo), ("hi", hi)) if v is not None}
        ins = ["x", "lo" if lo is not None else "", "hi" if hi is not None else ""]
        while ins[-1] == "":
            ins.pop()
        m = model([node("Clip", ins)], {"x": x}, consts, opset=opset)
    check(m, {"x": x}, tmp)


def test_clip_integers(tmp):
    x = _rand((3, 4), I64, 10)
    m = model([node("Clip", ["x", "lo", "hi"])], {"x": x},
              {"lo": np.array(-1, I64), "hi": np.array(2, I64)}, opset=13)  # fmt: skip
    check(m, {"x": x}, tmp)


@pytest.mark.parametrize("alpha", [0.01, 0.2])
def test_leaky_relu(alpha, tmp):
    x = _rand((3, 7), F32, 11)
    check(model([node("LeakyRelu", ["x"], alpha=alpha)], {"x": x}), {"x": x}, tmp)


@pytest.mark.parametrize("exp_dtype,exponent", [(F32, 2), (F32, 3), (F32, 0.5), (I64, 2), (I64, 3)],
                         ids=str)  # fmt: skip
def test_pow(exp_dtype, exponent, tmp):
    x = _rand((3, 4), F32, 12, 0.1, 2.0)
    m = model([node("Pow", ["x", "e"])], {"x": x}, {"e": np.array(exponent, exp_dtype)}, opset=13)
    check(m, {"x": x}, tmp)


@pytest.mark.parametrize("dtype", [F32, F64], ids=lambda d: np.dtype(d).name)
def test_erf(dtype, tmp):
    x = np.concatenate([np.linspace(-6, 6, 601), [0.0, 1e-6, -1e-6, 0.49, 0.5, 0.51]])
    x = x.astype(dtype)
    want = np.array([__import__("math").erf(v) for v in x.astype(F64)], dtype)  # exact, float64
    # (onnxruntime has no float64 Erf kernel: math.erf is the oracle there)
    check(model([node("Erf", ["x"])], {"x": x}), {"x": x}, tmp, [want], with_ort=dtype == F32)


@pytest.mark.parametrize("approximate", ["none", "tanh"])
def test_gelu(approximate, tmp):
    x = _rand((4, 9), F32, 13, -4, 4)
    m = model([node("Gelu", ["x"], approximate=approximate)], {"x": x}, opset=20)
    check(m, {"x": x}, tmp)


# ------------------------------------------------------------------ indexing and decoding
@pytest.mark.parametrize("op", ["ArgMax", "ArgMin"])
@pytest.mark.parametrize("axis,keepdims,last", [(-1, 0, 0), (0, 1, 0), (1, 1, 1), (-1, 0, 1)])
def test_arg(op, axis, keepdims, last, tmp):
    x = _rand((3, 4, 5), I64, 14)  # small integers: many ties
    m = model([node(op, ["x"], axis=axis, keepdims=keepdims, select_last_index=last)], {"x": x},
              opset=13)  # fmt: skip
    check(m, {"x": x}, tmp)


@pytest.mark.parametrize("axis", [0, 1, -1])
def test_gather_elements(axis, tmp):
    data = _rand((3, 4), F32, 15)
    n = data.shape[axis]
    shape = (2, 4) if axis == 0 else (3, 2)
    idx = np.random.default_rng(16).integers(-n, n, size=shape).astype(I64)
    feeds = {"d": data, "i": idx}
    check(model([node("GatherElements", ["d", "i"], axis=axis)], feeds), feeds, tmp)


@pytest.mark.parametrize("data_shape,idx,batch_dims", [
    ((3, 4, 5), [[0, 1], [2, -1]], 0), ((3, 4, 5), [[1], [-3]], 0), ((3, 4), [[2, 3]], 0),
    ((2, 4, 5), [[1], [3]], 1), ((2, 3, 4, 5), [[[0, 1], [2, 3]], [[1, 0], [0, -1]]], 1),
], ids=str)  # fmt: skip
def test_gather_nd(data_shape, idx, batch_dims, tmp):
    data = _rand(data_shape, F32, 35)
    feeds = {"d": data, "i": np.array(idx, I64)}
    check(model([node("GatherND", ["d", "i"], batch_dims=batch_dims)], feeds, opset=13), feeds,
          tmp)  # fmt: skip


def test_gather_elements_out_of_range_refused(tmp):
    feeds = {"d": np.zeros((2, 3), F32), "i": np.array([[3]], I64)}
    m = model([node("GatherElements", ["d", "i"], axis=1)], feeds)
    with pytest.raises(Exception):  # noqa: B017 (onnxruntime's own error types vary)
        run_ort(m, feeds)
    with pytest.raises(LeanRNNError, match=r"index 3 is out of range"):
        load(m, tmp).run(feeds)


@pytest.mark.parametrize("reps", [(1, 3, 1), (2, 1, 2), (1, 1, 1), (0, 2, 1)], ids=str)
def test_tile(reps, tmp):
    x = _rand((2, 1, 3), F32, 17)
    m = model([node("Tile", ["x", "r"])], {"x": x}, {"r": np.array(reps, I64)})
    check(m, {"x": x}, tmp)


def test_tile_repeats_from_a_shape(tmp):
    """The export of h0.repeat(1, N, 1): repeats = Concat(1, N, 1) from the input's shape."""
    h0, x = _rand((2, 1, 3), F32, 18), _rand((5, 4, 6), F32, 19)
    nodes = [node("Shape", ["x"], ["s"]), node("Gather", ["s", "one"], ["n"]),
             node("Concat", ["c1", "n", "c1"], ["r"], axis=0), node("Tile", ["h0", "r"])]  # fmt: skip
    consts = {"h0": h0, "one": np.array([1], I64), "c1": np.array([1], I64)}
    check(model(nodes, {"x": x}, consts), {"x": x}, tmp, [np.tile(h0, (1, 4, 1))])


@pytest.mark.parametrize("eq,shapes", [
    ("nth,ntc->nhc", [(2, 5, 3), (2, 5, 4)]),  # attention pooling over time
    ("ij,jk", [(3, 4), (4, 5)]),  # implicit output
    ("bij,bjk->bik", [(2, 3, 4), (2, 4, 5)]),
    ("...ij,...jk->...ik", [(2, 1, 3, 4), (1, 3, 4, 2)]),  # broadcast ellipsis
    ("i,i->", [(6,), (6,)]), ("ii->i", [(4, 4)]), ("ij->ji", [(3, 5)]),
    ("ab,bc,cd->ad", [(2, 3), (3, 4), (4, 2)]), ("bij , bjk -> bik", [(1, 2, 3), (1, 3, 2)]),
], ids=lambda v: v if isinstance(v, str) else None)  # fmt: skip
def test_einsum(eq, shapes, tmp):
    feeds = {f"x{i}": _rand(s, F32, 50 + i) for i, s in enumerate(shapes)}
    check(model([node("Einsum", list(feeds), equation=eq)], feeds, opset=12), feeds, tmp)


def test_einsum_equation_that_does_not_fit_is_refused(tmp):
    feeds = {"a": _rand((2, 3), F32, 60), "b": _rand((4, 5), F32, 61)}
    m = model([node("Einsum", ["a", "b"], equation="ij,jk->ik")], feeds, opset=12,
              out_dtypes=[F32])  # fmt: skip
    with pytest.raises(LeanRNNError, match=r"label 'j' is 3 in one input and 4"):
        load(m, tmp).run(feeds)


# --------------------------------------------------------------------------- normalization
@pytest.mark.parametrize("axis", [-1, -2, 1])
@pytest.mark.parametrize("with_bias", [True, False])
def test_layer_normalization(axis, with_bias, tmp):
    x = _rand((2, 3, 4), F32, 20)
    inner = x.shape[axis:]
    consts = {"s": _rand(inner, F32, 21)} | ({"b": _rand(inner, F32, 22)} if with_bias else {})
    ins = ["x", "s"] + (["b"] if with_bias else [])
    m = model([node("LayerNormalization", ins, axis=axis, epsilon=1e-5)], {"x": x}, consts,
              opset=17)  # fmt: skip
    check(m, {"x": x}, tmp)


@pytest.mark.parametrize("shape", [(2, 3), (2, 3, 5), (1, 3, 2, 4)], ids=str)
def test_batch_normalization_inference(shape, tmp):
    x = _rand(shape, F32, 23)
    C = shape[1]
    consts = {"s": _rand((C,), F32, 24), "b": _rand((C,), F32, 25), "m": _rand((C,), F32, 26),
              "v": _rand((C,), F32, 27, 0.5, 2.0)}  # fmt: skip
    m = model([node("BatchNormalization", ["x", "s", "b", "m", "v"], epsilon=1e-3)], {"x": x},
              consts, opset=15)  # fmt: skip
    check(m, {"x": x}, tmp)


# ------------------------------------------------------------------------ convolution
CONV_1D = [  # (C, M, group, kernel, stride, pad, dilation)
    (4, 6, 1, 3, 1, (1, 1), 1), (4, 6, 1, 5, 2, (2, 2), 1), (4, 8, 4, 3, 1, (1, 1), 1),
    (3, 2, 1, 3, 1, (0, 2), 2), (2, 4, 2, 1, 3, (0, 0), 1),
]  # fmt: skip


@pytest.mark.parametrize("C,M,group,k,s,pad,d", CONV_1D)
@pytest.mark.parametrize("bias", [True, False])
def test_conv_1d(C, M, group, k, s, pad, d, bias, tmp):
    x = _rand((2, C, 11), F32, 28)
    consts = {"w": _rand((M, C // group, k), F32, 29)} | (
        {"b": _rand((M,), F32, 30)} if bias else {}
    )
    ins = ["x", "w"] + (["b"] if bias else [])
    attrs = dict(group=group, kernel_shape=[k], strides=[s], pads=list(pad), dilations=[d])
    check(model([node("Conv", ins, **attrs)], {"x": x}, consts), {"x": x}, tmp)


@pytest.mark.parametrize("k,s,pads,group", [((5, 5), (2, 2), (2, 2, 2, 2), 1),
                                            ((3, 3), (2, 1), (1, 1, 1, 1), 1),
                                            ((3, 3), (1, 1), (1, 0, 1, 0), 2),
                                            ((1, 3), (1, 1), (0, 1, 0, 1), 1)])  # fmt: skip
def test_conv_2d(k, s, pads, group, tmp):
    x = _rand((2, 4, 9, 7), F32, 31)
    consts = {"w": _rand((6, 4 // group, *k), F32, 32), "b": _rand((6,), F32, 33)}
    attrs = dict(group=group, kernel_shape=list(k), strides=list(s), pads=list(pads))
    check(model([node("Conv", ["x", "w", "b"], **attrs)], {"x": x}, consts), {"x": x}, tmp)


@pytest.mark.parametrize("k,s,pads", [((2, 2), (2, 2), (0, 0, 0, 0)), ((2, 1), (2, 1), (0, 0, 0, 0)),
                                      ((3, 3), (1, 1), (1, 1, 1, 1)), ((3,), (2,), (1, 1))],
                         ids=str)  # fmt: skip
def test_maxpool(k, s, pads, tmp):
    x = _rand((2, 3, 7, 6)[: 2 + len(k)], F32, 34)
    m = model([node("MaxPool", ["x"], kernel_shape=list(k), strides=list(s), pads=list(pads))],
              {"x": x}, opset=12)  # fmt: skip
    check(m, {"x": x}, tmp)


# ------------------------------------------------------------- exported models, against torch
@pytest.mark.torch
@pytest.mark.parametrize("kind", ["mask_pool", "conv_ln_gru", "crnn"])
def test_exported_models_with_these_ops_match_torch(kind, tmp):
    torch = pytest.importorskip("torch")
    import leanrnn

    class MaskPool(torch.nn.Module):  # attention pooling over a biLSTM with a length mask
        def __init__(self):
            super().__init__()
            self.rnn = torch.nn.LSTM(4, 6, batch_first=True, bidirectional=True)
            self.att = torch.nn.Linear(12, 1)

        def forward(self, x, lengths):
            y, _ = self.rnn(x)
            mask = torch.arange(x.shape[1])[None] < lengths[:, None]
            s = self.att(y).squeeze(-1).masked_fill(~mask, float("-inf"))
            w = torch.softmax(s, dim=1)
            return (w.unsqueeze(-1) * y).sum(1).clamp(-0.5, 0.5)

    class ConvLnGru(torch.nn.Module):  # Conv1d front-end, LayerNorm, GELU, GRU, argmax decode
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv1d(4, 8, 3, padding=1)
            self.ln = torch.nn.LayerNorm(8)
            self.rnn = torch.nn.GRU(8, 6, batch_first=True)
            self.head = torch.nn.Linear(6, 5)

        def forward(self, x, lengths):
            h = self.conv(x.transpose(1, 2)).transpose(1, 2)
            h = torch.nn.functional.gelu(self.ln(h))
            y, _ = self.rnn(h)
            logits = torch.nn.functional.leaky_relu(self.head(y), 0.1)
            return logits, logits.argmax(-1)

    class Crnn(torch.nn.Module):  # Conv2d + BatchNorm + Hardtanh + MaxPool, then a biGRU
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv2d(1, 4, 3, stride=(2, 1), padding=1)
            self.bn = torch.nn.BatchNorm2d(4)
            self.rnn = torch.nn.GRU(4 * 2, 5, batch_first=True, bidirectional=True)

        def forward(self, x, lengths):  # x [N, T, F]
            h = self.bn(self.conv(x.transpose(1, 2).unsqueeze(1)))  # [N, 4, F/2, T]
            h = torch.nn.functional.hardtanh(h, 0, 20)
            h = torch.nn.functional.max_pool2d(h, (2, 1))  # [N, 4, F/4, T]
            h = h.permute(0, 3, 1, 2).flatten(2)  # [N, T, 4 * F/4]
            return self.rnn(h)[0]

    torch.manual_seed(0)
    m = {"mask_pool": MaskPool, "conv_ln_gru": ConvLnGru, "crnn": Crnn}[kind]().eval()
    if kind == "crnn":
        with torch.no_grad():  # statistics of their own, not 0 and 1
            m.bn.running_mean.uniform_(-0.5, 0.5)
            m.bn.running_var.uniform_(0.5, 2)
    F = 8 if kind == "crnn" else 4
    x0, L0 = torch.randn(3, 6, F), torch.tensor([6, 3, 1])
    outs = ["y", "ids"] if kind == "conv_ln_gru" else ["y"]
    path = torch_export(m, (x0, L0), tmp / f"{kind}.onnx", dynamo=False,
                        names=(["x", "lengths"], outs),
                        dynamic={"x": {0: "N", 1: "T"}, "lengths": {0: "N"}})  # fmt: skip
    ours = leanrnn.load(str(path))
    sess = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(1)
    for N, T in [(2, 7), (4, 5)]:
        x = rng.standard_normal((N, T, F)).astype(F32)
        L = rng.integers(1, T + 1, size=N).astype(I64)
        feeds = {k: v for k, v in (("x", x), ("lengths", L)) if k in ours.input_names}
        with torch.no_grad():
            want = m(torch.from_numpy(x), torch.from_numpy(L))
        want = [w.numpy() for w in (want if isinstance(want, tuple) else (want,))]
        got = ours.run(feeds)
        theirs = sess.run(None, feeds)
        for g, w, o in zip(got, want, theirs, strict=True):
            np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
            np.testing.assert_allclose(g, o, rtol=1e-5, atol=1e-5)


# ---------------------------------------- from the review: bounded memory, onnxruntime's ways
def test_conv_and_maxpool_memory_stays_near_the_output(tmp):
    """The whole im2col (1.6 GB for a 400 KB output, kernel 1000) and the padded copy of the
    input (7.45 GiB for pads of 10**9 on 4 values) were made before any size check."""
    from leanrnn.errors import ShapeError

    x = np.ones((1, 4, 20_000), F32)
    m = model([node("Conv", ["x", "w"])], {"x": x}, {"w": np.ones((1, 4, 1000), F32)})
    g = load(m, tmp)
    with traced_peak() as mem:
        y = g.run({"x": x})[0]
    peak = mem.peak
    np.testing.assert_allclose(y, run_ort(m, {"x": x})[0], rtol=1e-5)
    assert peak < 80 << 20, f"{peak / 2**20:.0f} MiB for a {y.nbytes / 2**20:.2f} MiB output"
    P = 10**9  # pads far beyond the input, strides to match: three outputs, x[0] in the middle
    x = np.arange(1, 5, dtype=F32).reshape(1, 1, 4)
    conv = model([node("Conv", ["x", "w"], pads=[P, P], strides=[P])], {"x": x},
                 {"w": np.full((1, 1, 1), 2, F32)})  # fmt: skip
    np.testing.assert_array_equal(load(conv, tmp).run({"x": x})[0], [[[0, 2, 0]]])
    pool = model([node("MaxPool", ["x"], kernel_shape=[2 * P + 4], pads=[P, P])], {"x": x})
    with pytest.raises(ShapeError, match=r"kernel \[2000000004\] is over twice the input"):
        load(pool, tmp).run({"x": x})


@pytest.mark.parametrize("start,limit,delta", [(-(2**62), -(2**62) + 5, 1), (0, 2**53 + 1, 2**52)],
                         ids=["far", "count"])  # fmt: skip
def test_range_int64_counts_exactly(start, limit, delta, tmp):
    consts = {k: np.array(v, I64) for k, v in (("s", start), ("l", limit), ("d", delta))}
    x = np.zeros(1, F32)
    m = model([node("Range", ["s", "l", "d"])], {"x": x}, consts, opset=11)
    got, want = load(m, tmp).run({"x": x})[0], run_ort(m, {"x": x})[0]
    assert got.dtype == want.dtype and np.array_equal(got, want)


@pytest.mark.parametrize("start,limit,delta", [(0.0, 1.0, 0.1), (1.0, 100.0, 0.3)], ids=str)
def test_range_float_steps_accumulate_as_onnxruntime(start, limit, delta, tmp):
    consts = {k: np.array(v, F32) for k, v in (("s", start), ("l", limit), ("d", delta))}
    x = np.zeros(1, F32)
    m = model([node("Range", ["s", "l", "d"])], {"x": x}, consts, opset=11)
    np.testing.assert_array_equal(load(m, tmp).run({"x": x})[0], run_ort(m, {"x": x})[0])


def test_reduce_mean_of_an_empty_axis_and_pow_with_a_wider_exponent(tmp):
    x = np.zeros((2, 0), F32)
    m = model([node("ReduceMean", ["x"], axes=[1])], {"x": x}, opset=13)
    check(m, {"x": x}, tmp)
    x = np.array([3, 7.5, 100, 1e6], F32)
    m = model([node("Pow", ["x", "e"])], {"x": x}, {"e": np.array(1.0000001, F64)}, opset=13)
    np.testing.assert_array_equal(load(m, tmp).run({"x": x})[0], run_ort(m, {"x": x})[0])


def test_lengths_input_is_not_the_token_ids(tmp):
    """sequence_lens computed from token ids [N, T] (a count of non-padding tokens): the ids are
    no lengths input, and `run --lengths` must not feed lengths into them."""
    import leanrnn

    T, N, C, H = 4, 2, 3, 5
    rng = np.random.default_rng(40)
    feeds = {"x": _rand((T, N, C), F32, 41), "tokens": np.array([[3, 1, 0, 0], [2, 2, 2, 0]], I64)}
    nodes = [node("Greater", ["tokens", "zero"], ["nz"]), node("Cast", ["nz"], ["nzi"], name="c1", to=7),
             node("ReduceSum", ["nzi", "one"], ["len64"], keepdims=0),
             node("Cast", ["len64"], ["lens"], name="c2", to=6),
             node("LSTM", ["x", "W", "R", "", "lens"], ["y"], hidden_size=H)]  # fmt: skip
    consts = {"zero": np.array(0, I64), "one": np.array([1], I64),
              "W": rng.standard_normal((1, 4 * H, C)).astype(F32),
              "R": rng.standard_normal((1, 4 * H, H)).astype(F32)}  # fmt: skip
    m = model(nodes, feeds, consts, opset=13, out_dtypes=[F32])
    g = leanrnn.load(save(m, tmp))
    assert g.lengths_input is None
    check(m, feeds, tmp)


# ------------------------------------------------- from fuzzing the ops against onnxruntime
@pytest.mark.parametrize(
    "opset,ins", [(13, ["x", "lo"]), (11, ["x"]), (13, ["x", "", "hi"])], ids=str
)
def test_clip_absent_bound_is_the_types_extreme(opset, ins, tmp):
    """ONNX: an absent bound is the type's lowest/highest value, so +-inf become finite
    (torch's clamp(min=0) export); leanrnn left inf alone."""
    x = np.array([-np.inf, -1, 0.5, np.inf], F32)
    consts = {"lo": np.array(0, F32), "hi": np.array(1, F32)}
    m = model([node("Clip", ins)], {"x": x}, {k: consts[k] for k in ins[1:] if k}, opset=opset)
    check(m, {"x": x}, tmp)


@pytest.mark.parametrize("op,attrs", [
    ("ReduceSum", {"keepdims": 2}), ("ArgMax", {"keepdims": 2, "axis": 1}),
    ("TopK", {"largest": 2}),
], ids=str)  # fmt: skip
def test_flags_are_true_when_1_as_onnxruntime_reads_them(op, attrs, tmp):
    x = _rand((3, 4), F32, 70)
    ins, consts, outs = ["x"], {}, ["y"]
    if op == "TopK":
        ins, consts, outs = ["x", "k"], {"k": np.array([2], I64)}, ["v", "i"]
    m = model([node(op, ins, outs, **attrs)], {"x": x}, consts, opset=11)
    check(m, {"x": x}, tmp)


@pytest.mark.parametrize("op,attrs,match", [
    ("Conv", {"strides": [1.5]}, "strides"), ("ArgMax", {"axis": 1.5}, "axis=1.5"),
    ("LeakyRelu", {"alpha": [0, 2]}, "alpha"), ("ReduceSum", {"keepdims": "1"}, "keepdims"),
], ids=str)  # fmt: skip
def test_attributes_of_the_wrong_type_are_refused(op, attrs, match, tmp):
    from leanrnn.errors import ModelFormatError

    x = _rand((1, 2, 5), F32, 71)
    consts = {"w": _rand((1, 2, 3), F32, 72)} if op == "Conv" else {}
    ins = ["x", "w"] if op == "Conv" else ["x"]
    m = model([node(op, ins, **attrs)], {"x": x}, consts, opset=11, out_dtypes=[F32])
    with pytest.raises(ModelFormatError, match=match):
        load(m, tmp).run({"x": x})


def test_empty_edges_as_onnxruntime(tmp):
    x = np.zeros((1, 0, 3), F32)  # ReduceMax over an empty axis: -inf (ONNX 18's identity)
    check(model([node("ReduceMax", ["x"], axes=[1])], {"x": x}, opset=13), {"x": x}, tmp)
    x = _rand((1, 1, 2), F32, 73)  # an input shorter than the kernel: an empty output
    check(model([node("MaxPool", ["x"], kernel_shape=[3])], {"x": x}, opset=12), {"x": x}, tmp)
    feeds = {"d": np.zeros((0, 3), F32), "i": np.zeros((0, 1), I64)}  # GatherND, empty batch
    check(model([node("GatherND", ["d", "i"], batch_dims=1)], feeds, opset=13), feeds, tmp)


def test_an_empty_output_with_huge_dims_is_refused_clearly(tmp):
    from leanrnn.errors import ShapeError

    x = np.zeros((0, 2), F32)
    m = model([node("Tile", ["x", "r"])], {"x": x}, {"r": np.array([2**62, 2**62], I64)},
              out_dtypes=[F32])  # fmt: skip
    with pytest.raises(ShapeError, match=r"below 2\*\*62"):
        load(m, tmp).run({"x": x})


def test_conv_without_channels_stays_small(tmp):
    x = np.zeros((1, 0, 20_000), F32)
    m = model([node("Conv", ["x", "w"])], {"x": x}, {"w": np.zeros((1, 0, 10_000), F32)},
              out_dtypes=[F32])  # fmt: skip
    g = load(m, tmp)
    with traced_peak() as mem:
        y = g.run({"x": x})[0]
    peak = mem.peak
    assert y.shape == (1, 1, 10_001) and not y.any()
    assert peak < 64 << 20, f"{peak / 2**20:.0f} MiB (the index arrays of every position at once)"


# -------------------------------------------------------- from the second review of the ops
def test_second_review_cases_as_onnxruntime(tmp):
    from leanrnn.errors import ShapeError

    # a size-1 label broadcasts (a learned query of batch 1 against a batch of keys)
    feeds = {"q": _rand((1, 2, 4), F32, 80), "k": _rand((3, 5, 2, 4), F32, 81)}
    check(model([node("Einsum", ["q", "k"], equation="bhd,bthd->bth")], feeds, opset=12),
          feeds, tmp)  # fmt: skip
    # a MaxPool input shorter than its kernel: C's division gives one window here
    x = np.array([[[0.0, 1.0]]], F32)
    m = model([node("MaxPool", ["x"], kernel_shape=[4], strides=[3])], {"x": x}, opset=12)
    check(m, {"x": x}, tmp, [np.array([[[1.0]]], F32)])
    m = model([node("MaxPool", ["x"], kernel_shape=[4])], {"x": x}, opset=12, out_dtypes=[F32])
    with pytest.raises(ShapeError, match="shorter than the kernel"):
        load(m, tmp).run({"x": x})
    # select_last_index: any nonzero value is true, as onnxruntime reads it
    x = np.array([[1, 3, 3, 0], [2, 2, 1, 2]], F32)
    m = model([node("ArgMax", ["x"], axis=1, select_last_index=2)], {"x": x}, opset=12)
    check(m, {"x": x}, tmp, [np.array([[2], [3]], I64)])
    # an empty output whose bytes (not elements) reach 2**63
    x = np.zeros((0, 2), F32)
    m = model([node("Tile", ["x", "r"])], {"x": x}, {"r": np.array([1, 2**60], I64)},
              out_dtypes=[F32])  # fmt: skip
    with pytest.raises(ShapeError, match=r"below 2\*\*62"):
        load(m, tmp).run({"x": x})
