"""leanrnn.train: gradients of the numpy-only Trainer against torch's own modules (float32 and
float64), against finite differences (no torch), recomputation against storing, tapes refused
when stale."""

from __future__ import annotations

import copy

import numpy as np
import pytest

import leanrnn
from helpers import bf16_act_twin
from leanrnn.errors import DTypeError, PlanError, ShapeError, SpecError
from leanrnn.formats import torch_format
from leanrnn.kernels import abi
from leanrnn.train import TapeError, Trainer
from tolerances import ATOL, RTOL_AUTOCAST_BF16, RTOL_AUTOCAST_BF16_ACT, RTOL_FINITE_DIFF, RTOL_GRAD

torch = pytest.importorskip("torch")

CASES = [  # cell, options
    ("LSTM", {}),
    ("GRU", {}),
    ("RNN", {}),
    ("RNN", {"nonlinearity": "relu", "num_layers": 2}),
    ("LSTM", {"num_layers": 2, "bidirectional": True}),
    ("GRU", {"num_layers": 3, "bidirectional": True}),
    ("RNN", {"num_layers": 2, "bidirectional": True}),
    ("LSTM", {"proj_size": 5}),
    ("LSTM", {"proj_size": 5, "num_layers": 2, "bidirectional": True}),
    ("LSTM", {"bias": False}),
    ("GRU", {"bias": False, "batch_first": True}),
    ("LSTM", {"num_layers": 2, "batch_first": True}),
]


def _torch_grads(m, x, hx, lengths, bf, seed=1):
    """torch's outputs and every gradient for loss = <y, dy> + <h_n, dh_n> (+ <c_n, dc_n>)."""
    g = torch.Generator().manual_seed(seed)
    if lengths is not None:
        pk = torch.nn.utils.rnn.pack_padded_sequence(
            x, torch.tensor(lengths), batch_first=bf, enforce_sorted=False
        )
        yp, hn = m(pk, hx)
        y, _ = torch.nn.utils.rnn.pad_packed_sequence(
            yp, batch_first=bf, total_length=x.shape[1 if bf else 0]
        )
    else:
        y, hn = m(x, hx)
    states = list(hn) if isinstance(hn, tuple) else [hn]
    cot = [torch.randn(t.shape, generator=g, dtype=t.dtype) for t in [y, *states]]
    loss = sum((t * c).sum() for t, c in zip([y, *states], cot, strict=True))
    loss.backward()
    return y.detach().numpy(), [c.numpy() for c in cot]


def _rel(a, b):
    return np.abs(a - b).max() / max(np.abs(b).max(), 1e-30)


