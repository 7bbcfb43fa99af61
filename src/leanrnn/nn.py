"""PyTorch-compatible modules on the engine: ``LSTM``, ``GRU``, ``RNN`` and the general ``Model``.

>>> import numpy as np, leanrnn
>>> lstm = leanrnn.LSTM(8, 16, num_layers=2, seed=0)
>>> y, (h_n, c_n) = lstm(np.zeros((5, 3, 8), np.float32))   # [T, N, C] -> [T, N, H]
>>> y.shape, h_n.shape
((5, 3, 16), (2, 3, 16))
"""

from __future__ import annotations

import copy
import math
import os
import re
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal, Self, overload

import numpy as np
from numpy.typing import ArrayLike, DTypeLike, NDArray

from .engine import Session, Stream, _check
from .engine.model import parameter_count, spec_line
from .errors import DTypeError, ShapeError, SpecError, WeightsError
from .formats import checkpoint, native, torch_format
from .formats.packing import PackedWeights, pack
from .formats.quantize import weight_bits
from .memory.arena import check_fits, round_up
from .memory.planner import Plan
from .spec import Activation, RNNSpec

# What a model's spec fixes, by torch.nn's names (read-only properties of Model)
_FIXED = frozenset(("weights", "spec", "dtype", "input_size", "hidden_size", "num_layers", "bias",
                    "batch_first", "bidirectional", "proj_size", "nonlinearity", "mode",
                    "dropout"))  # fmt: skip
# torch.nn.LSTM/GRU/RNN's parameter names: weight_ih_l0, bias_hh_l1_reverse, weight_hr_l0
_TORCH_PARAMETER = re.compile(r"^(weight|bias)_(ih|hh|hr)_l\d+(_reverse)?$")

# The call's types (LSTM, GRU and RNN declare them per cell; Model's are Any: either cell)
_Array = NDArray[Any]
_LSTMState = tuple[_Array, _Array]
_LSTMHx = Sequence[_Array | None] | None  # (h0, c0), either None for zeros


