"""The graph IR every importer hands over: ``Graph`` of ``Node`` with ``TensorInfo`` inputs and
outputs, constants and packed RNN weights; and the RNN nodes' semantics the engine needs at run time.

The op set and every op's semantics are ONNX's (operator names, inputs, attributes, default-domain
opset): one written-down vocabulary, whatever format a model came from. ONNX files map onto it one
to one; graph ``.lrnn`` files store it as JSON. An LSTM/GRU/RNN node stores its weights per
direction as W [D, G, C], R [D, G, H], B [D, 2G] (input biases then recurrent biases) and LSTM
peepholes P [D, 3H], with gate rows in the operator's order (LSTM i, o, f, c; GRU z, r, h; RNN h).
``rnn_from_node`` converts them to the internal order of ``spec.GATES`` with
``packing.ONNX_ORDER`` / ``ONNX_PEEP_ORDER``; nothing after import knows the source order.

Imports only errors, spec and the packed-weights layout (``formats.packing``, which is no
importer): the engine reads this module, never a file format.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from .errors import DTypeError, ModelFormatError, SpecError, WeightsError
from .formats.packing import (  # (PackedWeights too: typing.get_type_hints(Graph) reads it)
    ONNX_ORDER,
    ONNX_PEEP_ORDER,
    SUPPORTED_DTYPES,
    LayerWeights,
    PackedWeights,
    reorder_gates,
)
from .spec import DEFAULT_ACTIVATIONS, USES_ALPHA, USES_BETA, Activation, RNNSpec

# The recurrent ops and the cell each one runs
RNN_OPS = {"LSTM": "lstm", "GRU": "gru", "RNN": "rnn"}


def check_node_io(where: str, inputs, outputs, defined: set[str]) -> None:
    """A ModelFormatError unless every named input of a node is in ``defined`` (graph inputs,
    constants, earlier nodes' outputs) and no output redefines one. The one check for the
    importers and the engine's load-time pass; ``where`` is "[op] node 'name' (Op)"."""
    for i in inputs:
        if i and i not in defined:
            raise ModelFormatError(
                f"{where} reads {i!r}, which no graph input, constant or earlier node defines "
                "(nodes not in topological order, or a dangling name)"
            )
    named = [o for o in outputs if o]
    for o in named:
        if o in defined:
            raise ModelFormatError(f"{where} redefines tensor {o!r}")
    if len(set(named)) != len(named):  # (an If's ("y", "y"): its last branch output won)
        raise ModelFormatError(f"{where} names an output twice: {list(outputs)}")


def is_count(v) -> bool:
    """Whether ``v`` is a plausible dimension or byte count: an int (not a bool) in 0..2**62."""
    return isinstance(v, int) and not isinstance(v, bool) and 0 <= v < (1 << 62)


# ------------------------------------------------------------------------------------------ IR
@dataclass
class TensorInfo:
    """A graph input or output: name, numpy dtype name, shape (ints, symbolic names or None for
    an unknown dim; ``None`` for an unknown rank)."""

    name: str
    dtype: str
    shape: tuple[int | str | None, ...] | None = None

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": None if self.shape is None else list(self.shape),
        }

    @staticmethod
    def from_dict(d: dict) -> TensorInfo:
        shape = d.get("shape")
        if shape is not None and not all(
            s is None or isinstance(s, str) or is_count(s) for s in shape
        ):
            raise ValueError(f"tensor {d['name']!r} has shape {shape!r}; expected ints >= 0, "
                             "names or null")  # fmt: skip
        return TensorInfo(str(d["name"]), str(d["dtype"]), None if shape is None else tuple(shape))


