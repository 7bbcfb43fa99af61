"""The model IR: frozen dataclasses that say what a recurrent stack computes, nothing about storage.

Internal gate order — written down here once; every importer converts to it explicitly:

- LSTM: ``(i, f, g, o)`` — input, forget, cell candidate, output (PyTorch's order; ONNX is i, o, f, c).
- GRU:  ``(z, r, n)``    — update, reset, new/hidden (ONNX's order; PyTorch is r, z, n).
- RNN:  ``(h,)``.

Math, per direction, with ``x`` the layer input, ``W`` [G, C], ``R`` [G, K] (K = P if projected else H),
``bW``/``bR`` the input/recurrent biases, ``f, g, h`` the activations (defaults in brackets):

LSTM  i = f(W_i x + R_i h + bW_i + bR_i + p_i*c)    [f = Sigmoid]
      f = f(W_f x + R_f h + ... + p_f*c)  (or 1 - i with input_forget)
      g = g(W_g x + R_g h + ...)                  [g = Tanh]
      c' = f*c + i*g;  o = f(W_o x + R_o h + ... + p_o*c');  h' = o * h(c')   [h = Tanh]
      with proj_size P > 0: h' = W_hr (o * h(c'))  (PyTorch semantics; only with default activations)
GRU   z = f(..), r = f(..)
      n = g(W_n x + bW_n + R_n (r*h) + bR_n)          linear_before_reset = False (ONNX default)
      n = g(W_n x + bW_n + r*(R_n h + bR_n))          linear_before_reset = True (PyTorch)
      h' = (1 - z)*n + z*h
RNN   h' = f(W x + R h + bW + bR)                     [f = Tanh; PyTorch relu -> Relu]

``clip`` bounds every gate pre-activation to [-clip, clip] (ONNX).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, replace

from .errors import SpecError

CELLS = ("lstm", "gru", "rnn")
DIRECTIONS = ("forward", "reverse", "bidirectional")
GATES = {"lstm": ("i", "f", "g", "o"), "gru": ("z", "r", "n"), "rnn": ("h",)}

# ONNX activation names, in the order of the integer codes the kernels use, with ONNX's defaults
# for (alpha, beta) where the function takes them (the defaults of the corresponding ONNX operator).
ACTIVATIONS: dict[str, tuple[float, float]] = {
    "sigmoid": (0.0, 0.0),
    "tanh": (0.0, 0.0),
    "relu": (0.0, 0.0),
    "affine": (1.0, 0.0),
    "leakyrelu": (0.01, 0.0),
    "thresholdedrelu": (1.0, 0.0),
    "scaledtanh": (1.0, 1.0),
    "hardsigmoid": (0.2, 0.5),
    "elu": (1.0, 0.0),
    "softsign": (0.0, 0.0),
    "softplus": (0.0, 0.0),
}
ACTIVATION_CODES = {name: i for i, name in enumerate(ACTIVATIONS)}
# Which ONNX activations consume alpha / beta from activation_alpha / activation_beta.
USES_ALPHA = frozenset(
    {"affine", "leakyrelu", "thresholdedrelu", "scaledtanh", "hardsigmoid", "elu"}
)
USES_BETA = frozenset({"affine", "scaledtanh", "hardsigmoid"})

DEFAULT_ACTIVATIONS = {
    "lstm": ("sigmoid", "tanh", "tanh"),
    "gru": ("sigmoid", "tanh"),
    "rnn": ("tanh",),
}


@dataclass(frozen=True)
class Activation:
    """One activation function with its parameters (unused parameters are 0)."""

    name: str
    alpha: float = 0.0
    beta: float = 0.0

    def __post_init__(self) -> None:
        # built directly (not by make): Activation('Tanh') was a KeyError in the first run
        if self.name not in ACTIVATIONS:
            raise SpecError(
                f"[Activation] name {self.name!r}; expected one of {', '.join(ACTIVATIONS)} "
                "(lower case: Activation.make takes ONNX's spellings)"
            )
        for what in ("alpha", "beta"):
            v = getattr(self, what)
            if not isinstance(v, numbers.Real) or isinstance(v, bool) or not math.isfinite(v):
                raise SpecError(f"[Activation] {what}={v!r}; expected a finite number")
            # a Python float: a numpy one (np.float32(0.1)) reached describe(), and the
            # .lrnn header's JSON could not be written (a bare TypeError from save)
            object.__setattr__(self, what, float(v))

    @staticmethod
    def make(name: str, alpha: float | None = None, beta: float | None = None) -> Activation:
        key = name.lower() if isinstance(name, str) else None
        if key not in ACTIVATIONS:
            raise SpecError(
                f"[Activation] unknown activation {name!r}; expected one of "
                f"{', '.join(a.capitalize() for a in ACTIVATIONS)}"
            )
        da, db = ACTIVATIONS[key]
        try:
            a = float(da if alpha is None else alpha) if key in USES_ALPHA else 0.0
            b = float(db if beta is None else beta) if key in USES_BETA else 0.0
        except (TypeError, ValueError):
            raise SpecError(f"[Activation] {name} alpha={alpha!r}, beta={beta!r}; expected "
                            "numbers") from None  # fmt: skip
        return Activation(key, a, b)

    @property
    def code(self) -> int:
        return ACTIVATION_CODES[self.name]


@dataclass(frozen=True)
class RNNSpec:
    """What a recurrent stack computes. Frozen; build variants with ``dataclasses.replace``.

    ``activations`` holds one tuple per direction (LSTM: f, g, h; GRU: f, g; RNN: f); ``None``
    means the defaults. ``proj_size`` > 0 is PyTorch's LSTM projection.
    """

    cell: str
    input_size: int
    hidden_size: int
    num_layers: int = 1
    direction: str = "forward"
    proj_size: int = 0
    bias: bool = True
    batch_first: bool = False
    # None (the default) is filled in with the defaults by __post_init__: read, never None
    activations: tuple[tuple[Activation, ...], ...] = None  # type: ignore[assignment]
    clip: float | None = None
    input_forget: bool = False
    peepholes: bool = False
    linear_before_reset: bool = True

    def __post_init__(self) -> None:
        cell = str(self.cell).lower()
        object.__setattr__(self, "cell", cell)
        if cell not in CELLS:
            raise SpecError(f"[RNNSpec] cell={self.cell!r}; expected one of {CELLS}")
        for name in ("input_size", "hidden_size", "num_layers"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise SpecError(f"[RNNSpec] {name}={v!r}; expected a positive int")
        for name in ("bias", "batch_first", "input_forget", "peepholes", "linear_before_reset"):
            # a flag is a bool (or 0/1, as ONNX attributes are): batch_first="no" was truthy and
            # made a batch-first model, and a .lrnn header could carry any JSON value here
            v = getattr(self, name)
            ok = hasattr(v, "__index__") or type(v).__name__ in ("bool", "bool_")  # numpy's too
            if not ok or v not in (0, 1):
                raise SpecError(f"[RNNSpec] {name}={v!r}; expected True or False")
            object.__setattr__(self, name, bool(v))
        if self.direction not in DIRECTIONS:
            raise SpecError(f"[RNNSpec] direction={self.direction!r}; expected one of {DIRECTIONS}")
        p = self.proj_size
        if not isinstance(p, int) or isinstance(p, bool) or p < 0:
            raise SpecError(f"[RNNSpec] proj_size={p!r}; expected an int >= 0")
        if p and cell != "lstm":
            raise SpecError(f"[RNNSpec] proj_size={p} is only defined for LSTM, got cell={cell!r}")
        if p and p >= self.hidden_size:
            raise SpecError(
                f"[RNNSpec] proj_size={p} must be smaller than hidden_size={self.hidden_size} "
                "(PyTorch's rule)"
            )
        if self.clip is not None and (
            not isinstance(self.clip, numbers.Real)
            or isinstance(self.clip, bool)
            or not self.clip > 0
        ):
            raise SpecError(f"[RNNSpec] clip={self.clip!r}; expected a positive float or None")
        if self.clip is not None:
            # a Python float (np.float32 broke the header's JSON); an infinite one clips
            # nothing: None, which JSON can say (inspect --json printed "clip": Infinity)
            object.__setattr__(self, "clip", None if math.isinf(self.clip) else float(self.clip))
        if (self.input_forget or self.peepholes) and cell != "lstm":
            raise SpecError("[RNNSpec] input_forget and peepholes are LSTM options")
        acts = self.activations
        if acts is None:
            acts = tuple(
                tuple(Activation.make(a) for a in DEFAULT_ACTIVATIONS[cell])
                for _ in range(self.num_directions)
            )
        else:
            acts = tuple(tuple(a) for a in acts)
            want = len(DEFAULT_ACTIVATIONS[cell])
            if len(acts) != self.num_directions or any(len(a) != want for a in acts):
                raise SpecError(
                    f"[RNNSpec] activations has shape {[len(a) for a in acts]}; expected "
                    f"{self.num_directions} direction(s) of {want} activation(s) for {cell}"
                )
            for a in (a for d in acts for a in d):
                if not isinstance(a, Activation):
                    raise SpecError(f"[RNNSpec] activation {a!r} is not an Activation")
        object.__setattr__(self, "activations", acts)
        if p and not self.default_activations:
            raise SpecError("[RNNSpec] proj_size needs the default LSTM activations")

    # ---- derived sizes (one vocabulary: C input, H hidden, P projection, G gate width) ----
    @property
    def num_directions(self) -> int:
        return 2 if self.direction == "bidirectional" else 1

    @property
    def num_gates(self) -> int:
        return len(GATES[self.cell])

    @property
    def gate_width(self) -> int:
        """G: 4H for LSTM, 3H for GRU, H for RNN."""
        return self.num_gates * self.hidden_size

    @property
    def output_size(self) -> int:
        """Per-direction output (and recurrent state) size: P if projected, else H."""
        return self.proj_size or self.hidden_size

    def layer_input_size(self, layer: int) -> int:
        return self.input_size if layer == 0 else self.num_directions * self.output_size

    def reversed_direction(self, d: int) -> bool:
        """Whether direction slot ``d`` of a layer runs backwards in time."""
        return self.direction == "reverse" or (self.direction == "bidirectional" and d == 1)

    @property
    def default_activations(self) -> bool:
        want = tuple(Activation.make(a) for a in DEFAULT_ACTIVATIONS[self.cell])
        return all(d == want for d in self.activations or ())

    def beyond_torch(self, reverse_ok: bool = False) -> list[str]:
        """What of this spec PyTorch's RNN modules cannot be (ONNX-only options): an empty list
        for torch.nn.LSTM/GRU/RNN's own cells, whose state dicts and training leanrnn covers.
        ``reverse_ok``: a reverse-only direction passes (training runs it, as a bidirectional
        stack's second direction; torch's names cannot say it)."""
        bad = []
        if self.direction == "reverse" and not reverse_ok:
            bad.append("direction='reverse'")
        if self.peepholes:
            bad.append("peepholes")
        if self.clip is not None:
            bad.append(f"clip={self.clip}")
        if self.input_forget:
            bad.append("input_forget")
        if self.cell == "gru" and not self.linear_before_reset:
            bad.append("linear_before_reset=0")
        allowed = {"lstm": [("sigmoid", "tanh", "tanh")], "gru": [("sigmoid", "tanh")],
                   "rnn": [("tanh",), ("relu",)]}[self.cell]  # fmt: skip
        for d in self.activations or ():
            names = tuple(a.name for a in d)
            if names not in allowed or any(a.alpha or a.beta for a in d):
                bad.append(f"activations {names}")
                break
        return bad

    def with_(self, **changes) -> RNNSpec:
        return replace(self, **changes)

    # ---- JSON round trip (the native format's header) ----
    def to_dict(self) -> dict:
        return {
            "cell": self.cell,
            "input_size": self.input_size,
            "hidden_size": self.hidden_size,
            "num_layers": self.num_layers,
            "direction": self.direction,
            "proj_size": self.proj_size,
            "bias": self.bias,
            "batch_first": self.batch_first,
            "activations": [
                [{"name": a.name, "alpha": a.alpha, "beta": a.beta} for a in d]
                for d in self.activations or ()
            ],
            "clip": self.clip,
            "input_forget": self.input_forget,
            "peepholes": self.peepholes,
            "linear_before_reset": self.linear_before_reset,
        }

    @staticmethod
    def from_dict(d: dict) -> RNNSpec:
        if not isinstance(d, dict):
            raise SpecError(f"[RNNSpec.from_dict] expected a JSON object, got {type(d).__name__}")
        known = set(RNNSpec.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise SpecError(f"[RNNSpec.from_dict] unexpected keys {unknown}")
        kw = dict(d)
        if kw.get("activations") is not None:
            try:
                kw["activations"] = tuple(
                    tuple(Activation.make(a["name"], a.get("alpha"), a.get("beta")) for a in dd)
                    for dd in kw["activations"]
                )
            except (TypeError, KeyError) as e:
                raise SpecError(f"[RNNSpec.from_dict] malformed activations: {e!r}") from None
        try:
            return RNNSpec(**kw)
        except TypeError as e:
            raise SpecError(f"[RNNSpec.from_dict] {e}") from None