class Model:
    """A runnable recurrent stack: spec + packed weights + a lazily planned Session.

    ``model(x, hx=None, lengths=None)`` returns ``(y, h_n)`` (GRU/RNN) or ``(y, (h_n, c_n))``
    (LSTM), like torch.nn. ``x`` may be [T, N, C] (or [N, T, C] with batch_first) or unbatched
    [T, C], in which case the batch dimension is dropped from the outputs too.
    """

    session: Session  # (set once by __init__, through object.__setattr__: see __setattr__)

    def __init__(self, weights: PackedWeights, threads: int | np.integer | None = None) -> None:
        object.__setattr__(self, "session", Session(weights, threads=threads))

    def __reduce__(self):
        # deepcopy and pickle (a worker process, a copy to fine-tune): the weights (one new
        # aligned buffer, PackedWeights.__reduce__) and a new session of the same threads; the
        # session's locks, arena and bound programs belong to this process and this model.
        # What else was set on the instance (a subclass's own attributes) comes along, and
        # the session's chunk and memory limit (a copy ran what the original refused).
        state = {k: v for k, v in self.__dict__.items() if k != "session"}
        # (the chunk asked for and the one runs take: a limit's chunk is not asked for, and
        # a copy that took it as asked kept it once a resize lifted the limit)
        s = self.session
        state["_session_settings"] = {"_asked": s._asked, "_chunk": s._chunk, "_limit": s._limit}
        return type(self)._from_packed, (self.weights, s.threads), state

    def __setstate__(self, state: dict) -> None:
        state = dict(state)
        self.session.__dict__.update(state.pop("_session_settings", {}))
        self.__dict__.update(state)

    def __setattr__(self, name: str, value: Any) -> None:
        # torch.nn's attribute names, assigned as on a torch module, made a new attribute
        # that nothing read: `m.batch_first = True` then read [N, T, C] as [T, N, C], and
        # `m.weight_ih_l0 = w` ran the old weights, in silence
        if name in _FIXED or name == "session" or _TORCH_PARAMETER.match(name):
            what = ("its weights are packed once" if name in ("weights", "session")
                    or _TORCH_PARAMETER.match(name) else f"{name} is part of its spec")  # fmt: skip
            if name == "dropout":  # (torch's modules drop out in training only)
                raise AttributeError(f"[{type(self).__name__}] cannot set 'dropout': a model "
                                     "runs inference, where dropout is the identity; train "
                                     "with leanrnn.train.Trainer(model, dropout=p)")  # fmt: skip
            raise AttributeError(
                f"[{type(self).__name__}] cannot set {name!r}: {what}. Build a new model: "
                "from_state_dict(sd, ...) with the state dict (model.state_dict() gives a "
                "copy to edit) and the module's options, e.g. batch_first=True"
            )
        object.__setattr__(self, name, value)

    # -- description
    @property
    def weights(self) -> PackedWeights:
        """The packed weights the session runs (one buffer; read-only here: see __setattr__)."""
        return self.session.weights

    @property
    def spec(self) -> RNNSpec:
        return self.weights.spec

    # torch.nn.LSTM/GRU/RNN's attributes, read off the spec (torch code reads them)
    @property
    def input_size(self) -> int:
        return self.spec.input_size

    @property
    def hidden_size(self) -> int:
        return self.spec.hidden_size

    @property
    def num_layers(self) -> int:
        return self.spec.num_layers

    @property
    def bias(self) -> bool:
        return self.spec.bias

    @property
    def batch_first(self) -> bool:
        return self.spec.batch_first

    @property
    def bidirectional(self) -> bool:
        return self.spec.direction == "bidirectional"

    @property
    def proj_size(self) -> int:
        return self.spec.proj_size

    @property
    def dtype(self) -> np.dtype[Any]:
        return self.weights.dtype

    @property
    def dropout(self) -> float:
        return 0.0  # inference: torch's eval mode, dropout off

    @property
    def mode(self) -> str:
        """torch.nn.RNNBase's mode: "LSTM", "GRU", "RNN_TANH" or "RNN_RELU"."""
        cell = self.spec.cell
        return cell.upper() if cell != "rnn" else f"RNN_{(self.nonlinearity or 'tanh').upper()}"

    @property
    def threads(self) -> int | None:
        """The session's kernel threads (None: all); set, the next run plans with them (it
        was an attribute nothing read, as a GraphModel's is its one setting)."""
        return self.session.threads

    @threads.setter
    def threads(self, value: int | np.integer | None) -> None:
        self.session.threads = value

    @property
    def nonlinearity(self) -> str | None:
        """An RNN's "tanh" or "relu", as torch.nn.RNN names it (None for LSTM and GRU, and
        for an ONNX stack whose activations torch has no name for)."""
        s = self.spec
        names = {a.name for acts in s.activations for a in acts} if s.cell == "rnn" else ()
        return names.pop() if len(names) == 1 and names <= {"tanh", "relu"} else None

    def __repr__(self) -> str:
        s = self.spec
        extra = f", proj_size={s.proj_size}" if s.proj_size else ""
        extra += "" if s.bias else ", bias=False"
        if s.cell == "rnn" and self.nonlinearity != "tanh":  # (a relu RNN printed as a tanh one)
            acts = self.nonlinearity or "/".join(a.name for a in s.activations[0])
            extra += f", nonlinearity={acts!r}"
        onnx_only = (s.cell != "rnn" and not s.default_activations) or s.peepholes or (
            s.clip is not None or s.input_forget or s.direction == "reverse"
            or (s.cell == "gru" and not s.linear_before_reset))  # fmt: skip
        if onnx_only:  # an ONNX stack's options, which torch has no arguments for
            extra += f"; {spec_line(s)}"
        w = self.weights
        precision = "" if w.precision == "float" else f", precision={w.precision!r}"
        return (
            f"{type(self).__name__}({s.input_size}, {s.hidden_size}, num_layers={s.num_layers}, "
            f"bidirectional={s.direction == 'bidirectional'}, batch_first={s.batch_first}"
            f"{extra}, dtype={self.dtype}{precision})"
        )

    # -- running
    def forward(self, x: _Array, hx: Any = None, lengths: ArrayLike | None = None,
                out: Any = None, return_sequences: bool = True) -> Any:  # fmt: skip
        """Run the model; see ``Session.run`` for shapes. ``return_sequences=False`` returns
        ``None`` for y and, for a forward stack, keeps memory independent of T (the run is
        chunked; reverse and bidirectional stacks hold the whole sequence). For unbatched x
        [T, C], ``out=`` takes unbatched arrays (y [T, D*K], h_n [L*D, K], c_n [L*D, H]) or
        the batched ones with N=1; either way the outputs are written into them."""
        spec = self.spec
        unbatched = isinstance(x, np.ndarray) and x.ndim == 2
        if unbatched:
            if x.shape[1] != spec.input_size:  # said before the batch axis is added to it
                raise ShapeError(
                    f"[{type(self).__name__}] x has shape {x.shape}; expected unbatched "
                    f"[T, C={spec.input_size}] or batched "
                    f"{'[N, T, C]' if spec.batch_first else '[T, N, C]'}"
                )
            x = x[None] if spec.batch_first else x[:, None]
        h0 = c0 = None
        if hx is not None:
            if spec.cell == "lstm":
                if not isinstance(hx, tuple | list) or len(hx) != 2:
                    raise SpecError(f"[{type(self).__name__}] hx must be a tuple (h0, c0) for LSTM")
                h0, c0 = hx
            else:
                h0 = hx
            if unbatched:
                for name, a in (("h0", h0), ("c0", c0)):
                    if isinstance(a, np.ndarray) and a.ndim != 2:  # (an axis was added to it,
                        raise ShapeError(  # and the error showed a 4-D shape no one passed)
                            f"[{type(self).__name__}] x is unbatched [T, C]: {name} must be 2-D "
                            f"[L*D, {'H' if name == 'c0' else 'K'}] too, as torch requires; got "
                            f"shape {a.shape}"
                        )
                h0 = h0[:, None] if isinstance(h0, np.ndarray) else h0
                c0 = c0[:, None] if isinstance(c0, np.ndarray) else c0
        if _empty_batch(x, spec) and out is None and (lengths is None or np.size(lengths) == 0):
            return self._empty(x, h0, c0, return_sequences)
        if unbatched and out is not None:
            try:
                y, h_n, c_n = self.session.run(
                    x, h0, c0, lengths, self._batched_out(out, return_sequences),
                    return_sequences,
                )  # fmt: skip
            except ShapeError as e:
                if "] out" not in str(e):  # about x, h0, ...: already in the caller's terms
                    raise
                # the session saw the arrays with the batch axis added: say it unbatched
                hint = self._unbatched_out_hint(out, x.shape[1 if spec.batch_first else 0],
                                                return_sequences)  # fmt: skip
                raise ShapeError(f"[{type(self).__name__}] {hint}") from None
        else:
            y, h_n, c_n = self.session.run(x, h0, c0, lengths, out, return_sequences)
        if unbatched:
            if y is not None:
                y = y[0] if spec.batch_first else y[:, 0]
            h_n = h_n[:, 0]
            c_n = c_n[:, 0] if c_n is not None else None
        return (y, (h_n, c_n)) if spec.cell == "lstm" else (y, h_n)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        # (``__call__ = forward`` bound Model.forward: a subclass's own forward was skipped)
        return self.forward(*args, **kwargs)

    def _empty(self, x, h0, c0, return_sequences: bool):
        """torch.nn's answer for a batch of N=0 sequences: empty outputs (x's dtype and C,
        and the states' shapes (L*D, 0, K) and (L*D, 0, H), checked as torch checks them)."""
        spec = self.spec
        if x.dtype != self.dtype or x.shape[2] != spec.input_size:
            self.session.run(x)  # its own error, in its words
        T = x.shape[1 if spec.batch_first else 0]
        LD, K, H = spec.num_layers * spec.num_directions, spec.output_size, spec.hidden_size
        for name, a, w, wn in (("h0", h0, K, "K"), ("c0", c0, H, "H")):
            if a is not None:
                _check.array(type(self).__name__, name, a, self.dtype, (LD, 0, w),
                             ("L*D", "N", wn))  # fmt: skip
        y = None
        if return_sequences:
            y = np.zeros((0, T, spec.num_directions * K) if spec.batch_first
                         else (T, 0, spec.num_directions * K), self.dtype)  # fmt: skip
        h_n, c_n = np.zeros((LD, 0, K), self.dtype), np.zeros((LD, 0, H), self.dtype)
        return (y, (h_n, c_n)) if spec.cell == "lstm" else (y, h_n)

    def _batched_out(self, out, return_sequences: bool):
        """``out`` for an unbatched call, as the session takes it: each unbatched array (y
        [T, D*K], h_n [L*D, K], c_n [L*D, H]) viewed with the batch axis (N=1) added, so the
        session writes the caller's memory. Batched ones (N=1) pass as they are, and anything
        else is left for the session to refuse."""
        bf = self.spec.batch_first
        if isinstance(out, np.ndarray):
            out = (out,)
        if not isinstance(out, tuple | list):
            return out
        kinds = ("y", "state", "state") if return_sequences else ("state", "state")
        res = []
        for kind, a in zip(kinds, out, strict=False):
            if isinstance(a, np.ndarray) and a.ndim == 2:
                a = (a[None] if bf else a[:, None]) if kind == "y" else a[:, None]
            res.append(a)
        return type(out)(res) + type(out)(out[len(kinds) :])

    def _unbatched_out_hint(self, out, T: int, return_sequences: bool) -> str:
        spec = self.spec
        LD, K, H = spec.num_layers * spec.num_directions, spec.output_size, spec.hidden_size
        want = [f"y [T={T}, D*K={spec.num_directions * K}]"] if return_sequences else []
        want.append(f"h_n [L*D={LD}, K={K}]")
        if spec.cell == "lstm":
            want.append(f"c_n [L*D={LD}, H={H}]")
        arrays = out if isinstance(out, tuple | list) else (out,)
        given = [tuple(a.shape) if isinstance(a, np.ndarray) else type(a).__name__ for a in arrays]
        return (
            f"x is unbatched [T={T}, C]: out must be ({', '.join(want)}), or those with the "
            f"batch axis (N=1); got {given}"
        )

    # -- the model protocol (engine.model.RunnableModel), shared with GraphModel
    _INPUTS = ("x", "h0", "c0", "lengths")

    @property
    def input_names(self) -> list[str]:
        """The required input; ``run`` also takes the optional ``h0``, ``c0``, ``lengths``."""
        return ["x"]

    @property
    def output_names(self) -> list[str]:
        return ["y", "h_n", "c_n"] if self.spec.cell == "lstm" else ["y", "h_n"]

    @property
    def lengths_input(self) -> str:
        return "lengths"

    def run(self, feeds) -> list[np.ndarray]:
        """``[y, h_n]`` (``[y, h_n, c_n]`` for LSTM) for ``feeds``: a dict with ``x`` and
        optionally ``h0``, ``c0``, ``lengths``, or a list in that order; see ``Session.run``."""
        if isinstance(feeds, np.ndarray):  # run(x): x alone (a list of its T steps it was)
            feeds = [feeds]
        if not isinstance(feeds, dict):
            feeds = list(feeds)
            if len(feeds) > len(self._INPUTS):  # zip dropped the rest in silence
                raise ShapeError(
                    f"[{type(self).__name__}.run] {len(feeds)} inputs; expected at most "
                    f"{len(self._INPUTS)}: {', '.join(self._INPUTS)} in that order (or a dict)"
                )
            feeds = dict(zip(self._INPUTS, feeds, strict=False))
        unknown = sorted(set(feeds) - set(self._INPUTS))
        if unknown or "x" not in feeds:
            missing = [] if "x" in feeds else ["x"]
            raise ShapeError(
                f"[{type(self).__name__}.run] missing inputs {missing}; unexpected inputs "
                f"{unknown}; the model takes x and optionally h0, c0, lengths"
            )
        y, h_n, c_n = self.session.run(
            feeds["x"], feeds.get("h0"), feeds.get("c0"), feeds.get("lengths")
        )
        return [y, h_n, c_n] if self.spec.cell == "lstm" else [y, h_n]

    def resize(self, shapes, dtypes=None, memory_limit: int | float | None = None) -> Plan:
        """Plan the session for x of shape ``shapes["x"]`` (or ``shapes[0]``): [T, N, C], or
        [N, T, C] with batch_first. ``dtypes`` is accepted for the protocol; x's dtype is the
        weights' (checked at run)."""
        op, C = f"{type(self).__name__}.resize", self.spec.input_size
        if isinstance(shapes, dict):
            unknown = sorted(map(str, set(shapes) - set(self._INPUTS)))
            if unknown:
                raise ShapeError(f"[{op}] shapes for unknown inputs {unknown}; the model takes "
                                 f"{', '.join(self._INPUTS)}")  # fmt: skip
            shape = shapes.get("x")
        elif (
            isinstance(shapes, list | tuple)
            and shapes
            and all(isinstance(d, int | np.integer) for d in shapes)
        ):
            shape = shapes  # x's shape itself, (T, N, C)
        elif isinstance(shapes, list | tuple):
            shape = shapes[0] if shapes else None
        else:
            shape = None
        if not isinstance(shape, list | tuple | np.ndarray) or len(shape) != 3 or shape[2] != C:
            raise ShapeError(
                f"[{op}] x shape {shape!r}; expected [T, N, C={C}] ([N, T, C={C}] with "
                "batch_first), given as the shape, {'x': shape} or [shape]"
            )
        T, N = (shape[1], shape[0]) if self.spec.batch_first else (shape[0], shape[1])
        return self.session.resize(N, T, memory_limit)

    def stream(self, batch: int = 1) -> Stream:
        """A ``Stream`` over this model's session: feed chunks of steps, state carried."""
        return self.session.stream(batch)

    def describe(self, batch: int | np.integer, steps: int | np.integer) -> dict[str, Any]:
        """Layers, parameters, weight bytes and the arena planned for ``batch`` x ``steps``."""
        batch = _check.count(f"{type(self).__name__}.describe", "batch", batch, ShapeError)
        steps = _check.count(f"{type(self).__name__}.describe", "steps", steps, ShapeError)
        spec = self.spec
        p = self.session.planned(batch, steps)  # (the session's own plan and limit untouched)
        check_fits(p.total, f"the arena of N={batch}, T={steps}", "describe")
        return {
            "kind": "rnn",
            "layers": [
                {
                    "layer": layer,
                    "spec": spec_line(
                        spec.with_(num_layers=1, input_size=(spec.layer_input_size(layer)))
                    ),
                }
                for layer in range(spec.num_layers)
            ],
            "spec": spec.to_dict(),
            "dtype": self.dtype.name,
            "precision": self.weights.precision,  # of the W and R panels (leanrnn.quantize)
            "weight_bits": weight_bits(self.weights),
            "panel_bytes": self.weights.weight_bytes,
            "parameters": parameter_count(spec),
            "weight_bytes": self.weights.nbytes,
            "batch": batch,
            "steps": steps,
            "arena": {"total_bytes": p.total, "naive_bytes": p.naive_total},
        }

    def save(self, path) -> str:
        """Write the packed weights as an ``.lrnn`` file at ``path`` (which must end in
        ``.lrnn``: ``ModelFormatError`` otherwise); returns the path."""
        native.save_rnn(self.weights, path)
        return path

    # -- weights in and out
    def state_dict(self) -> dict[str, np.ndarray]:
        """PyTorch-named parameters (numpy arrays) — ``torch_module.load_state_dict`` takes them
        after ``torch.from_numpy``. They are copies, unpacked from the packed weights (torch's
        share the module's storage): editing them changes nothing until a model is built from
        them (``from_state_dict(sd, ...)``)."""
        return torch_format.to_state_dict(self.spec, self.weights.unpack())

    def astype(self, dtype: DTypeLike) -> Self:
        """A copy with weights in ``dtype`` (float32 or float64), on the same threads. Reduced
        weights (``leanrnn.quantize``) stay reduced: they run float32 only, so float64 is an
        error rather than a silent dequantization."""
        w, threads = self.weights, self.session.threads
        if w.precision != "float":
            if np.dtype(dtype) != w.dtype:
                raise DTypeError(
                    f"[{type(self).__name__}.astype] {np.dtype(dtype)} for a model with "
                    f"{w.precision} weights; reduced weights run float32 only. For their "
                    "dequantized values in float64: leanrnn.from_state_dict(model.state_dict(), "
                    "dtype=np.float64)"
                )
            return type(self)._from_packed(copy.deepcopy(w), threads)
        return type(self)._from_packed(pack(self.spec, w.unpack(), dtype), threads)

    @classmethod
    def _from_packed(cls, weights: PackedWeights, threads: int | np.integer | None = None) -> Self:
        obj = cls.__new__(cls)
        Model.__init__(obj, weights, threads)
        return obj

    @classmethod
    def from_state_dict(cls, state_dict: Mapping[str, Any], *, cell: str | None = None,
                        nonlinearity: str = "tanh", batch_first: bool = False,
                        dtype: DTypeLike | None = None,
                        prefix: str | None = None) -> Self:  # fmt: skip
        """Build from a PyTorch-named dict of arrays (numpy or torch tensors on the CPU).

        ``prefix`` picks the RNN module out of a whole model's state dict (``"encoder.rnn."``,
        or ``"encoder.rnn"``); without it, keys of one RNN module under a prefix are taken when
        nothing else is there, and anything else is refused, naming the prefixes present.

        The cell, sizes, layers, directions, bias and proj_size are read off the weights; what
        they cannot say must be passed as the module was built: ``batch_first`` (a module made
        with batch_first=True needs it here, or [N, T, C] input is read as [T, N, C]) and, for
        an RNN, ``nonlinearity``. ``dtype`` defaults to the weights' float dtype (float32 or
        float64). ``from_torch(module)`` reads all of it off the module instead.

        >>> gru = torch.nn.GRU(32, 64, batch_first=True)  # doctest: +SKIP
        >>> sd = {k: v.numpy() for k, v in gru.state_dict().items()}  # doctest: +SKIP
        >>> m = leanrnn.from_state_dict(sd, batch_first=True)  # doctest: +SKIP
        """
        if not isinstance(state_dict, Mapping):  # a path, a list of tensors: say which
            path = isinstance(state_dict, str | os.PathLike)
            name = type(state_dict).__name__
            what = "a path" if path else f"{'an' if name[0] in 'aeiouAEIOU' else 'a'} {name}"
            raise WeightsError(
                f"[from_state_dict] got {what} ({state_dict!r:.60}); expected a dict of "
                "arrays named as torch's module.state_dict() names them ('weight_ih_l0', ...); "
                "to read a file, use leanrnn.load(path)"
            )
        if prefix is not None or "weight_ih_l0" not in state_dict:
            state_dict = checkpoint.select_rnn(state_dict, prefix, None, "from_state_dict")
        sd = {k: _to_numpy(v) for k, v in state_dict.items()}
        mine = getattr(cls, "_cell", None)
        if cell is not None and mine is not None and cell != mine:  # an "LSTM" that was a GRU
            raise SpecError(f"[{cls.__name__}.from_state_dict] cell={cell!r}, but "
                            f"{cls.__name__} builds {mine.upper()} models; for a {cell.upper()} "
                            f"use leanrnn.from_state_dict(..., cell={cell!r})")  # fmt: skip
        cell = cell or mine
        spec = torch_format.infer_spec(sd, cell, nonlinearity, batch_first)
        if dtype is None:
            dtype = sd["weight_ih_l0"].dtype
            if dtype not in (np.float32, np.float64):
                raise DTypeError(
                    f"[from_state_dict] weights have dtype {dtype}; pass dtype=np.float32 or "
                    "np.float64 to convert explicitly"
                )
            others = sorted(k for k, v in sd.items() if v.dtype != dtype)
            if others:  # were rounded to weight_ih_l0's dtype without a word
                raise DTypeError(
                    f"[from_state_dict] weight_ih_l0 is {dtype} but {others[:4]} are "
                    f"{sd[others[0]].dtype}; pass dtype=np.float32 or np.float64 to convert "
                    "them all explicitly"
                )
        weights = pack(spec, torch_format.from_state_dict(spec, sd), dtype)
        target = _CELL_CLASSES[spec.cell] if cls is Model else cls
        return target._from_packed(weights)  # type: ignore[return-value]  # (Model: its cell's)

    @classmethod
    def from_torch(cls, module: Any, dtype: DTypeLike | None = None) -> Model:
        """Copy a torch.nn.LSTM/GRU/RNN, its batch_first and nonlinearity included (imports
        torch only here)."""
        spec, sd = torch_format.from_torch_module(module)
        mine = getattr(cls, "_cell", None)
        if mine is not None and spec.cell != mine:  # LSTM.from_torch(gru) returned a GRU
            raise SpecError(f"[{cls.__name__}.from_torch] the module is a torch "
                            f"{spec.cell.upper()}; {cls.__name__} builds {mine.upper()} models: "
                            "use leanrnn.from_torch(module), which picks the class")  # fmt: skip
        dtype = dtype or sd["weight_ih_l0"].dtype
        if np.dtype(dtype) == np.float16:
            raise DTypeError("[from_torch] the module's weights are float16; leanrnn computes "
                             "in float32 or float64: pass dtype=np.float32")  # fmt: skip
        weights = pack(spec, torch_format.from_state_dict(spec, sd), dtype)
        target = _CELL_CLASSES[spec.cell] if mine is None else cls
        return target._from_packed(weights)


