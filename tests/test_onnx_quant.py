"""Files from ``onnxruntime.quantization.quantize_dynamic``: DynamicQuantizeLSTM (lowered to a
float32 LSTM of the dequantized weights) and the dynamic-quantization graph ops around heads
and embeddings (DynamicQuantizeLinear, MatMulInteger, MatMulIntegerToFloat, DynamicQuantizeMatMul,
DequantizeLinear), each against onnxruntime running the same file, plus the accuracy of both
against the float32 model.

onnxruntime's u8s8 GEMMs on CPUs without VNNI (AVX2) add pairs of uint8 x int8 products in int16
with saturation (``vpmaddubsw``), so with int8 weights beyond [-64, 64] their results are not
the exact integer products (on such a CPU its MatMulInteger equals the saturated pair sums; its
DynamicQuantizeLSTM with full-range uint8 weights drifts the same way); leanrnn computes them
exactly (the ONNX result). Tests that compare with onnxruntime therefore keep weights in 7 bits:
``quantize_dynamic(reduce_range=True)``, onnxruntime's own advice for such CPUs.
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import helper, numpy_helper  # noqa: E402

import leanrnn  # noqa: E402
from _onnx_graphs import assert_same, load, node, run_ort, save  # noqa: E402
from helpers import torch_export, torch_tagger  # noqa: E402
from leanrnn.errors import DTypeError, LeanRNNError, ModelFormatError, WeightsError  # noqa: E402
from leanrnn.formats.onnx_import import read_onnx  # noqa: E402
from leanrnn.formats.onnx_quant import QLSTM, dequantize, quantized_lstm_weights  # noqa: E402
from leanrnn.ir import Graph, Node  # noqa: E402
from tolerances import ATOL_ORT_DYNAMIC_QUANT, ATOL_WEIGHT_QUANT_INT8  # noqa: E402

pytestmark = [pytest.mark.onnx]
F32, U8, I8, I32 = np.float32, np.uint8, np.int8, np.int32
MS = "com.microsoft"


@pytest.fixture(scope="module")
def tmp(tmp_path_factory):
    return tmp_path_factory.mktemp("onnx_quant")


def graph_model(nodes, feeds: dict, consts: dict, outputs: dict, ms: bool = False):
    """A model of ``nodes`` with graph inputs ``feeds`` (exact shapes), initializers ``consts``
    and outputs {name: dtype}; ``ms`` imports the com.microsoft domain."""
    ins = [
        helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(v.dtype), v.shape)
        for k, v in feeds.items()
    ]
    outs = [
        helper.make_tensor_value_info(k, helper.np_dtype_to_tensor_dtype(np.dtype(d)), None)
        for k, d in outputs.items()
    ]
    inits = [numpy_helper.from_array(np.asarray(v), k) for k, v in consts.items()]
    opsets = [helper.make_opsetid("", 17)] + ([helper.make_opsetid(MS, 1)] if ms else [])
    m = helper.make_model(helper.make_graph(nodes, "g", ins, outs, inits), opset_imports=opsets)
    m.ir_version = 8
    return m


def both(m, feeds, tmp, exact: bool = False):
    """leanrnn's and onnxruntime's outputs of ``m``, compared: exactly for integer outputs and
    with ``exact``, else within tolerances.atol."""
    got = load(m, tmp).run(feeds)
    want = run_ort(m, feeds)
    for g, w in zip(got, want, strict=True):
        assert_same(g, w)
        if exact:
            np.testing.assert_array_equal(g, w)
    return got


def rand_u8(shape, seed):
    return np.random.default_rng(seed).integers(0, 256, size=shape).astype(U8)


def rand_i8(shape, seed, lim=64):  # |q| <= 64: onnxruntime's AVX2 u8s8 path is exact there
    return np.random.default_rng(seed).integers(-lim, lim + 1, size=shape).astype(I8)


# ---------------------------------------------------------------------- DynamicQuantizeLinear
def _dql_inputs():
    rng = np.random.default_rng(0)
    ties = (np.arange(-40, 215) + 0.5).astype(F32) * F32(0.125)  # x / scale lands on k + 0.5
    return {
        "scalar": np.array(0.7, F32),
        "one": np.array([-3.0], F32),
        "positive": rng.uniform(0.1, 5, (3, 4)).astype(F32),
        "negative": rng.uniform(-5, -0.1, (2, 3, 5)).astype(F32),
        "mixed": (rng.standard_normal((7, 3, 16)) * 3).astype(F32),
        "zeros": np.zeros((4, 2), F32),
        "ties": np.concatenate([ties, [F32(-5.0), F32(26.875)]]).astype(F32),
        "tiny": (rng.standard_normal(9) * 1e-30).astype(F32),
    }


@pytest.mark.parametrize("case", list(_dql_inputs()))
def test_dynamic_quantize_linear(case, tmp):
    x = _dql_inputs()[case]
    m = graph_model(
        [node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])],
        {"x": x},
        {},
        {"y": U8, "s": F32, "z": U8},
    )
    both(m, {"x": x}, tmp, exact=True)


def test_dynamic_quantize_linear_ties_round_to_even(tmp):
    # an oracle of our own as well: the ties must go to the even integer, not away from zero
    x = _dql_inputs()["ties"]
    m = graph_model([node("DynamicQuantizeLinear", ["x"], ["y", "s", "z"])], {"x": x}, {},
                    {"y": U8, "s": F32, "z": U8})  # fmt: skip
    y, s, z = load(m, tmp).run({"x": x})
    assert s == F32(0.125) and z == 40
    want = np.clip(np.round(x.astype(np.float64) / 0.125) + 40, 0, 255)  # numpy: half to even
    np.testing.assert_array_equal(y, want.astype(U8))
    assert (np.abs(x / 0.125 - np.floor(x / 0.125) - 0.5) == 0).sum() > 100  # real ties


# --------------------------------------------------------------------------- MatMulInteger
MATMUL_SHAPES = [((5, 8), (8, 3)), ((7, 3, 16), (16, 5)), ((2, 4, 6), (2, 6, 3)), ((6,), (6, 4))]


@pytest.mark.parametrize("sa, sb", MATMUL_SHAPES)
@pytest.mark.parametrize("b_dtype", [U8, I8])
@pytest.mark.parametrize("b_const", [True, False])
def test_matmul_integer(sa, sb, b_dtype, b_const, tmp):
    a = rand_u8(sa, 1)
    b = rand_u8(sb, 2) if b_dtype == U8 else rand_i8(sb, 2)
    za, zb = np.array(117, U8), np.array(3 if b_dtype == U8 else -2, b_dtype)
    feeds = {"a": a, "za": za}
    consts = {"zb": zb}
    (consts if b_const else feeds)["b"] = b
    m = graph_model([node("MatMulInteger", ["a", "b", "za", "zb"])], feeds, consts, {"y": I32})
    (y,) = both(m, feeds, tmp, exact=True)
    want = (a.astype(np.int64) - 117) @ (b.astype(np.int64) - zb.astype(np.int64))
    np.testing.assert_array_equal(y, want)


def test_matmul_integer_per_column_zero_point_and_no_zero_points(tmp):
    a, b = rand_u8((4, 6), 3), rand_u8((6, 5), 4)
    zb = np.array([0, 7, 255, 128, 1], U8)
    m = graph_model([node("MatMulInteger", ["a", "b", "", "zb"])], {"a": a}, {"b": b, "zb": zb},
                    {"y": I32})  # fmt: skip
    both(m, {"a": a}, tmp, exact=True)
    m = graph_model([node("MatMulInteger", ["a", "b"])], {"a": a}, {"b": b}, {"y": I32})
    both(m, {"a": a}, tmp, exact=True)


def test_matmul_integer_float64_path_and_int32_wrap(tmp):
    # K * 255 * max|b - zb| >= 2**24: the exact float64 product instead of the float32 one
    a, b = rand_u8((3, 300), 12), rand_u8((300, 4), 13)
    m = graph_model([node("MatMulInteger", ["a", "b"])], {"a": a}, {"b": b}, {"y": I32})
    (y,) = both(m, {"a": a}, tmp, exact=True)
    np.testing.assert_array_equal(y, a.astype(np.int64) @ b.astype(np.int64))
    # sums past 2**31 wrap in int32, as onnxruntime's accumulators do
    a, b = np.full((1, 33100), 255, U8), np.full((33100, 2), 255, U8)
    m = graph_model([node("MatMulInteger", ["a", "b"])], {"a": a}, {"b": b}, {"y": I32})
    (y,) = both(m, {"a": a}, tmp, exact=True)
    assert y[0, 0] == np.int64(255 * 255 * 33100) - (1 << 32)


def test_matmul_integer_int8_a(tmp):
    a, b = rand_i8((3, 7), 5, 127), rand_i8((7, 2), 6, 127)
    m = graph_model([node("MatMulInteger", ["a", "b"])], {"a": a}, {"b": b}, {"y": I32})
    both(m, {"a": a}, tmp, exact=True)


# ------------------------------------------------------------------------- DequantizeLinear
@pytest.mark.parametrize("dtype", [U8, I8, I32])
@pytest.mark.parametrize(
    "shape, axis, per_axis",
    [((7,), 0, False), ((3, 4), 1, False), ((3, 4), 1, True), ((2, 3, 5), 0, True),
     ((2, 3, 5), -1, True), ((6,), 0, True)],
)  # fmt: skip
@pytest.mark.parametrize("with_zp", [True, False])
def test_dequantize_linear(dtype, shape, axis, per_axis, with_zp, tmp):
    rng = np.random.default_rng(11)
    lo, hi = (0, 256) if dtype == U8 else (-128, 128) if dtype == I8 else (-(1 << 30), 1 << 30)
    x = rng.integers(lo, hi, size=shape).astype(dtype)
    n = shape[axis] if per_axis else 1
    scale = rng.uniform(0.001, 0.1, n).astype(F32)
    zp = rng.integers(lo // 2, hi // 2, size=n).astype(dtype)
    if not per_axis:
        scale, zp = scale.reshape(()), zp.reshape(())
    ins = ["x", "s", "z"] if with_zp else ["x", "s"]
    m = graph_model([node("DequantizeLinear", ins, axis=axis)], {"x": x}, {"s": scale, "z": zp},
                    {"y": F32})  # fmt: skip
    both(m, {"x": x}, tmp, exact=True)


@pytest.mark.parametrize(
    "xshape, sshape, zshape", [((2, 3), (1,), ()), ((2, 3), (), (1,)), ((), (1,), ()), ((), (1,), (1,))]
)  # fmt: skip
def test_dequantize_linear_per_tensor_forms_mix(xshape, sshape, zshape, tmp):
    # a one-element scale beside a scalar zero point (and the reverse) is one per-tensor pair to
    # onnxruntime; leanrnn refused the first two, and a [1] scale of a scalar x failed to run
    x = np.asarray(rand_u8(xshape, 3))
    consts = {"s": np.full(sshape, 0.25, F32), "z": np.full(zshape, 7, U8)}
    m = graph_model([node("DequantizeLinear", ["x", "s", "z"])], {"x": x}, consts, {"y": F32})
    (got,) = both(m, {"x": x}, tmp, exact=True)
    assert got.shape == xshape


# ------------------------------------------------ MatMulIntegerToFloat, DynamicQuantizeMatMul
@pytest.mark.parametrize("sa, sb", MATMUL_SHAPES[:3])
@pytest.mark.parametrize("b_dtype", [U8, I8])
@pytest.mark.parametrize("bias", [True, False])
def test_matmul_integer_to_float(sa, sb, b_dtype, bias, tmp):
    a = rand_u8(sa, 7)
    b = rand_u8(sb, 8) if b_dtype == U8 else rand_i8(sb, 8)
    consts = {
        "b": b,
        "sa": np.array(0.0213, F32),
        "sb": np.array(0.0031, F32),
        "za": np.array(121, U8),
        "zb": np.array(5 if b_dtype == U8 else 0, b_dtype),
        "bias": np.linspace(-1, 1, sb[-1]).astype(F32),
    }
    ins = ["a", "b", "sa", "sb", "za", "zb"] + (["bias"] if bias else [])
    m = graph_model([helper.make_node("MatMulIntegerToFloat", ins, ["y"], domain=MS)],
                    {"a": a}, consts, {"y": F32}, ms=True)  # fmt: skip
    both(m, {"a": a}, tmp)


@pytest.mark.parametrize("sa, sb", MATMUL_SHAPES[:3])
@pytest.mark.parametrize("b_dtype", [U8, I8])
@pytest.mark.parametrize("bias", [True, False])
def test_dynamic_quantize_matmul(sa, sb, b_dtype, bias, tmp):
    a = (np.random.default_rng(9).standard_normal(sa) * 2).astype(F32)
    b = rand_u8(sb, 10) if b_dtype == U8 else rand_i8(sb, 10)
    consts = {
        "b": b,
        "sb": np.array(0.0047, F32),
        "zb": np.array(9 if b_dtype == U8 else 0, b_dtype),
        "bias": np.linspace(-1, 1, sb[-1]).astype(F32),
    }
    ins = ["a", "b", "sb", "zb"] + (["bias"] if bias else [])
    m = graph_model([helper.make_node("DynamicQuantizeMatMul", ins, ["y"], domain=MS)],
                    {"a": a}, consts, {"y": F32}, ms=True)  # fmt: skip
    both(m, {"a": a}, tmp)


@pytest.mark.parametrize(
    "op, ins, consts, err, match",
    [
        ("MatMulInteger", ["f", "b"], {"b": np.ones((6, 2), U8)}, DTypeError, "A has dtype float32"),
        ("MatMulInteger", ["a", "b", "", "zb"], {"b": np.ones((6, 2), U8),
         "zb": np.ones(3, U8)}, LeanRNNError, "b_zero_point has shape"),
        ("MatMulInteger", ["a", "b"], {"b": np.ones((5, 2), U8)}, LeanRNNError, "inner dims"),
        ("MatMulIntegerToFloat", ["a", "b", "s", "s2"], {"b": np.ones((6, 2), U8),
         "s": np.ones(2, F32), "s2": np.ones((), F32)}, LeanRNNError, "a_scale has shape"),
        ("DynamicQuantizeMatMul", ["f", "b", "s"], {"b": np.ones((6, 2), U8),
         "s": np.ones((), np.float64)}, DTypeError, "b_scale has dtype float64"),
        ("DynamicQuantizeMatMul", ["f", "b", "s", "", "bias"], {"b": np.ones((6, 2), U8),
         "s": np.ones((), F32), "bias": np.ones(3, F32)}, LeanRNNError, "bias has shape"),
        ("DynamicQuantizeLinear", ["a"], {}, DTypeError, "x has dtype uint8"),
        ("DequantizeLinear", ["a", "s"], {"s": np.ones(4, F32)}, LeanRNNError,
         "x_scale has shape"),
        ("DequantizeLinear", ["a", "s", "z"], {"s": np.ones((), F32), "z": np.ones((), I8)},
         DTypeError, "x_zero_point has dtype int8"),
    ],
)  # fmt: skip
def test_quant_op_bad_inputs(op, ins, consts, err, match, tmp):
    feeds = {"a": rand_u8((4, 6), 0), "f": np.ones((4, 6), F32)}
    feeds = {k: v for k, v in feeds.items() if k in ins}
    domain = MS if op in ("MatMulIntegerToFloat", "DynamicQuantizeMatMul") else ""
    m = graph_model([helper.make_node(op, ins, ["y"], domain=domain, name="q")], feeds, consts,
                    {"y": F32}, ms=bool(domain))  # fmt: skip
    with pytest.raises(err, match=match) as e:
        load(m, tmp).run(feeds)
    assert "'q'" in str(e.value)


# ---------------------------------------------------- DynamicQuantizeLSTM files from torch
try:
    import torch
except ImportError:  # pragma: no cover - CI installs torch
    torch = None
needs_torch = pytest.mark.skipif(torch is None, reason="needs torch")


def tagger(cell, C, H, layers, bi, classes=5):
    """torch RNN (``cell``) -> Linear head, in eval mode."""

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = getattr(torch.nn, cell)(C, H, num_layers=layers, bidirectional=bi)
            self.head = torch.nn.Linear(H * (2 if bi else 1), classes)

        def forward(self, x):
            y, _ = self.rnn(x)
            return self.head(y)

    return Tagger().eval()


def quantized_file(tmp, cell="LSTM", C=6, H=12, layers=1, bi=False, dynamo=False,
                   seed=0, **qopts):  # fmt: skip
    """(float32 torch model, path of its quantize_dynamic'd ONNX file; int8 weights unless
    ``qopts`` says otherwise)."""
    from onnxruntime.quantization import QuantType, quantize_dynamic

    torch.manual_seed(seed)
    model = tagger(cell, C, H, layers, bi)
    tag = f"{cell}{C}_{H}_{layers}_{bi}_{dynamo}_{seed}_{sorted(qopts.items())}".replace(" ", "")
    f32 = torch_export(model, (torch.zeros(9, 3, C),), tmp / f"{tag}.onnx", dynamo,
                       names=(["x"], ["y"]), dynamic={"x": {0: "T", 1: "N"}})  # fmt: skip
    out = tmp / f"{tag}.q.onnx"
    qopts.setdefault("weight_type", QuantType.QInt8)
    quantize_dynamic(str(f32), str(out), **qopts)
    return model, str(out)


def run_all(model, path, x):
    """(leanrnn, onnxruntime, float32 torch) outputs on ``x``."""
    got = leanrnn.load(path).run({"x": x})[0]
    sess = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    want = sess.run(None, {"x": x})[0]
    with torch.no_grad():
        ref = model(torch.from_numpy(x)).numpy()
    return got, want, ref


def ops_of(path) -> set[str]:
    return {n.op_type for n in onnx.load(path).graph.node}


@needs_torch
@pytest.mark.parametrize(
    "layers, bi, dynamo, per_channel",
    [(1, False, False, False), (2, False, False, False), (1, True, False, False),
     (2, True, False, True), (2, False, True, False), (1, True, True, True)],
)  # fmt: skip
def test_quantized_lstm_matches_onnxruntime(layers, bi, dynamo, per_channel, tmp):
    model, path = quantized_file(tmp, layers=layers, bi=bi, dynamo=dynamo,
                                 per_channel=per_channel, reduce_range=True)  # fmt: skip
    assert {"DynamicQuantizeLSTM", "DynamicQuantizeLinear", "MatMulInteger"} <= ops_of(path)
    x = np.random.default_rng(1).standard_normal((9, 3, 6)).astype(F32)
    got, want, ref = run_all(model, path, x)
    assert got.shape == want.shape == ref.shape
    # onnxruntime quantizes X and every step's h to uint8 inside DynamicQuantizeLSTM; leanrnn
    # keeps them float32 (see tolerances.ATOL_ORT_DYNAMIC_QUANT)
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL_ORT_DYNAMIC_QUANT[F32])
    # both against the float32 model: leanrnn rounds the weights (and the head's input, as
    # onnxruntime does); onnxruntime the LSTM's activations as well
    assert np.abs(got - ref).max() <= ATOL_WEIGHT_QUANT_INT8[F32]
    assert np.abs(want - ref).max() <= ATOL_ORT_DYNAMIC_QUANT[F32]


@needs_torch
def test_quantized_file_then_leanrnn_int8_weights(tmp):
    """The README's path to int8 kernels for such a file: load, then leanrnn.quantize. Its
    weights are re-rounded to leanrnn's per-column int8 scales, so it stays within the int8
    weight bound of the float32 model and of onnxruntime on the same file."""
    model, path = quantized_file(tmp, layers=2, bi=True, reduce_range=True)
    x = np.random.default_rng(2).standard_normal((9, 3, 6)).astype(F32)
    q = leanrnn.quantize(leanrnn.load(path), "int8")
    got = q.run({"x": x})[0]
    _, want, ref = run_all(model, path, x)
    assert np.abs(got - ref).max() <= ATOL_WEIGHT_QUANT_INT8[F32]
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL_ORT_DYNAMIC_QUANT[F32])


@needs_torch
def test_quantized_lstm_uint8_weights(tmp):
    # QUInt8: uint8 weights with a per-tensor zero point, in the LSTM and the head
    from onnxruntime.quantization import QuantType

    model, path = quantized_file(tmp, layers=2, bi=True, reduce_range=True, seed=2,
                                 weight_type=QuantType.QUInt8)  # fmt: skip
    x = np.random.default_rng(1).standard_normal((9, 3, 6)).astype(F32)
    got, want, ref = run_all(model, path, x)
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL_ORT_DYNAMIC_QUANT[F32])
    assert np.abs(got - ref).max() <= ATOL_WEIGHT_QUANT_INT8[F32]


@needs_torch
def test_quantized_lstm_default_options_accuracy(tmp):
    # quantize_dynamic's defaults (full-range int8 weights): onnxruntime's AVX2 path saturates
    # there (module docstring; measured up to 0.1 off the float32 model at these sizes on an
    # AVX2 CPU, where leanrnn was <= 2.5e-3), so only leanrnn's accuracy is asserted
    model, path = quantized_file(tmp, layers=2, bi=True, seed=3)
    x = np.random.default_rng(2).standard_normal((20, 2, 6)).astype(F32)
    got, _, ref = run_all(model, path, x)
    assert np.abs(got - ref).max() <= ATOL_WEIGHT_QUANT_INT8[F32]


@needs_torch
def test_quantized_gru_model_keeps_float_gru(tmp):
    # quantize_dynamic leaves GRU (and RNN) nodes float32 and quantizes only the head
    model, path = quantized_file(tmp, cell="GRU", layers=2, reduce_range=True)
    ops = ops_of(path)
    assert "GRU" in ops and "MatMulInteger" in ops and not any("Quantize" in o and "GRU" in o
                                                                 for o in ops)  # fmt: skip
    x = np.random.default_rng(4).standard_normal((9, 3, 6)).astype(F32)
    got, want, ref = run_all(model, path, x)
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL_ORT_DYNAMIC_QUANT[F32])
    assert np.abs(got - ref).max() <= ATOL_WEIGHT_QUANT_INT8[F32]


@needs_torch
@pytest.mark.parametrize("per_channel", [False, True])
def test_onnxruntime_fused_heads(per_channel, tmp):
    # onnxruntime's optimizer fuses the head into DynamicQuantizeMatMul (or
    # MatMulIntegerToFloat); a model saved after optimization loads too
    model, path = quantized_file(tmp, layers=1, reduce_range=True, seed=5,
                                 per_channel=per_channel)  # fmt: skip
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    fused = str(tmp / f"fused{per_channel}.onnx")
    opts.optimized_model_filepath = fused
    ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    ops = ops_of(fused)
    assert ops & {"DynamicQuantizeMatMul", "MatMulIntegerToFloat"}, ops
    x = np.random.default_rng(6).standard_normal((9, 3, 6)).astype(F32)
    got, want, _ = run_all(model, fused, x)
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL_ORT_DYNAMIC_QUANT[F32])
    plain = leanrnn.load(path).run({"x": x})[0]
    np.testing.assert_allclose(got, plain, rtol=0, atol=ATOL_ORT_DYNAMIC_QUANT[F32])
    # the fused head's int8 weights are parameters, its scales and zero points not (B was
    # left out and b_zero_point counted in DynamicQuantizeMatMul)
    want = sum(p.numel() for p in model.parameters())
    assert leanrnn.load(fused).describe(1, 4)["parameters"] == want


# ------------------------------------------------------ DynamicQuantizeLSTM nodes by hand
def qlstm(C=5, H=4, D=1, wdtype=U8, per_column=False, zp=None, seed=0, drop=(), **over):
    """A model of one DynamicQuantizeLSTM node (Y, Y_h, Y_c out) with random weights, biases
    and peepholes; ``over`` replaces initializers by name (W, R, B, P, W_scale, W_zero_point,
    R_scale, R_zero_point) or, for "attrs", the attributes; ``drop`` leaves inputs out."""
    rng = np.random.default_rng(seed)
    G = 4 * H
    q = (lambda s: rand_u8(s, seed)) if wdtype == U8 else (lambda s: rand_i8(s, seed))
    sshape = (D, G) if per_column else (D,)
    zp = (128 if wdtype == U8 else 0) if zp is None else zp
    consts = {
        "W": q((D, C, G)),
        "R": q((D, H, G)),
        "B": rng.uniform(-0.3, 0.3, (D, 8 * H)).astype(F32),
        "P": rng.uniform(-0.3, 0.3, (D, 3 * H)).astype(F32),
        "W_scale": rng.uniform(0.002, 0.006, sshape).astype(F32),
        "W_zero_point": np.full(sshape, zp, wdtype),
        "R_scale": rng.uniform(0.002, 0.006, sshape).astype(F32),
        "R_zero_point": np.full(sshape, zp, wdtype),
    }
    consts.update({k: v for k, v in over.items() if k != "attrs"})
    names = ["x", "W", "R", "B", "", "", "", "P", "W_scale", "W_zero_point", "R_scale",
             "R_zero_point"]  # fmt: skip
    names = ["" if n in drop else n for n in names]
    attrs = over.get("attrs", {"hidden_size": H, "direction": "bidirectional" if D == 2 else
                               "forward"})  # fmt: skip
    n = helper.make_node("DynamicQuantizeLSTM", names, ["Y", "Y_h", "Y_c"], name="qlstm",
                         domain=MS, **attrs)  # fmt: skip
    x = rng.standard_normal((6, 2, C)).astype(F32)
    consts = {k: v for k, v in consts.items() if k in names}
    m = graph_model([n], {"x": x}, consts, {"Y": F32, "Y_h": F32, "Y_c": F32}, ms=True)
    return m, x


@pytest.mark.parametrize("wdtype", [U8, I8])
@pytest.mark.parametrize("per_column", [False, True])
@pytest.mark.parametrize("D", [1, 2])
def test_dynamic_quantize_lstm_node(wdtype, per_column, D, tmp):
    # uint8 weights with zero point 128 (the quantizer's QUInt8), int8 with 0 (QInt8); per
    # direction or per column scales; bias, peepholes, both directions
    m, x = qlstm(D=D, wdtype=wdtype, per_column=per_column, seed=D)
    got = load(m, tmp).run({"x": x})
    want = run_ort(m, {"x": x})
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape
        np.testing.assert_allclose(g, w, rtol=0, atol=ATOL_ORT_DYNAMIC_QUANT[F32])


def test_dynamic_quantize_lstm_zero_point_is_applied(tmp):
    # a per-tensor non-zero int8 zero point (onnxruntime honours it): dropping it changes the
    # output far beyond the tolerance, so the comparison sees the zero point
    m, x = qlstm(wdtype=I8, zp=-20, seed=4)
    got = load(m, tmp).run({"x": x})[0]
    want = run_ort(m, {"x": x})[0]
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL_ORT_DYNAMIC_QUANT[F32])
    m0, _ = qlstm(wdtype=I8, zp=0, seed=4)
    assert np.abs(load(m0, tmp).run({"x": x})[0] - want).max() > ATOL_ORT_DYNAMIC_QUANT[F32]


def test_dynamic_quantize_lstm_weights_in_one_place(tmp):
    # the int8 values and scales reach the engine through quantized_lstm_weights only
    m, _ = qlstm(D=2, wdtype=I8, per_column=True)
    g = read_onnx(save(m, tmp))
    assert [n.op for n in g.nodes] == ["LSTM"] and list(g.packed) == ["qlstm"]
    consts = {t.name: numpy_helper.to_array(t) for t in m.graph.initializer}
    raw = Node(QLSTM, "qlstm", tuple(m.graph.node[0].input), ("Y",),
               {"hidden_size": 4, "direction": "bidirectional"})  # fmt: skip
    W, R, _ = quantized_lstm_weights(Graph([], [], [raw], consts), raw, "here")
    assert W.q.dtype == np.int8 and W.scale.shape == (2, 16) and R.q.shape == (2, 4, 16)
    Wf = dequantize(W)
    np.testing.assert_array_equal(
        Wf, (consts["W"].astype(F32) * consts["W_scale"][:, None, :]).transpose(0, 2, 1)
    )


BAD_QLSTM = [
    ("float W", dict(W=np.ones((1, 5, 16), F32)), DTypeError, "W has dtype float32"),
    ("W shape", dict(W=np.ones((1, 16, 5), U8)), WeightsError, r"W has shape \[1, 16, 5\]"),
    ("R shape", dict(R=np.ones((1, 5, 16), U8)), WeightsError, r"R has shape \[1, 5, 16\]"),
    ("scale shape", dict(W_scale=np.ones((1, 4), F32)), WeightsError, "W_scale has shape"),
    ("scale dtype", dict(R_scale=np.ones(1, np.float64)), DTypeError, "R_scale has dtype"),
    ("zp dtype", dict(W_zero_point=np.zeros(1, I8)), DTypeError, "W_zero_point has dtype int8"),
    ("zp shape", dict(R_zero_point=np.zeros((1, 3), U8)), WeightsError, "R_zero_point has shape"),
    ("zp varies", dict(per_column=True, W_zero_point=np.arange(16, dtype=U8)[None]),
     WeightsError, "W_zero_point differs between columns"),
    ("int8 column zp", dict(per_column=True, W=np.ones((1, 5, 16), I8),
                            W_zero_point=np.full((1, 16), 3, I8)),
     WeightsError, "W_zero_point is per column and non-zero"),
    # per-column scales beside per-direction zero points (and the reverse): onnxruntime read
    # the zero points in the scales' layout and ran another direction's numbers
    ("layouts differ", dict(W_zero_point=np.full((1, 16), 128, U8)), WeightsError,
     r"W_scale has shape \[1\] and W_zero_point \[1, 16\]; expected one layout"),
    ("layouts differ 2", dict(per_column=True, R_zero_point=np.full(1, 128, U8)), WeightsError,
     r"R_scale has shape \[1, 16\] and R_zero_point \[1\]"),
    ("inf scale", dict(R_scale=np.array([np.inf], F32)), WeightsError, "R_scale holds non-finite"),
    # a finite scale whose weights are not: 1e37 * 100 made inf weights and NaN outputs
    ("overflowing scale", dict(W_scale=np.array([1e37], F32)), WeightsError,
     r"W_scale \* \(W - W_zero_point\) overflows float32"),
    ("W and R types", dict(W=np.ones((1, 5, 16), I8), W_zero_point=np.zeros(1, I8)), DTypeError,
     "W is int8 and R is uint8; DynamicQuantizeLSTM takes one type"),
    ("no hidden_size", dict(attrs={}), ModelFormatError, "hidden_size=None"),
    ("layout", dict(attrs={"hidden_size": 4, "layout": 1}), ModelFormatError, "layout=1"),
    ("unknown attribute", dict(attrs={"hidden_size": 4, "peepholes": 1}), ModelFormatError,
     r"attributes \['peepholes'\]"),
    ("direction", dict(attrs={"hidden_size": 4, "direction": "bidirectional"}), WeightsError,
     r"W has shape \[1, 5, 16\]; expected \[D=2"),
]  # fmt: skip


@pytest.mark.parametrize("what, over, err, match", BAD_QLSTM, ids=[b[0] for b in BAD_QLSTM])
def test_dynamic_quantize_lstm_bad_files(what, over, err, match, tmp):
    m, _ = qlstm(**over)
    with pytest.raises(err, match=match) as e:
        leanrnn.load(save(m, tmp))
    assert "'qlstm'" in str(e.value)


def test_dynamic_quantize_lstm_missing_or_computed_inputs(tmp):
    m, _ = qlstm(drop=("W_scale",))
    with pytest.raises(ModelFormatError, match=r"no W_scale \(input 8\)"):
        leanrnn.load(save(m, tmp))
    m, x = qlstm()
    del m.graph.node[0].input[11:]  # R_zero_point gone: 11 inputs
    with pytest.raises(ModelFormatError, match="has 11 inputs; expected 12"):
        leanrnn.load(save(m, tmp))
    m, x = qlstm()  # R fed at run time
    r = next(t for t in m.graph.initializer if t.name == "R")
    m.graph.input.append(helper.make_tensor_value_info("R", r.data_type, list(r.dims)))
    m.graph.initializer.remove(r)
    with pytest.raises(ModelFormatError, match="R 'R' is computed at run time"):
        leanrnn.load(save(m, tmp))
    ok, x = qlstm()  # and the session still works after the errors
    assert load(ok, tmp).run({"x": x})[0].shape == (6, 1, 2, 4)


@needs_torch
@pytest.mark.parametrize("dynamo", [False, True])
def test_quantized_tagger_with_embedding(dynamo, tmp):
    # Embedding -> 2 x LSTM -> Linear: quantize_dynamic quantizes the embedding table too
    # (Gather from int8, then DequantizeLinear)
    from onnxruntime.quantization import QuantType, quantize_dynamic

    torch.manual_seed(8)
    model = torch_tagger(vocab=23, emb=6, hidden=12, classes=5).eval()
    tokens = np.random.default_rng(9).integers(0, 23, size=(9, 3)).astype(np.int64)
    f32 = torch_export(model, (torch.from_numpy(tokens),), tmp / f"tagger{dynamo}.onnx", dynamo,
                       names=(["x"], ["y"]), dynamic={"x": {0: "T", 1: "N"}})  # fmt: skip
    path = str(tmp / f"tagger{dynamo}.q.onnx")
    quantize_dynamic(str(f32), path, weight_type=QuantType.QInt8, reduce_range=True)
    assert {"DequantizeLinear", "DynamicQuantizeLSTM"} <= ops_of(path)
    got, want, ref = run_all(model, path, tokens)
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL_ORT_DYNAMIC_QUANT[F32])
    assert np.abs(got - ref).max() <= ATOL_WEIGHT_QUANT_INT8[F32]


@needs_torch
def test_quantized_file_converts_to_lrnn(tmp):
    # .onnx -> .lrnn: the lowered LSTMs as packed float32 weights, the head's int8 constants
    # and quantized ops as they are; the same outputs bit for bit
    model, path = quantized_file(tmp, layers=2, bi=True, reduce_range=True, seed=6)
    native = leanrnn.convert(path, str(tmp / "q.lrnn"))
    x = np.random.default_rng(7).standard_normal((9, 3, 6)).astype(F32)
    np.testing.assert_array_equal(leanrnn.load(native).run({"x": x})[0],
                                  leanrnn.load(path).run({"x": x})[0])  # fmt: skip


@needs_torch
@pytest.mark.parametrize("per_channel", [False, True])
def test_quantized_file_counts_the_parameters_torch_counts(per_channel, tmp):
    # describe()/inspect counted float constants only: the uint8 embedding table and the int8
    # head weight of quantize_dynamic's file were left out and their scales counted (1,231 of
    # torch's 1,439); scales and zero points are not parameters, the 8-bit weights are
    from onnxruntime.quantization import quantize_dynamic

    torch.manual_seed(0)
    model = torch_tagger(20, 6, 9, 5)  # embedding -> 2-layer LSTM -> linear
    f32 = torch_export(model, (torch.randint(0, 20, (4, 2)),), tmp / f"emb{per_channel}.onnx",
                       False, names=(["tok"], ["y"]), dynamic={"tok": {0: "T", 1: "N"}})  # fmt: skip
    q = str(tmp / f"emb{per_channel}.q.onnx")
    quantize_dynamic(str(f32), q, per_channel=per_channel)
    assert {"DequantizeLinear", "MatMulInteger", "DynamicQuantizeLSTM"} <= ops_of(q)
    want = sum(p.numel() for p in model.parameters())
    assert leanrnn.load(q).describe(1, 4)["parameters"] == want
    assert leanrnn.load(str(f32)).describe(1, 4)["parameters"] == want
