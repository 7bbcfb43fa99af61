"""The engines a user would pick instead of leanrnn, behind one small interface.

An engine is created in a fresh child process with the thread count already in the environment
(see ``harness``); ``__init__`` imports its library and applies the thread setting, ``load`` builds
the model (counted in the cold figure), ``forward`` runs the whole sequence, ``stream`` runs it one
step per call with the state carried. Both return ``(y [T, N, H], h_n [1, N, H], c_n or None)``
as NumPy arrays; they may be views of engine-owned buffers, valid until the next call.

Engines are looked up by name in ``ENGINES``, or as ``"package.module:Class"`` for your own.
"""

from __future__ import annotations

import importlib
import importlib.util
from pathlib import Path

import numpy as np

from .problem import REDUCED_TOLERANCE, TOLERANCE, Config, Problem


class Engine:
    """Base class. Subclasses set ``name``, ``requires`` (modules that must be importable) and
    ``files`` (model files the harness prepares: ``"onnx"``, ``"mnn"``); reduced-precision
    engines also their ``precision`` and the looser ``tolerance`` their outputs are checked to."""

    name = "?"
    description = ""
    requires: tuple[str, ...] = ()
    files: tuple[str, ...] = ()
    precision = "float"  # or "bf16", "int8" (weights), "int8-dynamic" (weights and activations)
    tolerance = TOLERANCE

    @classmethod
    def unavailable(cls) -> str | None:
        """Why this engine cannot run here, or None. Looks modules up without importing them."""
        missing = [m for m in cls.requires if importlib.util.find_spec(m) is None]
        if not missing:
            return None
        return f"not installed: {', '.join(missing)} (pip install 'leanrnn[bench]')"

    @classmethod
    def unsupported(cls, cfg: Config) -> str | None:
        """Why this engine cannot run ``cfg`` (its row is then marked unavailable), or None."""
        return None

    def __init__(self, threads: int) -> None:
        self.threads = threads

    def thread_info(self) -> dict:
        """What the library reports about its threads, for the JSON (proof of enforcement)."""
        return {}

    def ran_on(self) -> dict:
        """After the first forward: what the library resolved to run on, for the JSON and the
        report (leanrnn: the kernel backend, which may have fallen back to the JIT)."""
        return {}

    def load(self, p: Problem, files: dict[str, str]) -> None:
        raise NotImplementedError

    def forward(self):
        raise NotImplementedError

    def stream(self, steps: int):
        raise NotImplementedError


# --------------------------------------------------------------------------------- leanrnn
class LeanRNN(Engine):
    name = "leanrnn"
    description = "leanrnn Session.run(..., out=...) into preallocated outputs"
    requires = ("leanrnn",)

    def __init__(self, threads: int) -> None:
        super().__init__(threads)
        import leanrnn

        self._lr = leanrnn
        leanrnn.set_num_threads(threads)

    def thread_info(self) -> dict:
        # The backend asked for, not resolved: resolving loads the kernels, which belongs to
        # the cold measurement (load + first forward).
        return {"leanrnn": self._lr.get_num_threads(), "backend": self._lr.config.backend()}

    def ran_on(self) -> dict:
        from ..engine import kernel_backend

        return {"kernels": kernel_backend()}

    def _model(self, p: Problem):
        return self._lr.Model.from_state_dict(p.sd)

    def load(self, p: Problem, files) -> None:
        cfg = p.config
        self.p = p
        self.model = self._model(p)
        self.session = self.model.session
        lstm = cfg.cell == "lstm"
        # Every output buffer allocated once, here; run(..., out=...) then needs no new arrays.
        self.y = np.empty((cfg.T, cfg.N, cfg.H), np.float32)
        self.h_n = np.empty((1, cfg.N, cfg.H), np.float32)
        self.c_n = np.empty((1, cfg.N, cfg.H), np.float32) if lstm else None
        self.out = (self.y, self.h_n, self.c_n) if lstm else (self.y, self.h_n)
        if cfg.stream:
            # Session.stream (issue 4): state carried in the stream, y_t written into y[t].
            self._stream = self.session.stream(batch=cfg.N)

    def forward(self):
        self.session.run(self.p.x, self.p.h0, self.p.c0, None, out=self.out)
        return self.y, self.h_n, self.c_n

    def stream(self, steps: int):
        s, x, y = self._stream, self.p.x, self.y
        s.state = (self.p.h0, self.p.c0)
        for t in range(steps):
            s.feed(x[t], out=y[t])  # one step: x [N, C] -> y [N, H]
        h, c = s.state  # a copy of 2 x [1, N, H]: once per call, not per step
        return y[:steps], h, c


