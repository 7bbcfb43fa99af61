"""leanrnn.torch's two ways to its kernels: eager calls through _EagerRNN (an autograd.Function
around the ops' bodies), and the torch.library custom ops wherever something traces or
intercepts the call (torch.compile, a dispatch mode). The same bits both ways, torch's values
and gradients, which way a call takes, and the one-pass packing of changed parameters and
their gradients against formats.packing's."""

from __future__ import annotations

import numpy as np
import pytest

from helpers import compile_recording
from tolerances import ATOL, RTOL_GRAD

pytestmark = pytest.mark.torch
torch = pytest.importorskip("torch")
lt = pytest.importorskip("leanrnn.torch")

from torch.utils._python_dispatch import TorchDispatchMode  # noqa: E402

import leanrnn  # noqa: E402
from leanrnn.formats import torch_format  # noqa: E402

# H = 20: one whole unit block of 16 and a partial one in every gate (proj 17: the same in the
# projection); GRU: torch's gate order differs from leanrnn's; RNN: H = 16, whole blocks only
C, H, T, N = 5, 20, 4, 3
CASES = [
    ("LSTM", {"num_layers": 2, "bidirectional": True, "proj_size": 17}),
    ("GRU", {"num_layers": 2}),
    ("RNN", {"nonlinearity": "relu", "bidirectional": True, "hidden_size": 16}),
    ("LSTM", {"bias": False}),
]
IDS = ["LSTM-proj-bidir", "GRU", "RNN-relu-bidir", "LSTM-nobias"]


class _Recording(TorchDispatchMode):
    """Runs every op unchanged and records its name. While a dispatch mode is active,
    leanrnn.torch calls its custom ops (the mode must see them)."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(str(func))
        return func(*args, **(kwargs or {}))


def _module(cell, kw):
    kw = dict(kw)
    hidden = kw.pop("hidden_size", H)
    torch.manual_seed(0)
    ref = getattr(torch.nn, cell)(C, hidden, **kw).double()
    return ref, lt.from_module(ref)


def _inputs(ref):
    D = 2 if ref.bidirectional else 1
    LD, K = ref.num_layers * D, ref.proj_size if isinstance(ref, torch.nn.LSTM) else 0
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, N, C, generator=g, dtype=torch.float64)
    states = [torch.randn(LD, N, K or ref.hidden_size, generator=g, dtype=torch.float64)]
    if isinstance(ref, torch.nn.LSTM):
        states.append(torch.randn(LD, N, ref.hidden_size, generator=g, dtype=torch.float64))
    return x, states


def _step(mod, x, states, x_grad):
    """Outputs, gradients (x, states, parameters) and y's grad_fn of one forward and backward
    of a loss that reads every output."""
    mod.zero_grad()
    xi = x.clone().requires_grad_(x_grad)
    si = [s.clone().requires_grad_() for s in states]
    with torch.backends.mkldnn.flags(enabled=False):  # torch's native kernels as the oracle
        y, hn = mod(xi, tuple(si) if len(si) == 2 else si[0])
        outs = [y, *(hn if isinstance(hn, tuple) else (hn,))]
        g = torch.Generator().manual_seed(2)
        loss = sum((o * torch.randn(o.shape, generator=g, dtype=o.dtype)).sum() for o in outs)
        loss.backward()
    grads = [xi.grad, *(s.grad for s in si), *(p.grad for p in mod.parameters())]
    return [o.detach() for o in outs], grads, y.grad_fn


@pytest.mark.parametrize("x_grad", [True, False], ids=["x-grad", "x-no-grad"])
@pytest.mark.parametrize(("cell", "kw"), CASES, ids=IDS)
def test_eager_path_equals_the_custom_ops_bit_for_bit_and_torch(cell, kw, x_grad):
    ref, m = _module(cell, kw)
    x, states = _inputs(ref)
    eager = _step(m, x, states, x_grad)
    with _Recording() as mode:
        ops = _step(m, x, states, x_grad)
    # which way each call went
    assert type(eager[2]).__name__ == "_EagerRNNBackward"
    assert "leanrnn.rnn_forward.default" in mode.ops
    assert "leanrnn.rnn_backward.default" in mode.ops
    assert type(ops[2]).__name__ != "_EagerRNNBackward"
    # the same bits
    for a, b in zip(eager[0] + eager[1], ops[0] + ops[1], strict=True):
        assert (a is None) == (b is None)
        assert a is None or torch.equal(a, b)
    # and torch's values and gradients (x's none when it needs none, as torch's)
    want = _step(ref, x, states, x_grad)
    for a, b in zip(eager[0], want[0], strict=True):
        assert float((a - b).detach().abs().max()) <= ATOL[np.float64]
    for a, b in zip(eager[1], want[1], strict=True):
        assert (a is None) == (b is None)
        if a is not None:
            rel = float((a - b).abs().max() / max(float(b.abs().max()), 1e-30))
            assert rel <= RTOL_GRAD[np.float64]
    assert (eager[1][0] is None) == (not x_grad)


@pytest.mark.parametrize(("cell", "kw"), CASES, ids=IDS)
def test_packing_and_gradient_readout_equal_formats_packing(cell, kw):
    """A parameter changed by an optimizer is packed gate by gate (_Engine._write), and each
    gradient read back the same way (_Engine._read): both equal formats.packing's pack and
    unpack of the same tensors, bit for bit, padding included."""
    ref, m = _module(cell, kw)
    x, states = _inputs(ref)
    m(x)[0].sum().backward()  # builds the engine, packs the initial weights
    opt = torch.optim.SGD(m.parameters(), lr=0.5)
    opt.step()  # every parameter changes: the next forward packs them again
    m.zero_grad()
    y, _ = m(x, tuple(states) if len(states) == 2 else states[0])
    (y**2).sum().backward()
    eng = lt._ENGINES[m._key]
    sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    nonlin = getattr(m, "nonlinearity", "tanh")
    want = leanrnn.from_state_dict(sd, cell=cell.lower(), nonlinearity=nonlin).weights
    got = eng.tr.weights
    assert got.nbytes == want.nbytes
    for name, a in want.tensors().items():
        if not name.endswith((".b", ".rb")):  # (folded by the trainer, at its refresh)
            assert np.array_equal(got.tensors()[name], a), name
    assert np.array_equal(got.buffer, want.buffer)  # the folded biases and the padding too
    grads = torch_format.to_state_dict(eng.tr.spec, eng.tr.gradients())
    for n, p in m.named_parameters():
        assert np.array_equal(p.grad.numpy(), grads[n]), n


def test_torch_compile_takes_the_custom_ops_and_eager_calls_do_not():
    """Under torch.compile the module calls the ops (the graph holds them, with x's gradient
    skipped when x needs none); the same module called eagerly takes _EagerRNN; the two give
    the same bits."""
    ref, m = _module("GRU", {"num_layers": 2})
    x, states = _inputs(ref)
    cm, codes = compile_recording(m)
    compiled = _step(cm, x, states, x_grad=False)
    assert len(codes) == 2
    assert "leanrnn.rnn_forward" in codes[0] and "leanrnn.rnn_backward" in codes[1]
    eager = _step(m, x, states, x_grad=False)
    assert type(eager[2]).__name__ == "_EagerRNNBackward"
    assert compiled[1][0] is None and eager[1][0] is None
    for a, b in zip(eager[0] + eager[1][1:], compiled[0] + compiled[1][1:], strict=True):
        assert torch.equal(a, b)
