"""Load-time passes over the graph IR, in the order ``LoadedGraph`` runs them: ``check`` (ops the
engine implements, names, definitions before use), ``fold`` (constant subgraphs become
constants), ``pack_constant_rnns`` (RNN nodes whose weights are constant get packed weights),
``prune`` (what no output needs), ``fuse`` (the Transpose after an RNN's Y), ``classify``
(shape-only tensors vs data) and ``pack_matmuls`` (constant right-hand matrices of the classifier
head). No pass knows which file format the graph came from.
"""

from __future__ import annotations

import math

import numpy as np

from ...errors import LeanRNNError, ModelFormatError, UnsupportedOpError
from ...formats.packing import ONNX_ORDER, PackedWeights, pack
from ...ir import RNN_OPS, Graph, Node, check_node_io, rnn_from_node
from ..products import PackedMatmul
from .ops import OPS, SUPPORTED_OPS, Ctx, Out, evaluate, guard, infer

# Bytes any single folded constant may take at load, beyond the size of all the constants the
# file holds: a hostile file cannot make loading allocate more than the model plausibly needs.
FOLD_SLACK_BYTES = 64 << 20
# Packed RNN weights may be this many times the distinct RNN weights the file holds (plus the
# slack above): padding grows panels (a gate of H=20 fills 32 units), and nodes naming the same
# weights share one packing (pack_constant_rnns), so no real model comes near it.
PACK_RATIO = 4


class LoadedGraph:
    """A graph after the load-time passes, with what planning needs to know about it: which
    tensors some output needs (``needed``), which depend on input shapes only (``kind``,
    ``shape_nodes``) and the packed MatMul/Gemm weights (``matmuls``). Takes ownership of
    ``graph`` and rewrites it in place."""

    def __init__(self, graph: Graph, threads: int | None = None) -> None:
        self.graph = graph
        self.threads = threads
        check(graph)
        fold(graph, threads)
        pack_constant_rnns(graph)
        self.needed = prune(graph)
        if fuse(graph):
            self.needed = prune(graph)
        self.kind, self.shape_nodes = classify(graph, self.input_names)
        self.matmuls = pack_matmuls(graph, self.kind)

    @property
    def input_names(self) -> list[str]:
        return [t.name for t in self.graph.inputs]

    @property
    def output_names(self) -> list[str]:
        return [t.name for t in self.graph.outputs]


def check(g: Graph) -> None:
    """Reject what the engine cannot run, naming the node: unsupported ops, duplicate names,
    tensors read before anything defines them, malformed RNN attributes, stray packed weights."""
    for t in [*g.inputs, *g.outputs]:
        ok = t.dtype == "" or (t.dtype in np.sctypeDict and np.dtype(t.dtype).kind in "biuf")
        if not ok:
            raise ModelFormatError(
                f"[load] graph input/output {t.name!r} has dtype "
                f"{t.dtype!r}; expected a numeric or bool dtype"
            )
    defined = set(g.constants) | {t.name for t in g.inputs}
    scope: dict[str, tuple] = {}  # the conditions a tensor is made under (none: always)
    names = set()
    for node in g.nodes:
        if node.op not in OPS:
            raise UnsupportedOpError(
                f"[load] node {node.name!r} has op {node.op!r}, which leanrnn does not "
                f"implement; supported ops: {', '.join(SUPPORTED_OPS)} (and onnxruntime's "
                "com.microsoft::DynamicQuantizeLSTM, read as an int8 LSTM when the file loads)"
            )
        if node.name in names:
            raise ModelFormatError(f"[load] two nodes are named {node.name!r}")
        names.add(node.name)
        check_node_io(f"[load] node {node.name!r} ({node.op})", node.inputs, node.outputs, defined)
        _check_scope(node, scope, defined)
        defined |= {o for o in node.outputs if o}
        scope.update((o, node.when) for o in node.outputs if o)
        if node.op in RNN_OPS:
            _check_rnn(g, node)
    for t in g.outputs:
        if t.name not in defined:
            raise ModelFormatError(f"[load] graph output {t.name!r} is never produced")
        if scope.get(t.name):
            raise ModelFormatError(f"[load] graph output {t.name!r} is made only in a branch")
    stray = sorted(set(g.packed) - {n.name for n in g.nodes if n.op in RNN_OPS})
    if stray:
        raise ModelFormatError(f"[load] packed weights for unknown RNN nodes {stray}")


