"""leanrnn.torch: the torch.nn.LSTM/GRU/RNN drop-ins against torch's own modules -- outputs and
every gradient over the option matrix, gradcheck, optimizer steps, dropout masks, the
word-language-model loop, torch.compile, torch.export, autocast, no_grad and DDP."""

from __future__ import annotations

import contextlib
import copy
import datetime
import os
import subprocess
import sys
import tempfile
import warnings

import numpy as np
import pytest

from helpers import bf16_act_twin, compile_recording, finish_process, src_env
from tolerances import (
    ATOL,
    ATOL_AUTOCAST_BF16,
    MIN_WRONG,
    RTOL_AUTOCAST_BF16,
    RTOL_AUTOCAST_BF16_ACT,
    RTOL_GRAD,
)

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
lt = pytest.importorskip("leanrnn.torch")

from torch.nn.utils.rnn import pack_padded_sequence, pad_packed_sequence  # noqa: E402

from leanrnn.errors import DTypeError, ShapeError, SpecError  # noqa: E402

CASES = [  # cell, torch options
    ("LSTM", {}),
    ("GRU", {}),
    ("RNN", {}),
    ("RNN", {"nonlinearity": "relu", "num_layers": 2}),
    ("LSTM", {"num_layers": 2, "bidirectional": True}),
    ("GRU", {"num_layers": 3, "bidirectional": True}),
    ("RNN", {"num_layers": 2, "bidirectional": True, "batch_first": True}),
    ("LSTM", {"proj_size": 3}),
    ("LSTM", {"proj_size": 3, "num_layers": 2, "bidirectional": True}),
    ("LSTM", {"bias": False, "num_layers": 3}),
    ("GRU", {"bias": False, "batch_first": True}),
    ("LSTM", {"num_layers": 2, "batch_first": True}),
]
T, N, C, H = 5, 3, 4, 6
LENGTHS = [4, 5, 2]  # unsorted: the packed order differs from the batch order


def _diff(d) -> float:
    return float(d.detach().abs().max())


def _rel(a, b) -> float:
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).abs().max() / max(float(b.abs().max()), 1e-30))


def _pair(cell, kw, dtype=torch.float64, seed=0):
    """torch's module and its leanrnn.torch twin, same weights."""
    torch.manual_seed(seed)
    ref = getattr(torch.nn, cell)(C, H, **kw).to(dtype)
    return ref, lt.from_module(ref)


