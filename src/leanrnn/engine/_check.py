"""Input validation for the engine: precise errors naming what came in and what was expected."""

from __future__ import annotations

import math

import numpy as np

from ..errors import DTypeError, LayoutError, LengthsError, ShapeError, SpecError


def fmt_shape(shape) -> str:
    return "[" + ", ".join(str(s) for s in shape) + "]"


def array(
    op: str, name: str, a, dtype: np.dtype, want: tuple, names: tuple[str, ...]
) -> np.ndarray:
    """Check an input array: ndarray, ``dtype``, shape ``want`` (None = any), C-contiguous."""
    if not isinstance(a, np.ndarray):
        tensor = hasattr(a, "detach") and hasattr(a, "numpy")  # torch's, without importing it
        hint = (f" ({name}.numpy(); or leanrnn.torch's modules, which take tensors)" if tensor
                else "")  # fmt: skip
        raise DTypeError(
            f"[{op}] {name} is a {type(a).__name__}; expected a numpy.ndarray of {dtype} "
            f"with shape {fmt_shape(names)}{hint}"
        )
    if type(a) is not np.ndarray:
        unmasked(op, name, a, name == "x")
    if a.dtype != dtype:
        hint = f"; convert with {name}.astype(np.{dtype.name})" if a.dtype.kind in "fiu" else ""
        if name == "h0" and a.dtype.kind in "iu" and a.ndim == 1:  # model(x, lengths)
            hint += "; or, if these are lengths, pass them by name: lengths=..."
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


def unmasked(op: str, name: str, a, sequences: bool = False) -> None:
    """Refuse a numpy masked array: its mask went unread and the masked values ran.
    ``sequences``: ``a`` holds padded sequences (lengths say where they end)."""
    if isinstance(a, np.ma.MaskedArray):
        hint = "pass the sequences' lengths for padded ones, or " if sequences else ""
        raise DTypeError(
            f"[{op}] {name} is a numpy masked array; leanrnn reads no mask: {hint or 'pass '}"
            "its .filled(value) for the values as they are"
        )


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


# Work allowed to np.shares_memory once two arrays' byte ranges overlap: enough to tell apart
# interleaved strided views; past it, the arrays are treated as overlapping (bounded time).
OVERLAP_WORK = 10_000


def _owner(a: np.ndarray) -> np.ndarray | None:
    """The array that owns a's memory, or None when numpy cannot tell (a foreign buffer)."""
    while (b := a.base) is not None:
        if not isinstance(b, np.ndarray):
            return None
        a = b
    return a if a.flags.owndata else None


def _overlap(a: np.ndarray, oa, b: np.ndarray, ob) -> bool:
    """Whether a and b (owned by oa, ob: see _owner) share memory. Two numpy allocations never
    do (checked in ~0.1 us, against ~1 us for np.may_share_memory's bounds check); otherwise
    the bounds, then the exact answer, with bounded work."""
    if oa is not ob and oa is not None and ob is not None:
        return False
    if not np.may_share_memory(a, b):
        return False
    try:
        return np.shares_memory(a, b, max_work=OVERLAP_WORK)
    except np.exceptions.TooHardError:
        return True


def _same(a: np.ndarray, b: np.ndarray) -> bool:
    """The very same elements at the very same addresses (strides of length-1 axes aside)."""
    if a is b:
        return True
    if a.shape != b.shape or a.__array_interface__["data"][0] != b.__array_interface__["data"][0]:
        return False
    return all(n < 2 or sa == sb for n, sa, sb in zip(a.shape, a.strides, b.strides, strict=True))


def disjoint(op: str, outs: tuple, ins: tuple, in_place: tuple = ()) -> None:
    """Outputs must share no memory with each other nor with an input: the engine writes an
    output while it still reads the others (a bidirectional layer reads x once per direction,
    h_n written as h0 is read...). ``outs``/``ins``: (name, array or None) pairs; ``in_place``:
    (out, in) name pairs that may be the very same array — h_n/h0, c_n/c0: op k reads its own
    slot of the state before it writes it — but not another view of the same memory.
    Cost: ~0.1-0.5 us per array, and a bounds check only for arrays over one allocation."""
    # Anything else is not an array yet: the checks of shape and dtype refuse it.
    outs = [(n, a, _owner(a)) for n, a in outs if isinstance(a, np.ndarray)]
    ins = [(n, b, _owner(b)) for n, b in ins if isinstance(b, np.ndarray)]
    for i, (na, a, oa) in enumerate(outs):
        for nb, b, ob in outs[i + 1 :]:
            if _overlap(a, oa, b, ob):
                raise LayoutError(
                    f"[{op}] out {na} and out {nb} share memory; expected a separate array for "
                    f"each output (the run writes both); pass distinct arrays, e.g. "
                    f"np.empty_like({nb})"
                )
        for nb, b, ob in ins:
            if not _overlap(a, oa, b, ob):
                continue
            if (na, nb) in in_place:
                if _same(a, b):
                    continue
                allowed = f" ({na} may be {nb} itself, for an in-place update, but no other view)"
            else:
                allowed = ""
            raise LayoutError(
                f"[{op}] out {na} shares memory with {nb}; expected outputs apart from the "
                f"inputs{allowed}: the run still reads {nb} after it starts writing {na}; pass "
                f"a separate array for {na}, e.g. np.empty_like({na})"
            )