def _empty_batch(x, spec: RNNSpec) -> bool:
    """Whether ``x`` is a batched array of N=0 sequences (of T >= 1 steps)."""
    if not isinstance(x, np.ndarray) or x.ndim != 3:
        return False
    T, N = (x.shape[1], x.shape[0]) if spec.batch_first else x.shape[:2]
    return N == 0 and T >= 1


def _to_numpy(v) -> np.ndarray:
    if isinstance(v, np.ndarray):
        return v
    if hasattr(v, "detach"):  # a torch tensor; no torch import needed
        return torch_format.tensor_array(v)
    return np.asarray(v)


def _direction(bidirectional) -> str:
    # torch.nn's flag, checked: bidirectional="no" was truthy and made a bidirectional model
    ok = isinstance(bidirectional, bool | np.bool_ | int | np.integer)
    if not ok or bidirectional not in (0, 1):
        raise SpecError(f"[leanrnn] bidirectional={bidirectional!r}; expected True or False")
    return "bidirectional" if bidirectional else "forward"


# Bytes of Python objects one (layer, direction) holds while its weights are drawn and packed:
# the state dict's arrays, LayerWeights, the packed views (measured ~4.5 KiB for small H).
_LAYER_OBJECT_BYTES = 8 << 10


def _packed_bytes(spec: RNNSpec, dtype) -> int:
    """Bytes of ``spec``'s packed weights (PackedWeights.nbytes), by arithmetic in O(1): layers
    from the second on are alike, so two layers' layout says it all (a layout of 10**8 layers
    would itself take minutes)."""
    dt = np.dtype(dtype)
    L, D = spec.num_layers, spec.num_directions
    per = [round_up(math.prod(s) * dt.itemsize, 64)
           for _, s in PackedWeights.layout(spec.with_(num_layers=min(L, 2)))]  # fmt: skip
    n = len(per) // min(L, 2)  # tensors per layer (all its directions)
    assert n == len(per) / min(L, 2) and n % D == 0
    return sum(per[:n]) + (L - 1) * sum(per[n:])