def _run(m, x, hx, packed, bf):
    """(outputs as padded tensors) of m on x (a PackedSequence of it when packed)."""
    if packed:
        pk = pack_padded_sequence(x, torch.tensor(LENGTHS), batch_first=bf, enforce_sorted=False)
        yp, hn = m(pk, hx)
        assert isinstance(yp, torch.nn.utils.rnn.PackedSequence)
        assert torch.equal(yp.sorted_indices, pk.sorted_indices)
        y, _ = pad_packed_sequence(yp, batch_first=bf, total_length=T)
    else:
        y, hn = m(x, hx)
    return [y, *(hn if isinstance(hn, tuple) else (hn,))]


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["f64", "f32"])
@pytest.mark.parametrize(("cell", "kw"), CASES, ids=[f"{c}-{k}" for c, k in CASES])
@pytest.mark.parametrize("mode", ["plain", "packed+states"])
def test_gradients_match_torch(cell, kw, mode, dtype):
    ref, m = _pair(cell, kw, dtype)
    bf = kw.get("batch_first", False)
    D = 2 if kw.get("bidirectional") else 1
    LD, K = kw.get("num_layers", 1) * D, kw.get("proj_size") or H
    g = torch.Generator().manual_seed(1)
    x = torch.randn((N, T, C) if bf else (T, N, C), generator=g, dtype=dtype)
    states = [torch.randn(LD, N, K, generator=g, dtype=dtype)]
    if cell == "LSTM":
        states.append(torch.randn(LD, N, H, generator=g, dtype=dtype))
    packed = mode != "plain"
    results = []
    for mod in (ref, m):
        xi = x.clone().requires_grad_()
        si = [s.clone().requires_grad_() for s in states]
        hx = (tuple(si) if cell == "LSTM" else si[0]) if packed else None
        # torch's native kernels as the oracle: oneDNN's would JIT a primitive per shape (~1 s)
        with torch.backends.mkldnn.flags(enabled=False):
            outs = _run(mod, xi, hx, packed, bf)
        cot = torch.Generator().manual_seed(2)
        loss = sum((o * torch.randn(o.shape, generator=cot, dtype=dtype)).sum() for o in outs)
        with torch.backends.mkldnn.flags(enabled=False):
            loss.backward()
        grads = [xi.grad] + ([s.grad for s in si] if packed else [])
        grads += [p.grad for p in mod.parameters()]
        results.append((outs, grads))
    (o_ref, g_ref), (o, gr) = results
    for a, b in zip(o, o_ref, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert _diff(a - b) <= ATOL[np.dtype(str(dtype).split(".")[1])]
    names = ["x"] + (["h0", "c0"][: len(states)] if packed else [])
    names += [n for n, _ in m.named_parameters()]
    rtol = RTOL_GRAD[np.dtype(str(dtype).split(".")[1])]
    for name, a, b in zip(names, gr, g_ref, strict=True):
        assert a is not None and a.shape == b.shape, name
        assert _rel(a, b) <= rtol, name


@pytest.mark.parametrize(
    ("cell", "kw"), [CASES[7], CASES[5], CASES[3]], ids=["LSTM-proj", "GRU", "RNN"]
)
def test_gradients_ignore_arena_garbage(cell, kw, monkeypatch):
    """Tape memory is never cleared: rows past a sample's length must not reach a gradient,
    even when the bytes there are NaN (the projection gradient summed them: 0 * NaN)."""
    import leanrnn.memory.arena as arena

    fresh = arena.aligned_empty

    def poisoned(nbytes, *args, **kwargs):
        buf = fresh(nbytes, *args, **kwargs)
        buf[:] = 0xFF  # every float a NaN
        return buf

    monkeypatch.setattr(arena, "aligned_empty", poisoned)
    test_gradients_match_torch(cell, kw, "packed+states", torch.float64)


def test_construction_equals_torch():
    """Constructor, parameter names/shapes/order, init under a seed, state_dict both ways."""
    for cell, args, kw in [("LSTM", (3, 7, 2), {"proj_size": 4, "bidirectional": True}),
                           ("GRU", (3, 7), {"bias": False, "batch_first": True}),
                           ("RNN", (3, 7, 2, "relu"), {"dropout": 0.5})]:  # fmt: skip
        torch.manual_seed(3)
        ref = getattr(torch.nn, cell)(*args, **kw)
        torch.manual_seed(3)
        m = getattr(lt, cell)(*args, **kw)
        assert repr(m).split("(", 1)[1] == repr(ref).split("(", 1)[1]
        assert [(n, p.shape) for n, p in m.named_parameters()] == [
            (n, p.shape) for n, p in ref.named_parameters()
        ]
        for (n, p), q in zip(m.named_parameters(), ref.parameters(), strict=True):
            assert torch.equal(p, q), n
        back = m.to_module()
        assert type(back) is type(ref)
        assert all(
            torch.equal(a, b) for a, b in zip(back.parameters(), ref.parameters(), strict=True)
        )
        ref.load_state_dict(m.state_dict())
        m.load_state_dict(ref.state_dict())
    with pytest.raises(ValueError, match="proj_size"):
        lt.GRU(3, 4, proj_size=2)
    with pytest.raises(ValueError, match="dropout"):
        lt.LSTM(3, 4, dropout=1.5)
    with pytest.raises(ValueError, match="nonlinearity"):
        lt.RNN(3, 4, nonlinearity="gelu")
    with pytest.raises(DTypeError):
        lt.LSTM(3, 4, dtype=torch.float16)
    m64 = lt.LSTM(3, 4, dtype=torch.float64)
    assert m64.weight_ih_l0.dtype == torch.float64


@pytest.mark.parametrize(("cell", "kw"), [("LSTM", {"proj_size": 2, "bidirectional": True}),
                                          ("GRU", {"num_layers": 2}),
                                          ("RNN", {"nonlinearity": "relu"})])  # fmt: skip
def test_gradcheck(cell, kw):
    torch.manual_seed(0)
    m = getattr(lt, cell)(2, 3, **kw).double()
    D = 2 if kw.get("bidirectional") else 1
    LD, K = kw.get("num_layers", 1) * D, kw.get("proj_size") or 3
    x = torch.randn(3, 2, 2, dtype=torch.float64, requires_grad=True)
    h0 = torch.randn(LD, 2, K, dtype=torch.float64, requires_grad=True)
    c0 = torch.randn(LD, 2, 3, dtype=torch.float64, requires_grad=True)
    names = [n for n, _ in m.named_parameters()]

    def f(x, h0, *ps):
        hx = (h0, c0) if cell == "LSTM" else h0
        out = torch.func.functional_call(m, dict(zip(names, ps, strict=True)), (x, hx))
        return out[0], out[1][1] if cell == "LSTM" else out[1]

    # fast mode (random directions) checks every input at a few forwards; the weights change
    # through .data in place between them, which the module must notice (values, not versions)
    assert torch.autograd.gradcheck(f, (x, h0, *m.parameters()), fast_mode=True)
    if cell == "RNN":
        assert torch.autograd.gradcheck(f, (x, h0, *m.parameters()))


def test_optimizer_steps_then_forward_match_torch():
    ref, m = _pair("LSTM", {"num_layers": 2, "proj_size": 3})
    opts = [torch.optim.Adam(ref.parameters(), lr=0.05), torch.optim.Adam(m.parameters(), lr=0.05)]
    g = torch.Generator().manual_seed(4)
    xs = [torch.randn(T, N, C, generator=g, dtype=torch.float64) for _ in range(4)]
    losses = [[], []]
    for x in xs:
        for i, (mod, opt) in enumerate(zip((ref, m), opts, strict=True)):
            opt.zero_grad()
            y, (h, c) = mod(x)
            loss = (y**2).mean() + h.abs().mean()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(mod.parameters(), 0.1)
            opt.step()
            losses[i].append(loss.item())
    np.testing.assert_allclose(losses[1], losses[0], rtol=RTOL_GRAD[np.float64], atol=0)
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        assert _rel(p, q) <= RTOL_GRAD[np.float64]
    # in-place writes through .data bump no version counter: still seen by the next forward
    with torch.no_grad():
        y0 = m(xs[0])[0]
    m.weight_ih_l0.data.add_(1.0)
    ref.weight_ih_l0.data.add_(1.0)
    with torch.no_grad():
        y1, y_ref = m(xs[0])[0], ref(xs[0])[0]
    assert _diff(y1 - y0) > MIN_WRONG[np.float64]
    assert _diff(y1 - y_ref) <= ATOL[np.float64]


@pytest.mark.parametrize("packed", [False, True])
def test_dropout_draws_torchs_masks(packed):
    kw = {"num_layers": 3, "dropout": 0.4, "bidirectional": True}
    ref, m = _pair("GRU", kw)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, N, C, generator=g, dtype=torch.float64)
    res = []
    for mod in (ref, m):
        xi = x.clone().requires_grad_()
        torch.manual_seed(11)
        outs = _run(mod, xi, None, packed, False)
        sum(o.sum() for o in outs).backward()
        res.append([*outs, xi.grad, *(p.grad for p in mod.parameters())])
    for a, b in zip(res[1], res[0], strict=True):
        assert _rel(a, b) <= RTOL_GRAD[np.float64]
    # the masks differ from call to call, and eval() turns them off
    with torch.no_grad():
        m.train()
        a, b = m(x)[0], m(x)[0]
        assert not torch.equal(a, b)
        m.eval()
        ref.eval()
        assert _diff(m(x)[0] - ref(x)[0]) <= ATOL[np.float64]


