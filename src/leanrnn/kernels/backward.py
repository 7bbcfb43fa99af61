"""The backward recurrences: one numba kernel per cell runs the backward loop of one (layer,
direction) over a segment of ``T`` steps, newest first (train.steps is their NumPy twin).

Per step two phases (threads as in kernels.recurrent, see _sync):
  A. each unit block u (its gates are one panel of G): the cell's backward for its units, in
     place over what the forward kept of the step's rows (LSTM and GRU: the activated gates;
     RNN: the pre-activations), which become gate gradients;
     those gradients also go to ``dgs`` (rows n = sample, as the GEMM wants them).
  B. each panel v of RT (R's columns in panels of up to 4 groups of B, _dh_gemm):
     ``dh_prev[:, v] = dgs @ R[:, v]`` with the register-tiled panel GEMM (gemm.panel4/2/1);
     a sample past its length keeps its dh (its state is frozen there, so the gradient passes
     through unchanged).
From BACK_SHARE_TILES register tiles of rows per thread on, each thread instead runs both
phases of every step for its own tile-aligned batch slice (_sync.share): no barrier, and no
thread reads the gate gradients another one wrote.
The LSTM recomputes its cell states first (one phase: every unit is independent over time) and,
with a projection, adds a phase per step for the projected h's gradient (phase A needs all of it).

Arrays (packed column order; ``Gp`` gate columns, ``Hp``/``Kp`` padded; rows t*N + n):
  G:     [T*N, Gp]  in: the activated gates (LSTM i, f, g, o; GRU z, r, n), RNN the
                    pre-activations; out: the pre-activations' gradients (zero on steps past
                    a sample's length; GRU's n block ``d(pre_n)``, pre_n = W_n x + bW_n +
                    r * (R_n h + bR_n))
  ghn:   [T*N, Hp]  GRU: in ``R_n h + bR_n``, out its gradient ``d(pre_n) * r``
  hprev: [T*N, >=K] GRU: the state each step started from
  c0:    [N, Hp]    LSTM cell state before the segment;  cs: [T*N, Hp] scratch (c of each step)
  dy:    [T*N, >=K] gradient of the layer output, columns y_off..y_off+K
  dh:    [N, Kp]    in: gradient of the last h; out: of h0 (padding columns stay 0).
  dc:    [N, Hp]    the same for the LSTM's c
  RT:    [V, Gp, W] recurrent weights, transposed panels of W = 1, 2 or 4 groups of B
                    columns: RT[v, g, j] = R[g, v*W + j], zero past Kp (train.session
                    ._column_panels)
  projd: [P, Hp]    LSTM projection, dense (P = 0: no projection); hf [T*N, Hp] and dhs
                    [T*N, P] receive o*tanh(c) and the projected h's gradient (zero past a
                    sample's length), for the projection's weight GEMM
  dgs:   [N, Gp], dhn: [N, >= V*W] scratch
  lengths: [N] int64 valid steps per sample (<= T); reverse: the direction runs backward in time
  consts: [zero, one, tiny, clip] in the working dtype; me, parts, sync: see _sync
No argument may alias another.
"""

from __future__ import annotations

from llvmlite import ir
from numba import types
from numba.extending import intrinsic, overload

from ._cells import _Vec, block_add
from ._jit import inline, kernel
from ._math import tanh_
from ._sync import ALIGN, claim, end_phase, finish, share
from .abi import B
from .gemm import panel1, panel2, panel4

# Batch slices (_sync.share: each thread runs every step of its own samples, never meeting the
# others) from this many register tiles of rows per thread on. Lower than the forward's
# SHARE_TILES: a backward step meets twice (cell backward, then dh_prev's GEMM), and that GEMM
# reads every thread's gate gradients of the step (LSTM: 4x the h the forward's step shares).
BACK_SHARE_TILES = 2

# ---------------------------------------------------------------- the cells' backward, per block
# float32 as explicit 16-lane vector IR (_cells._Vec), as the forward's cells: LLVM left these
# loops scalar (it cannot tell the arrays apart), 5 scalar divides per unit and step. float64
# as plain loops over libm. Each names B consecutive elements of a row as (array, row, col).


def _f32(*arrays) -> bool:
    return all(isinstance(a, types.Array) and a.dtype == types.float32 and a.ndim == 2
               for a in arrays)  # fmt: skip


def lstm_c(G, gr, gc, cp, pr, pc, cs, sr, sc):  # pragma: no cover
    """cs[sr, sc:+B] = f*cp[pr, pc:+B] + i*g, the activated gates from G[gr, gc:+4B]."""
    raise NotImplementedError("numba-only")


