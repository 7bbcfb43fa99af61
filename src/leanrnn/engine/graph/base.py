"""What every graph op module shares: ``Out`` (what ``infer`` says about an output), ``OpDef``
(an op's infer/run/scratch) and the checks ops make of their nodes (arity, axes, dtypes,
broadcasting, integer arguments known from constants or shapes). Below the op modules
(``ops``, ``quant_ops``, ``layer_ops``), which import from here and never from each other's
internals."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from ...errors import DTypeError, LeanRNNError, ModelFormatError, ShapeError
from ...ir import Node


@dataclass(frozen=True, eq=False)
class Out:
    """What ``infer`` says about one output: shape, dtype, whether it is a view of input 0's
    memory (no buffer of its own), and its value when it is known from shapes alone."""

    shape: tuple[int, ...]
    dtype: np.dtype
    view: bool = False
    value: np.ndarray | None = None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


@dataclass(frozen=True)
class OpDef:
    infer: Callable  # (ctx, node, ins: [Out|None], vals: [ndarray|None]) -> [Out]
    run: Callable  # (ctx, node, ins: [ndarray|None], outs: [ndarray|None], metas, tmp) -> [ndarray]
    scratch: Callable | None = None  # (ctx, node, ins, metas, needed) -> {name: (shape, dtype)}
    # (ctx, node, ins, metas) -> bytes the run allocates itself, at most at once, and frees
    # before it returns (numpy's temporaries of a blocked loop): counted with the plan, not
    # placed in the arena
    transient: Callable | None = None


def _fail(node: Node, msg: str, cls: type[LeanRNNError] = ShapeError):
    raise cls(f"[graph] node {node.name!r} ({node.op}): {msg}")


def _numeric(node: Node, name) -> np.dtype:
    """A numeric or bool dtype by its numpy name (names only: np.dtype(None) is float64)."""
    dt = np.dtype(name) if isinstance(name, str) else None
    if dt is None or dt.kind not in "biuf":
        _fail(node, f"dtype {name!r}; expected a numeric or bool dtype name", ModelFormatError)
    return dt


def _axis(node: Node, axis, rank: int) -> int:
    if not _is_int(axis):
        _fail(node, f"axis={axis!r:.80}; expected an int", ModelFormatError)
    a = int(axis)
    if not -rank <= a < rank:
        _fail(node, f"axis {a} is out of range for a rank-{rank} tensor")
    return a % rank


def _ints(node: Node, value, what: str) -> list[int]:
    if value is None:
        _fail(
            node,
            f"{what} must be a constant or computable from input shapes (Shape, Gather, "
            "Concat, ...); here it depends on input values",
            ModelFormatError,
        )
    arr = np.asarray(value)
    if arr.dtype.kind not in "iu" or arr.ndim > 1:
        _fail(node, f"{what} is {arr.dtype}{list(arr.shape)}; expected a 1-D integer tensor")
    return [int(v) for v in arr.reshape(-1)]


def _optional(node: Node, ins: list, vals: list, i: int, attr: str, what: str) -> list[int] | None:
    """An int list given as attribute ``attr`` (older opsets) or as input ``i`` (newer)."""
    if attr in node.attrs:
        return [int(v) for v in node.attrs[attr]]
    if i < len(ins) and ins[i] is not None:
        return _ints(node, vals[i], what)
    return None


# Typed attribute reads: onnxruntime refuses an attribute of the wrong type at load (a float
# stride, a string kernel, a list where one alpha is due), where int() and float() truncated,
# iterated or broadcast it into a result of their own.
def _is_int(v) -> bool:
    return isinstance(v, int | np.integer) and not isinstance(v, bool | np.bool_)


def attr_int(node: Node, name: str, default: int) -> int:
    v = node.attrs.get(name, default)
    if not _is_int(v):
        _fail(node, f"attribute {name}={v!r:.80}; expected an int", ModelFormatError)
    return int(v)


def attr_flag(node: Node, name: str, default: int) -> bool:
    """A 0/1 int attribute, read as onnxruntime reads it: true when it is 1."""
    return attr_int(node, name, default) == 1


def attr_ints(node: Node, name: str, default: list[int]) -> list[int]:
    v = node.attrs.get(name, default)
    if not isinstance(v, list | tuple) or not all(_is_int(x) for x in v):
        _fail(node, f"attribute {name}={v!r:.80}; expected a list of ints", ModelFormatError)
    return [int(x) for x in v]


def attr_float(node: Node, name: str, default: float) -> float:
    v = node.attrs.get(name, default)
    if not isinstance(v, float | int | np.floating | np.integer) or isinstance(v, bool):
        _fail(node, f"attribute {name}={v!r:.80}; expected a float", ModelFormatError)
    return float(v)


def attr_str(node: Node, name: str, default: str) -> str:
    v = node.attrs.get(name, default)
    if not isinstance(v, str):
        _fail(node, f"attribute {name}={v!r:.80}; expected a string", ModelFormatError)
    return v


def _fits_off_axis(node: Node, data: Out, idx: Out, a: int) -> None:
    """GatherElements/ScatterElements: indices may not be larger than data off the axis."""
    if any(i > d for j, (i, d) in enumerate(zip(idx.shape, data.shape, strict=True)) if j != a):
        _fail(node, f"indices {list(idx.shape)} are larger than data {list(data.shape)} off "
                    f"axis {a}")  # fmt: skip


def _element_index(node: Node, idx: np.ndarray, a: int, n: int) -> tuple:
    """The index tuple that addresses, for every element of ``idx``, its own position with
    axis ``a`` replaced by its value (GatherElements/ScatterElements), after checking the values
    within [-n, n) (negatives count from the end)."""
    if idx.size:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -n or hi >= n:
            _fail(node, f"index {lo if lo < -n else hi} is out of range [-{n}, {n}) for axis {a}")
    where = list(np.indices(idx.shape, sparse=True))
    where[a] = np.where(idx < 0, idx + n, idx)
    return tuple(where)


def _same_dtype(node: Node, ins: list) -> np.dtype:
    present = [m for m in ins if m is not None]
    dt = present[0].dtype
    for m in present[1:]:
        if m.dtype != dt:
            _fail(
                node,
                f"inputs have dtypes {[str(x.dtype) for x in present]}; expected one dtype",
                DTypeError,
            )
    return dt


_NARROW_INTS = frozenset(np.dtype(t) for t in (np.int8, np.int16, np.uint8, np.uint16))


def _typed(ctx, node: Node, dt: np.dtype) -> None:
    """Refuse a dtype outside the ONNX type constraint of an arithmetic op (numpy would run
    it: Add of bools as a logical or, Neg of uint8 wrapping around). Add/Sub/Mul/Div and Relu
    take 8- and 16-bit integers from opset 14, MatMul and Gemm never; Neg takes signed types
    only; Relu before opset 14 floats only. onnxruntime refuses such graphs at load too."""
    op, narrow = node.op, dt in _NARROW_INTS
    bad = (
        dt.kind not in "iuf"
        or (op in ("MatMul", "Gemm") and narrow)
        or (op in ("Add", "Sub", "Mul", "Div") and narrow and ctx.opset < 14)
        or (op == "Neg" and dt.kind == "u")
        or (op == "Relu" and dt.kind != "f" and (ctx.opset < 14 or dt.kind == "u"))
    )
    if bad:
        _fail(node, f"input has dtype {dt}, which ONNX's {op} does not take at opset "
                    f"{ctx.opset}", DTypeError)  # fmt: skip


def _float(node: Node, m: Out) -> None:
    if m.dtype.kind != "f":
        _fail(node, f"input has dtype {m.dtype}; expected a float tensor", DTypeError)


def _numeric_tensor(node: Node, m: Out, what: str = "input") -> None:
    if m.dtype.kind not in "iuf":
        _fail(node, f"{what} has dtype {m.dtype}; expected a numeric tensor", DTypeError)


def _indices(node: Node, m: Out) -> None:
    if m.dtype.kind not in "iu":
        _fail(node, f"indices have dtype {m.dtype}; expected int32 or int64", DTypeError)


def _broadcast(node: Node, *shapes) -> tuple[int, ...]:
    try:
        return tuple(int(d) for d in np.broadcast_shapes(*shapes))
    except ValueError:
        _fail(node, f"shapes {[list(s) for s in shapes]} do not broadcast")


def _nin(node: Node, ins: list, lo: int, hi: int | None = None) -> None:
    n = len(ins)
    if n < lo or (hi is not None and n > hi) or any(m is None for m in ins[:lo]):
        want = f"{lo}" if hi == lo else f"{lo}..{hi if hi is not None else 'n'}"
        _fail(node, f"has {n} inputs; expected {want} (required ones present)", ModelFormatError)


def _view_run(ctx, node, ins, outs, metas, tmp):
    return [ins[0].reshape(metas[0].shape)]
