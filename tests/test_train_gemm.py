"""Training's big products on either GEMM (engine.products: the engine's packed tile or numpy's
BLAS, measured per machine): both give torch's gradients, on every machine whatever it picks,
across the shapes the native path treats apart (GRU's 48-column weight panels in 64-column
product panels, input widths off the panel, chunks of the steps' rows, threads), and the
choice itself is measured, remembered and overridable."""

from __future__ import annotations

import json

import numpy as np
import pytest

import leanrnn
from leanrnn.engine import products
from leanrnn.engine.products import PANEL, PackedMatmul, pack_columns, packed_product
from leanrnn.train import Trainer
from leanrnn.train import session as train_session
from test_train import assert_wide_case_matches_torch
from tolerances import RTOL_GRAD

torch = pytest.importorskip("torch")

GEMMS = ["native", "blas"]


@pytest.fixture(params=GEMMS)
def gemm(request, monkeypatch):
    monkeypatch.setenv(products.ENV_GEMM, request.param)
    return request.param


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("cell", "kw"), [
    ("LSTM", {"bidirectional": True}),
    ("LSTM", {"proj_size": 40, "num_layers": 2}),
    ("GRU", {"num_layers": 2}),
    ("GRU", {"bidirectional": True, "bias": False}),
    ("RNN", {"num_layers": 2, "bidirectional": True}),
])  # fmt: skip
@pytest.mark.parametrize(("gemm", "path"), [
    ("native", "in_place"), ("native", "packed"), ("native", "packed_chunks"), ("blas", None),
])  # fmt: skip
@pytest.mark.parametrize("recompute", [False, True])
def test_float32_gradients_match_torch_on_either_gemm(cell, kw, threads, gemm, path, recompute,
                                                       monkeypatch):  # fmt: skip
    """H = 72 (GRU: 3 x 16 = 48-column weight panels, the last padded), C = 7 and layer inputs
    of 144 (dx's last 64-column panel through the tail), N = 30 with ragged lengths. On the
    native GEMM the weight gradients read x, h_prev and G in place (kernels.gemm
    .weight_gradient: these rows of G are narrow) or, as wide layers do, packed: then with
    "packed_chunks" a few steps' rows per product (the chunk loop); storing, x^T and h_prev^T
    are transposed together (G packed once), recomputing one at a time."""
    if recompute and kw.get("bidirectional"):
        pytest.skip("recompute=True needs a forward stack (the other cases run it)")
    monkeypatch.setenv(products.ENV_GEMM, gemm)
    if path in ("packed", "packed_chunks"):
        monkeypatch.setattr(train_session, "_L1_WAY", 0)
    if path == "packed_chunks":
        monkeypatch.setattr(train_session, "_GEMM_AT_BYTES", 3000)
    assert train_session.Trainer(leanrnn.LSTM(3, 4))._native_gemm() == (gemm == "native")
    assert_wide_case_matches_torch(cell, kw, torch.float32, threads=threads, recompute=recompute,
                                   segment=4)  # fmt: skip


