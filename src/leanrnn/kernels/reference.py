"""The float64 NumPy oracle: the spec's math written out one sample and one step at a time.

Slow on purpose; every fast kernel is tested against it, and it is tested against torch and ORT.
"""

from __future__ import annotations

import numpy as np

from ..errors import LengthsError, ShapeError, SpecError
from ..formats.packing import TORCH_ORDER, LayerWeights, reorder_gates
from ..spec import Activation, RNNSpec

__all__ = ["activation", "layers_from_torch", "reference_forward"]


def activation(name: str, x, alpha: float = 0.0, beta: float = 0.0) -> np.ndarray:
    """ONNX RNN activation ``name`` (any case) applied to ``x`` in float64.

    Formulas as onnxruntime computes them; note ``ThresholdedRelu`` is strict: x if x > alpha.
    """
    x = np.asarray(x, dtype=np.float64)
    key = name.lower()
    if key == "sigmoid":
        with np.errstate(over="ignore", under="ignore"):  # exp(-x) = inf gives the limit 0
            return 1.0 / (1.0 + np.exp(-x))
    if key == "tanh":
        return np.tanh(x)
    if key == "relu":
        return np.maximum(x, 0.0)
    if key == "affine":
        return alpha * x + beta
    if key == "leakyrelu":
        return np.where(x >= 0.0, x, alpha * x)
    if key == "thresholdedrelu":
        return np.where(x > alpha, x, 0.0)
    if key == "scaledtanh":
        return alpha * np.tanh(beta * x)
    if key == "hardsigmoid":
        return np.minimum(np.maximum(alpha * x + beta, 0.0), 1.0)
    if key == "elu":
        return np.where(x >= 0.0, x, alpha * np.expm1(np.minimum(x, 0.0)))
    if key == "softsign":
        return x / (1.0 + np.abs(x))
    if key == "softplus":
        return np.logaddexp(0.0, x)  # log(1 + exp(x)) without overflow
    raise SpecError(f"[activation] unknown activation {name!r}")


def _act(a: Activation, x: np.ndarray) -> np.ndarray:
    return activation(a.name, x, a.alpha, a.beta)


def _f64(a) -> np.ndarray | None:
    return None if a is None else np.asarray(a, dtype=np.float64)


def _same(a):
    return a


def _lstm_step(spec, w, acts, x, h, c, op=_same):
    H = spec.hidden_size
    f_act, g_act, h_act = acts
    W, R, b = w["W"], w["R"], w["bW"] + w["bR"]
    peep, clip = w["peep"], spec.clip
    xo, ho = op(x), op(h)

    def pre(k, extra=0.0):
        s = slice(k * H, (k + 1) * H)
        z = W[s] @ xo + R[s] @ ho + b[s] + extra
        return z if clip is None else np.clip(z, -clip, clip)

    i = _act(f_act, pre(0, 0.0 if peep is None else peep[0] * c))
    if spec.input_forget:
        f = 1.0 - i
    else:
        f = _act(f_act, pre(1, 0.0 if peep is None else peep[1] * c))
    g = _act(g_act, pre(2))
    c_new = f * c + i * g
    o = _act(f_act, pre(3, 0.0 if peep is None else peep[2] * c_new))
    h_new = o * _act(h_act, c_new)
    if w["proj"] is not None:
        h_new = w["proj"] @ h_new
    return h_new, c_new


def _gru_step(spec, w, acts, x, h, op=_same):
    H = spec.hidden_size
    f_act, g_act = acts
    W, R, bW, bR, clip = w["W"], w["R"], w["bW"], w["bR"], spec.clip
    z_, r_, n_ = (slice(k * H, (k + 1) * H) for k in range(3))
    xo, ho = op(x), op(h)

    def cl(v):
        return v if clip is None else np.clip(v, -clip, clip)

    z = _act(f_act, cl(W[z_] @ xo + R[z_] @ ho + bW[z_] + bR[z_]))
    r = _act(f_act, cl(W[r_] @ xo + R[r_] @ ho + bW[r_] + bR[r_]))
    if spec.linear_before_reset:
        n = _act(g_act, cl(W[n_] @ xo + bW[n_] + r * (R[n_] @ ho + bR[n_])))
    else:
        n = _act(g_act, cl(W[n_] @ xo + bW[n_] + R[n_] @ op(r * h) + bR[n_]))
    return (1.0 - z) * n + z * h


