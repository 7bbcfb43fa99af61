"""The benchmark's problems: one config, its deterministic weights and inputs, the float64
reference every engine is checked against, and the one-node ONNX file ORT and MNN load.

Everything here is rebuilt from (cell, H, N, T) alone, so a fresh child process gets the same
arrays as its parent without shipping them. The reference is a batched float64 NumPy loop written
from the PyTorch equations, independent of leanrnn's kernels.
"""

from __future__ import annotations

import zlib
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

CELLS = ("lstm", "gru")
GATES = {"lstm": 4, "gru": 3}

# Max abs error (float32 engine vs the float64 reference) beyond which a row is flagged. The
# engine issue's parity bar is 1e-5 per run; 100-1000 recurrent steps add a little rounding drift.
TOLERANCE = 1e-4
# The same check for reduced-precision engines (leanrnn's bf16/int8, torch qint8, onnxruntime
# int8): loose enough for their rounding (int8 at H=1024, T=1000: ~3e-2), tight enough to flag
# garbage. Their accuracy proper is measured by benchmarks/quant_bars.py (issue 14).
REDUCED_TOLERANCE = 0.25


@dataclass(frozen=True, order=True)
class Config:
    """One benchmarked job shape: a single-layer ``cell`` with input size = hidden size ``H``.

    ``stream``: feed ``T`` single steps (N=1), carrying the state between calls, instead of one
    call over all ``T`` steps.
    """

    cell: str
    H: int
    N: int
    T: int
    stream: bool = False
    threads: int = 1

    @property
    def C(self) -> int:
        return self.H

    @property
    def G(self) -> int:
        return GATES[self.cell] * self.H

    @property
    def shape_key(self) -> str:
        """The problem's identity: the same weights, inputs and reference for all engines."""
        return f"{self.cell}-H{self.H}-N{self.N}-T{self.T}"

    @property
    def model_T(self) -> int:
        """Steps per call: 1 when streaming (MNN needs one fixed-shape model per call shape)."""
        return 1 if self.stream else self.T

    @property
    def model_key(self) -> str:
        return f"{self.cell}-H{self.H}-N{self.N}-T{self.model_T}"

    @property
    def label(self) -> str:
        shape = f"stream N={self.N} x{self.T}" if self.stream else f"N={self.N} T={self.T}"
        return f"{self.cell.upper()} H={self.H} {shape}"

    @property
    def weight_bytes(self) -> int:
        """Bytes of the recurrent weights R [H, G] in float32: what every step must read."""
        return self.H * self.G * 4

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class Problem:
    """Weights and inputs of one config, float32.

    sd: PyTorch-named parameters ``weight_ih_l0`` [G, C], ``weight_hh_l0`` [G, H],
        ``bias_ih_l0`` [G], ``bias_hh_l0`` [G]; gate order as torch (LSTM i,f,g,o; GRU r,z,n)
    x:  [T, N, C] input, time-major
    h0: [1, N, H] initial hidden state (non-zero, so state carrying is checked too)
    c0: [1, N, H] initial cell state (LSTM) or None
    """

    config: Config
    sd: dict[str, np.ndarray]
    x: np.ndarray
    h0: np.ndarray
    c0: np.ndarray | None


def _seed(*parts) -> int:
    return zlib.crc32("-".join(map(str, parts)).encode())


def make_weights(cfg: Config) -> dict[str, np.ndarray]:
    """Deterministic PyTorch-named float32 weights for (cell, H), PyTorch's U(-1/sqrt(H),
    1/sqrt(H)) initialisation."""
    H, C, G = cfg.H, cfg.C, cfg.G
    rng = np.random.default_rng(_seed("weights", cfg.cell, H))
    k = 1.0 / np.sqrt(H)

    def u(*shape):
        return rng.uniform(-k, k, size=shape).astype(np.float32)

    return {
        "weight_ih_l0": u(G, C),
        "weight_hh_l0": u(G, H),
        "bias_ih_l0": u(G),
        "bias_hh_l0": u(G),
    }


def make_problem(cfg: Config) -> Problem:
    """Weights (depend on cell, H) and inputs (depend on cell, H, N, T) for ``cfg``."""
    H, C = cfg.H, cfg.C
    sd = make_weights(cfg)
    rng = np.random.default_rng(_seed("inputs", cfg.cell, H, cfg.N, cfg.T))
    x = rng.standard_normal((cfg.T, cfg.N, C), dtype=np.float32)
    h0 = rng.uniform(-0.5, 0.5, size=(1, cfg.N, H)).astype(np.float32)
    c0 = (
        rng.uniform(-0.5, 0.5, size=(1, cfg.N, H)).astype(np.float32)
        if cfg.cell == "lstm"
        else None
    )
    return Problem(cfg, sd, x, h0, c0)


