"""The graph op library: per ONNX op, ``infer`` (output shapes and dtypes from input shapes, and
values known from shapes alone), ``scratch`` (arena buffers it needs) and ``run`` (compute into
the arena views it is handed), gathered in ``OPS``. Ops read the IR (``leanrnn.ir``), never a
file format. RNN nodes (LSTM/GRU/RNN, one layer, any direction) run through one engine
``Session`` each; weights that are not constant are packed per run.

The engine returns y [T, N, D*H] ([N, T, D*H] for layout 1); ONNX wants Y [T, D, N, H]
([N, T, D, H]), which is the same memory when D == 1, layout == 1 or the transpose after Y was
fused, so the engine writes Y in place; only an unfused layout-0 bidirectional Y is transposed
through an arena scratch buffer.
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable

import numpy as np

from ... import config
from ...errors import DTypeError, LeanRNNError, ModelFormatError, PlanError, ShapeError
from ...formats.packing import pack
from ...ir import RNN_OPS, Graph, Node, rnn_from_node
from ...kernels import abi
from ...threads import PARALLEL_MATMUL_MACS, matmul_pool
from ..products import (
    PANEL,
    PackedMatmul,
    packed_product,
    padded_tail_fits,
    padded_tail_width,
    tail_rows,
)
from ..session import Session
from .base import (
    OpDef,
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
    _numeric,
    _numeric_tensor,
    _optional,
    _same_dtype,
    _typed,
    _view_run,
    attr_flag,
    attr_ints,
    attr_str,
)
from .layer_ops import layer_ops
from .quant_ops import quant_ops


class Ctx:
    """What ops may consult: opset, packed RNN weights, per-node engine sessions, packed
    MatMul/Gemm weights."""

    def __init__(self, graph: Graph, sessions: dict[str, Session], threads: int | None,
                 matmuls: dict | None = None) -> None:  # fmt: skip
        self.opset = graph.opset
        self.packed = graph.packed
        self.sessions = sessions
        self.threads = threads
        self.matmuls: dict[str, PackedMatmul] = matmuls or {}
        self.sync = np.zeros(abi.sync_size(1), np.int64)
        self.needed: set[str] = set()


# -------------------------------------------------------------------------- elementwise ops
def _unary_infer(ctx, node, ins, vals):
    _nin(node, ins, 1, 1)
    if node.op not in ("Relu", "Neg", "Abs", "Identity"):
        _float(node, ins[0])
    elif node.op != "Identity":
        _typed(ctx, node, ins[0].dtype)
    return [Out(ins[0].shape, ins[0].dtype)]


def _sigmoid(x, out):
    # 1 / (1 + exp(-x)): exp overflow gives inf and the correct limit 0
    np.negative(x, out=out)
    with np.errstate(over="ignore"):
        np.exp(out, out=out)
    out += 1
    np.reciprocal(out, out=out)


_UNARY: dict[str, Callable] = {
    "Relu": lambda x, o: np.maximum(x, x.dtype.type(0), out=o),
    "Tanh": lambda x, o: np.tanh(x, out=o),
    "Sigmoid": _sigmoid,
    "Neg": lambda x, o: np.negative(x, out=o),
    "Abs": lambda x, o: np.abs(x, out=o),
    "Exp": lambda x, o: np.exp(x, out=o),
    "Log": lambda x, o: np.log(x, out=o),
    "Sqrt": lambda x, o: np.sqrt(x, out=o),
    "Reciprocal": lambda x, o: np.reciprocal(x, out=o),
}


def _unary(fn):
    def run(ctx, node, ins, outs, metas, tmp):
        fn(ins[0], outs[0])
        return outs

    return run


def _binary_infer(ctx, node, ins, vals):
    _nin(node, ins, 2, 2)
    dt = _same_dtype(node, ins)
    _typed(ctx, node, dt)
    return [Out(_broadcast(node, ins[0].shape, ins[1].shape), dt)]


def _div(a, b, out):
    if out.dtype.kind == "f":
        np.divide(a, b, out=out)
        return
    if np.any(b == 0):
        raise ShapeError(
            "integer Div by zero: the divisor holds 0 (ONNX leaves the result undefined); "
            "check the divisor's values, or Cast both inputs to float"
        )
    # ONNX integer division truncates toward zero; numpy's // floors
    q = np.floor_divide(a, b)
    q += (np.remainder(a, b) != 0) & ((a < 0) ^ (b < 0))
    np.copyto(out, q)


_BINARY: dict[str, Callable] = {
    "Add": lambda a, b, o: np.add(a, b, out=o),
    "Sub": lambda a, b, o: np.subtract(a, b, out=o),
    "Mul": lambda a, b, o: np.multiply(a, b, out=o),
    "Div": _div,
}


def _binary(fn):
    def run(ctx, node, ins, outs, metas, tmp):
        fn(ins[0], ins[1], outs[0])
        return outs

    return run


def _softmax_axes(ctx, node, shape) -> tuple[tuple[int, ...], int]:
    """(2-D or N-D working shape, axis) for Softmax/LogSoftmax under the node's opset."""
    rank = len(shape)
    if ctx.opset < 13:  # before opset 13: coerce to 2-D at axis (default 1), normalize rows
        a = _axis(node, node.attrs.get("axis", 1), rank) if rank else 0
        return (math.prod(shape[:a]), math.prod(shape[a:])), 1
    return tuple(shape), _axis(node, node.attrs.get("axis", -1), rank)


def _softmax_infer(ctx, node, ins, vals):
    _nin(node, ins, 1, 1)
    _float(node, ins[0])
    if not ins[0].shape:
        _fail(node, "input is a scalar; expected rank >= 1")
    _softmax_axes(ctx, node, ins[0].shape)
    return [Out(ins[0].shape, ins[0].dtype)]


def _softmax_scratch(ctx, node, ins, metas, needed):
    if node.op != "LogSoftmax":
        return {}
    return {"exp": (ins[0].shape, ins[0].dtype)}


def _softmax_run(ctx, node, ins, outs, metas, tmp):
    if outs[0].size == 0:  # an empty axis or batch: nothing to normalize (x.max would raise)
        return outs
    work, ax = _softmax_axes(ctx, node, ins[0].shape)
    x, o = ins[0].reshape(work), outs[0].reshape(work)
    np.subtract(x, x.max(axis=ax, keepdims=True), out=o)
    if node.op == "Softmax":
        np.exp(o, out=o)
        o /= o.sum(axis=ax, keepdims=True)
    else:
        e = tmp["exp"].reshape(work)
        np.exp(o, out=e)
        o -= np.log(e.sum(axis=ax, keepdims=True))
    return outs