def _assert_grads_match(tr, m, inputs, got, rtol):
    """The trainer's dx, dh0 (dc0) and weight gradients against torch's, left on ``inputs``
    (x, h0, c0) and ``m``'s parameters by _torch_grads; dc0 only for an LSTM (got[2] set)."""
    for g, t in zip(got, inputs, strict=True):
        if g is not None:
            assert _rel(g, t.grad.numpy()) <= rtol
    grads = torch_format.to_state_dict(tr.spec, tr.gradients())
    for name, p in m.named_parameters():
        assert _rel(grads[name], p.grad.numpy()) <= rtol, name


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("cell", "kw"), CASES)
@pytest.mark.parametrize("lengths", [None, [3]])
def test_one_sample_gradients_match_torch(cell, kw, lengths, threads, monkeypatch):
    """One sample's training forward takes the single-sample step loop (kernels.recurrent
    ._steps_one; keep: the gates stay in xw for backward), on 1 thread and on 2 threads' block
    slices: its outputs and every gradient against torch's (float64), also with the length
    short of T (the state where T steps leave it: train.session reads buffer T % 2)."""
    monkeypatch.setattr("leanrnn.train.session.PARALLEL_MIN_MACS", 0)  # threads at any size
    torch.manual_seed(0)
    T, N, C, H = 5, 1, 4, 20
    m = getattr(torch.nn, cell)(C, H, **kw).to(torch.float64)
    bf = kw.get("batch_first", False)
    L = kw.get("num_layers", 1)
    D = 2 if kw.get("bidirectional") else 1
    K = kw.get("proj_size") or H
    x = torch.randn((N, T, C) if bf else (T, N, C), dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(L * D, N, K, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(L * D, N, H, dtype=torch.float64, requires_grad=True)
    hx = (h0, c0) if cell == "LSTM" else h0
    y_ref, cot = _torch_grads(m, x, hx, lengths, bf)
    tr = Trainer(leanrnn.from_torch(m), threads=threads)
    hxn = (h0.detach().numpy(), c0.detach().numpy()) if cell == "LSTM" else h0.detach().numpy()
    tape = tr.forward(x.detach().numpy(), hxn, lengths=lengths)
    assert (tr._sync[abi.CLAIM0 * abi.LINE] > 0) == (threads == 2)  # block slices on 2
    assert np.abs(tape.y - y_ref).max() <= ATOL[np.float64]
    dx, dh0, dc0 = tr.backward(tape, *cot)
    _assert_grads_match(tr, m, (x, h0, c0), (dx, dh0, dc0), RTOL_GRAD[np.float64])


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize(("cell", "kw"), CASES)
@pytest.mark.parametrize("lengths", [None, [5, 2, 4]])
def test_gradients_match_torch(cell, kw, lengths, dtype):
    tdt = torch.float64 if dtype == np.float64 else torch.float32
    torch.manual_seed(0)
    T, N, C, H = 5, 3, 4, 20
    m = getattr(torch.nn, cell)(C, H, **kw).to(tdt)
    bf = kw.get("batch_first", False)
    L = kw.get("num_layers", 1)
    D = 2 if kw.get("bidirectional") else 1
    K = kw.get("proj_size") or H
    x = torch.randn((N, T, C) if bf else (T, N, C), dtype=tdt, requires_grad=True)
    h0 = torch.randn(L * D, N, K, dtype=tdt, requires_grad=True)
    c0 = torch.randn(L * D, N, H, dtype=tdt, requires_grad=True)
    hx = (h0, c0) if cell == "LSTM" else h0
    y_ref, cot = _torch_grads(m, x, hx, lengths, bf)

    tr = Trainer(leanrnn.from_torch(m))
    npx = x.detach().numpy()
    hxn = (h0.detach().numpy(), c0.detach().numpy()) if cell == "LSTM" else h0.detach().numpy()
    tape = tr.forward(npx, hxn, lengths=lengths)
    assert np.abs(tape.y - y_ref).max() <= ATOL[dtype]
    dx, dh0, dc0 = tr.backward(tape, *cot)
    rtol = RTOL_GRAD[dtype]
    _assert_grads_match(tr, m, (x, h0, c0), (dx, dh0, dc0), rtol)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("cell", "kw"), [
    ("LSTM", {"bidirectional": True}),
    ("LSTM", {"proj_size": 40}),
    ("GRU", {"num_layers": 2}),
    ("RNN", {"bidirectional": True}),
])  # fmt: skip
def test_gradients_match_torch_at_a_batch_with_wide_panels_and_batch_slices(cell, kw, threads):
    """H = 72 (5 groups of 16 columns: dh_prev's GEMM on 4-group panels, the last one padded;
    proj 40: 2-group panels on 2 threads, one padded 4-group panel on 1) and N = 30 (2
    threads: each runs its own tile-aligned batch slice of every backward step,
    kernels.backward.BACK_SHARE_TILES), with ragged lengths."""
    assert_wide_case_matches_torch(cell, kw, torch.float64, threads=threads)


def assert_wide_case_matches_torch(cell, kw, dtype, **trainer_options) -> None:
    """The wide-panel case (T=6, N=30, C=7, H=72, ragged lengths, h0/c0 in): every gradient of
    a Trainer(**trainer_options) against torch's module of ``dtype`` on the same weights."""
    torch.manual_seed(0)
    T, N, C, H = 6, 30, 7, 72
    m = getattr(torch.nn, cell)(C, H, **kw).to(dtype)
    L = kw.get("num_layers", 1)
    D = 2 if kw.get("bidirectional") else 1
    K = kw.get("proj_size") or H
    lengths = [T - (n % 4) for n in range(N)]
    x = torch.randn(T, N, C, dtype=dtype, requires_grad=True)
    h0 = torch.randn(L * D, N, K, dtype=dtype, requires_grad=True)
    c0 = torch.randn(L * D, N, H, dtype=dtype, requires_grad=True)
    hx = (h0, c0) if cell == "LSTM" else h0
    _, cot = _torch_grads(m, x, hx, lengths, False)
    tr = Trainer(leanrnn.from_torch(m), **trainer_options)
    assert tr._parts(N) == tr._threads()
    hxn = (h0.detach().numpy(), c0.detach().numpy()) if cell == "LSTM" else h0.detach().numpy()
    dx, dh0, dc0 = tr.backward(tr.forward(x.detach().numpy(), hxn, lengths=lengths), *cot)
    rtol = RTOL_GRAD[np.float64 if dtype == torch.float64 else np.float32]
    _assert_grads_match(tr, m, (x, h0, c0), (dx, dh0, dc0), rtol)


def _loss(tr, x, hx, lengths, cot):
    tape = tr.forward(x, hx, lengths=lengths)
    outs = [tape.y, tape.h_n] + ([tape.c_n] if tape.c_n is not None else [])
    return sum(float((o * c).sum()) for o, c in zip(outs, cot, strict=True)), tape


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn"])
def test_finite_differences_without_torch(cell):
    """The numpy-only path against central differences of its own forward (float64)."""
    rng = np.random.default_rng(3)
    m = {"lstm": leanrnn.LSTM, "gru": leanrnn.GRU, "rnn": leanrnn.RNN}[cell](
        3, 6, num_layers=2, dtype=np.float64, seed=1)  # fmt: skip
    tr = Trainer(m)
    x = rng.standard_normal((4, 2, 3))
    lengths = [4, 3]
    tape = tr.forward(x, lengths=lengths)
    cot = [rng.standard_normal(a.shape) for a in (tape.y, tape.h_n, tape.c_n) if a is not None]
    dx, _, _ = tr.backward(tape, *cot)
    eps = 1e-6
    for idx in [(0, 0, 0), (2, 1, 2), (3, 0, 1)]:
        xp, xm = x.copy(), x.copy()
        xp[idx] += eps
        xm[idx] -= eps
        fd = (_loss(tr, xp, None, lengths, cot)[0] - _loss(tr, xm, None, lengths, cot)[0]) / (
            2 * eps
        )
        assert abs(fd - dx[idx]) <= RTOL_FINITE_DIFF[np.float64] * max(1.0, abs(fd))
    # a few weights, through the parameter views
    p = tr.parameters()[1]  # layer 0 recurrent panels
    g = p.grad.copy()
    nz = np.argwhere(g != 0)[:3]
    for idx in map(tuple, nz):
        old = p.value[idx]
        with p.edit() as v:  # (bumps version: the trainer refreshes its derived weights)
            v[idx] = old + eps
        lp = _loss(tr, x, None, lengths, cot)[0]
        with p.edit() as v:
            v[idx] = old - eps
        lm = _loss(tr, x, None, lengths, cot)[0]
        with p.edit() as v:
            v[idx] = old
        fd = (lp - lm) / (2 * eps)
        assert abs(fd - g[idx]) <= RTOL_FINITE_DIFF[np.float64] * max(1.0, abs(fd))


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn"])
def test_recompute_equals_storing_to_the_bit(cell):
    rng = np.random.default_rng(0)
    make = {"lstm": leanrnn.LSTM, "gru": leanrnn.GRU, "rnn": leanrnn.RNN}[cell]
    m = make(5, 24, num_layers=2, seed=2)
    x = rng.standard_normal((11, 3, 5)).astype(np.float32)
    lengths = [11, 6, 9]
    out = []
    for rec in (False, True):
        tr = Trainer(m, segment=3, recompute=rec)
        tape = tr.forward(x, lengths=lengths)
        dy = np.ones_like(tape.y)
        dx, dh0, _ = tr.backward(tape, dy)
        out.append((tape.y, dx, dh0, tr.grad.buffer.copy()))
    for a, b in zip(*out, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize(("cell", "kw"), [
    ("lstm", {"num_layers": 2, "proj_size": 7}), ("lstm", {}), ("gru", {"num_layers": 2}),
    ("rnn", {}),
])  # fmt: skip
@pytest.mark.parametrize("N", [1, 21])
def test_the_training_forward_gives_the_inference_forwards_bits(cell, kw, N, dtype):
    """The training forward is the inference one with each step's gates kept for backward;
    storing them must not change what is computed (it did: the fast-math kernels rewrote the
    LSTM's cell update differently once its gates had a second use, ~1e-8 apart)."""
    make = {"lstm": leanrnn.LSTM, "gru": leanrnn.GRU, "rnn": leanrnn.RNN}[cell]
    m = make(6, 20, seed=4, **kw).astype(dtype)
    x = np.random.default_rng(4).standard_normal((5, N, 6)).astype(dtype)
    tape = Trainer(m).forward(x)
    y, h_n = m(x)[:2]
    assert np.array_equal(tape.y, y)
    assert np.array_equal(tape.h_n, h_n[0] if cell == "lstm" else h_n)


def test_accumulation_of_micro_batches_equals_one_batch():
    rng = np.random.default_rng(1)
    m = leanrnn.GRU(4, 16, dtype=np.float64, seed=0)
    x = rng.standard_normal((6, 8, 4))
    dy = rng.standard_normal((6, 8, 16))
    whole = Trainer(m)
    whole.backward(whole.forward(x), dy)
    parts = Trainer(m)
    for i in range(0, 8, 2):
        parts.backward(
            parts.forward(np.ascontiguousarray(x[:, i : i + 2])),
            np.ascontiguousarray(dy[:, i : i + 2]),
        )
    diff = parts.grad.buffer.view(np.float64) - whole.grad.buffer.view(np.float64)
    assert np.abs(diff).max() <= ATOL[np.float64]


def test_stale_tapes_are_refused_and_the_trainer_survives():
    m = leanrnn.LSTM(3, 8, seed=0)
    tr = Trainer(m)
    x = np.ones((4, 2, 3), np.float32)
    tape = tr.forward(x)
    tr.backward(tape)
    with pytest.raises(TapeError, match="already ran"):
        tr.backward(tape)
    old = tr.forward(x)
    tr.forward(x)  # reuses the arena
    with pytest.raises(TapeError, match="newer forward"):
        tr.backward(old)
    kept = tr.forward(x, own_memory=True)
    tr.forward(x)
    tr.backward(kept)  # its own memory: still fine
    tape = tr.forward(x)
    tr.parameters()[0].version += 1  # what an optimizer step does
    with pytest.raises(TapeError, match="weights changed"):
        tr.backward(tape)
    tape = tr.forward(x)
    with pytest.raises(ShapeError, match="dy"):
        tr.backward(tape, np.ones((4, 2, 9), np.float32))
    tr.backward(tape, np.ones((4, 2, 8), np.float32))  # the same tape after a refused call


def test_onnx_only_options_refuse_training():
    spec = leanrnn.RNNSpec("lstm", 3, 8, peepholes=True)
    from helpers import random_layers

    w = leanrnn.pack(spec, random_layers(spec, np.random.default_rng(0)))
    with pytest.raises(SpecError, match="peepholes"):
        Trainer(w)


def test_memory_limit_picks_recomputed_segments_that_fit():
    m = leanrnn.LSTM(8, 32, num_layers=2, seed=0)
    x = np.random.default_rng(0).standard_normal((200, 4, 8)).astype(np.float32)
    full = Trainer(m).plan(4, 200)
    assert full["segment"] == 200 and not full["recompute"]
    limit = full["total_bytes"] // 4
    tr = Trainer(m, memory_limit=limit)
    p = tr.plan(4, 200)
    assert p["recompute"] and 1 < p["segment"] < 200 and p["total_bytes"] <= limit
    dx_limited = tr.backward(tr.forward(x), np.ones((200, 4, 32), np.float32))[0]
    same = Trainer(m, segment=p["segment"])  # storing, the same segments
    dx_stored = same.backward(same.forward(x), np.ones((200, 4, 32), np.float32))[0]
    assert np.array_equal(dx_limited, dx_stored)
    assert np.array_equal(tr.grad.buffer, same.grad.buffer)
    with pytest.raises(PlanError, match="memory_limit"):
        Trainer(m, memory_limit=1000).forward(x)


def test_without_input_grad_the_weight_gradients_are_the_same():
    m = leanrnn.LSTM(4, 16, num_layers=2, seed=0)
    x = np.random.default_rng(0).standard_normal((6, 3, 4)).astype(np.float32)
    a, b = Trainer(m), Trainer(m)
    dx, dh0, _ = a.backward(a.forward(x), np.ones((6, 3, 16), np.float32))
    none, dh0b, _ = b.backward(b.forward(x), np.ones((6, 3, 16), np.float32), input_grad=False)
    assert dx is not None and none is None
    assert np.array_equal(dh0, dh0b) and np.array_equal(a.grad.buffer, b.grad.buffer)


def test_plan_train_command(capsys):
    from leanrnn import cli

    assert cli.main(["plan", "lstm:32x2", "--train", "--batch", "4", "--steps", "100"]) == 0
    stored = capsys.readouterr().out
    assert "store, segments of 100 steps" in stored and "xw.0" in stored and "reserve" in stored
    assert cli.main(["plan", "lstm:32x2", "--train", "--recompute", "--batch", "4",
                     "--steps", "100"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "recompute, segments of 10 steps (10)" in out

    def total(text):
        return int(text.split("total")[1].split("B")[0].replace(",", ""))

    assert total(out) < total(stored) / 3
    assert cli.main(["plan", "lstm:32x2", "--train", "--autocast", "--batch", "8",
                     "--steps", "100"]) == 0  # fmt: skip
    mixed = capsys.readouterr().out
    assert "store, autocast bf16, segments of 100 steps" in mixed
    # the split activation rows of the bf16 forward, where it runs on AMX or vdpbf16ps
    from leanrnn.engine.session import splits_operand

    assert ("\nq " in mixed) == splits_operand("bf16")
    assert cli.main(["plan", "--train", "--autocast", "lstm:32x2", "--autocast-mode",
                     "bf16-act", "--batch", "8", "--steps", "100"]) == 0  # fmt: skip
    rounded = capsys.readouterr().out
    assert "store, autocast bf16-act, segments of 100 steps" in rounded
    assert "\nq " in rounded  # its rounded activation rows, on every CPU
    assert cli.main(["plan", "lstm:32x2", "--autocast"]) == 1
    assert "--autocast plans a training step: add --train" in capsys.readouterr().err


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_adam_steps_on_packed_weights_follow_torch(cell):
    """Trainer + leanrnn.train.AdamW on the packed weights (biases refolded after each step)
    against torch's module + torch.optim.AdamW, five steps of the same data (float64)."""
    from leanrnn.train import AdamW, clip_grad_norm

    torch.manual_seed(0)
    m = getattr(torch.nn, cell)(4, 12, num_layers=2).double()
    tr = Trainer(leanrnn.from_torch(m))
    opt = AdamW(tr.parameters(), lr=1e-2)
    topt = torch.optim.AdamW(m.parameters(), lr=1e-2)
    rng = np.random.default_rng(0)
    for _ in range(5):
        x = rng.standard_normal((6, 3, 4))
        dy = rng.standard_normal((6, 3, 12))
        topt.zero_grad()
        y, _ = m(torch.from_numpy(x))
        (y * torch.from_numpy(dy)).sum().backward()
        torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
        topt.step()
        tr.zero_grad()
        tr.backward(tr.forward(x), dy)
        clip_grad_norm(tr.parameters(), 1.0)
        opt.step()
    y_ref, _ = m(torch.from_numpy(x))
    y = tr.forward(x).y
    assert np.abs(y - y_ref.detach().numpy()).max() <= ATOL[np.float64]
    padding = tr.weights.unpack()  # the canonical weights back; pack() again must be identical
    again = leanrnn.pack(tr.spec, padding, np.float64)
    assert np.array_equal(again.buffer, tr.weights.buffer)  # padding stayed zero


def test_recompute_replays_every_segment_but_the_last(monkeypatch):
    """The recomputing forward leaves the last segment's reserve in the segment buffers:
    backward replays only the earlier segments (and still equals storing, above)."""
    m = leanrnn.LSTM(4, 16, num_layers=2, seed=0)
    tr = Trainer(m, segment=3, recompute=True)
    x = np.random.default_rng(0).standard_normal((11, 2, 4)).astype(np.float32)
    tape = tr.forward(x)
    calls = []
    real = Trainer._forward_segment
    monkeypatch.setattr(Trainer, "_forward_segment",
                        lambda self, *a: calls.append(a[6]) or real(self, *a))  # fmt: skip
    tr.backward(tape, np.ones_like(tape.y))
    assert calls == [6, 3, 0]  # segment starts: 9 (the last) is not replayed


def test_steady_state_forward_reuses_its_plan_and_released_arenas(monkeypatch):
    """A second forward of the same shape does not plan again; an own-memory tape's arena,
    once released, serves the next own-memory forward, whose gradients stay exact."""
    from leanrnn.train import session

    m = leanrnn.GRU(4, 16, seed=0)
    x = np.random.default_rng(0).standard_normal((5, 3, 4)).astype(np.float32)
    dy = np.ones((5, 3, 16), np.float32)
    want = Trainer(m)
    want.backward(want.forward(x), dy)
    planned = []
    real = session.plan
    monkeypatch.setattr(session, "plan", lambda bufs: planned.append(1) or real(bufs))
    tr = Trainer(m)
    first = tr.forward(x, own_memory=True)
    arena = first._saved["mem"]["_arena"]
    y = first.y.copy()
    tr.release(first)
    assert np.array_equal(first.y, y)  # outputs outlive the release
    with pytest.raises(TapeError, match="released"):
        tr.backward(first, dy)
    second = tr.forward(x, own_memory=True)
    assert second._saved["mem"]["_arena"] is arena
    assert len(planned) == 1
    tr.backward(second, dy)
    assert np.array_equal(tr.grad.buffer, want.grad.buffer)


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn"])
def test_recompute_with_boundary_states_in_dx_equals_storing_to_the_bit(cell):
    """Wide inputs (C = 32 > the states' 2 x 8 per layer): the boundary states live in dx's
    rows until backward writes them, newest segment first; nothing of them may leak into dx."""
    rng = np.random.default_rng(3)
    make = {"lstm": leanrnn.LSTM, "gru": leanrnn.GRU, "rnn": leanrnn.RNN}[cell]
    m = make(32, 8, num_layers=2, seed=4)
    x = rng.standard_normal((11, 3, 32)).astype(np.float32)
    dy = rng.standard_normal((11, 3, 8)).astype(np.float32)
    out = []
    for rec in (False, True):
        tr = Trainer(m, segment=3, recompute=rec)
        assert tr.plan(3, 11)["boundaries_in_dx"] and tr.plan(3, 11)["checkpoint_bytes"] == 0
        tape = tr.forward(x, lengths=[11, 5, 9])
        assert np.shares_memory(tape._saved["ckh"][-1], tape._saved["dx"])
        dx, dh0, _ = tr.backward(tape, dy)
        out.append((tape.y, dx, dh0, tr.grad.buffer.copy()))
    whole = Trainer(m)  # one segment: nothing to keep but h0
    dx_whole = whole.backward(whole.forward(x, lengths=[11, 5, 9]), dy)[0]
    np.testing.assert_allclose(out[0][1], dx_whole, rtol=0, atol=ATOL[np.float32])
    for a, b in zip(*out, strict=True):
        assert np.array_equal(a, b)


@pytest.mark.parametrize("gemm", ["native", "blas"])
def test_recomputing_step_needs_a_small_fraction_of_its_outputs(gemm, monkeypatch):
    """The memory bar's step (2-layer LSTM, H=512, N=64, T=1000; planned, not run): beyond y
    and dx, a recomputing step plans under 1/16 of their bytes, on either GEMM (the engine's
    needs its own scratch: engine.products). Before: segments of sqrt(T) with the boundary
    states apart, 0.28 of them."""
    monkeypatch.setenv("LEANRNN_GEMM", gemm)
    m = leanrnn.LSTM(512, 512, num_layers=2, seed=0)
    p = Trainer(m, recompute=True).plan(64, 1000)
    outputs = 2 * 1000 * 64 * 512 * 4  # y and dx, float32
    assert p["recompute"] and p["boundaries_in_dx"]
    # (the dense copies of the weights, counted in total_bytes since session 39, go with the
    # weights, not with the step: ~2x the weights whatever N and T)
    step = p["total_bytes"] - p["dense_weight_bytes"]
    assert step <= outputs / 16, (p["segment"], step, outputs)


def test_backward_leaves_the_process_blas_threads_as_they_were():
    """backward runs its GEMMs single-threaded on the matmul pool and restores the BLAS limit:
    before, it set the process's BLAS to the trainer's threads for good."""
    from leanrnn.threads import blas_controller

    c = blas_controller()
    if c is None or not c.select(user_api="blas").lib_controllers:
        pytest.skip("no BLAS under threadpoolctl")
    m = leanrnn.LSTM(4, 16, seed=0)
    x = np.random.default_rng(0).standard_normal((6, 3, 4)).astype(np.float32)
    with c.limit(limits=2, user_api="blas"):
        tr = Trainer(m, threads=1)
        tr.backward(tr.forward(x), np.ones((6, 3, 16), np.float32))
        assert {i["num_threads"] for i in c.select(user_api="blas").info()} == {2}


def _rounded_torch(m32):
    """float64 copy of torch module ``m32`` with its input and recurrent weights rounded to
    bfloat16 by torch: the model Trainer(autocast="bf16") computes (an independent oracle)."""
    ref = copy.deepcopy(m32).double()
    with torch.no_grad():
        for name, p in ref.named_parameters():
            if name.startswith(("weight_ih", "weight_hh")):
                p.copy_(getattr(m32, name).detach().to(torch.bfloat16).double())
    return ref


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("cell", "kw"), [
    ("LSTM", {"num_layers": 2}),
    ("LSTM", {"proj_size": 24, "bidirectional": True}),
    ("GRU", {"bidirectional": True}),
    ("RNN", {"nonlinearity": "relu", "num_layers": 2}),
])  # fmt: skip
def test_autocast_gradients_are_those_of_the_rounded_model(cell, kw, threads):
    """Trainer(autocast="bf16") at N=21 (the AMX block where the CPU has one, batch slices on
    2 threads), ragged lengths and h0: outputs and every gradient equal those of the float64
    model on the bf16-rounded weights (float32's are ~1e-3 away); after an optimizer-like
    change of the weights the next forward runs on their new rounding."""
    torch.manual_seed(0)
    T, N, C, H = 6, 21, 40, 48
    m32 = getattr(torch.nn, cell)(C, H, **kw)
    L = kw.get("num_layers", 1)
    D = 2 if kw.get("bidirectional") else 1
    K = kw.get("proj_size") or H
    lengths = [T - (n % 3) for n in range(N)]
    x = torch.randn(T, N, C, dtype=torch.float64, requires_grad=True)
    h0 = (0.5 * torch.randn(L * D, N, K, dtype=torch.float64)).requires_grad_()
    c0 = (0.5 * torch.randn(L * D, N, H, dtype=torch.float64)).requires_grad_()
    hx = (h0, c0) if cell == "LSTM" else h0
    tr = Trainer(leanrnn.from_torch(m32), threads=threads, autocast="bf16")
    f32 = lambda t: t.detach().float().numpy()  # noqa: E731
    hxn = (f32(h0), f32(c0)) if cell == "LSTM" else f32(h0)
    for _ in range(2):
        ref = _rounded_torch(m32)
        for t in (x, h0, c0):
            t.grad = None
        y_ref, cot = _torch_grads(ref, x, hx, lengths, False)
        tape = tr.forward(f32(x), hxn, lengths=lengths)
        assert _rel(tape.y, y_ref) <= RTOL_AUTOCAST_BF16
        tr.zero_grad()
        got = tr.backward(tape, *[c.astype(np.float32) for c in cot])
        _assert_grads_match(tr, ref, (x, h0, c0), got, RTOL_AUTOCAST_BF16)
        # an optimizer-like step on both: the same float32 weights, changed in place
        with torch.no_grad():
            for p in m32.parameters():
                p.mul_(1.01)
        for prm in tr.parameters():
            with prm.edit() as v:
                np.multiply(v, np.float32(1.01), out=v)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("cell", ["LSTM", "GRU", "RNN"])
def test_autocast_bf16_act_rounds_the_products_as_torch_does(cell, threads):
    """Trainer(autocast="bf16-act") at N=21 (the AMX block where the CPU has one, batch
    slices on 2 threads), with h0: outputs and every gradient equal those of the float64
    oracle that rounds both factors of every product (helpers.bf16_act_twin); the weights-only
    mode ("bf16") is measurably elsewhere, so this test tells the two apart."""
    torch.manual_seed(3)
    T, N, C, H = 12, 21, 40, 48
    m32 = getattr(torch.nn, cell)(C, H)
    x = torch.randn(T, N, C, dtype=torch.float64, requires_grad=True)
    h0 = (0.5 * torch.randn(1, N, H, dtype=torch.float64)).requires_grad_()
    c0 = (0.5 * torch.randn(1, N, H, dtype=torch.float64)).requires_grad_()
    f32 = lambda t: t.detach().float().numpy()  # noqa: E731
    hxn = (f32(h0), f32(c0)) if cell == "LSTM" else f32(h0)
    g = torch.Generator().manual_seed(1)
    cot = [torch.randn(s, generator=g, dtype=torch.float64) for s in
           [(T, N, H)] + [(1, N, H)] * (2 if cell == "LSTM" else 1)]  # fmt: skip
    cotn = [c.float().numpy() for c in cot]
    got = {}
    for mode in ("bf16-act", "bf16"):
        tr = Trainer(leanrnn.from_torch(m32), threads=threads, autocast=mode)
        tape = tr.forward(f32(x), hxn)
        grads = tr.backward(tape, *cotn)
        got[mode] = (tape.y, grads, torch_format.to_state_dict(tr.spec, tr.gradients()))
    h_seen = np.concatenate([f32(h0), got["bf16-act"][0][:-1]])  # h_prev of every step
    hx = (h0, c0) if cell == "LSTM" else h0
    y64, states, params = bf16_act_twin(m32, x, hx, cell, h_seen)
    sum((t * c).sum() for t, c in zip([y64, *states], cot, strict=True)).backward()
    inputs = (x, h0, c0) if cell == "LSTM" else (x, h0)
    errors = {}
    for mode, (y, grads, named) in got.items():
        err = [_rel(y, y64.detach().numpy())]
        err += [_rel(a, t.grad.numpy()) for a, t in zip(grads, inputs, strict=False)]
        err += [_rel(named[k], p.grad.numpy()) for k, p in params.items()]
        errors[mode] = max(err)
    assert errors["bf16-act"] <= RTOL_AUTOCAST_BF16_ACT, errors
    assert errors["bf16"] > 3 * RTOL_AUTOCAST_BF16_ACT, errors


@pytest.mark.parametrize("mode", ["bf16", "bf16-act"])
def test_autocast_recompute_equals_storing_and_modes_are_per_tape(mode):
    """Recomputing replays the bf16 forward (the same bits as storing); a tape made under
    autocast goes back through its own mode's forward even once the trainer's mode is off or
    the other one, and the float32 mode still gives float32's results."""
    rng = np.random.default_rng(0)
    m = leanrnn.LSTM(40, 48, num_layers=2, seed=2)
    x = rng.standard_normal((11, 21, 40)).astype(np.float32)
    out = []
    other = {"bf16": "bf16-act", "bf16-act": "bf16"}[mode]
    for rec, then in ((False, None), (True, None), (True, other)):
        tr = Trainer(m, segment=3, recompute=rec, autocast=mode)
        tape = tr.forward(x)
        tr.autocast = then
        dx, dh0, _ = tr.backward(tape, np.ones_like(tape.y))
        out.append((tape.y, dx, dh0, tr.grad.buffer.copy()))
    for got in out[1:]:
        for a, b in zip(out[0], got, strict=True):
            assert np.array_equal(a, b)
    tr = Trainer(m)
    tape = tr.forward(x)
    dx32, _, _ = tr.backward(tape, np.ones_like(tape.y))
    assert _rel(tape.y, out[0][0]) > 3 * RTOL_AUTOCAST_BF16
    assert _rel(dx32, out[0][1]) > 3 * RTOL_AUTOCAST_BF16


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize(("cell", "kw"), [
    ("LSTM", {"num_layers": 2, "bidirectional": True}),
    ("LSTM", {"proj_size": 24, "num_layers": 2}),
    ("GRU", {"num_layers": 3, "bidirectional": True}),
    ("RNN", {"nonlinearity": "relu", "num_layers": 2}),
])  # fmt: skip
def test_autocast_forward_is_the_quantized_models_forward(cell, kw, threads):
    """In both modes, the training forward of every stack (layers, directions, projection,
    ragged lengths) gives the bits of the inference model quantized to the same precision
    (leanrnn.quantize: its own kernels' calls and scratch), which the reduced-precision tests
    hold to their float64 oracles: where the single-layer oracle test stops, this carries the
    mode through every layer."""
    torch.manual_seed(5)
    m = leanrnn.from_torch(getattr(torch.nn, cell)(40, 48, **kw))
    x = np.random.default_rng(5).standard_normal((7, 21, 40)).astype(np.float32)
    lengths = [7 - (n % 3) for n in range(21)]
    for mode in ("bf16", "bf16-act"):
        tape = Trainer(m, threads=threads, autocast=mode).forward(x, lengths=lengths)
        y, _ = leanrnn.quantize(m, mode)(x, lengths=lengths)  # (the process's threads)
        assert np.array_equal(tape.y, y), mode


def test_an_autocast_trainer_pickles_without_its_derived_weights():
    """A pickled autocast trainer carries its mode but not the bf16 rounding or the dense
    copies (derived from the weights, remade when needed): the same gradients."""
    import pickle

    rng = np.random.default_rng(3)
    x = rng.standard_normal((5, 21, 12)).astype(np.float32)
    tr = Trainer(leanrnn.GRU(12, 32, seed=1), autocast="bf16")
    tape = tr.forward(x)
    tr.backward(tape, np.ones_like(tape.y))
    blob = pickle.dumps(tr)
    assert tr._bf16 is not None and tr._dense
    tr2 = pickle.loads(blob)
    assert tr2.autocast == "bf16" and tr2._bf16 is None and tr2._dense == {}
    for t in (tr, tr2):
        t.zero_grad()
        tape = t.forward(x)
        t.backward(tape, np.ones_like(tape.y))
    assert np.array_equal(tr.grad.buffer, tr2.grad.buffer)


def test_autocast_refuses_what_it_cannot_do():
    m64 = leanrnn.LSTM(4, 8, dtype=np.float64, seed=0)
    with pytest.raises(DTypeError, match="float32"):
        Trainer(m64, autocast="bf16")
    tr = Trainer(leanrnn.LSTM(4, 8, seed=0))
    with pytest.raises(SpecError, match="'bf16', 'bf16-act'"):
        tr.autocast = "fp16"
    assert tr.autocast is None


def test_a_hand_written_update_goes_through_edit_and_the_trainer_sees_it():
    """A red team's finding (session 34): ``p.value[...] -= lr * p.grad`` wrote the weights
    without a version bump, so the trainer kept the folded biases and dense copies of the old
    weights (outputs 0.46 off, gradients 1.4x off a fresh trainer's). The value is now a
    read-only view; ``edit()`` writes it and the trainer refreshes."""
    rng = np.random.default_rng(0)
    x = rng.standard_normal((5, 2, 3))
    dy = rng.standard_normal((5, 2, 4))
    m = leanrnn.LSTM(3, 4, seed=0, dtype=np.float64)
    tr = Trainer(m)
    tr.backward(tr.forward(x), dy)
    with pytest.raises(ValueError, match="read-only"):
        tr.parameters()[2].value[...] -= 0.5  # (bW: what the forward folds)
    for p in tr.parameters():
        with p.edit() as v:
            v -= 0.5 * p.grad
    tr.zero_grad()
    tape = tr.forward(x)
    tr.backward(tape, dy)
    fresh = Trainer(leanrnn.from_state_dict(m.state_dict(), dtype=np.float64))
    want = fresh.forward(x)
    fresh.backward(want, dy)
    np.testing.assert_allclose(tape.y, want.y, rtol=0, atol=1e-12)
    np.testing.assert_allclose(tr.grad.buffer, fresh.grad.buffer, rtol=0, atol=1e-12)
    np.testing.assert_allclose(m(x)[0], want.y, rtol=0, atol=1e-12)  # the model's own forward


def test_tape_y_is_read_only_since_backward_reads_it_again():
    """A red team's finding (session 34): np.tanh(tape.y, out=tape.y) before backward changed
    the gradients by 0.24% without a word."""
    m = leanrnn.GRU(3, 4, seed=0, dtype=np.float64)
    tr = Trainer(m)
    x = np.random.default_rng(1).standard_normal((5, 2, 3))
    tape = tr.forward(x)
    with pytest.raises(ValueError, match="read-only"):
        np.tanh(tape.y, out=tape.y)
    want = Trainer(m)
    wt = want.forward(x)
    np.testing.assert_array_equal(tape.y, wt.y)
    dy = np.ones_like(tape.y)
    assert dy.flags.writeable
    np.testing.assert_array_equal(tr.backward(tape, dy)[0], want.backward(wt, dy)[0])
    np.testing.assert_array_equal(tr.grad.buffer, want.grad.buffer)


@pytest.mark.parametrize(("attr", "value"), [
    ("threads", -1), ("threads", 1.5), ("segment", 2.5), ("segment", -3), ("dropout", 1.5),
    ("dropout", "0.1"), ("memory_limit", "abc"), ("memory_limit", 0), ("recompute", "no"),
])  # fmt: skip
def test_settings_are_checked_when_set_after_construction(attr, value):
    """A red team's finding (session 34): the constructor refused these, but set afterwards
    they ran (dropout=1.5 zeroed the layers' inputs; memory_limit='abc' a raw ValueError)."""
    tr = Trainer(leanrnn.LSTM(3, 8, num_layers=2, seed=0))
    before = getattr(tr, attr)
    with pytest.raises(SpecError, match=attr):
        setattr(tr, attr, value)
    assert getattr(tr, attr) == before
    with pytest.raises(SpecError, match=attr):
        Trainer(leanrnn.LSTM(3, 8, num_layers=2, seed=0), **{attr: value})


def test_dropout_switched_on_after_a_step_plans_its_masks():
    """Turning dropout on after a step without it reused a plan with no mask buffers."""
    m = leanrnn.LSTM(3, 8, num_layers=2, seed=0, dtype=np.float64)
    x = np.random.default_rng(0).standard_normal((6, 2, 3))
    tr = Trainer(m, seed=1)
    tr.forward(x)
    tr.dropout = 0.5
    tape = tr.forward(x)
    want = Trainer(m, dropout=0.5, seed=1)
    np.testing.assert_array_equal(tape.y, want.forward(x).y)
    tr.dropout = 0.0
    np.testing.assert_array_equal(tr.forward(x).y, m(x)[0])
    rt = leanrnn.LSTM(3, 8, num_layers=2, bidirectional=True, seed=0)
    with pytest.raises(SpecError, match="forward stack"):
        Trainer(rt).recompute = True
    tr.recompute = None  # (as the constructor always took it: False)
    assert tr.recompute is False
    with pytest.raises(SpecError, match="recompute"):
        tr.recompute = np.array([1, 0])


def test_dropout_switched_on_under_a_memory_limit_picks_segments_that_fit():
    """(a review's finding: the segment picked for the limit without the masks' buffers was
    kept, and the step's arena went over the limit)"""
    m = leanrnn.LSTM(8, 16, num_layers=2, seed=0)
    x = np.zeros((100, 4, 8), np.float32)
    fresh = Trainer(m, dropout=0.5)
    limit = fresh.plan(4, 100)["total_bytes"] * 3 // 4
    fresh.memory_limit = limit
    want = fresh.plan(4, 100)
    tr = Trainer(m, memory_limit=limit)
    tr.forward(x)
    tr.dropout = 0.5
    got = tr.plan(4, 100)
    assert got["total_bytes"] <= limit and got["segment"] == want["segment"], (got, want)


def test_a_trainer_pickled_when_settings_were_attributes_still_loads():
    tr = Trainer(leanrnn.GRU(3, 4, num_layers=2, seed=0), segment=2, dropout=0.25)
    state = tr.__getstate__()
    for old, now in (("threads", "_threads_asked"), ("segment", "_segment_steps"),
                     ("recompute", "_recompute"), ("memory_limit", "_memory_limit"),
                     ("dropout", "_dropout")):  # fmt: skip
        state[old] = state.pop(now)  # the pickle of an earlier version
    from leanrnn.train import Parameter

    for i, prm in enumerate(state["_params"]):  # parameters pickled before logical shapes
        old = Parameter.__new__(Parameter)
        old.__setstate__({"_grad": prm._grad, "_value": prm._value, "name": prm.name,
                          "version": prm.version})  # fmt: skip
        state["_params"][i] = old
    back = Trainer.__new__(Trainer)
    back.__setstate__(state)
    assert (back.segment, back.dropout, back.recompute, back.threads) == (2, 0.25, False, None)
    assert [p.logical_shape for p in back.parameters()] == [
        p.logical_shape for p in tr.parameters()]  # fmt: skip
    x = np.ones((4, 2, 3), np.float32)
    back.training = tr.training = False
    np.testing.assert_array_equal(back.forward(x).y, tr.forward(x).y)


def test_an_optimizer_unpickled_without_its_trainer_refuses_to_step():
    """A red team's finding (session 34): pickled apart, the optimizer came back over copies
    of the trainer's parameters, and resumed training never changed the model."""
    import pickle

    from leanrnn.train import Adam, Parameter

    tr = Trainer(leanrnn.GRU(3, 4, seed=0))
    opt = Adam(tr.parameters(), lr=0.1)
    x, dy = np.ones((5, 2, 3), np.float32), np.ones((5, 2, 4), np.float32)
    alone = pickle.loads(pickle.dumps(opt))
    with pytest.raises(leanrnn.errors.LeanRNNError, match=r"pickle\.dumps"):
        alone.step()
    with pytest.raises(leanrnn.errors.LeanRNNError, match="copies of a trainer"):
        copy.deepcopy(opt).step()
    tr2, opt2 = pickle.loads(pickle.dumps((tr, opt)))  # together: bound to the new trainer
    for t, o in ((tr, opt), (tr2, opt2)):
        t.backward(t.forward(x), dy)
        o.step()
    np.testing.assert_array_equal(tr2.weights.buffer, tr.weights.buffer)
    fresh = Adam(tr2.parameters(), lr=0.1)  # the state-dict route
    fresh.load_state_dict(alone.state_dict())
    own = Parameter(np.ones(3, np.float32))  # a parameter no trainer owns pickles as ever
    o3 = pickle.loads(pickle.dumps(Adam([own], lr=0.1)))
    o3.step()


def test_a_checkpoint_with_the_dropout_generator_resumes_bit_for_bit(tmp_path):
    """A red team's finding (session 34): model.save + opt.state_dict resumed with other
    dropout masks (0.015 off), the generator being in no state dict."""
    from leanrnn.train import Adam

    x = np.random.default_rng(0).standard_normal((6, 2, 3))
    dy = np.ones((6, 2, 5))

    def steps(tr, opt, n):
        for _ in range(n):
            tr.backward(tr.forward(x), dy)
            opt.step()
            tr.zero_grad()

    m = leanrnn.LSTM(3, 5, num_layers=3, seed=0, dtype=np.float64)
    tr = Trainer(m, dropout=0.3, seed=7)
    opt = Adam(tr.parameters(), lr=0.01)
    steps(tr, opt, 2)
    m.save(str(tmp_path / "ck.lrnn"))
    ck = (opt.state_dict(), tr.rng.bit_generator.state)
    steps(tr, opt, 2)
    m2 = leanrnn.load(str(tmp_path / "ck.lrnn"))
    tr2 = Trainer(m2, dropout=0.3)
    opt2 = Adam(tr2.parameters())
    opt2.load_state_dict(ck[0])
    tr2.rng.bit_generator.state = ck[1]
    steps(tr2, opt2, 2)
    np.testing.assert_array_equal(m2.weights.buffer, m.weights.buffer)