def test_no_grad_runs_inference_and_graphs_free_their_tapes():
    ref, m = _pair("LSTM", {"num_layers": 2, "bidirectional": True})
    x = torch.randn(T, N, C, dtype=torch.float64)
    live = len(lt._TAPES)
    y, (h, c) = m(x)  # parameters require grad: a tape
    assert len(lt._TAPES) == live + 1
    with torch.no_grad():
        y1, (h1, c1) = m(x)
    with torch.inference_mode():
        y2, _ = m(x)
    assert len(lt._TAPES) == live + 1  # no tape without gradients
    for a, b in ((y1, y), (h1, h), (c1, c), (y2, y)):
        assert _diff(a - b.detach()) <= ATOL[np.float64]
    del y, h, c, a, b  # the graph dies without a backward: its tape goes with it
    assert len(lt._TAPES) == live
    y, _ = m(x)
    y.sum().backward()
    assert len(lt._TAPES) == live  # backward without retain_graph freed it


def test_truncated_bptt_and_accumulation_match_torch():
    """hx passed between calls (detached), two graphs alive at once, backward out of order,
    .grad accumulating over both, a retained graph run backward twice."""
    ref, m = _pair("LSTM", {"num_layers": 2})
    g = torch.Generator().manual_seed(6)
    xs = [torch.randn(T, N, C, generator=g, dtype=torch.float64) for _ in range(2)]
    for mod in (ref, m):
        y1, hx = mod(xs[0])
        y2, _ = mod(xs[1], tuple(t.detach() for t in hx))
        (y2**2).sum().backward(retain_graph=True)
        (y2**2).sum().backward()
        y1.sum().backward()
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        assert _rel(p.grad, q.grad) <= RTOL_GRAD[np.float64]


def test_unbatched_and_batch_first_match_torch():
    ref, m = _pair("GRU", {"num_layers": 2, "batch_first": True})
    x = torch.randn(T, C, dtype=torch.float64)
    h0 = torch.randn(2, H, dtype=torch.float64)
    for a, b in zip(m(x, h0), ref(x, h0), strict=True):
        assert a.shape == b.shape
        assert _diff(a - b) <= ATOL[np.float64]
    y, _ = m(torch.randn(N, T, C, dtype=torch.float64))
    assert y.shape == (N, T, H) and y.is_contiguous()


@pytest.mark.parametrize("cls", [lt.LSTM, lt.GRU])
def test_output_modified_in_place_refuses_backward_as_torch_does(cls):
    """y is the last layer's reserve (its h_{t-1} for dR): y.mul_(2) then backward gave wrong
    weight gradients silently. torch.nn.LSTM raises (its oneDNN path saves y); torch.nn.GRU's
    composite CPU path computes it, which leanrnn cannot without a copy of y: it refuses."""
    torch.manual_seed(0)
    x = torch.randn(T, N, C)
    ref = getattr(torch.nn, cls.__name__)(C, H)
    if cls is lt.LSTM:
        y, _ = ref(x)
        y.mul_(2.0)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()  # the oracle: torch's own module refuses it
    m = cls.from_module(ref)
    y, _ = m(x)
    y.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    y, _ = m(x)  # and the module stays usable
    y.sum().backward()
    assert m.weight_hh_l0.grad is not None


