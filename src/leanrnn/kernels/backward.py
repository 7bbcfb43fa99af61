"""The backward recurrences: one numba kernel per cell runs the backward loop of one (layer,
direction) over a segment of ``T`` steps, newest first (train.steps is their NumPy twin).

Per step two phases (threads as in kernels.recurrent, see _sync):
  A. each unit block u (its gates are one panel of G): the cell's backward for its units, in
     place over the gate pre-activations of the step's rows, which become gate gradients;
     those gradients also go to ``dgs`` (rows n = sample, as the GEMM wants them).
  B. each block v of B output columns: ``dh_prev[:, v] = dgs @ R[:, v]`` with the register-tiled
     panel GEMM (gemm.panel1) on ``RT``, the transposed panels of R; a sample past its length
     keeps its dh (its state is frozen there, so the gradient passes through unchanged).
The LSTM recomputes its cell states first (one phase: every unit is independent over time) and,
with a projection, adds a phase per step for the projected h's gradient (phase A needs all of it).

Arrays (packed column order; ``Gp`` gate columns, ``Hp``/``Kp`` padded; rows t*N + n):
  G:     [T*N, Gp]  in: gate pre-activations; out: their gradients (zero on steps past a
                    sample's length). GRU: the n block holds ``W_n x + bW_n`` in, ``d(pre_n)`` out
  ghn:   [T*N, Hp]  GRU: in ``R_n h + bR_n``, out its gradient ``d(pre_n) * r``
  hprev: [T*N, >=K] GRU: the state each step started from
  c0:    [N, Hp]    LSTM cell state before the segment;  cs: [T*N, Hp] scratch (c of each step)
  dy:    [T*N, >=K] gradient of the layer output, columns y_off..y_off+K
  dh:    [N, Kp]    in: gradient of the last h; out: of h0 (padding columns stay 0).
  dc:    [N, Hp]    the same for the LSTM's c
  RT:    [Kp/B, Gp, B] recurrent weights, transposed panels: RT[v, g, j] = R[g, v*B + j]
  projd: [P, Hp]    LSTM projection, dense (P = 0: no projection); hf [T*N, Hp] and dhs
                    [T*N, P] receive o*tanh(c) and the projected h's gradient (zero past a
                    sample's length), for the projection's weight GEMM
  dgs:   [N, Gp], dhn: [N, Kp] scratch
  lengths: [N] int64 valid steps per sample (<= T); reverse: the direction runs backward in time
  consts: [zero, one, tiny, clip] in the working dtype; me, parts, sync: see _sync
No argument may alias another.
"""

from __future__ import annotations

from ._jit import inline, kernel
from ._math import sigmoid_, tanh_
from ._sync import claim, end_phase, finish
from .abi import B
from .gemm import panel1


@inline
def _row(s, n, N, lengths, reverse):
    """Sample n's time-major row at loop step s, or -1 once s is past its length."""
    L = lengths[n]
    if s >= L:
        return -1
    return ((L - 1 - s) if reverse else s) * N + n


@inline
def _zero(a, row, start, length, zero):
    for j in range(start, start + length):
        a[row, j] = zero


@inline
def _dh_in(tmp, n, col, dh, dy, row, y_off, c0, K, zero):
    """tmp[n, col:col+B] = dh[n, c0:c0+B] + dy[row, y_off+c0 : ...] (0 past K, the padding)."""
    if c0 + B <= K:  # a whole block: a constant trip count, so one vector pass
        for j in range(B):
            tmp[n, col + j] = dh[n, c0 + j] + dy[row, y_off + c0 + j]
    else:
        for j in range(B):
            tmp[n, col + j] = dh[n, c0 + j] + dy[row, y_off + c0 + j] if c0 + j < K else zero


@inline
def _dh_gemm(RT, dgs, N, Gp, dhn, dh, s, lengths, reverse, add, me, parts, sync, g, consts):
    """Phase B: dh[n, v-block] = (dh if add else 0) + dgs[n] @ R[:, v-block], active n."""
    V = RT.shape[0]
    for q in range(parts):
        lo, hi = claim(sync, me, q, parts, g, V)
        if hi < 0:
            continue
        for v in range(lo, hi):
            c0 = v * B
            panel1(RT, v, 0, dgs, 0, N, Gp, dhn, c0, consts, -1)
            for n in range(N):
                if _row(s, n, N, lengths, reverse) < 0:
                    continue
                if add:
                    for j in range(B):
                        dh[n, c0 + j] += dhn[n, c0 + j]
                else:
                    for j in range(B):
                        dh[n, c0 + j] = dhn[n, c0 + j]
        finish(sync, parts)
    return end_phase(sync, parts, g)