def _check_scope(node: Node, scope: dict[str, tuple], defined: set[str]) -> None:
    """Branches as ``ir.Node`` lays them out: a node's conditions are defined before it, it
    reads only what is made whenever it runs (a tensor made under conditions that begin its
    own), and an If has a condition and each branch's outputs, read under that branch's
    condition. A file that breaks this would read a tensor its plan never made."""
    where = f"[load] node {node.name!r} ({node.op})"
    for c, t in node.when:
        if c not in defined:
            raise ModelFormatError(f"{where} runs when {c!r}, which no earlier node, input or "
                                   "constant defines")  # fmt: skip
        if not isinstance(t, bool):
            raise ModelFormatError(f"{where} runs when {c!r} is {t!r:.40}; expected true or "
                                   "false")  # fmt: skip
    reads = [(i, node.when) for i in node.inputs if i]
    if node.op == "If":
        k = len(node.outputs)
        if not k or len(node.inputs) != 1 + 2 * k or "" in node.inputs:
            raise ModelFormatError(
                f"{where} has {len(node.inputs)} inputs and {k} outputs; expected the "
                "condition, then each branch's outputs (1 + 2 x outputs, none empty)"
            )
        c = node.inputs[0]
        reads = [(c, node.when)] + [
            (i, (*node.when, (c, j <= k))) for j, i in enumerate(node.inputs[1:], start=1)
        ]
    for i, runs in reads:
        made = scope.get(i, ())
        if tuple(runs[: len(made)]) != tuple(made):
            raise ModelFormatError(
                f"{where} reads {i!r}, which is made only when {_conditions(made)}; the node "
                f"runs when {_conditions(runs)}"
            )


def _conditions(when) -> str:
    """Conditions for a message: a hostile file's 400,000 of them made a 5 MB one."""
    shown = ", ".join(f"{c!r}={t}" for c, t in list(when)[:4])
    return f"[{shown}{f', ... ({len(when)} in all)' if len(when) > 4 else ''}]"


def _check_rnn(g: Graph, node: Node) -> None:
    a = node.attrs
    if a.get("layout") not in (0, 1) or a.get("direction") not in (
        "forward",
        "reverse",
        "bidirectional",
    ):
        raise ModelFormatError(
            f"[load] node {node.name!r} ({node.op}) has malformed attributes {a}"
        )
    if a.get("y_tndh", False) not in (True, False) or (a.get("y_tndh") and a["layout"]):
        raise ModelFormatError(f"[load] node {node.name!r}: y_tndh needs layout 0")
    pw = g.packed.get(node.name)
    if pw is None:
        return
    s = pw.spec
    if (s.cell, s.num_layers, s.direction, s.batch_first) != (
        RNN_OPS[node.op],
        1,
        a["direction"],
        a["layout"] == 1,
    ):
        raise ModelFormatError(
            f"[load] node {node.name!r} ({node.op}, {a['direction']}, layout {a['layout']}) "
            f"does not match its packed spec ({s.cell}, layers={s.num_layers}, "
            f"{s.direction}, batch_first={s.batch_first})"
        )