def apart(op: str, ins: tuple, updated: tuple, owner: np.ndarray) -> None:
    """Inputs must share no memory with arrays the run updates in place while it reads them
    (run_slots's states: an x laid over them reads what the run wrote there, a silent wrong
    answer). ``ins``/``updated``: (name, array or None) pairs; ``owner``: the array that owns
    all of ``updated``'s memory. Cost: ~0.2 us per input from another allocation."""
    for na, a in ins:
        if not isinstance(a, np.ndarray):
            continue
        oa = _owner(a)
        if oa is not None and oa is not owner:  # another allocation: apart
            continue
        for nb, b in updated:
            if b is not None and _overlap(a, oa, b, owner):
                raise LayoutError(
                    f"[{op}] {na} shares memory with {nb}; expected inputs apart from the "
                    f"states: the run writes {nb} while it still reads {na}; pass a copy, "
                    f"e.g. np.array({na})"
                )


def lengths(op: str, lengths, N: int, T: int) -> np.ndarray:
    unmasked(op, "lengths", lengths)  # (a masked length ran as a real one)
    # Always a copy, checked and then used: the kernels read it with the GIL released, and a
    # caller's array another thread changed after the check sent rows past T (a segfault)
    arr = np.array(lengths)
    if arr.dtype.kind not in "iu":
        raise LengthsError(f"[{op}] lengths has dtype {arr.dtype}; expected an integer array")
    if arr.shape != (N,):
        raise LengthsError(f"[{op}] lengths has shape {tuple(arr.shape)}; expected [N={N}]")
    if N and (arr.min() < 0 or arr.max() > T):
        bad = [int(v) for v in arr if v < 0 or v > T][:5]
        raise LengthsError(f"[{op}] lengths {bad} out of range; expected 0 <= length <= T={T}")
    # int64 from here on: a chunked run computes lengths - t0, which wrapped around for unsigned
    # lengths (an ended sample ran again in every later chunk) and overflowed int8/int16
    return arr.astype(np.int64, copy=False)


def count(op: str, name: str, v, error: type = SpecError) -> int:
    """``v`` as an int >= 1 (a float, a string, a bool, None or a value < 1 refused: 2.0 gave
    plans of float byte counts, 0 a plan of nothing), else ``error``."""
    if not isinstance(v, int | np.integer) or isinstance(v, bool | np.bool_) or v < 1:
        raise error(f"[{op}] {name}={v!r}; expected a positive int")
    return int(v)


def flag(op: str, name: str, v, error: type = SpecError) -> bool:
    """``v`` as a bool (True, False, numpy's): "no", None or 1 refused, else ``error`` ("no"
    ran as True, None as False)."""
    if not isinstance(v, bool | np.bool_):
        raise error(f"[{op}] {name}={v!r}; expected True or False")
    return bool(v)


def count_or_none(op: str, name: str, v, what: str = "a positive int") -> int | None:
    """``v`` as an int >= 1, or None. Settings such as threads and segment (byte counts:
    ``bytes_or_none``): a float, a string, a bool or a value < 1 is refused, never truncated or
    clamped in silence (segment=2.5 ran segments of 2, threads=-1 ran with -1 threads)."""
    if v is None:
        return None
    if not isinstance(v, int | np.integer) or isinstance(v, bool | np.bool_) or v < 1:
        raise SpecError(f"[{op}] {name}={v!r}; expected {what} or None")
    return int(v)


def bytes_or_none(op: str, name: str, v) -> int | None:
    """``v`` as an int of bytes >= 1, or None: memory_limit's one check (Session, the models,
    score). Byte counts are written 4e6 or 2**30 as often as 4 << 20, so a float that is a whole
    number counts; 4.5, nan, inf, a bool, a string or a value < 1 is refused, never rounded."""
    if v is None:
        return None
    n = None
    if isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_):
        n = int(v)
    elif isinstance(v, float | np.floating) and math.isfinite(v) and float(v).is_integer():
        n = int(v)
    if n is None or n < 1:
        raise SpecError(
            f"[{op}] {name}={v!r}; expected an int of bytes >= 1 (e.g. 4 << 20 or 4e6) or None"
        )
    return n


def packed_weights(op: str, model):
    """The PackedWeights of ``model`` (a leanrnn model, or PackedWeights themselves)."""
    from ..formats.packing import PackedWeights

    w = model if isinstance(model, PackedWeights) else getattr(model, "weights", None)
    if not isinstance(w, PackedWeights):
        graph = getattr(model, "graph", None)
        if graph is not None and hasattr(graph, "packed"):  # leanrnn.load of an ONNX file
            nodes = list(graph.packed)[:4]
            raise SpecError(
                f"[{op}] got a GraphModel (an op graph); this takes a recurrent stack: one of "
                f"its RNN nodes' weights (model.graph.packed[name], names {nodes}), or the "
                "stack's state dict through leanrnn.from_state_dict"
            )
        raise SpecError(
            f"[{op}] got a {type(model).__name__}; expected a leanrnn LSTM/GRU/RNN model or its "
            "PackedWeights (model.weights); load a file first with leanrnn.load(path)"
        )
    return w
