"""onnxruntime's ``com.microsoft::DynamicQuantizeLSTM`` (what
``onnxruntime.quantization.quantize_dynamic`` makes of an ONNX LSTM) -> an ordinary LSTM node of
the graph IR with float32 weights. The graph ops it puts around heads (DynamicQuantizeLinear,
MatMulInteger, ...) run as they are: ``engine.graph.quant_ops``.

A DynamicQuantizeLSTM node holds W [D, C, 4H] and R [D, H, 4H] as int8 or uint8 (transposed
against ONNX LSTM's [D, 4H, C]; gates in ONNX order i, o, f, c), each with a float32 scale and a
zero point per direction ([D]) or per output column ([D, 4H]). ``quantized_lstm_weights`` reads
and checks them; ``dequantize`` turns them into float32 ``scale * (q - zero_point)`` (exact
integers, one rounding), which the float32 engine then packs. onnxruntime also quantizes the
*activations* (X for the whole sequence and h at every step, to uint8) before its integer GEMMs;
leanrnn keeps them float32, so its output is the float32 LSTM of the dequantized weights and sits
within that activation quantization's error of onnxruntime's.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import DTypeError, ModelFormatError, WeightsError
from ..ir import Graph, Node, rnn_attrs

QLSTM = "com.microsoft::DynamicQuantizeLSTM"
# Inputs: X, W, R, B, sequence_lens, initial_h, initial_c, P, W_scale, W_zero_point, R_scale,
# R_zero_point (onnxruntime's contrib op schema).
_W, _R, _W_SCALE, _W_ZP, _R_SCALE, _R_ZP = 1, 2, 8, 9, 10, 11
_ATTRS = {
    "activation_alpha",
    "activation_beta",
    "activations",
    "clip",
    "direction",
    "hidden_size",
    "input_forget",
    "layout",  # copied from the LSTM by the quantizer; only its default 0 means anything here
}


@dataclass(frozen=True)
class QuantizedMatrix:
    """One quantized weight of a DynamicQuantizeLSTM node, as the file holds it: ``q`` [D, K, G]
    int8/uint8 (K = C for W, H for R), ``scale`` [D, G] float32 (a per-direction scale repeated
    over the columns), ``zero_point`` [D] int32 (one per direction: onnxruntime requires the
    per-column ones to be equal and uses the first)."""

    q: np.ndarray
    scale: np.ndarray
    zero_point: np.ndarray


def _fail(where: str, msg: str, cls=ModelFormatError):
    raise cls(f"[load_onnx] {where}: {msg}")


def _const(graph: Graph, node: Node, i: int, what: str, where: str) -> np.ndarray:
    name = node.inputs[i] if i < len(node.inputs) else ""
    if not name:
        _fail(where, f"has no {what} (input {i}); DynamicQuantizeLSTM needs it")
    if name not in graph.constants:
        _fail(
            where,
            f"{what} {name!r} is computed at run time; leanrnn needs DynamicQuantizeLSTM's "
            "quantized weights, scales and zero points as initializers (as quantize_dynamic "
            "writes them)",
        )
    return graph.constants[name]


def _matrix(graph, node, which: str, D: int, K: int | None, G: int, where) -> QuantizedMatrix:
    """W (``which`` = "W", K = None: the input size comes from the file) or R (K = H), checked
    against the node before anything proportional to its size is done."""
    iq, isc, izp = (_W, _W_SCALE, _W_ZP) if which == "W" else (_R, _R_SCALE, _R_ZP)
    q = _const(graph, node, iq, which, where)
    scale = _const(graph, node, isc, f"{which}_scale", where)
    zp = _const(graph, node, izp, f"{which}_zero_point", where)
    if q.dtype not in (np.int8, np.uint8):
        _fail(where, f"{which} has dtype {q.dtype}; expected int8 or uint8", DTypeError)
    want = f"[D={D}, {'C' if K is None else f'H={K}'}, 4H={G}]"
    if q.ndim != 3 or q.shape[0] != D or q.shape[2] != G or (K is not None and q.shape[1] != K):
        _fail(where, f"{which} has shape {list(q.shape)}; expected {want}", WeightsError)
    if q.shape[1] < 1:
        _fail(where, f"{which} has shape {list(q.shape)}; expected {want} with C >= 1",
              WeightsError)  # fmt: skip
    shapes = ((D,), (D, G))
    if scale.dtype != np.float32:
        _fail(where, f"{which}_scale has dtype {scale.dtype}; expected float32", DTypeError)
    if zp.dtype != q.dtype:
        _fail(where, f"{which}_zero_point has dtype {zp.dtype}; expected {q.dtype} like {which}",
              DTypeError)  # fmt: skip
    for name, a in ((f"{which}_scale", scale), (f"{which}_zero_point", zp)):
        if a.shape not in shapes:
            _fail(
                where,
                f"{name} has shape {list(a.shape)}; expected [{D}] (per direction) or "
                f"[{D}, {G}] (per output column)",
                WeightsError,
            )
    if scale.shape != zp.shape:  # onnxruntime reads the zero points in the scales' layout:
        # a per-direction zero point beside per-column scales ran its reverse direction on
        # another direction's numbers, 0.67 away from the dequantized LSTM
        _fail(
            where,
            f"{which}_scale has shape {list(scale.shape)} and {which}_zero_point "
            f"{list(zp.shape)}; expected one layout for both, [{D}] (per direction) or "
            f"[{D}, {G}] (per output column)",
            WeightsError,
        )
    if not np.isfinite(scale).all():
        _fail(where, f"{which}_scale holds non-finite values; expected finite scales",
              WeightsError)  # fmt: skip
    zp = zp.astype(np.int32).reshape(D, -1)
    if (zp != zp[:, :1]).any():
        _fail(
            where,
            f"{which}_zero_point differs between columns; onnxruntime uses one zero point per "
            "direction (re-quantize with symmetric weights, the int8 default)",
            WeightsError,
        )
    if q.dtype == np.int8 and zp.shape[1] > 1 and zp.any():
        _fail(
            where,
            f"{which}_zero_point is per column and non-zero for int8 weights; onnxruntime "
            "rejects it (per-column int8 weights must be symmetric)",
            WeightsError,
        )
    scale = np.broadcast_to(scale.reshape(D, -1), (D, G))
    # scale * (q - zero_point) must be a float32: a finite scale of 1e37 made inf weights here
    # (and NaN outputs), so the largest |q - zero_point| of each column bounds its scale
    reach = np.abs(q.astype(np.int32) - zp[:, :1, None]).max(axis=1)  # [D, G]
    if (np.abs(scale.astype(np.float64)) * reach > np.finfo(np.float32).max).any():
        _fail(where, f"{which}_scale * ({which} - {which}_zero_point) overflows float32 (a "
                     f"scale of {np.abs(scale).max():.3g}); expected the scales of quantized "
                     "weights, which keep every weight finite", WeightsError)  # fmt: skip
    return QuantizedMatrix(q, np.ascontiguousarray(scale), np.ascontiguousarray(zp[:, 0]))


def quantized_lstm_weights(
    graph: Graph, node: Node, where: str
) -> tuple[QuantizedMatrix, QuantizedMatrix, dict]:
    """(W, R, normalized LSTM attributes) of a DynamicQuantizeLSTM node, every shape, dtype and
    zero point checked. The one place the int8 values and their scales are read: the int8
    engine takes them from here (today ``lower_quantized_lstms`` dequantizes them)."""
    unknown = sorted(set(node.attrs) - _ATTRS)
    if unknown:
        _fail(where, f"has attributes {unknown} that DynamicQuantizeLSTM does not define")
    if int(node.attrs.get("layout", 0)) != 0:
        _fail(where, f"layout={node.attrs['layout']}; DynamicQuantizeLSTM is [T, N, C] (layout 0)")
    hs = node.attrs.get("hidden_size")
    if not isinstance(hs, int) or isinstance(hs, bool) or hs < 1:
        _fail(where, f"hidden_size={hs!r}; DynamicQuantizeLSTM needs a positive hidden_size")
    attrs = rnn_attrs("LSTM", node.attrs, where)
    D = 2 if attrs["direction"] == "bidirectional" else 1
    G = 4 * hs
    if len(node.inputs) != 12:
        _fail(
            where,
            f"has {len(node.inputs)} inputs; expected 12 (X, W, R, B, sequence_lens, initial_h, "
            "initial_c, P, W_scale, W_zero_point, R_scale, R_zero_point)",
        )
    W = _matrix(graph, node, "W", D, None, G, where)
    R = _matrix(graph, node, "R", D, hs, G, where)
    if W.q.dtype != R.q.dtype:  # one type parameter in the op's schema: onnxruntime refuses
        _fail(where, f"W is {W.q.dtype} and R is {R.q.dtype}; DynamicQuantizeLSTM takes one "
                     "type for both (quantize them alike)", DTypeError)  # fmt: skip
    return W, R, attrs


def dequantize(m: QuantizedMatrix) -> np.ndarray:
    """float32 [D, G, K] (ONNX LSTM's layout) = scale * (q - zero_point): the difference is an
    exact integer, so each weight is rounded once, like onnxruntime's per-column scale."""
    diff = m.q.astype(np.int32) - m.zero_point[:, None, None]
    w = diff.astype(np.float32) * m.scale[:, None, :]
    return np.ascontiguousarray(w.transpose(0, 2, 1))


def lower_quantized_lstms(graph: Graph) -> None:
    """Replace every DynamicQuantizeLSTM node of ``graph`` by an LSTM node whose W and R are
    float32 constants (dequantized; B and P are float32 already), in place. Its int8 weights,
    scales and zero points become unused constants, which packing drops."""
    taken = set(graph.constants) | {o for n in graph.nodes for o in n.outputs}
    taken |= {t.name for t in graph.inputs}
    for k, node in enumerate(graph.nodes):
        if node.op != QLSTM:
            continue
        where = f"node {node.name!r} ({node.op})"
        W, R, attrs = quantized_lstm_weights(graph, node, where)
        names = []
        for which, m in (("W", W), ("R", R)):
            name = f"{node.name}/{which}_dequantized"
            while name in taken:
                name += "_"
            taken.add(name)
            graph.constants[name] = dequantize(m)
            names.append(name)
        x, _, _, *rest = node.inputs[:8]
        graph.nodes[k] = Node(
            "LSTM", node.name, (x, *names, *rest), node.outputs, attrs, node.when
        )  # (inside an If's branch, it stays there)