def test_bad_input_is_refused_and_module_stays_usable():
    m = lt.LSTM(C, H, 2)
    x = torch.randn(T, N, C)
    with pytest.raises(ShapeError, match="input size"):
        m(torch.randn(T, N, C + 1))
    with pytest.raises(ShapeError, match="h_0"):
        m(x, (torch.zeros(1, N, H), torch.zeros(2, N, H)))
    with pytest.raises(DTypeError, match="float64"):
        m(x.double())
    with pytest.raises(ShapeError, match="3-D"):
        m(torch.randn(1, T, N, C))
    y, _ = m(x)
    with torch.no_grad():
        m.weight_ih_l0.add_(1.0)  # an in-place update between forward and backward
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    y, _ = m(x)
    y.sum().backward()
    assert m.weight_ih_l0.grad is not None


def _rounded_twin(mod):
    """A float64 torch module with ``mod``'s input and recurrent weights rounded to bfloat16 by
    torch (biases and an LSTM's projection as they are, as in leanrnn's bf16 models): the
    model leanrnn's autocast computes, as an independent oracle."""
    twin = (mod.to_module() if isinstance(mod, lt.LSTM | lt.GRU | lt.RNN) else
            copy.deepcopy(mod)).double()  # fmt: skip
    with torch.no_grad():
        for name, p in twin.named_parameters():
            if name.startswith(("weight_ih", "weight_hh")):
                p.copy_(getattr(mod, name).detach().to(torch.bfloat16).double())
    return twin


@pytest.mark.parametrize("cell", ["LSTM", "GRU", "RNN"])
def test_autocast_bfloat16_like_torch(cell):
    """Output dtypes and gradient flow as torch's module under CPU autocast, values as torch's
    bf16 matmuls give them; and exactly (to the bf16 kernels' tolerance) the outputs and
    gradients of the model with its weights rounded to bf16 — in float32 they differ from the
    float32 model's by ~1e-3, so the float32 path would fail here."""
    ref, m = _pair(cell, {"num_layers": 2}, torch.float32)
    twin = _rounded_twin(m)
    x = torch.randn(T, N, C)
    res = []
    for mod, autocast in ((ref, True), (m, True), (twin, False)):
        mod.zero_grad()
        xi = x.clone().to(next(mod.parameters()).dtype).requires_grad_()
        # torch's oneDNN LSTM cannot run bf16 on every CPU: its native kernels are the oracle
        with (
            torch.backends.mkldnn.flags(enabled=False),
            torch.autocast("cpu", torch.bfloat16, enabled=autocast),
        ):
            y, hn = mod(xi)
        h = hn[0] if isinstance(hn, tuple) else hn
        # outside the autocast region, as training loops call it
        (y.double().sum() + h.double().sum()).backward()
        res.append((y, h, xi.grad, [p.grad for p in mod.parameters()]))
    (y_ref, h_ref, gx_ref, gp_ref), (y, h, gx, gp), (y64, _, gx64, gp64) = res
    assert (y.dtype, h.dtype, gx.dtype) == (y_ref.dtype, h_ref.dtype, gx_ref.dtype)
    assert y.dtype == (torch.bfloat16 if cell == "RNN" else torch.float32)
    assert _diff(y.float() - y_ref.float()) <= ATOL_AUTOCAST_BF16[np.float32]
    # (an RNN's outputs come back rounded to bf16, as torch's; its gradients do not)
    tol = RTOL_AUTOCAST_BF16 if cell != "RNN" else 2.0**-8
    assert _rel(y, y64) <= tol
    assert _rel(gx, gx64) <= RTOL_AUTOCAST_BF16
    for a, b, c in zip(gp, gp_ref, gp64, strict=True):
        assert a.dtype == b.dtype == torch.float32
        assert _rel(a, c) <= RTOL_AUTOCAST_BF16


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_autocast_mode_bf16_act_rounds_the_activations_as_torch_does(cell):
    """A module with autocast_mode = "bf16-act" under CPU autocast, N=21 with h0 (float32
    outputs: the GRU's, and the LSTM's with oneDNN off): the outputs and every gradient equal
    those of the float64 oracle that rounds both factors of every product
    (helpers.bf16_act_twin), where the default mode's are measurably elsewhere; no_grad
    inference gives the training forward's bits; a mode it does not know is refused."""
    Tb, Nb, Cb, Hb = 8, 21, 40, 48
    torch.manual_seed(4)
    ref = getattr(torch.nn, cell)(Cb, Hb)
    x = torch.randn(Tb, Nb, Cb, dtype=torch.float64, requires_grad=True)
    h0 = (0.5 * torch.randn(1, Nb, Hb, dtype=torch.float64)).requires_grad_()
    c0 = (0.5 * torch.randn(1, Nb, Hb, dtype=torch.float64)).requires_grad_()
    dy = torch.randn(Tb, Nb, Hb, dtype=torch.float64)
    got = {}
    for mode in ("bf16-act", "bf16"):
        m = lt.from_module(ref)
        m.autocast_mode = mode
        xi = x.detach().float().requires_grad_()
        hx = (h0.detach().float(), c0.detach().float()) if cell == "LSTM" else h0.detach().float()
        with torch.backends.mkldnn.flags(enabled=False), torch.autocast("cpu", torch.bfloat16):
            y, _ = m(xi, hx)
            with torch.no_grad():
                y_inf, _ = m(xi, hx)
        assert y.dtype == torch.float32 and torch.equal(y_inf, y)
        (y.double() * dy).sum().backward()
        got[mode] = (y.detach(), xi.grad, dict(m.named_parameters()))
    y_act = got["bf16-act"][0]
    h_seen = np.concatenate([h0.detach().float().numpy(), y_act[:-1].numpy()])
    hx64 = (h0, c0) if cell == "LSTM" else h0
    y64, _, params = bf16_act_twin(ref, x, hx64, cell, h_seen)
    (y64 * dy).sum().backward()
    errors = {}
    for mode, (y, gx, named) in got.items():
        err = [_rel(y, y64), _rel(gx, x.grad)]
        err += [_rel(named[k].grad, p.grad) for k, p in params.items()]
        errors[mode] = max(float(e) for e in err)
    assert errors["bf16-act"] <= RTOL_AUTOCAST_BF16_ACT, errors
    assert errors["bf16"] > 3 * RTOL_AUTOCAST_BF16_ACT, errors
    with pytest.raises(SpecError, match="autocast_mode='fp16'"):  # refused when set
        m.autocast_mode = "fp16"