def fold(g: Graph, threads: int | None = None) -> None:
    """Evaluate every non-RNN node whose inputs are all constants, once, at load: the
    constant subgraphs exporters put in front of weights (torch's dynamo exporter builds an
    LSTM's W and R with Slice/Concat/Unsqueeze of the initializers) become constants, which
    ``pack_constant_rnns`` and ``pack_matmuls`` then pack. A constant goes as soon as the
    last node reading it is folded, so the weights are not held three times over. A node
    nobody reads is dropped unevaluated (``prune`` would drop it anyway)."""
    # A folded value is at most a rearrangement of the constants plus slack (Expand and
    # ConstantOfShape can make more): bounded by what the file holds, whatever its layout.
    # The bound holds for the whole pass, not per node: a file of a few hundred bytes with N
    # ConstantOfShape nodes each under it made loading allocate N times it. Two totals are
    # checked before each node runs: the values of folded constants alive after it, and the
    # values folding has made beyond what its nodes read (``grown``), so a chain that makes
    # and drops a large value per node is refused too. Counted in values, not bytes: a model
    # that widens its weights at load (float16 -> Cast, int8 -> DequantizeLinear) expands
    # nothing, and was refused when the budget was in bytes (at ~22 MB of int8 weights).
    limit = FOLD_SLACK_BYTES // 4 + sum(c.size for c in g.constants.values())
    ctx = Ctx(g, {}, threads)
    readers: dict[str, int] = {t.name: 1 for t in g.outputs}
    for node in g.nodes:
        for i in node.inputs:
            readers[i] = readers.get(i, 0) + 1
    folded: dict[str, int] = {}  # values of each folded constant still alive
    alive = grown = 0
    keep = []
    for node in g.nodes:
        # If nodes and their branches' nodes wait for the plan: a branch not taken may not
        # even be computable (a Squeeze of a dim that is not 1)
        if (
            node.op in RNN_OPS
            or node.op == "If"
            or not all(i == "" or i in g.constants for i in node.inputs)
        ):
            keep.append(node)
            continue
        if any(readers.get(o, 0) for o in node.outputs if o):
            vals = [g.constants[i] if i else None for i in node.inputs]
            ins = [None if v is None else Out(v.shape, v.dtype) for v in vals]
            try:
                metas = infer(ctx, node, ins, vals)
            except LeanRNNError:
                # A branch's node of constants folds too (the weights an exporter builds
                # inside a branch: its RNN is then packed at load, not per run), unless it
                # cannot be computed (a branch not meant to run: a Squeeze of a dim that is
                # not 1); then it waits for a plan that takes its branch
                if not node.when:
                    raise
                keep.append(node)
                continue
            made = sum(math.prod(m.shape) for m in metas)
            read = sum(g.constants[i].size for i in set(node.inputs) if i)
            last = [i for i in set(node.inputs) if i and readers[i] == node.inputs.count(i)]
            after = alive - sum(folded.get(i, 0) for i in last) + made
            for what, total in (
                ("folded constants alive", after),
                ("values folding made beyond what it read", grown + max(made - read, 0)),
            ):
                if max(made, total) > limit:
                    raise ModelFormatError(
                        f"[load] node {node.name!r} ({node.op}) would make {made} values of "
                        f"constants {[list(m.shape) for m in metas[:4]]}, bringing the {what} "
                        f"to {total}; refusing more than {limit} (the file's constants plus "
                        f"{FOLD_SLACK_BYTES // 4} values of slack): a model's constant "
                        "subgraphs do not expand this much"
                    )
            grown += max(made - read, 0)
            try:
                res = guard(node, evaluate, ctx, node, vals, metas)
            except LeanRNNError:
                if not node.when:
                    raise
                grown -= max(made - read, 0)
                keep.append(node)
                continue
            del vals
            for name, arr in zip(node.outputs, res, strict=False):
                if name and readers.get(name, 0):
                    g.constants[name] = np.asarray(arr, order="C")
                    folded[name] = g.constants[name].size
                    alive += folded[name]
            del res
        for i in node.inputs:
            readers[i] -= 1
            if i and not readers[i]:
                del g.constants[i]
                alive -= folded.pop(i, 0)
    g.nodes = keep


def _drop_weight_inputs(node: Node, ins: list[str], slots: tuple[int, ...]) -> None:
    """The node's packed weights' inputs become "" (trailing ones dropped)."""
    for k in slots:
        ins[k] = ""
    while ins and ins[-1] == "":
        ins.pop()
    node.inputs = tuple(ins)


