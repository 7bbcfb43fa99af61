"""The ops real recurrent models put around their RNN nodes, as torch's two ONNX exporters write
them (a survey of 34 deployed-style models in session 37): masks from lengths (``Less``,
``Equal``, ``Not``, ``Where``), pooling and decoding (``ArgMax``, ``GatherElements``, ``GatherND``, ``Tile``, ``Einsum`` for attention over time),
activations (``Clip`` for Hardtanh and clamp, ``LeakyRelu``, ``Pow``, ``Erf``, ``Gelu``),
normalization (``LayerNormalization``, ``BatchNormalization`` in inference form) and the
convolution front-ends of speech and OCR models (``Conv``, ``MaxPool``, 1-D and 2-D).

Each ``run`` writes its output into the arena view it is handed; numpy temporaries of an
input's size are made where a formula needs one (the RNN nodes, which hold the model's time,
allocate nothing). Semantics are ONNX's, checked op by op against onnxruntime
(tests/test_hardening11_graph.py); where ONNX leaves a case open, onnxruntime's choice is taken
and the docstring says so.
"""

from __future__ import annotations

import math

import numpy as np

from ...errors import DTypeError, ModelFormatError
from .base import (
    Out,
    _axis,
    _broadcast,
    _element_index,
    _fail,
    _fits_off_axis,
    _float,
    _indices,
    _ints,
    _nin,
    _numeric_tensor,
    _same_dtype,
    attr_flag,
    attr_float,
    attr_int,
    attr_ints,
    attr_str,
)

BOOL = np.dtype(bool)
I64 = np.dtype(np.int64)


# ------------------------------------------------------------------ comparisons and logic
_COMPARE = {
    "Equal": np.equal,
    "Less": np.less,
    "Greater": np.greater,
    "LessOrEqual": np.less_equal,
    "GreaterOrEqual": np.greater_equal,
}
_LOGIC = {"And": np.logical_and, "Or": np.logical_or, "Xor": np.logical_xor}


def _compare_infer(ctx, node, ins, vals):
    _nin(node, ins, 2, 2)
    dt = _same_dtype(node, ins)
    if node.op in _LOGIC and dt != BOOL:
        _fail(node, f"inputs have dtype {dt}; expected bool", DTypeError)
    if node.op in _COMPARE and dt.kind not in "iuf" and not (node.op == "Equal" and dt == BOOL):
        _fail(node, f"inputs have dtype {dt}; expected numeric tensors", DTypeError)
    return [Out(_broadcast(node, ins[0].shape, ins[1].shape), BOOL)]


def _compare_run(ctx, node, ins, outs, metas, tmp):
    ({**_COMPARE, **_LOGIC})[node.op](ins[0], ins[1], out=outs[0])
    return outs


def _not_infer(ctx, node, ins, vals):
    _nin(node, ins, 1, 1)
    if ins[0].dtype != BOOL:
        _fail(node, f"input has dtype {ins[0].dtype}; expected bool", DTypeError)
    return [Out(ins[0].shape, BOOL)]


def _not_run(ctx, node, ins, outs, metas, tmp):
    np.logical_not(ins[0], out=outs[0])
    return outs


def _where_infer(ctx, node, ins, vals):
    _nin(node, ins, 3, 3)
    cond, x, y = ins
    if cond.dtype != BOOL:
        _fail(node, f"condition has dtype {cond.dtype}; expected bool", DTypeError)
    dt = _same_dtype(node, [x, y])
    return [Out(_broadcast(node, cond.shape, x.shape, y.shape), dt)]


def _where_run(ctx, node, ins, outs, metas, tmp):
    cond, x, y = ins
    np.copyto(outs[0], np.broadcast_to(y, outs[0].shape))
    np.copyto(
        outs[0], np.broadcast_to(x, outs[0].shape), where=np.broadcast_to(cond, outs[0].shape)
    )
    return outs