# ------------------------------------------------------------------------------- linear algebra
def _matmul_infer(ctx, node, ins, vals):
    # a third input: the bias passes.fuse_bias folded in ([M], checked there)
    _nin(node, ins, 2, 3 if node.attrs.get("fused_bias") else 2)
    ins = ins[:2]
    dt = _same_dtype(node, ins)
    _typed(ctx, node, dt)
    sa, sb = list(ins[0].shape), list(ins[1].shape)
    if not sa or not sb:
        _fail(node, f"inputs have shapes {sa} and {sb}; MatMul needs rank >= 1")
    a1, b1 = len(sa) == 1, len(sb) == 1
    sa = [1, *sa] if a1 else sa
    sb = [*sb, 1] if b1 else sb
    if sa[-1] != sb[-2]:
        _fail(node, f"inner dims differ: {list(ins[0].shape)} @ {list(ins[1].shape)}")
    shape = [*_broadcast(node, tuple(sa[:-2]), tuple(sb[:-2])), sa[-2], sb[-1]]
    if b1:
        shape.pop(-1)
    if a1:
        shape.pop(-2 if not b1 else -1)
    return [Out(tuple(shape), dt)]


def _row_parallel_matmul(ctx, a, b, out) -> None:
    """out [R, M] = a [R, K] @ b [K, M], rows split over ``threads`` Python threads, each a
    single-threaded BLAS call (numpy releases the GIL), from threads.PARALLEL_MATMUL_MACS on."""
    threads = ctx.threads or config.get_num_threads()
    rows = a.shape[0]
    if threads < 2 or rows < 2 * threads or rows * a.shape[1] * b.shape[1] < PARALLEL_MATMUL_MACS:
        np.matmul(a, b, out=out)
        return
    pool = matmul_pool(threads)
    cuts = np.linspace(0, rows, threads + 1).astype(int)
    jobs = [
        pool.submit(np.matmul, a[lo:hi], b, out=out[lo:hi])
        for lo, hi in itertools.pairwise(cuts)
        if hi > lo
    ]
    for j in jobs:
        j.result()


def _packed_product(ctx, pm: PackedMatmul, a, out, tail) -> None:
    """out [R, M] = a [R, K] @ B through ``pm`` on the context's threads (products)."""
    packed_product(pm, a, out, tail, config.threads_for(ctx.threads), ctx.sync)


def _ran_packed(ctx, node, a, o, tmp) -> bool:
    """o = a @ B on the node's packed B (MatMul and Gemm alike), if it has one and ``a`` fits
    it; False when the caller must multiply another way."""
    pm = ctx.matmuls.get(node.name)
    if pm is None or a.dtype != pm.W.dtype or a.ndim < 2 or not a.flags.c_contiguous or not a.size:
        return False
    _packed_product(ctx, pm, a.reshape(-1, a.shape[-1]), o.reshape(-1, pm.M), tmp.get("tail"))
    return True


def _matmul_scratch(ctx, node, ins, metas, needed):
    pm = ctx.matmuls.get(node.name)
    if pm is None or pm.M % PANEL == 0 or len(metas[0].shape) < 1:
        return {}
    rows = math.prod(metas[0].shape[:-1])
    itemsize = np.dtype(metas[0].dtype).itemsize
    if padded_tail_fits(pm, rows, itemsize):
        return {"tail": ((rows, padded_tail_width(pm.W.shape[0])), metas[0].dtype)}
    return {"tail": ((tail_rows(rows, itemsize), PANEL), metas[0].dtype)}


def _matmul_run(ctx, node, ins, outs, metas, tmp):
    a, b = ins[:2]
    o = outs[0]
    if _ran_packed(ctx, node, a, o, tmp):  # a fused bias is in the packed product's b
        return outs
    if b.ndim == 2 and a.ndim >= 2 and a.flags.c_contiguous and b.size:
        # [..., K] @ [K, M]: one product over all leading rows, not one per batch entry
        # (K or M of 0 goes to np.matmul: reshape(-1, 0) cannot infer the rows)
        _row_parallel_matmul(ctx, a.reshape(-1, a.shape[-1]), b, o.reshape(-1, b.shape[1]))
    else:
        np.matmul(a, b, out=o)
    if len(ins) > 2:  # passes.fuse_bias
        o += ins[2]
    return outs


def _gemm_infer(ctx, node, ins, vals):
    _nin(node, ins, 2, 3)
    dt = _same_dtype(node, ins)
    _typed(ctx, node, dt)
    A, Bm = ins[0].shape, ins[1].shape
    if len(A) != 2 or len(Bm) != 2:
        _fail(node, f"A is {list(A)}, B is {list(Bm)}; Gemm needs 2-D A and B")
    M, K = A[::-1] if node.attrs.get("transA", 0) else A
    K2, N = Bm[::-1] if node.attrs.get("transB", 0) else Bm
    if K != K2:
        _fail(node, f"A' is [{M}, {K}] and B' is [{K2}, {N}]; inner dims differ")
    if len(ins) > 2 and ins[2] is not None and _broadcast(node, ins[2].shape, (M, N)) != (M, N):
        _fail(node, f"C has shape {list(ins[2].shape)}; expected to broadcast to [{M}, {N}]")
    return [Out((M, N), dt)]


def _gemm_run(ctx, node, ins, outs, metas, tmp):
    a = ins[0].T if node.attrs.get("transA", 0) else ins[0]
    b = ins[1].T if node.attrs.get("transB", 0) else ins[1]
    o = outs[0]
    if not _ran_packed(ctx, node, a, o, tmp):
        _row_parallel_matmul(ctx, a, b, o)
    alpha, beta = float(node.attrs.get("alpha", 1.0)), float(node.attrs.get("beta", 1.0))
    if alpha != 1.0:
        o *= o.dtype.type(alpha)
    if len(ins) > 2 and ins[2] is not None and beta != 0.0:
        o += ins[2] if beta == 1.0 else ins[2] * ins[2].dtype.type(beta)
    return outs