@intrinsic
def _lstm_c_f32(typingctx, G, gr, gc, cp, pr, pc, cs, sr, sc):
    if not _f32(G, cp, cs):
        return None
    i = types.intp

    def gen(context, builder, sig, args):
        v = _Vec(context, builder, sig, args)
        ig, fg, gg = v.load(0, 0), v.load(0, 1), v.load(0, 2)
        v.store(v.fma(fg, v.load(3), v.mul(ig, gg)), 6)
        return context.get_dummy_value()

    return types.void(G, i, i, cp, i, i, cs, i, i), gen


@overload(lstm_c, inline="always")
def _lstm_c_ov(G, gr, gc, cp, pr, pc, cs, sr, sc):
    if _f32(G, cp, cs):
        return lambda G, gr, gc, cp, pr, pc, cs, sr, sc: _lstm_c_f32(G, gr, gc, cp, pr, pc, cs,
                                                                      sr, sc)  # fmt: skip

    def loop(G, gr, gc, cp, pr, pc, cs, sr, sc):
        for j in range(B):
            i = G[gr, gc + j]
            f = G[gr, gc + B + j]
            g = G[gr, gc + 2 * B + j]
            cs[sr, sc + j] = f * cp[pr, pc + j] + i * g

    return loop


def lstm_cell_back(G, gr, gc, cs, sr, sc, cp, pr, pc, dgs, dr, dcol, dc, cr, cc, hf, hr, hc,
                   keep):  # pragma: no cover  # fmt: skip
    """One block's LSTM backward: G[gr, gc:+4B] activated gates -> gate gradients (also into
    dgs[dr, dcol:+4B], whose o slot holds dh of the block's units on entry); c from cs, the
    previous c from cp; dc[cr, cc:+B] in/out; keep: hf[hr, hc:+B] = o*tanh(c)."""
    raise NotImplementedError("numba-only")


@intrinsic
def _lstm_back_f32(typingctx, G, gr, gc, cs, sr, sc, cp, pr, pc, dgs, dr, dcol, dc, cr, cc, hf,
                   hr, hc, keep):  # fmt: skip
    if not _f32(G, cs, cp, dgs, dc, hf):
        return None
    i = types.intp

    def gen(context, builder, sig, args):
        v = _Vec(context, builder, sig, args)
        one = v.const(1.0)
        ig, fg, gg, og = (v.load(0, k) for k in range(4))
        tc = v.tanh(v.load(3))
        dhu = v.load(9, 3)
        dct = v.fma(v.mul(dhu, og), v.b.fsub(one, v.mul(tc, tc)), v.load(12))
        v.store(v.mul(dct, fg), 12)
        di = v.mul(v.mul(dct, gg), v.mul(ig, v.b.fsub(one, ig)))
        df = v.mul(v.mul(dct, v.load(6)), v.mul(fg, v.b.fsub(one, fg)))
        dg = v.mul(v.mul(dct, ig), v.b.fsub(one, v.mul(gg, gg)))
        do = v.mul(v.mul(dhu, tc), v.mul(og, v.b.fsub(one, og)))
        i64 = ir.IntType(64)
        for k, d in enumerate((di, df, dg, do)):
            for a in (0, 9):
                p = v.b.gep(v.ptr(a), [ir.Constant(i64, k)])
                v.b.store(d, p, align=4)
        with builder.if_then(builder.icmp_signed("!=", args[18], ir.Constant(args[18].type, 0))):
            v.store(v.mul(og, tc), 15)
        return context.get_dummy_value()

    return types.void(G, i, i, cs, i, i, cp, i, i, dgs, i, i, dc, i, i, hf, i, i, keep), gen