# ------------------------------------------------------------------------ elementwise math
def _clip_bounds(node, ins, vals, dt) -> tuple:
    """(min, max) as scalars of ``dt`` (None: unbounded): attributes before opset 11, optional
    scalar inputs after (values at run time: ``vals`` may be None at infer)."""
    if len(ins) == 1 and ("min" in node.attrs or "max" in node.attrs):
        lo = attr_float(node, "min", 0.0) if "min" in node.attrs else None
        hi = attr_float(node, "max", 0.0) if "max" in node.attrs else None
        if lo is not None and hi is not None and lo > hi:  # (onnxruntime's Clip-6 refuses it)
            _fail(node, f"min={lo:g} > max={hi:g}", ModelFormatError)
        return (None if lo is None else dt.type(lo)), (None if hi is None else dt.type(hi))
    bounds = []
    for i in (1, 2):
        m = ins[i] if i < len(ins) else None
        if m is None:
            bounds.append(None)
            continue
        if m.dtype != dt or math.prod(m.shape) != 1:
            _fail(node, f"input {i} is {m.dtype}{list(m.shape)}; expected a scalar of {dt}")
        v = vals[i] if vals is not None else None
        bounds.append(None if v is None else dt.type(np.asarray(v).reshape(())))
    return tuple(bounds)


def _clip_infer(ctx, node, ins, vals):
    _nin(node, ins, 1, 3)
    _numeric_tensor(node, ins[0])
    _clip_bounds(node, ins, None, ins[0].dtype)  # the checks
    return [Out(ins[0].shape, ins[0].dtype)]


def _clip_run(ctx, node, ins, outs, metas, tmp):
    x, o = ins[0], outs[0]
    lo, hi = _clip_bounds(node, [None if a is None else Out(a.shape, a.dtype) for a in ins],
                          ins, x.dtype)  # fmt: skip
    # ONNX (opset 13): min(max(x, lo), hi), so every value is hi when lo > hi; an absent bound
    # is the type's lowest or highest finite value (so +-inf become finite, as in onnxruntime)
    info = np.finfo(x.dtype) if x.dtype.kind == "f" else np.iinfo(x.dtype)
    lo = info.min if lo is None else lo
    hi = info.max if hi is None else hi
    with np.errstate(invalid="ignore"):
        np.maximum(x, lo, out=o)
        np.minimum(o, hi, out=o)
    return outs


def _leaky_relu_run(ctx, node, ins, outs, metas, tmp):
    x, o = ins[0], outs[0]
    alpha = x.dtype.type(attr_float(node, "alpha", 0.01))
    np.multiply(x, alpha, out=o)
    np.copyto(o, x, where=x >= 0)
    return outs


def _pow_infer(ctx, node, ins, vals):
    _nin(node, ins, 2, 2)
    _numeric_tensor(node, ins[0], "the base")
    _numeric_tensor(node, ins[1], "the exponent")
    return [Out(_broadcast(node, ins[0].shape, ins[1].shape), ins[0].dtype)]


def _pow_run(ctx, node, ins, outs, metas, tmp):
    x, y = ins
    if x.dtype.kind == "f" and y.dtype.itemsize <= x.dtype.itemsize:
        np.power(x, y.astype(x.dtype, copy=False), out=outs[0])
    else:
        # an integer base, or a wider exponent: computed in float64 and cast to the base's type,
        # as onnxruntime's std::pow promotes (a float32 base with a float64 exponent differs
        # in the last bits otherwise)
        with np.errstate(invalid="ignore", over="ignore"):
            np.copyto(outs[0], np.power(x.astype(np.float64), y.astype(np.float64)),
                      casting="unsafe")  # fmt: skip
    return outs


ERF_BLOCK = 1 << 16


def erf(x: np.ndarray, out: np.ndarray) -> None:
    """erf(x) into ``out``. float64: exact (math.erf per value, which numpy lacks). float32:
    within 2e-7 absolutely, computed in float64: a Taylor series for |x| < 0.5 and Numerical
    Recipes' Chebyshev fit of erfc (fractional error < 1.2e-7) beyond."""
    if x.size > ERF_BLOCK:  # in blocks: the float64 work is several times the output
        xs, os_ = x.reshape(-1), out.reshape(-1)
        for a in range(0, x.size, ERF_BLOCK):
            erf(xs[a : a + ERF_BLOCK], os_[a : a + ERF_BLOCK])
        return
    if x.dtype == np.float64:
        np.copyto(out, np.frompyfunc(math.erf, 1, 1)(x).astype(np.float64))
        return
    z = np.abs(x.astype(np.float64))
    t = 1.0 / (1.0 + 0.5 * z)
    poly = 0.17087277
    for c in (-0.82215223, 1.48851587, -1.13520398, 0.27886807, -0.18628806, 0.09678418,
              0.37409196, 1.00002368, -1.26551223):  # fmt: skip
        poly = c + t * poly
    r = 1.0 - t * np.exp(-z * z + poly)
    z2 = z * z  # 2/sqrt(pi) (x - x^3/3 + x^5/10 - x^7/42 + x^9/216 - x^11/1320)
    series = z * (1 + z2 * (-1 / 3 + z2 * (1 / 10 + z2 * (-1 / 42 + z2 * (1 / 216 - z2 / 1320)))))
    r = np.where(z < 0.5, series * (2 / math.sqrt(math.pi)), r)
    np.copyto(out, np.copysign(r, x), casting="same_kind")