class LeanRNNReduced(LeanRNN):
    """leanrnn on the same weights quantized by ``leanrnn.quantize(model, precision)`` at load
    (counted in the cold figure), as a user would after loading a float32 model."""

    precision = "int8-dynamic"
    tolerance = REDUCED_TOLERANCE
    reduce_range = False

    def _model(self, p: Problem):
        model = super()._model(p)
        if self.reduce_range:
            return self._lr.quantize(model, self.precision, reduce_range=True)
        return self._lr.quantize(model, self.precision)


class LeanRNNInt8Dynamic(LeanRNNReduced):
    name = "leanrnn-int8-dynamic"
    description = "leanrnn, int8 weights and activations (quantize(m, 'int8-dynamic'))"


class LeanRNNInt8Dynamic7(LeanRNNReduced):
    name = "leanrnn-int8-dynamic-7bit"
    description = ("leanrnn, 7-bit weights and int8 activations (quantize(m, 'int8-dynamic', "
                   "reduce_range=True): AVX2's faster integer products)")  # fmt: skip
    reduce_range = True


class LeanRNNInt8(LeanRNNReduced):
    name = "leanrnn-int8"
    description = "leanrnn, int8 weights, float32 activations (quantize(m, 'int8'))"
    precision = "int8"


class LeanRNNBf16(LeanRNNReduced):
    name = "leanrnn-bf16"
    description = "leanrnn, bfloat16 weights (quantize(m, 'bf16'))"
    precision = "bf16"


class LeanRNNBf16Act(LeanRNNReduced):
    name = "leanrnn-bf16-act"
    description = "leanrnn, bfloat16 weights and activations (quantize(m, 'bf16-act'))"
    precision = "bf16-act"


# --------------------------------------------------------------------------------- NumPy
def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


class NumpyNaive(Engine):
    """What people write first: a per-step loop, both products every step, fresh arrays."""

    name = "numpy-naive"
    description = "NumPy per-step loop, new arrays every step"
    requires = ("numpy",)

    def load(self, p: Problem, files) -> None:
        self.p = p
        self.W, self.R = p.sd["weight_ih_l0"], p.sd["weight_hh_l0"]
        self.b_ih, self.b_hh = p.sd["bias_ih_l0"], p.sd["bias_hh_l0"]

    def _step(self, x, h, c):
        H = self.p.config.H
        gi = x @ self.W.T + self.b_ih
        gh = h @ self.R.T + self.b_hh
        if c is not None:
            g = gi + gh
            i, f, gg, o = g[:, :H], g[:, H : 2 * H], g[:, 2 * H : 3 * H], g[:, 3 * H :]
            c = _sigmoid(f) * c + _sigmoid(i) * np.tanh(gg)
            h = _sigmoid(o) * np.tanh(c)
            return h, c
        r = _sigmoid(gi[:, :H] + gh[:, :H])
        z = _sigmoid(gi[:, H : 2 * H] + gh[:, H : 2 * H])
        n = np.tanh(gi[:, 2 * H :] + r * gh[:, 2 * H :])
        return (1 - z) * n + z * h, None

    def _run(self, steps: int):
        p = self.p
        h = p.h0[0]
        c = p.c0[0] if p.c0 is not None else None
        ys = []
        for t in range(steps):
            h, c = self._step(p.x[t], h, c)
            ys.append(h)
        return np.stack(ys), h[None], (c[None] if c is not None else None)

    def forward(self):
        return self._run(self.p.config.T)

    def stream(self, steps: int):
        return self._run(steps)  # it already is one call per step