def _check_build_fits(op: str, spec: RNNSpec, dtype) -> None:
    """PlanError, before any draw or per-layer loop, if building ``spec`` cannot fit this
    machine's memory: float64 draws, the state dict in ``dtype`` and the packed copy (about 3x
    the packed bytes, as ``leanrnn plan`` counts) plus each layer's Python objects. The time a
    build takes grows with its layers too; this bound keeps it to what memory can hold."""
    if np.dtype(dtype) not in (np.float32, np.float64):
        return  # pack refuses it, naming the dtype
    packed = _packed_bytes(spec, dtype)
    objects = spec.num_layers * spec.num_directions * _LAYER_OBJECT_BYTES
    check_fits(
        3 * packed + objects,
        f"building {spec.cell.upper()} input_size={spec.input_size} hidden_size="
        f"{spec.hidden_size} num_layers={spec.num_layers} ({packed:,} bytes of packed "
        f"weights, about 3x that while built, and {objects:,} of per-layer objects)",
        op,
    )


class _TorchLike(Model):
    _cell = "rnn"

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1, bias: bool = True,
                 batch_first: bool = False, dropout: float = 0.0, bidirectional: bool = False,
                 proj_size: int = 0, *, nonlinearity: str = "tanh",
                 dtype: DTypeLike | None = np.float32, seed: int | np.integer | None = None,
                 threads: int | np.integer | None = None) -> None:  # fmt: skip
        if dropout:
            raise SpecError(
                f"[{type(self).__name__}] dropout={dropout}: leanrnn runs inference only; "
                "dropout is identity there, pass 0"
            )
        if proj_size and self._cell != "lstm":
            raise SpecError(f"[{type(self).__name__}] proj_size is only defined for LSTM")
        acts = None
        if self._cell != "rnn" and nonlinearity != "tanh":  # (it was ignored, even 'bogus')
            raise SpecError(f"[{type(self).__name__}] nonlinearity={nonlinearity!r} is an RNN's "
                            f"argument; a {self._cell.upper()}'s activations are fixed")  # fmt: skip
        if dtype is None:  # the documented default (np.dtype(None) is float64)
            dtype = np.float32
        if seed is not None and (
            not isinstance(seed, int | np.integer) or isinstance(seed, bool) or seed < 0
        ):  # (numpy's own error named no argument)
            raise SpecError(f"[{type(self).__name__}] seed={seed!r}; expected an int >= 0 or "
                            "None")  # fmt: skip
        if self._cell == "rnn":
            if nonlinearity not in ("tanh", "relu"):
                raise SpecError(f"[RNN] nonlinearity={nonlinearity!r}; expected 'tanh' or 'relu'")
            acts = ((Activation.make(nonlinearity),),) * (
                2 if _direction(bidirectional) != "forward" else 1
            )
        spec = RNNSpec(
            self._cell, input_size, hidden_size, num_layers=num_layers,
            direction=_direction(bidirectional), proj_size=proj_size,
            bias=bias, batch_first=batch_first,
            activations=acts,  # type: ignore[arg-type]  # (None: the cell's defaults)
        )  # fmt: skip
        _check_build_fits(type(self).__name__, spec, dtype)
        # PyTorch's initialisation: every parameter ~ U(-1/sqrt(H), 1/sqrt(H)).
        rng = np.random.default_rng(seed)
        k = 1.0 / np.sqrt(hidden_size)
        sd = {
            key: rng.uniform(-k, k, size=torch_format.param_shape(spec, key)).astype(dtype)
            for key in torch_format.expected_keys(spec)
        }
        super().__init__(pack(spec, torch_format.from_state_dict(spec, sd), dtype), threads)