def test_autocast_bf16_act_inference_runs_the_inference_engine():
    """no_grad inference in bf16-act mode runs the inference model on the trainer's bf16
    rounding read as bf16-act (its gates need no keeping): it used to run the training
    forward, whose arena holds every step's gates (637 MiB for a 2-layer LSTM H=512 at N=64,
    T=500, against the inference session's 12) and kept it. The bits are the same."""
    torch.manual_seed(6)
    ref = torch.nn.GRU(16, 32, num_layers=2)
    m = lt.from_module(ref)
    m.autocast_mode = "bf16-act"
    assert lt.GRU.from_module(m).autocast_mode == "bf16-act"  # a twin keeps it
    assert lt.GRU.from_module(ref).autocast_mode == "bf16"
    x = torch.randn(9, 5, 16)
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        y, _ = m(x)
    eng = lt._engine(m._key, m._spec_str)
    assert eng.tr._arena is None and set(eng.bf16_models) == {"bf16-act"}
    import leanrnn

    want = leanrnn.quantize(leanrnn.from_torch(ref), "bf16-act")(x.numpy())[0]
    assert np.array_equal(y.numpy(), want)


@pytest.mark.parametrize("onednn", [True, False])
@pytest.mark.parametrize(("cell", "kw"), [
    ("LSTM", {}), ("LSTM", {"proj_size": 3}), ("LSTM", {"num_layers": 2, "bidirectional": True}),
    ("GRU", {}), ("RNN", {}), ("LSTM", {"dtype": torch.float64}), ("RNN", {"dtype": torch.float64}),
])  # fmt: skip
def test_autocast_output_dtypes_follow_torch(cell, kw, onednn):
    """torch's own module is the oracle: under CPU bf16 autocast its LSTM returns bfloat16
    where oneDNN runs it (the default on CPUs with bf16 support) or with a projection, float32
    with oneDNN off; the RNN bfloat16, the GRU float32, float64 modules float64. leanrnn's LSTM
    returned float32 where torch's returned bfloat16. On a CPU without bf16 support torch's
    own oneDNN LSTM raises under autocast ("could not create a primitive descriptor"; torch
    2.13 on a Zen 3) where leanrnn runs as torch does with oneDNN off: that is the oracle there."""
    ref_onednn = onednn and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    torch.manual_seed(0)
    ref = getattr(torch.nn, cell)(5, 8, **kw)
    m = lt.from_module(ref)
    x = torch.randn(3, 2, 5, dtype=kw.get("dtype", torch.float32), requires_grad=True)
    outs = []
    for mod, flag in ((ref, ref_onednn), (m, onednn)):
        with (
            warnings.catch_warnings(),  # torch: "LSTM with projections is not supported with oneDNN"
            torch.backends.mkldnn.flags(enabled=flag),
            torch.autocast("cpu", torch.bfloat16),
        ):
            warnings.simplefilter("ignore")
            y, hn = mod(x)
        states = hn if isinstance(hn, tuple) else (hn,)
        y.float().sum().backward()  # the gradient flows through the casts
        outs.append([y.dtype, *(h.dtype for h in states), x.grad.dtype])
        x.grad = None
    assert outs[1] == outs[0]


