"""Compiling the kernels shows no numba-internal warnings: they ask the user to report a numba bug
and name nothing leanrnn-related (the float32 tanh once printed four per first compile)."""

import warnings

import numba
import numpy as np

from leanrnn.kernels._math import tanh_
from tolerances import atol


def test_inlined_float32_tanh_compiles_without_numba_ir_warnings():
    # The shape that drew NumbaIRAssumptionWarning ("variable ... is not in scope"): the
    # overload inlined into an IR-inlined helper with branches (as act_span in the kernels),
    # itself inlined twice into a loop. Defined here, so numba compiles it afresh (no cache).
    @numba.njit(inline="always")
    def span(buf, code):
        if code == 1:
            for j in range(buf.size):
                buf[j] = tanh_(buf[j])
        else:
            for j in range(buf.size):
                buf[j] = tanh_(buf[j])

    @numba.njit
    def steps(buf, n):
        for s in range(n):
            if s > 0:
                span(buf, 1)
            span(buf, 0)

    x = np.array([-20.0, -3.0, -0.5, 0.0, 0.25, 2.0, 9.5, np.nan], np.float32)
    got = x.copy()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        steps(got, 2)  # s=0: one tanh; s=1: two
    assert [str(w.message) for w in caught] == []
    want = np.tanh(np.tanh(np.tanh(x.astype(np.float64))))
    np.testing.assert_allclose(got, want, atol=atol(np.float32), rtol=0)
    assert np.isnan(got[-1])  # NaN passes through the clamp
