"""``GraphModel``: a graph model as the user holds it (what ``leanrnn.load`` returns for ONNX files
and graph ``.lrnn`` files). It sits above the engine, like ``nn.Model``: the engine's passes
(``LoadedGraph``) and ``GraphSession`` run it, ``formats.native`` saves it.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import re
import threading
from typing import Any

import numpy as np

from .engine import _check, _fork
from .engine.graph import GraphSession, LoadedGraph
from .engine.graph.quant_ops import quantization_constants
from .engine.model import parameter_count, spec_line
from .errors import LeanRNNError, ShapeError, SpecError
from .formats import native
from .formats.packing import pack
from .formats.quantize import weight_bits
from .ir import RNN_OPS, Graph, Node
from .memory.planner import Plan
from .nn import GRU, LSTM, RNN, Model


class GraphModel:
    """A runnable op graph around RNN nodes (what ``leanrnn.load`` returns for ONNX files).

    ``model(*inputs)`` or ``model(**named)`` returns the graph's outputs (one array, or a tuple);
    ``run(feeds)`` returns a list. Inputs must have the declared dtypes (nothing is converted).
    Returned arrays belong to the caller (fresh per run). The model takes ownership of ``graph``
    and rewrites it at load (folded constants, packed weights, pruned and fused nodes); that
    rewritten graph is what ``save`` stores.

        >>> m = leanrnn.load("model.onnx")                      # doctest: +SKIP
        >>> logits = m(tokens)                                  # doctest: +SKIP
    """

    def __init__(self, graph: Graph, threads: int | None = None) -> None:
        self._loaded = LoadedGraph(graph, _check.count_or_none("GraphModel", "threads", threads))
        self._lock = threading.Lock()
        _fork.renew_lock(self)  # a fork mid-run must not leave the child's lock held
        self._session: GraphSession | None = None
        self._limit: int | None = None  # a dropped session's memory_limit (threads' setter)

    def __reduce__(self):
        # deepcopy and pickle (a worker process, a copy per thread): the graph (its constants
        # and packed weights copied, PackedWeights.__reduce__) loaded again, as a saved
        # .lrnn is: the load-time passes leave a graph they made as it is. The lock, the
        # session and its arenas belong to this process and this model; the memory_limit of
        # its last resize comes along (a copy ran what the original refused).
        limit = self._session._limit if self._session is not None else self._limit
        return type(self), (self.graph, self._loaded.threads), {"_limit": limit}

    def __setattr__(self, name: str, value) -> None:
        # `m.graph = other` ran one graph and saved, copied and described another; `m.thread
        # = 2` was taken and changed nothing. What the model reports (its properties but
        # threads) and near misses of threads are refused; other names are the caller's
        # (a subclass's own attributes, a tag, a mock of a method).
        attr = getattr(type(self), name, None)
        fixed = isinstance(attr, property) and attr.fset is None
        typo = (attr is None and not name.startswith("_") and name not in self.__dict__
                and difflib.get_close_matches(name, ["threads"], n=1, cutoff=0.85))  # fmt: skip
        if fixed or typo:
            hint = " (did you mean 'threads'?)" if typo else ""
            raise AttributeError(f"[GraphModel] cannot set {name!r}{hint}: a loaded graph is "
                                 "fixed (load the other file; threads is its one setting)")  # fmt: skip
        object.__setattr__(self, name, value)

    @property
    def graph(self) -> Graph:
        """The graph as loaded and rewritten (folded constants, packed weights): what runs,
        what ``save`` writes."""
        return self._loaded.graph

    @property
    def threads(self) -> int | None:
        """Kernel threads (None: all). Set after a run, the next run plans a session anew
        with them (the planned one kept its threads while this said otherwise)."""
        return self._loaded.threads

    @threads.setter
    def threads(self, value: int | None) -> None:
        self._loaded.threads = _check.count_or_none("GraphModel", "threads", value)  # -1 ran late
        with self._lock:  # the next run's session: these threads, the last resize's limit
            if self._session is not None:
                self._limit = self._session._limit
            self._session = None

    # -- the recurrent stack inside
    def as_stack(self) -> Model:
        """The recurrent stack this graph computes, as a ``leanrnn.LSTM``/``GRU``/``RNN``, when
        that is all it computes: its RNN nodes (forward, weights in the file) chained layer to
        layer, and no more than the glue exporters write around them (``torch.onnx.export`` of
        an ``nn.LSTM``, TorchScript's or dynamo's: initial states of zeros made from the
        input's shape, or graph inputs; the Squeeze or Reshape of Y's direction axis between
        layers; the Transposes of a batch-first layout; the Concat of the layers' final
        states). Its ``model(x, hx)`` gives the graph's outputs as ``(y, h_n)`` /
        ``(y, (h_n, c_n))``, same weights and attributes (an ONNX node's clip, activations,
        peepholes run as in the graph). ``leanrnn serve`` serves a graph this way.

        The RNN nodes, their attributes and the graph's ends are read off the graph; the glue
        between them (data movement only: Identity, Transpose, Squeeze, Reshape) is then
        checked by running both on random inputs of four shapes (a Reshape's shape is often
        computed from the input's; one computed from its values is refused): ``SpecError``
        naming what else the graph computes, or where the two differ, otherwise. The stack
        has weights of its own (training it leaves the graph as it was)."""
        g = self.graph
        nodes = self.rnn_nodes
        made = {o: n for n in g.nodes for o in n.outputs if o}
        inputs = {t.name: t for t in g.inputs}

        def refuse(why: str):
            return SpecError(f"[GraphModel.as_stack] {why}; only a graph that is a recurrent "
                             "stack and the glue around it is one")  # fmt: skip

        if not nodes:
            raise refuse("the graph has no RNN node")
        L = len(nodes)
        packed = []
        for node in nodes:
            pw = g.packed.get(node.name)
            if pw is None:
                raise refuse(f"RNN node {node.name!r} takes its weights as graph inputs or "
                             "computed tensors")  # fmt: skip
            if pw.spec.direction != "forward":
                raise refuse(f"RNN node {node.name!r} is {pw.spec.direction}")
            if len(node.inputs) > 4 and node.inputs[4]:
                raise refuse(f"RNN node {node.name!r} takes sequence_lens from the graph")
            if node.when:
                raise refuse(f"RNN node {node.name!r} runs inside an If branch")
            packed.append(pw)
        spec0 = packed[0].spec
        for node, pw in zip(nodes[1:], packed[1:], strict=True):
            if dataclasses.replace(pw.spec, input_size=spec0.input_size) != spec0 or (
                pw.precision != packed[0].precision or pw.dtype != packed[0].dtype
            ):
                raise refuse(f"RNN node {node.name!r} is not a layer like the first "
                             f"({spec_line(pw.spec)} after {spec_line(spec0)})")  # fmt: skip

        def moved(name: str, stop) -> str:
            """Back from tensor ``name`` through data movement (Identity, Transpose, Squeeze,
            a Reshape to a shape computed from shapes) until ``stop(name)``: that tensor."""
            for _ in range(len(g.nodes) + 1):
                if stop(name):
                    return name
                p = made.get(name)
                if p is None or p.when or p.op not in ("Identity", "Transpose", "Squeeze",
                                                       "Reshape"):  # fmt: skip
                    break
                # its target shape computed from constants and the inputs' shapes alone (the
                # load's classification): the probes below then see what it does at any
                # size, where one read off the inputs' values could do anything
                shape = p.inputs[1] if len(p.inputs) > 1 else ""
                if p.op == "Reshape" and self._kind.get(shape) not in ("const", "shape"):
                    raise refuse(f"Reshape {p.name!r} takes a shape computed from the inputs' "
                                 "values")  # fmt: skip
                name = p.inputs[0]
            what = f"a {made[name].op} op" if name in made else "no op"
            raise refuse(f"tensor {name!r} is made by {what}, which the stack does not explain")

        # layer 0 reads a graph input; layer k the layer before it
        x_name = moved(nodes[0].inputs[0], inputs.__contains__)
        for k in range(1, L):
            prev = nodes[k - 1].outputs[0]
            if moved(nodes[k].inputs[0], lambda n, prev=prev: n == prev) != prev:
                raise refuse(f"RNN node {nodes[k].name!r} does not read the layer before it")

        # the initial states: zeros made by the graph, or graph inputs (layer k: slice k)
        def zeros(name: str) -> bool:
            for _ in range(len(g.nodes) + 1):
                if name in g.constants:
                    return not np.any(g.constants[name])
                p = made.get(name)
                if p is None or p.when:
                    return False
                if p.op == "ConstantOfShape":
                    v = p.attrs.get("value")
                    return v is None or not np.any(
                        np.asarray(v.get("values", 0) if isinstance(v, dict) else v)
                    )
                if p.op == "Concat":
                    return all(zeros(i) for i in p.inputs if i)
                if p.op not in ("Identity", "Cast", "Expand", "Reshape", "Slice", "Squeeze",
                                "Unsqueeze", "Transpose", "Tile", "Gather"):  # fmt: skip
                    return False
                name = p.inputs[0]
            return False

        state_inputs: dict[str, str] = {}  # "h0"/"c0" -> the graph input it comes from
        for slot, what in ((5, "h0"), (6, "c0")):
            src = set()
            for k, node in enumerate(nodes):
                name = node.inputs[slot] if len(node.inputs) > slot else ""
                if not name or zeros(name):
                    src.add(None)
                    continue
                p = made.get(name)
                if name in inputs and L == 1:
                    src.add(name)
                elif (p is not None and p.op == "Slice" and p.inputs[0] in inputs
                      and _slices_layer(p, g.constants, k)):  # fmt: skip
                    src.add(p.inputs[0])
                else:
                    raise refuse(f"RNN node {node.name!r}'s initial state {name!r} is neither "
                                 "zeros nor a graph input")  # fmt: skip
            if len(src) > 1:
                raise refuse(f"the layers' {what} come from different places")
            (one,) = src
            if one is not None:
                state_inputs[what] = one
        others = set(inputs) - {x_name, *state_inputs.values()}
        if others:
            raise refuse(f"the graph takes inputs {sorted(others)} the stack has no use for")

        # every graph output: the last layer's Y, or the layers' final states (one layer's, or
        # all of them concatenated in layer order)
        last = nodes[-1]
        finals = [[n.outputs[j] if len(n.outputs) > j else "" for n in nodes] for j in (1, 2)]
        roles = []
        for t in g.outputs:
            name = t.name
            while name in made and made[name].op == "Identity" and not made[name].when:
                name = made[name].inputs[0]
            p = made.get(name)
            # (a Concat of the layers' final states on axis 0, -3 of their rank 3; of one)
            stacked = (p is not None and p.op == "Concat" and not p.when
                       and int(p.attrs.get("axis", 0)) % 3 == 0)  # fmt: skip
            for j, role in ((0, "h_n"), (1, "c_n")):
                if (L == 1 and name == finals[j][0]) or (stacked and list(p.inputs) == finals[j]):
                    roles.append(role)
                    break
            else:
                if name in inputs or name in g.constants:
                    raise refuse(f"output {t.name!r} is not computed by the stack")
                moved(name, lambda n: n == last.outputs[0])
                roles.append("y")

        batch_first = self._batch_first(x_name)
        spec = dataclasses.replace(spec0, num_layers=L, batch_first=batch_first)
        if L == 1:  # a copy of its own: a trained stack left the graph's weights changed
            weights = copy.deepcopy(packed[0])
            weights.spec = spec
        elif packed[0].precision != "float":
            raise refuse(f"its {L} RNN nodes hold {packed[0].precision} weights (a stack of "
                         "separate reduced layers is made only from float ones)")  # fmt: skip
        else:
            weights = pack(spec, [pw.unpack()[0] for pw in packed], packed[0].dtype)
        cls = {"lstm": LSTM, "gru": GRU, "rnn": RNN}[spec.cell]
        stack = cls._from_packed(weights, self.threads)
        self._check_stack(stack, x_name, state_inputs, roles)
        return stack

    def _batch_first(self, x_name: str) -> bool:
        """Whether input ``x_name`` is batch-first: the first RNN node's X axes traced back to
        it through its Transposes (_rnn_input_axes); time-major where they are not traced."""
        name, axes, _ = _rnn_input_axes(self)
        return name == x_name and axes.get(0) == "N"

    def _check_stack(self, stack: Model, x_name: str, state_inputs: dict, roles: list) -> None:
        """as_stack's last check: the graph and ``stack`` agree on random inputs of four
        shapes (T and N apart, and each of them 1; fewer where the graph declares fixed
        sizes), which the glue's data movement would not if it did anything but what the
        stack does."""
        decl = next(t.shape for t in self.graph.inputs if t.name == x_name) or (None,) * 3
        if len(decl) != 3:
            raise SpecError(f"[GraphModel.as_stack] input {x_name!r} is declared of rank "
                            f"{len(decl)}; a stack takes [T, N, C] (or [N, T, C])")  # fmt: skip
        bf = stack.batch_first
        rng = np.random.default_rng(0)
        tried = set()
        for T, N in ((3, 2), (5, 3), (7, 1), (1, 4)):
            shape = [N, T] if bf else [T, N]
            shape = tuple(d if isinstance(d, int) else want
                          for d, want in zip(decl, [*shape, stack.input_size], strict=True))  # fmt: skip
            if shape in tried:
                continue
            tried.add(shape)
            n = shape[0] if bf else shape[1]
            x = rng.uniform(-1, 1, shape).astype(stack.dtype)
            LK = (stack.num_layers, n)
            feeds = {x_name: x}
            hx = {}
            for what, name in state_inputs.items():
                width = stack.spec.output_size if what == "h0" else stack.hidden_size
                feeds[name] = hx[what] = rng.uniform(-1, 1, (*LK, width)).astype(stack.dtype)
            try:
                got = self.run(feeds)
            except LeanRNNError as e:
                raise SpecError(f"[GraphModel.as_stack] the graph does not run on a probe input "
                                f"of shape {list(shape)}: {e}") from None  # fmt: skip
            state = None
            if stack.spec.cell == "lstm" and hx:
                zero = np.zeros((*LK, stack.hidden_size), stack.dtype)
                state = (hx.get("h0", zero[..., : stack.spec.output_size]), hx.get("c0", zero))
            elif hx:
                state = hx["h0"]
            y, h = stack(x, state)
            mine = {"y": y, "h_n": h[0] if isinstance(h, tuple) else h,
                    "c_n": h[1] if isinstance(h, tuple) else None}  # fmt: skip
            for role, out, name in zip(roles, got, self.output_names, strict=True):
                ref = mine[role]
                if ref is not None and ref.shape == out.shape:
                    if np.allclose(out, ref, rtol=1e-4, atol=1e-5):
                        continue
                    what = "other values"
                else:
                    what = f"shape {list(out.shape)}"
                raise SpecError(
                    f"[GraphModel.as_stack] output {name!r} is not the stack's {role} (a "
                    f"probe input of shape {list(shape)} gave {what}): the glue around the RNN "
                    "nodes computes something else"
                )

    # -- description
    @property
    def input_names(self) -> list[str]:
        return self._loaded.input_names

    @property
    def output_names(self) -> list[str]:
        return self._loaded.output_names

    @property
    def rnn_nodes(self) -> list[Node]:
        return [n for n in self.graph.nodes if n.op in RNN_OPS]

    @property
    def _matmuls(self) -> dict:
        return self._loaded.matmuls

    @property
    def _kind(self) -> dict[str, str]:
        return self._loaded.kind

    @property
    def lengths_input(self) -> str | None:
        """The graph input that feeds an RNN node's sequence_lens, directly or through the ops
        an exporter puts between them (torch's Cast, or the sort of pack_padded_sequence's
        enforce_sorted=False: Cast, TopK): the one integer graph input the sequence_lens
        tensors are computed from; None when there is none, or several."""
        # rank 1 ([N]), or undeclared: token ids [N, T] feed sequence_lens too (a mask's sum)
        ints = {t.name for t in self.graph.inputs if np.dtype(t.dtype).kind in "iu"
                and (t.shape is None or len(t.shape) == 1)}  # fmt: skip
        made_by = {o: n for n in self.graph.nodes for o in n.outputs if o}
        found: set[str] = set()
        seen: set[str] = set()
        todo = [n.inputs[4] for n in self.rnn_nodes if len(n.inputs) > 4 and n.inputs[4]]
        while todo:
            name = todo.pop()
            if name in seen:
                continue
            seen.add(name)
            if name in ints:
                found.add(name)
            elif name in made_by:
                todo.extend(i for i in made_by[name].inputs if i)
        return found.pop() if len(found) == 1 else None

    def __repr__(self) -> str:
        ops = ", ".join(n.op for n in self.graph.nodes)
        return f"GraphModel({self.graph.name!r}: {self.input_names} -> {self.output_names}; {ops})"

    def describe(self, batch: int, steps: int) -> dict:
        """Nodes, parameters, weight bytes and the arenas planned for ``batch`` sequences of
        ``steps`` steps (input shapes from the declared ones; see ``_input_shapes``). The
        reported ``batch``/``steps`` are what was planned: None for a size the declared shapes
        fix (the arena's ``input_shapes`` then say what was planned instead). An input whose
        shape the file leaves unknown (and which does not feed an RNN node's X or lengths)
        leaves ``arena`` None and says why in ``unplanned``."""
        batch = _check.count("GraphModel.describe", "batch", batch, ShapeError)
        steps = _check.count("GraphModel.describe", "steps", steps, ShapeError)
        g = self.graph
        layers, params, wbytes = [], 0, 0
        owners = g.weight_owners()
        for node in g.nodes:
            pw = g.packed.get(node.name)
            if node.op in RNN_OPS and pw is not None and owners[node.name] != node.name:
                # another node's weights (an exporter's unrolled decoder): one copy in
                # memory and in a file, counted once
                layers.append({"node": node.name, "op": node.op, "spec": spec_line(pw.spec),
                               "shares": owners[node.name]})  # fmt: skip
            elif node.op in RNN_OPS and pw is not None:
                layers.append(
                    {
                        "node": node.name,
                        "op": node.op,
                        "spec": spec_line(pw.spec),
                        "weight_bytes": pw.nbytes,
                        "precision": pw.precision,
                        "weight_bits": weight_bits(pw),
                        "panel_bytes": pw.weight_bytes,
                    }
                )
                params += parameter_count(pw.spec)
                wbytes += pw.nbytes
            else:
                layers.append({"node": node.name, "op": node.op})
            if node.when:  # runs in an If's branch, when these conditions hold
                layers[-1]["when"] = [[c, t] for c, t in node.when]
        # parameters as torch counts the float model's: float constants and quantized (8-bit)
        # weights, not the scales and zero points that quantization added
        quant = quantization_constants(g)
        for name, c in g.constants.items():
            if name not in quant and (c.dtype.kind == "f" or c.dtype in (np.int8, np.uint8)):
                params += c.size
            wbytes += c.nbytes
        info = {
            "kind": "graph",
            "inputs": [t.to_dict() for t in g.inputs],
            "outputs": [t.to_dict() for t in g.outputs],
            "layers": layers,
            "parameters": int(params),
            "weight_bytes": int(wbytes),
        }
        try:
            shapes = _input_shapes(self, batch, steps)
        except ShapeError as e:  # the file says too little to plan: describe the rest
            return {**info, "batch": batch, "steps": steps, "arena": None, "unplanned": str(e)}
        est = self.session.estimate(shapes)  # planned, not made: describing allocates nothing
        fixed = _fixed_sizes(self, batch, steps, shapes)
        arena = {
            "input_shapes": {k: list(v) for k, v in shapes.items()},
            "graph_arena_bytes": est["arena_bytes"],
            "graph_arena_naive_bytes": est["plan"].naive_total,
            "rnn_arena_bytes": est["rnn_arena_bytes"],
            "shape_constant_bytes": est["shape_constant_bytes"],
            "working_bytes": est["working_bytes"],
        }
        parts = ("graph_arena_bytes", "rnn_arena_bytes", "shape_constant_bytes", "working_bytes")
        arena["total_bytes"] = sum(arena[k] for k in parts)
        return {
            **info,
            "batch": None if "batch" in fixed else batch,
            "steps": None if "steps" in fixed else steps,
            "arena": arena,
        }

    def save(self, path) -> str:
        """Write the (rewritten) graph as a graph ``.lrnn`` file at ``path`` (which must end in
        ``.lrnn``: ``ModelFormatError`` otherwise); returns the path."""
        native.save_graph(self.graph, path)
        return path

    def stream(self, batch: int = 1):
        """Not supported for graphs: carrying RNN nodes' states across calls is only exact when
        every other op is independent per time step, which leanrnn does not analyse yet."""
        raise SpecError(
            f"[GraphModel.stream] {self.graph.name!r} is an op graph; leanrnn streams recurrent "
            "stacks only (LSTM/GRU/RNN models). Run the graph on the whole sequence with "
            "run(), or load the recurrent stack alone (a .lrnn, checkpoint or state dict)"
        )

    # -- running
    @property
    def session(self) -> GraphSession:
        if self._session is None:
            with self._lock:  # two threads' first runs must not plan two sessions
                if self._session is None:
                    session = GraphSession(self._loaded)
                    session._limit = self._limit
                    self._session = session
        return self._session

    def run(self, feeds, times: dict[str, float] | None = None) -> list[np.ndarray]:
        """Outputs (in ``output_names`` order) for ``feeds``: a dict name -> array, or a list in
        ``input_names`` order. ``times``: a dict that gets each node's wall seconds added
        under "op name" (GraphSession.run)."""
        return self.session.run(feeds, times)

    def __call__(self, /, *args, **kwargs) -> Any:  # (an input may be named "self")
        if args and kwargs:
            raise ShapeError("[GraphModel] pass inputs positionally or by name, not both")
        outs = self.run(dict(kwargs) if kwargs else list(args))
        return outs[0] if len(outs) == 1 else tuple(outs)

    def resize(self, shapes, dtypes=None, memory_limit: int | float | None = None) -> Plan:
        """Plan the session for input ``shapes`` (dict or list) in at most ``memory_limit``
        bytes of arena, the graph's and its RNN nodes' together (an int, or a whole float such
        as 4e6); see ``GraphSession.resize``."""
        memory_limit = _check.bytes_or_none("GraphModel.resize", "memory_limit", memory_limit)
        return self.session.resize(shapes, dtypes, memory_limit)


_T_NAMES = re.compile(r"^(t|time|steps?|seq(uence)?(_?len(gth)?)?|sequence_length|len)$", re.I)
_N_NAMES = re.compile(r"^(n|b|batch(_?size)?|num_seq)$", re.I)


def _input_shapes(model: GraphModel, batch: int, steps: int) -> dict[str, tuple[int, ...]]:
    """Concrete shapes for a graph's inputs for N=batch, T=steps: declared ints are kept;
    symbolic dims named like batch/time take N/T; the rest follow the first RNN node's layout
    ([T, N, ...] for layout 0, [N, T, ...] for layout 1) — through the Transposes (and an
    embedding's Gather) between it and the input that feeds it, as exporters of batch-first
    modules write them (a [N, T, C] input transposed for a layout-0 node was planned as
    [T, N, C]: 2.9x the arena)."""
    size = {"T": steps, "N": batch}
    feeder, roles, width = _rnn_input_axes(model)
    shapes = {}
    for t in model.graph.inputs:
        shape = t.shape
        if shape is None and t.name == feeder and width is not None:
            # undeclared (exporters of other frameworks leave it so): X's axes, C from W
            shape = [width[1] if i == width[0] else roles[i] for i in range(len(roles) + 1)]
        elif shape is None and t.name == model.lengths_input:
            shape = ["N"]  # sequence_lens: one length per sequence
        if shape is None:
            raise ShapeError(f"[inspect] input {t.name!r} has no declared shape (and does not "
                             "feed an RNN node's X or sequence_lens directly); cannot plan it")  # fmt: skip
        order = [r for _, r in sorted(roles.items())] if t.name != feeder else None
        dims = []
        free = 0
        for i, d in enumerate(shape):
            if isinstance(d, int):
                dims.append(d)
            elif order is None and i in roles:  # the RNN's own input: its axes are known (a
                dims.append(size[roles[i]])  # name such as "b" says less than the graph)
            elif isinstance(d, str) and _T_NAMES.match(d):
                dims.append(steps)
            elif isinstance(d, str) and _N_NAMES.match(d):
                dims.append(batch)
            elif order is None:
                dims.append(1)
            else:
                dims.append(size[order[free]] if free < 2 else 1)
                free += 1
        shapes[t.name] = tuple(dims)
    return shapes


def _rnn_input_axes(model: GraphModel):
    """(the graph input that feeds the first RNN node's X, {its axis: "T" or "N"}, (its
    axis, size) that is X's feature axis C or None), traced back from X's axes through
    Transpose, Identity, Cast and an embedding Gather's indices (which have no C axis);
    (None, X's own axes, None) where the path is anything else."""
    node = next(iter(model.rnn_nodes), None)
    layout = 0 if node is None else node.attrs.get("layout", 0)
    roles = {0: "T", 1: "N"} if layout == 0 else {0: "N", 1: "T"}
    if node is None:
        return None, roles, None
    pw = model.graph.packed.get(node.name)  # (None: weights fed as inputs)
    made = {o: n for n in model.graph.nodes for o in n.outputs if o}
    inputs = {t.name for t in model.graph.inputs}
    name, axes, rank = node.inputs[0], dict(roles), 3
    width = None if pw is None else (2, pw.spec.input_size)
    for _ in range(len(made) + 1):
        if name in inputs:
            return name, axes, width
        p = made.get(name)
        if p is None:
            break
        if p.op == "Transpose" and p.attrs.get("perm") is not None:
            perm = list(p.attrs["perm"])  # output axis i is input axis perm[i]
            if len(perm) != rank:
                break
            axes = {perm[i]: r for i, r in axes.items()}
            width = None if width is None else (perm[width[0]], width[1])
            name = p.inputs[0]
        elif p.op in ("Identity", "Cast"):
            name = p.inputs[0]
        elif p.op == "Gather" and int(p.attrs.get("axis", 0)) == 0 and len(p.inputs) > 1:
            # an embedding: the output's leading axes are the indices'
            name, width, rank = p.inputs[1], None, rank - 1
        else:
            break
    return None, roles, None


def _fixed_sizes(model: GraphModel, batch: int, steps: int, shapes: dict) -> set[str]:
    """Which of "batch" and "steps" the declared input shapes leave no room for: the planned
    ``shapes`` (``_input_shapes(model, batch, steps)``) do not change with them."""
    return {name for name, b, s in (("batch", batch + 1, steps), ("steps", batch, steps + 1))
            if _input_shapes(model, b, s) == shapes}  # fmt: skip


def _slices_layer(node: Node, constants: dict, k: int) -> bool:
    """Whether Slice ``node`` takes index k of axis 0 (a stacked initial state's layer k)."""

    def arg(i: int, key: str):
        if len(node.inputs) > i and node.inputs[i]:
            v = constants.get(node.inputs[i])
            return None if v is None else [int(a) for a in np.atleast_1d(v)]
        v = node.attrs.get(key)
        return None if v is None else [int(a) for a in np.atleast_1d(v)]

    starts, ends, axes, steps = arg(1, "starts"), arg(2, "ends"), arg(3, "axes"), arg(4, "steps")
    return (starts == [k] and ends == [k + 1] and axes in (None, [0])
            and steps in (None, [1]))  # fmt: skip