@pytest.mark.parametrize(("cell", "kw"), [
    ("LSTM", {"num_layers": 2, "proj_size": 24}),
    ("GRU", {"bidirectional": True}),
    ("RNN", {"nonlinearity": "relu"}),
])  # fmt: skip
def test_autocast_runs_the_bf16_kernels_at_a_batch(cell, kw):
    """N=21 (the AMX block where the CPU has one: activations split in two bf16 terms), with
    h0: training, a second backward through the retained graph (a replay, in the tape's
    mode, though autocast is off by then), no_grad inference and torch.compile against the
    float64 model on the rounded weights."""
    Tb, Nb, Cb, Hb = 6, 21, 40, 48
    torch.manual_seed(1)
    m = lt.from_module(getattr(torch.nn, cell)(Cb, Hb, **kw))
    twin = _rounded_twin(m)
    L, D = m.num_layers, 2 if m.bidirectional else 1
    x = torch.randn(Tb, Nb, Cb)
    h0 = torch.randn(L * D, Nb, kw.get("proj_size") or Hb) * 0.5
    hx64 = h0.double()
    if cell == "LSTM":
        c0 = torch.randn(L * D, Nb, Hb) * 0.5
        hx, hx64 = (h0, c0), (hx64, c0.double())
    else:
        hx = h0
    y64, _ = twin(x.double(), hx64)
    dy = torch.randn(y64.shape, dtype=torch.float64)
    with torch.autocast("cpu", torch.bfloat16):
        y, _ = m(x, hx)
    # an RNN's y and a projected LSTM's come back in bf16 (as torch's), so the gradient
    # reaching them is rounded too
    lowered = y.dtype == torch.bfloat16
    assert lowered == (cell != "GRU")
    (y64 * (dy.to(torch.bfloat16).double() if lowered else dy)).sum().backward()
    loss = (y.double() * dy).sum()
    grads = []
    for _ in range(2):  # the second backward replays the forward from the tape
        m.zero_grad()
        loss.backward(retain_graph=True)
        grads.append([p.grad.clone() for p in m.parameters()])
    assert _rel(y, y64) <= (2.0**-8 if lowered else RTOL_AUTOCAST_BF16)
    for g1, g2, ref in zip(*grads, twin.parameters(), strict=True):
        assert torch.equal(g1, g2)
        assert _rel(g1, ref.grad) <= RTOL_AUTOCAST_BF16
    with torch.no_grad(), torch.autocast("cpu", torch.bfloat16):
        yi, _ = m(x, hx)
        yc, _ = torch.compile(m, backend="eager")(x, hx)
    assert torch.equal(yi, y) and torch.equal(yc, y)
    with torch.no_grad():  # and without autocast, the float32 model again
        assert _rel(m(x, hx)[0], y64) > 3 * RTOL_AUTOCAST_BF16


class _Net(torch.nn.Module):
    """Embedding -> recurrent stack -> linear head (the shape of the word language model)."""

    def __init__(self, rnn, vocab=11):
        super().__init__()
        self.emb = torch.nn.Embedding(vocab, rnn.input_size, dtype=rnn.weight_ih_l0.dtype)
        self.rnn = rnn
        width = rnn.hidden_size * (2 if rnn.bidirectional else 1)
        self.head = torch.nn.Linear(width, vocab, dtype=rnn.weight_ih_l0.dtype)

    def forward(self, tok, hx=None):
        y, hx = self.rnn(self.emb(tok), hx)
        return self.head(y), hx


def _twin_nets(cell="LSTM", dtype=torch.float64, **kw):
    torch.manual_seed(0)
    a = _Net(getattr(torch.nn, cell)(C, H, **kw).to(dtype))
    b = _Net(lt.from_module(a.rnn))
    b.emb.load_state_dict(a.emb.state_dict())
    b.head.load_state_dict(a.head.state_dict())
    return a, b


def test_torch_compile_traces_the_leanrnn_ops_and_matches_eager():
    _, net = _twin_nets(num_layers=2)
    cnet, codes = compile_recording(net)  # dynamo + AOTAutograd (fake tensors, the joint graph)
    tok = torch.randint(0, 11, (T, N), generator=torch.Generator().manual_seed(7))
    out, _ = cnet(tok)
    (out**2).sum().backward()
    grads = [p.grad.clone() for p in net.parameters()]
    assert len(codes) == 2  # one forward and one backward graph: no graph break
    assert "leanrnn.rnn_forward" in codes[0] and "leanrnn.rnn_backward" in codes[1]
    assert not any("aten.lstm" in c or "mkldnn_rnn" in c for c in codes)  # no torch kernels
    net.zero_grad()
    ref, _ = net(tok)
    (ref**2).sum().backward()
    assert _diff(out - ref) <= ATOL[np.float64]
    for a, p in zip(grads, net.parameters(), strict=True):
        assert _rel(a, p.grad) <= RTOL_GRAD[np.float64]


def test_the_op_called_without_its_bf16_argument_still_trains():
    """rnn_forward's ``bf16`` and then ``mode`` came later, with defaults: a program traced or
    exported before calls it with the earlier arguments, and its backward must return one
    gradient per argument it was given (autograd refused one more)."""
    _, m = _pair("LSTM", {"num_layers": 2})
    x = torch.randn(T, N, C, dtype=torch.float64)
    weights = list(m.parameters())
    grads = []
    for extra in ((), (False,), (False, "bf16-act")):  # (mode: rnn_forward's latest)
        m.zero_grad()
        y = torch.ops.leanrnn.rnn_forward(x, None, None, weights, None, None, m._key,
                                          m._spec_str, True, *extra)[0]  # fmt: skip
        (y**2).sum().backward()
        grads.append([p.grad.clone() for p in weights])
    for other in grads[1:]:
        for a, b in zip(grads[0], other, strict=True):
            assert torch.equal(a, b)


