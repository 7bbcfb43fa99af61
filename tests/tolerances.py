"""One tolerance table, keyed by dtype: how far a result may be from its oracle.

``ATOL`` is the default: max abs error of leanrnn against an independent oracle (the float64
reference, torch, onnxruntime) computing in the same dtype. Every other entry is NAMED for the
reason a check needs another bound; a dtype without an entry has no such reason yet (the lookup
fails loudly rather than falling back to a guess). Tests never write a tolerance inline.
"""

import numpy as np

from leanrnn.engine.session import splits_operand


class ByDtype(dict):
    """``{dtype: tolerance}``; indexed by anything ``np.dtype`` accepts (np.float32, "float64")."""

    def __init__(self, f32: float | None = None, f64: float | None = None):
        super().__init__()
        if f32 is not None:
            self[np.dtype(np.float32)] = f32
        if f64 is not None:
            self[np.dtype(np.float64)] = f64

    def __getitem__(self, dtype) -> float:
        return super().__getitem__(np.dtype(dtype))

    def __setitem__(self, dtype, value: float) -> None:
        super().__setitem__(np.dtype(dtype), value)


ATOL = ByDtype(f32=1e-5, f64=1e-10)

# Relative bound where magnitudes are not bounded by the activations (values may grow large):
# the same figures as ATOL, relative to the oracle's value.
RTOL = ByDtype(f32=1e-5, f64=1e-10)

# Two runs that do the same arithmetic: the same numba code compiled ahead of time and by the
# JIT, or a chunked run that must fall back to one whole-sequence pass. Only instruction
# selection (FMA contraction) can differ: a few ulps, tighter than ATOL so a real divergence in
# one of them is not hidden inside the oracle's tolerance.
ATOL_SAME_ARITHMETIC = ByDtype(f32=1e-6, f64=1e-13)
RTOL_SAME_ARITHMETIC = ByDtype(f32=1e-6)

# Two float64 implementations of the same formulas on small, well-scaled problems (the bench's
# batched float64 loop vs the oracle or torch; the float64 graph path vs the oracle): only
# summation order differs, errors are ~1e-15, and this is tighter than ATOL.
ATOL_FLOAT64_TWINS = ByDtype(f64=1e-12)

# One elementwise function (sigmoid, softplus, elu) against its closed form in float64: a few
# ulps relative, also for values like exp(-50) that an absolute bound cannot see.
RTOL_ELEMENTWISE = ByDtype(f64=1e-12)

# Unbounded activations (Affine, Relu, Softplus, ...) grow states polynomially per step; their
# chaotic growth amplifies float64 rounding past RTOL now and then. A logic error is O(1).
RTOL_UNBOUNDED = ByDtype(f64=1e-7)

# onnxruntime computes float32 with its own kernels: its own summation order and its own
# approximations of tanh/sigmoid (MLAS), so it sits a little farther from the float64 oracle
# than leanrnn does.
ATOL_ORT = ByDtype(f32=2e-5)
RTOL_ORT = ByDtype(f32=2e-4)

# A float32 matrix product against another float32 product (numpy's BLAS, onnxruntime's MLAS)
# with a different blocking and summation order: the rounding grows with the inner size and with
# the magnitude of the outputs (|y| up to ~10 here).
ATOL_MATMUL = ByDtype(f32=1e-4)
RTOL_MATMUL = ByDtype(f32=1e-4)

# A negative control: a deliberately wrong model (swapped gates, another GRU variant, a changed
# option) must miss the oracle by at least this much, far above the dtype's tolerance, so the
# comparison tells a wrong formula from rounding.
MIN_WRONG = ByDtype(f32=1e-3, f64=1e-4)


# leanrnn.score's outputs against the same model run on each sequence alone: batching and
# padding may change only the order of float32 sums (issue 12's bar).
ATOL_SCORE = ByDtype(f32=1e-6)


# A run against the float64 oracle where the model amplifies rounding: the oracle's own movement
# under perturbations of its inputs by one rounding of the run's dtype (eps/2 relative), times
# this factor. A computation in that dtype rounds every operation, not only the inputs, so it
# may sit a few times farther; one float32 draw (GRU with tanh gates, 2 layers) sat 1.18e-5 off
# where ATOL is 1e-5 and the perturbations moved the oracle 1.4e-5. Draws whose bound reaches
# MIN_WRONG are discarded: a wrong formula is O(1e-3) or more.
CONDITIONING = 4.0


def atol(dtype) -> float:
    return ATOL[dtype]


# Gradients of a training step against torch's own modules (or finite differences), relative to
# the largest magnitude of the gradient tensor: float32 gradients sum T*N products in another
# order than torch, so they sit a few 1e-6 apart; float64 are twins (summation order only).
RTOL_GRAD = ByDtype(f32=1e-5, f64=1e-10)
# Central finite differences in float64 (step 1e-6): truncation and rounding error ~1e-8.
RTOL_FINITE_DIFF = ByDtype(f64=1e-6)