class NumpyPrealloc(Engine):
    """The careful NumPy version: input projection for all steps as one GEMM, every buffer
    allocated once, nonlinearities in place (``out=``)."""

    name = "numpy-prealloc"
    description = "NumPy, hoisted input GEMM, preallocated in-place buffers"
    requires = ("numpy",)

    def load(self, p: Problem, files) -> None:
        cfg = p.config
        T, N, H, G = cfg.T, cfg.N, cfg.H, cfg.G
        self.p = p
        self.Wt = np.ascontiguousarray(p.sd["weight_ih_l0"].T)  # [C, G]
        self.Rt = np.ascontiguousarray(p.sd["weight_hh_l0"].T)  # [H, G]
        self.b_ih, self.b_hh = p.sd["bias_ih_l0"], p.sd["bias_hh_l0"]
        lstm = cfg.cell == "lstm"
        # LSTM folds both biases into the projection; GRU must keep b_hn inside r * (...).
        self.b_x = self.b_ih + self.b_hh if lstm else self.b_ih.copy()
        if not lstm:
            self.b_x[: 2 * H] += self.b_hh[: 2 * H]
        self.xw = np.empty((T, N, G), np.float32)
        self.gh = np.empty((N, G), np.float32)
        self.tmp = np.empty((N, H), np.float32)
        self.y = np.empty((T, N, H), np.float32)
        self.h = np.empty((N, H), np.float32)
        self.c = np.empty((N, H), np.float32) if lstm else None
        self.xw1 = np.empty((1, N, G), np.float32)

    @staticmethod
    def _sigmoid_(a) -> None:
        np.negative(a, out=a)
        np.exp(a, out=a)
        a += 1.0
        np.reciprocal(a, out=a)

    def _recur(self, xw_t, y_t) -> None:
        H, h, c, gh, tmp = self.p.config.H, self.h, self.c, self.gh, self.tmp
        np.matmul(h, self.Rt, out=gh)
        if c is not None:
            gh += xw_t
            i, f, g, o = gh[:, :H], gh[:, H : 2 * H], gh[:, 2 * H : 3 * H], gh[:, 3 * H :]
            self._sigmoid_(gh[:, :H])
            self._sigmoid_(gh[:, H : 2 * H])
            self._sigmoid_(o)
            np.tanh(g, out=g)
            c *= f
            np.multiply(i, g, out=tmp)
            c += tmp
            np.tanh(c, out=tmp)
            np.multiply(o, tmp, out=h)
        else:
            gh[:, 2 * H :] += self.b_hh[2 * H :]
            rz = gh[:, : 2 * H]
            rz += xw_t[:, : 2 * H]
            self._sigmoid_(rz)
            r, z, n = gh[:, :H], gh[:, H : 2 * H], gh[:, 2 * H :]
            n *= r
            n += xw_t[:, 2 * H :]
            np.tanh(n, out=n)
            # h = n + z * (h - n)
            h -= n
            h *= z
            h += n
        y_t[...] = h

    def _reset(self) -> None:
        self.h[...] = self.p.h0[0]
        if self.c is not None:
            self.c[...] = self.p.c0[0]

    def _state(self):
        return self.h[None], (self.c[None] if self.c is not None else None)

    def forward(self):
        p = self.p
        T, N, C = p.x.shape
        np.matmul(p.x.reshape(T * N, C), self.Wt, out=self.xw.reshape(T * N, -1))
        self.xw += self.b_x
        self._reset()
        for t in range(T):
            self._recur(self.xw[t], self.y[t])
        return (self.y, *self._state())

    def stream(self, steps: int):
        self._reset()
        xw = self.xw1[0]
        for t in range(steps):
            np.matmul(self.p.x[t], self.Wt, out=xw)
            xw += self.b_x
            self._recur(xw, self.y[t])
        return (self.y[:steps], *self._state())