def _float_unary_infer(ctx, node, ins, vals):
    _nin(node, ins, 1, 1)
    _float(node, ins[0])
    if node.op == "Gelu" and attr_str(node, "approximate", "none") not in ("none", "tanh"):
        _fail(node, f"approximate={node.attrs['approximate']!r}; expected 'none' or 'tanh'",
              ModelFormatError)  # fmt: skip
    return [Out(ins[0].shape, ins[0].dtype)]


def _erf_run(ctx, node, ins, outs, metas, tmp):
    erf(ins[0], outs[0])
    return outs


def _gelu_run(ctx, node, ins, outs, metas, tmp):
    x, o = ins[0], outs[0]
    t = x.dtype.type
    if (
        attr_str(node, "approximate", "none") == "tanh"
    ):  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))
        inner = x * x
        inner *= t(0.044715)
        inner += t(1)
        inner *= x
        inner *= t(math.sqrt(2 / math.pi))
        np.tanh(inner, out=o)
    else:  # 0.5 x (1 + erf(x / sqrt(2)))
        erf(x * t(1 / math.sqrt(2)), o)
    o += t(1)
    o *= x
    o *= t(0.5)
    return outs


# -------------------------------------------------------------------- indexing and decoding
def _arg_infer(ctx, node, ins, vals):
    _nin(node, ins, 1, 1)
    _numeric_tensor(node, ins[0])
    shape = ins[0].shape
    if not shape:
        _fail(node, "input is a scalar; expected rank >= 1")
    a = _axis(node, node.attrs.get("axis", 0), len(shape))
    if shape[a] == 0:
        _fail(node, f"axis {a} of {list(shape)} is empty: no index to return")
    keep = attr_flag(node, "keepdims", 1)
    out = (*shape[:a], *((1,) if keep else ()), *shape[a + 1 :])
    return [Out(out, I64)]


def _arg_run(ctx, node, ins, outs, metas, tmp):
    # NaN counts as the largest (and smallest) value, as numpy and torch have it; onnxruntime
    # skips NaN
    x = ins[0]
    a = _axis(node, node.attrs.get("axis", 0), x.ndim)
    fn = np.argmax if node.op == "ArgMax" else np.argmin
    if attr_int(node, "select_last_index", 0) != 0:  # the last of equal extremes (any nonzero)
        idx = (x.shape[a] - 1) - fn(np.flip(x, axis=a), axis=a)
    else:
        idx = fn(x, axis=a)
    np.copyto(outs[0], idx.reshape(metas[0].shape))
    return outs


def _gather_elements_infer(ctx, node, ins, vals):
    _nin(node, ins, 2, 2)
    data, idx = ins
    _indices(node, idx)
    if len(idx.shape) != len(data.shape) or not data.shape:
        _fail(node, f"indices {list(idx.shape)} must have the rank of data {list(data.shape)}")
    a = _axis(node, node.attrs.get("axis", 0), len(data.shape))
    _fits_off_axis(node, data, idx, a)
    return [Out(idx.shape, data.dtype)]


def _gather_elements_run(ctx, node, ins, outs, metas, tmp):
    data, idx = ins
    a = _axis(node, node.attrs.get("axis", 0), data.ndim)
    np.copyto(outs[0], data[_element_index(node, idx, a, data.shape[a])])
    return outs


def _gather_nd_infer(ctx, node, ins, vals):
    _nin(node, ins, 2, 2)
    data, idx = ins
    if idx.dtype != I64:
        _fail(node, f"indices have dtype {idx.dtype}; expected int64", DTypeError)
    b = attr_int(node, "batch_dims", 0)
    if not idx.shape or not 0 <= b < min(len(data.shape), len(idx.shape)):
        _fail(node, f"batch_dims={b} for data {list(data.shape)} and indices {list(idx.shape)}")
    k = idx.shape[-1]
    if data.shape[:b] != idx.shape[:b] or not 1 <= k <= len(data.shape) - b:
        _fail(node, f"indices {list(idx.shape)} for data {list(data.shape)} with batch_dims={b}: "
                    "expected the same batch dims and a last dim of 1..rank(data)-batch_dims")  # fmt: skip
    return [Out((*idx.shape[:-1], *data.shape[b + k :]), data.dtype)]


