"""Bad input: a precise error naming what came in and what was expected; the session survives."""

import numpy as np
import pytest

import leanrnn
from leanrnn import errors


@pytest.fixture(scope="module")
def model():
    return leanrnn.LSTM(8, 16, num_layers=2, seed=0)


@pytest.fixture(scope="module")
def good():
    x = np.random.default_rng(0).standard_normal((5, 3, 8)).astype(np.float32)
    return x


def _still_works(model, good, expected):
    y, (h, c) = model(good)
    np.testing.assert_array_equal(y, expected)


BAD = [
    ("rank", lambda x: x[0], errors.ShapeError, r"x has shape \(3, 8\); expected \[T, N, C=8\]"),
    ("features", lambda x: x[..., :7], errors.ShapeError, r"expected \[T, N, C=8\]"),
    ("dtype", lambda x: x.astype(np.float64), errors.DTypeError, "dtype float64; expected float32"),
    ("int", lambda x: x.astype(np.int32), errors.DTypeError, "astype"),
    ("list", lambda x: x.tolist(), errors.DTypeError, "is a list"),
    (
        "strided",
        lambda x: np.zeros((5, 6, 8), np.float32)[:, ::2],
        errors.LayoutError,
        "C-contiguous",
    ),
    ("negative", lambda x: x[::-1], errors.LayoutError, "ascontiguousarray"),
    ("empty", lambda x: x[:0], errors.ShapeError, "T and N must be >= 1"),
]


@pytest.mark.parametrize("name,make,exc,msg", BAD, ids=[b[0] for b in BAD])
def test_bad_x(model, good, name, make, exc, msg):
    expected = model(good)[0]
    with pytest.raises(exc, match=msg):
        model.session.run(make(good))
    _still_works(model, good, expected)


@pytest.mark.parametrize(
    "lengths,msg",
    [
        (np.array([5, 6, 1]), r"lengths \[6\] out of range; expected 0 <= length <= T=5"),
        (np.array([5, -1, 1]), r"lengths \[-1\] out of range"),
        (np.array([5, 1]), r"lengths has shape \(2,\); expected \[N=3\]"),
        (np.array([5.0, 1.0, 2.0]), "expected an integer array"),
    ],
)
def test_bad_lengths(model, good, lengths, msg):
    expected = model(good)[0]
    with pytest.raises(errors.LengthsError, match=msg):
        model(good, lengths=lengths)
    _still_works(model, good, expected)


def test_bad_states(model, good):
    expected = model(good)[0]
    h0 = np.zeros((2, 3, 16), np.float32)
    with pytest.raises(errors.ShapeError, match=r"h0 has shape \(1, 3, 16\); expected \[L\*D=2"):
        model(good, (h0[:1], h0))
    with pytest.raises(errors.DTypeError, match="c0 has dtype float64"):
        model(good, (h0, h0.astype(np.float64)))
    with pytest.raises(errors.SpecError, match="tuple"):
        model(good, h0)
    _still_works(model, good, expected)


def test_bad_out(model, good):
    expected = model(good)[0]
    y = np.empty((5, 3, 16), np.float32)
    h = np.empty((2, 3, 16), np.float32)
    with pytest.raises(errors.ShapeError, match="out must be a tuple"):
        model.session.run(good, out=(y, h))
    with pytest.raises(errors.ShapeError, match=r"out\[0\] \(y\) has shape"):
        model.session.run(good, out=(y[:4], h, h))
    ro = h.copy()
    ro.flags.writeable = False
    with pytest.raises(errors.LayoutError, match="read-only"):
        model.session.run(good, out=(y, h, ro))
    _still_works(model, good, expected)


def test_nan_and_inf_propagate(model, good):
    """Documented: NaN/Inf in the input propagate; they never crash or hang."""
    x = good.copy()
    x[2, 1, 3] = np.nan
    y, (h, c) = model(x)
    assert np.isnan(y[2:, 1]).all() and np.isfinite(y[:, 0]).all() and np.isfinite(y[:2]).all()
    x[2, 1, 3] = np.inf
    y, _ = model(x)
    assert np.isfinite(y[:, 0]).all()


def test_bad_spec_and_weights():
    with pytest.raises(errors.SpecError, match="proj_size=20 must be smaller than hidden_size=16"):
        leanrnn.LSTM(8, 16, proj_size=20)
    with pytest.raises(errors.SpecError, match="cell='lstn'"):
        leanrnn.RNNSpec("lstn", 3, 4)
    sd = leanrnn.LSTM(4, 6, seed=0).state_dict()
    sd["weight_hh_l0"] = sd["weight_hh_l0"][:, :5]
    with pytest.raises(
        errors.WeightsError, match=r"weight_hh_l0 has shape \(24, 5\); expected \(24, 6\)"
    ):
        leanrnn.LSTM.from_state_dict(sd)
    sd = leanrnn.LSTM(4, 6, seed=0).state_dict()
    sd["bogus"] = sd.pop("bias_hh_l0")
    with pytest.raises(
        errors.WeightsError, match=r"missing keys \['bias_hh_l0'\]; unexpected keys \['bogus'\]"
    ):
        leanrnn.LSTM.from_state_dict(sd)


def test_set_num_threads_validates():
    with pytest.raises(errors.LeanRNNError, match="expected >= 1"):
        leanrnn.set_num_threads(0)
