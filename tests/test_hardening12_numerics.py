"""Session 38, from a red-team pass on numerical extremes, against torch: an LSTM with
proj_size and a hidden size off the 16-unit block turned one infinite input into NaN for the
rest of its sample (and NaN gradients in every parameter), where torch's gates saturate; and a
relu RNN's backward zeroed the gradient at a NaN pre-activation, where torch's passes it on.
Each test failed before."""

from __future__ import annotations

import numpy as np
import pytest

import leanrnn

torch = pytest.importorskip("torch")
lt = pytest.importorskip("leanrnn.torch")


def _x(shape, seed=1):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def _same(got, want, atol=1e-5):
    """Equal NaN patterns, and the finite values within ``atol``."""
    got, want = np.asarray(got), np.asarray(want)
    np.testing.assert_array_equal(np.isnan(got), np.isnan(want))
    np.testing.assert_allclose(got, want, rtol=0, atol=atol, equal_nan=True)


@pytest.mark.parametrize("H", [20, 16, 37])
@pytest.mark.parametrize("value", [np.inf, -np.inf])
def test_projected_lstm_with_an_infinite_input_saturates_as_torch(H, value):
    torch.manual_seed(0)
    ref = torch.nn.LSTM(3, H, proj_size=4)
    m = leanrnn.from_torch(ref)
    x = _x((5, 2, 3))
    x[1, 0, 1] = value  # sample 0 at t=1
    with torch.no_grad():
        yt, (ht, ct) = ref(torch.from_numpy(x))
    assert np.isfinite(yt.numpy()).all()  # torch's gates saturate: nothing to propagate
    y, (h, c) = m(x)
    _same(y, yt.numpy())
    _same(h, ht.numpy())
    _same(c, ct.numpy())
    chunked = leanrnn.Session(m.weights, chunk=2)
    _same(chunked.run(x)[0], yt.numpy())
    st = m.session.stream(batch=2)
    _same(np.stack([st.feed(x[t]) for t in range(len(x))]), yt.numpy())


def _grads(mod, x, dy):
    for p in mod.parameters():
        p.grad = None
    xt = torch.tensor(x, requires_grad=True)
    y, _ = mod(xt)
    y.backward(torch.from_numpy(dy))
    return xt.grad.numpy(), {k: p.grad.numpy().copy() for k, p in mod.named_parameters()}


def _same_grads(ref, mine, x, dy) -> dict:
    """torch's module ``ref`` and ``mine`` give the same dx and parameter gradients; torch's."""
    dxt, gt = _grads(ref, x, dy)
    dxl, gl = _grads(mine, x, dy)
    _same(dxl, dxt)
    for k in gt:
        _same(gl[k], gt[k])
    return gt


def test_projected_lstm_gradients_with_an_infinite_input_as_torch():
    """torch's gradients are NaN in weight_ih's column of the infinite input only (0 * inf);
    leanrnn's were NaN in every parameter."""
    torch.manual_seed(0)
    ref = torch.nn.LSTM(3, 20, proj_size=4)
    mine = lt.from_module(ref)
    x, dy = _x((4, 2, 3)), _x((4, 2, 4), 2)
    x[1, 0, 1] = np.inf
    gt = _same_grads(ref, mine, x, dy)
    assert np.isnan(gt["weight_ih_l0"]).sum() == 80 and not np.isnan(gt["weight_hh_l0"]).any()


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_relu_rnn_backward_passes_the_gradient_at_a_nan_pre_activation_as_torch(dtype):
    torch.manual_seed(0)
    ref = torch.nn.RNN(3, 16, nonlinearity="relu").to(dtype)
    mine = lt.from_module(ref)
    np_dtype = np.float32 if dtype == torch.float32 else np.float64
    x, dy = _x((5, 3, 3)).astype(np_dtype), _x((5, 3, 16), 3).astype(np_dtype)
    x[2, 1, 0] = np.nan
    gt = _same_grads(ref, mine, x, dy)
    assert np.isfinite(gt["bias_ih_l0"]).all()  # (finite on both sides: nothing flagged it)