def _gather_nd_run(ctx, node, ins, outs, metas, tmp):
    data, idx = ins
    b, k = attr_int(node, "batch_dims", 0), idx.shape[-1]
    B = math.prod(data.shape[:b])
    if not B or not outs[0].size:  # an empty batch or no indices: nothing to gather
        return outs
    d = data.reshape(B, *data.shape[b:])
    ii = idx.reshape(B, -1, k)
    coords = []
    for j in range(k):
        n, c = d.shape[1 + j], ii[..., j]
        if c.size and (int(c.min()) < -n or int(c.max()) >= n):
            bad = int(c.min()) if int(c.min()) < -n else int(c.max())
            _fail(node, f"index {bad} is out of range [-{n}, {n}) for axis {b + j} of data")
        coords.append(np.where(c < 0, c + n, c))
    np.copyto(outs[0], d[(np.arange(B)[:, None], *coords)].reshape(metas[0].shape))
    return outs


def _tile_infer(ctx, node, ins, vals):
    _nin(node, ins, 2, 2)
    reps = _ints(node, vals[1], "repeats")
    shape = ins[0].shape
    if len(reps) != len(shape) or any(r < 0 for r in reps):
        _fail(node, f"repeats {reps}; expected {len(shape)} values >= 0, one per axis of "
                    f"{list(shape)}")  # fmt: skip
    return [Out(tuple(d * r for d, r in zip(shape, reps, strict=True)), ins[0].dtype)]


