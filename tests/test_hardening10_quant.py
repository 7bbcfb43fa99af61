"""Hardening, tenth pass: reduced precision against an independent float64 oracle and against
itself across kernel paths (a red team's sweep). Each test failed before its fix."""

from __future__ import annotations

import numpy as np
import pytest

import leanrnn
from helpers import tile_gemm
from leanrnn.errors import DTypeError, ModelFormatError, WeightsError
from leanrnn.formats import quantize as qz
from leanrnn.formats.packing import LayerWeights, pack
from leanrnn.kernels.abi import DOT_NARROW_QMAX, DOT_QMAX, B
from leanrnn.spec import RNNSpec
from test_quant_dynamic import _dot_operands

F32 = np.float32


# ------------------------------------------------ int8-dynamic's int32 sums: a width bound
def _wide_rnn(C: int) -> leanrnn.Model:
    """An RNN of one unit over C inputs, every weight 1e-5: on all-ones input the
    pre-activation is C * 1e-5 (positive: the codes' products all add up)."""
    spec = RNNSpec("rnn", C, 1, bias=False)
    w = LayerWeights(np.full((1, C), 1e-5, F32), np.zeros((1, 1), F32), np.zeros(1, F32),
                     np.zeros(1, F32))  # fmt: skip
    return leanrnn.Model(pack(spec, [[w]]))


def test_int8_dynamic_refuses_a_layer_wider_than_its_int32_sums_hold():
    """RNN(140000, 1): the int32 sum of 140000 products of up to 128 x 127 wrapped around, and
    the output came back -0.852 where tanh(1.4) = 0.885, silently."""
    most = qz.dot_exact_inputs()
    assert most == (2**31 - 1) // (128 * DOT_QMAX) == 132104
    m = _wide_rnn(most + 1)
    with pytest.raises(DTypeError, match="int32"):
        leanrnn.quantize(m, "int8-dynamic")
    q7 = leanrnn.quantize(m, "int8-dynamic", reduce_range=True)  # 7-bit codes: twice as wide
    y = q7(np.ones((1, 1, most + 1), F32))[0]
    np.testing.assert_allclose(y, np.tanh((most + 1) * 1e-5), atol=2e-3)
    w8 = leanrnn.quantize(m, "int8")  # weight-only int8 sums float32: no such bound
    np.testing.assert_allclose(w8(np.ones((1, 1, most + 1), F32))[0], np.tanh((most + 1) * 1e-5),
                               atol=1e-4)  # fmt: skip


def test_a_file_of_int8_dynamic_weights_too_wide_for_int32_is_refused(tmp_path, monkeypatch):
    m = _wide_rnn(qz.dot_exact_inputs() + 1)
    monkeypatch.setattr(qz, "_check_dot_inputs", lambda *a: None)  # as another writer would
    path = tmp_path / "wide.lrnn"
    leanrnn.quantize(m, "int8-dynamic").save(path)
    monkeypatch.undo()
    with pytest.raises(ModelFormatError, match="int32"):
        leanrnn.load(path)


# -------------------------------------- one answer on every path: the store's rounding
@pytest.mark.parametrize("qmax", [DOT_QMAX, DOT_NARROW_QMAX], ids=["8-bit", "7-bit"])
def test_the_integer_tiles_give_the_same_bits_on_every_path(qmax):
    """Every path sums the same int32s, but the store's sum * scale + bias was fused into one
    FMA by LLVM on some tiles and not others: outputs of the same model differed by up to
    1.8e-7 between the VNNI and AVX2 paths (the README: "the same on every CPU"). One FMA
    everywhere now, so the bits agree."""
    rng = np.random.default_rng(11)
    runs = {name: tile_gemm(name) for name in ("avx512", "avx2", "sse")}
    bias = rng.standard_normal(4 * B).astype(F32)
    for K in (11, 37, 100):
        panel, _, A, _ = _dot_operands(rng, K, 7, qmax=qmax)
        for nvec in (1, 4):
            for M in (1, 7):
                C0 = rng.standard_normal((M, nvec * B)).astype(F32)
                for mode in (0, 1, 2):
                    outs = {}
                    for name, run in runs.items():
                        C = C0.copy()
                        run(nvec, panel, panel.shape[1] * panel.shape[2], A[:M], 0, M, K, C,
                            mode, bias)  # fmt: skip
                        outs[name] = C
                    want = _fma_store(panel, A[:M], K, nvec, C0, mode, bias)
                    for name, got in outs.items():
                        np.testing.assert_array_equal(got, want,
                                                      err_msg=f"{name} K={K} M={M} mode {mode}")  # fmt: skip


