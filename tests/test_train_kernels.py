"""The backward kernels (kernels.backward, jobs lstm_back/gru_back/rnn_back) against their NumPy
twins (train.steps, run in float64) on random inputs: every array they write, float32 and
float64, lengths from 0 to full, reverse, the LSTM projection, RNN relu, 1 and 2 threads."""

from __future__ import annotations

import numpy as np
import pytest

from leanrnn.kernels import abi, runner
from leanrnn.train import steps
from tolerances import ATOL_FLOAT64_TWINS, RTOL_GRAD

B = abi.B
T, N = 5, 7
LENGTHS = np.array([5, 0, 3, 5, 1, 4, 2], np.int64)  # 0 and full included


def _pad(x):
    return -(-x // B) * B


def _tol(dtype):
    return ATOL_FLOAT64_TWINS[dtype] if dtype == np.float64 else RTOL_GRAD[dtype]


def _rel(a, b):
    a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
    assert a.shape == b.shape
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def _transposed_panels(Rd, groups):
    """RT [V, Gp, W] with RT[v, g, j] = Rd[g, v*W + j], W = groups*B columns per panel, zero
    past Rd's Kp columns (the layout Trainer._refresh packs, written out element by element)."""
    Gp, Kp = Rd.shape
    W = groups * B
    V = -(-Kp // W)
    RT = np.zeros((V, Gp, W))
    for v in range(V):
        for j in range(W):
            if v * W + j < Kp:
                RT[v, :, j] = Rd[:, v * W + j]
    return RT


def _common(rng, dtype, ng, H, K, lengths_full, N):
    Hp, Kp = _pad(H), _pad(K)
    Gp = ng * Hp
    G = rng.standard_normal((T * N, Gp))
    Rd = np.zeros((Gp, Kp))
    Rd[:, :K] = rng.standard_normal((Gp, K)) * 0.3
    dy = rng.standard_normal((T * N, 2 * K + 3))  # a second direction's columns beside ours
    dh = np.zeros((N, Kp))
    dh[:, :K] = rng.standard_normal((N, K))
    lengths = np.full(N, T, np.int64) if lengths_full else np.resize(LENGTHS, N)
    return Hp, Kp, Gp, G, Rd, dy, dh, lengths


def _run(job, parts, dtype, Gp, N, **named):
    f = {k: (np.ascontiguousarray(v, dtype) if isinstance(v, np.ndarray) and v.dtype.kind == "f"
             else v) for k, v in named.items()}  # fmt: skip
    sync = np.zeros(abi.sync_size(parts), np.int64)
    consts = np.array([0.0, 1.0, np.finfo(dtype).tiny, 0.0], dtype)
    RT = named["RT"]
    dhn = np.full((N, RT.shape[0] * RT.shape[2]), np.nan, dtype)
    call = abi.Call(job, ("parts",), dgs=np.zeros((N, Gp), dtype), dhn=dhn, T=T, consts=consts,
                    sync=sync, **f)  # fmt: skip
    runner.run(job, call.bind(parts=parts), parts)
    return f


# the panel width of RT (groups of B columns: Trainer._dh_groups picks 1, 2 or 4) cycles over
# the cases, so each width meets 1 and 2 threads and a padded last panel (Kp not a multiple);
# at N = 7 two threads split unit blocks, and three more cases take a batch of 26, which two
# threads cut into batch slices (kernels.backward.BACK_SHARE_TILES: from 2 tiles of 6 rows)
CASES = [
    (lf, rev, parts, (1, 2, 4)[i % 3], N)
    for i, (lf, rev, parts) in enumerate(
        (lf, rev, parts) for lf in (True, False) for rev in (False, True) for parts in (1, 2)
    )
]
CASES += [(False, True, 2, 1, 26), (False, False, 2, 4, 26), (True, False, 2, 2, 26)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize(("full", "reverse", "parts", "groups", "N"), CASES)
@pytest.mark.parametrize(("H", "P"), [(20, 0), (33, 0), (20, 7), (24, 18)])
def test_lstm_back_equals_the_numpy_loop(H, P, full, reverse, parts, groups, N, dtype):
    rng = np.random.default_rng(H + P + 10 * reverse)
    K = P or H
    Hp, Kp, Gp, G, Rd, dy, dh, lengths = _common(rng, dtype, 4, H, K, full, N)
    G = np.tanh(G)  # what the forward keeps: the activated gates, within (-1, 1)
    c0 = np.zeros((N, Hp))
    c0[:, :H] = rng.standard_normal((N, H))
    dc = np.zeros((N, Hp))
    dc[:, :H] = rng.standard_normal((N, H))
    proj = rng.standard_normal((P, H)) * 0.3 if P else None
    projd = np.zeros((P, Hp))
    if P:
        projd[:, :H] = proj
    y_off = K + 1
    rows = steps.step_rows(lengths, T, N, reverse)
    G1, dh1, dc1 = G.copy(), dh.copy(), dc.copy()
    G1 = G1.astype(dtype).astype(np.float64)  # the oracle starts from the same rounded inputs
    cs1, hf1, dhs1 = np.zeros((T * N, Hp)), np.zeros((T * N, Hp)), np.zeros((T * N, P))
    steps.lstm_backward(G1, None, c0, cs1, dy, y_off, dh1, dc1, Rd, K, rows, proj,
                        hf1 if P else None, dhs1 if P else None)  # fmt: skip
    nan = np.full((T * N, Hp), np.nan)  # scratch the kernel must fill, not read
    f = _run("lstm_back", parts, dtype, Gp, N, G=G, c0=c0, cs=nan.copy(), dy=dy, y_off=y_off,
             dh=dh, dc=dc, RT=_transposed_panels(Rd, groups), K=K, projd=projd, P=P,
             hf=nan.copy() if P else np.zeros((0, Hp)),
             dhs=np.full((T * N, P), np.nan), lengths=lengths, reverse=reverse)  # fmt: skip
    tol = _tol(dtype)
    assert _rel(f["G"], G1) < tol
    assert _rel(f["dh"], dh1) < tol
    assert _rel(f["dc"], dc1) < tol
    if P:
        assert _rel(f["dhs"], dhs1) < tol
        # hf is read only where dhs is not zero (the projection's GEMM): compare it there
        live = rows[rows >= 0]
        assert _rel(f["hf"][live], hf1[live]) < tol
        assert not np.isnan(f["hf"]).any()


@pytest.mark.parametrize(("parts", "N"), [(1, 7), (2, 7), (2, 26)])
def test_lstm_back_with_r_beyond_half_of_l2_equals_the_numpy_loop(parts, N):
    """Where R^T's panels are larger than half of this core's L2, phase B's GEMM tile asks for
    the next panel over its k loop (kernels.gemm._ahead): the smallest such
    float64 H on this CPU, both ways of splitting the threads."""
    from leanrnn.kernels import gemm

    H = 16
    while 4 * H * H * 8 <= gemm.PANEL_L2:
        H += 16
    test_lstm_back_equals_the_numpy_loop(H, 0, False, True, parts, 4, N, np.float64)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize(("full", "reverse", "parts", "groups", "N"), CASES)
@pytest.mark.parametrize("H", [20, 48])
def test_gru_back_equals_the_numpy_loop(H, full, reverse, parts, groups, N, dtype):
    rng = np.random.default_rng(H + 10 * reverse)
    Hp, Kp, Gp, G, Rd, dy, dh, lengths = _common(rng, dtype, 3, H, H, full, N)
    G = np.tanh(G)  # what the forward keeps: the activated gates, within (-1, 1)
    ghn = rng.standard_normal((T * N, Hp))
    hprev = rng.standard_normal((T * N, H))
    rows = steps.step_rows(lengths, T, N, reverse)
    G1 = G.astype(dtype).astype(np.float64)
    ghn1 = ghn.astype(dtype).astype(np.float64)
    dh1 = dh.copy()
    steps.gru_backward(G1, ghn1, hprev.astype(dtype).astype(np.float64), dy, 0, dh1, Rd, H, rows)
    f = _run("gru_back", parts, dtype, Gp, N, G=G, ghn=ghn, hprev=hprev, dy=dy, y_off=0, dh=dh,
             RT=_transposed_panels(Rd, groups), K=H, lengths=lengths, reverse=reverse)  # fmt: skip
    tol = _tol(dtype)
    assert _rel(f["G"], G1) < tol
    assert _rel(f["ghn"], ghn1) < tol
    assert _rel(f["dh"], dh1) < tol


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize(("full", "reverse", "parts", "groups", "N"), CASES)
@pytest.mark.parametrize(("H", "relu"), [(20, False), (20, True), (32, False)])
def test_rnn_back_equals_the_numpy_loop(H, relu, full, reverse, parts, groups, N, dtype):
    rng = np.random.default_rng(H + 10 * reverse + relu)
    Hp, Kp, Gp, G, Rd, dy, dh, lengths = _common(rng, dtype, 1, H, H, full, N)
    rows = steps.step_rows(lengths, T, N, reverse)
    G1 = G.astype(dtype).astype(np.float64)
    dh1 = dh.copy()
    steps.rnn_backward(G1, dy, H, dh1, Rd, H, rows, relu)
    f = _run("rnn_back", parts, dtype, Gp, N, G=G, dy=dy, y_off=H, dh=dh,
             RT=_transposed_panels(Rd, groups), K=H, lengths=lengths, reverse=reverse,
             relu=relu)  # fmt: skip
    tol = _tol(dtype)
    assert _rel(f["G"], G1) < tol
    assert _rel(f["dh"], dh1) < tol