def test_torch_export_produces_a_program_that_runs():
    _, net = _twin_nets("GRU", num_layers=2, bidirectional=False)
    tok = torch.randint(0, 11, (T, N), generator=torch.Generator().manual_seed(8))
    with torch.no_grad():
        ep = torch.export.export(net.eval(), (tok,))
        ops = [str(n.target) for n in ep.graph.nodes if n.op == "call_function"]
        assert "leanrnn.rnn_forward.default" in ops
        got, _ = ep.module()(tok)
        want, _ = net(tok)
    assert _diff(got - want) <= ATOL[np.float64]


def _repackage_hidden(h):
    return h.detach() if isinstance(h, torch.Tensor) else tuple(_repackage_hidden(v) for v in h)


def test_word_language_model_loop_gives_torchs_losses():
    """pytorch/examples word_language_model/main.py's train(): bptt windows, repackage_hidden,
    clip_grad_norm_, SGD through p.data.add_, embedding/output dropout and LSTM dropout."""
    a, b = _twin_nets(num_layers=2, dropout=0.3)
    vocab, bsz, bptt, lr = 11, 4, 5, 2.0
    data = torch.randint(0, vocab, (4 * bptt + 1, bsz), generator=torch.Generator().manual_seed(9))
    drop = torch.nn.Dropout(0.2)
    losses = []
    for model in (a, b):
        torch.manual_seed(12)
        model.train()
        hidden = None
        out = []
        for i in range(0, data.size(0) - 1, bptt):
            inp, target = data[i : i + bptt], data[i + 1 : i + 1 + bptt].reshape(-1)
            model.zero_grad()
            if hidden is not None:
                hidden = _repackage_hidden(hidden)
            y, hidden = model.rnn(drop(model.emb(inp)), hidden)
            logits = model.head(drop(y)).view(-1, vocab)
            loss = torch.nn.functional.cross_entropy(logits, target)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
            for p in model.parameters():
                p.data.add_(p.grad, alpha=-lr)
            out.append(loss.item())
        losses.append(out)
    assert losses[0][0] != losses[0][-1]
    np.testing.assert_allclose(losses[1], losses[0], rtol=RTOL_GRAD[np.float64], atol=0)


def test_import_leanrnn_does_not_import_torch():
    code = "import sys, leanrnn, leanrnn.train; leanrnn.LSTM; assert 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, env=os.environ.copy())


# ---------------------------------------------------------------------------- DDP
CONNECTED = "gloo connected"


def _ddp_worker(rank, world, path):
    """One rank: DDP over the twin net, loss on its half of the batch; saves its gradients.
    The ranks meet through a file (torch's FileStore), not a TCP store on a port found free
    beforehand: another process (the suite runs on two xdist workers) could take that port
    in between."""
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"file://{path}.store",
        rank=rank,
        world_size=world,
        timeout=datetime.timedelta(seconds=60),
    )
    print(CONNECTED, flush=True)
    try:
        _, net = _twin_nets(num_layers=2, bidirectional=True)
        ddp = torch.nn.parallel.DistributedDataParallel(net)
        tok = torch.randint(0, 11, (T, 2 * N), generator=torch.Generator().manual_seed(10))
        out, _ = ddp(tok[:, rank * N : (rank + 1) * N])
        (out**2).mean().backward()
        torch.save([p.grad for p in net.parameters()], f"{path}.{rank}")
    finally:
        torch.distributed.destroy_process_group()
    # Leave without the interpreter's teardown: gloo's threads can still be joinable when
    # C++'s static destructors run, and std::terminate then aborts a rank whose work is saved
    # ("terminate called without an active exception", one CI run in many)
    sys.stdout.flush()
    os._exit(0)


@pytest.mark.slow  # two interpreters import torch and leanrnn: ~10 s of start-up
def test_ddp_two_processes_equal_one_process_on_the_whole_batch():
    """gloo on 127.0.0.1, both ranks in child processes. gloo's own calls block in C++ where
    neither its timeout nor a Python signal reaches them (a CI run once hung here for 90
    minutes), so no rank runs inside pytest: each child has a hard deadline and is killed with
    its process group when it passes. GLOO_SOCKET_IFNAME=lo keeps gloo's pair connections on
    loopback instead of the address the host name resolves to."""
    here = os.path.dirname(os.path.abspath(__file__))
    env = dict(src_env(), GLOO_SOCKET_IFNAME="lo")
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "grads")
        ranks = []
        for rank in range(2):
            code = (
                f"import sys; sys.path.insert(0, {here!r}); import test_torch_train as t; "
                f"t._ddp_worker({rank}, 2, {path!r})"
            )
            ranks.append(
                subprocess.Popen(
                    [sys.executable, "-c", code],
                    env=env,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    text=True,
                    start_new_session=True,
                )
            )
        logs = [finish_process(p, timeout=240) for p in ranks]
        if any(p.returncode for p in ranks) and not any(CONNECTED in log for log in logs):
            # Neither rank got past gloo's rendezvous: the sandbox's network, not leanrnn.
            pytest.skip(f"gloo could not connect two processes on loopback here: {logs[0][-500:]}")
        for p, log in zip(ranks, logs, strict=True):
            assert p.returncode == 0, log[-3000:]
        got = [torch.load(f"{path}.{r}") for r in range(2)]
    _, net = _twin_nets(num_layers=2, bidirectional=True)
    tok = torch.randint(0, 11, (T, 2 * N), generator=torch.Generator().manual_seed(10))
    out, _ = net(tok)
    (out**2).mean().backward()
    for rank_grads in got:
        for a, p in zip(rank_grads, net.parameters(), strict=True):
            assert _rel(a, p.grad) <= RTOL_GRAD[np.float64]