def pack_constant_rnns(graph: Graph, dtype=None, lazy: dict | None = None) -> None:
    """Pack every RNN node whose W, R, B, P are constants (in ``graph.constants``, or read on
    demand from ``lazy``) and drop those inputs from the node (and the constants nobody else
    reads). Idempotent. Runs at import (with ``lazy``) and again after folding.

    ``lazy`` maps a name to a constant an importer reads only when its node is packed: an object
    with ``dims`` (declared shape) and ``read(rows=None)``; ``rows=(order, H)`` reads a
    [D, G, X] weight with its H-row gate blocks taken in ``order``, i.e. straight into internal
    gate order. Reading one node's weights at a time keeps the peak near one copy of the model."""
    lazy = lazy or {}

    def get(name):
        return graph.constants[name] if name in graph.constants else lazy[name].read()

    # Nodes naming the same weights (an unrolled decoder: one LSTM node a step, on one W and
    # R) share one packing; packed apart, a 2 MiB file of 500 such nodes took 1 GiB. What is
    # packed is then bounded by the weights the file holds, as fold's values are, with a
    # ratio and slack for padding (a tiny model's panels are many times its weights); counted
    # in values (a float16 file widens at load), checked before each buffer is allocated.
    def held(name):
        c = graph.constants.get(name)
        return c.size if c is not None else math.prod(lazy[name].dims) if name in lazy else 0

    weights = {n.inputs[k] for n in graph.nodes if n.op in RNN_OPS
               for k in (1, 2, 3, 7) if k < len(n.inputs) and n.inputs[k]}  # fmt: skip
    slack = FOLD_SLACK_BYTES // 4
    limit = PACK_RATIO * sum(held(w) for w in weights) + slack
    packed = 0  # by this call (the nodes packed before have no weight inputs left)
    shared: dict[tuple, PackedWeights] = {}
    for node in graph.nodes:
        if node.op not in RNN_OPS or node.name in graph.packed:
            continue
        ins = list(node.inputs) + [""] * (8 - len(node.inputs))
        weight_slots = (1, 2, 3, 7)  # W, R, B, P
        same = (node.op, tuple(ins[k] for k in weight_slots), repr(sorted(node.attrs.items())))
        if any(
            ins[k] and ins[k] not in graph.constants and ins[k] not in lazy for k in weight_slots
        ):
            continue  # weights are computed at run time; the engine packs them per run
        if not ins[1] or not ins[2]:
            raise ModelFormatError(f"[load_onnx] node {node.name!r} ({node.op}) has no W or R")
        if same in shared:
            graph.packed[node.name] = shared[same]
            _drop_weight_inputs(node, ins, weight_slots)
            continue
        # W and R of D x [G, X] in ONNX gate order; read from the file straight into internal
        # order when the declared dims agree with the node (otherwise rnn_from_node reports)
        W = R = None
        ng = {"lstm": 4, "gru": 3, "rnn": 1}[RNN_OPS[node.op]]
        lw, lr = lazy.get(ins[1]), lazy.get(ins[2])
        if lw is not None and lr is not None and len(lw.dims) == 3 and len(lr.dims) == 3:
            H = node.attrs["hidden_size"] or lr.dims[2]
            if lw.dims[1] == lr.dims[1] == ng * H and lr.dims[2] == H and lw.dims[0] == lr.dims[0]:
                order = ONNX_ORDER[RNN_OPS[node.op]]
                W, R = lw.read((order, H)), lr.read((order, H))
        in_onnx_order = W is None
        if in_onnx_order:
            W, R = get(ins[1]), get(ins[2])
        B, P = (get(ins[k]) if ins[k] else None for k in (3, 7))
        if node.op != "LSTM" and P is not None:
            P = None  # only LSTM has input 7; others never get here with one
        spec, layers = rnn_from_node(
            node.op,
            node.attrs,
            W,
            R,
            B,
            P,
            f"node {node.name!r}",
            gates_in_onnx_order=in_onnx_order,
        )
        wdtype = W.dtype
        del W, R  # the unpacked weights go before the next node's are read
        packed += PackedWeights.size(spec, dtype or wdtype) // np.dtype(dtype or wdtype).itemsize
        if packed > limit:
            raise ModelFormatError(
                f"[load] node {node.name!r} ({node.op}) brings the packed RNN weights to "
                f"{packed} values; the file's RNN weights hold {(limit - slack) // PACK_RATIO}, "
                f"and more than {PACK_RATIO}x that plus {slack} values of slack is refused"
            )
        graph.packed[node.name] = shared[same] = pack(spec, layers, dtype or wdtype)
        _drop_weight_inputs(node, ins, weight_slots)
    used = {i for n in graph.nodes for i in n.inputs} | {t.name for t in graph.outputs}
    for k in [k for k in graph.constants if k not in used]:
        del graph.constants[k]


def prune(g: Graph) -> set[str]:
    """Drop nodes, constants and packed weights no graph output needs; returns the names of
    the tensors that are needed."""
    needed = {t.name for t in g.outputs}
    keep = []
    for node in reversed(g.nodes):
        if any(o in needed for o in node.outputs):
            keep.append(node)
            needed |= {i for i in node.inputs if i} | {c for c, _ in node.when}
    g.nodes = keep[::-1]
    for k in [k for k in g.constants if k not in needed]:
        del g.constants[k]
    names = {n.name for n in g.nodes}
    for k in [k for k in g.packed if k not in names]:
        del g.packed[k]
    return needed


def fuse(g: Graph) -> bool:
    """Fold ``Transpose(perm=[0, 2, 1, 3])`` of a layout-0 RNN's Y into the RNN node: the
    engine writes y as [T, N, D, H] anyway, so exporters' transpose back (torch emits one
    after every bidirectional layer) costs neither a copy nor a buffer. And fold a constant
    bias added to a MatMul by a constant [K, M] into it (``fuse_bias``)."""
    consumers: dict[str, list[Node]] = {}
    for node in g.nodes:
        for i in node.inputs:
            consumers.setdefault(i, []).append(node)
    outputs = {t.name for t in g.outputs}
    dropped = fuse_bias(g, consumers, outputs)
    for node in g.nodes:
        if node.op not in RNN_OPS or node.attrs.get("layout") != 0 or not node.outputs:
            continue
        y = node.outputs[0]
        users = consumers.get(y, [])
        if not y or y in outputs or node.attrs.get("y_tndh") or len(users) != 1:
            continue
        t = users[0]
        if t.op != "Transpose" or [int(p) for p in t.attrs.get("perm", ())] != [0, 2, 1, 3]:
            continue
        node.outputs = (t.outputs[0], *node.outputs[1:])
        node.attrs["y_tndh"] = True
        dropped.add(t.name)
    g.nodes = [n for n in g.nodes if n.name not in dropped]
    return bool(dropped)