@overload(lstm_cell_back, inline="always")
def _lstm_back_ov(G, gr, gc, cs, sr, sc, cp, pr, pc, dgs, dr, dcol, dc, cr, cc, hf, hr, hc, keep):
    if _f32(G, cs, cp, dgs, dc, hf):
        return lambda G, gr, gc, cs, sr, sc, cp, pr, pc, dgs, dr, dcol, dc, cr, cc, hf, hr, hc, \
            keep: _lstm_back_f32(G, gr, gc, cs, sr, sc, cp, pr, pc, dgs, dr, dcol, dc, cr, cc,
                                 hf, hr, hc, keep)  # fmt: skip

    def loop(G, gr, gc, cs, sr, sc, cp, pr, pc, dgs, dr, dcol, dc, cr, cc, hf, hr, hc, keep):
        for j in range(B):
            i = G[gr, gc + j]
            f = G[gr, gc + B + j]
            gg = G[gr, gc + 2 * B + j]
            o = G[gr, gc + 3 * B + j]
            tc = tanh_(cs[sr, sc + j])
            dhu = dgs[dr, dcol + 3 * B + j]
            dct = dc[cr, cc + j] + dhu * o * (1 - tc * tc)
            dc[cr, cc + j] = dct * f
            di = dct * gg * i * (1 - i)
            df = dct * cp[pr, pc + j] * f * (1 - f)
            dg = dct * i * (1 - gg * gg)
            do = dhu * tc * o * (1 - o)
            G[gr, gc + j] = di
            G[gr, gc + B + j] = df
            G[gr, gc + 2 * B + j] = dg
            G[gr, gc + 3 * B + j] = do
            dgs[dr, dcol + j] = di
            dgs[dr, dcol + B + j] = df
            dgs[dr, dcol + 2 * B + j] = dg
            dgs[dr, dcol + 3 * B + j] = do
            if keep:
                hf[hr, hc + j] = o * tc

    return loop


def gru_cell_back(G, gr, gc, ghn, hr, hc, dgs, dr, dcol, dh, nr, nc):  # pragma: no cover
    """One block's GRU backward: G[gr, gc:+3B] (z, r, n as the forward kept them) -> the
    gradients of their pre-activations, also into dgs[dr, dcol:+3B] (the n slot with
    d(pre_n)*r), whose z slot holds h_prev and n slot dh on entry; ghn[hr, hc:+B] R_n h +
    bR_n -> d(pre_n)*r; dh = dh*z."""
    raise NotImplementedError("numba-only")


@intrinsic
def _gru_back_f32(typingctx, G, gr, gc, ghn, hr, hc, dgs, dr, dcol, dh, nr, nc):
    if not _f32(G, ghn, dgs, dh):
        return None
    i = types.intp

    def gen(context, builder, sig, args):
        v = _Vec(context, builder, sig, args)
        one = v.const(1.0)
        dht, h0 = v.load(6, 2), v.load(6, 0)
        z, r, nn, gh = v.load(0, 0), v.load(0, 1), v.load(0, 2), v.load(3)
        dnp = v.mul(v.mul(dht, v.b.fsub(one, z)), v.b.fsub(one, v.mul(nn, nn)))
        dzp = v.mul(v.mul(dht, v.b.fsub(h0, nn)), v.mul(z, v.b.fsub(one, z)))
        drp = v.mul(v.mul(dnp, gh), v.mul(r, v.b.fsub(one, r)))
        dnr = v.mul(dnp, r)
        i64 = ir.IntType(64)
        for a, vals in ((0, (dzp, drp, dnp)), (6, (dzp, drp, dnr))):
            for k, d in enumerate(vals):
                v.b.store(d, v.b.gep(v.ptr(a), [ir.Constant(i64, k)]), align=4)
        v.store(dnr, 3)
        v.store(v.mul(dht, z), 9)
        return context.get_dummy_value()

    return types.void(G, i, i, ghn, i, i, dgs, i, i, dh, i, i), gen


@overload(gru_cell_back, inline="always")
def _gru_back_ov(G, gr, gc, ghn, hr, hc, dgs, dr, dcol, dh, nr, nc):
    if _f32(G, ghn, dgs, dh):
        return lambda G, gr, gc, ghn, hr, hc, dgs, dr, dcol, dh, nr, nc: _gru_back_f32(
            G, gr, gc, ghn, hr, hc, dgs, dr, dcol, dh, nr, nc)  # fmt: skip

    def loop(G, gr, gc, ghn, hr, hc, dgs, dr, dcol, dh, nr, nc):
        for j in range(B):
            dht = dgs[dr, dcol + 2 * B + j]
            h0 = dgs[dr, dcol + j]
            z = G[gr, gc + j]
            r = G[gr, gc + B + j]
            gh = ghn[hr, hc + j]
            nn = G[gr, gc + 2 * B + j]
            dnp = dht * (1 - z) * (1 - nn * nn)
            dzp = dht * (h0 - nn) * z * (1 - z)
            drp = dnp * gh * r * (1 - r)
            G[gr, gc + j] = dzp
            G[gr, gc + B + j] = drp
            G[gr, gc + 2 * B + j] = dnp
            ghn[hr, hc + j] = dnp * r
            dgs[dr, dcol + j] = dzp
            dgs[dr, dcol + B + j] = drp
            dgs[dr, dcol + 2 * B + j] = dnp * r
            dh[nr, nc + j] = dht * z

    return loop