class LSTM(_TorchLike):
    """torch.nn.LSTM on leanrnn: ``LSTM(input_size, hidden_size, num_layers=1, bias=True,
    batch_first=False, dropout=0.0, bidirectional=False, proj_size=0)``; call returns
    ``(y, (h_n, c_n))``; ``lengths=`` gives per-sample lengths (packed-sequence semantics)."""

    _cell = "lstm"

    if TYPE_CHECKING:  # the call's types, per cell, for type checkers (Model.forward runs)
        # fmt: off
        @overload
        def forward(self, x: _Array, hx: _LSTMHx = None,
                    lengths: ArrayLike | None = None, out: Any = None,
                    return_sequences: Literal[True] = True) -> tuple[_Array, _LSTMState]: ...
        @overload
        def forward(self, x: _Array, hx: _LSTMHx = None,
                    lengths: ArrayLike | None = None, out: Any = None,
                    return_sequences: bool = True) -> tuple[_Array | None, _LSTMState]: ...
        def forward(self, x: _Array, hx: _LSTMHx = None,
                    lengths: ArrayLike | None = None, out: Any = None,
                    return_sequences: bool = True) -> tuple[_Array | None, _LSTMState]: ...
        @overload
        def __call__(self, x: _Array, hx: _LSTMHx = None,
                     lengths: ArrayLike | None = None, out: Any = None,
                     return_sequences: Literal[True] = True) -> tuple[_Array, _LSTMState]: ...
        @overload
        def __call__(self, x: _Array, hx: _LSTMHx = None,
                     lengths: ArrayLike | None = None, out: Any = None,
                     return_sequences: bool = True) -> tuple[_Array | None, _LSTMState]: ...
        def __call__(self, x: _Array, hx: _LSTMHx = None,
                     lengths: ArrayLike | None = None, out: Any = None,
                     return_sequences: bool = True) -> tuple[_Array | None, _LSTMState]: ...
        # fmt: on


