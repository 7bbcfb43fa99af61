"""Files from ``onnxruntime.quantization.quantize_dynamic``: DynamicQuantizeLSTM (lowered to a
float32 LSTM of the dequantized weights) and the dynamic-quantization graph ops around heads
(DynamicQuantizeLinear, MatMulInteger, MatMulIntegerToFloat, DynamicQuantizeMatMul), each against
onnxruntime running the same file, plus the accuracy of both against the float32 model.

onnxruntime's u8s8 GEMMs on CPUs without VNNI (AVX2) add pairs of uint8 x int8 products in int16
with saturation (``vpmaddubsw``), so with int8 weights beyond [-64, 64] their results are not
the exact integer products; leanrnn computes them exactly (the ONNX result, and onnxruntime's on
VNNI and ARM). Tests that compare with onnxruntime therefore keep int8 weights in [-64, 64]:
``quantize_dynamic(reduce_range=True)``, onnxruntime's own advice for such CPUs.
"""

from __future__ import annotations

import numpy as np
import pytest

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from _onnx_graphs import assert_same, load, node, run_ort, save  # noqa: E402
from onnx import helper, numpy_helper  # noqa: E402
from tolerances import ATOL_ORT_DYNAMIC_QUANT, ATOL_WEIGHT_QUANT_INT8  # noqa: E402

import leanrnn  # noqa: E402
from leanrnn.errors import DTypeError, LeanRNNError, ModelFormatError, WeightsError  # noqa: E402

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


def test_matmul_integer_int8_a(tmp):
    a, b = rand_i8((3, 7), 5, 127), rand_i8((7, 2), 6, 127)
    m = graph_model([node("MatMulInteger", ["a", "b"])], {"a": a}, {"b": b}, {"y": I32})
    both(m, {"a": a}, tmp, exact=True)


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
torch = pytest.importorskip("torch")
from helpers import torch_export  # noqa: E402
from onnxruntime.quantization import QuantType, quantize_dynamic  # noqa: E402


class Tagger(torch.nn.Module):
    def __init__(self, cell, C, H, layers, bi, classes=5):
        super().__init__()
        self.rnn = getattr(torch.nn, cell)(C, H, num_layers=layers, bidirectional=bi)
        self.head = torch.nn.Linear(H * (2 if bi else 1), classes)

    def forward(self, x):
        y, _ = self.rnn(x)
        return self.head(y)


def quantized_file(tmp, cell="LSTM", C=6, H=12, layers=1, bi=False, dynamo=False,
                   seed=0, **qopts):  # fmt: skip
    """(float32 torch model, path of its quantize_dynamic'd ONNX file)."""
    torch.manual_seed(seed)
    model = Tagger(cell, C, H, layers, bi).eval()
    tag = f"{cell}{C}_{H}_{layers}_{bi}_{dynamo}_{seed}_{sorted(qopts.items())}".replace(" ", "")
    f32 = torch_export(model, (torch.zeros(9, 3, C),), tmp / f"{tag}.onnx", dynamo,
                       names=(["x"], ["y"]), dynamic={"x": {0: "T", 1: "N"}})  # fmt: skip
    out = tmp / f"{tag}.q.onnx"
    quantize_dynamic(str(f32), str(out), weight_type=QuantType.QInt8, **qopts)
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


def test_quantized_lstm_default_options_accuracy(tmp):
    # quantize_dynamic's defaults (full-range int8 weights): onnxruntime's AVX2 path saturates
    # there (module docstring; measured up to 0.1 off the float32 model at these sizes on an
    # AVX2 CPU, where leanrnn was <= 2.5e-3), so only leanrnn's accuracy is asserted
    model, path = quantized_file(tmp, layers=2, bi=True, seed=3)
    x = np.random.default_rng(2).standard_normal((20, 2, 6)).astype(F32)
    got, _, ref = run_all(model, path, x)
    assert np.abs(got - ref).max() <= ATOL_WEIGHT_QUANT_INT8[F32]


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


def test_onnxruntime_fused_heads(tmp):
    # onnxruntime's optimizer fuses the head into DynamicQuantizeMatMul (or
    # MatMulIntegerToFloat); a model saved after optimization loads too
    model, path = quantized_file(tmp, layers=1, reduce_range=True, seed=5)
    opts = ort.SessionOptions()
    opts.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_EXTENDED
    fused = str(tmp / "fused.onnx")
    opts.optimized_model_filepath = fused
    ort.InferenceSession(path, opts, providers=["CPUExecutionProvider"])
    ops = ops_of(fused)
    assert ops & {"DynamicQuantizeMatMul", "MatMulIntegerToFloat"}, ops
    x = np.random.default_rng(6).standard_normal((9, 3, 6)).astype(F32)
    got, want, _ = run_all(model, fused, x)
    np.testing.assert_allclose(got, want, rtol=0, atol=ATOL_ORT_DYNAMIC_QUANT[F32])
    plain = leanrnn.load(path).run({"x": x})[0]
    np.testing.assert_allclose(got, plain, rtol=0, atol=ATOL_ORT_DYNAMIC_QUANT[F32])