@pytest.mark.parametrize("cell", ["lstm", "gru"])
@pytest.mark.parametrize("chunk_bytes", [None, 5000, 200])
def test_recompute_equals_storing_to_the_bit_on_the_native_gemm(cell, chunk_bytes, monkeypatch):
    """In place (None) and packed: storing transposes x and h_prev together, recomputing one
    at a time (its plan has room for one): the chunks of rows, and so the sums, are the same
    (200 bytes: chunks of 2 rows, shorter than a segment's 9)."""
    monkeypatch.setenv(products.ENV_GEMM, "native")
    if chunk_bytes:
        monkeypatch.setattr(train_session, "_L1_WAY", 0)
        monkeypatch.setattr(train_session, "_GEMM_AT_BYTES", chunk_bytes)
    rng = np.random.default_rng(0)
    m = {"lstm": leanrnn.LSTM, "gru": leanrnn.GRU}[cell](5, 24, num_layers=2, seed=2)
    x = rng.standard_normal((11, 3, 5)).astype(np.float32)
    out = []
    for rec in (False, True):
        tr = Trainer(m, segment=3, recompute=rec)
        tape = tr.forward(x, lengths=[11, 6, 9])
        dx, dh0, _ = tr.backward(tape, np.ones_like(tape.y))
        out.append((dx, dh0, tr.grad.buffer.copy()))
    for a, b in zip(*out, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_an_infinite_input_leaves_the_padding_gradients_zero_on_both_paths(cell, monkeypatch):
    """H = 20 (units 20..31 of each gate pad the 16-unit blocks): an inf in x makes the
    padding units' gate columns of x^T G NaN (inf times their zero gradients); they stay 0 in
    the gradient panels in place as packed, and the real gradients agree between the paths,
    NaN for NaN (the weight gradients' weight_gradient job against packed products)."""
    monkeypatch.setenv(products.ENV_GEMM, "native")
    rng = np.random.default_rng(4)
    m = {"lstm": leanrnn.LSTM, "gru": leanrnn.GRU}[cell](6, 20, seed=5)
    x = rng.standard_normal((5, 3, 6)).astype(np.float32)
    x[2, 1, 3] = np.inf
    grads = []
    for way in (4096, 0):
        monkeypatch.setattr(train_session, "_L1_WAY", way)
        tr = Trainer(m)
        assert tr._in_place_gradients() == (way > 0)
        tape = tr.forward(x)
        tr.backward(tape, np.ones_like(tape.y))
        gl = tr.grad.layers[0][0]
        pad = tr._pad_columns()
        assert pad.size
        for panels in (gl.Wt, gl.Rt):
            last = panels[-1][:, pad - (panels.shape[0] - 1) * panels.shape[2]]
            assert np.array_equal(last, np.zeros_like(last))
        grads.append(tr.grad.buffer.view(np.float32).copy())
    a, b = grads
    assert np.array_equal(np.isnan(a), np.isnan(b)) and np.isnan(a).any()
    ok = np.isfinite(a) & np.isfinite(b)
    assert np.abs(a[ok] - b[ok]).max() <= RTOL_GRAD[np.float32] * np.abs(a[ok]).max()


def test_accumulation_and_a_switch_of_gemm_between_steps(monkeypatch):
    """Two backward calls accumulate on the native GEMM as on BLAS; switching LEANRNN_GEMM
    between steps re-plans (the native path's scratch) instead of reading a stale plan."""
    rng = np.random.default_rng(1)
    m = leanrnn.GRU(9, 40, seed=3)
    x = rng.standard_normal((7, 5, 9)).astype(np.float32)
    grads = {}
    for order in (("native", "blas"), ("blas", "native")):
        tr = Trainer(m)
        for g in order:
            monkeypatch.setenv(products.ENV_GEMM, g)
            tape = tr.forward(x)
            tr.backward(tape, np.ones_like(tape.y))
        grads[order] = tr.grad.buffer.view(np.float32).copy()
    a, b = grads.values()
    assert np.abs(a - b).max() <= RTOL_GRAD[np.float32] * np.abs(a).max()


@pytest.mark.parametrize(("R", "K", "M"), [(5, 3, 64), (13, 70, 100), (1, 1, 1), (40, 129, 200)])
def test_packed_product_of_columns_packed_per_call(R, K, M):
    """pack_columns + packed_product = a @ b (float64 oracle), b a strided block of a wider
    matrix, M on and off the panel width (the tail)."""
    rng = np.random.default_rng(R + K + M)
    a = rng.standard_normal((R, K)).astype(np.float32)
    wide = rng.standard_normal((K, M + 9)).astype(np.float32)
    b = wide[:, 3 : 3 + M]
    U = -(-M // PANEL)
    panels = np.full((U, K, PANEL), np.nan, np.float32)  # every slot must be written
    pack_columns(b, panels)
    pm = PackedMatmul(panels, np.zeros(U * PANEL, np.float32), M)
    out = np.empty((R, M), np.float32)
    tail = np.empty((R, PANEL), np.float32)
    packed_product(pm, a, out, tail, 1, np.zeros(64, np.int64))
    want = a.astype(np.float64) @ b.astype(np.float64)
    assert np.abs(out - want).max() <= 1e-5 * max(1.0, np.abs(want).max())


def test_the_choice_is_measured_once_remembered_and_overridable(monkeypatch, tmp_path):
    calls = []

    def fake(rounds=5):
        calls.append(rounds)
        return {"choice": "native", "native_gflops": 2.0, "blas_gflops": 1.0}

    monkeypatch.delenv(products.ENV_GEMM, raising=False)
    monkeypatch.setattr(products, "calibrate", fake)
    monkeypatch.setattr(products, "_wisdom_path", lambda: tmp_path / "wisdom.json")
    monkeypatch.setattr(products, "_CHOICE", {})
    assert products.gemm_choice(np.float32) == "native"
    assert products.gemm_choice(np.float32) == "native" and len(calls) == 1  # once a process
    assert json.loads((tmp_path / "wisdom.json").read_text())["gemm"]["choice"] == "native"
    monkeypatch.setattr(products, "_CHOICE", {})  # a new process reads the file
    assert products.gemm_choice(np.float32) == "native" and len(calls) == 1
    assert products.gemm_choice(np.float64) == "blas"  # float64 is not measured
    assert products.gemm_decision()["native_gflops"] == 2.0  # what info shows
    monkeypatch.setenv(products.ENV_GEMM, "blas")
    assert products.gemm_choice(np.float32) == "blas"
    assert products.gemm_decision() == {"choice": "blas", "by": "LEANRNN_GEMM"}
    monkeypatch.setenv(products.ENV_GEMM, "native")
    assert products.gemm_choice(np.float64) == "blas"  # float64 stays on BLAS
    (tmp_path / "wisdom.json").write_text("{not json")  # a damaged file: measured again
    monkeypatch.delenv(products.ENV_GEMM)
    monkeypatch.setattr(products, "_CHOICE", {})
    assert products.gemm_choice(np.float32) == "native" and len(calls) == 2


def test_calibrate_times_both_and_names_the_faster():
    got = products.calibrate(rounds=1)
    assert got["choice"] in products.GEMM_CHOICES
    assert got["native_gflops"] > 0 and got["blas_gflops"] > 0
    faster = (
        "blas" if got["blas_gflops"] > products.BLAS_MARGIN * got["native_gflops"] else "native"
    )
    assert got["choice"] == faster


def test_a_tie_on_the_product_goes_to_the_native_path():
    """On a Xeon the two GEMMs measured level (75.6 vs 75.8 GFLOP/s) and the old rule (the
    tile only if 5% faster) chose BLAS, whose training step was 1.3-2.7x slower than the native
    path's: BLAS must now be clearly faster."""
    assert products.decide(1.0, 1.0) == "native"
    assert products.decide(1.0, 0.997) == "native"  # the Xeon's measurement
    assert products.decide(1.0, 0.9) == "native"
    assert products.decide(1.0, 0.7) == "blas"
    assert products.decide(0.5, 1.0) == "native"


def test_wisdom_of_an_earlier_rule_is_measured_again(monkeypatch, tmp_path):
    monkeypatch.delenv(products.ENV_GEMM, raising=False)
    monkeypatch.setattr(products, "_wisdom_path", lambda: tmp_path / "wisdom.json")
    monkeypatch.setattr(products, "_CHOICE", {})
    fresh = {"choice": "native", "native_gflops": 75.6, "blas_gflops": 75.8}
    monkeypatch.setattr(products, "calibrate", lambda rounds=5: dict(fresh))
    old = {"gemm": {"choice": "blas", "native_gflops": 75.6, "blas_gflops": 75.8}}
    (tmp_path / "wisdom.json").write_text(json.dumps(old))  # the old rule's file
    assert products.gemm_choice(np.float32) == "native"
    assert json.loads((tmp_path / "wisdom.json").read_text())["gemm"] == fresh


def test_a_bad_gemm_setting_is_a_clear_error_and_the_trainer_survives(monkeypatch):
    m = leanrnn.LSTM(3, 16, seed=0)
    x = np.ones((4, 2, 3), np.float32)
    tr = Trainer(m)
    monkeypatch.setenv(products.ENV_GEMM, "fastest")
    with pytest.raises(
        leanrnn.errors.LeanRNNError, match="LEANRNN_GEMM='fastest'; expected native, blas"
    ):
        tr.forward(x)
    monkeypatch.setenv(products.ENV_GEMM, "auto")
    tape = tr.forward(x)
    assert tr.backward(tape, np.ones_like(tape.y))[0].shape == x.shape


def test_info_reports_the_training_gemm(monkeypatch):
    from leanrnn.commands import info

    monkeypatch.setattr(products, "_CHOICE", {"float32": {"choice": "native",
                                                          "native_gflops": 7.5,
                                                          "blas_gflops": 2.5}})  # fmt: skip
    monkeypatch.delenv(products.ENV_GEMM, raising=False)
    line = info._gemm()
    assert line.startswith("native") and "7.5 GFLOP/s" in line and "BLAS 2.5" in line
    monkeypatch.setenv(products.ENV_GEMM, "blas")
    assert info._gemm() == "blas (set by LEANRNN_GEMM)"


@pytest.mark.parametrize(("R", "C"), [(1, 1), (31, 5), (33, 70), (100, 64)])
def test_transpose_into_is_the_transpose(R, C):
    from leanrnn.engine.products import transpose_into

    wide = np.arange(R * (C + 3), dtype=np.float32).reshape(R, C + 3)
    src = wide[:, 2 : 2 + C]  # a strided block, as training's x and h_prev are
    out = np.full((C, R), np.nan, np.float32)
    transpose_into(src, out)
    assert np.array_equal(out, src.T)


@pytest.mark.parametrize("threads", [1, 2])
def test_leanrnn_torch_gradients_on_either_gemm(gemm, threads):
    """leanrnn.torch's backward runs its products on the engine's GEMM (on torch's OpenMP
    team, as its kernels) or on torch's matmul, by the choice: both give torch's gradients."""
    lt = pytest.importorskip("leanrnn.torch")
    torch.manual_seed(0)
    ref = torch.nn.LSTM(7, 72, num_layers=2)
    mine = lt.from_module(ref)
    x = torch.randn(6, 30, 7)
    old = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        outs = [m(x.clone().requires_grad_(True))[0] for m in (ref, mine)]
        cot = torch.randn(outs[0].shape)
        for y in outs:
            (y * cot).sum().backward()
    finally:
        torch.set_num_threads(old)
    for (name, p), q in zip(ref.named_parameters(), mine.parameters(), strict=True):
        err = (p.grad - q.grad).abs().max() / p.grad.abs().max()
        assert err <= RTOL_GRAD[np.float32], name


@pytest.mark.parametrize(("K", "M"), [(7, 64), (33, 100), (5, 1), (16, 129)])
def test_packed_matmul_of_lays_out_columns_and_zero_padding(K, M):
    """PackedMatmul.of(B): panel p's row k holds B[k, 64p : 64p + 64], and the last panel's
    slots past M are zero (whatever the fresh memory held), so a product of them is 0."""
    rng = np.random.default_rng(K * M)
    B = rng.standard_normal((K, M)).astype(np.float32)
    pm = PackedMatmul.of(B)
    U = -(-M // PANEL)
    assert pm.W.shape == (U, K, PANEL) and pm.M == M
    want = np.zeros((K, U * PANEL), np.float32)
    want[:, :M] = B
    assert np.array_equal(pm.W.transpose(1, 0, 2).reshape(K, U * PANEL), want)