@dataclass
class Node:
    """One op. ``op`` is the ONNX operator name (the op vocabulary), ``inputs`` use "" for an
    absent optional input, ``attrs`` holds JSON values only (ints, floats, strings, lists).

    Control flow is flat: ONNX's ``If`` is one node whose inputs are its condition, then its
    then-branch's outputs, then its else-branch's (``1 + 2 * len(outputs)`` inputs), and the
    branches' nodes sit in the graph before it, each with ``when``: the (condition tensor,
    truth) pairs under which it runs, outermost first. Conditions must be known when a run is
    planned (computed from input shapes and constants: the exporters' "squeeze this dim if it
    is 1"), so a plan holds the taken branch's nodes only and the If's outputs are views of
    that branch's."""

    op: str
    name: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    attrs: dict = field(default_factory=dict)
    when: tuple[tuple[str, bool], ...] = ()

    def to_dict(self) -> dict:
        d = {
            "op": self.op,
            "name": self.name,
            "inputs": list(self.inputs),
            "outputs": list(self.outputs),
            "attrs": self.attrs,
        }
        if self.when:  # (absent for every unconditional node: files without If are unchanged)
            d["when"] = [[c, t] for c, t in self.when]
        return d

    @staticmethod
    def from_dict(d: dict) -> Node:
        when = d.get("when") or []

        def pair(w) -> bool:
            return (isinstance(w, list) and len(w) == 2 and isinstance(w[0], str) and bool(w[0])
                    and isinstance(w[1], bool))  # fmt: skip

        bad = [when] if not isinstance(when, list) else [w for w in when if not pair(w)]
        if bad:  # (the first one, cut: a hostile file's list could be megabytes)
            raise ValueError(f"node {d.get('name')!r} has a condition {bad[0]!r:.200}; "
                             "expected when = [[condition name, true|false], ...]")  # fmt: skip
        return Node(
            str(d["op"]),
            str(d["name"]),
            tuple(str(s) for s in d["inputs"]),
            tuple(str(s) for s in d["outputs"]),
            dict(d.get("attrs") or {}),
            tuple((c, t) for c, t in when),
        )


@dataclass
class Graph:
    """A model as an op graph: what importers produce and ``GraphModel`` runs.

    ``constants`` are weights and folded values by tensor name; ``packed`` maps the name of an
    RNN node (LSTM/GRU/RNN, always one layer) to its packed weights when they are constant (the
    node's W/R/B/P inputs are then ""). ``opset`` is the ONNX default-domain opset, which fixes
    a few op semantics (e.g. Softmax's axis before opset 13). ``fixed``: the ONNX file's graph
    inputs that are initializers too (constants here, not inputs; named so in errors).
    """

    inputs: list[TensorInfo]
    outputs: list[TensorInfo]
    nodes: list[Node]
    constants: dict[str, np.ndarray] = field(default_factory=dict)
    packed: dict[str, PackedWeights] = field(default_factory=dict)
    opset: int = 17
    name: str = "graph"
    fixed: frozenset[str] = frozenset()

    def weight_owners(self) -> dict[str, str]:
        """For each RNN node with packed weights, the first node (in ``packed``'s order) that
        holds the same ones: itself, or the node whose weights it shares (an exporter's
        unrolled decoder). Files, quantize, describe and plan keep and count them once."""
        first: dict[int, str] = {}
        return {name: first.setdefault(id(pw), name) for name, pw in self.packed.items()}

    def to_dict(self) -> dict:
        return {
            "name": self.name,
            "opset": self.opset,
            "inputs": [t.to_dict() for t in self.inputs],
            "outputs": [t.to_dict() for t in self.outputs],
            "nodes": [n.to_dict() for n in self.nodes],
        }


MAX_OPSET = 10_000  # far beyond any ONNX opset; a larger number is a corrupt field, not a version


def check_opset(opset, where: str) -> int:
    """``opset`` if it is a plausible ONNX default-domain opset, else a ModelFormatError. The
    one check for every way a graph comes in (ONNX files, graph ``.lrnn`` files); ``where`` is
    "[op] what", e.g. "[load] 'model.lrnn'"."""
    if isinstance(opset, bool) or not isinstance(opset, int) or not 1 <= opset <= MAX_OPSET:
        raise ModelFormatError(
            f"{where} declares default-domain opset {opset!r}; expected one version in "
            f"1..{MAX_OPSET}"
        )
    return opset