# ------------------------------------------------------------------------------ data movement
def _gather_infer(ctx, node, ins, vals):
    _nin(node, ins, 2, 2)
    data, idx = ins
    _indices(node, idx)
    if not data.shape:
        _fail(node, "data is a scalar; expected rank >= 1")
    a = _axis(node, node.attrs.get("axis", 0), len(data.shape))
    shape = data.shape[:a] + idx.shape + data.shape[a + 1 :]
    return [Out(shape, data.dtype)]


def _gather_run(ctx, node, ins, outs, metas, tmp):
    data, idx = ins
    a = _axis(node, node.attrs.get("axis", 0), data.ndim)
    n = data.shape[a]
    if idx.size:
        lo, hi = int(idx.min()), int(idx.max())
        if lo < -n or hi >= n:
            bad = lo if lo < -n else hi
            _fail(
                node,
                f"index {bad} is out of range [-{n}, {n}) for axis {a} of input "
                f"{list(data.shape)} (e.g. a token id >= the embedding's vocabulary)",
            )
    # indices are checked above, so 'wrap' only maps negatives; unlike 'raise' it is unbuffered
    np.take(data, idx, axis=a, out=outs[0], mode="wrap")
    return outs


def _transpose_infer(ctx, node, ins, vals):
    _nin(node, ins, 1, 1)
    shape = ins[0].shape
    rank = len(shape)
    perm = [int(p) for p in node.attrs.get("perm", range(rank - 1, -1, -1))]
    # ONNX's perm has no negative entries: onnxruntime refuses them (taking them modulo the
    # rank ran [0, -1] as an identity)
    if sorted(perm) != list(range(rank)):
        _fail(node, f"perm {perm} is not a permutation of the axes 0..{rank - 1}")
    out = tuple(shape[p] for p in perm)
    # Moving only size-1 axes keeps the memory order: the output is a reshape (no copy)
    moved = [p for p in perm if shape[p] != 1]
    return [Out(out, ins[0].dtype, view=moved == sorted(moved))]


def _transpose_run(ctx, node, ins, outs, metas, tmp):
    if metas[0].view:
        return [ins[0].reshape(metas[0].shape)]
    rank = ins[0].ndim
    perm = [int(p) for p in node.attrs.get("perm", range(rank - 1, -1, -1))]
    np.copyto(outs[0], ins[0].transpose(perm))
    return outs


def _squeeze_infer(ctx, node, ins, vals):
    _nin(node, ins, 1, 2)
    shape = ins[0].shape
    axes = _optional(node, ins, vals, 1, "axes", "axes")
    if not axes:  # none, or an empty list: every size-1 axis (onnxruntime reads [] so too)
        keep = [d for d in shape if d != 1]
    else:
        ax = {_axis(node, a, len(shape)) for a in axes}
        for a in ax:
            if shape[a] != 1:
                _fail(node, f"cannot squeeze axis {a} of size {shape[a]} (input {list(shape)})")
        keep = [d for i, d in enumerate(shape) if i not in ax]
    return [Out(tuple(keep), ins[0].dtype, view=True)]


def _unsqueeze_infer(ctx, node, ins, vals):
    _nin(node, ins, 1, 2)
    shape = list(ins[0].shape)
    axes = _optional(node, ins, vals, 1, "axes", "axes")
    if axes is None:
        _fail(node, "needs axes", ModelFormatError)
    rank = len(shape) + len(axes)
    ax = sorted(_axis(node, a, rank) for a in axes)
    if len(set(ax)) != len(ax):
        _fail(node, f"axes {axes} repeat an axis")
    for a in ax:
        shape.insert(a, 1)
    return [Out(tuple(shape), ins[0].dtype, view=True)]


def _reshape_infer(ctx, node, ins, vals):
    _nin(node, ins, 2, 2)
    src = ins[0].shape
    want = _ints(node, vals[1], "the target shape")
    allowzero = int(node.attrs.get("allowzero", 0))
    shape = []
    for i, d in enumerate(want):
        if d == 0 and not allowzero:
            if i >= len(src):
                _fail(node, f"shape {want} copies dim {i} (0) but the input has rank {len(src)}")
            d = src[i]
        shape.append(d)
    if shape.count(-1) > 1 or any(d < -1 for d in shape):
        _fail(node, f"shape {want} is invalid (at most one -1, others >= 0)")
    total = math.prod(src)
    if -1 in shape:
        rest = math.prod(d for d in shape if d != -1)
        if rest == 0 or total % rest:
            _fail(node, f"cannot reshape {list(src)} ({total} values) to {want}")
        shape[shape.index(-1)] = total // rest
    if math.prod(shape) != total:
        _fail(node, f"cannot reshape {list(src)} ({total} values) to {want}")
    return [Out(tuple(shape), ins[0].dtype, view=True)]


def _flatten_infer(ctx, node, ins, vals):
    _nin(node, ins, 1, 1)
    shape = ins[0].shape
    a = int(node.attrs.get("axis", 1))
    if not -len(shape) <= a <= len(shape):
        _fail(node, f"axis {a} out of range for rank {len(shape)}")
    a = a + len(shape) if a < 0 else a
    return [Out((math.prod(shape[:a]), math.prod(shape[a:])), ins[0].dtype, view=True)]


def _identity_infer(ctx, node, ins, vals):
    _nin(node, ins, 1, 3 if node.op == "Dropout" else 1)
    if node.op == "Dropout" and len(ins) > 2 and ins[2] is not None:
        train = vals[2]
        if train is None or bool(np.asarray(train).reshape(-1)[0]):
            _fail(
                node,
                "training_mode is not a constant false; leanrnn runs inference only",
                ModelFormatError,
            )
    outs = [Out(ins[0].shape, ins[0].dtype, view=True)]
    if len(node.outputs) > 1:  # Dropout's mask, all kept: bool from opset 10, before it T
        outs.append(Out(ins[0].shape, np.dtype(np.bool_) if ctx.opset >= 10 else ins[0].dtype))
    return outs


def _identity_run(ctx, node, ins, outs, metas, tmp):
    # an output named "" (ONNX's "not wanted", e.g. Dropout's mask) is handed as None: the
    # session gives it no buffer, and writing one failed every run of a model that loaded
    res = [ins[0].reshape(metas[0].shape)]
    if len(outs) > 1:
        if outs[1] is not None:
            outs[1].fill(1)
        res.append(outs[1])
    return res


