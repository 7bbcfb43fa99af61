"""Reduced-precision weights (leanrnn.quantize, issue 14): bf16 and int8 W/R panels, float32
activations and sums (bf16-act: the activations rounded to bfloat16 too). The kernels against
the float64 oracle run on weights rounded the same way (computed here from the canonical
weights, independently of the packing), the formats' rounding bounds, .lrnn round trips and
bad input."""

from __future__ import annotations

import dataclasses
import json
import pickle
import struct
from pathlib import Path

import numba
import numpy as np
import pytest

import leanrnn
from helpers import random_layers, tile_gemm
from leanrnn.errors import DTypeError, ModelFormatError, WeightsError
from leanrnn.formats import native
from leanrnn.formats.packing import SCALE_ROWS, pack
from leanrnn.formats.quantize import (
    Int8LayerWeights,
    bf16_panel,
    bf16_round,
    bf16_value,
    dequantize_panel,
    pack_int8,
    panel_scales,
    quantize_packed,
)
from leanrnn.kernels import _cpu
from leanrnn.kernels._bf16amx import split_rows
from leanrnn.kernels.abi import SPLIT_MIN_ROWS, B, split_min_rows, split_row_floats
from leanrnn.kernels.gemm import round_rows
from leanrnn.kernels.reference import reference_forward
from leanrnn.spec import RNNSpec
from tolerances import (
    ATOL_BF16_ACT,
    ATOL_REDUCED,
    ATOL_SAME_ARITHMETIC,
    INT8_HALF_STEP,
    RTOL_BF16_ROUNDING,
)

PRECISIONS = ["bf16", "int8"]
PANEL = {"bf16": np.uint16, "int8": np.int8}


# ------------------------------------------------------------------------ the oracle's weights
def _bf16(w: np.ndarray) -> np.ndarray:
    """Round to nearest bfloat16, ties to even, in float64 arithmetic on the value (not on the
    bits, as the library does): the two must agree."""
    w = np.asarray(w, np.float64)
    m, e = np.frexp(w)  # w = m * 2**e, 0.5 <= |m| < 1: 8 significant bits keep m to 2**-8
    return np.ldexp(np.round(m * 256.0) / 256.0, e)  # np.round: half to even


def _int8(w: np.ndarray) -> np.ndarray:
    """Per row (output unit and gate): s = max|w| / 127 (as float32), q = round(w / s)."""
    w = np.asarray(w, np.float64)
    s = (np.abs(w).max(axis=1) / 127).astype(np.float32).astype(np.float64)[:, None]
    q = np.clip(np.rint(np.divide(w, s, out=np.zeros_like(w), where=s > 0)), -127, 127)
    return q * s


def rounded(layers, precision):
    f = _bf16 if precision == "bf16" else _int8
    return [[dataclasses.replace(lw, W=f(lw.W), R=f(lw.R)) for lw in d] for d in layers]


SPECS = [
    RNNSpec("lstm", 5, 16),  # H on the panel width
    RNNSpec("lstm", 7, 19, num_layers=2, direction="bidirectional"),  # off it; 2 layers
    RNNSpec("lstm", 6, 13, proj_size=5, peepholes=True, clip=2.0),  # the per-gate path
    RNNSpec("gru", 5, 16, direction="reverse"),
    RNNSpec("gru", 7, 21, num_layers=2, direction="bidirectional", linear_before_reset=False),
    RNNSpec("rnn", 5, 32),
    RNNSpec("rnn", 9, 17, num_layers=2, direction="bidirectional", batch_first=True),
]


def _check(spec, precision, seed, N, T, threads=None, longest_first=False):
    rng = np.random.default_rng(seed)
    layers = random_layers(spec, rng, np.float32, scale=0.3)
    model = leanrnn.quantize(leanrnn.Model(pack(spec, layers, np.float32)), precision)
    model.session.threads = threads
    K, H = spec.output_size, spec.hidden_size
    LD = spec.num_layers * spec.num_directions
    x = rng.standard_normal((N, T, spec.input_size) if spec.batch_first
                            else (T, N, spec.input_size)).astype(np.float32)  # fmt: skip
    lengths = rng.integers(0, T + 1, size=N)
    lengths[0] = T
    if longest_first:  # each step's GEMM rows shrink to the live ones (kernels.recurrent)
        lengths = np.linspace(T, 0, N).round().astype(np.int64)
    h0 = rng.standard_normal((LD, N, K)).astype(np.float32)
    c0 = rng.standard_normal((LD, N, H)).astype(np.float32) if spec.cell == "lstm" else None
    y, h_n, c_n = model.session.run(x, h0, c0, lengths)
    ry, rh, rc = reference_forward(spec, rounded(layers, precision), x, h0, c0, lengths)
    tol = ATOL_REDUCED[PANEL[precision]]
    np.testing.assert_allclose(y, ry, rtol=0, atol=tol)
    np.testing.assert_allclose(h_n, rh, rtol=0, atol=tol)
    if c_n is not None:
        np.testing.assert_allclose(c_n, rc, rtol=0, atol=tol)
    # ... and the test can fail: the float32 model is farther from the rounded oracle than that
    y32, _, _ = leanrnn.Model(pack(spec, layers, np.float32)).session.run(x, h0, c0, lengths)
    assert np.abs(y32 - ry).max() > tol


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_reduced_kernels_match_the_reference_on_the_same_rounded_weights(spec, precision):
    _check(spec, precision, 3, N=3, T=7)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("N, threads", [(21, 1), (21, 2), (50, 2)])