# ------------------------------------------------------------------------- RNN node mapping
# ONNX's inputs and outputs of each RNN op (the LSTM's P and Y_c are its own). A name beyond
# them was ignored (a GRU's "P"), or an output never written returned the arena's old bytes.
RNN_ARITY = {"LSTM": (8, 3), "GRU": (6, 2), "RNN": (6, 2)}


def check_rnn_io(op: str, inputs, outputs, where: str) -> None:
    """A ModelFormatError unless an ``op`` node names at most ONNX's inputs and outputs of
    ``op`` (onnx.checker and onnxruntime refuse more)."""
    n_in, n_out = RNN_ARITY[op]
    if len(inputs) > n_in or len(outputs) > n_out:
        raise ModelFormatError(
            f"{where} has {len(inputs)} inputs and {len(outputs)} outputs; ONNX's {op} takes "
            f"at most {n_in} inputs and makes at most {n_out} outputs"
        )


def rnn_attrs(op: str, raw: dict, where: str) -> dict:
    """Normalize an ONNX LSTM/GRU/RNN node's attributes to JSON values with defaults filled in.

    ``activations`` becomes one [name, alpha, beta] triple per activation of every direction,
    consuming ``activation_alpha`` / ``activation_beta`` the way onnxruntime does: one value per
    activation that takes an alpha (beta), in order; missing values take the ONNX defaults.
    """
    cell = RNN_OPS[op]
    direction = raw.get("direction", "forward")
    if direction not in ("forward", "reverse", "bidirectional"):
        raise ModelFormatError(
            f"[load_onnx] {where}: direction={direction!r}; expected forward, "
            "reverse or bidirectional"
        )
    D = 2 if direction == "bidirectional" else 1
    per_dir = len(DEFAULT_ACTIVATIONS[cell])
    names = list(raw.get("activations") or [])
    if not names:
        names = [a.capitalize() for a in DEFAULT_ACTIVATIONS[cell]] * D
    if len(names) != per_dir * D:
        raise ModelFormatError(
            f"[load_onnx] {where}: {len(names)} activations {names}; expected {per_dir} per "
            f"direction x {D} direction(s) for {op}"
        )
    alphas = list(raw.get("activation_alpha") or [])
    betas = list(raw.get("activation_beta") or [])
    acts = []
    for name in names:
        key = str(name).lower()
        alpha = alphas.pop(0) if key in USES_ALPHA and alphas else None
        beta = betas.pop(0) if key in USES_BETA and betas else None
        try:
            a = Activation.make(str(name), alpha, beta)
        except SpecError as e:
            raise ModelFormatError(f"[load_onnx] {where}: {e}") from None
        acts.append([a.name, a.alpha, a.beta])
    clip = raw.get("clip")
    if clip is not None and not float(clip) > 0:
        raise ModelFormatError(f"[load_onnx] {where}: clip={clip}; expected a positive float")
    layout = int(raw.get("layout", 0))
    if layout not in (0, 1):
        raise ModelFormatError(f"[load_onnx] {where}: layout={layout}; expected 0 or 1")
    hs = raw.get("hidden_size")
    if hs is not None and (not isinstance(hs, int) or hs < 1):
        raise ModelFormatError(f"[load_onnx] {where}: hidden_size={hs!r}; expected a positive int")
    input_forget = int(raw.get("input_forget", 0))
    if input_forget and cell != "lstm":
        raise ModelFormatError(f"[load_onnx] {where}: input_forget is an LSTM attribute")
    return {
        "hidden_size": hs,
        "direction": direction,
        "activations": acts,
        "clip": None if clip is None else float(clip),
        "input_forget": bool(input_forget),
        "linear_before_reset": bool(int(raw.get("linear_before_reset", 0))),
        "layout": layout,
    }