def _sigmoid(z: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        return 1.0 / (1.0 + np.exp(-z))


def reference(p: Problem) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """float64 forward of ``p``: returns (y [T, N, H], h_n [1, N, H], c_n [1, N, H] or None).

    LSTM (torch): i,f,g,o = split(x W^T + b_ih + h R^T + b_hh); c = s(f) c + s(i) tanh(g);
    h = s(o) tanh(c). GRU (torch): r,z = s(...); n = tanh(x W_n^T + b_in + r (h R_n^T + b_hn));
    h = (1 - z) n + z h.
    """
    cfg = p.config
    H = cfg.H
    W, R = (p.sd[k].astype(np.float64) for k in ("weight_ih_l0", "weight_hh_l0"))
    b_ih, b_hh = (p.sd[k].astype(np.float64) for k in ("bias_ih_l0", "bias_hh_l0"))
    T, N, C = p.x.shape
    # The input projection of all steps at once: [T*N, C] @ [C, G].
    xw = (p.x.reshape(T * N, C).astype(np.float64) @ W.T + b_ih).reshape(T, N, -1)
    Rt = np.ascontiguousarray(R.T)
    h = p.h0[0].astype(np.float64)
    c = p.c0[0].astype(np.float64) if p.c0 is not None else None
    y = np.empty((T, N, H))
    for t in range(T):
        hr = h @ Rt + b_hh
        if cfg.cell == "lstm":
            z = xw[t] + hr
            i, f, o = (_sigmoid(z[:, k * H : (k + 1) * H]) for k in (0, 1, 3))
            g = np.tanh(z[:, 2 * H : 3 * H])
            c = f * c + i * g
            h = o * np.tanh(c)
        else:
            r = _sigmoid(xw[t, :, :H] + hr[:, :H])
            zg = _sigmoid(xw[t, :, H : 2 * H] + hr[:, H : 2 * H])
            n = np.tanh(xw[t, :, 2 * H :] + r * hr[:, 2 * H :])
            h = (1.0 - zg) * n + zg * h
        y[t] = h
    return y, h[None], (c[None] if c is not None else None)


def reference_file(cfg: Config, cache_dir: Path) -> Path:
    """The reference of ``cfg``'s problem as ``.npz`` (y, h_n[, c_n]), computed once and cached."""
    path = Path(cache_dir) / f"ref-{cfg.shape_key}.npz"
    if not path.exists():
        path.parent.mkdir(parents=True, exist_ok=True)
        y, h_n, c_n = reference(make_problem(cfg))
        arrays = {"y": y, "h_n": h_n} | ({"c_n": c_n} if c_n is not None else {})
        tmp = path.with_suffix(".tmp.npz")
        np.savez(tmp, **arrays)
        tmp.replace(path)
    return path


def compare(out, ref_path: Path, tolerance: float = TOLERANCE) -> dict:
    """Max abs error of an engine's (y, h_n, c_n) against the saved reference, per output;
    ``ok`` when every one is within ``tolerance``."""
    names = ("y", "h_n", "c_n")
    errs: dict[str, float] = {}
    with np.load(ref_path) as ref:
        for name, got in zip(names, out, strict=False):
            if name not in ref.files:
                continue
            want = ref[name]
            if got is None or np.size(got) != want.size:
                errs[name] = float("inf")
                continue
            diff = np.abs(np.asarray(got).reshape(want.shape).astype(np.float64) - want)
            errs[name] = float(np.nanmax(diff)) if not np.isnan(diff).any() else float("nan")
    worst = max(errs.values()) if errs else float("nan")
    ok = bool(errs) and all(e <= tolerance for e in errs.values())  # NaN compares False
    return {"max_abs_err": errs, "worst": worst, "tolerance": tolerance, "ok": ok}


# ONNX gate orders differ from torch: LSTM i,o,f,c (torch i,f,g,o); GRU z,r,h (torch r,z,n).
_ONNX_FROM_TORCH = {"lstm": (0, 3, 1, 2), "gru": (1, 0, 2)}


def _to_onnx_order(cell: str, a: np.ndarray, H: int) -> np.ndarray:
    return np.concatenate([a[k * H : (k + 1) * H] for k in _ONNX_FROM_TORCH[cell]], axis=0)


def write_onnx(cfg: Config, path: Path) -> Path:
    """A one-node ONNX LSTM/GRU with ``cfg``'s weights and fixed shapes [model_T, N, C].

    Inputs X, initial_h (and initial_c); outputs Y [T, 1, N, H], Y_h, (Y_c). GRU uses
    linear_before_reset=1, PyTorch's formula.
    """
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    sd = make_weights(cfg)
    H, N, T, C = cfg.H, cfg.N, cfg.model_T, cfg.C
    W = _to_onnx_order(cfg.cell, sd["weight_ih_l0"], H)[None]
    R = _to_onnx_order(cfg.cell, sd["weight_hh_l0"], H)[None]
    B = np.concatenate([_to_onnx_order(cfg.cell, sd[k], H) for k in ("bias_ih_l0", "bias_hh_l0")])[
        None
    ]
    inits = [numpy_helper.from_array(a, n) for a, n in ((W, "W"), (R, "R"), (B, "B"))]
    f32 = TensorProto.FLOAT
    ins = [
        helper.make_tensor_value_info("X", f32, [T, N, C]),
        helper.make_tensor_value_info("initial_h", f32, [1, N, H]),
    ]
    outs = [
        helper.make_tensor_value_info("Y", f32, [T, 1, N, H]),
        helper.make_tensor_value_info("Y_h", f32, [1, N, H]),
    ]
    node_in = ["X", "W", "R", "B", "", "initial_h"]
    node_out = ["Y", "Y_h"]
    attrs: dict = {"hidden_size": H}
    if cfg.cell == "lstm":
        ins.append(helper.make_tensor_value_info("initial_c", f32, [1, N, H]))
        outs.append(helper.make_tensor_value_info("Y_c", f32, [1, N, H]))
        node_in.append("initial_c")
        node_out.append("Y_c")
    else:
        attrs["linear_before_reset"] = 1
    node = helper.make_node(cfg.cell.upper(), node_in, node_out, **attrs)
    graph = helper.make_graph([node], cfg.model_key, ins, outs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8  # readable by every onnxruntime and MNN converter in use
    onnx.checker.check_model(model)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    onnx.save(model, path)
    return path