# An optimizer (SGD/Adam/AdamW) over ~20 steps, or gradient clipping, against torch.optim /
# torch.nn.utils in the same dtype: the same operations in the same order, but torch's
# vectorised kernels fuse multiply-adds (lerp, add with alpha) where numpy rounds twice, and
# norms sum in another order. Measured <= 6 eps on values of size ~1; bound at ~30 eps. A wrong
# formula (a missed bias correction, dampening on the first step) is O(lr), far above.
RTOL_OPTIM = ByDtype(f32=4e-6, f64=1e-14)
ATOL_OPTIM = ByDtype(f32=4e-6, f64=1e-14)

# torch.autocast("cpu", torch.bfloat16): torch runs an RNN's matmuls in bfloat16 (8 significant
# bits: 2**-8 relative per rounding, accumulated over layers and steps) while leanrnn computes in
# float32 and rounds its outputs once; both are tanh-bounded (|y| <= 1). A wrong formula is O(1).
ATOL_AUTOCAST_BF16 = ByDtype(f32=5e-2)

# onnxruntime's DynamicQuantizeLSTM (and quantize_dynamic's heads) quantize activations to uint8
# with one scale per call: X over the whole sequence and h at every step (step = range / 255, so
# h in (-1, 1) is off by up to 2/510 = 3.9e-3 per element), then run integer GEMMs. leanrnn keeps
# activations float32, so the two differ by that rounding carried through the gates and the
# recurrence; the same bound holds for onnxruntime's quantized model against the float32 one.
# Measured on the tests' tiny models (C=6, H=12, T=9, 1-2 layers, uni/bi, int8 or uint8 weights
# in 7 bits): <= 2.9e-3 against leanrnn, <= 3.4e-3 against float32. A wrong gate order,
# transpose, scale or zero point is O(0.1).
ATOL_ORT_DYNAMIC_QUANT = ByDtype(f32=1e-2)

# A model with int8 weights (scale max|w| / 127 per tensor or per column, 7 bits with
# reduce_range) run with float32 activations, against the float32 model it came from, on the
# tests' tiny models: measured <= 2.7e-3.
ATOL_WEIGHT_QUANT_INT8 = ByDtype(f32=1e-2)

# Reduced-precision weights (leanrnn.quantize), keyed by the panels' storage dtype (uint16 holds
# bfloat16 bits, int8 the symmetric codes). ATOL_REDUCED: the kernels against the float64
# oracle run on the *same rounded* weights, so only the kernels' float32 arithmetic differs
# (widening a weight to float32 is exact; int8 multiplies by its scale once per sum): ATOL's
# float32 figure.
ATOL_REDUCED = ByDtype()


# bf16 and weight-only int8 on AMX (kernels._bf16amx, 4 rows or more), and bf16 on vdpbf16ps,
# split each activation into two bfloat16 terms: up to 2**-16 of sum |a w| per output where
# float32 has ~K 2**-24 (4e-5 seen at K=112 with |h| <= 1; the weights' own rounding, 2**-8, is
# 40x this bound). Elsewhere float32's.
ATOL_REDUCED[np.uint16] = 1e-4 if splits_operand("bf16") else 1e-5
ATOL_REDUCED[np.int8] = 1e-4 if splits_operand("int8") else 1e-5
# Mixed-precision training (Trainer.autocast, leanrnn.torch under autocast) against a float64
# model on the same bf16-rounded weights, relative to the largest value: the bf16 kernels'
# figure above (its forward) carried through float32 backward arithmetic. Measured <= 6e-6
# (LSTM/GRU/RNN, N=21 on AMX); the float32 model's gradients are ~1e-3 away.
RTOL_AUTOCAST_BF16 = ATOL_REDUCED[np.uint16]
# Trainer(autocast="bf16-act") against the float64 oracle that rounds both factors of every
# product the same way (bf16 x bf16 is exact in float32): float32 sums and backward arithmetic
# only. Measured <= 5.3e-7 (LSTM/GRU/RNN, N=21, the float32 and vdpbf16ps tiles); the weights-
# only mode is ~2e-3 away.
RTOL_AUTOCAST_BF16_ACT = 1e-5
# int8-dynamic (uint8 panels): the integer sums are exact and the oracle rounds the activations
# the same way; float32 arithmetic in the scaling and the cell is what differs.
ATOL_REDUCED[np.uint8] = 1e-5
# bf16-act against the float64 oracle that rounds the same weights and the same activations
# (one step from float32 states): bf16 x bf16 products are exact in float32 on AMX and on the
# float32 tile, so only float32 sums differ. Measured <= 3.7e-7 (LSTM/GRU/RNN, N <= 50).
ATOL_BF16_ACT = ByDtype(f32=1e-5)
# The formats' own rounding bounds (exact, not measured): bfloat16 keeps 8 significant bits, so
# round-to-nearest is off by <= 2**-8 relative (half a spacing of 2**-7); int8 by <= half a step, scale/2, absolute (as a
# fraction of the column's scale, with float32 slack for dividing by the scale).
RTOL_BF16_ROUNDING = 2.0**-8
INT8_HALF_STEP = 0.5 + 1e-6