class _HiddenOnly(_TorchLike):
    """GRU and RNN: one state, h."""

    if TYPE_CHECKING:  # the call's types, per cell, for type checkers (Model.forward runs)
        # fmt: off
        @overload
        def forward(self, x: _Array, hx: _Array | None = None,
                    lengths: ArrayLike | None = None, out: Any = None,
                    return_sequences: Literal[True] = True) -> tuple[_Array, _Array]: ...
        @overload
        def forward(self, x: _Array, hx: _Array | None = None,
                    lengths: ArrayLike | None = None, out: Any = None,
                    return_sequences: bool = True) -> tuple[_Array | None, _Array]: ...
        def forward(self, x: _Array, hx: _Array | None = None,
                    lengths: ArrayLike | None = None, out: Any = None,
                    return_sequences: bool = True) -> tuple[_Array | None, _Array]: ...
        @overload
        def __call__(self, x: _Array, hx: _Array | None = None,
                     lengths: ArrayLike | None = None, out: Any = None,
                     return_sequences: Literal[True] = True) -> tuple[_Array, _Array]: ...
        @overload
        def __call__(self, x: _Array, hx: _Array | None = None,
                     lengths: ArrayLike | None = None, out: Any = None,
                     return_sequences: bool = True) -> tuple[_Array | None, _Array]: ...
        def __call__(self, x: _Array, hx: _Array | None = None,
                     lengths: ArrayLike | None = None, out: Any = None,
                     return_sequences: bool = True) -> tuple[_Array | None, _Array]: ...
        # fmt: on


