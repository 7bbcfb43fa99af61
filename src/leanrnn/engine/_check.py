"""Input validation for the engine: precise errors naming what came in and what was expected."""

from __future__ import annotations

import numpy as np

from ..errors import DTypeError, LayoutError, LengthsError, ShapeError


def fmt_shape(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def array(
    op: str, name: str, a, dtype: np.dtype, want: tuple, names: tuple[str, ...]
) -> np.ndarray:
    """Check an input array: ndarray, ``dtype``, shape ``want`` (None = any), C-contiguous."""
    if not isinstance(a, np.ndarray):
        raise DTypeError(
            f"[{op}] {name} is a {type(a).__name__}; expected a numpy.ndarray of {dtype} "
            f"with shape {fmt_shape(names)}"
        )
    if a.dtype != dtype:
        hint = f"; convert with {name}.astype(np.{dtype.name})" if a.dtype.kind in "fiu" else ""
        raise DTypeError(
            f"[{op}] {name} has dtype {a.dtype}; expected {dtype} (the model's dtype; leanrnn "
            f"never converts silently){hint}"
        )
    if a.ndim != len(want) or not _shape_ok(a.shape, want):
        spec = fmt_shape(
            [f"{n}={w}" if w is not None else n for n, w in zip(names, want, strict=True)]
        )
        raise ShapeError(f"[{op}] {name} has shape {tuple(a.shape)}; expected {spec}")
    return a


def _shape_ok(shape: tuple, want: tuple) -> bool:
    # A plain loop: this runs on every call of a streaming step, where a generator costs µs.
    for s, w in zip(shape, want, strict=True):
        if w is not None and s != w:
            return False
    return True


def contiguous(op: str, name: str, a: np.ndarray) -> None:
    if not a.flags.c_contiguous:
        raise LayoutError(
            f"[{op}] {name} is not C-contiguous (strides {a.strides}); pass "
            f"np.ascontiguousarray({name})"
        )


def writable(op: str, name: str, a: np.ndarray) -> None:
    contiguous(op, name, a)
    if not a.flags.writeable:
        raise LayoutError(f"[{op}] {name} is read-only; expected a writable output array")


def lengths(op: str, lengths, N: int, T: int) -> np.ndarray:
    arr = lengths if isinstance(lengths, np.ndarray) else np.asarray(lengths)
    if arr.dtype.kind not in "iu":
        raise LengthsError(f"[{op}] lengths has dtype {arr.dtype}; expected an integer array")
    if arr.shape != (N,):
        raise LengthsError(f"[{op}] lengths has shape {tuple(arr.shape)}; expected [N={N}]")
    if N and (arr.min() < 0 or arr.max() > T):
        bad = [int(v) for v in arr if v < 0 or v > T][:5]
        raise LengthsError(f"[{op}] lengths {bad} out of range; expected 0 <= length <= T={T}")
    return arr
