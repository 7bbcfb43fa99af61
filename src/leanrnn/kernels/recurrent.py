"""The recurrences: one numba kernel per cell runs every timestep of one (layer, direction).

Per step, each unit block u (B units; all gates of those units are one panel, see
formats.packing) is one task: it computes its gate pre-activations with the register-tiled panel
GEMM (gemm.py), then finishes the fused, in-place cell/hidden update for its units without
waiting for the other blocks — one vector pass for the default activations (_cells: explicit
vector IR), per-gate passes with the ONNX activation switch otherwise. Only two things need a
barrier inside a step, and take a second phase: the LSTM projection (needs the whole
unprojected h) and the GRU n gate with linear_before_reset = 0 (needs r*h of all units).

The step loop is written once (_steps: the steps, each one or two phases; _phase: a phase's
unit blocks, each a GEMM then every live sample's update). A cell is the hooks it hands in —
per phase a GEMM of one block and an update of one sample's block — and a tuple of its own
arrays and settings; the hooks are functions passed as arguments, inlined where they are
called, so each kernel compiles to its own cell's loop with no branch on the cell.

One sample (batch-1 latency, a stream's steps) takes _steps_one instead: the same GEMV and
update per block in the same order and the same block slices, so the same bits, with none of
the batch loop's bookkeeping, which cost a third of a batch-1 LSTM H=128 step.

Threads (see _sync): every thread of an op calls the same kernel with its index ``me`` of
``parts``. A batch large enough (_sync.share) is cut into tile-aligned sample slices, one per
thread, each running every step on its own with no barrier at all; otherwise each phase (step,
or half-step) is cut into ``parts`` slices of unit blocks that the threads claim and finish
before any of them moves on. parts == 1 is the plain serial loop.

Arrays (shared vocabulary; D*K output columns, Kp/Hp/Gp padded sizes):
  xw:      [T*N, Gp] input projection with folded bias, rows t*N + n (time-major) or
           n*T + t when xw_bf_T = T > 0 (it follows the layout of the layer input)
  Rt:      [U, Kp, ng*B] gate-fused recurrent panels;  K = real recurrent width (P or H)
  h_a/h_b: [N, Kp]   state double buffer; h_a holds h0 on entry (without a slot table). The
                     return value says which holds the final state (0: h_a, 1: h_b). Blocks
                     read h_prev while others write h_next, so h cannot be updated in place;
                     c can, and is.
  c:       [N, Hp]   LSTM cell state, in/out; with a slot table [S, Hp], row slot[n] for n
  slot:    [N] int64 slot table, or [0]: no slots. With one, the states live in fixed rows of
           a store that outlives the call (serve's streams): h_a's rows are gathered from
           h_store[slot[n]] (zeros where slot[n] < 0, rows of lengths 0) before the first step,
           a sample's last valid step also writes its h there, and c is the store itself
           (updated in place at row slot[n]). Frozen samples and rows of other slots are
           never touched. The steps in between run on the dense double buffer, so every
           step's GEMM stays on contiguous rows. Slots are distinct (the engine checks).
  h_store: [S, K]    the hidden states by slot (only columns 0..K are read and written, so
                     unpadded rows will do); [0, 0] without a slot table
  gates:   [N, Gp]   scratch; hfull/rh: [N, Hp] scratch (LSTM projection / GRU r*h); H the
                     real hidden width the LSTM projection reads of hfull
  lengths: [N] int64 valid steps per sample (<= T); a sample's state freezes after it, and
           from then on its row leaves the step GEMMs when no live row comes after it
           (_live_end): rows sorted longest first (serve's calls, score's batches) run each
           step on the live rows only, as a packed sequence does
  y:       [rows, D*K] output; row t*N + n, or n*T + t when y_bf_T = T > 0; columns
           y_off..y_off+K. Steps past a sample's length are written as zeros.
  acts/alphas/betas: activation codes and parameters (LSTM f,g,h; GRU f,g; RNN f)
  consts:  [zero, one, tiny, clip] in the working dtype (clip <= 0: no clip)
  q:       [threads, bytes] uint8 scratch: with int8-dynamic panels (uint8 Rt) each thread
           quantizes the rows it multiplies (h_prev, the GRU's r*h) into its own row q[me]
           once per phase (gemm.operand) — N*K element ops against N*K*G multiply-adds;
           with bf16 panels on AMX it holds those rows split into bfloat16 terms, with
           bf16_act those rows rounded
  bf16_act: bf16 panels multiply those rows rounded to bfloat16 (as torch's autocast does;
           on AMX one tile product instead of the split's two; precision "bf16-act")
  keep:    training (train.session): leave each step's gates in its xw row (the LSTM's and
           GRU's activated, the RNN's pre-activations; backward reads them instead of
           recomputing h_prev R^T and the activations); GRU also writes R_n h + bR_n
           to ghn [rows, Hp]. Only the fused paths of PyTorch's cells keep (the others are
           ONNX-only and never trained); the outputs are the same bits either way.
  me, parts, sync: this thread's index, the thread count and their sync array (see _sync)
No argument may alias another.
"""