class GRU(_HiddenOnly):
    """torch.nn.GRU on leanrnn (linear_before_reset, like PyTorch); call returns ``(y, h_n)``."""

    _cell = "gru"


class RNN(_HiddenOnly):
    """torch.nn.RNN on leanrnn: ``RNN(input_size, hidden_size, num_layers=1,
    nonlinearity='tanh', bias=True, batch_first=False, dropout=0.0, bidirectional=False)``,
    torch's order (nonlinearity fourth: RNN(3, 4, 2, 'relu') was read as bias='relu');
    returns ``(y, h_n)``."""

    _cell = "rnn"

    def __init__(self, input_size: int, hidden_size: int, num_layers: int = 1,
                 nonlinearity: str = "tanh", bias: bool = True, batch_first: bool = False,
                 dropout: float = 0.0, bidirectional: bool = False, *, proj_size: int = 0,
                 dtype: DTypeLike | None = np.float32, seed: int | np.integer | None = None,
                 threads: int | np.integer | None = None) -> None:  # fmt: skip
        # (proj_size: refused by name, as torch refuses it, not as an unknown argument)
        super().__init__(input_size, hidden_size, num_layers, bias, batch_first, dropout,
                         bidirectional, proj_size, nonlinearity=nonlinearity, dtype=dtype,
                         seed=seed, threads=threads)  # fmt: skip


# The class of each cell (typed: a dict literal of them reads as dict[str, type] to mypy)
_CELL_CLASSES: dict[str, type[Model]] = {"lstm": LSTM, "gru": GRU, "rnn": RNN}


def from_torch(module: Any, dtype: DTypeLike | None = None) -> Model:
    """Copy a torch.nn.LSTM/GRU/RNN into the matching leanrnn module."""
    return Model.from_torch(module, dtype)


def from_state_dict(state_dict: Mapping[str, Any], **kwargs: Any) -> Model:
    """Build from a PyTorch-named state dict; see ``Model.from_state_dict``."""
    return Model.from_state_dict(state_dict, **kwargs)