def _fma_store(panel, A, K, nvec, C0, mode, bias) -> np.ndarray:
    """The store as one FMA, from the exact int32 sums: float32(sum) * float32(s_row * s_col)
    + init rounded once (a sum below 2**24 is exact in float32, its product with a float32
    exact in float64, and the float64 add rounds only at ties before the one float32
    rounding). The AMX store is the same code (_qdot.store_row); this CPU has no AMX tile to
    run it on."""
    q, s, _ = qz.dot_codes(panel)
    M, cols = A.shape[0], nvec * B
    codes = A[:, :K].astype(np.int64) - 128
    tot = codes @ q[1, :K, :cols].astype(np.int64)  # panel 1, as the runs read it
    assert np.abs(tot).max() < 2**24  # exact as a float32, as the tile converts it
    s_row = A[:, -4:].copy().view(F32)[:, 0]
    scale = (s_row[:, None] * s[1][None, :cols]).astype(F32)  # one float32 product, as the tile
    init = {0: np.zeros((M, cols)), 1: C0.astype(np.float64), 2: bias[:cols].astype(np.float64)}
    return (tot.astype(np.float64) * scale + init[mode]).astype(F32)


# ------------------------------------------------------------- bf16's range
def test_bf16_refuses_weights_it_would_round_to_infinity():
    """A finite weight of 3.4e38 became inf in bf16; times the zero low half of an activation
    (1.0 = hi 1.0 + lo 0) that is NaN: the default path returned NaN where float32, torch and
    the AVX2 path returned 1.0."""
    spec = RNNSpec("rnn", 1, 1)
    big = LayerWeights(np.full((1, 1), 3.4e38, F32), np.zeros((1, 1), F32), np.zeros(1, F32),
                       np.zeros(1, F32))  # fmt: skip
    m = leanrnn.Model(pack(spec, [[big]]))
    for mode in ("bf16", "bf16-act"):
        with pytest.raises(WeightsError, match="bfloat16"):
            leanrnn.quantize(m, mode)
    ok = LayerWeights(
        np.full((1, 1), 3.38e38, F32), np.zeros((1, 1), F32), np.zeros(1, F32), np.zeros(1, F32)
    )  # fmt: skip  (rounds to bfloat16's largest, finite)
    q = leanrnn.quantize(leanrnn.Model(pack(spec, [[ok]])), "bf16")
    assert q(np.ones((1, 1, 1), F32))[0].item() == 1.0


# --------------------------------------------------- DynamicQuantizeLinear of -inf
def test_dynamic_quantize_linear_of_an_infinite_range_as_onnxruntime(tmp_path):
    """[1, -inf, -2, 3]: the zero point is -(-inf) / inf = NaN, which onnxruntime's clamp
    (std::min(255, NaN)) reads as 255; leanrnn cast NaN to a zero point of 0 (all codes 0)."""
    pytest.importorskip("onnxruntime")
    from _onnx_graphs import assert_same, model, node, run_ort
    from _onnx_graphs import load as load_graph

    x = np.array([1, -np.inf, -2, 3], F32)
    m = model([node("DynamicQuantizeLinear", ["x"], ["q", "s", "z"])], {"x": x}, opset=13)
    got = load_graph(m, tmp_path).run({"x": x})
    for g, w in zip(got, run_ort(m, {"x": x}), strict=True):
        assert_same(g, w)


def test_mixed_precision_training_refuses_weights_bf16_cannot_hold():
    """The same range check where autocast rounds the master weights after each update, named
    for the trainer (and without temporaries of the weights' size)."""
    from leanrnn.train import Trainer

    m = leanrnn.LSTM(4, 8, seed=0)
    m.weights.layers[0][0].Wt[0, 0, 0] = 3.4e38
    tr = Trainer(m, autocast="bf16")
    with pytest.raises(WeightsError, match=r"\[Trainer \(autocast\)\].*bfloat16"):
        tr.forward(np.ones((3, 2, 4), F32))