from __future__ import annotations

from ._cells import (
    block_copy,
    gru_update,
    gru_update_keep,
    lstm_update,
    lstm_update_keep,
    rnn_update,
)
from ._ir import prefetch_l2
from ._jit import inline, kernel
from ._math import SIGMOID, TANH, act_span, clip_span, flush
from ._sync import SHARE_TILES, claim, end_phase, finish, share
from .abi import B
from .gemm import (
    next_panel_share,
    operand,
    panel1,
    panel2,
    panel3,
    panel4,
    prefetch_next_panel,
    slice_rows,
)


@inline
def _yrow(t, n, N, y_bf_T):
    return n * y_bf_T + t if y_bf_T > 0 else t * N + n


@inline
def _block(i, lo, hi, s):
    """The unit block a slice lo..hi walks i-th at step s: forward on even steps, backward on
    odd ones. Where a thread's share of R is larger than its L2, a forward-only walk misses on
    every block (the LRU cache has just evicted what comes next); turning round at each end
    starts every step on the blocks the last one left in L2, so about an L2's worth of R per
    step comes from there instead of L3. Blocks are independent within a phase, so the order
    changes no result."""
    return i if s % 2 == 0 else lo + hi - 1 - i


@inline
def _time_of(s, n, lengths, reverse, carry, hp, hn, j0):
    """Sample n's time index at step s of the loop, or -1 once s is past its length: its state
    then freezes, so (if ``carry``) block j0..j0+B of h is carried from hp to hn."""
    L = lengths[n]
    if s >= L:
        if carry:
            for j in range(j0, j0 + B):
                hn[n, j] = hp[n, j]
        return -1
    return L - 1 - s if reverse else s


@inline
def _zero_tails(y, y_off, K, lengths, T, N, y_bf_T, zero):
    for n in range(N):
        for t in range(lengths[n], T):
            r = _yrow(t, n, N, y_bf_T)
            for j in range(K):
                y[r, y_off + j] = zero


@inline
def _add_span(dst, row, start, src, srow, length):
    for j in range(length):
        dst[row, start + j] += src[srow, start + j]


@inline
def _gru_finish(gates, n, rz, rn, c0, hp, hn, clip, ag, alg, beg, zero, one, tiny):
    """n = g(clip(pre_n)) in place, then h' = (1 - z)*n + z*h for one unit block of sample n."""
    if clip > zero:
        clip_span(clip, gates, n, rn, B)
    act_span(ag, alg, beg, zero, one, gates, n, rn, B)
    for j in range(B):
        z = gates[n, rz + j]
        hv = (one - z) * gates[n, rn + j] + z * hp[n, c0 + j]
        hn[n, c0 + j] = flush(hv, tiny, zero)


@inline
def _keep_span(xw, xr, col, gates, n, length, zero):
    """xw row += gates row (the pre-activation stays in xw: the RNN's), gates row = 0: the
    fused update that follows adds the two again and gets the same bits."""
    for j in range(length):
        xw[xr, col + j] += gates[n, col + j]
        gates[n, col + j] = zero


