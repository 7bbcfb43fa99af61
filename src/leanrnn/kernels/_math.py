"""Scalar math the kernels inline: activations (float32 fast paths), typed constants.

float32 ``tanh`` is a clamped rational approximation (max error ~1e-7) made only of adds,
multiplies and one divide, so LLVM vectorizes the loops around it; scalar libm ``tanhf``/``expf``
calls per element are what make naive numba RNNs slow at large batch. float64 uses libm, so the
float64 path stays within 1e-10 of PyTorch's double path.
"""

from __future__ import annotations

import math

import numpy as np
from numba import types
from numba.extending import overload

from ._jit import inline, jit

# Activation codes (spec.ACTIVATIONS order).
SIGMOID, TANH, RELU, AFFINE, LEAKYRELU, THRESHOLDEDRELU = 0, 1, 2, 3, 4, 5
SCALEDTANH, HARDSIGMOID, ELU, SOFTSIGN, SOFTPLUS = 6, 7, 8, 9, 10


def tanh_(x):  # pragma: no cover - replaced by the overload inside kernels
    return math.tanh(x)


def sigmoid_(x):  # pragma: no cover
    return 1.0 / (1.0 + math.exp(-x))


# tanh(v) ~ v * P(v^2) / Q(v^2) on [-9, 9], the result bounded to [-1, 1]: the float32 tanh,
# here and in the vector IR of _cells. Past |v| ~ 7.9 the rational overshoots 1 by up to 2.4e-7
# (Eigen 3.4 moved its clamp of these coefficients to 7.9053 for that); bounding the result
# leaves the values below as they were (the scalar bits exactly; the vector IR's within an ulp,
# as LLVM schedules the longer expression) and makes sigmoid = tanh/2 + 1/2 never negative (it
# read -1.2e-7 at x = -17.97, and a saturated LSTM output gate then flipped h's sign).
TANH_CLAMP = 9.0
TANH_P = (
    -2.76076847742355e-16, 2.00018790482477e-13, -8.60467152213735e-11, 5.12229709037114e-08,
    1.48572235717979e-05, 6.37261928875436e-04, 4.89352455891786e-03,
)  # fmt: skip
TANH_Q = (1.19825839466702e-06, 1.18534705686654e-04, 2.26843463243900e-03, 4.89352518554385e-03)
_P = tuple(np.float32(c) for c in TANH_P)
_Q = tuple(np.float32(c) for c in TANH_Q)
_HI, _LO = np.float32(TANH_CLAMP), np.float32(-TANH_CLAMP)
_ONE = np.float32(1.0)


@overload(tanh_, inline="always", fastmath=True)
def _tanh_ov(x):
    if x == types.float32:

        def impl(x):
            # Clamp without a branch: a branch in an IR-inlined overload trips numba's SSA scope
            # check (NumbaIRAssumptionWarning on every first compile). numba's min/max are one
            # compare and a select (min(x, HI) = HI if HI < x else x), false for NaN, so NaN
            # passes through untouched, as with the comparisons this replaced (bit-identical).
            v = max(min(x, _HI), _LO)
            x2 = v * v
            p = _P[0]
            p = p * x2 + _P[1]
            p = p * x2 + _P[2]
            p = p * x2 + _P[3]
            p = p * x2 + _P[4]
            p = p * x2 + _P[5]
            p = p * x2 + _P[6]
            q = _Q[0]
            q = q * x2 + _Q[1]
            q = q * x2 + _Q[2]
            q = q * x2 + _Q[3]
            return max(min((p * v) / q, _ONE), -_ONE)  # compare-and-select: NaN passes

        return impl
    return lambda x: math.tanh(x)


@overload(sigmoid_, inline="always", fastmath=True)
def _sigmoid_ov(x):
    if x == types.float32:
        return lambda x: np.float32(0.5) * tanh_(np.float32(0.5) * x) + np.float32(0.5)
    return lambda x: 1.0 / (1.0 + math.exp(-x))


@jit
def act(code, x, alpha, beta, zero, one):
    """ONNX activation ``code`` of scalar x; alpha, beta, zero and one are in x's dtype (a float64
    literal would promote float32 math to float64)."""
    if code == SIGMOID:
        return sigmoid_(x)
    if code == TANH:
        return tanh_(x)
    # RELU and HARDSIGMOID test "below the bound" so that NaN passes through, as torch's relu and
    # the oracle's np.maximum do (NaN is in no sample's outputs otherwise: a NaN input read 0).
    # THRESHOLDEDRELU is ONNX's literal "x if x > alpha", as onnxruntime and the oracle take it.
    if code == RELU:
        return zero if x < zero else x
    if code == AFFINE:
        return alpha * x + beta
    if code == LEAKYRELU:
        return x if x >= zero else alpha * x
    if code == THRESHOLDEDRELU:
        return x if x > alpha else zero
    if code == SCALEDTANH:
        return alpha * tanh_(beta * x)
    if code == HARDSIGMOID:
        v = alpha * x + beta
        v = zero if v < zero else v
        return one if v > one else v
    if code == ELU:
        return x if x >= zero else alpha * (math.exp(x) - one)
    if code == SOFTSIGN:
        return x / (one + abs(x))
    # SOFTPLUS, in the form that cannot overflow: max(x, 0) + log1p(exp(-|x|))
    return (x if x > zero else zero) + math.log1p(math.exp(-abs(x)))


@inline
def act_span(code, alpha, beta, zero, one, buf, row, start, length):
    """buf[row, start:start+length] = act(buf[...]) in place; the switch sits outside the loops
    so each case is a plain loop LLVM can vectorize."""
    if code == SIGMOID:
        for j in range(start, start + length):
            buf[row, j] = sigmoid_(buf[row, j])
    elif code == TANH:
        for j in range(start, start + length):
            buf[row, j] = tanh_(buf[row, j])
    else:
        for j in range(start, start + length):
            buf[row, j] = act(code, buf[row, j], alpha, beta, zero, one)


@inline
def clip_span(clip, buf, row, start, length):
    """Bound buf[row, start:start+length] to [-clip, clip] (ONNX ``clip``); NaN passes through."""
    for j in range(start, start + length):
        v = buf[row, j]
        if v > clip:
            v = clip
        if v < -clip:
            v = -clip
        buf[row, j] = v


@inline
def flush(v, tiny, zero):
    """0 for subnormal |v|: a decaying state must not drop the loop onto the slow denormal path.
    Written as ``abs(v) < tiny`` so NaN (comparison false) passes through; ``v - v`` would be
    folded to 0 under fast-math reassociation."""
    return zero if abs(v) < tiny else v
