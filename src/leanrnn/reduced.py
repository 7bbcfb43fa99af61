"""``leanrnn.quantize``: a model with reduced-precision weights (bf16, bf16-act, int8,
int8-dynamic), of the same kind.

Sits above the models (nn.Model, GraphModel) and formats.quantize, which owns the number
formats; the engine runs the result with the reduced-precision jobs (kernels.abi.job_for).
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar, overload

import numpy as np

from .errors import DTypeError
from .formats.packing import PRECISIONS, PackedWeights
from .formats.quantize import quantize_packed
from .graph_model import GraphModel
from .nn import Model

REDUCED = tuple(p for p in PRECISIONS if p != "float")

_M = TypeVar("_M", bound=Model)  # quantize gives a Model's own class back


def check_reduced(precision: Any, op: str, reduce_range: bool = False) -> None:
    """DTypeError unless ``precision`` names a reduced precision (and, with ``reduce_range``,
    the one that has it)."""
    if not isinstance(reduce_range, (bool, np.bool_)):
        raise DTypeError(f"[{op}] reduce_range={reduce_range!r}; expected True or False")
    if reduce_range and precision is None:
        raise DTypeError(f"[{op}] reduce_range (7-bit weight codes) needs precision "
                         "'int8-dynamic' named with it (--precision int8-dynamic), also for "
                         "a model that is int8-dynamic already")  # fmt: skip
    if precision not in REDUCED:
        raise DTypeError(f"[{op}] precision {precision!r}; expected one of "
                         f"{', '.join(map(repr, REDUCED))}")  # fmt: skip
    if reduce_range and precision != "int8-dynamic":
        raise DTypeError(f"[{op}] reduce_range (7-bit weight codes) is int8-dynamic's; "
                         f"{precision!r} multiplies no integer codes")  # fmt: skip


@overload
def quantize(model: _M, precision: str, *, reduce_range: bool = False) -> _M: ...
@overload
def quantize(model: GraphModel, precision: str, *, reduce_range: bool = False) -> GraphModel: ...
def quantize(model: Model | GraphModel, precision: str, *,
             reduce_range: bool = False) -> Model | GraphModel:  # fmt: skip
    """A copy of ``model`` whose recurrent layers' input and recurrent weights are ``precision``
    ("bf16": bfloat16, rounded to nearest even; "int8": symmetric, one float32 scale per output
    unit and gate). Activations, states and sums stay float32; biases, peepholes and the LSTM
    projection stay float32. Works on ``Model`` (LSTM/GRU/RNN, same class back) and on
    ``GraphModel`` (its packed RNN nodes). The model must be float32; ``model`` is unchanged.

    "int8-dynamic" is what torch's ``quantize_dynamic`` and onnxruntime's dynamic quantization
    do: int8 weights (one scale per output unit and gate) and the activations (x,
    h) quantized per row as the kernels run, multiplied with integer dot products and summed
    exactly in int32 (kernels._qdot) — the fast int8 mode, at the accuracy of the peers' int8.
    ``reduce_range=True`` (onnxruntime's option of the same name) rounds its weights to 7-bit
    codes instead of 8: twice the weight error, still within the peers' (the README's accuracy
    table), and on CPUs without AVX-512 VNNI (AVX2 only) 1.3-1.9x faster runs (the README's
    Zen 3 table: three instructions per 32 products instead of four; ``leanrnn info`` names
    the CPU's int8 path). A 7-bit model runs everywhere and gives the same numbers everywhere.

    "bf16-act" is bf16's weights with the activations (x, h, the GRU's r*h) rounded to
    bfloat16 too before each product, as torch's autocast and oneDNN's bf16 do: on AMX one
    tile product where bf16 does two (it splits each activation into two bfloat16 terms to
    keep float32's accuracy), so batches run ~1.2-1.6x faster than bf16; on every path and
    CPU alike, so results do not depend on the batch beyond float32 summation order. Sums,
    states and gates stay float32.

    Per step the recurrence reads 1/2 (bf16) or ~1/4 (int8) of the float32 weight bytes, which
    at batch 1 is what sets the latency. Errors: bf16 rounds each weight by <= 2**-8
    relative; int8 and int8-dynamic by <= scale/2 = max|w_column| / 254 absolute (/ 126 with
    reduce_range; and int8-dynamic each activation by max|row| / 254); bf16-act also each
    activation by <= 2**-8 relative.

    >>> m = leanrnn.LSTM(64, 128, seed=0)
    >>> q = leanrnn.quantize(m, "int8")          # q(x) ~= m(x), weights ~1/4 of the bytes
    >>> q.weights.precision, q.weights.weight_bytes < m.weights.weight_bytes / 3
    ('int8', True)
    """
    return _quantize(model, precision, "quantize", reduce_range)


def _quantize(model: Any, precision: str, op: str,
              reduce_range: bool = False) -> Model | GraphModel:  # fmt: skip
    """``quantize``, its errors under ``op`` (``convert`` calls it too)."""
    check_reduced(precision, op, reduce_range)
    if isinstance(model, Model):
        return type(model)._from_packed(
            quantize_packed(model.weights, precision, reduce_range=reduce_range),
            model.session.threads,
        )
    if isinstance(model, GraphModel):
        g = model.graph
        if not g.packed:  # nothing would change: the "int8" file would be the float one
            from .ir import RNN_OPS

            rnns = [n.name for n in g.nodes if n.op in RNN_OPS]
            why = (f"its RNN nodes {rnns[:4]} take W and R as graph inputs (packed per run, "
                   "so there are no stored weights to quantize): make them initializers"
                   if rnns else "it has no LSTM/GRU/RNN node")  # fmt: skip
            raise DTypeError(f"[{op}] the graph has no packed recurrent weights to store in "
                             f"{precision}: {why}")  # fmt: skip
        wide = sorted(k for k, pw in g.packed.items() if pw.dtype != np.float32)
        if wide:  # (quantize_packed's advice, model.astype, is a Model's; a graph has none)
            raise DTypeError(f"[{op}] RNN nodes {wide[:4]} compute in "
                             f"{g.packed[wide[0]].dtype}; {precision} weights run float32 "
                             "activations: export the model in float32 and load that")  # fmt: skip
        packed: dict[str, PackedWeights] = {}
        for k, owner in g.weight_owners().items():  # weights several nodes share: once
            packed[k] = packed[owner] if owner != k else quantize_packed(
                g.packed[k], precision, reduce_range=reduce_range)  # fmt: skip
        graph = dataclasses.replace(g, nodes=[dataclasses.replace(n) for n in g.nodes],
                                    constants=dict(g.constants), packed=packed)  # fmt: skip
        return GraphModel(graph, threads=model.threads)
    raise DTypeError(f"[{op}] got a {type(model).__name__}; expected a leanrnn Model "
                     "(LSTM/GRU/RNN) or GraphModel")  # fmt: skip