def _tile_run(ctx, node, ins, outs, metas, tmp):
    x, o = ins[0], outs[0]
    reps = tuple(o.shape[i] // x.shape[i] if x.shape[i] else 0 for i in range(x.ndim))
    # a view of o as [r0, d0, r1, d1, ...]: x broadcast into every repeat at once
    view = o.reshape(tuple(v for r, d in zip(reps, x.shape, strict=True) for v in (r, d)))
    np.copyto(view, x.reshape(tuple(v for d in x.shape for v in (1, d))))
    return outs


def _einsum_terms(node, ins) -> tuple[str, list[str], str]:
    """(equation without spaces, input terms, output term) checked against the inputs: one
    letter per named axis, ``...`` for the broadcast ones; the output term is the explicit one,
    or (implicit mode) the ellipsis then the letters used once, in alphabetical order."""
    eq = node.attrs.get("equation")
    if not isinstance(eq, str) or not eq:
        _fail(node, f"equation={eq!r}; expected an einsum equation such as 'nth,ntc->nhc'",
              ModelFormatError)  # fmt: skip
    eq = eq.replace(" ", "")
    lhs, arrow, rhs = eq.partition("->")
    terms = lhs.split(",")
    if len(terms) != len(ins):
        _fail(node, f"equation {eq!r} names {len(terms)} inputs; the node has {len(ins)}",
              ModelFormatError)  # fmt: skip
    letters = [t.replace("...", "") for t in [*terms, *([rhs] if arrow else [])]]
    bad = [t for t in letters if t and not (t.isalpha() and t.isascii())]
    if bad or any(t.count("...") > 1 for t in [*terms, rhs]):
        _fail(node, f"equation {eq!r}; expected letters, commas, one '...' per term and '->'",
              ModelFormatError)  # fmt: skip
    if not arrow:
        once = sorted(c for c in set("".join(letters)) if "".join(letters).count(c) == 1)
        rhs = ("..." if "..." in lhs else "") + "".join(once)
    named = rhs.replace("...", "")
    if len(set(named)) != len(named):  # ("ij->ii" was planned, then refused by numpy at run)
        _fail(node, f"equation {eq!r}: the output term names a label twice", ModelFormatError)
    return f"{lhs}->{rhs}", terms, rhs


def _einsum_infer(ctx, node, ins, vals):
    _nin(node, ins, 1, None)
    dt = _same_dtype(node, ins)
    _numeric_tensor(node, ins[0])
    eq, terms, rhs = _einsum_terms(node, ins)
    dims: dict[str, int] = {}
    ell: list[tuple[int, ...]] = []
    for term, m in zip(terms, ins, strict=True):
        named = term.replace("...", "")
        extra = len(m.shape) - len(named)
        if extra < 0 or (extra and "..." not in term):
            _fail(node, f"term {term!r} does not fit input {list(m.shape)}")
        head = term.index("...") if "..." in term else len(named)
        ell.append(tuple(m.shape[head : head + extra]))
        axes = list(m.shape[:head]) + list(m.shape[head + extra :])
        for c, d in zip(named, axes, strict=True):
            have = dims.setdefault(c, d)
            if have != d and 1 not in (have, d):  # (a size-1 label broadcasts, as onnxruntime's)
                _fail(node, f"label {c!r} is {have} in one input and {d} in another")
            dims[c] = max(have, d)
    if any(c not in dims for c in rhs.replace("...", "")):
        _fail(node, f"output term {rhs!r} names a label no input has", ModelFormatError)
    shape = []
    for part in rhs.split("...") if "..." in rhs else [rhs]:
        shape.append([dims[c] for c in part])
    if "..." in rhs:
        shape = shape[0] + list(_broadcast(node, *ell)) + shape[1]
    else:
        shape = shape[0]
    return [Out(tuple(shape), dt)]


def _einsum_run(ctx, node, ins, outs, metas, tmp):
    eq, _, _ = _einsum_terms(node, ins)
    # numpy's contraction path (BLAS for pairs; its temporaries stay within the largest
    # operand or output): its plain loops took the product of every label's size, 44 s for
    # "ab,cd,ef->" on three 60x60 matrices
    np.einsum(eq, *ins, out=outs[0], optimize=True)
    return outs


# ---------------------------------------------------------------------------- normalization
def _layer_norm_infer(ctx, node, ins, vals):
    _nin(node, ins, 2, 3)
    x = ins[0]
    _float(node, x)
    a = _axis(node, node.attrs.get("axis", -1), len(x.shape))
    inner = x.shape[a:]
    for i, what in ((1, "scale"), (2, "bias")):
        m = ins[i] if i < len(ins) else None
        if m is not None and (m.dtype != x.dtype or _broadcast(node, inner, m.shape) != inner):
            _fail(node, f"{what} is {m.dtype}{list(m.shape)}; expected {x.dtype} broadcasting "
                        f"to the normalized axes {list(inner)}")  # fmt: skip
    stats = (*x.shape[:a], *(1,) * len(inner))
    stash = np.float32 if attr_int(node, "stash_type", 1) == 1 else x.dtype
    return [Out(x.shape, x.dtype), Out(stats, np.dtype(stash)), Out(stats, np.dtype(stash))]


def _layer_norm_run(ctx, node, ins, outs, metas, tmp):
    x = ins[0]
    a = _axis(node, node.attrs.get("axis", -1), x.ndim)
    axes = tuple(range(a, x.ndim))
    # statistics in float32 at least (stash_type 1), as onnxruntime computes them
    work = x.astype(np.promote_types(x.dtype, np.float32), copy=False)
    mean = work.mean(axis=axes, keepdims=True)
    centered = work - mean
    var = np.mean(centered * centered, axis=axes, keepdims=True)
    inv = 1.0 / np.sqrt(var + work.dtype.type(attr_float(node, "epsilon", 1e-5)))
    y = centered * inv
    if len(ins) > 1 and ins[1] is not None:
        y *= ins[1]
    if len(ins) > 2 and ins[2] is not None:
        y += ins[2]
    np.copyto(outs[0], y, casting="same_kind")
    for o, v in zip(outs[1:], (mean, inv), strict=False):
        if o is not None:
            np.copyto(o, v, casting="same_kind")
    return outs


def _batch_norm_infer(ctx, node, ins, vals):
    _nin(node, ins, 5, 5)
    x = ins[0]
    _float(node, x)
    if attr_int(node, "training_mode", 0) or len([o for o in node.outputs if o]) > 1:
        _fail(node, "training mode (running statistics as outputs); expected the inference "
                    "form: export the model in eval()", ModelFormatError)  # fmt: skip
    if len(x.shape) < 2:
        _fail(node, f"input is {list(x.shape)}; expected [N, C, ...]")
    C = x.shape[1]
    for m, what in zip(ins[1:], ("scale", "bias", "mean", "var"), strict=True):
        if m.shape != (C,) or m.dtype.kind != "f":
            _fail(node, f"{what} is {m.dtype}{list(m.shape)}; expected a float [{C}] (the "
                        "channels, axis 1)")  # fmt: skip
    return [Out(x.shape, x.dtype)]


def _batch_norm_run(ctx, node, ins, outs, metas, tmp):
    x, scale, bias, mean, var = ins
    shape = (1, x.shape[1]) + (1,) * (x.ndim - 2)
    t = x.dtype.type
    inv = (scale / np.sqrt(var + t(attr_float(node, "epsilon", 1e-5)))).astype(x.dtype)
    np.subtract(x, mean.astype(x.dtype).reshape(shape), out=outs[0])
    outs[0] *= inv.reshape(shape)
    outs[0] += bias.astype(x.dtype).reshape(shape)
    return outs


# -------------------------------------------------------------------- convolution front-ends
def _window(node, ins, vals, pool: bool):
    """(spatial kernel, strides, dilations, pads [begin..., end...]) of a Conv or MaxPool, checked
    against the input's spatial shape."""
    x = ins[0]
    nd = len(x.shape) - 2
    if nd not in (1, 2):
        _fail(node, f"input is {list(x.shape)}; expected [N, C, L] or [N, C, H, W] (1-D or 2-D)",
              ModelFormatError)  # fmt: skip
    if pool:
        kernel = attr_ints(node, "kernel_shape", [])
    else:
        kernel = list(ins[1].shape[2:])
        if "kernel_shape" in node.attrs and attr_ints(node, "kernel_shape", []) != kernel:
            _fail(node, f"kernel_shape {node.attrs['kernel_shape']} is not the weight's {kernel}")
    if len(kernel) != nd:
        _fail(node, f"kernel {kernel} for a {nd}-D input", ModelFormatError)
    strides = attr_ints(node, "strides", [1] * nd)
    dil = attr_ints(node, "dilations", [1] * nd)
    pads = attr_ints(node, "pads", [0] * (2 * nd))
    auto = attr_str(node, "auto_pad", "NOTSET")
    if auto not in ("NOTSET", "VALID", ""):
        _fail(node, f"auto_pad={auto!r}; expected NOTSET or VALID (explicit pads, as torch's "
                    "exporters write them)", ModelFormatError)  # fmt: skip
    if auto == "VALID":
        pads = [0] * (2 * nd)
    if attr_int(node, "ceil_mode", 0):
        _fail(node, "ceil_mode=1; expected 0 (torch's default)", ModelFormatError)
    if (
        (len(strides), len(dil), len(pads)) != (nd, nd, 2 * nd)
        or min(strides + dil) < 1
        or (min(pads) < 0)
    ):
        _fail(node, f"strides {strides}, dilations {dil}, pads {pads}; expected {nd}, {nd} and "
                    f"{2 * nd} values (>= 1, >= 1, >= 0)", ModelFormatError)  # fmt: skip
    return kernel, strides, dil, pads


def _out_len(n, k, s, d, p0, p1) -> int:
    return (n + p0 + p1 - d * (k - 1) - 1) // s + 1


# Bytes of window patches made at once: the convolution runs over blocks of output positions
# (an im2col of the whole output was thousands of times the output's checked bytes for a
# long kernel: 1.6 GB for a 400 KB output), and padding is never materialized (a MaxPool of a
# [1, 1, 4] input with pads of 10**9 padded a 7.45 GiB copy).
PATCH_BYTES = 16 << 20


def _patches(x, kernel, strides, dil, pads, out, n0, n1, a, b, fill):
    """The windows of samples n0:n1 at flat output positions a:b (C order over ``out``):
    [n1 - n0, C, b - a, *kernel], padding read as ``fill``. Indices are made per window
    element (a few per output position), so pads of any size cost nothing."""
    nd = len(kernel)
    pos = np.unravel_index(np.arange(a, b), out)
    idx, valid = [], None
    for i in range(nd):
        shape = [b - a] + [kernel[j] if j == i else 1 for j in range(nd)]
        j = np.arange(kernel[i]).reshape(shape[1:])
        at = pos[i].reshape([b - a] + [1] * nd) * strides[i] + j * dil[i] - pads[i]
        ok = (at >= 0) & (at < x.shape[2 + i])
        valid = ok if valid is None else valid & ok
        idx.append(np.clip(at, 0, x.shape[2 + i] - 1))
    w = x[(slice(n0, n1), slice(None), *idx)]  # [n, C, B, *kernel]
    if not valid.all():
        np.copyto(w, x.dtype.type(fill), where=~valid)
    return w


def _position_bytes(C: int, kernel: list[int], dt: np.dtype) -> int:
    """What one output position of one sample costs _patches: its window values, the validity
    mask and the int64 index rows (counted even with no channels, whose windows are empty)."""
    K = math.prod(kernel)
    return K * (max(C, 1) * dt.itemsize + 1) + 8 * sum(kernel)


def _block_size(N: int, P: int, per_position: int) -> tuple[int, int]:
    """(samples, positions) of _blocks' blocks."""
    nb = max(1, min(N, PATCH_BYTES // max(1, per_position * P)))
    return nb, max(1, min(P, PATCH_BYTES // max(1, per_position * nb)))


def _blocks(N: int, P: int, per_position: int):
    """(n0, n1, a, b) blocks of samples x output positions whose patches take at most
    PATCH_BYTES (one position of one sample at least)."""
    nb, pb = _block_size(N, P, per_position)
    for n0 in range(0, N, nb):
        for a in range(0, P, pb):
            yield n0, min(N, n0 + nb), a, min(P, a + pb)


def _conv_infer(ctx, node, ins, vals):
    _nin(node, ins, 2, 3)
    x, w = ins[0], ins[1]
    if x.dtype.kind != "f" or w.dtype != x.dtype:
        _fail(node, f"input {x.dtype} and weight {w.dtype}; expected one float dtype", DTypeError)
    kernel, strides, dil, pads = _window(node, ins, vals, pool=False)
    N, C = x.shape[:2]
    M, group = w.shape[0], attr_int(node, "group", 1)
    if group < 1 or C % group or M % group or w.shape[1] != C // group:
        _fail(node, f"weight {list(w.shape)} with group={group} for {C} input channels; "
                    f"expected [M, C/group, ...] with C and M divisible by group")  # fmt: skip
    if min(kernel) < 1:
        _fail(node, f"weight {list(w.shape)} has an empty kernel")
    b = ins[2] if len(ins) > 2 else None
    if b is not None and (b.shape != (M,) or b.dtype != x.dtype):
        _fail(node, f"bias is {b.dtype}{list(b.shape)}; expected {x.dtype}[{M}]")
    nd = len(kernel)
    out = [_out_len(x.shape[2 + i], kernel[i], strides[i], dil[i], pads[i], pads[i + nd])
           for i in range(nd)]  # fmt: skip
    if min(out) < 1:
        _fail(node, f"input {list(x.shape)} is smaller than the kernel {kernel} (dilated)")
    return [Out((N, M, *out), x.dtype)]


def _conv_run(ctx, node, ins, outs, metas, tmp):
    x, w = ins[0], ins[1]
    kernel, strides, dil, pads = _window(node, [Out(x.shape, x.dtype), Out(w.shape, w.dtype)],
                                         None, pool=False)  # fmt: skip
    group = attr_int(node, "group", 1)
    N, C, M = x.shape[0], x.shape[1], w.shape[0]
    cg, mg = C // group, M // group
    out = outs[0].shape[2:]
    if not outs[0].size:  # (no output: no windows to gather, however long the input)
        return outs
    P, K = math.prod(out), math.prod(kernel)
    o = outs[0].reshape(N, M, P)
    wg = [w[g * mg : (g + 1) * mg].reshape(mg, cg * K).T for g in range(group)]
    for n0, n1, a, b in _blocks(N, P, _position_bytes(C, kernel, x.dtype)):
        patch = _patches(x, kernel, strides, dil, pads, out, n0, n1, a, b, 0)
        for g in range(group):
            # [n, B, cg * K] @ [cg * K, mg]: one GEMM per group over the block's positions
            cols = np.moveaxis(patch[:, g * cg : (g + 1) * cg], 1, 2).reshape(n1 - n0, b - a, -1)
            o[n0:n1, g * mg : (g + 1) * mg, a:b] = np.moveaxis(cols @ wg[g], -1, 1)
    if len(ins) > 2 and ins[2] is not None:
        o += ins[2].reshape(1, M, 1)
    return outs


def _window_transient(ctx, node, ins, metas):
    """Bytes a Conv or MaxPool run allocates at once beyond its output: one block's window
    patches (with their indices), and for Conv one group's columns copied for the GEMM and
    its product. A Conv1d front-end over N=8, T=2000 took 26.5 MiB outside a plan that said
    16 MiB in all."""
    x = ins[0]
    if not metas[0].nbytes:
        return 0
    conv = node.op == "Conv"
    kernel = _window(node, ins[:2] if conv else ins[:1], None, pool=not conv)[0]
    N, C = x.shape[:2]
    P, K = math.prod(metas[0].shape[2:]), math.prod(kernel)
    per = _position_bytes(C, kernel, x.dtype)
    nb, pb = _block_size(N, P, per)
    total = per * nb * pb
    if conv:
        group = attr_int(node, "group", 1)
        M = ins[1].shape[0]
        total += nb * pb * (C // group * K + M // group) * x.dtype.itemsize
    return total


def _maxpool_infer(ctx, node, ins, vals):
    _nin(node, ins, 1, 1)
    x = ins[0]
    _numeric_tensor(node, x)
    if len([o for o in node.outputs if o]) > 1:
        _fail(node, "asks for the Indices output; expected Y only", ModelFormatError)
    if attr_int(node, "storage_order", 0):
        _fail(node, "storage_order=1; expected 0", ModelFormatError)
    kernel, strides, dil, pads = _window(node, ins, vals, pool=True)
    nd = len(kernel)
    if any(max(pads[i], pads[i + nd]) >= kernel[i] for i in range(nd)):
        _fail(node, f"pads {pads} reach a whole kernel {kernel} (a window of padding only)")
    if any(kernel[i] > 2 * x.shape[2 + i] + 1 for i in range(nd)):
        # (mostly padding: a window's work is its kernel, which no data bounds otherwise)
        _fail(node, f"kernel {kernel} is over twice the input's {list(x.shape[2:])}; expected "
                    "windows within the input and its padding")  # fmt: skip
    out = []
    for i in range(nd):
        # onnxruntime's length: (L + pads - span) / stride + 1 with C's division (toward
        # zero), so a short input gives 1 or 0 windows, and a negative length is refused
        num = x.shape[2 + i] + pads[i] + pads[i + nd] - (dil[i] * (kernel[i] - 1) + 1)
        n = (num // strides[i] if num >= 0 else -((-num) // strides[i])) + 1
        if n < 0:
            _fail(node, f"input {list(x.shape)} is shorter than the kernel {kernel} by more than "
                        "a stride")  # fmt: skip
        out.append(n)
    return [Out((*x.shape[:2], *out), x.dtype)]


def _maxpool_run(ctx, node, ins, outs, metas, tmp):
    # a NaN in a window makes its maximum NaN, as torch's max_pool does (onnxruntime skips
    # NaN): a model exported from torch computes what it computed there
    x = ins[0]
    kernel, strides, dil, pads = _window(node, [Out(x.shape, x.dtype)], None, pool=True)
    fill = -np.inf if x.dtype.kind == "f" else np.iinfo(x.dtype).min
    N, C = x.shape[:2]
    out = outs[0].shape[2:]
    if not outs[0].size:  # (no output: no windows to gather, however long the input)
        return outs
    P, K = math.prod(out), math.prod(kernel)
    o = outs[0].reshape(N, C, P)
    for n0, n1, a, b in _blocks(N, P, _position_bytes(C, kernel, x.dtype)):
        win = _patches(x, kernel, strides, dil, pads, out, n0, n1, a, b, fill)
        np.max(win.reshape(n1 - n0, C, b - a, K), axis=-1, out=o[n0:n1, :, a:b])
    return outs


def layer_ops(OpDef) -> dict:
    """The ops of this module as ``OpDef``s for ``ops.OPS`` (passed in: ops imports us)."""
    return {
        **{k: OpDef(_compare_infer, _compare_run) for k in (*_COMPARE, *_LOGIC)},
        "Not": OpDef(_not_infer, _not_run),
        "Where": OpDef(_where_infer, _where_run),
        "Clip": OpDef(_clip_infer, _clip_run),
        "LeakyRelu": OpDef(_float_unary_infer, _leaky_relu_run),
        "Pow": OpDef(_pow_infer, _pow_run),
        "Erf": OpDef(_float_unary_infer, _erf_run),
        "Gelu": OpDef(_float_unary_infer, _gelu_run),
        "ArgMax": OpDef(_arg_infer, _arg_run),
        "ArgMin": OpDef(_arg_infer, _arg_run),
        "GatherElements": OpDef(_gather_elements_infer, _gather_elements_run),
        "GatherND": OpDef(_gather_nd_infer, _gather_nd_run),
        "Tile": OpDef(_tile_infer, _tile_run),
        "Einsum": OpDef(_einsum_infer, _einsum_run),
        "LayerNormalization": OpDef(_layer_norm_infer, _layer_norm_run),
        "BatchNormalization": OpDef(_batch_norm_infer, _batch_norm_run),
        "Conv": OpDef(_conv_infer, _conv_run, transient=_window_transient),
        "MaxPool": OpDef(_maxpool_infer, _maxpool_run, transient=_window_transient),
    }
