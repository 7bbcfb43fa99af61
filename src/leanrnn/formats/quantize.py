"""Reduced-precision packed weights: float32 panels -> bfloat16 or int8 panels, and back.

Only the W and R panels change (they are the bytes each step streams); biases, peepholes and
the LSTM projection stay float32, and so do activations, states and every sum (the kernels
widen each weight vector to float32 right after its load, kernels._qsimd).

- ``bf16``: each weight rounded to the nearest bfloat16, ties to even (the top 16 bits of a
  float32, stored as uint16), laid out in input pairs: panel row k2 holds, for each column j,
  its weights of inputs 2*k2 and 2*k2 + 1 side by side in one 32-bit lane ([U, X/2, 2*Wd]).
  That is AMX's layout for a bf16 B tile (kernels._bf16amx loads panel rows as they are), and
  the float32 tile widens both inputs' 16 columns from one 64-byte load with a shift and a
  mask. Relative error <= 2**-8. Files and pickles made before 2026-12-01 18:32 UTC hold
  one of two earlier layouts and are refused (formats.packing.unmarked_bf16).
- ``bf16-act``: bf16's panels, and the activations rounded to bfloat16 too before every
  product, as torch's autocast and oneDNN do: on AMX (panel GEMMs of 4 rows or more) one tile
  product where bf16 does two; on every other path and CPU the rows rounded for the float32
  tile (kernels.gemm.round_rows), so the results do not depend on which path ran.
- ``int8``: symmetric, one scale per packed column — per output unit and gate, separately for
  W and R: s_j = max_k |w_kj| / 127, q_kj = round(w_kj / s_j) in [-127, 127]. Absolute error
  <= s_j / 2 per weight. The scales are stored in the panel's last SCALE_ROWS rows.
- ``int8-dynamic``: what torch's and onnxruntime's dynamic quantization do — int8 weights and
  activations quantized per row as the kernels run (kernels._qdot), summed exactly in int32
  (up to dot_exact_inputs(qmax) inputs per product, 132104 with 8-bit codes: a wider layer is
  refused, its sums would wrap around).
  Weights symmetric per packed column in 8 bits, s_j = max_k |w_kj| / 127 (codes -127..127;
  -128 unused, see kernels._qdot's AVX2 path), error <= s_j / 2 per weight; laid out 4
  inputs per row (dot_panel) with two tail rows: the column scales and 128 * sum_k q_kj.
  ``reduce_range`` (onnxruntime's name and meaning) makes the codes 7-bit, s_j = max|w| / 63:
  twice the weight error, for CPUs without VNNI, whose AVX2 tile multiplies such panels with
  three instructions per 32 products instead of four (kernels._qdot). Such a panel says so in
  bit 0 of its corrections (abi.DOT_NARROW), set from the codes by dot_panel and again by
  check_loaded for every panel read from a file and by set_narrow_flags for every pickle or
  copy (so neither can claim it falsely, and files written with 7-bit codes before 2026-12-01,
  when those were the only codes, get it too).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import DTypeError, ModelFormatError, WeightsError
from ..kernels.abi import CODE_OFFSET, DOT_NARROW, DOT_NARROW_QMAX, DOT_QMAX, DOT_TAIL_ROWS
from ..spec import RNNSpec
from .packing import (
    _PANELS,
    SCALE_ROWS,
    LayerWeights,
    PackedLayer,
    PackedWeights,
    check_precision,
    pack,
    panel_format,
    rows_to_panels,
)

QMAX = 127  # symmetric int8: -128 is never used, so -q is always representable


def bf16_round(a: np.ndarray) -> np.ndarray:
    """float32 -> the uint16 bits of the nearest bfloat16 (ties to even; NaN stays NaN, a
    value past bfloat16's largest rounds to inf, as IEEE rounding does)."""
    bits = np.ascontiguousarray(a, np.float32).view(np.uint32)
    rounded = (bits + np.uint32(0x7FFF) + ((bits >> 16) & 1)) >> 16
    nan = np.isnan(a)
    if nan.any():  # the rounding carry could turn a NaN's payload into inf: keep it quiet NaN
        rounded = np.where(nan, (bits >> 16) | 0x0040, rounded)
    return rounded.astype(np.uint16)


def bf16_value(bits: np.ndarray) -> np.ndarray:
    """uint16 bfloat16 bits -> float32 (exact)."""
    return (np.asarray(bits, np.uint16).astype(np.uint32) << 16).view(np.float32)


def _paired(bits: np.ndarray) -> np.ndarray:
    """[..., X, Wd] (X even) -> [..., X/2, 2*Wd]: row k2 holds (row 2*k2, row 2*k2 + 1) of each
    column side by side (a copy)."""
    *lead, X, Wd = bits.shape
    pairs = bits.reshape(*lead, X // 2, 2, Wd).swapaxes(-1, -2)
    return np.ascontiguousarray(pairs).reshape(*lead, X // 2, 2 * Wd)


def _unpaired(panel: np.ndarray) -> np.ndarray:
    """_paired's inverse: [..., X/2, 2*Wd] -> [..., X, Wd]."""
    *lead, X2, W2 = panel.shape
    rows = panel.reshape(*lead, X2, W2 // 2, 2).swapaxes(-1, -2)
    return np.ascontiguousarray(rows).reshape(*lead, 2 * X2, W2 // 2)


def bf16_panel(w: np.ndarray) -> np.ndarray:
    """A float32 panel [..., X, Wd] (X even) -> its bf16 panel [..., X/2, 2*Wd] (rounded, in
    input pairs)."""
    return _paired(bf16_round(w))


def int8_columns(w: np.ndarray, qmax: int = QMAX) -> tuple[np.ndarray, np.ndarray]:
    """Symmetric per-column int8 of ``w`` [..., X, Wd] (columns: the last axis, max over X),
    codes in [-qmax, qmax]: (q int8 [..., X, Wd], scale float32 [..., Wd]); q * scale
    approximates w within scale/2. An all-zero column gets scale 0."""
    w64 = np.asarray(w, np.float64)
    if not np.isfinite(w64).all():
        raise WeightsError("[quantize] int8 weights must be finite; the model holds NaN or inf "
                           "weights (bf16 keeps NaN ones but refuses infinite ones as well: "
                           "fix the weights first)")  # fmt: skip
    scale = (np.abs(w64).max(axis=-2) / qmax).astype(np.float32)
    s = scale.astype(np.float64)[..., None, :]
    q = np.rint(np.divide(w64, s, out=np.zeros_like(w64), where=s > 0))
    return np.clip(q, -qmax, qmax).astype(np.int8), scale


def dot_panel(w: np.ndarray, qmax: int = DOT_QMAX) -> np.ndarray:
    """A float32 panel [U, X, Wd] (X a multiple of 4) -> its int8-dynamic panel, uint8
    [U, X/4 + DOT_TAIL_ROWS, 4*Wd], codes in [-qmax, qmax] (DOT_QMAX or DOT_NARROW_QMAX): row
    k4 holds each column's 4 codes of inputs 4*k4..+3, then a row of the Wd float32 column
    scales and one of the Wd int32 corrections CODE_OFFSET * sum_k q_kj (kernels._qdot), with
    DOT_NARROW set in a panel whose codes all lie within +-DOT_NARROW_QMAX."""
    q, scale = int8_columns(w, qmax)
    U, X, Wd = q.shape
    out = np.empty((U, X // 4 + DOT_TAIL_ROWS, 4 * Wd), np.uint8)
    out[:, : X // 4] = (
        q.reshape(U, X // 4, 4, Wd).transpose(0, 1, 3, 2).reshape(U, X // 4, 4 * Wd).view(np.uint8)
    )
    out[:, X // 4] = scale.view(np.uint8).reshape(U, 4 * Wd)
    out[:, X // 4 + 1] = _dot_corrections(q).view(np.uint8).reshape(U, 4 * Wd)
    _flag(out, *_code_range(out))
    return out


def _dot_corrections(q: np.ndarray) -> np.ndarray:
    """int32 [U, Wd] corrections of codes q [U, X, Wd] (DOT_NARROW clear: _flag sets it)."""
    return (CODE_OFFSET * q.astype(np.int32).sum(axis=1)).astype(np.int32)


def weight_bits(pw: PackedWeights) -> int:
    """Bits per weight of ``pw``'s W and R panels: the dtype's for float, 16 for bf16 and
    bf16-act, 8 for int8, and for int8-dynamic 7 where every panel holds 7-bit codes (made with
    ``reduce_range``, or a file from before 8-bit codes), else 8 (what ``inspect`` shows)."""
    fmt = panel_format(pw.precision)
    if fmt == "float":
        return 8 * np.dtype(pw.dtype).itemsize
    if fmt != "int8-dynamic":
        return 16 if fmt == "bf16" else 8
    flags = [np.asarray(panel[:, -1, :4]).view(np.int32) & DOT_NARROW
             for dirs in pw.layers for pl in dirs for panel in (pl.Wt, pl.Rt)]  # fmt: skip
    return 7 if all(f.all() for f in flags) else 8


def set_narrow_flags(pw: PackedWeights) -> None:
    """Set every int8-dynamic panel's DOT_NARROW flags from its codes, in place (what
    check_loaded does for a file; pickles and copies, formats.packing, call this)."""
    for dirs in pw.layers:
        for pl in dirs:
            for panel in (pl.Wt, pl.Rt):
                _flag(panel, *_code_range(panel))


def _code_range(panel: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """An int8-dynamic panel's smallest and largest code per panel u, int16 [U] each (read in
    place: int8 reductions do not widen the panel)."""
    codes = panel[:, :-DOT_TAIL_ROWS].view(np.int8)
    return (codes.min(axis=(1, 2), initial=0).astype(np.int16),
            codes.max(axis=(1, 2), initial=0).astype(np.int16))  # fmt: skip


def _flag(panel: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> None:
    """Set the DOT_NARROW bit of panel u's corrections iff its codes lo[u]..hi[u] fit 7 bits."""
    corr = panel[:, -1].view(np.int32)  # [U, Wd], in place
    corr[...] = (corr & ~DOT_NARROW) | _narrow(np.maximum(-lo, hi))[:, None]


def _narrow(amax: np.ndarray) -> np.ndarray:
    """Panels' largest |code| [U] -> the flag each one's corrections carry, int32 [U]."""
    return np.where(amax <= DOT_NARROW_QMAX, DOT_NARROW, 0).astype(np.int32)


def dot_codes(panel: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """An int8-dynamic panel's (codes int8 [U, X, Wd], scales float32 [U, Wd], corrections
    int32 [U, Wd]), the inverse of dot_panel's layout."""
    U, R, W4 = panel.shape
    X4, Wd = R - DOT_TAIL_ROWS, W4 // 4
    q = (
        panel[:, :X4]
        .view(np.int8)
        .reshape(U, X4, Wd, 4)
        .transpose(0, 1, 3, 2)
        .reshape(U, 4 * X4, Wd)
    )
    scale = np.ascontiguousarray(panel[:, X4]).view(np.float32).reshape(U, Wd)
    corr = np.ascontiguousarray(panel[:, X4 + 1]).view(np.int32).reshape(U, Wd)
    return q, scale, corr


def panel_scales(panel: np.ndarray) -> np.ndarray:
    """The float32 column scales [U, Wd] an int8 panel [U, X + SCALE_ROWS, Wd] carries (a view)."""
    U, X, Wd = panel.shape
    return panel[:, X - SCALE_ROWS :, :].reshape(U, SCALE_ROWS * Wd).view(np.float32)


def _set_int8(panel: np.ndarray, q: np.ndarray, scale: np.ndarray) -> None:
    """Fill an int8 panel [U, X + SCALE_ROWS, Wd] with weights q [U, X, Wd], scales [U, Wd]."""
    U, X, Wd = q.shape
    panel[:, :X] = q
    panel[:, X:] = np.ascontiguousarray(scale, np.float32).view(np.int8).reshape(U, SCALE_ROWS, Wd)


def dequantize_panel(panel: np.ndarray, precision: str, dtype=np.float32) -> np.ndarray:
    """A reduced panel as ``dtype`` numbers [U, X, Wd] (the scale rows dropped): exactly the
    weights the kernels multiply by (up to the int8 scale, applied after the sum there)."""
    precision = panel_format(precision)
    if precision == "bf16":
        return bf16_value(_unpaired(panel)).astype(dtype)
    if precision == "int8":
        q = panel[:, : panel.shape[1] - SCALE_ROWS]
        return (q.astype(np.float64) * panel_scales(panel)[:, None, :]).astype(dtype)
    if precision == "int8-dynamic":
        q, scale, _ = dot_codes(panel)
        return (q.astype(np.float64) * scale[:, None, :]).astype(dtype)
    raise DTypeError(f"[dequantize] precision {precision!r}; expected 'bf16', 'int8' or "
                     "'int8-dynamic'")  # fmt: skip


def _copy_rest(src: PackedWeights, dst: PackedWeights) -> None:
    """Every packed tensor but the W and R panels, as is (biases, peepholes, projection)."""
    for ls, ld in zip(src.layers, dst.layers, strict=True):
        for ps, pd in zip(ls, ld, strict=True):
            for name in PackedLayer.__dataclass_fields__:
                if name not in _PANELS:
                    getattr(pd, name)[...] = getattr(ps, name)


# The smallest float32 magnitude that rounds to infinity in bfloat16 (bf16_round): past the
# largest bfloat16, 0x7F7F, by half its last place.
BF16_OVERFLOW = float(np.array(0x7F7F8000, np.uint32).view(np.float32))


def _check_bf16_range(w: np.ndarray, op: str) -> None:
    """Refuse weights that are or would round to infinity in bfloat16 (|w| >= 3.3961e38): an
    inf weight times a zero activation term is NaN, and bf16 splits each activation in two
    terms (hi, lo) whose lo is 0 wherever the activation is a bfloat16 already, on the CPUs
    that multiply bf16 (AVX512-BF16, AMX) and not on the others: an inf weight gave NaN there
    and tanh(inf) = 1 elsewhere and in float32. Two reductions, no temporaries
    (mixed-precision training checks its master weights after every update); fmax/fmin pass
    over NaN, which is NaN on every path."""
    hi, lo = float(np.fmax.reduce(w, axis=None)), float(np.fmin.reduce(w, axis=None))
    big = max(hi, -lo, 0.0)
    if big >= BF16_OVERFLOW:
        what = "infinite weights are" if np.isinf(big) else f"weights as large as {big:.4g} are"
        raise WeightsError(f"[{op}] {what} past bfloat16's range (< {BF16_OVERFLOW:.5g}): "
                           "times the zero terms bf16 splits activations into, an "
                           "infinity is NaN")  # fmt: skip


def dot_exact_inputs(qmax: int = DOT_QMAX) -> int:
    """The most inputs an int8-dynamic product sums exactly in int32: per input the activation
    code less its offset, at most 128 in size, times a weight code of at most ``qmax``."""
    return (2**31 - 1) // (CODE_OFFSET * qmax)


def _check_dot_inputs(spec: RNNSpec, qmax: int, op: str) -> None:
    """Refuse int8-dynamic weights for a layer wider than its int32 sums hold exactly."""
    most = dot_exact_inputs(qmax)
    wider = "" if qmax != DOT_QMAX else (
        f"; {dot_exact_inputs(DOT_NARROW_QMAX)} with reduce_range=True")  # fmt: skip
    for layer in range(spec.num_layers):
        for what, k in (("inputs", spec.layer_input_size(layer)), ("outputs", spec.output_size)):
            if k > most:
                raise DTypeError(
                    f"[{op}] layer {layer} has {k} {what}; int8-dynamic sums its products of "
                    f"{qmax}-bounded weight codes in int32, exactly up to {most} per product"
                    f"{wider}: past that the sums wrap around. Use int8 or bf16 for this model"
                )


def quantize_packed(pw: PackedWeights, precision: str, out: PackedWeights | None = None,
                    reduce_range: bool = False, op: str = "quantize") -> PackedWeights:  # fmt: skip
    """``pw`` (float32 weights) with its W and R panels in ``precision`` (formats.packing
    PRECISIONS; ``pw``'s own precision, a copy of it). New buffer, one per model, ~1/2 or ~1/4 of the
    panels' bytes; ``pw`` is not changed. Quantizing reduced weights again is refused (it would
    round twice): quantize the float32 model; between precisions of the same panels ("bf16",
    "bf16-act") the panels are copied as they are. ``out``: weights of this spec and precision
    made so before, refilled in place (mixed-precision training rounds its master weights
    again after every optimizer step, train.session). ``reduce_range``: int8-dynamic's codes
    7-bit (DOT_NARROW_QMAX; see the module docstring)."""
    check_precision(precision, pw.dtype, "quantize")
    if precision == "int8-dynamic":
        _check_dot_inputs(pw.spec, DOT_NARROW_QMAX if reduce_range else DOT_QMAX, "quantize")
    if reduce_range and precision != "int8-dynamic":
        raise DTypeError(f"[quantize] reduce_range (7-bit weight codes) is int8-dynamic's; "
                         f"{precision!r} multiplies no integer codes")  # fmt: skip
    if precision == pw.precision and reduce_range and weight_bits(pw) != 7:
        raise DTypeError("[quantize] the weights are int8-dynamic with 8-bit codes "
                         "already; rounding them again to 7 bits would round twice: "
                         "quantize the float32 model with reduce_range=True")  # fmt: skip
    # The same panels (its own precision, or bf16 <-> bf16-act): their bytes copied, never
    # pw itself (a model on the same buffer changed with it)
    same = precision == pw.precision or (
        pw.precision != "float" and panel_format(pw.precision) == panel_format(precision))  # fmt: skip
    if pw.precision != "float" and not same:
        raise DTypeError(f"[quantize] the weights are {pw.precision} already; expected float32 "
                         f"weights: quantize the float32 model to {precision!r}")  # fmt: skip
    if out is None:
        out = PackedWeights(pw.spec, pw.dtype, zero=not same, precision=precision)
    elif out.spec != pw.spec or out.precision != precision:
        raise DTypeError(f"[quantize] out holds {out.precision} weights of {out.spec}; expected "
                         f"{precision} weights of {pw.spec}")  # fmt: skip
    if same:
        out.buffer[:] = pw.buffer
        return out
    _copy_rest(pw, out)
    for ls, ld in zip(pw.layers, out.layers, strict=True):
        for ps, pd in zip(ls, ld, strict=True):
            for name in _PANELS:
                src, dst = getattr(ps, name), getattr(pd, name)
                if panel_format(precision) == "bf16":
                    _check_bf16_range(src, op)
                    dst[...] = bf16_panel(src)
                elif precision == "int8-dynamic":
                    dst[...] = dot_panel(src, DOT_NARROW_QMAX if reduce_range else DOT_QMAX)
                else:
                    _set_int8(dst, *int8_columns(src))
    return out


@dataclass
class Int8LayerWeights:
    """Already-quantized weights of one (layer, direction), internal gate order, unpadded:
    ``Wq`` int8 [G, C] and ``Rq`` int8 [G, K] with one float32 scale per row (per output unit
    and gate: ``W_scale``/``R_scale`` [G]; a per-tensor scale is the same value G times), so
    that W ~= Wq * W_scale[:, None]. Biases, peepholes and projection are float32, as in
    ``LayerWeights``."""

    Wq: np.ndarray
    W_scale: np.ndarray
    Rq: np.ndarray
    R_scale: np.ndarray
    bW: np.ndarray
    bR: np.ndarray
    peep: np.ndarray | None = None
    proj: np.ndarray | None = None


def pack_int8(spec: RNNSpec, layers: list[list[Int8LayerWeights]]) -> PackedWeights:
    """Pack weights that are int8 already (e.g. read from an ONNX ``DynamicQuantizeLSTM``) into
    int8 panels as they are, without rounding them again. Symmetric only: an importer with
    zero points must fold them first (or dequantize and call ``quantize_packed``)."""
    zero = [[LayerWeights(np.zeros((spec.gate_width, spec.layer_input_size(li)), np.float32),
                          np.zeros((spec.gate_width, spec.output_size), np.float32),
                          lw.bW, lw.bR, lw.peep, lw.proj) for lw in dirs]
            for li, dirs in enumerate(layers)]  # fmt: skip
    base = pack(spec, zero, np.float32)  # checks shapes and counts, packs biases etc.
    out = PackedWeights(spec, np.float32, precision="int8")
    _copy_rest(base, out)
    for li, dirs in enumerate(layers):
        for di, lw in enumerate(dirs):
            pl = out.layers[li][di]
            for name, q, s in (("Wt", lw.Wq, lw.W_scale), ("Rt", lw.Rq, lw.R_scale)):
                q, s = np.asarray(q), np.asarray(s, np.float32)
                tag = f"[pack_int8] layer {li} direction {di} {name[0]}"
                if q.dtype != np.int8 or s.shape != (q.shape[0],):
                    raise WeightsError(f"{tag}: got {q.dtype}{list(q.shape)} with scales "
                                       f"{list(s.shape)}; expected int8 [G, X] and [G] float32 "
                                       "scales")  # fmt: skip
                if not (np.isfinite(s).all() and (s >= 0).all()):
                    raise WeightsError(f"{tag}: scales must be finite and >= 0")
                U, X, Wd = pl.Wt.shape if name == "Wt" else pl.Rt.shape
                qp = np.zeros((U, X - SCALE_ROWS, Wd), np.int8)
                rows_to_panels(q, out.perm, qp)
                sp = np.where(out.perm >= 0, s[np.maximum(out.perm, 0)], 0).astype(np.float32)
                _set_int8(getattr(pl, name), qp, sp.reshape(U, Wd))
    return out


def _bf16_padding_zero(panel: np.ndarray, K: int) -> bool:
    """Whether a bf16 panel [U, X/2, 2*Wd] holds zeros (either sign) past its K inputs: AMX
    multiplies whole pairs and 32-input tiles (kernels._bf16amx), the padding by zero
    activations, so an inf there would make NaN."""
    if (panel[:, (K + 1) // 2 :] & 0x7FFF).any():
        return False
    return not (K % 2 and (panel[:, K // 2, 1::2] & 0x7FFF).any())


def check_loaded(pw: PackedWeights, op: str, path: str) -> None:
    """After reading reduced weights from a file: every int8 scale finite and >= 0 (one pass
    over U*Wd floats per panel), so a corrupt scale is an error, not a model of NaNs; for
    int8-dynamic also the codes within +-DOT_QMAX, zero past the panel's K inputs (the padding
    of its last group of 4 is multiplied by scratch bytes no one writes) and the corrections
    equal to what the codes give (one pass over the codes: a wrong correction would shift
    every output silently), their DOT_NARROW flags set from the codes; for bf16 the padding
    past K inputs zero (_bf16_padding_zero)."""
    fmt = panel_format(pw.precision)
    if fmt not in ("bf16", "int8", "int8-dynamic"):
        return
    if fmt == "int8-dynamic":
        _check_loaded_dot_inputs(pw, op, path)
    for li, dirs in enumerate(pw.layers):
        for di, pl in enumerate(dirs):
            for name in _PANELS:
                tag = f"[{op}] {path!r}: layer {li} direction {di} {name}"
                panel = getattr(pl, name)
                K = pw.spec.layer_input_size(li) if name == "Wt" else pw.spec.output_size
                if fmt == "bf16":
                    if not _bf16_padding_zero(panel, K):
                        raise ModelFormatError(f"{tag} has bf16 weights past its {K} inputs; "
                                               "the file is corrupt")  # fmt: skip
                    continue
                if fmt == "int8":
                    s = panel_scales(panel)
                else:
                    s = np.ascontiguousarray(panel[:, -DOT_TAIL_ROWS]).view(np.float32)
                    if not _dot_panel_consistent(panel, K):
                        raise ModelFormatError(f"{tag} has int8-dynamic codes beyond +-{DOT_QMAX}, "
                                               f"codes past its {K} inputs, or corrections that "
                                               "do not match them; the file is corrupt")  # fmt: skip
                if not (np.isfinite(s).all() and (s >= 0).all()):
                    raise ModelFormatError(f"{tag} has int8 scales that are negative or not "
                                           "finite; the file is corrupt")  # fmt: skip


def _check_loaded_dot_inputs(pw: PackedWeights, op: str, path: str) -> None:
    """A file's int8-dynamic panels no wider than their codes' int32 sums hold exactly (what
    quantize refuses to make; another writer may not): a panel past the 8-bit bound passes
    only with codes small enough for its width (7-bit ones, to twice the width)."""
    for li, dirs in enumerate(pw.layers):
        for di, pl in enumerate(dirs):
            for name in _PANELS:
                panel = getattr(pl, name)
                K = pw.spec.layer_input_size(li) if name == "Wt" else pw.spec.output_size
                if K <= dot_exact_inputs(DOT_QMAX):
                    continue
                lo, hi = _code_range(panel)
                qmax = max(1, int(max(-int(lo.min()), int(hi.max()))))
                if K > dot_exact_inputs(qmax):
                    raise ModelFormatError(
                        f"[{op}] {path!r}: layer {li} direction {di} {name} sums {K} products "
                        f"of codes up to {qmax} in int32, exact only up to "
                        f"{dot_exact_inputs(qmax)} of them: its sums would wrap around"
                    )


def _dot_panel_consistent(panel: np.ndarray, K: int) -> bool:
    """Whether an int8-dynamic panel [U, X/4 + DOT_TAIL_ROWS, 4*Wd] holds codes within
    +-DOT_QMAX, zeros for inputs K.. (the padding) and the corrections its codes give, reading
    the codes in place (reductions widen as they go): widening the whole panel to int16 and
    int32 first (dot_codes, _dot_corrections) made a load's peak 2.5x the file and its time 3x
    a float32 file's. Then sets each panel's DOT_NARROW flag from its codes, whatever the file
    held there: AVX2 would saturate on a wrong one."""
    U, R, W4 = panel.shape
    X4, Wd = R - DOT_TAIL_ROWS, W4 // 4
    codes = panel[:, :X4].view(np.int8)  # [U, X/4, 4*Wd]: each column's 4 codes side by side
    lo, hi = _code_range(panel)
    if (lo < -DOT_QMAX).any() or (hi > DOT_QMAX).any():
        return False
    by_input = codes.reshape(U, X4, Wd, 4)  # [u, k4, j, m]: input 4*k4 + m of column j
    if K % 4 and K // 4 < X4 and by_input[:, K // 4, :, K % 4 :].any():
        return False
    if by_input[:, -(-K // 4) :].any():
        return False
    sums = codes.sum(axis=1, dtype=np.int32).reshape(U, Wd, 4).sum(axis=2)
    corr = panel[:, X4 + 1].view(np.int32)  # [U, Wd]
    if not np.array_equal(corr & ~DOT_NARROW, CODE_OFFSET * sums):
        return False
    _flag(panel, lo, hi)
    return True