@pytest.mark.parametrize("spec", [*SPECS, RNNSpec("gru", 40, 70, linear_before_reset=False)],
                         ids=repr)  # fmt: skip
def test_reduced_weights_at_a_batch_match_the_reference(spec, N, threads, precision, many_cores):
    """A batch: on AMX (where this CPU has it) each step's operand and each projection chunk is
    split once into q (kernels.gemm.operand) and multiplied in blocks of 32 rows and a partial
    one (int8's codes widened to bfloat16); on 2 threads, 21 rows split every step's unit
    blocks, 50 take batch slices (_sync.share); K off and past 64 (H=70)."""
    _check(spec, precision, 6, N=N, T=5, threads=threads)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("N, threads", [(40, 1), (50, 2)])
@pytest.mark.parametrize("spec", [SPECS[1], SPECS[4]], ids=repr)
def test_reduced_rows_longest_first_match_the_reference(spec, N, threads, precision, many_cores):
    """Rows longest first: each step's GEMM runs up to the last live row only, so the rows
    split into q and multiplied (on AMX from 4 rows, in blocks of 32 and a partial one) shrink
    step by step, through the split threshold down to a lone row and none."""
    _check(spec, precision, 7, N=N, T=12, threads=threads, longest_first=True)


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("spec", [RNNSpec("lstm", 24, 96), RNNSpec("gru", 24, 80),
                                  RNNSpec("rnn", 24, 112, direction="bidirectional")],
                         ids=repr)  # fmt: skip
def test_reduced_kernels_on_two_threads(spec, precision, many_cores):
    """Big enough (threads.PARALLEL_MIN_MACS) that two threads split every step's blocks."""
    _check(spec, precision, 5, N=3, T=5, threads=2)


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_stream_of_single_steps_equals_one_run(precision):
    m = leanrnn.quantize(leanrnn.LSTM(6, 20, num_layers=2, seed=1), precision)
    x = np.random.default_rng(0).standard_normal((5, 2, 6)).astype(np.float32)
    y, _, _ = m.session.run(x)
    st = m.session.stream(batch=2)
    steps = np.stack([st.feed(x[t]) for t in range(5)])
    # a run's input projection tiles T*N rows, a step's N rows: the sums' order may differ
    np.testing.assert_allclose(steps, y, rtol=0, atol=ATOL_SAME_ARITHMETIC[np.float32])


def test_the_jit_backend_runs_reduced_jobs_too(monkeypatch):
    """The same jobs on numba's JIT (what runs where no C compiler is): one small cell."""
    monkeypatch.setattr(leanrnn.config, "_backend", "jit")
    _check(RNNSpec("rnn", 5, 17, direction="bidirectional"), "int8", 9, N=2, T=4)