# --------------------------------------------------------------------------------- torch
class Torch(Engine):
    name = "torch"
    description = "torch.nn.LSTM/GRU in inference_mode, default (oneDNN) path"
    requires = ("torch",)
    onednn = True

    def __init__(self, threads: int) -> None:
        super().__init__(threads)
        import torch

        self.torch = torch
        torch.set_num_threads(threads)
        torch.set_num_interop_threads(1)
        if not self.onednn:
            # Entered once for the life of the child process: no per-call context overhead.
            self._flags = torch.backends.mkldnn.flags(enabled=False)
            self._flags.__enter__()

    def thread_info(self) -> dict:
        t = self.torch
        return {
            "torch": t.get_num_threads(),
            "torch_interop": t.get_num_interop_threads(),
            "mkldnn_enabled": bool(t.backends.mkldnn.enabled),
        }

    def load(self, p: Problem, files) -> None:
        torch, cfg = self.torch, p.config
        cls = torch.nn.LSTM if cfg.cell == "lstm" else torch.nn.GRU
        self.m = cls(cfg.C, cfg.H).eval()
        with torch.no_grad():
            self.m.load_state_dict({k: torch.from_numpy(v) for k, v in p.sd.items()})
        self.p = p
        self.x = torch.from_numpy(p.x)
        self.x_steps = [self.x[t : t + 1] for t in range(cfg.T)]
        self.h0 = torch.from_numpy(p.h0)
        self.c0 = torch.from_numpy(p.c0) if p.c0 is not None else None
        self.y = np.empty((cfg.T, cfg.N, cfg.H), np.float32)

    def _call(self, x, h, c):
        if c is None:
            y, h = self.m(x, h)
            return y, h, None
        y, (h, c) = self.m(x, (h, c))
        return y, h, c

    def forward(self):
        with self.torch.inference_mode():
            y, h, c = self._call(self.x, self.h0, self.c0)
        return y.numpy(), h.numpy(), (c.numpy() if c is not None else None)

    def stream(self, steps: int):
        h, c = self.h0, self.c0
        with self.torch.inference_mode():
            for t in range(steps):
                y, h, c = self._call(self.x_steps[t], h, c)
                self.y[t] = y.numpy()[0]
        return self.y[:steps], h.numpy(), (c.numpy() if c is not None else None)


class TorchNoDNNL(Torch):
    name = "torch-nodnnl"
    description = "torch as above inside torch.backends.mkldnn.flags(enabled=False)"
    onednn = False


class TorchQint8(Torch):
    """torch's dynamic quantization, the int8 path torch users take: int8 weights, activations
    quantized as it runs. ``quantize_dynamic`` swaps child modules only, so the RNN goes in a
    container and comes back out."""

    name = "torch-qint8"
    description = "torch.ao.quantization.quantize_dynamic(..., dtype=torch.qint8)"
    precision = "int8-dynamic"
    tolerance = REDUCED_TOLERANCE

    def load(self, p: Problem, files) -> None:
        import warnings

        import torch.ao.quantization as tq

        super().load(p, files)
        torch = self.torch
        with warnings.catch_warnings():  # its deprecation notice
            warnings.simplefilter("ignore")
            box = tq.quantize_dynamic(
                torch.nn.Sequential(self.m), {torch.nn.LSTM, torch.nn.GRU}, dtype=torch.qint8
            )
        self.m = box[0]


