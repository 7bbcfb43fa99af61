"""leanrnn vs torch.nn.LSTM/GRU/RNN: same weights, same inputs, max abs error within tolerance."""

import zlib

import numpy as np
import pytest

import leanrnn
from tolerances import atol

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.torch

CASES = [
    # cell, input, hidden, layers, bidirectional, proj, batch_first, nonlinearity
    ("LSTM", 7, 13, 1, False, 0, False, "tanh"),
    ("LSTM", 16, 32, 2, True, 0, True, "tanh"),
    ("LSTM", 5, 17, 3, False, 0, False, "tanh"),
    ("LSTM", 9, 20, 2, True, 7, False, "tanh"),
    ("LSTM", 4, 33, 1, False, 16, True, "tanh"),
    ("GRU", 7, 13, 1, False, 0, False, "tanh"),
    ("GRU", 16, 48, 3, True, 0, True, "tanh"),
    ("GRU", 3, 1, 2, False, 0, False, "tanh"),
    ("RNN", 7, 13, 2, True, 0, False, "tanh"),
    ("RNN", 8, 16, 1, False, 0, True, "relu"),
    ("RNN", 11, 31, 3, True, 0, False, "relu"),
]


def _torch_module(cell, C, H, L, bi, proj, bf, nonlin, dtype):
    kw = dict(num_layers=L, bidirectional=bi, batch_first=bf)
    if cell == "LSTM":
        kw["proj_size"] = proj
    if cell == "RNN":
        kw["nonlinearity"] = nonlin
    m = getattr(torch.nn, cell)(C, H, **kw)
    return m.double() if dtype == np.float64 else m


def _run_torch(m, x, hx, lengths, T):
    with torch.no_grad():
        xt = torch.from_numpy(x)
        if lengths is not None:
            packed = torch.nn.utils.rnn.pack_padded_sequence(
                xt, torch.from_numpy(lengths), batch_first=m.batch_first, enforce_sorted=False
            )
            y, hs = m(packed, hx)
            y, _ = torch.nn.utils.rnn.pad_packed_sequence(
                y, batch_first=m.batch_first, total_length=T
            )
        else:
            y, hs = m(xt, hx)
    return y.numpy(), hs


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(map(str, c)))
@pytest.mark.parametrize("with_lengths", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_matches_torch(case, dtype, with_lengths, with_state):
    cell, C, H, L, bi, proj, bf, nonlin = case
    seed = zlib.crc32(repr(case).encode())
    torch.manual_seed(seed)
    rng = np.random.default_rng(seed)
    m = _torch_module(cell, C, H, L, bi, proj, bf, nonlin, dtype)
    model = leanrnn.from_torch(m)
    assert model.dtype == np.dtype(dtype)
    T, N = 6, 5
    x = rng.standard_normal((N, T, C) if bf else (T, N, C)).astype(dtype)
    D = 2 if bi else 1
    K = proj or H
    lengths = np.array([6, 1, 4, 6, 3], np.int64) if with_lengths else None
    hx = thx = None
    if with_state:
        h0 = rng.standard_normal((L * D, N, K)).astype(dtype)
        if cell == "LSTM":
            c0 = rng.standard_normal((L * D, N, H)).astype(dtype)
            hx, thx = (h0, c0), (torch.from_numpy(h0), torch.from_numpy(c0))
        else:
            hx, thx = h0, torch.from_numpy(h0)
    y, hs = model(x, hx, lengths=lengths)
    yt, hst = _run_torch(m, x, thx, lengths, T)
    tol = atol(dtype)
    assert y.shape == yt.shape
    np.testing.assert_allclose(y, yt, rtol=0, atol=tol)
    if cell == "LSTM":
        np.testing.assert_allclose(hs[0], hst[0].numpy(), rtol=0, atol=tol)
        np.testing.assert_allclose(hs[1], hst[1].numpy(), rtol=0, atol=tol)
    else:
        np.testing.assert_allclose(hs, hst.numpy(), rtol=0, atol=tol)


@pytest.mark.parametrize("N", [4, 9, 33])
@pytest.mark.parametrize("H", [64, 200])
def test_threaded_paths(H, N):
    """Sizes that take the threaded path on 2 threads (unit blocks split per step, the threads
    meeting through atomics), small and large batches."""
    torch.manual_seed(0)
    m = torch.nn.LSTM(H, H)
    model = leanrnn.from_torch(m)
    leanrnn.set_num_threads(2)
    x = np.random.default_rng(0).standard_normal((50, N, H)).astype(np.float32)
    y, (h, c) = model(x)
    with torch.no_grad():
        yt, (ht, ct) = m(torch.from_numpy(x))
    np.testing.assert_allclose(y, yt.numpy(), rtol=0, atol=atol(np.float32))
    np.testing.assert_allclose(c, ct.numpy(), rtol=0, atol=atol(np.float32))


def test_state_dict_roundtrip_into_torch():
    """state_dict() gives PyTorch names and order: loading it into torch reproduces the model."""
    model = leanrnn.GRU(6, 10, num_layers=2, bidirectional=True, seed=3)
    m = torch.nn.GRU(6, 10, num_layers=2, bidirectional=True)
    m.load_state_dict({k: torch.from_numpy(v) for k, v in model.state_dict().items()})
    x = np.random.default_rng(0).standard_normal((4, 2, 6)).astype(np.float32)
    y, h = model(x)
    with torch.no_grad():
        yt, ht = m(torch.from_numpy(x))
    np.testing.assert_allclose(y, yt.numpy(), rtol=0, atol=atol(np.float32))


def test_unbatched_input_like_torch():
    torch.manual_seed(1)
    m = torch.nn.LSTM(5, 8)
    model = leanrnn.from_torch(m)
    x = np.random.default_rng(0).standard_normal((7, 5)).astype(np.float32)
    y, (h, c) = model(x)
    with torch.no_grad():
        yt, (ht, ct) = m(torch.from_numpy(x))
    assert y.shape == (7, 8) and h.shape == (1, 8)
    np.testing.assert_allclose(y, yt.numpy(), rtol=0, atol=atol(np.float32))
    np.testing.assert_allclose(h, ht.numpy(), rtol=0, atol=atol(np.float32))


@pytest.mark.parametrize("case", [c for c in CASES if c[6]], ids=lambda c: "-".join(map(str, c)))
def test_batch_first_module_via_state_dict_and_from_torch(case):
    """A state dict holds neither batch_first nor nonlinearity: from_state_dict takes them as
    arguments, from_torch reads them off the module; both then match torch on [N, T, C]."""
    cell, C, H, L, bi, proj, bf, nonlin = case
    seed = zlib.crc32(repr(case).encode())
    torch.manual_seed(seed)
    m = _torch_module(cell, C, H, L, bi, proj, bf, nonlin, np.float32)
    x = np.random.default_rng(seed).standard_normal((3, 6, C)).astype(np.float32)  # [N, T, C]
    want, _ = _run_torch(m, x, None, None, 6)
    sd = {k: v.detach().numpy() for k, v in m.state_dict().items()}
    via_sd = leanrnn.from_state_dict(sd, batch_first=True, nonlinearity=nonlin)
    via_torch = leanrnn.from_torch(m)
    for model in (via_sd, via_torch):
        assert model.spec.batch_first
        assert type(model).__name__ == cell
        np.testing.assert_allclose(model(x)[0], want, rtol=0, atol=atol(np.float32))
    # The flag is what a state dict cannot say: left out, the same weights read x time-major.
    assert not leanrnn.from_state_dict(sd, nonlinearity=nonlin).spec.batch_first