def rnn_cell_back(G, gr, gc, dgs, dr, dcol, relu):  # pragma: no cover
    """One block's RNN backward: G[gr, gc:+B] pre-activations -> gradients, also into
    dgs[dr, dcol:+B], which holds dh on entry; tanh, or relu if ``relu``."""
    raise NotImplementedError("numba-only")


@intrinsic
def _rnn_back_f32(typingctx, G, gr, gc, dgs, dr, dcol, relu):
    if not _f32(G, dgs):
        return None
    i = types.intp

    def gen(context, builder, sig, args):
        v = _Vec(context, builder, sig, args)
        pre, dht = v.load(0), v.load(3)
        h = v.tanh(pre)
        dtanh = v.mul(dht, v.b.fsub(v.const(1.0), v.mul(h, h)))
        # torch's threshold_backward, "pre <= 0 ? 0 : dh": a NaN pre-activation passes dh on
        # (an ordered ">" had zeroed it, and that sample's gradients differed from torch's)
        drelu = v.b.select(v.b.fcmp_unordered(">", pre, v.const(0.0)), dht, v.const(0.0))
        is_relu = builder.icmp_signed("!=", args[6], ir.Constant(args[6].type, 0))
        d = builder.select(is_relu, drelu, dtanh)
        v.store(d, 0)
        v.store(d, 3)
        return context.get_dummy_value()

    return types.void(G, i, i, dgs, i, i, relu), gen


@overload(rnn_cell_back, inline="always")
def _rnn_back_ov(G, gr, gc, dgs, dr, dcol, relu):
    if _f32(G, dgs):
        return lambda G, gr, gc, dgs, dr, dcol, relu: _rnn_back_f32(G, gr, gc, dgs, dr, dcol,
                                                                    relu)  # fmt: skip

    def loop(G, gr, gc, dgs, dr, dcol, relu):
        for j in range(B):
            pre = G[gr, gc + j]
            if relu:
                d = 0.0 if pre <= 0 else dgs[dr, dcol + j]
            else:
                h = tanh_(pre)
                d = dgs[dr, dcol + j] * (1 - h * h)
            G[gr, gc + j] = d
            dgs[dr, dcol + j] = d

    return loop


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
    if c0 + B <= K:  # a whole block
        block_add(tmp, n, col, dh, n, c0, dy, row, y_off + c0)
    else:
        for j in range(B):
            tmp[n, col + j] = dh[n, c0 + j] + dy[row, y_off + c0 + j] if c0 + j < K else zero


@inline
def _dh_gemm(RT, dgs, N, n0, n1, Gp, dhn, dh, s, lengths, reverse, add, me, parts, sync, g,
             consts):  # fmt: skip
    """Phase B: dh[n, v-block] = (dh if add else 0) + dgs[n] @ R[:, v-block], active n.
    A block is one panel of RT: 4 groups of B columns where there are enough of them (the
    6 x 64 tile does 24 FMAs per 10 loads; a 1-group panel's 6 x 16 tile 6 per 7, and phase
    B ran at a third of the forward step's GEMM rate), fewer where the threads would
    otherwise run out of blocks (Trainer._dh_groups chooses)."""
    V, Wb = RT.shape[0], RT.shape[2]
    Kp = dh.shape[1]
    for q in range(parts):
        lo, hi = claim(sync, me, q, parts, g, V)
        if hi < 0:
            continue
        for v in range(lo, hi):
            c0 = v * Wb
            # the next block, whose panel the (float) tile asks for as it goes (gemm._ahead)
            nv = v + 1 if v + 1 < hi else -1
            if Wb == 4 * B:
                panel4(RT, v, 0, dgs, n0, n1, Gp, dhn, c0, consts, -1, nv)
            elif Wb == 2 * B:
                panel2(RT, v, 0, dgs, n0, n1, Gp, dhn, c0, consts, -1, nv)
            else:
                panel1(RT, v, 0, dgs, n0, n1, Gp, dhn, c0, consts, -1, nv)
            c1 = min(c0 + Wb, Kp)  # the last panel's columns past Kp are zero weights
            for n in range(n0, n1):
                if _row(s, n, N, lengths, reverse) < 0:
                    continue
                if add:
                    for j in range(c0, c1):
                        dh[n, j] += dhn[n, j]
                else:
                    for j in range(c0, c1):
                        dh[n, j] = dhn[n, j]
        finish(sync, parts)
    return end_phase(sync, parts, g)