def _lstm_back(
    G, c0, cs, dy, y_off, dh, dc, RT, K, projd, P, hf, dhs, dgs, dhn, lengths, T, reverse,
    consts, me, parts, sync,
):  # fmt: skip
    zero, one = consts[0], consts[1]
    N = dh.shape[0]
    Hp = c0.shape[1]
    U = Hp // B
    Gp = G.shape[1]
    NP = (P + B - 1) // B
    g = 0  # phase counter, the same on every thread
    # The cell state of every step, oldest first (the forward kept only pre-activations).
    for q in range(parts):
        lo, hi = claim(sync, me, q, parts, g, U)
        if hi < 0:
            continue
        for u in range(lo, hi):
            r0 = u * 4 * B
            cb = u * B
            for n in range(N):
                for j in range(B):
                    dgs[n, r0 + j] = c0[n, cb + j]  # the running c, in this block's scratch
                for s in range(T):
                    row = _row(s, n, N, lengths, reverse)
                    if row < 0:
                        break
                    for j in range(B):
                        i = sigmoid_(G[row, r0 + j])
                        f = sigmoid_(G[row, r0 + B + j])
                        gg = tanh_(G[row, r0 + 2 * B + j])
                        c = f * dgs[n, r0 + j] + i * gg
                        dgs[n, r0 + j] = c
                        cs[row, cb + j] = c
        finish(sync, parts)
    g = end_phase(sync, parts, g)
    for s in range(T - 1, -1, -1):
        if P > 0:  # the projected h's gradient, which every unit block needs whole
            for q in range(parts):
                lo, hi = claim(sync, me, q, parts, g, NP)
                if hi < 0:
                    continue
                for pb in range(lo, hi):
                    p0 = pb * B
                    p1 = min(p0 + B, P)
                    for n in range(N):
                        row = _row(s, n, N, lengths, reverse)
                        if row < 0:
                            _zero(dhs, s * N + n, p0, p1 - p0, zero)
                            continue
                        for p in range(p0, p1):
                            dhs[row, p] = dh[n, p] + dy[row, y_off + p]
                finish(sync, parts)
            g = end_phase(sync, parts, g)
        for q in range(parts):
            lo, hi = claim(sync, me, q, parts, g, U)
            if hi < 0:
                continue
            for u in range(lo, hi):
                r0 = u * 4 * B
                ri, rf, rg, ro = r0, r0 + B, r0 + 2 * B, r0 + 3 * B
                cb = u * B
                for n in range(N):
                    row = _row(s, n, N, lengths, reverse)
                    if row < 0:  # frozen: dh, dc pass through; the row was never reached
                        _zero(G, s * N + n, r0, 4 * B, zero)
                        _zero(dgs, n, r0, 4 * B, zero)
                        if P > 0:  # hf meets dhs = 0 there in the projection's GEMM
                            _zero(hf, s * N + n, cb, B, zero)
                        continue
                    # dh of the block's units into the o slot of dgs (written last below)
                    if P > 0:
                        _zero(dgs, n, ro, B, zero)
                        for p in range(P):
                            w = dhs[row, p]
                            for j in range(B):
                                dgs[n, ro + j] += w * projd[p, cb + j]
                    else:
                        _dh_in(dgs, n, ro, dh, dy, row, y_off, cb, K, zero)
                    if s > 0:
                        prow = row - N if not reverse else row + N
                        cp = cs
                    else:
                        prow = n
                        cp = c0
                    for j in range(B):
                        i = sigmoid_(G[row, ri + j])
                        f = sigmoid_(G[row, rf + j])
                        gg = tanh_(G[row, rg + j])
                        o = sigmoid_(G[row, ro + j])
                        tc = tanh_(cs[row, cb + j])
                        dhu = dgs[n, ro + j]
                        dct = dc[n, cb + j] + dhu * o * (one - tc * tc)
                        dc[n, cb + j] = dct * f
                        di = dct * gg * i * (one - i)
                        df = dct * cp[prow, cb + j] * f * (one - f)
                        dg = dct * i * (one - gg * gg)
                        do = dhu * tc * o * (one - o)
                        G[row, ri + j] = di
                        G[row, rf + j] = df
                        G[row, rg + j] = dg
                        G[row, ro + j] = do
                        dgs[n, ri + j] = di
                        dgs[n, rf + j] = df
                        dgs[n, rg + j] = dg
                        dgs[n, ro + j] = do
                        if P > 0:
                            hf[row, cb + j] = o * tc
            finish(sync, parts)
        g = end_phase(sync, parts, g)
        g = _dh_gemm(RT, dgs, N, Gp, dhn, dh, s, lengths, reverse, False, me, parts, sync, g,
                     consts)  # fmt: skip
    return 0