# ------------------------------------------------------- every ISA's tile, on any machine (jit)
@pytest.mark.parametrize("name", ["avx2", "avx512", "sse"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_isa_tile_reads_reduced_panels(name, precision):
    """The AVX2 tile (the fallback everywhere) and the AVX-512 one, whatever this CPU has: the
    lone-row GEMV and several rows, one and four groups, the second panel of two (so an int8
    tile finds panel 1's scales, not panel 0's), modes 0 (zero), 1 (add to C) and 2 (bias);
    one to four groups."""
    run = tile_gemm(name)
    rng = np.random.default_rng(2)
    Wd, Kp, K = 4 * B, 16, 11
    w = rng.standard_normal((2, Kp, Wd)).astype(np.float32)
    w[:, K:] = 0
    if precision == "bf16":
        P, deq = bf16_panel(w), bf16_value(bf16_round(w)).astype(np.float64)
    else:
        pw = np.zeros((2, Kp + SCALE_ROWS, Wd), np.int8)
        from leanrnn.formats.quantize import _set_int8, int8_columns

        q, s = int8_columns(w)
        _set_int8(pw, q, s)
        P, deq = pw, q.astype(np.float64) * s.astype(np.float64)[:, None, :]
    bias = rng.standard_normal(Wd).astype(np.float32)
    for nvec in (1, 2, 3, 4):
        cols = nvec * B
        for M in (1, 7):
            A = rng.standard_normal((M, K)).astype(np.float32)
            C0 = rng.standard_normal((M, cols)).astype(np.float32)
            prod = A.astype(np.float64) @ deq[1, :K, :cols]
            for mode, init in ((0, 0.0), (1, C0.astype(np.float64)), (2, bias[:cols])):
                C = C0.copy()
                run(nvec, P, P.shape[1] * P.shape[2], A, 0, M, K, C, mode, bias)
                np.testing.assert_allclose(C, prod + init, rtol=0,
                                           atol=ATOL_REDUCED[PANEL[precision]] * 10)  # fmt: skip


# ------------------------------------------------------------------ the formats' own rounding
def test_bf16_rounds_to_nearest_even():
    one = 1.0
    ulp = 2.0**-7  # bf16 spacing at 1.0
    x = np.array([one + ulp / 2, one + 1.5 * ulp, one + ulp / 2 + 2**-20, -(one + ulp / 2),
                  np.inf, -np.inf, 0.0, -0.0, 3.4e38], np.float32)  # fmt: skip
    got = bf16_value(bf16_round(x))
    want = [one, one + 2 * ulp, one + ulp, -one, np.inf, -np.inf, 0.0, -0.0, np.inf]
    np.testing.assert_array_equal(got, np.array(want, np.float32))
    assert np.signbit(got[7])
    assert np.isnan(bf16_value(bf16_round(np.array([np.nan], np.float32))))


def test_quantize_then_dequantize_stays_within_the_format_bound():
    spec = RNNSpec("lstm", 13, 21, num_layers=2, direction="bidirectional")
    layers = random_layers(spec, np.random.default_rng(0), np.float32, scale=2.0)
    layers[0][0].R[3] = 0  # an all-zero row: scale 0, weights stay 0
    pw = pack(spec, layers, np.float32)
    for precision in PRECISIONS:
        back = quantize_packed(pw, precision).unpack()
        for d, dq in zip(layers, back, strict=True):
            for lw, lq in zip(d, dq, strict=True):
                for w, wq in ((lw.W, lq.W), (lw.R, lq.R)):
                    w64, err = w.astype(np.float64), np.abs(wq - w.astype(np.float64))
                    if precision == "bf16":
                        assert (err <= RTOL_BF16_ROUNDING * np.abs(w64)).all()
                        np.testing.assert_array_equal(wq, _bf16(w64))  # bits == value rounding
                    else:
                        step = np.abs(w64).max(axis=1, keepdims=True) / 127
                        assert (err <= INT8_HALF_STEP * step).all()
                        np.testing.assert_array_equal(wq.astype(np.float64), _int8(w64)
                                                      .astype(np.float32))  # fmt: skip
                    np.testing.assert_array_equal(wq[3] if w is layers[0][0].R else 0, 0)
                np.testing.assert_array_equal(lq.bW, lw.bW)  # biases stay float32, as they were


def test_packed_weights_shrink_to_a_half_and_a_quarter():
    spec = RNNSpec("lstm", 64, 128, num_layers=2)
    pw = pack(spec, random_layers(spec, np.random.default_rng(0)), np.float32)
    bf, i8 = quantize_packed(pw, "bf16"), quantize_packed(pw, "int8")
    assert bf.weight_bytes * 2 == pw.weight_bytes
    assert pw.weight_bytes / 4 < i8.weight_bytes < pw.weight_bytes / 4 * 1.05  # + scales
    assert i8.nbytes < pw.nbytes / 3  # one buffer, no float32 copy kept
    for q in (bf, i8):
        assert q.buffer.ctypes.data % 64 == 0
        assert all(v.base is not None for v in q.tensors().values())


def test_pack_int8_takes_quantized_weights_without_rounding_again():
    """The handover for importers of already-quantized models (DynamicQuantizeLSTM): the
    codes and per-row scales land in the panels as they are."""
    spec = RNNSpec("lstm", 6, 18, direction="bidirectional")
    rng = np.random.default_rng(4)
    layers = random_layers(spec, rng)
    G = spec.gate_width
    qlayers = [[Int8LayerWeights(
        rng.integers(-127, 128, (G, 6)).astype(np.int8), rng.random(G).astype(np.float32) / 50,
        rng.integers(-127, 128, (G, 18)).astype(np.int8), rng.random(G).astype(np.float32) / 50,
        lw.bW, lw.bR) for lw in d] for d in layers]  # fmt: skip
    pw = pack_int8(spec, qlayers)
    back = pw.unpack()
    for d, dq in zip(qlayers, back, strict=True):
        for q, lq in zip(d, dq, strict=True):
            np.testing.assert_array_equal(lq.W, (q.Wq * q.W_scale.astype(np.float64)[:, None])
                                          .astype(np.float32))  # fmt: skip
            np.testing.assert_array_equal(lq.R, (q.Rq * q.R_scale.astype(np.float64)[:, None])
                                          .astype(np.float32))  # fmt: skip
    again = quantize_packed(pw, "int8")  # not rounded again: a copy of the same bytes
    assert again is not pw and np.array_equal(again.buffer, pw.buffer)
    with pytest.raises(WeightsError, match="int8"):
        bad = [[dataclasses.replace(q, Wq=q.Wq.astype(np.int16)) for q in d] for d in qlayers]
        pack_int8(spec, bad)


# ------------------------------------------------------------------------------- files and API
@pytest.mark.parametrize("precision", [*PRECISIONS, "bf16-act"])
def test_lrnn_round_trip_is_bit_exact(tmp_path, precision):
    m = leanrnn.quantize(leanrnn.GRU(5, 19, num_layers=2, bidirectional=True, seed=0), precision)
    assert type(m) is leanrnn.GRU
    path = str(tmp_path / "q.lrnn")
    m.save(path)
    back = leanrnn.load(path)
    assert type(back) is leanrnn.GRU and back.weights.precision == precision
    assert back.weights.buffer.tobytes() == m.weights.buffer.tobytes()
    x = np.random.default_rng(0).standard_normal((4, 2, 5)).astype(np.float32)
    np.testing.assert_array_equal(back(x)[0], m(x)[0])
    info = back.describe(1, 10)
    assert info["precision"] == precision and info["panel_bytes"] == m.weights.weight_bytes


def test_graph_model_quantizes_its_rnn_nodes(tmp_path):
    """A GraphModel (here from a graph .lrnn): its packed RNN nodes run int8, the rest as is."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    C, H = 4, 16
    W = (rng.standard_normal((1, 4 * H, C)) * 0.3).astype(np.float32)
    R = (rng.standard_normal((1, 4 * H, H)) * 0.3).astype(np.float32)
    g = helper.make_graph(
        [helper.make_node("LSTM", ["x", "W", "R"], ["y", "h"], hidden_size=H)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "N", C])],
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, "N", H])],
        [numpy_helper.from_array(W, "W"), numpy_helper.from_array(R, "R")],
    )  # fmt: skip
    src = tmp_path / "m.onnx"
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17)]), src)
    m = leanrnn.load(str(src))
    q = leanrnn.quantize(m, "int8")
    assert type(q) is leanrnn.GraphModel
    assert [pw.precision for pw in q.graph.packed.values()] == ["int8"]
    assert [pw.precision for pw in m.graph.packed.values()] == ["float"]  # unchanged
    x = rng.standard_normal((6, 2, C)).astype(np.float32)
    spec = RNNSpec("lstm", C, H, bias=False)
    ordered = leanrnn.formats.packing.reorder_gates
    lw = leanrnn.LayerWeights(ordered(W[0], (0, 2, 3, 1), H), ordered(R[0], (0, 2, 3, 1), H),
                              np.zeros(4 * H, np.float32), np.zeros(4 * H, np.float32))  # fmt: skip
    _, rh, _ = reference_forward(spec, rounded([[lw]], "int8"), x)
    np.testing.assert_allclose(q(x), rh, rtol=0, atol=ATOL_REDUCED[np.int8])
    path = str(tmp_path / "q.lrnn")
    leanrnn.save(q, path)
    np.testing.assert_array_equal(leanrnn.load(path)(x), q(x))


def test_cli_convert_and_inspect(tmp_path, capsys):
    from leanrnn import cli

    src, dst = str(tmp_path / "a.lrnn"), str(tmp_path / "b.lrnn")
    leanrnn.LSTM(8, 32, seed=0).save(src)
    assert cli.main(["convert", src, dst, "--precision", "int8"]) == 0
    assert leanrnn.load(dst).weights.precision == "int8"
    capsys.readouterr()
    assert cli.main(["inspect", dst]) == 0
    assert "weight precision: int8" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        cli.main(["convert", src, dst, "--precision", "fp8"])
    assert e.value.code == 2
    with pytest.raises(DTypeError, match="'fp8'"):
        leanrnn.convert(src, dst, precision="fp8")


def test_bad_requests_are_clear_errors():
    m = leanrnn.LSTM(4, 8, seed=0)
    with pytest.raises(DTypeError, match=r"\[quantize\] precision 'fp8'"):
        leanrnn.quantize(m, "fp8")
    with pytest.raises(DTypeError, match="float32"):
        leanrnn.quantize(m.astype(np.float64), "int8")
    with pytest.raises(DTypeError, match="already"):
        quantize_packed(leanrnn.quantize(m, "bf16").weights, "int8")
    w = pack(m.spec, m.weights.unpack(), np.float32)
    w.layers[0][0].Rt[0, 0, 0] = np.nan
    with pytest.raises(WeightsError, match="finite"):
        quantize_packed(w, "int8")
    from leanrnn.train import Trainer

    with pytest.raises(DTypeError, match="float"):
        Trainer(leanrnn.quantize(m, "int8"))
    m(np.zeros((2, 1, 4), np.float32))  # the model still runs


# ---------------------------------------------------------------------------- corrupt files
def _rewrite(path, meta=None, shapes=None, data_edit=None):
    """Rewrite a safetensors file: ``meta`` entries replaced, tensor ``shapes`` replaced (their
    bytes cut or padded to fit), ``data_edit(name, bytes) -> bytes``."""
    raw = open(path, "rb").read()
    (n,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + n])
    data = raw[8 + n :]
    md = header.pop("__metadata__")
    md.update(meta or {})
    out, cursor = [], 0
    for name, e in sorted(header.items(), key=lambda kv: kv[1]["data_offsets"][0]):
        b = data[e["data_offsets"][0] : e["data_offsets"][1]]
        if shapes and name in shapes:
            e["shape"] = shapes[name]
            size = int(np.prod(shapes[name])) * np.dtype(native._ST_DTYPES[e["dtype"]]).itemsize
            b = (b + bytes(size))[:size]
        if data_edit:
            b = data_edit(name, b)
        e["data_offsets"] = [cursor, cursor + len(b)]
        cursor += len(b)
        out.append(b)
    header["__metadata__"] = md
    text = json.dumps(header).encode()
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(out))


@pytest.fixture
def int8_file(tmp_path):
    path = str(tmp_path / "q.lrnn")
    leanrnn.quantize(leanrnn.LSTM(5, 19, seed=0), "int8").save(path)
    return path


def test_a_file_with_scale_rows_missing_is_refused_before_reading(int8_file):
    """Rt declared without its scale rows: the layout check (shapes against the spec) refuses
    it before anything is allocated or read."""
    pw = leanrnn.load(int8_file).weights
    U, X, Wd = pw.layers[0][0].Rt.shape
    _rewrite(int8_file, shapes={"l0.d0.Rt": [U, X - SCALE_ROWS, Wd]})
    with pytest.raises(ModelFormatError, match="do not match"):
        native.load(int8_file, verify=False)


def test_a_file_with_corrupt_scales_is_refused(int8_file):
    def nan_scales(name, b):
        if name != "l0.d0.Wt":
            return b
        return b[: -4 * B] + np.full(B, np.nan, np.float32).tobytes()

    _rewrite(int8_file, data_edit=nan_scales)
    with pytest.raises(ModelFormatError, match="corrupt"):
        native.load(int8_file)
    with pytest.raises(ModelFormatError, match="int8 scales"):
        native.load(int8_file, verify=False)


@pytest.mark.parametrize("meta", [{"precision": "fp8"}, {"precision": "int8", "dtype": "float64"}])
def test_a_file_with_an_unknown_precision_is_refused(int8_file, meta):
    _rewrite(int8_file, meta=meta)
    with pytest.raises(ModelFormatError, match=r"precision|float32"):
        native.load(int8_file, verify=False)


def test_a_float_file_claiming_int8_is_refused(tmp_path):
    path = str(tmp_path / "f.lrnn")
    leanrnn.LSTM(5, 19, seed=0).save(path)
    _rewrite(path, meta={"precision": "int8"})
    with pytest.raises(ModelFormatError, match="do not match"):
        native.load(path, verify=False)


def test_scales_of_a_loaded_panel_are_where_the_kernel_reads_them(int8_file):
    pw = leanrnn.load(int8_file).weights
    Rt = pw.layers[0][0].Rt
    s = panel_scales(Rt)
    q = Rt[:, : Rt.shape[1] - SCALE_ROWS].astype(np.float64)
    # every column's largest code is +-127 (or the column is all zero)
    assert ((np.abs(q).max(axis=1) == 127) | (s == 0)).all()
    assert (s > 0).any()


# --------------------------------------------------------------- bf16 panels in input pairs
def _tile_and_split(dot, one_term):
    """(the AVX-512 tile with bf16 / int8 panels' rows on ``dot``, split_rows jitted), skipped
    where ``dot`` is AMX and this CPU (or process) cannot run AMX-BF16."""
    if dot == "amx" and _cpu.bf16_dot(_cpu.ISAS["avx512"]) != "amx":
        pytest.skip("this CPU (or process) has no AMX-BF16; the fma case covers the tile")
    if dot == "dpbf16" and not _cpu.has_avx512_bf16():
        pytest.skip("this CPU has no AVX512-BF16; the fma case covers the tile")
    split = numba.njit(lambda A, K, out: split_rows(A, 0, A.shape[0], K, out, one_term))
    return tile_gemm("avx512", bf16=dot), split


def _within(C, want, bound):
    """C non-finite exactly where ``want`` is, and within ``bound`` of it elsewhere."""
    np.testing.assert_array_equal(np.isfinite(C), np.isfinite(want))
    ok = np.isfinite(want)
    err = np.abs(C[ok] - want[ok])
    assert (err <= bound[ok]).all(), err.max()


@pytest.mark.parametrize("dot, one_term", [("fma", False), ("amx", False), ("amx", True),
                                           ("dpbf16", False), ("dpbf16", True)])  # fmt: skip
def test_bf16_rows_in_whole_tiles_match_float64(dot, one_term):
    """The bf16 tile at several rows: on AMX (the operand split into two bf16 terms as
    gemm.operand does, or rounded to one for bf16-act, the scratch past its rows NaN; tile
    products of 32 inputs, K off 32; rows in blocks of 32 and a last 1..31; fewer than
    SPLIT_MIN_ROWS rows on the float32 tile), with vdpbf16ps on the same operands (tiles of
    6 rows and a last 1..5, pairs of inputs, K odd) and on the float32 tile, against float64 on the
    same rounded weights (and for one term the same rounded activations), tightly: the
    roundings are the oracle's too; a row of inf and one of NaN stay non-finite where
    float64's do. The second panel of two, so the AMX block's tail copy of the last k step
    reads the right panel's rows."""
    run, split = _tile_and_split(dot, one_term)
    rng = np.random.default_rng(4)
    Wd = 4 * B
    for K in (11, 37, 64, 100, 300):
        Kp = (K + 15) // 16 * 16
        w = rng.standard_normal((2, Kp, Wd)).astype(np.float32)
        w[:, K:] = 0
        P, deq = bf16_panel(w), bf16_value(bf16_round(w)).astype(np.float64)
        bias = rng.standard_normal(Wd).astype(np.float32)
        for nvec in (1, 2, 3, 4):
            cols = nvec * B
            for M in (1, 3, 5, 16, 35, 64):
                A = rng.standard_normal((M, K)).astype(np.float32)
                A[min(1, M - 1), 5] = np.inf
                if M > 1:
                    A[M - 2, 0] = np.nan
                C0 = rng.standard_normal((M, cols)).astype(np.float32)
                # split as gemm.operand splits: on AMX from 4 rows, on vdpbf16ps every row
                amx = dot != "fma" and M >= split_min_rows(dot)
                A64 = _bf16(A) if amx and one_term else A.astype(np.float64)
                with np.errstate(invalid="ignore"):
                    prod = A64 @ deq[1, :K, :cols]
                # the split's 2**-16 per product (none for one term: bf16 x bf16 is exact)
                # and float32 sums' rounding, per output
                with np.errstate(invalid="ignore"):
                    mags = np.abs(A64) @ np.abs(deq[1, :K, :cols])
                operand = A
                if amx:  # as gemm.operand hands it over
                    ld = split_row_floats(K, one_term)
                    q = np.full((M + 31) // 32 * 32 * 4 * ld, 0xFF, np.uint8)  # NaN past M
                    split(A, K, q)
                    operand = q.view(np.float32).reshape(-1, ld)
                for mode, init in ((0, 0.0), (1, C0.astype(np.float64)), (2, bias[:cols])):
                    C = C0.copy()
                    run(nvec, P, P.shape[1] * P.shape[2], operand, 0, M, K, C, mode, bias)
                    want = prod + init
                    split_err = 0.0 if one_term else 2.0**-16
                    _within(C, want, (split_err + (K + 2) * 2.0**-24) * (mags + np.abs(init)))


@pytest.mark.parametrize("dot", ["fma", "amx"])
def test_int8_rows_in_whole_tiles_match_float64(dot):
    """The weight-only int8 tile at several rows: on AMX (4 rows or more: the operand split
    into two bf16 terms as gemm.operand does, the scratch past its rows NaN; the codes widened
    to bfloat16 a column pair and _bf16amx.KCH inputs at a time, so K = 600 and 1100 take 2
    and 3 chunks, the later ones adding to C) and on the float32 tile, against float64 on the
    same codes and scales, within the split's 2**-16 and float32's sums; K ending on a chunk
    and odd in a later one (1024, 513); row blocks of 32 with last blocks of 3, 4 and 18 rows;
    the second panel of two (its own scales), and a slice from its third group (v0 = 2, the
    GRU's n columns); a row of inf and one of NaN stay non-finite where float64's do."""
    from leanrnn.formats.quantize import _set_int8, int8_columns

    run, split = _tile_and_split(dot, False)
    rng = np.random.default_rng(5)
    Wd = 4 * B
    for K in (11, 37, 300, 513, 600, 1024, 1100):
        Kp = (K + 15) // 16 * 16
        w = rng.standard_normal((2, Kp, Wd)).astype(np.float32)
        w[:, K:] = 0
        P = np.zeros((2, Kp + SCALE_ROWS, Wd), np.int8)
        codes, scales = int8_columns(w)
        _set_int8(P, codes, scales)
        deq = codes.astype(np.float64) * scales.astype(np.float64)[:, None, :]
        bias = rng.standard_normal(Wd).astype(np.float32)
        for nvec, v0 in ((1, 0), (3, 0), (4, 0), (2, 2)):
            cols = slice(v0 * B, (v0 + nvec) * B)
            for M in (3, 5, 35, 50, 64):
                A = rng.standard_normal((M, K)).astype(np.float32)
                A[1, 5] = np.inf
                A[M - 2, 0] = np.nan
                C0 = rng.standard_normal((M, nvec * B)).astype(np.float32)
                with np.errstate(invalid="ignore"):
                    prod = A.astype(np.float64) @ deq[1, :K, cols]
                    mags = np.abs(A.astype(np.float64)) @ np.abs(deq[1, :K, cols])
                operand = A
                if dot == "amx" and M >= SPLIT_MIN_ROWS:  # as gemm.operand hands it over
                    ld = split_row_floats(K)
                    q = np.full((M + 31) // 32 * 32 * 4 * ld, 0xFF, np.uint8)  # NaN past M
                    split(A, K, q)
                    operand = q.view(np.float32).reshape(-1, ld)
                for mode, init in ((0, 0.0), (1, C0.astype(np.float64)), (2, bias[cols])):
                    C = C0.copy()
                    poff = P.shape[1] * P.shape[2] + v0 * B
                    run(nvec, P, poff, operand, 0, M, K, C, mode, bias[v0 * B :])
                    want = prod + init
                    _within(C, want, (2.0**-16 + (K + 4) * 2.0**-24) * (mags + np.abs(init)))


@pytest.mark.parametrize("precision", ["bf16", "int8"])
def test_batches_get_their_split_operands_scratch(precision):
    """Where bf16 (AMX or vdpbf16ps) or int8 (AMX) GEMMs of 4 rows or more multiply a split
    operand (kernels.gemm.operand), each op's q is in the plan, sized for the split rows;
    without it the kernels would take the float32 tile instead, right and slower, and every
    accuracy test would still pass."""
    from leanrnn.engine.session import split_scratch_bytes, splits_operand

    if not splits_operand(precision):
        pytest.skip(f"{precision} runs the float32 tile on this CPU (or process)")
    spec = RNNSpec("gru", 40, 70, num_layers=2)
    model = leanrnn.quantize(leanrnn.Model(pack(spec, random_layers(spec, np.random.default_rng(0),
                                                                    np.float32), np.float32)),
                             precision)  # fmt: skip
    N, T = 50, 5
    q = {b.name: b.nbytes for b in model.session.buffers(N, T) if b.name.startswith("q.")}
    threads = leanrnn.config.max_threads()
    assert q == {f"q.{k}": threads * split_scratch_bytes(spec, k, T * N, N) for k in (0, 1)}
    # a stream's lone row: split on vdpbf16ps (a register tile), not on AMX (a 16-row tile
    # product for one row: the float32 tile's GEMV instead); room for the widest input, the
    # rows rounded up to 32 as gemm.operand asks
    dot = _cpu.bf16_dot(_cpu.isa())
    q1 = {b.name: b.nbytes for b in model.session.buffers(1, 1) if b.name.startswith("q.")}
    if dot == "dpbf16":
        assert q1 == {f"q.{k}": threads * 32 * 4 * split_row_floats(70) for k in (0, 1)}
    else:
        assert q1 == {}


def _specials(rng, rows, K):
    """float32 rows with ties, subnormals, the largest finite values, inf and NaNs (one with
    its payload in the low 16 bits alone) among random ones."""
    A = (rng.standard_normal((rows, K)) * 3).astype(np.float32)
    bits = [0x3F808000, 0x3F818000, 0xBF808000, 0x00000001, 0x807FFFFF, 0x7F7FFFFF,
            0x7F7F7FFF, 0x7F800000, 0xFF800000, 0x7FC00000, 0x7F800001, 0x00800000]  # fmt: skip
    A[0, : len(bits)] = np.array(bits, np.uint32).view(np.float32)
    return A


def test_round_rows_rounds_to_nearest_bfloat16():
    """bf16-act's operand for the float32 tile (kernels.gemm.round_rows): nearest bfloat16,
    ties to even, as the float64 oracle rounds; subnormals to a zero of their sign, past the
    largest bfloat16 to inf, inf kept, NaN (even one whose payload lies in the low bits
    alone) NaN; rows from i0, K of a longer row."""
    rng = np.random.default_rng(8)
    A = _specials(rng, 7, 37)
    A[2:, :33] = _specials(rng, 5, 33)  # rows from i0, each K = 33 of its 37
    out = np.full(5 * 33 * 4, 0xFF, np.uint8)
    round_rows(A, 2, 7, 33, out)
    got = out.view(np.float32).reshape(5, 33)
    src = A[2:7, :33]
    tiny = np.abs(src) < np.finfo(np.float32).tiny
    with np.errstate(over="ignore", invalid="ignore"):
        want = np.where(tiny, np.copysign(0.0, src), _bf16(src)).astype(np.float32)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(src))
    ok = ~np.isnan(src)
    np.testing.assert_array_equal(got[ok], want[ok])
    assert np.array_equal(np.signbit(got[ok]), np.signbit(want[ok]))
    assert (got.view(np.uint32) & 0xFFFF == 0).all()  # bfloat16 values
    if _cpu.bf16_dot(_cpu.ISAS["avx512"]) == "amx":  # the same bits as AMX's conversion
        split = numba.njit(lambda A, K, out: split_rows(A, 2, 7, K, out, True))
        q = np.zeros(5 * 4 * split_row_floats(33, True), np.uint8)
        split(A, 33, q)
        hi = q.view(np.uint16).reshape(5, -1)[:, :33].astype(np.uint32) << 16
        np.testing.assert_array_equal(hi, got.view(np.uint32))


ACT_SPECS = [
    RNNSpec("lstm", 5, 16),
    RNNSpec("lstm", 6, 13, proj_size=5),  # the projection's weights stay float32: not rounded
    RNNSpec("gru", 7, 21, direction="bidirectional", linear_before_reset=False),  # r*h too
    RNNSpec("gru", 40, 70),
    RNNSpec("rnn", 9, 17, direction="bidirectional", batch_first=True),
]


@pytest.mark.parametrize("N, threads", [(1, 1), (3, 1), (21, 1), (21, 2), (50, 2)])
@pytest.mark.parametrize("spec", ACT_SPECS, ids=repr)
def test_bf16_act_rounds_every_operand_on_every_path(spec, N, threads, many_cores):
    """bf16-act: x, h and the GRU's r*h rounded to bfloat16 before every product with W and
    R, on AMX (4 rows or more, one tile product) and on the float32 tile (fewer rows, or a
    CPU without AMX: kernels.gemm.round_rows) alike, on 1 and 2 threads. One step from
    float32 states, so that the kernels and the oracle round the very same numbers: tightly
    against the float64 oracle that rounds them, far from the one that does not."""
    rng = np.random.default_rng(9)
    layers = random_layers(spec, rng, np.float32, scale=0.3)
    model = leanrnn.quantize(leanrnn.Model(pack(spec, layers, np.float32)), "bf16-act")
    model.session.threads = threads
    shape = (N, 1, spec.input_size) if spec.batch_first else (1, N, spec.input_size)
    x = rng.standard_normal(shape).astype(np.float32)
    h0 = rng.standard_normal((spec.num_directions, N, spec.output_size)).astype(np.float32)
    c0 = None
    if spec.cell == "lstm":
        c0 = rng.standard_normal((1, N, spec.hidden_size)).astype(np.float32)
    y, h_n, c_n = model.session.run(x, h0, c0)
    weights = rounded(layers, "bf16")
    ry, rh, rc = reference_forward(spec, weights, x, h0, c0, operand=_bf16)
    tol = ATOL_BF16_ACT[np.float32]
    np.testing.assert_allclose(y, ry, rtol=0, atol=tol)
    np.testing.assert_allclose(h_n, rh, rtol=0, atol=tol)
    if c_n is not None:
        np.testing.assert_allclose(c_n, rc, rtol=0, atol=tol)
    assert np.abs(y - reference_forward(spec, weights, x, h0, c0)[0]).max() > 10 * tol


def test_bf16_act_runs_a_batch_as_its_rows_one_by_one(many_cores):
    """The activations are rounded whichever tile multiplies them, so a batch (on AMX: one
    tile product per tile) gives each sample what it gets alone (the float32 tile): bf16-act's
    results do not depend on the batch. One step from given states: over more steps a float32
    sum's last bit, which differs between the tiles, may move an h across a rounding boundary
    (~5e-5 later), which is not a difference of the mode."""
    m = leanrnn.quantize(leanrnn.LSTM(12, 40, seed=3), "bf16-act")
    m.session.threads = 2
    rng = np.random.default_rng(3)
    x = rng.standard_normal((1, 21, 12)).astype(np.float32)
    h0, c0 = (rng.standard_normal((1, 21, 40)).astype(np.float32) for _ in range(2))
    y = m.session.run(x, h0, c0)[0]
    alone = np.concatenate([m.session.run(*(np.ascontiguousarray(a[:, n : n + 1])
                                            for a in (x, h0, c0)))[0]
                            for n in range(21)], 1)  # fmt: skip
    np.testing.assert_allclose(y, alone, rtol=0, atol=ATOL_BF16_ACT[np.float32])
    # ... and bf16, whose activations keep float32's accuracy, is farther from it than that
    b = leanrnn.quantize(leanrnn.LSTM(12, 40, seed=3), "bf16")
    assert np.abs(y - b.session.run(x, h0, c0)[0]).max() > 10 * ATOL_BF16_ACT[np.float32]


def test_bf16_and_bf16_act_share_their_panels():
    """Between the two bf16 precisions quantize copies the panels (no second rounding); a
    bf16-act file stores bf16's panels."""
    m = leanrnn.LSTM(6, 20, seed=2)
    b, a = leanrnn.quantize(m, "bf16"), leanrnn.quantize(m, "bf16-act")
    assert a.weights.buffer.tobytes() == b.weights.buffer.tobytes()
    again = leanrnn.quantize(b, "bf16-act")
    assert again.weights.precision == "bf16-act"
    assert again.weights.buffer.tobytes() == b.weights.buffer.tobytes()
    assert again.weights.buffer is not b.weights.buffer
    out = quantize_packed(m.weights, "bf16-act")  # refilled in place, as training's roundings
    out.buffer[:] = 0
    assert quantize_packed(b.weights, "bf16-act", out=out) is out
    assert out.buffer.tobytes() == b.weights.buffer.tobytes()
    with pytest.raises(DTypeError, match="already"):
        leanrnn.quantize(a, "int8")


def test_bf16_panels_hold_input_pairs():
    """Row k2 of a bf16 panel holds each column's inputs 2*k2 and 2*k2 + 1 side by side (what
    AMX's B tiles and the float32 tile's pair loads read), and dequantize inverts it."""
    w = np.arange(2 * 4 * 16, dtype=np.float32).reshape(2, 4, 16)  # exact in bf16
    P = bf16_panel(w)
    assert P.shape == (2, 2, 32)
    assert bf16_value(P[1, 1, 2 * 5 : 2 * 5 + 2]).tolist() == [w[1, 2, 5], w[1, 3, 5]]
    np.testing.assert_array_equal(dequantize_panel(P, "bf16"), w)


DATA = Path(__file__).parent / "data"


def test_a_bf16_file_or_pickle_without_its_layout_is_refused():
    """Written by leanrnn at commit 56323a9 (``quantize(LSTM(5, 19, num_layers=2, seed=0),
    "bf16")``, saved and pickled), before bf16 panels held input pairs: no "bf16_layout". Such
    files were written in two column orders (e8fb2ae's, then 8da5a98's) that the bytes cannot
    tell apart; read as the later one, e8fb2ae's computed garbage (0.5-7.7 off), so both are
    refused, naming what to do. A pickle made now round-trips as it is."""
    path = str(DATA / "lstm_bf16_before_pairs.lrnn")
    assert "bf16_layout" not in native._Container(path, "test").metadata
    for verify in (True, False):
        with pytest.raises(ModelFormatError, match=r"without a bf16_layout.*quantize the float32"):
            leanrnn.load(path, verify=verify)
    with pytest.raises(WeightsError, match="a pickle of bf16 weights without a bf16_layout"):
        pickle.loads((DATA / "lstm_bf16_before_pairs.pkl").read_bytes())
    m = leanrnn.quantize(leanrnn.LSTM(5, 19, num_layers=2, seed=0), "bf16")
    np.testing.assert_array_equal(pickle.loads(pickle.dumps(m.weights)).buffer, m.weights.buffer)


def test_a_bf16_file_with_weights_past_its_inputs_is_refused(tmp_path):
    """AMX multiplies the panel's padding by zero activations: an inf there would be NaN."""
    path = str(tmp_path / "b.lrnn")
    leanrnn.quantize(leanrnn.LSTM(5, 19, seed=0), "bf16").save(path)

    def inf_padding(name, b):  # Wt: K = 5 inputs, pair row 2 holds inputs 4 and 5
        if name != "l0.d0.Wt":
            return b
        a = np.frombuffer(b, np.uint16).copy()
        a[2 * 2 * 4 * B + 1] = 0x7F80  # input 5 of column 0: +inf
        return a.tobytes()

    _rewrite(path, data_edit=inf_padding)
    with pytest.raises(ModelFormatError, match="past its 5 inputs"):
        native.load(path, verify=False)