def _lstm_back(
    G, c0, cs, dy, y_off, dh, dc, RT, K, projd, P, hf, dhs, dgs, dhn, lengths, T, reverse,
    consts, me, parts, sync,
):  # fmt: skip
    zero = consts[0]
    N = dh.shape[0]
    Hp = c0.shape[1]
    U = Hp // B
    Gp = G.shape[1]
    NP = (P + B - 1) // B
    n0, n1, parts = share(N, me, parts, BACK_SHARE_TILES, ALIGN)  # this thread's samples
    g = 0  # phase counter, the same on every thread
    # The cell state of every step, oldest first (the forward kept only the gates).
    for q in range(parts):
        lo, hi = claim(sync, me, q, parts, g, U)
        if hi < 0:
            continue
        for u in range(lo, hi):
            r0 = u * 4 * B
            cb = u * B
            for n in range(n0, n1):
                for s in range(T):
                    row = _row(s, n, N, lengths, reverse)
                    if row < 0:
                        break
                    if s == 0:
                        lstm_c(G, row, r0, c0, n, cb, cs, row, cb)
                    else:
                        lstm_c(G, row, r0, cs, row + N if reverse else row - N, cb, cs, row, cb)
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
                    for n in range(n0, n1):
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
                ro = r0 + 3 * B
                cb = u * B
                for n in range(n0, n1):
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
                    lstm_cell_back(G, row, r0, cs, row, cb, cp, prow, cb, dgs, n, r0, dc, n, cb,
                                   hf, row if P > 0 else 0, cb, P > 0)  # fmt: skip
            finish(sync, parts)
        g = end_phase(sync, parts, g)
        g = _dh_gemm(RT, dgs, N, n0, n1, Gp, dhn, dh, s, lengths, reverse, False, me, parts,
                     sync, g, consts)  # fmt: skip
    return 0


def _gru_back(
    G, ghn, hprev, dy, y_off, dh, RT, K, dgs, dhn, lengths, T, reverse, consts, me, parts, sync,
):  # fmt: skip
    zero = consts[0]
    N = dh.shape[0]
    Hp = ghn.shape[1]
    U = Hp // B
    Gp = G.shape[1]
    n0, n1, parts = share(N, me, parts, BACK_SHARE_TILES, ALIGN)  # this thread's samples
    g = 0
    for s in range(T - 1, -1, -1):
        for q in range(parts):
            lo, hi = claim(sync, me, q, parts, g, U)
            if hi < 0:
                continue
            for u in range(lo, hi):
                r0 = u * 3 * B
                rz, rn = r0, r0 + 2 * B
                cb = u * B
                for n in range(n0, n1):
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
                    gru_cell_back(G, row, r0, ghn, row, cb, dgs, n, r0, dh, n, cb)  # dh = dh*z
            finish(sync, parts)
        g = end_phase(sync, parts, g)
        g = _dh_gemm(RT, dgs, N, n0, n1, Gp, dhn, dh, s, lengths, reverse, True, me, parts,
                     sync, g, consts)  # fmt: skip
    return 0


def _rnn_back(
    G, dy, y_off, dh, RT, K, dgs, dhn, lengths, T, reverse, relu, consts, me, parts, sync,
):  # fmt: skip
    zero = consts[0]
    N = dh.shape[0]
    Gp = G.shape[1]
    U = Gp // B
    n0, n1, parts = share(N, me, parts, BACK_SHARE_TILES, ALIGN)  # this thread's samples
    g = 0
    for s in range(T - 1, -1, -1):
        for q in range(parts):
            lo, hi = claim(sync, me, q, parts, g, U)
            if hi < 0:
                continue
            for u in range(lo, hi):
                cb = u * B
                for n in range(n0, n1):
                    row = _row(s, n, N, lengths, reverse)
                    if row < 0:
                        _zero(G, s * N + n, cb, B, zero)
                        _zero(dgs, n, cb, B, zero)
                        continue
                    _dh_in(dgs, n, cb, dh, dy, row, y_off, cb, K, zero)
                    rnn_cell_back(G, row, cb, dgs, n, cb, relu)
            finish(sync, parts)
        g = end_phase(sync, parts, g)
        g = _dh_gemm(RT, dgs, N, n0, n1, Gp, dhn, dh, s, lengths, reverse, False, me, parts,
                     sync, g, consts)  # fmt: skip
    return 0


lstm_back = kernel(_lstm_back)
gru_back = kernel(_gru_back)
rnn_back = kernel(_rnn_back)