def _rnn_step(spec, w, acts, x, h, op=_same):
    (f_act,) = acts
    z = w["W"] @ op(x) + w["R"] @ op(h) + w["bW"] + w["bR"]
    if spec.clip is not None:
        z = np.clip(z, -spec.clip, spec.clip)
    return _act(f_act, z)


def _run_direction(spec, w, acts, x, h0, c0, lengths, reverse, op=_same):
    """One direction of one layer. x [T, N, C]; h0 [N, K]; c0 [N, H] or None."""
    T, N, _ = x.shape
    y = np.zeros((T, N, spec.output_size))
    h_n = h0.copy()
    c_n = None if c0 is None else c0.copy()
    for n in range(N):
        h = h0[n]
        c = None if c0 is None else c0[n]
        steps = range(int(lengths[n]))
        for t in reversed(steps) if reverse else steps:
            if spec.cell == "lstm":
                h, c = _lstm_step(spec, w, acts, x[t, n], h, c, op)
            elif spec.cell == "gru":
                h = _gru_step(spec, w, acts, x[t, n], h, op)
            else:
                h = _rnn_step(spec, w, acts, x[t, n], h, op)
            y[t, n] = h
        h_n[n] = h
        if c_n is not None:
            c_n[n] = c
    return y, h_n, c_n


def _weights(spec: RNNSpec, layer: int, lw) -> dict:
    G, K, H, C = spec.gate_width, spec.output_size, spec.hidden_size, spec.layer_input_size(layer)
    w = {
        "W": _f64(lw.W),
        "R": _f64(lw.R),
        "bW": np.zeros(G) if lw.bW is None else _f64(lw.bW),
        "bR": np.zeros(G) if lw.bR is None else _f64(lw.bR),
        "peep": _f64(lw.peep) if spec.peepholes else None,
        "proj": _f64(lw.proj) if spec.proj_size else None,
    }
    want = [("W", (G, C)), ("R", (G, K)), ("bW", (G,)), ("bR", (G,))]
    if spec.peepholes:
        want.append(("peep", (3, H)))
    if spec.proj_size:
        want.append(("proj", (spec.proj_size, H)))
    for name, shape in want:
        if w[name] is None:
            raise ShapeError(f"[reference_forward] layer {layer}: {name} is missing")
        if w[name].shape != shape:
            raise ShapeError(
                f"[reference_forward] layer {layer} {name} has shape {w[name].shape}; "
                f"expected {shape}"
            )
    return w