@inline
def _gather(slot, h_store, hp, K, zero, n0, n1, me, parts, sync, g):
    """h_{-1}: rows n0..n1 of hp from h_store[slot[n]] (zeros for slot[n] < 0), one phase of
    row slices: the first step's GEMM (and an int8-dynamic operand) reads every row. On batch
    slices (_sync.share: parts 1, no barrier) a thread gathers only its own samples: another
    thread's rows may already be past their first step."""
    for sl in range(parts):
        lo, hi = claim(sync, me, sl, parts, g, n1 - n0)
        if hi < 0:
            continue  # another thread has this slice
        for n in range(n0 + lo, n0 + hi):
            sn = slot[n]
            if sn < 0:
                for j in range(K):
                    hp[n, j] = zero
            else:
                for j in range(K):
                    hp[n, j] = h_store[sn, j]
        finish(sync, parts)
    return end_phase(sync, parts, g)


@inline
def _put(slotted, slot, h_store, hn, n, c0, K, s, lengths):
    """At sample n's last valid step, its new h block (real units only) into its slot."""
    if slotted and s == lengths[n] - 1:
        sn = slot[n]
        for j in range(c0, min(c0 + B, K)):
            h_store[sn, j] = hn[n, j]


@inline
def _emit(hn, n, c0, y, yr, y_off, K):
    """Copy the block's new h (its real units only) into output row yr."""
    if c0 + B <= K:  # a whole block
        block_copy(y, yr, y_off + c0, hn, n, c0)
    else:
        for j in range(K - c0):
            y[yr, y_off + c0 + j] = hn[n, c0 + j]


# --------------------------------------------------------------------------- the step loop
# (the module docstring says how cells hand in their hooks)