# --------------------------------------------------------------------------------- ONNX Runtime
class OnnxRuntime(Engine):
    name = "onnxruntime"
    description = "onnxruntime InferenceSession on a one-node ONNX LSTM/GRU"
    requires = ("onnxruntime", "onnx")
    files = ("onnx",)

    def __init__(self, threads: int) -> None:
        super().__init__(threads)
        import onnxruntime as ort

        self.ort = ort

    def thread_info(self) -> dict:
        return {"intra_op_num_threads": self.threads, "inter_op_num_threads": 1}

    def load(self, p: Problem, files) -> None:
        ort = self.ort
        so = ort.SessionOptions()
        so.intra_op_num_threads = self.threads
        so.inter_op_num_threads = 1
        so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        self.s = ort.InferenceSession(files["onnx"], so, providers=["CPUExecutionProvider"])
        self.p = p
        self.lstm = p.c0 is not None
        self.y = np.empty((*p.x.shape[:2], p.config.H), np.float32)

    def _feeds(self, x, h, c) -> dict:
        feeds = {"X": x, "initial_h": h}
        if self.lstm:
            feeds["initial_c"] = c
        return feeds

    def forward(self):
        p = self.p
        out = self.s.run(None, self._feeds(p.x, p.h0, p.c0))
        y = out[0][:, 0]  # Y is [T, num_directions=1, N, H]
        return y, out[1], (out[2] if self.lstm else None)

    def stream(self, steps: int):
        p = self.p
        h, c = p.h0, p.c0
        for t in range(steps):
            out = self.s.run(None, self._feeds(p.x[t : t + 1], h, c))
            self.y[t] = out[0][0, 0]
            h = out[1]
            c = out[2] if self.lstm else None
        return self.y[:steps], h, c


class OnnxRuntimeInt8(OnnxRuntime):
    """onnxruntime on the same ONNX file after ``onnxruntime.quantization.quantize_dynamic``
    (int8 weights: a ``DynamicQuantizeLSTM`` node), quantized once per file and kept beside it."""

    name = "onnxruntime-int8"
    description = "onnxruntime on quantize_dynamic(..., QInt8) of the ONNX file"
    precision = "int8-dynamic"
    tolerance = REDUCED_TOLERANCE

    @classmethod
    def unsupported(cls, cfg: Config) -> str | None:
        if cfg.cell != "lstm":
            return "onnxruntime's quantize_dynamic quantizes LSTM only (a GRU stays float32)"
        return None

    def load(self, p: Problem, files) -> None:
        src = Path(files["onnx"])
        dst = src.with_suffix(".int8.onnx")
        if not dst.exists():
            import contextlib
            import io
            import logging
            import os
            import warnings

            from onnxruntime.quantization import QuantType, quantize_dynamic

            tmp = dst.with_suffix(f".{os.getpid()}.tmp")
            logging.getLogger().setLevel(logging.ERROR)  # its pre-processing advice
            with contextlib.redirect_stdout(io.StringIO()), warnings.catch_warnings():
                warnings.simplefilter("ignore")
                quantize_dynamic(str(src), str(tmp), weight_type=QuantType.QInt8)
            tmp.replace(dst)
        super().load(p, {**files, "onnx": str(dst)})