def _concat_infer(ctx, node, ins, vals):
    if not ins or any(m is None for m in ins):
        _fail(node, "needs one or more inputs", ModelFormatError)
    dt = _same_dtype(node, ins)
    rank = len(ins[0].shape)
    if rank == 0:  # (onnxruntime refuses it too; this read ins' shape[0] and raised IndexError)
        _fail(node, "concatenates scalars (rank 0), which have no axis; Unsqueeze them first")
    if "axis" not in node.attrs:
        _fail(node, "needs an axis attribute", ModelFormatError)
    a = _axis(node, node.attrs["axis"], max(rank, 1))
    for m in ins:
        if len(m.shape) != rank or any(
            d != e for i, (d, e) in enumerate(zip(m.shape, ins[0].shape, strict=True)) if i != a
        ):
            _fail(node, f"input shapes {[list(m.shape) for m in ins]} differ off axis {a}")
    shape = list(ins[0].shape)
    shape[a] = sum(m.shape[a] for m in ins)
    value = None
    if all(v is not None for v in vals):  # shape arithmetic: keep the value
        value = np.concatenate([np.asarray(v) for v in vals], axis=a)
    return [Out(tuple(shape), dt, value=value)]


def _concat_run(ctx, node, ins, outs, metas, tmp):
    a = _axis(node, node.attrs["axis"], max(ins[0].ndim, 1))
    np.concatenate(ins, axis=a, out=outs[0])
    return outs


def _slices(node, ins, vals, opset) -> tuple[tuple[slice, ...], tuple[int, ...]]:
    shape = ins[0].shape
    if opset < 10 or "starts" in node.attrs:
        starts, ends = node.attrs.get("starts"), node.attrs.get("ends")
        axes, steps = node.attrs.get("axes"), None
        if starts is None or ends is None:
            _fail(node, "needs starts and ends", ModelFormatError)
    else:
        _nin(node, ins, 3, 5)
        starts = _ints(node, vals[1], "starts")
        ends = _ints(node, vals[2], "ends")
        axes = _optional(node, ins, vals, 3, "__none__", "axes")
        steps = _optional(node, ins, vals, 4, "__none__", "steps")
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    if not len(starts) == len(ends) == len(axes) == len(steps):
        _fail(
            node,
            f"starts/ends/axes/steps have lengths {len(starts)}/{len(ends)}/"
            f"{len(axes)}/{len(steps)}; expected equal",
        )
    named = [_axis(node, a, len(shape)) for a in axes]
    if len(set(named)) != len(named):  # the last would win; onnxruntime refuses the node
        _fail(node, f"axes {list(axes)} name an axis more than once")
    sl = [slice(None)] * len(shape)
    for s, e, a, st in zip(starts, ends, named, steps, strict=True):
        if st == 0:
            _fail(node, "a step is 0")
        n = shape[a]
        s = s + n if s < 0 else s
        e = e + n if e < 0 else e
        if e in _INT_MAX:  # "to the end" in the step's direction, as onnxruntime reads it (the
            e = n if st > 0 else -1  # spec's clamp made x[3:INT_MAX:-1] empty, not x[3::-1])
        if st > 0:
            s, e = min(max(s, 0), n), min(max(e, 0), n)
        else:
            s, e = min(max(s, 0), n - 1), min(max(e, -1), n - 1)
        sl[a] = slice(s, e if e >= 0 else None, st)
    out = tuple(len(range(*sl[i].indices(shape[i]))) for i in range(len(shape)))
    return tuple(sl), out


_INT_MAX = (2**31 - 1, 2**63 - 1)  # exporters' "no end" (numpy's None) in Slice's ends


def _slice_infer(ctx, node, ins, vals):
    sl, shape = _slices(node, ins, vals, ctx.opset)
    value = None if vals[0] is None else np.asarray(vals[0])[sl]
    return [Out(shape, ins[0].dtype, value=value)]


def _slice_run(ctx, node, ins, outs, metas, tmp):
    metas_in = [None if a is None else Out(a.shape, a.dtype) for a in ins]
    sl, _ = _slices(node, metas_in, ins, ctx.opset)
    np.copyto(outs[0], ins[0][sl])
    return outs