def rnn_from_node(
    op: str,
    attrs: dict,
    W,
    R,
    B=None,
    P=None,
    where: str = "node",
    gates_in_onnx_order: bool = True,
) -> tuple[RNNSpec, list[list[LayerWeights]]]:
    """(spec, canonical weights in internal gate order) of one LSTM/GRU/RNN node. ``attrs`` comes from ``rnn_attrs``;
    W [D, G, C], R [D, G, H], B [D, 2G] or None, P [D, 3H] or None (LSTM), all one float dtype.
    ``gates_in_onnx_order=False`` says W and R are already in internal gate order."""
    cell = RNN_OPS[op]
    D = 2 if attrs["direction"] == "bidirectional" else 1
    ng = {"lstm": 4, "gru": 3, "rnn": 1}[cell]
    W, R = np.asarray(W), np.asarray(R)
    if W.dtype not in SUPPORTED_DTYPES:
        raise DTypeError(
            f"[load_onnx] {where}: W has dtype {W.dtype}; leanrnn runs RNN nodes in "
            "float32 or float64"
        )
    if R.ndim != 3:
        raise WeightsError(f"[load_onnx] {where}: R has shape {R.shape}; expected [D, G, H]")
    H = attrs["hidden_size"] or int(R.shape[2])
    G = ng * H
    if W.ndim != 3 or W.shape[:2] != (D, G) or W.shape[2] < 1:
        raise WeightsError(
            f"[load_onnx] {where}: W has shape {W.shape}; expected [D={D}, "
            f"G={G}, C] ({ng} gates x hidden_size {H})"
        )
    want = {"R": (R, (D, G, H)), "B": (B, (D, 2 * G)), "P": (P, (D, 3 * H))}
    for name, (a, shape) in want.items():
        if a is None:
            continue
        a = np.asarray(a)
        if a.shape != shape:
            raise WeightsError(
                f"[load_onnx] {where}: {name} has shape {a.shape}; expected {list(shape)}"
            )
        if a.dtype != W.dtype:
            raise DTypeError(
                f"[load_onnx] {where}: {name} has dtype {a.dtype}; expected {W.dtype} like W"
            )
    if P is not None and cell != "lstm":
        raise WeightsError(f"[load_onnx] {where}: peepholes (P) are an LSTM input")
    C = int(W.shape[2])
    k = len(DEFAULT_ACTIVATIONS[cell])
    flat = [Activation.make(n, a, b) for n, a, b in attrs["activations"]]
    acts = tuple(tuple(flat[d * k : (d + 1) * k]) for d in range(D))
    try:
        spec = RNNSpec(
            cell,
            C,
            H,
            num_layers=1,
            direction=attrs["direction"],
            bias=B is not None,
            batch_first=attrs["layout"] == 1,
            activations=acts,
            clip=attrs["clip"],
            input_forget=attrs["input_forget"],
            peepholes=P is not None,
            linear_before_reset=attrs["linear_before_reset"] if cell == "gru" else True,
        )
    except SpecError as e:
        raise ModelFormatError(f"[load_onnx] {where}: {e}") from None
    order = ONNX_ORDER[cell]
    dirs = []
    for d in range(D):
        Bd = np.zeros(2 * G, W.dtype) if B is None else np.asarray(B)[d]
        peep = None
        if P is not None:
            peep = reorder_gates(np.asarray(P)[d], ONNX_PEEP_ORDER, H).reshape(3, H)
        Wd, Rd = W[d], R[d]
        if gates_in_onnx_order:
            Wd, Rd = reorder_gates(Wd, order, H), reorder_gates(Rd, order, H)
        dirs.append(
            LayerWeights(
                W=Wd,
                R=Rd,
                bW=reorder_gates(Bd[:G], order, H),
                bR=reorder_gates(Bd[G:], order, H),
                peep=peep,
            )
        )
    return spec, [dirs]