# --------------------------------------------------------------------------------- MNN
class MNNEngine(Engine):
    """MNN's Module API on a model converted (fixed shapes) from the same ONNX file.

    Never imports ``MNN.tools``: that module runs pip and sends telemetry when imported. The
    harness converts through the ``_tools`` extension in a subprocess (``convert_mnn``).
    """

    name = "mnn"
    description = "MNN nn.load_module_from_file, model converted from the same ONNX"
    requires = ("MNN",)
    files = ("mnn",)

    def __init__(self, threads: int) -> None:
        super().__init__(threads)
        import MNN

        self.nn, self.F = MNN.nn, MNN.expr

    def thread_info(self) -> dict:
        return {"numThread": self.threads}

    def load(self, p: Problem, files) -> None:
        lstm = p.c0 is not None
        # precision "high" keeps fp32 math; "normal" may pick bf16/fp16 kernels on some CPUs.
        cfg = {"backend": "CPU", "numThread": self.threads, "precision": "high"}
        self.rt = self.nn.create_runtime_manager((cfg,))
        ins = ["X", "initial_h"] + (["initial_c"] if lstm else [])
        outs = ["Y", "Y_h"] + (["Y_c"] if lstm else [])
        self.m = self.nn.load_module_from_file(files["mnn"], ins, outs, runtime_manager=self.rt)
        self.p = p
        self.lstm = lstm
        self.y = np.empty((*p.x.shape[:2], p.config.H), np.float32)

    def _var(self, a: np.ndarray):
        return self.F.const(a, list(a.shape), self.F.NCHW)

    def _run(self, x, h, c):
        ins = [x, h] + ([c] if self.lstm else [])
        return self.m.forward(ins)

    def forward(self):
        p = self.p
        out = self._run(self._var(p.x), self._var(p.h0), self._var(p.c0) if self.lstm else None)
        y = np.asarray(out[0].read())[:, 0]
        h = np.asarray(out[1].read())
        c = np.asarray(out[2].read()) if self.lstm else None
        return y, h, c

    def stream(self, steps: int):
        p = self.p
        h = self._var(p.h0)
        c = self._var(p.c0) if self.lstm else None
        for t in range(steps):
            out = self._run(self._var(p.x[t : t + 1]), h, c)
            self.y[t] = np.asarray(out[0].read())[0, 0]
            h = out[1]
            c = out[2] if self.lstm else None
        hn = np.asarray(h.read())
        cn = np.asarray(c.read()) if self.lstm else None
        return self.y[:steps], hn, cn


# The converter's own Python wrapper (MNN/tools/mnnconvert.py) calls exactly this; we skip the
# wrapper because importing MNN.tools pip-installs a logging SDK and sends telemetry. The call
# returns True even on failure: success is the output file plus "Converted Success" in the log.
_MNN_CONVERT = "import sys, _tools; _tools.mnnconvert(sys.argv)"


def convert_mnn_command(onnx_path: Path, mnn_path: Path) -> list[str]:
    """argv for a child process converting ``onnx_path`` to ``mnn_path`` with MNNConvert."""
    import sys

    return [
        sys.executable,
        "-P",  # not the working directory on sys.path: its modules could shadow others
        "-c",
        _MNN_CONVERT,
        "mnnconvert",
        "-f",
        "ONNX",
        "--modelFile",
        str(onnx_path),
        "--MNNModel",
        str(mnn_path),
        "--bizCode",
        "leanrnn",
    ]


ENGINES: dict[str, type[Engine]] = {
    e.name: e
    for e in (LeanRNN, NumpyNaive, NumpyPrealloc, Torch, TorchNoDNNL, OnnxRuntime, MNNEngine,
              LeanRNNBf16, LeanRNNBf16Act, LeanRNNInt8, LeanRNNInt8Dynamic, LeanRNNInt8Dynamic7,
              TorchQint8, OnnxRuntimeInt8)
}  # fmt: skip
# ``--precision`` (bench.cli): the engines of each reduced precision — leanrnn's own and the
# peers' paths of the same kind (int8 weights and activations, quantized as they run).
PRECISION_ENGINES = {
    "bf16": ("leanrnn-bf16",),
    "bf16-act": ("leanrnn-bf16-act",),
    "int8": ("leanrnn-int8",),
    "int8-dynamic": (
        "leanrnn-int8-dynamic",
        "leanrnn-int8-dynamic-7bit",
        "torch-qint8",
        "onnxruntime-int8",
    ),
}


def resolve(name: str) -> type[Engine]:
    """An engine class by registry name or ``"package.module:Class"``."""
    if name in ENGINES:
        return ENGINES[name]
    if ":" in name:
        mod, _, attr = name.partition(":")
        cls = getattr(importlib.import_module(mod), attr)
        if not (isinstance(cls, type) and issubclass(cls, Engine)):
            raise TypeError(f"{name} is not a leanrnn.bench.engines.Engine subclass")
        return cls
    known = ", ".join(ENGINES)
    raise KeyError(f"unknown engine {name!r}; expected one of {known} or 'module:Class'")