def reference_forward(spec: RNNSpec, layers, x, h0=None, c0=None, lengths=None, operand=None):
    """Run the stack described by ``spec`` in float64. Returns ``(y, h_n, c_n)``.

    ``x`` [T, N, C] ([N, T, C] if batch_first); ``h0`` [L*D, N, K]; ``c0`` [L*D, N, H] (LSTM);
    ``lengths`` [N] ints in [0, T] or None. ``y`` is [T, N, D*K] ([N, T, D*K] if batch_first),
    forward direction first, zero at t >= lengths[n]; ``h_n`` [L*D, N, K]; ``c_n`` [L*D, N, H] or
    None. Final states come from each sample's last valid step (the initial state if length 0).
    Biases are added as given (converters supply zeros for bias=False). ``operand``: a function
    applied to every vector a weight matrix multiplies (x, h, the GRU's r*h) — the rounding of
    dynamically quantized activations; None: as they are.
    """
    op = _same if operand is None else operand
    x = np.asarray(x, dtype=np.float64)
    if x.ndim != 3:
        raise ShapeError(f"[reference_forward] x has shape {x.shape}; expected rank 3")
    if spec.batch_first:
        x = x.transpose(1, 0, 2)
    T, N, C = x.shape
    if C != spec.input_size:
        raise ShapeError(f"[reference_forward] x has {C} features; expected {spec.input_size}")
    L, D, H, K = spec.num_layers, spec.num_directions, spec.hidden_size, spec.output_size
    if len(layers) != L or any(len(d) != D for d in layers):
        raise ShapeError(
            f"[reference_forward] layers is {[len(d) for d in layers]}; expected {L} x {D}"
        )
    h0 = np.zeros((L * D, N, K)) if h0 is None else np.asarray(h0, dtype=np.float64)
    if h0.shape != (L * D, N, K):
        raise ShapeError(f"[reference_forward] h0 has shape {h0.shape}; expected {(L * D, N, K)}")
    lstm = spec.cell == "lstm"
    if lstm:
        c0 = np.zeros((L * D, N, H)) if c0 is None else np.asarray(c0, dtype=np.float64)
        if c0.shape != (L * D, N, H):
            raise ShapeError(
                f"[reference_forward] c0 has shape {c0.shape}; expected {(L * D, N, H)}"
            )
    elif c0 is not None:
        raise ShapeError("[reference_forward] c0 is only for LSTM")
    if lengths is None:
        lengths = np.full(N, T, dtype=np.int64)
    else:
        lengths = np.asarray(lengths)
        if lengths.shape != (N,) or not np.issubdtype(lengths.dtype, np.integer):
            raise LengthsError(
                f"[reference_forward] lengths has shape {lengths.shape} and dtype "
                f"{lengths.dtype}; expected [{N}] ints"
            )
        if np.any(lengths < 0) or np.any(lengths > T):
            raise LengthsError(f"[reference_forward] lengths {lengths.tolist()} not in [0, {T}]")

    h_n = np.zeros((L * D, N, K))
    c_n = np.zeros((L * D, N, H)) if lstm else None
    inp = x
    for layer in range(L):
        outs = []
        for d in range(D):
            k = layer * D + d
            y_d, h_n[k], c_k = _run_direction(
                spec,
                _weights(spec, layer, layers[layer][d]),
                spec.activations[d],
                inp,
                h0[k],
                c0[k] if lstm else None,
                lengths,
                spec.reversed_direction(d),
                op,
            )
            if lstm:
                c_n[k] = c_k
            outs.append(y_d)
        inp = np.concatenate(outs, axis=2)
    y = inp.transpose(1, 0, 2) if spec.batch_first else inp
    return y, h_n, c_n


def layers_from_torch(module) -> tuple[RNNSpec, list[list[LayerWeights]]]:
    """(spec, canonical float64 weights) of a ``torch.nn.LSTM`` / ``GRU`` / ``RNN``."""
    import torch

    if isinstance(module, torch.nn.LSTM):
        cell = "lstm"
    elif isinstance(module, torch.nn.GRU):
        cell = "gru"
    elif isinstance(module, torch.nn.RNN):
        cell = "rnn"
    else:
        raise SpecError(
            f"[layers_from_torch] expected nn.LSTM/GRU/RNN, got {type(module).__name__}"
        )
    D = 2 if module.bidirectional else 1
    activations = None
    if cell == "rnn" and module.nonlinearity == "relu":
        activations = tuple((Activation.make("relu"),) for _ in range(D))
    spec = RNNSpec(
        cell=cell,
        input_size=module.input_size,
        hidden_size=module.hidden_size,
        num_layers=module.num_layers,
        direction="bidirectional" if D == 2 else "forward",
        proj_size=getattr(module, "proj_size", 0),
        bias=module.bias,
        batch_first=module.batch_first,
        activations=activations,
        linear_before_reset=True,
    )
    H, G, order = spec.hidden_size, spec.gate_width, TORCH_ORDER[cell]

    def get(name):
        t = getattr(module, name, None)
        return None if t is None else t.detach().cpu().to(torch.float64).numpy().copy()

    layers = []
    for layer in range(spec.num_layers):
        dirs = []
        for d in range(D):
            sfx = f"l{layer}" + ("_reverse" if d == 1 else "")
            bW, bR = get(f"bias_ih_{sfx}"), get(f"bias_hh_{sfx}")
            dirs.append(
                LayerWeights(
                    W=reorder_gates(get(f"weight_ih_{sfx}"), order, H),
                    R=reorder_gates(get(f"weight_hh_{sfx}"), order, H),
                    bW=np.zeros(G) if bW is None else reorder_gates(bW, order, H),
                    bR=np.zeros(G) if bR is None else reorder_gates(bR, order, H),
                    peep=None,
                    proj=get(f"weight_hr_{sfx}") if spec.proj_size else None,
                )
            )
        layers.append(dirs)
    return spec, layers