@inline
def _live_end(lengths, n0, n1, s, rows):
    """The end of the step-s GEMM's rows of n0..n1: past the last sample still live, rounded
    up to whole slices of ``rows`` (slice_rows: a multiple of every tile height; n0 if none
    is live). The rows left out have frozen states, which no step reads from the GEMM
    (_time_of skips them); the rows kept share their tiles with the same rows as in a GEMM
    of all of n0..n1, so every result keeps its bits (a lone live row of a larger slice
    would otherwise take the GEMV, whose sums run in another order). A row that froze ahead
    of a live one still rides along: callers order rows longest first to drop them all."""
    m = n1
    while m > n0 and lengths[m - 1] <= s:
        m -= 1
    return min(n1, n0 + (m - n0 + rows - 1) // rows * rows)


@inline
def _phase(gemm, update, cell, W, A, Kin, carry, s, hp, hn, n0, n1, g, xw, xw_bf_T, K, gates,
           slot, h_store, lengths, reverse, y, y_off, y_bf_T, consts, keep, me, parts, sync):  # fmt: skip
    """One phase of step s: the unit blocks of W (one per task, claimed by slices, walked by
    _block), each its GEMM for rows n0..n1 then every live sample's update; returns the next
    phase counter. Samples past their length are skipped (their h block carried to hn if
    ``carry``: the phase that writes h). (Python passes a call of more than 30 arguments as
    *args, which numba cannot inline: hence k4 and gs made here, not passed.)"""
    N = hp.shape[0]
    span = xw.shape[1] // W.shape[0]  # xw columns per unit block (its gates)
    span_bytes = span * xw.itemsize
    k4 = (consts[0], consts[1], consts[2], consts[3])  # zero, one, tiny, clip: read once
    gs = gates[n0:]  # the panel GEMMs' C: row 0 is sample n0, as in their A (operand)
    m = _live_end(lengths, n0, n1, s, slice_rows(W))  # GEMM rows; updates walk n0..n1
    # reduced panels' next panel, a share per row (float tiles ask for theirs: gemm._ahead)
    per = next_panel_share(W, m - n0)
    for sl in range(parts):
        lo, hi = claim(sync, me, sl, parts, g, W.shape[0])
        if hi < 0:
            continue  # another thread has this slice
        for i in range(lo, hi):
            u = _block(i, lo, hi, s)
            nb = _block(i + 1, lo, hi, s) if i + 1 < hi else -1
            if m > n0:  # its tile asks for block nb's panel as it goes (gemm._ahead)
                gemm(cell, W, u, A, n0, m, Kin, gs, hn, consts, nb)
            # the next block's xw span of each row, asked for now (_ir.prefetch_l2)
            nxt = nb * span if nb >= 0 else -1
            for n in range(n0, n1):
                prefetch_next_panel(W, nb, n - n0, per)
                t = _time_of(s, n, lengths, reverse, carry, hp, hn, u * B)
                if t >= 0:
                    if nxt >= 0:
                        prefetch_l2(xw, _yrow(t, n, N, xw_bf_T), nxt, span_bytes)
                    update(cell, u, s, n, t, N, hp, hn, xw, xw_bf_T, K, gates, slot, h_store,
                           lengths, y, y_off, y_bf_T, k4, keep)  # fmt: skip
        finish(sync, parts)
    return end_phase(sync, parts, g)


@inline
def _steps_one(gemm, update, cell, xw, xw_bf_T, Rt, K, hp, hn, gates, slot, h_store, lengths, T,
               reverse, y, y_off, y_bf_T, consts, keep, q, bf16_act, me, parts, sync, g):  # fmt: skip
    """_steps for one sample without a slot table and one phase per step (batch-1 latency, a
    stream's steps): the same GEMVs and updates in the same order, its threads claiming the
    same block slices, so the same bits, without the batch loop's bookkeeping — live-row ends,
    frozen rows, per-row prefetch shares (the steps past the sample's length are not run:
    _zero_tails wrote them, and its state is the last valid step's, left in the buffer T steps
    would leave it in). That bookkeeping cost a third of an LSTM H=128 step on one thread of a
    Zen 4 (5.8 against ~4 us; the panel GEMV alone is 2.4) and a fifth on two."""
    k4 = (consts[0], consts[1], consts[2], consts[3])  # zero, one, tiny, clip: read once
    U = Rt.shape[0]
    span = xw.shape[1] // U  # xw columns per unit block (its gates)
    span_bytes = span * xw.itemsize
    per = next_panel_share(Rt, 1)
    L = min(lengths[0], T)  # (the batch loop runs min(length, T) steps too: _time_of)
    for s in range(L):
        t = L - 1 - s if reverse else s
        A = operand(Rt, hp, q, me, 0, 1, K, True, bf16_act)
        for sl in range(parts):
            lo, hi = claim(sync, me, sl, parts, g, U)
            if hi < 0:
                continue  # another thread has this slice
            for i in range(lo, hi):
                u = _block(i, lo, hi, s)
                nb = _block(i + 1, lo, hi, s) if i + 1 < hi else -1
                gemm(cell, Rt, u, A, 0, 1, K, gates, hn, consts, nb)
                if nb >= 0:  # the next block's panel (reduced panels) and xw span, asked now
                    prefetch_next_panel(Rt, nb, 0, per)
                    prefetch_l2(xw, _yrow(t, 0, 1, xw_bf_T), nb * span, span_bytes)
                update(cell, u, s, 0, t, 1, hp, hn, xw, xw_bf_T, K, gates, slot, h_store,
                       lengths, y, y_off, y_bf_T, k4, keep)  # fmt: skip
            finish(sync, parts)
        g = end_phase(sync, parts, g)
        hp, hn = hn, hp
    # the state where T steps leave it, as frozen rows carry it (_time_of); past the last
    # step's barrier every slice's update is written
    if (T - L) % 2 == 1 and me == 0:
        for j in range(hp.shape[1]):
            hn[0, j] = hp[0, j]
    return T % 2


@inline
def _steps(gemm1, update1, carry1, gemm2, update2, second, cell, xw, xw_bf_T, Rt, K, h_a, h_b,
           slot, h_store, gates, lengths, T, reverse, y, y_off, Kout, y_bf_T, consts, keep, q,
           bf16_act, me, parts, sync):  # fmt: skip
    """Every step of one (layer, direction): phase 1 on Rt and h_prev, then, where second =
    (run, W2, src2, K2) says run, phase 2 on W2 and src2 (K2 inputs); returns which buffer
    holds the final h (see the module docstring)."""
    run2, W2, src2, K2 = second
    zero = consts[0]
    N = h_a.shape[0]
    # this thread's samples; parts: its block slices
    n0, n1, parts = share(N, me, parts, SHARE_TILES, slice_rows(Rt))
    if me == 0:  # one thread zeroes the steps past each length
        _zero_tails(y, y_off, Kout, lengths, T, N, y_bf_T, zero)
    hp = h_a
    hn = h_b
    parity = 0
    g = 0  # phase counter, the same on every thread
    if N == 1 and slot.shape[0] == 0 and not run2:
        return _steps_one(gemm1, update1, cell, xw, xw_bf_T, Rt, K, hp, hn, gates, slot, h_store,
                          lengths, T, reverse, y, y_off, y_bf_T, consts, keep, q, bf16_act, me,
                          parts, sync, g)  # fmt: skip
    if slot.shape[0] > 0:
        g = _gather(slot, h_store, hp, K, zero, n0, n1, me, parts, sync, g)
    for s in range(T):
        m = _live_end(lengths, n0, n1, s, slice_rows(Rt))  # _phase's GEMM rows: the
        A = operand(Rt, hp, q, me, n0, m, K, True, bf16_act)  # split operand follows them
        g = _phase(gemm1, update1, cell, Rt, A, K, carry1, s, hp, hn, n0, n1, g, xw, xw_bf_T, K,
                   gates, slot, h_store, lengths, reverse, y, y_off, y_bf_T, consts, keep, me,
                   parts, sync)  # fmt: skip
        if run2:
            m = _live_end(lengths, n0, n1, s, slice_rows(W2))
            A = operand(W2, src2, q, me, n0, m, K2, True, bf16_act)
            g = _phase(gemm2, update2, cell, W2, A, K2, True, s, hp, hn, n0, n1, g, xw,
                       xw_bf_T, K, gates, slot, h_store, lengths, reverse, y, y_off, y_bf_T,
                       consts, keep, me, parts, sync)  # fmt: skip
        hp, hn = hn, hp
        parity = 1 - parity
    return parity


@inline
def _done(slot, h_store, hn, n, c0, K, s, lengths, y, yr, y_off):
    """A sample's new h block is final: into its output row and, at its last step, its slot."""
    _emit(hn, n, c0, y, yr, y_off, K)
    _put(slot.shape[0] > 0, slot, h_store, hn, n, c0, K, s, lengths)


# ---------------------------------------------------------------------------------- LSTM
# cell: (peep, use_peep, P, c, hfull, input_forget, fast, acts, alphas, betas) — the last three
# as tuples of scalars (f, g, h), read once per call.


@inline
def _lstm_gates(cell, W, u, A, n0, n1, Kin, gs, hn, consts, nb):
    panel4(W, u, 0, A, 0, n1 - n0, Kin, gs, u * 4 * B, consts, -1, nb)


@inline
def _lstm_cell(cell, u, s, n, t, N, hp, hn, xw, xw_bf_T, K, gates, slot, h_store, lengths, y,
               y_off, y_bf_T, k4, keep):  # fmt: skip
    peep, use_peep, P, c = cell[0], cell[1], cell[2], cell[3]
    hfull, input_forget, fast = cell[4], cell[5], cell[6]
    af, ag, ah = cell[7]
    alf, alg, alh = cell[8]
    bef, beg, beh = cell[9]
    zero, one, tiny, clip = k4
    r0 = u * 4 * B
    ri, rf, rg, ro = r0, r0 + B, r0 + 2 * B, r0 + 3 * B
    c0 = u * B
    xr = _yrow(t, n, N, xw_bf_T)
    cr = slot[n] if slot.shape[0] > 0 else n  # c's row
    if fast:
        dst = hn if P == 0 else hfull
        if keep:  # the activated gates stay in xw, stored from registers
            lstm_update_keep(gates, n, r0, xw, xr, r0, c, cr, c0, dst, n, c0, tiny)
        else:
            lstm_update(gates, n, r0, xw, xr, r0, c, cr, c0, dst, n, c0, tiny)
        if P == 0:
            _done(slot, h_store, hn, n, c0, K, s, lengths, y, _yrow(t, n, N, y_bf_T), y_off)
        return
    _add_span(gates, n, r0, xw, xr, 4 * B)
    if use_peep:
        for j in range(B):
            gates[n, ri + j] += peep[0, c0 + j] * c[cr, c0 + j]
            gates[n, rf + j] += peep[1, c0 + j] * c[cr, c0 + j]
    if clip > zero:
        clip_span(clip, gates, n, ri, 3 * B)
    act_span(af, alf, bef, zero, one, gates, n, ri, B)
    if input_forget:
        for j in range(B):
            gates[n, rf + j] = one - gates[n, ri + j]
    else:
        act_span(af, alf, bef, zero, one, gates, n, rf, B)
    act_span(ag, alg, beg, zero, one, gates, n, rg, B)
    for j in range(B):
        cc = gates[n, rf + j] * c[cr, c0 + j] + gates[n, ri + j] * gates[n, rg + j]
        c[cr, c0 + j] = flush(cc, tiny, zero)
    if use_peep:
        for j in range(B):
            gates[n, ro + j] += peep[2, c0 + j] * c[cr, c0 + j]
    if clip > zero:
        clip_span(clip, gates, n, ro, B)
    act_span(af, alf, bef, zero, one, gates, n, ro, B)
    # The g slot is free now: reuse it for h(c).
    for j in range(B):
        gates[n, rg + j] = c[cr, c0 + j]
    act_span(ah, alh, beh, zero, one, gates, n, rg, B)
    if P == 0:
        for j in range(B):
            hn[n, c0 + j] = flush(gates[n, ro + j] * gates[n, rg + j], tiny, zero)
        _done(slot, h_store, hn, n, c0, K, s, lengths, y, _yrow(t, n, N, y_bf_T), y_off)
    else:
        for j in range(B):
            hfull[n, c0 + j] = gates[n, ro + j] * gates[n, rg + j]


@inline
def _lstm_projection(cell, W, u, A, n0, n1, Kin, gs, hn, consts, nb):
    """h = hfull proj^T, block u of the projected units, straight into hn."""
    panel1(W, u, 0, cell[4], n0, n1, Kin, hn, u * B, consts, -1, nb)


@inline
def _lstm_projected(cell, u, s, n, t, N, hp, hn, xw, xw_bf_T, K, gates, slot, h_store, lengths,
                    y, y_off, y_bf_T, k4, keep):  # fmt: skip
    zero, tiny = k4[0], k4[2]
    p0 = u * B
    yr = _yrow(t, n, N, y_bf_T)
    for p in range(p0, min(p0 + B, cell[2])):  # the P projected units
        v = flush(hn[n, p], tiny, zero)
        hn[n, p] = v
        y[yr, y_off + p] = v
    _put(slot.shape[0] > 0, slot, h_store, hn, n, p0, K, s, lengths)


def _lstm(
    xw, xw_bf_T, Rt, K, peep, use_peep, proj, P, H, h_a, h_b, c, slot, h_store, gates, hfull,
    lengths, T, reverse, y, y_off, y_bf_T, acts, alphas, betas, input_forget, consts, keep, q,
    bf16_act, me, parts, sync,
):  # fmt: skip
    # The common case (PyTorch's LSTM) as one fused loop per unit block: all four gates, the
    # cell and the hidden update in registers, one vector pass — no per-gate passes.
    fast = acts[0] == SIGMOID and acts[1] == TANH and acts[2] == TANH and not use_peep
    fast = fast and not input_forget and not consts[3] > consts[0]
    cell = (peep, use_peep, P, c, hfull, input_forget, fast, (acts[0], acts[1], acts[2]),
            (alphas[0], alphas[1], alphas[2]), (betas[0], betas[1], betas[2]))  # fmt: skip
    Kout = P if P > 0 else K  # output columns
    # the projection, over the H real units only: the padding's hfull is NaN when an input is
    # infinite (inf * the padding's zero weights), and NaN * 0 reached every projected unit
    second = (P > 0, proj, hfull, H)
    return _steps(_lstm_gates, _lstm_cell, P == 0, _lstm_projection, _lstm_projected, second, cell,
                  xw, xw_bf_T, Rt, K, h_a, h_b, slot, h_store, gates, lengths, T, reverse, y, y_off,
                  Kout, y_bf_T, consts, keep, q, bf16_act, me, parts, sync)  # fmt: skip


# ----------------------------------------------------------------------------------- GRU
# cell: (rb, linear_before_reset, rh, ghn, fast, acts, alphas, betas) — the last three (f, g).


@inline
def _gru_gates(cell, W, u, A, n0, n1, Kin, gs, hn, consts, nb):
    if cell[1]:  # linear_before_reset: all three gates' R h here
        panel3(W, u, 0, A, 0, n1 - n0, Kin, gs, u * 3 * B, consts, -1, nb)
    else:  # n's R (r*h) comes in the second phase
        panel2(W, u, 0, A, 0, n1 - n0, Kin, gs, u * 3 * B, consts, -1, nb)


@inline
def _gru_cell(cell, u, s, n, t, N, hp, hn, xw, xw_bf_T, K, gates, slot, h_store, lengths, y,
              y_off, y_bf_T, k4, keep):  # fmt: skip
    rb, linear_before_reset, rh, ghn, fast = cell[0], cell[1], cell[2], cell[3], cell[4]
    af, ag = cell[5]
    alf, alg = cell[6]
    bef, beg = cell[7]
    zero, one, tiny, clip = k4
    r0 = u * 3 * B
    rz, rr, rn = r0, r0 + B, r0 + 2 * B
    c0 = u * B
    xr = _yrow(t, n, N, xw_bf_T)
    if fast:  # PyTorch's GRU in one fused pass
        if keep:  # z, r and n stay in xw, stored from registers
            for j in range(B):
                ghn[xr, c0 + j] = gates[n, rn + j] + rb[rn + j]
            gru_update_keep(gates, n, r0, xw, xr, r0, rb, hp, n, c0, hn, n, c0, tiny)
        else:
            gru_update(gates, n, r0, xw, xr, r0, rb, hp, n, c0, hn, n, c0, tiny)
        _done(slot, h_store, hn, n, c0, K, s, lengths, y, _yrow(t, n, N, y_bf_T), y_off)
        return
    _add_span(gates, n, rz, xw, xr, 2 * B)
    if clip > zero:
        clip_span(clip, gates, n, rz, 2 * B)
    act_span(af, alf, bef, zero, one, gates, n, rz, 2 * B)
    if linear_before_reset:
        for j in range(B):
            gates[n, rn + j] = xw[xr, rn + j] + gates[n, rr + j] * (gates[n, rn + j] + rb[rn + j])
        _gru_finish(gates, n, rz, rn, c0, hp, hn, clip, ag, alg, beg, zero, one, tiny)
        _done(slot, h_store, hn, n, c0, K, s, lengths, y, _yrow(t, n, N, y_bf_T), y_off)
    else:
        for j in range(B):
            rh[n, c0 + j] = gates[n, rr + j] * hp[n, c0 + j]


@inline
def _gru_reset_gemm(cell, W, u, A, n0, n1, Kin, gs, hn, consts, nb):
    """R_n (r*h) for block u: the n gate's panel group (2) into its gate columns."""
    panel1(W, u, 2, A, 0, n1 - n0, Kin, gs, u * 3 * B + 2 * B, consts, -1, nb)


@inline
def _gru_reset_cell(cell, u, s, n, t, N, hp, hn, xw, xw_bf_T, K, gates, slot, h_store, lengths,
                    y, y_off, y_bf_T, k4, keep):  # fmt: skip
    ag, alg, beg = cell[5][1], cell[6][1], cell[7][1]
    zero, one, tiny, clip = k4
    rz, rn = u * 3 * B, u * 3 * B + 2 * B
    c0 = u * B
    _add_span(gates, n, rn, xw, _yrow(t, n, N, xw_bf_T), B)
    _gru_finish(gates, n, rz, rn, c0, hp, hn, clip, ag, alg, beg, zero, one, tiny)
    _done(slot, h_store, hn, n, c0, K, s, lengths, y, _yrow(t, n, N, y_bf_T), y_off)


def _gru(
    xw, xw_bf_T, Rt, K, rb, linear_before_reset, h_a, h_b, slot, h_store, gates, rh, lengths, T,
    reverse, y, y_off, y_bf_T, acts, alphas, betas, consts, keep, ghn, q, bf16_act, me, parts,
    sync,
):  # fmt: skip
    fast = acts[0] == SIGMOID and acts[1] == TANH and not consts[3] > consts[0]
    fast = fast and linear_before_reset
    cell = (rb, linear_before_reset, rh, ghn, fast, (acts[0], acts[1]), (alphas[0], alphas[1]),
            (betas[0], betas[1]))  # fmt: skip
    second = (not linear_before_reset, Rt, rh, K)  # R_n (r*h) after r
    return _steps(_gru_gates, _gru_cell, linear_before_reset, _gru_reset_gemm, _gru_reset_cell,
                  second, cell, xw, xw_bf_T, Rt, K, h_a, h_b, slot, h_store, gates, lengths, T,
                  reverse, y, y_off, K, y_bf_T, consts, keep, q, bf16_act, me, parts,
                  sync)  # fmt: skip


# ----------------------------------------------------------------------------------- RNN
# cell: (f, alpha, beta) of its activation.


@inline
def _rnn_gates(cell, W, u, A, n0, n1, Kin, gs, hn, consts, nb):
    panel1(W, u, 0, A, 0, n1 - n0, Kin, gs, u * B, consts, -1, nb)


@inline
def _rnn_cell(cell, u, s, n, t, N, hp, hn, xw, xw_bf_T, K, gates, slot, h_store, lengths, y,
              y_off, y_bf_T, k4, keep):  # fmt: skip
    af, alf, bef = cell
    zero, one, tiny, clip = k4
    r0 = u * B
    xr = _yrow(t, n, N, xw_bf_T)
    if af == TANH and not clip > zero:  # the common case, fused
        if keep:
            _keep_span(xw, xr, r0, gates, n, B, zero)
        rnn_update(gates, n, r0, xw, xr, r0, hn, n, r0, tiny)
    else:
        _add_span(gates, n, r0, xw, xr, B)
        if clip > zero:
            clip_span(clip, gates, n, r0, B)
        if keep:  # RNN relu (trainable): the pre-activation is in gates now
            for j in range(B):
                xw[xr, r0 + j] = gates[n, r0 + j]
        act_span(af, alf, bef, zero, one, gates, n, r0, B)
        for j in range(B):
            hn[n, r0 + j] = flush(gates[n, r0 + j], tiny, zero)
    _done(slot, h_store, hn, n, r0, K, s, lengths, y, _yrow(t, n, N, y_bf_T), y_off)


def _rnn(
    xw, xw_bf_T, Rt, K, h_a, h_b, slot, h_store, gates, lengths, T, reverse, y, y_off, y_bf_T, acts,
    alphas, betas, consts, keep, q, bf16_act, me, parts, sync,
):  # fmt: skip
    cell = (acts[0], alphas[0], betas[0])
    # one phase: the second's hooks are the first's, never run
    second = (False, Rt, h_a, K)
    return _steps(_rnn_gates, _rnn_cell, True, _rnn_gates, _rnn_cell, second, cell, xw, xw_bf_T,
                  Rt, K, h_a, h_b, slot, h_store, gates, lengths, T, reverse, y, y_off, K, y_bf_T,
                  consts, keep, q, bf16_act, me, parts, sync)  # fmt: skip


lstm = kernel(_lstm)
gru = kernel(_gru)
rnn = kernel(_rnn)
