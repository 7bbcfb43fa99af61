"""Session.run(x, out=...) takes back the tuple it returns: for a GRU/RNN that is (y, h_n, None),
which was refused as "out must be a tuple (y, h_n); got 3 arrays"."""

from __future__ import annotations

import numpy as np
import pytest

import leanrnn
from leanrnn import errors


@pytest.mark.parametrize("cls", [leanrnn.GRU, leanrnn.RNN])
def test_run_takes_back_its_own_outputs(cls):
    m = cls(4, 8, num_layers=2, seed=0)
    s = m.session
    x = np.random.default_rng(0).standard_normal((5, 3, 4)).astype(np.float32)
    y, h_n, c_n = s.run(x)
    assert c_n is None
    y2, h2, c2 = s.run(x, out=(np.empty_like(y), np.empty_like(h_n), None))
    assert c2 is None
    np.testing.assert_array_equal(y2, y)
    np.testing.assert_array_equal(h2, h_n)
    # the returned tuple itself, as the README's loop writes it: written in place
    y3, h3, c3 = s.run(x, out=(y2, h2, c2))
    assert y3 is y2 and h3 is h2 and c3 is None
    np.testing.assert_array_equal(h3, h_n)
    # return_sequences=False: (h_n, None) likewise
    _, h4, c4 = s.run(x, out=(np.empty_like(h_n), None), return_sequences=False)
    assert c4 is None
    np.testing.assert_array_equal(h4, h_n)
    # through the model, unbatched: the session sees the same trailing None
    yu, hu = m(
        np.ascontiguousarray(x[:, 0]), out=(np.empty_like(y[:, 0]), np.empty_like(h_n[:, 0]), None)
    )
    # (N=1 against N=3: equal to rounding, the README's reproducibility across batch shapes)
    np.testing.assert_allclose(yu, y[:, 0], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(hu, h_n[:, 0], rtol=1e-5, atol=1e-6)


def test_run_refuses_a_cell_state_for_a_gru():
    m = leanrnn.GRU(4, 8, seed=0)
    x = np.zeros((5, 3, 4), np.float32)
    y, h_n, _ = m.session.run(x)
    c = np.empty_like(h_n)
    with pytest.raises(errors.ShapeError, match=r"a GRU has no cell state: out\[2\] \(c_n\)"):
        m.session.run(x, out=(y, h_n, c))
    with pytest.raises(errors.ShapeError, match="out must be a tuple"):
        m.session.run(x, out=(y, h_n, None, None))


def test_lstm_out_still_needs_c_n():
    m = leanrnn.LSTM(4, 8, seed=0)
    x = np.zeros((5, 3, 4), np.float32)
    y, h_n, c_n = m.session.run(x)
    with pytest.raises(errors.ShapeError, match="out must be a tuple"):
        m.session.run(x, out=(y, h_n))
    with pytest.raises(errors.DTypeError, match=r"out\[2\] \(c_n\) is a NoneType"):
        m.session.run(x, out=(y, h_n, None))