def test_training_steps_reuse_the_memory_of_freed_tapes(monkeypatch):
    """A graph freed by its backward gives its tape's arena back: the next forward reuses it
    instead of allocating (and faulting in) a new one; the gradients stay torch's."""
    from leanrnn.train import session

    ref, m = _pair("LSTM", {"num_layers": 2})
    x = torch.randn(T, N, C, dtype=torch.float64)
    for mod in (ref, m):
        mod(x)[0].sum().backward()
    made = []
    real = session.Arena
    monkeypatch.setattr(session, "Arena", lambda *a, **k: made.append(1) or real(*a, **k))
    for _ in range(3):
        for mod in (ref, m):
            (mod(x)[0] ** 2).sum().backward()
    assert made == []
    for p, q in zip(m.parameters(), ref.parameters(), strict=True):
        assert _rel(p.grad, q.grad) <= RTOL_GRAD[np.float64]


@pytest.mark.parametrize("cell", ["RNN", "LSTM", "GRU"])
def test_an_infinite_input_poisons_only_what_torch_s_does(cell):
    """x = inf at one step: torch's gradients are NaN only for that input's weight column
    (inf * 0) and 0 for that step's dx; leanrnn's were NaN for every earlier step and every
    recurrent weight — the padding units' gates (inf times their zero weights) fed NaN into
    backward's dh_prev GEMM."""
    torch.manual_seed(0)
    ref = getattr(torch.nn, cell)(3, 4, dtype=torch.float64)  # H=4: 12 padding units of 16
    m = lt.from_module(ref)
    x = torch.randn(3, 2, 3, dtype=torch.float64)
    x[1, 0, 0] = float("inf")
    grads = []
    for mod in (ref, m):
        mod.zero_grad()
        xi = x.clone().requires_grad_()
        mod(xi)[0].sum().backward()
        grads.append([xi.grad, *(p.grad for p in mod.parameters())])
    for want, got in zip(*grads, strict=True):
        assert torch.equal(want.isnan(), got.isnan())
        assert torch.allclose(got.nan_to_num(), want.nan_to_num(), rtol=1e-10, atol=1e-12)
    assert grads[1][0][0].isfinite().all()  # the step before the inf one


def test_a_double_backward_is_refused_on_both_paths():
    """create_graph=True through a leanrnn module: its gradient has no graph. For a loss
    linear in y the eager path returned one anyway (once_differentiable refuses only where the
    incoming gradient requires grad), and a gradient penalty built on it silently counted 0."""
    from torch.overrides import TorchFunctionMode

    class Passthrough(TorchFunctionMode):  # any function mode: the custom ops' path
        def __torch_function__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    m = lt.from_module(torch.nn.LSTM(3, 4, dtype=torch.float64))
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    w = torch.randn(5, 2, 4, dtype=torch.float64)
    for mode in (contextlib.nullcontext, Passthrough):
        xi = x.clone().requires_grad_()
        with mode():
            loss = (m(xi)[0] * w).sum()
        with pytest.raises(RuntimeError, match=r"create_graph|autograd formula"):
            (g,) = torch.autograd.grad(loss, xi, create_graph=True)
            (loss + g.pow(2).sum()).backward()
    xi = x.clone().requires_grad_()  # first order still works after a refusal
    (g,) = torch.autograd.grad((m(xi)[0] * w).sum(), xi)
    assert g.shape == x.shape and torch.isfinite(g).all()
    # create_graph=True passed generically (MAML-style code), nothing differentiated twice:
    # torch's module's first-order gradient, as before the refusal existed
    ref = m.to_module()
    got, want = [
        torch.autograd.grad((mod(xr)[0] ** 2).sum(), xr, create_graph=True)[0]
        for mod, xr in ((m, x.clone().requires_grad_()), (ref, x.clone().requires_grad_()))
    ]
    torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-12)


def test_functorch_transforms_and_other_devices_get_a_clear_error():
    m = lt.LSTM(5, 8, dtype=torch.float64)
    x = torch.randn(6, 3, 5, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match=r"torch\.func transforms .* not supported"):
        torch.func.grad(lambda x: m(x)[0].sum())(x)
    with pytest.raises(DTypeError, match=r"on device meta.*CPU"):
        m(x.to("meta"))
    with pytest.raises(DTypeError, match="hx is on device meta"):
        m(x, (torch.zeros(1, 3, 8, dtype=torch.float64, device="meta"),) * 2)
    assert m(x)[0].shape == (6, 3, 8)  # the module unharmed
