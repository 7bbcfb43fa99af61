"""The per-step backward recurrences in NumPy: what the backward kernels compute, written plainly.

One function per cell runs the backward loop of one (layer, direction) over ``T`` steps, newest
first, for the whole batch. The GEMMs over all steps (weight gradients, the input gradient)
are not here: train.session does them once per segment. These loops (a few NumPy calls per
step) are the oracle the backward kernels (kernels.backward, which train.session runs) are
tested against in tests/test_train_kernels.py.

Arrays (packed column order, see formats.packing; ``Gp`` gate columns, ``Hp``/``Kp`` padded):
  G:     [T*N, Gp]  in: what the forward kept of every step, rows t*N + n (time-major):
                    the activated gates (LSTM i, f, g, o; GRU z, r, n), RNN the
                    pre-activations; out: the pre-activations' gradients (zero on steps
                    past a sample's length; GRU's n block ``d(pre_n)``).
  ghn:   [T*N, Hp]  GRU only: in ``R_n h + bR_n``, out its gradient ``d(pre_n) * r``
  hprev: [T*N, K]   the state each step started from (h0 or the step before)
  c0:    [N, Hp]    LSTM cell state before the first step; cs: [T*N, Hp] scratch (c per step)
  dy:    [T*N, >=K] gradient of the layer output, columns y_off..y_off+K
  dh:    [N, Kp]    in: gradient of the final h; out: of h0.  dc: [N, Hp] the same for c
  Rd:    [Gp, Kp]   recurrent weights as dense rows in packed order (dh_prev = dG_t @ Rd)
  proj:  [P, H]     LSTM projection (P > 0): hf [T*N, Hp] and dhs [T*N, P] receive o*tanh(c)
                    and the gradient of the projected h, for the projection's weight GEMM
  rows:  [T, N]     int64 row of (loop step s, sample n) in the time-major arrays, -1 once s
                    is past the sample's length (its state is frozen there: gradients pass
                    through unchanged and dy is not read)
"""

from __future__ import annotations

import numpy as np


def step_rows(lengths: np.ndarray, T: int, N: int, reverse: bool) -> np.ndarray:
    """rows[s, n]: the time-major row sample n is at on loop step s, or -1 past its length."""
    s = np.arange(T)[:, None]
    L = lengths[None, :].astype(np.int64)
    t = (L - 1 - s) if reverse else np.broadcast_to(s, (T, N))
    return np.where(s < L, t * N + np.arange(N)[None, :], -1).astype(np.int64)


def _gates(G, rows, ng, U, B):
    """The gate blocks of rows as ng arrays [len(rows), U*B] (copies)."""
    g4 = G[rows].reshape(len(rows), U, ng, B)
    return [g4[:, :, k, :].reshape(len(rows), U * B) for k in range(ng)]


def _put(G, rows, parts, U, B):
    out = np.stack([p.reshape(len(rows), U, B) for p in parts], axis=2)
    G[rows] = out.reshape(len(rows), -1)


def lstm_backward(G, hprev, c0, cs, dy, y_off, dh, dc, Rd, K, rows, proj, hf, dhs):
    T, N = rows.shape
    Hp = c0.shape[1]
    B = 16
    U = Hp // B
    P = proj.shape[0] if proj is not None else 0
    if P:
        # rows past a sample's length add nothing to the projection's gradient (dhs.T @ hf):
        # both are zeroed, as arena garbage may be NaN and 0 * NaN is NaN
        dhs[:] = 0
        hf[:] = 0
    # Recompute c of every step, oldest first (the forward kept only the activated gates).
    c = c0.copy()
    for s in range(T):
        act = np.nonzero(rows[s] >= 0)[0]
        if len(act) == 0:
            continue
        r = rows[s, act]
        i, f, g, _ = _gates(G, r, 4, U, B)
        c[act] = f * c[act] + i * g
        cs[r] = c[act]
    for s in range(T - 1, -1, -1):
        act = np.nonzero(rows[s] >= 0)[0]
        if len(act) == 0:
            continue
        r = rows[s, act]
        i, f, g, o = _gates(G, r, 4, U, B)
        c_t = cs[r]
        prev = rows[s - 1, act] if s > 0 else np.full(len(act), -1)
        c_prev = np.where((prev >= 0)[:, None], cs[np.maximum(prev, 0)], c0[act])
        tc = np.tanh(c_t)
        dh_t = dh[act, :K] + dy[r, y_off : y_off + K]
        if P:
            dhs[r] = dh_t
            hfull = o * tc
            hf[r] = hfull
            dhu = np.zeros((len(act), Hp), G.dtype)
            dhu[:, : proj.shape[1]] = dh_t @ proj
        else:
            dhu = np.zeros((len(act), Hp), G.dtype)
            dhu[:, :K] = dh_t
        do = dhu * tc
        dct = dc[act] + dhu * o * (1 - tc * tc)
        di, dg, df = dct * g, dct * i, dct * c_prev
        dc[act] = dct * f
        parts = [di * i * (1 - i), df * f * (1 - f), dg * (1 - g * g), do * o * (1 - o)]
        _put(G, r, parts, U, B)
        dh[act, :K] = G[r] @ Rd[:, :K]
    _zero_inactive(G, rows)


def gru_backward(G, ghn, hprev, dy, y_off, dh, Rd, K, rows):
    T, N = rows.shape
    Hp = ghn.shape[1]
    B = 16
    U = Hp // B
    for s in range(T - 1, -1, -1):
        act = np.nonzero(rows[s] >= 0)[0]
        if len(act) == 0:
            continue
        r_ = rows[s, act]
        z, r, n = _gates(G, r_, 3, U, B)
        gh = ghn[r_]
        h0 = np.zeros((len(act), Hp), G.dtype)
        h0[:, :K] = hprev[r_]
        dh_t = np.zeros((len(act), Hp), G.dtype)
        dh_t[:, :K] = dh[act, :K] + dy[r_, y_off : y_off + K]
        dn = dh_t * (1 - z)
        dz = dh_t * (h0 - n)
        dnp = dn * (1 - n * n)
        dr = dnp * gh
        dzp, drp = dz * z * (1 - z), dr * r * (1 - r)
        ghn[r_] = dnp * r
        _put(G, r_, [dzp, drp, ghn[r_]], U, B)  # the h side first: dh_prev needs it
        dh[act, :K] = G[r_] @ Rd[:, :K] + (dh_t * z)[:, :K]
        _put(G, r_, [dzp, drp, dnp], U, B)  # then the x side, which G keeps
    _zero_inactive(G, rows)
    _zero_inactive(ghn, rows)


def rnn_backward(G, dy, y_off, dh, Rd, K, rows, relu: bool):
    T, N = rows.shape
    for s in range(T - 1, -1, -1):
        act = np.nonzero(rows[s] >= 0)[0]
        if len(act) == 0:
            continue
        r = rows[s, act]
        pre = G[r]
        dh_t = np.zeros_like(pre)
        dh_t[:, :K] = dh[act, :K] + dy[r, y_off : y_off + K]
        if relu:
            d = np.where(pre <= 0, 0, dh_t)  # torch's threshold_backward: NaN passes dh
        else:
            h = np.tanh(pre)
            d = dh_t * (1 - h * h)
        G[r] = d
        dh[act, :K] = d @ Rd[:, :K]
    _zero_inactive(G, rows)


def _zero_inactive(G, rows):
    """Rows no step reached (past every length) hold the forward's values still: zero them."""
    T, N = rows.shape
    seen = np.zeros(T * N, bool)
    seen[rows[rows >= 0]] = True
    G[~seen] = 0