def _gru_back(
    G, ghn, hprev, dy, y_off, dh, RT, K, dgs, dhn, lengths, T, reverse, consts, me, parts, sync,
):  # fmt: skip
    zero, one = consts[0], consts[1]
    N = dh.shape[0]
    Hp = ghn.shape[1]
    U = Hp // B
    Gp = G.shape[1]
    g = 0
    for s in range(T - 1, -1, -1):
        for q in range(parts):
            lo, hi = claim(sync, me, q, parts, g, U)
            if hi < 0:
                continue
            for u in range(lo, hi):
                r0 = u * 3 * B
                rz, rr, rn = r0, r0 + B, r0 + 2 * B
                cb = u * B
                for n in range(N):
                    row = _row(s, n, N, lengths, reverse)
                    if row < 0:
                        _zero(G, s * N + n, r0, 3 * B, zero)
                        _zero(ghn, s * N + n, cb, B, zero)
                        _zero(dgs, n, r0, 3 * B, zero)
                        continue
                    # dh into the n slot of dgs and h_prev into the z slot (both read first)
                    _dh_in(dgs, n, rn, dh, dy, row, y_off, cb, K, zero)
                    if cb + B <= K:
                        for j in range(B):
                            dgs[n, rz + j] = hprev[row, cb + j]
                    else:
                        for j in range(B):
                            dgs[n, rz + j] = hprev[row, cb + j] if cb + j < K else zero
                    for j in range(B):
                        dht = dgs[n, rn + j]
                        h0 = dgs[n, rz + j]
                        z = sigmoid_(G[row, rz + j])
                        r = sigmoid_(G[row, rr + j])
                        gh = ghn[row, cb + j]
                        nn = tanh_(G[row, rn + j] + r * gh)
                        dnp = dht * (one - z) * (one - nn * nn)
                        dzp = dht * (h0 - nn) * z * (one - z)
                        drp = dnp * gh * r * (one - r)
                        G[row, rz + j] = dzp
                        G[row, rr + j] = drp
                        G[row, rn + j] = dnp
                        ghn[row, cb + j] = dnp * r
                        dgs[n, rz + j] = dzp
                        dgs[n, rr + j] = drp
                        dgs[n, rn + j] = dnp * r
                        dh[n, cb + j] = dht * z  # phase B adds the R part
            finish(sync, parts)
        g = end_phase(sync, parts, g)
        g = _dh_gemm(RT, dgs, N, Gp, dhn, dh, s, lengths, reverse, True, me, parts, sync, g,
                     consts)  # fmt: skip
    return 0


def _rnn_back(
    G, dy, y_off, dh, RT, K, dgs, dhn, lengths, T, reverse, relu, consts, me, parts, sync,
):  # fmt: skip
    zero, one = consts[0], consts[1]
    N = dh.shape[0]
    Gp = G.shape[1]
    U = Gp // B
    g = 0
    for s in range(T - 1, -1, -1):
        for q in range(parts):
            lo, hi = claim(sync, me, q, parts, g, U)
            if hi < 0:
                continue
            for u in range(lo, hi):
                cb = u * B
                for n in range(N):
                    row = _row(s, n, N, lengths, reverse)
                    if row < 0:
                        _zero(G, s * N + n, cb, B, zero)
                        _zero(dgs, n, cb, B, zero)
                        continue
                    _dh_in(dgs, n, cb, dh, dy, row, y_off, cb, K, zero)
                    if relu:
                        for j in range(B):
                            d = dgs[n, cb + j] if G[row, cb + j] > zero else zero
                            G[row, cb + j] = d
                            dgs[n, cb + j] = d
                    else:
                        for j in range(B):
                            h = tanh_(G[row, cb + j])
                            d = dgs[n, cb + j] * (one - h * h)
                            G[row, cb + j] = d
                            dgs[n, cb + j] = d
            finish(sync, parts)
        g = end_phase(sync, parts, g)
        g = _dh_gemm(RT, dgs, N, Gp, dhn, dh, s, lengths, reverse, False, me, parts, sync, g,
                     consts)  # fmt: skip
    return 0


lstm_back = kernel(_lstm_back)
gru_back = kernel(_gru_back)
rnn_back = kernel(_rnn_back)