def fuse_bias(g: Graph, consumers: dict[str, list[Node]], outputs: set[str]) -> set[str]:
    """``Add(MatMul(a, B), bias)`` with constant B [K, M] and bias [M] (torch's Linear as
    exported: the classifier head) becomes one MatMul with a third input, the bias, marked
    ``fused_bias``: the packed product adds it in its tiles' final store (pack_matmuls), so
    the [rows, M] product is neither stored apart nor read again by a second pass (at N=64,
    T=100 and 1000 classes: 26 MB written and read back). Returns the dropped Add nodes."""
    dropped: set[str] = set()
    for node in g.nodes:
        if node.op != "MatMul" or len(node.inputs) != 2 or len(node.outputs) != 1:
            continue
        B = g.constants.get(node.inputs[1])
        y = node.outputs[0]
        users = consumers.get(y, [])
        if B is None or B.ndim != 2 or y in outputs or len(users) != 1:
            continue
        add = users[0]
        if add.op != "Add" or len(add.inputs) != 2 or add.name in dropped:
            continue
        other = add.inputs[1] if add.inputs[0] == y else add.inputs[0]
        bias = g.constants.get(other)
        # [M] only: a bias of higher rank could broadcast the sum to a larger shape
        if other == y or bias is None or bias.shape != (B.shape[1],) or bias.dtype != B.dtype:
            continue
        node.inputs = (*node.inputs, other)
        node.outputs = tuple(add.outputs)
        node.attrs["fused_bias"] = True
        dropped.add(add.name)
    g.nodes = [n for n in g.nodes if n.name not in dropped]
    return dropped


def classify(g: Graph, input_names: list[str]) -> tuple[dict[str, str], set[str]]:
    """Which tensors depend only on input shapes ("shape": evaluated at resize) and which on
    input values ("data": planned in the arena, computed at run); returns (kind by tensor, names of
    the shape nodes)."""
    kind = dict.fromkeys(g.constants, "const")
    kind.update(dict.fromkeys(input_names, "data"))
    shape_nodes: set[str] = set()
    ifs = {n.inputs[0]: n.name for n in g.nodes if n.op == "If" and n.inputs}  # by condition
    for node in g.nodes:
        if node.op == "Shape" or (
            node.op not in RNN_OPS
            and all(kind.get(i) in ("const", "shape") for i in node.inputs if i)
        ):
            k = "shape"
            shape_nodes.add(node.name)
        else:
            k = "data"
        conds = [c for c, _ in node.when] + ([node.inputs[0]] if node.op == "If" else [])
        data = [c for c in conds if kind.get(c) == "data"]
        if data:
            raise UnsupportedOpError(
                f"[load] If node {ifs.get(data[0], node.name)!r} has condition {data[0]!r}, "
                "which depends on input values; leanrnn runs If only when its condition comes "
                "from input shapes and constants (known when a run is planned)"
            )
        kind.update(dict.fromkeys((o for o in node.outputs if o), k))
    return kind, shape_nodes


def pack_matmuls(g: Graph, kind: dict[str, str]) -> dict[str, PackedMatmul]:
    """Pack the constant right-hand matrix of every MatMul [.., K] @ [K, M] and Gemm
    (transA = 0) whose left side is computed: the classifier head of a sequence model."""
    out = {}
    for node in g.nodes:
        if node.op not in ("MatMul", "Gemm") or len(node.inputs) < 2:
            continue
        B = g.constants.get(node.inputs[1])
        if B is None or B.ndim != 2 or not B.size or B.dtype not in (np.float32, np.float64):
            continue
        if node.op == "Gemm":
            if node.attrs.get("transA", 0):
                continue
            if node.attrs.get("transB", 0):
                B = B.T
        if kind.get(node.inputs[0]) == "data":
            bias = g.constants[node.inputs[2]] if node.attrs.get("fused_bias") else None
            out[node.name] = PackedMatmul.of(np.ascontiguousarray(B), bias)
    return out