def _split_infer(ctx, node, ins, vals):
    _nin(node, ins, 1, 2)
    shape = ins[0].shape
    a = _axis(node, node.attrs.get("axis", 0), len(shape))
    sizes = _optional(node, ins, vals, 1, "split", "split")
    k = len(node.outputs)
    if sizes is None:
        if k < 1 or int(node.attrs.get("num_outputs", k)) != k:
            _fail(node, f"num_outputs={node.attrs.get('num_outputs', k)} with {k} outputs named")
        if (ctx.opset < 18 or "num_outputs" not in node.attrs) and shape[a] % k:
            # only opset 18's num_outputs lets the last part be smaller; before it (and
            # onnxruntime at any opset without num_outputs) the parts must be equal
            _fail(node, f"axis {a} of size {shape[a]} does not split into {k} equal parts "
                        "(give the split sizes, or num_outputs at opset 18 and later)")  # fmt: skip
        q = -(-shape[a] // k)
        sizes = [q] * (k - 1) + [shape[a] - q * (k - 1)]
    if len(sizes) != len(node.outputs) or sum(sizes) != shape[a] or min(sizes) < 0:
        _fail(
            node,
            f"split {sizes} does not cut axis {a} of size {shape[a]} into "
            f"{len(node.outputs)} parts",
        )
    return [Out((*shape[:a], s, *shape[a + 1 :]), ins[0].dtype) for s in sizes]


def _split_run(ctx, node, ins, outs, metas, tmp):
    a = _axis(node, node.attrs.get("axis", 0), ins[0].ndim)
    start = 0
    for o, m in zip(outs, metas, strict=True):
        n = m.shape[a]
        if o is not None:  # (an unnamed part: None)
            idx = [slice(None)] * ins[0].ndim
            idx[a] = slice(start, start + n)
            np.copyto(o, ins[0][tuple(idx)])
        start += n
    return outs


def _expand_infer(ctx, node, ins, vals):
    _nin(node, ins, 2, 2)
    want = _ints(node, vals[1], "the target shape")
    if any(d < 0 for d in want):
        _fail(node, f"shape {want} has a negative dim")
    shape = _broadcast(node, ins[0].shape, tuple(want))
    return [Out(shape, ins[0].dtype, view=shape == ins[0].shape)]


def _expand_run(ctx, node, ins, outs, metas, tmp):
    if metas[0].view:
        return [ins[0]]
    np.copyto(outs[0], np.broadcast_to(ins[0], metas[0].shape))
    return outs


# ------------------------------------------------------------------------------ shape and types
def _shape_infer(ctx, node, ins, vals):
    _nin(node, ins, 1, 1)
    s = ins[0].shape
    r = len(s)
    start, end = int(node.attrs.get("start", 0)), int(node.attrs.get("end", r))
    start = min(max(start + r if start < 0 else start, 0), r)
    end = min(max(end + r if end < 0 else end, 0), r)
    v = np.array(s[start:end], dtype=np.int64)
    return [Out(v.shape, v.dtype, value=v)]


def _shape_run(ctx, node, ins, outs, metas, tmp):
    return [metas[0].value.copy()]


def _constant_of_shape_infer(ctx, node, ins, vals):
    _nin(node, ins, 1, 1)
    shape = _ints(node, vals[0], "the shape")
    if any(d < 0 for d in shape):
        _fail(node, f"shape {shape} has a negative dim")
    v = node.attrs.get("value") or {"dtype": "float32", "values": [0.0]}
    return [Out(tuple(shape), _numeric(node, v["dtype"]))]


def _constant_of_shape_run(ctx, node, ins, outs, metas, tmp):
    v = node.attrs.get("value") or {"dtype": "float32", "values": [0.0]}
    outs[0].fill(v["values"][0])
    return outs


def _cast_infer(ctx, node, ins, vals):
    _nin(node, ins, 1, 1)
    if "to" not in node.attrs:
        _fail(node, "needs a 'to' attribute", ModelFormatError)
    dt = _numeric(node, node.attrs["to"])
    value = None if vals[0] is None else np.asarray(vals[0]).astype(dt)
    return [Out(ins[0].shape, dt, view=dt == ins[0].dtype, value=value)]


def _cast_run(ctx, node, ins, outs, metas, tmp):
    if metas[0].view:
        return [ins[0]]
    np.copyto(outs[0], ins[0], casting="unsafe")
    return outs


# --------------------------------------------------------------- sorting, scattering, ranges
# What torch's ONNX export of pack_padded_sequence(..., enforce_sorted=False) adds around an RNN
# node: TopK sorts the lengths (longest first), the batch is gathered in that order, and
# Range + ScatterElements build the inverse permutation that gathers y back; ReduceProd counts
# the batch from a shape.


def _topk_infer(ctx, node, ins, vals):
    _nin(node, ins, 2, 2)
    x = ins[0]
    _numeric_tensor(node, x)
    if not x.shape:
        _fail(node, "input is a scalar; expected rank >= 1")
    a = _axis(node, node.attrs.get("axis", -1), len(x.shape))
    ks = _ints(node, vals[1], "K")
    if len(ks) != 1:
        _fail(node, f"K has {len(ks)} values; expected one")
    k = ks[0]
    if not 0 <= k <= x.shape[a]:
        _fail(node, f"K={k}; expected 0 <= K <= {x.shape[a]}, the size of axis {a}")
    shape = (*x.shape[:a], k, *x.shape[a + 1 :])
    return [Out(shape, x.dtype), Out(shape, np.dtype(np.int64))]


def _topk_order(node, x: np.ndarray, a: int) -> np.ndarray:
    """Indices along axis ``a`` in TopK's order: largest (or smallest) first, equal values in
    index order (ONNX's rule; a stable sort of the reversed axis, reversed back, gives it for
    largest-first)."""
    if attr_flag(node, "largest", 1):
        n = x.shape[a]
        rev = np.flip(x, axis=a)
        return (n - 1) - np.flip(np.argsort(rev, axis=a, kind="stable"), axis=a)
    return np.argsort(x, axis=a, kind="stable")


def _topk_run(ctx, node, ins, outs, metas, tmp):
    x = ins[0]
    a = _axis(node, node.attrs.get("axis", -1), x.ndim)
    k = metas[0].shape[a]
    order = _topk_order(node, x, a)
    idx = np.take(order, np.arange(k), axis=a)
    if outs[1] is not None:  # (an unnamed output: None)
        np.copyto(outs[1], idx)
    if outs[0] is not None:
        np.copyto(outs[0], np.take_along_axis(x, idx, axis=a))
    return outs


def _scatter_elements_infer(ctx, node, ins, vals):
    _nin(node, ins, 3, 3)
    data, idx, upd = ins
    _indices(node, idx)
    if upd.dtype != data.dtype:
        _fail(node, f"updates have dtype {upd.dtype}; expected {data.dtype}, the data's",
              DTypeError)  # fmt: skip
    if idx.shape != upd.shape or len(idx.shape) != len(data.shape):
        _fail(node, f"indices {list(idx.shape)} and updates {list(upd.shape)} must have one "
                    f"shape, of the data's rank {len(data.shape)}")  # fmt: skip
    a = _axis(node, node.attrs.get("axis", 0), len(data.shape)) if data.shape else 0
    _fits_off_axis(node, data, idx, a)
    reduction = attr_str(node, "reduction", "none")
    if reduction not in _SCATTER_REDUCE:
        _fail(node, f"reduction={reduction!r}; expected one of {sorted(_SCATTER_REDUCE)}",
              ModelFormatError)  # fmt: skip
    return [Out(data.shape, data.dtype)]


_SCATTER_REDUCE = {"none": None, "add": np.add, "mul": np.multiply, "max": np.maximum,
                   "min": np.minimum}  # fmt: skip


def _scatter_elements_run(ctx, node, ins, outs, metas, tmp):
    data, idx, upd = ins
    out = outs[0]
    np.copyto(out, data)
    if not idx.size:
        return outs
    a = _axis(node, node.attrs.get("axis", 0), data.ndim)
    where = _element_index(node, idx, a, data.shape[a])
    fn = _SCATTER_REDUCE[attr_str(node, "reduction", "none")]
    if fn is None:  # later updates of one element win, as onnxruntime writes them in order
        out[where] = upd
    else:
        fn.at(out, where, upd)
    return outs


_RANGE_TYPES = frozenset(
    np.dtype(t) for t in (np.float32, np.float64, np.int16, np.int32, np.int64)
)


def _range_infer(ctx, node, ins, vals):
    _nin(node, ins, 3, 3)
    dt = _same_dtype(node, ins)
    if dt not in _RANGE_TYPES:
        _fail(node, f"inputs have dtype {dt}; expected float32/64 or int16/32/64", DTypeError)
    if any(m.shape not in ((), (1,)) for m in ins):
        _fail(node, f"inputs have shapes {[list(m.shape) for m in ins]}; expected scalars")
    if any(v is None for v in vals):
        _fail(node, "start, limit and delta must be known from constants or input shapes (the "
                    "output's length depends on them)", ModelFormatError)  # fmt: skip
    start, limit, delta = (np.asarray(v, dt).reshape(()) for v in vals)
    if delta == 0:
        _fail(node, "delta is 0")
    if dt.kind == "i":  # exactly, in Python's integers (through floats, int64 counts rounded)
        n = max(-((int(start) - int(limit)) // int(delta)), 0)
    else:
        n = max(math.ceil((float(limit) - float(start)) / float(delta)), 0)
    return [Out((n,), dt)]  # (its size is checked against memory before it is made)


def _range_run(ctx, node, ins, outs, metas, tmp):
    start, delta = (np.asarray(v).reshape(()) for v in (ins[0], ins[2]))
    o = outs[0]
    if o.size:
        # start, start + delta, (start + delta) + delta, ...: delta added step by step in the
        # inputs' type, as onnxruntime computes it (start + i * delta differs for fractional
        # float steps: Range(0, 1, 0.1)[7] is 0.70000005 there)
        o.fill(delta)
        o[0] = start
        np.add.accumulate(o, out=o)
    return outs


def _reduce_axes(ctx, node, ins, vals) -> tuple[bool, list[int] | None]:
    """(whether this opset gives the axes as input 1, the axes as given: None or [] for none)
    of a Reduce node; ``ins`` are metas and ``vals`` values (at run, the arrays themselves)."""
    if ctx.opset >= (13 if node.op == "ReduceSum" else 18):
        return True, _optional(node, ins, vals, 1, "__none__", "axes")
    return False, attr_ints(node, "axes", []) if "axes" in node.attrs else None


def _reduce_infer(ctx, node, ins, vals):
    _nin(node, ins, 1, 2)
    x = ins[0]
    _numeric_tensor(node, x)
    axes_as_input, axes = _reduce_axes(ctx, node, ins, vals)
    if axes_as_input and "axes" in node.attrs:  # (onnxruntime refuses it: it would be ignored)
        _fail(node, f"has an 'axes' attribute; at opset {ctx.opset} the axes are its second "
                    "input", ModelFormatError)  # fmt: skip
    if not axes_as_input and len(ins) > 1:
        _fail(node, f"has {len(ins)} inputs; before opset "
                    f"{13 if node.op == 'ReduceSum' else 18} the axes are an attribute",
              ModelFormatError)  # fmt: skip
    rank = len(x.shape)
    if not axes:
        if axes_as_input and attr_flag(node, "noop_with_empty_axes", 0):
            return [Out(x.shape, x.dtype, view=True)]
        axes = list(range(rank))
    named = sorted({_axis(node, a, rank) for a in axes})
    if len(named) != len(axes):
        _fail(node, f"axes {axes} name an axis more than once")
    keep = attr_flag(node, "keepdims", 1)
    shape = tuple(1 if i in named else d for i, d in enumerate(x.shape)
                  if keep or i not in named)  # fmt: skip
    return [Out(shape, x.dtype, view=False)]


_REDUCE = {"ReduceProd": np.prod, "ReduceSum": np.sum, "ReduceMax": np.max, "ReduceMin": np.min,
           "ReduceMean": np.mean}  # fmt: skip


def _reduce_run(ctx, node, ins, outs, metas, tmp):
    x = ins[0]
    if metas[0].view:
        return [x]
    metas_in = [None if a is None else Out(a.shape, a.dtype) for a in ins]
    _, axes = _reduce_axes(ctx, node, metas_in, ins)
    axes = tuple(range(x.ndim)) if not axes else tuple(sorted({a % x.ndim for a in axes}))
    keep = attr_flag(node, "keepdims", 1)
    if not math.prod(x.shape[a] for a in axes):  # nothing to reduce: the op's identity
        # (ONNX 18: max of nothing is the lowest value, min the highest; onnxruntime's mean 0)
        info = np.finfo(x.dtype) if x.dtype.kind == "f" else np.iinfo(x.dtype)
        empty = {"ReduceMax": -np.inf if x.dtype.kind == "f" else info.min,
                 "ReduceMin": np.inf if x.dtype.kind == "f" else info.max,
                 "ReduceProd": 1, "ReduceSum": 0, "ReduceMean": 0}  # fmt: skip
        outs[0].fill(empty[node.op])
        return outs
    r = _REDUCE[node.op](x, axis=axes, keepdims=keep)
    np.copyto(outs[0], np.asarray(r).astype(x.dtype, copy=False).reshape(metas[0].shape),
              casting="unsafe")  # fmt: skip
    return outs


# ---------------------------------------------------------------------------------- RNN nodes
def _rnn_layout(node: Node) -> tuple[int, int]:
    layout = int(node.attrs.get("layout", 0))
    D = 2 if node.attrs.get("direction") == "bidirectional" else 1
    return layout, D


def _rnn_infer(ctx, node, ins, vals):
    ins = list(ins) + [None] * (8 - len(ins))
    layout, D = _rnn_layout(node)
    X = ins[0]
    if X is None:
        _fail(node, "has no input X", ModelFormatError)
    if len(X.shape) != 3:
        want = "[T, N, C]" if layout == 0 else "[N, T, C] (layout=1)"
        _fail(node, f"X has shape {list(X.shape)}; expected {want}")
    T, N, C = X.shape if layout == 0 else (X.shape[1], X.shape[0], X.shape[2])
    pw = ctx.packed.get(node.name)
    if pw is not None:
        Cw, H, wdt = pw.spec.input_size, pw.spec.hidden_size, pw.dtype
    else:
        W, R = ins[1], ins[2]
        if W is None or R is None:
            _fail(node, "has no W or R input", ModelFormatError)
        if len(W.shape) != 3 or len(R.shape) != 3:
            _fail(node, f"W is {list(W.shape)}, R is {list(R.shape)}; expected rank 3")
        Cw, H, wdt = W.shape[2], node.attrs.get("hidden_size") or R.shape[2], W.dtype
    if C != Cw:
        _fail(node, f"X has {C} features; the weights expect input_size {Cw}")
    if X.dtype != wdt:
        _fail(
            node,
            f"X has dtype {X.dtype}; the weights are {wdt} (leanrnn never converts "
            "silently; Cast the input)",
            DTypeError,
        )
    if T < 1 or N < 1:
        _fail(node, f"X has shape {list(X.shape)}; T and N must be >= 1")
    state = (D, N, H) if layout == 0 else (N, D, H)
    if ins[4] is not None and (ins[4].shape != (N,) or ins[4].dtype.kind not in "iu"):
        _fail(node, f"sequence_lens is {ins[4].dtype}{list(ins[4].shape)}; expected int32[{N}]")
    for k, nm in ((5, "initial_h"), (6, "initial_c")):
        if ins[k] is not None and (ins[k].shape != state or ins[k].dtype != wdt):
            _fail(node, f"{nm} is {ins[k].dtype}{list(ins[k].shape)}; expected {wdt}{list(state)}")
    if ins[6] is not None and node.op != "LSTM":
        _fail(node, "initial_c is an LSTM input", ModelFormatError)
    if layout == 1:
        Y = (N, T, D, H)
    elif node.attrs.get("y_tndh"):  # fused with the Transpose that followed (see _fuse)
        Y = (T, N, D, H)
    else:
        Y = (T, D, N, H)
    metas = [Out(Y, wdt), Out(state, wdt)] + ([Out(state, wdt)] if node.op == "LSTM" else [])
    return metas[: len(node.outputs)]


def _rnn_need(ctx, node, k: int) -> bool:
    return k < len(node.outputs) and node.outputs[k] in ctx.needed


def _y_direct(node, D: int) -> bool:
    """Whether the engine's y [T, N, D*H] ([N, T, D*H]) is ONNX Y's memory as it stands."""
    layout, _ = _rnn_layout(node)
    return D == 1 or layout == 1 or bool(node.attrs.get("y_tndh"))


def rnn_computes_y(ctx, node) -> bool:
    """Whether the engine computes y: when Y is needed. Without Y the engine keeps only final
    states (``return_sequences=False``), chunked for forward stacks; reverse and bidirectional
    ones run whole (the Session decides, see ``Session.chunkable``)."""
    return _rnn_need(ctx, node, 0)


def _rnn_scratch(ctx, node, ins, metas, needed):
    layout, D = _rnn_layout(node)
    X = ins[0].shape
    T, N = (X[0], X[1]) if layout == 0 else (X[1], X[0])
    H, dt = metas[0].shape[-1], metas[0].dtype  # Y is [.., H] in both layouts
    tmp = {}
    if rnn_computes_y(ctx, node) and not (_rnn_need(ctx, node, 0) and _y_direct(node, D)):
        tmp["y"] = ((T, N, D * H) if layout == 0 else (N, T, D * H), dt)
    if not (_rnn_need(ctx, node, 1) and layout == 0):
        tmp["h"] = ((D, N, H), dt)
    if node.op == "LSTM" and not (_rnn_need(ctx, node, 2) and layout == 0):
        tmp["c"] = ((D, N, H), dt)
    return tmp


def _rnn_run(ctx, node, ins, outs, metas, tmp):
    ins = list(ins) + [None] * (8 - len(ins))
    outs = list(outs) + [None] * (3 - len(outs))
    layout, D = _rnn_layout(node)
    session = ctx.sessions.get(node.name)
    if session is None:  # weights are graph inputs or computed: pack them for this run
        P = ins[7] if node.op == "LSTM" else None
        spec, layers = rnn_from_node(
            node.op, node.attrs, ins[1], ins[2], ins[3], P, f"node {node.name!r}"
        )
        session = Session(pack(spec, layers, ins[1].dtype), threads=ctx.threads)
    x = ins[0]
    H = session.spec.hidden_size
    h0, c0 = ins[5], ins[6]
    if layout == 1:  # the engine keeps states [D, N, H] in both layouts
        h0 = None if h0 is None else np.ascontiguousarray(h0.transpose(1, 0, 2))
        c0 = None if c0 is None else np.ascontiguousarray(c0.transpose(1, 0, 2))
    T, N = (x.shape[0], x.shape[1]) if layout == 0 else (x.shape[1], x.shape[0])
    engine_y = rnn_computes_y(ctx, node)
    y = None
    if engine_y:
        y = (
            tmp["y"]
            if "y" in tmp
            else outs[0].reshape((T, N, D * H) if layout == 0 else (N, T, D * H))
        )
    h = tmp["h"] if "h" in tmp else outs[1]
    states = (h, tmp["c"] if "c" in tmp else outs[2]) if node.op == "LSTM" else (h,)
    out = (y, *states) if engine_y else states
    session.run(x, h0, c0, ins[4], out=out, return_sequences=engine_y)
    if ins[4] is not None and not ins[4].all():
        # A zero-length sample: onnxruntime reports zero final states (not the initial ones)
        for state in states:
            state[:, ins[4] == 0] = 0
    if "y" in tmp and _rnn_need(ctx, node, 0):  # layout 0, D == 2: -> ONNX's [T, D, N, H]
        np.copyto(outs[0], y.reshape(T, N, D, H).transpose(0, 2, 1, 3))
    if layout == 1:
        for k, src in enumerate(states, start=1):
            if _rnn_need(ctx, node, k):
                np.copyto(outs[k], src.transpose(1, 0, 2))
    return outs[: len(node.outputs)]


# ---------------------------------------------------------------------------------- control
def truth(node: Node, name: str, value) -> bool:
    """The truth of condition ``name`` of ``node`` (an If, or a node of one's branch): a
    one-element tensor known when the run is planned, or a ModelFormatError naming both."""
    if value is None:
        _fail(node, f"condition {name!r} depends on input values; leanrnn runs If only when its "
              "condition comes from input shapes and constants (known when a run is planned)",
              ModelFormatError)  # fmt: skip
    v = np.asarray(value)
    if v.dtype != np.bool_:  # (onnxruntime refuses the model; a NaN float read as true)
        _fail(node, f"condition {name!r} has dtype {v.dtype}; expected bool", ModelFormatError)
    if v.size != 1:
        _fail(node, f"condition {name!r} has shape {list(v.shape)}; expected one element",
              ModelFormatError)  # fmt: skip
    return bool(v.reshape(-1)[0])


def taken_branch(node: Node, cond) -> list[Node]:
    """An If node as the planned run holds it: one Identity (a view, no copy) per output, of
    the taken branch's output. Named as the If, so the plan's per-node records name it."""
    k = len(node.outputs)
    srcs = node.inputs[1 : 1 + k] if truth(node, node.inputs[0], cond) else node.inputs[1 + k :]
    return [
        Node("Identity", node.name, (s,), (o,)) for s, o in zip(srcs, node.outputs, strict=True)
    ]


def _if_unexpanded(ctx, node, *args):
    # GraphSession plans an If as its taken branch (taken_branch); nothing else may run one
    _fail(node, "If is planned as its taken branch, never run as a node", ModelFormatError)


# ------------------------------------------------------------------------------------ registry
OPS: dict[str, OpDef] = {
    "If": OpDef(_if_unexpanded, _if_unexpanded),
    **{k: OpDef(_unary_infer, _unary(f)) for k, f in _UNARY.items()},
    **{k: OpDef(_binary_infer, _binary(f)) for k, f in _BINARY.items()},
    "Softmax": OpDef(_softmax_infer, _softmax_run, _softmax_scratch),
    "LogSoftmax": OpDef(_softmax_infer, _softmax_run, _softmax_scratch),
    "MatMul": OpDef(_matmul_infer, _matmul_run, _matmul_scratch),
    "Gemm": OpDef(_gemm_infer, _gemm_run, _matmul_scratch),
    "Gather": OpDef(_gather_infer, _gather_run),
    "Transpose": OpDef(_transpose_infer, _transpose_run),
    "Squeeze": OpDef(_squeeze_infer, _view_run),
    "Unsqueeze": OpDef(_unsqueeze_infer, _view_run),
    "Reshape": OpDef(_reshape_infer, _view_run),
    "Flatten": OpDef(_flatten_infer, _view_run),
    "Identity": OpDef(_identity_infer, _identity_run),
    "Dropout": OpDef(_identity_infer, _identity_run),
    "Concat": OpDef(_concat_infer, _concat_run),
    "Slice": OpDef(_slice_infer, _slice_run),
    "Split": OpDef(_split_infer, _split_run),
    "Expand": OpDef(_expand_infer, _expand_run),
    "Shape": OpDef(_shape_infer, _shape_run),
    "ConstantOfShape": OpDef(_constant_of_shape_infer, _constant_of_shape_run),
    "Cast": OpDef(_cast_infer, _cast_run),
    "TopK": OpDef(_topk_infer, _topk_run),
    "ScatterElements": OpDef(_scatter_elements_infer, _scatter_elements_run),
    "Range": OpDef(_range_infer, _range_run),
    **{k: OpDef(_reduce_infer, _reduce_run) for k in _REDUCE},
    **{k: OpDef(_rnn_infer, _rnn_run, _rnn_scratch) for k in RNN_OPS},
    **quant_ops(OpDef),  # DynamicQuantizeLinear, MatMulInteger and onnxruntime's fused forms
    **layer_ops(OpDef),  # masks, normalization, convolution front-ends around the RNN
}
# Elementwise ops whose output may take over an input's memory (see GraphSession._plan_arena)
INPLACE_OPS = frozenset([*_UNARY, *_BINARY, "Softmax", "LogSoftmax"])
# Constant nodes never reach the engine: the importer turns them into constants.
SUPPORTED_OPS = tuple(sorted([*OPS, "Constant"]))


def guard(node: Node, fn, *args):
    """Call an op function (at load, plan or run time) so that every error names the node: a
    leanrnn error that does not yet gets the node in front, anything else (a malformed
    attribute in a hostile file, say) becomes a ModelFormatError that names it."""
    try:
        return fn(*args)
    except LeanRNNError as e:
        if str(e).startswith(f"[graph] node {node.name!r}"):
            raise
        raise type(e)(f"[graph] node {node.name!r} ({node.op}): {e}") from None
    except (TypeError, ValueError, KeyError, IndexError, AttributeError, ArithmeticError) as e:
        raise ModelFormatError(
            f"[graph] node {node.name!r} ({node.op}): {type(e).__name__}: {e}"
        ) from None
    except MemoryError as e:  # (numpy's names the shape it could not allocate)
        raise PlanError(
            f"[graph] node {node.name!r} ({node.op}) needs more memory than this machine gives: {e}"
        ) from None


MAX_DIM = 1 << 62


def infer(ctx, node: Node, ins: list, vals: list) -> list[Out]:
    """The op's output metas (guarded), refusing a node that names more outputs than its op
    makes: the extra names passed the load's checks as defined, were never given a shape, and
    the first run failed on them with a bare KeyError. Fewer is fine (optional outputs)."""
    outs = guard(node, OPS[node.op].infer, ctx, node, ins, vals)
    for m in outs:  # (an empty output passed every byte check, then numpy refused the dims)
        nonzero = math.prod(d for d in m.shape if d) * m.dtype.itemsize
        if any(d >= MAX_DIM for d in m.shape) or nonzero >= MAX_DIM:
            raise ShapeError(
                f"[graph] node {node.name!r} ({node.op}): output {list(m.shape)} of "
                f"{m.dtype}; expected dimensions (and bytes) below 2**62"
            )
    extra = [o for o in node.outputs[len(outs) :] if o]
    if extra:
        raise ModelFormatError(
            f"[graph] node {node.name!r} ({node.op}) names {len(node.outputs)} outputs; the op "
            f"makes {len(outs)} here, so {extra} would never be computed"
        )
    return outs


def evaluate(ctx, node: Node, vals: list, metas: list[Out]) -> list[np.ndarray]:
    """Run one node on concrete arrays, allocating its outputs (folding and shape math)."""
    if all(m.value is not None for m in metas):
        return [m.value for m in metas]
    outs = [None if m.view else np.empty(m.shape, m.dtype) for m in metas]
    tmp = {}
    if OPS[node.op].scratch is not None:
        ins = [None if v is None else Out(v.shape, v.dtype) for v in vals]
        for k, (shape, dt) in OPS[node.op].scratch(ctx, node, ins, metas, set()).items():
            tmp[k] = np.empty(shape, dt)
    return list(OPS[node.op].run(ctx, node, vals, outs, metas, tmp))
