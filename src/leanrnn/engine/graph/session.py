"""GraphSession: plan one run shape of a loaded graph, then run it (MNN's onResize/onExecute split).

- ``resize`` walks the graph once with the input shapes. Tensors that depend only on input
  *shapes* (``Shape`` -> ``Gather`` -> ``Concat`` -> ``Reshape`` chains, ``ConstantOfShape``
  initial states) are evaluated right there, the large ones only once the whole run's bytes
  are known to fit the machine (PlanError before anything is allocated if not). Every other tensor gets a shape, a dtype and a
  lifetime [producing op, last reading op], and ``memory.planner`` packs them into one arena.
  View ops (Reshape, Squeeze, Unsqueeze, Flatten, Identity, Dropout; Transpose/Cast/Expand when
  they move no data) get no memory, and elementwise ops overwrite their input when nothing
  reads it later; both extend the lifetime of the memory they reuse.
- ``run`` hands each op its arena views; a graph output is a fresh array per run, written in
  place by the op that produces it.

RNN nodes' sessions share one arena (``Pool``: they run one after another) and unidirectional
ones run in chunks of steps, so their scratch does not grow with T.
"""

from __future__ import annotations

import math
import time
from collections import OrderedDict

import numpy as np

from ... import config
from ...errors import DTypeError, ModelFormatError, PlanError, ShapeError
from ...ir import RNN_OPS
from ...memory.arena import Arena, check_fits, reusable
from ...memory.planner import Buffer, Plan, plan
from ...threads import blas_alone
from .. import _check, _fork
from .._turn import Turn
from ..session import Pool, Session
from .ops import (
    INPLACE_OPS,
    OPS,
    Ctx,
    Out,
    evaluate,
    guard,
    infer,
    rnn_computes_y,
    taken_branch,
    truth,
)
from .passes import LoadedGraph
from .quant_ops import BLAS_OPS as QUANT_BLAS_OPS

_OP = "GraphSession.resize"
# Bytes up to which a shape-computed node is evaluated as soon as it is reached: shape math
# (Shape -> Gather -> Concat) whose values later nodes' shapes read. Larger ones (ConstantOfShape
# states [1, N, H]) wait until the whole run is known to fit.
_EVALUATE_NOW = 1 << 16


def _graph_turn() -> Turn:
    return Turn("GraphModel.run")


class GraphSession:
    """One planned arena for a loaded graph plus one engine Session per RNN node. Calls are
    serialized by a lock; one re-entered on its own thread (a signal handler's) is refused
    (engine._turn)."""

    def __init__(self, loaded: LoadedGraph) -> None:
        self.loaded = loaded
        g = loaded.graph
        # RNN nodes run one after another: their sessions share one arena (sized to the largest)
        self._pool = Pool()
        # Forward nodes run in chunks of steps (the Session's automatic chunk): their scratch
        # (the input projection above all) is O(chunk), not O(T), and the recurrence reads it
        # from cache; y is still written whole, in place. Reverse and bidirectional nodes run
        # whole: they need the whole sequence.
        self._sessions = {
            name: Session(pw, threads=loaded.threads, pool=self._pool)
            for name, pw in g.packed.items()
        }
        self._ctx = Ctx(g, self._sessions, loaded.threads, loaded.matmuls)
        self._ctx.needed = loaded.needed
        self._scratch = _scratch_prefix(g)
        # a run from a signal handler inside a run deadlocked on a plain lock: Turn refuses it;
        # a fork mid-run must not leave the child's lock held
        _fork.renew_lock(self, make=_graph_turn)
        self._lock = _graph_turn()
        # BLAS ops (MatMul, Gemm) between RNN nodes run on one thread: a multi-threaded BLAS's
        # spinning workers and leanrnn's spinning kernel threads otherwise starve each other on
        # every switch between them (measured: N=1 tagger run 16 ms -> 8 ms on 2 cores).
        ops = {n.op for n in g.nodes}
        self._blas_alone = (
            bool(ops & set(RNN_OPS))
            and bool(ops & {"MatMul", "Gemm", *QUANT_BLAS_OPS})
            and ((loaded.threads or config.get_num_threads()) > 1)
        )
        self._key = None
        self._limit: int | None = None  # the last resize's memory_limit (runs re-plan within it)
        # The plans of the last PLANS_KEPT input shapes on the arena in place (_keep): a run of
        # a shape seen before takes its plan back instead of planning again (0.3-0.4 ms of
        # Python each time, where inputs of varying length made every run a new shape).
        self._plans: OrderedDict[tuple, tuple] = OrderedDict()
        self._arena: Arena | None = None
        self._plan: Plan | None = None
        self.resize_constant_bytes = 0
        self.working_bytes = 0  # what ops allocate while they run (OpDef.transient)

    @property
    def plan(self) -> Plan | None:
        return self._plan

    @property
    def arena_bytes(self) -> int:
        """Bytes of the graph arena (intermediate tensors), without the RNN sessions' arenas."""
        return self._arena.nbytes if self._arena is not None else 0

    @property
    def rnn_arena_bytes(self) -> int:
        return self._pool.nbytes

    def _input_metas(self, shapes, dtypes) -> dict:
        g = self.loaded.graph
        names = self.loaded.input_names
        one_shape = (
            isinstance(shapes, list | tuple)
            and bool(shapes)
            and all(isinstance(d, int | np.integer) and not isinstance(d, bool) for d in shapes)
        )
        if one_shape and len(names) == 1:  # resize(x.shape) of a one-input graph, as run(x)
            shapes = [shapes]
        if isinstance(shapes, dict):
            _check_input_names("GraphSession.resize", shapes, names, self.loaded.graph)
            shapes = [shapes[n] for n in names]
        if len(shapes) != len(names):
            raise ShapeError(
                f"[GraphSession.resize] got {len(shapes)} input shapes; the model "
                f"has {len(names)} inputs {names}"
            )
        if dtypes is None:
            dtypes = [t.dtype for t in g.inputs]
        elif isinstance(dtypes, dict):
            dtypes = [dtypes.get(n, t.dtype) for n, t in zip(names, g.inputs, strict=True)]
        metas = {}
        for t, shape, dt in zip(g.inputs, shapes, dtypes, strict=True):
            if not dt:
                raise DTypeError(
                    f"[GraphSession.resize] input {t.name!r} has no declared dtype; pass dtypes="
                )
            dims = tuple(shape) if isinstance(shape, list | tuple | np.ndarray) else None
            if dims is None or not all(
                isinstance(d, int | np.integer) and not isinstance(d, bool | np.bool_) and d >= 0
                for d in dims
            ):
                raise ShapeError(  # (5.7 planned 5)
                    f"[GraphSession.resize] input {t.name!r}: shape {shape!r}; "
                    "expected a list or tuple of ints >= 0"
                )
            try:
                dtype = np.dtype(dt)
            except TypeError:
                raise DTypeError(f"[GraphSession.resize] input {t.name!r}: dtype {dt!r} is not "
                                 "a numpy dtype") from None  # fmt: skip
            metas[t.name] = Out(tuple(int(d) for d in dims), dtype)
        return metas

    def resize(self, shapes, dtypes=None, memory_limit: int | None = None) -> Plan:
        """Plan every intermediate tensor for inputs of ``shapes`` (and ``dtypes``, default the
        declared ones), in one arena; plans each RNN node's Session too. ``memory_limit``
        holds the two arenas together: the RNN nodes get what the graph's leaves, forward ones
        chunking to fit; PlanError (nothing allocated) if that cannot be met."""
        metas_in = self._input_metas(shapes, dtypes)
        with self._lock():
            return self._resize(metas_in, memory_limit)

    def estimate(self, shapes, dtypes=None) -> dict:
        """What ``resize(shapes, dtypes)`` would plan, without making it: the arena's plan and
        the bytes of the graph arena, the RNN nodes' arena and the shape-computed tensors. The
        large shape-computed tensors are not evaluated (a 170-byte file's ConstantOfShape of
        its input's shape times k filled 808 MiB to be described) and nothing is allocated;
        the session's own plan is left as it was."""
        metas_in = self._input_metas(shapes, dtypes)
        with self._lock():
            return self._resize_checked(metas_in, None, plan_only=True)

    def _resize(self, metas_in: dict, memory_limit: int | None) -> Plan:
        try:
            p = self._resize_checked(metas_in, memory_limit)
            self._limit = memory_limit  # kept for the runs of other shapes, as a Session's
            self._keep()
            return p
        except BaseException:
            # refused (or failed) part way: the next run plans again from scratch, so a
            # half-made plan (an RNN session resized, the other not) is never run
            self._key = None
            raise

    _KEPT = ("_steps", "_metas", "_values", "_views", "_fresh", "_root", "_inplace", "_plan",
             "resize_constant_bytes", "working_bytes")  # fmt: skip
    # 64 shapes (inputs of 5..60 steps kept 56), whose shape-computed tensors (each kept plan
    # holds its own) come to at most KEPT_CONSTANT_BYTES together: the least recently used go
    PLANS_KEPT, KEPT_CONSTANT_BYTES = 64, 1 << 20

    def _keep(self) -> None:
        """Keep the plan just made (its views are of the arena in place) for its shapes. Not
        under a memory_limit: there each shape's plan splits the limit between the graph's
        arena and the RNN nodes' in its own way, which a plan taken back would not redo."""
        if self._limit is not None:
            self._plans.clear()
            return
        plans = self._plans
        plans.pop(self._key, None)
        mine = self.resize_constant_bytes
        if mine > self.KEPT_CONSTANT_BYTES:
            return
        i = self._KEPT.index("resize_constant_bytes")
        held = sum(kept[i] for kept in plans.values())
        while plans and (len(plans) >= self.PLANS_KEPT
                         or held + mine > self.KEPT_CONSTANT_BYTES):  # fmt: skip
            held -= plans.popitem(last=False)[1][i]  # the least recently used
        plans[self._key] = tuple(getattr(self, a) for a in self._KEPT)

    def _take_back(self, key: tuple) -> bool:
        """The kept plan of input shapes ``key``, made the session's, if there is one. The RNN
        nodes' sessions are not resized for it: their runs plan again where their own plan in
        place does not serve the shape (Session._covers), within the same limit."""
        kept = self._plans.get(key)
        if kept is None:
            return False
        self._plans.move_to_end(key)  # now the most recently used
        # the key cleared first, set last: interrupted part way (Ctrl-C), the old key over
        # the new views skipped the next run's plan and ran on a mix of the two (Session's too)
        self._key = None
        for a, v in zip(self._KEPT, kept, strict=True):
            setattr(self, a, v)
        self._key = key
        return True

    def _resize_checked(self, metas_in: dict, memory_limit: int | None,
                        plan_only: bool = False) -> Plan | dict:  # fmt: skip
        """Shapes first, memory next, allocation last: a shape-computed tensor proportional
        to the input (ConstantOfShape's [1, N, H] initial state) is evaluated only once the
        whole run's bytes are known to fit, so an impossible size is a PlanError before
        anything grows (it was numpy's MemoryError, or 1 GB allocated, then refused).
        ``plan_only``: stop before that, with ``estimate``'s figures."""
        loaded, g, ctx = self.loaded, self.loaded.graph, self._ctx
        limit = memory_limit
        metas: dict[str, Out] = {k: Out(v.shape, v.dtype) for k, v in g.constants.items()}
        metas.update(metas_in)
        values: dict[str, np.ndarray] = dict(g.constants)
        steps = []  # (node, out metas, scratch {key: (shape, dtype)})
        extra = 0  # bytes of shape-computed values made so far
        # Shape-computed nodes whose outputs are large wait here (in graph order) until the
        # total is checked; their outputs' values are None meanwhile (as data would be).
        pending: list[tuple] = []
        pending_names: set[str] = set()
        pending_bytes = 0

        def flush() -> None:
            nonlocal extra, pending_bytes
            check_fits(extra + pending_bytes, "the graph's shape-computed tensors", _OP)
            for node, outs in pending:
                vals = [values.get(i) if i else None for i in node.inputs]
                res = guard(node, evaluate, ctx, node, vals, outs)
                for name, arr in zip(node.outputs, res, strict=False):
                    if name:
                        values[name] = np.asarray(arr, order="C")
                        extra += arr.nbytes
            pending.clear()
            pending_names.clear()
            pending_bytes = 0

        def known(name: str):
            # a condition's value, made now if it waits (a view of a large shape value)
            if name in pending_names:
                flush()
            return values.get(name)

        def planned_nodes():
            # the nodes this run holds: a branch's only when its conditions hold (read in
            # order, outermost first: an inner condition exists only inside its branch), an
            # If as views of its taken branch's outputs. A generator, so each condition is
            # read after the nodes before it have been evaluated.
            for node in g.nodes:
                if not all(truth(node, c, known(c)) == t for c, t in node.when):
                    continue
                if node.op == "If":
                    yield from taken_branch(node, known(node.inputs[0]))
                else:
                    yield node

        graph_outputs = {t.name for t in g.outputs}
        for node in planned_nodes():
            ins = [metas[i] if i else None for i in node.inputs]
            vals = [values.get(i) if i else None for i in node.inputs]
            outs = infer(ctx, node, ins, vals)
            for name, m in zip(node.outputs, outs, strict=False):
                # an output the node does not make (an RNN's unnamed Y), or an RNN output no
                # one reads (never computed: a final-state classifier's Y was held to the
                # limit, so no limit below T*N*H floats was accepted)
                if not name or (node.op in RNN_OPS and name not in loaded.needed):
                    continue
                # (a graph output is the caller's, handed out fresh per run: outside the limit,
                # as a Session's outputs are; it was refused here with a ShapeError)
                if limit is not None and m.nbytes > limit and name not in graph_outputs:
                    raise PlanError(
                        f"[GraphSession.resize] node {node.name!r} ({node.op}) "
                        f"output {list(m.shape)} needs {m.nbytes} bytes; the memory"
                        f" limit is {limit}"
                    )
                check_fits(m.nbytes, f"node {node.name!r} ({node.op}) output {list(m.shape)}", _OP)
            for name, m in zip(node.outputs, outs, strict=False):
                if name:
                    metas[name] = m
            if node.name in loaded.shape_nodes:
                nbytes = sum(m.nbytes for m in outs if m.value is None and not m.view)
                waits = not pending_names.isdisjoint(node.inputs)
                # Large, or a view of a large one: waits. Small from a large one (a value
                # later shape math may read): the waiting ones are made first.
                if nbytes > _EVALUATE_NOW or (waits and any(m.view for m in outs)):
                    pending.append((node, outs))
                    pending_names.update(o for o in node.outputs if o)
                    pending_bytes += nbytes
                    continue
                if waits:
                    flush()
                    vals = [values.get(i) if i else None for i in node.inputs]
                check_fits(extra + pending_bytes + nbytes, "the graph's shape-computed tensors",
                           _OP)  # fmt: skip
                res = guard(node, evaluate, ctx, node, vals, outs)
                for name, arr in zip(node.outputs, res, strict=False):
                    if name:
                        values[name] = np.asarray(arr, order="C")
                        extra += arr.nbytes
                continue
            tmp = {}
            if OPS[node.op].scratch is not None:
                tmp = guard(node, OPS[node.op].scratch, ctx, node, ins, outs, loaded.needed)
            steps.append((node, outs, tmp))
        for t in g.outputs:
            # onnxruntime refuses such a file at load ("Type Error"); handing out the computed
            # dtype under the declared name would be a silent change of type
            if t.dtype and metas[t.name].dtype != np.dtype(t.dtype):
                raise ModelFormatError(
                    f"[GraphSession.resize] graph output {t.name!r} is declared {t.dtype}, "
                    f"but the graph computes it as {metas[t.name].dtype} for inputs "
                    f"{ {k: m.dtype.name for k, m in metas_in.items()} } (onnxruntime "
                    "refuses such a file at load; if it runs this one, leanrnn computes an "
                    "op's type wrongly: please report it)"
                )
        p, layout = self._plan_layout(steps, metas, limit)
        # What ops allocate themselves while they run (Conv's and MaxPool's window blocks),
        # the most any one does: the nodes run one after another, each freeing its own
        transient, by = 0, None
        for node, outs, _ in steps:
            fn = OPS[node.op].transient
            if fn is not None:
                ins = [metas[i] if i else None for i in node.inputs]
                n = guard(node, fn, ctx, node, ins, outs)
                if n > transient:
                    transient, by = n, node
        if limit is not None and p.total + transient > limit:
            raise PlanError(
                f"[GraphSession.resize] node {by.name!r} ({by.op}) works in {transient:,} "
                f"bytes of its own beside the graph arena's {p.total:,}; memory_limit={limit}"
            )
        # Everything a run holds at once: the arena, the outputs handed out fresh per run, the
        # shape-computed values, the ops' own working memory and the RNN nodes' shared arena
        # (the largest of their plans). A memory limit holds all of them: the RNN nodes plan
        # within what the rest leaves (forward ones chunk to fit, as Session.resize does).
        rnn_limit = None if limit is None else limit - p.total - transient
        if limit is not None:
            loose = [
                n.name for n, _, _ in steps if n.op in RNN_OPS and n.name not in self._sessions
            ]
            if loose:
                raise PlanError(
                    f"[GraphSession.resize] RNN nodes {loose[:4]} have weights computed per run "
                    "(graph inputs or computed tensors, packed per run with sessions of their "
                    "own): their memory is outside any plan, so a memory_limit cannot hold it; "
                    "make their weights initializers, or plan without a limit"
                )
        fresh_bytes = sum(metas[r].nbytes for r in layout[0])
        rnn = []
        rnn_bytes = 0
        for node, _, _ in steps:
            sess = self._sessions.get(node.name)
            if sess is not None:
                x = metas[node.inputs[0]].shape
                T, N = (x[0], x[1]) if node.attrs["layout"] == 0 else (x[1], x[0])
                seq = rnn_computes_y(ctx, node)
                rnn.append((sess, N, T, seq))
                if N >= 1 and T >= 1:  # else sess.resize refuses it, below
                    if rnn_limit is not None and rnn_limit < 1:
                        raise PlanError(
                            f"[GraphSession.resize] the graph's arena takes {p.total} bytes of "
                            f"memory_limit={limit}: none is left for RNN node {node.name!r}"
                        )
                    try:
                        rnn_bytes = max(rnn_bytes, sess.planned(N, T, seq, rnn_limit).total)
                    except PlanError as e:  # (it named the node's share as the limit)
                        raise PlanError(
                            f"[GraphSession.resize] memory_limit={limit} leaves RNN node "
                            f"{node.name!r} {rnn_limit} bytes beside the graph's arena of "
                            f"{p.total}, and it needs more ({e}); raise the limit"
                        ) from None
        total = p.total + fresh_bytes + extra + pending_bytes + rnn_bytes + transient
        check_fits(
            total,
            f"a run of graph {g.name!r} for inputs "
            f"{ {k: list(m.shape) for k, m in metas_in.items()} } ({p.total:,} bytes of arena, "
            f"{fresh_bytes:,} of outputs, {extra + pending_bytes:,} of shape-computed tensors, "
            f"{rnn_bytes:,} of RNN arena, {transient:,} of ops' own working memory)",
            _OP,
        )
        if plan_only:
            return {"plan": p, "arena_bytes": p.total, "rnn_arena_bytes": rnn_bytes,
                    "shape_constant_bytes": extra + pending_bytes,
                    "working_bytes": transient}  # fmt: skip
        flush()
        # a held arena over what the limit leaves beside the RNN nodes' is let go
        views = self._allocate_arena(p, layout, None if limit is None else limit - rnn_bytes)
        for sess, N, T, seq in rnn:
            sess.resize(N, T, memory_limit=rnn_limit, return_sequences=seq)
        self._steps, self._metas, self._values, self._views = steps, metas, values, views
        self._key = tuple((k, m.shape, m.dtype) for k, m in metas_in.items())
        self.resize_constant_bytes = extra
        self.working_bytes = transient
        self._plan = p
        return p

    def _scratch_name(self, step: int, node, key: str) -> str:
        """The arena name of scratch ``key`` of ``node``, the ``step``-th to run: past every
        tensor's name (_scratch_prefix) and every other node's, duplicate node names too."""
        return f"{self._scratch}{step}:{node.name}#{key}"

    def _plan_layout(self, steps, metas, limit):
        """Lifetimes -> one arena's plan, by arithmetic (``_allocate_arena`` then takes it). A
        tensor's memory is shared by its *family*: the views of it and the elementwise ops that
        overwrite it in place (allowed when nothing reads the old value later and no graph
        output is in the family). A family holding a graph output lives in a fresh array per
        run, which the caller then owns; all others in the arena."""
        g = self.loaded.graph
        outputs = {t.name for t in g.outputs}
        last_read: dict[str, int] = {}
        for k, (node, _, _) in enumerate(steps):
            for i in node.inputs:
                if i:
                    last_read[i] = k
        root: dict[str, str] = {}
        family: dict[str, list[str]] = {}
        first: dict[str, int] = {}
        inplace: dict[str, str] = {}
        # Per family, kept as members join: the last step reading any member, and whether a
        # member is a graph output. The in-place test then costs O(1), not O(family): a chain
        # of n elementwise ops is one family, and rescanning it made planning O(n^2).
        fam_last: dict[str, int] = {}
        fam_output: dict[str, bool] = {}
        for k, (node, outs, _) in enumerate(steps):
            for name, m in zip(node.outputs, outs, strict=False):
                if not name or (node.op in RNN_OPS and name not in self.loaded.needed):
                    continue
                src = (
                    node.inputs[0]
                    if m.view
                    else self._inplace_source(node, m, k, root, first, fam_last, fam_output, metas)
                )
                if src is not None and (m.view or src in root):
                    r = root.get(src, src)
                    if not m.view:
                        inplace[name] = src
                else:
                    r = name
                    first[name] = k
                root[name] = r
                family.setdefault(r, []).append(name)
                fam_last[r] = max(fam_last.get(r, -1), last_read.get(name, -1))
                fam_output[r] = fam_output.get(r, False) or name in outputs
        buffers = []
        fresh: set[str] = set()  # roots allocated per run
        for r in family:
            if r not in first:
                continue  # a view of a graph input, constant or shape value
            if fam_output[r]:
                fresh.add(r)
                continue
            buffers.append(Buffer(r, metas[r].nbytes, first[r], max(first[r], fam_last[r])))
        for k, (node, _, tmp) in enumerate(steps):
            for key, (shape, dt) in tmp.items():
                nbytes = math.prod(shape) * np.dtype(dt).itemsize
                buffers.append(Buffer(self._scratch_name(k, node, key), nbytes, k, k))
        p = plan(buffers, limit=limit)
        shapes = {r: (metas[r].shape, metas[r].dtype) for r in family}
        for k, (node, _, tmp) in enumerate(steps):
            for key, (shape, dt) in tmp.items():
                shapes[self._scratch_name(k, node, key)] = (shape, np.dtype(dt))
        return p, (fresh, root, inplace, shapes)

    def _allocate_arena(self, p: Plan, layout, cap: int | None = None) -> dict[str, np.ndarray]:
        """Take the arena ``p`` needs (reusing the current one when it is large enough, and
        not over ``cap`` bytes) and make every planned view; the layout becomes the session's."""
        fresh, root, inplace, shapes = layout
        if not reusable(self._arena, p.total, cap):
            self._plans.clear()  # their views are of the arena going
            self._arena = None  # drop the old arena before taking the new one
            self._arena = Arena(p.total, name=f"graph arena[{self.loaded.graph.name}]")
        views = {}
        for pl in p.placements:
            shape, dt = shapes[pl.buffer.name]
            views[pl.buffer.name] = self._arena.view(pl.offset, shape, dt)
        self._fresh, self._root, self._inplace = fresh, root, inplace
        return views

    @staticmethod
    def _inplace_source(node, m, k, root, first, fam_last, fam_output, metas) -> str | None:
        """The input an elementwise op may overwrite with its output, if any: one produced here
        with the output's layout whose family nobody reads after step ``k`` and that holds no
        graph output."""
        if node.op not in INPLACE_OPS:
            return None
        for i in node.inputs:
            r = root.get(i)
            if r not in first or metas[i].shape != m.shape or metas[i].dtype != m.dtype:
                continue  # not produced here (input, constant), or not the output's layout
            if fam_last[r] <= k and not fam_output[r]:
                return i
        return None

    def _feeds(self, feeds) -> dict[str, np.ndarray]:
        g = self.loaded.graph
        names = self.loaded.input_names
        if isinstance(feeds, np.ndarray):  # run(x) of a one-input graph: x alone, not its rows
            if len(names) != 1:
                raise ShapeError(f"[GraphModel.run] got one array; the model takes "
                                 f"{len(names)} inputs: {names} (a dict or a list, in order)")  # fmt: skip
            feeds = [feeds]
        if not isinstance(feeds, dict):
            feeds = list(feeds)
            if len(feeds) != len(names):
                raise ShapeError(
                    f"[GraphModel.run] got {len(feeds)} inputs; the model takes "
                    f"{len(names)}: {names}"
                )
            feeds = dict(zip(names, feeds, strict=True))
        _check_input_names("GraphModel.run", feeds, names, self.loaded.graph)
        out = {}
        for t in g.inputs:
            a = feeds[t.name]
            _check.unmasked("GraphModel.run", f"input {t.name!r}", a)
            if not isinstance(a, np.ndarray):
                a = np.asarray(a)
            if t.dtype and a.dtype != np.dtype(t.dtype):
                hint = f"; convert with .astype(np.{t.dtype})" if a.dtype.kind in "fiub" else ""
                raise DTypeError(
                    f"[GraphModel.run] input {t.name!r} has dtype {a.dtype}; the "
                    f"model declares {t.dtype}{hint}"
                )
            if t.shape is not None:
                bad = len(t.shape) != a.ndim or any(
                    isinstance(d, int) and d != s for d, s in zip(t.shape, a.shape, strict=False)
                )
                if bad:
                    want = ", ".join("?" if d is None else str(d) for d in t.shape)
                    raise ShapeError(
                        f"[GraphModel.run] input {t.name!r} has shape "
                        f"{tuple(a.shape)}; the model declares [{want}]"
                    )
            out[t.name] = np.asarray(a, order="C")
        return out

    def run(self, feeds, times: dict[str, float] | None = None) -> list[np.ndarray]:
        """The graph's outputs for ``feeds``. ``times``: a dict that gets each node's wall
        seconds in this run added under "op name" (the nodes run one after another; the
        constants folded at load are not nodes any more; a run that fails keeps the times of
        the nodes before) — where a model's time goes, node by node, beside onnxruntime's own
        profile (benchmarks/bench_load.py --breakdown). Runs of one session may share a dict
        (they take turns); runs of different sessions on different threads may not."""
        if times is not None and not isinstance(times, dict):
            raise DTypeError(
                f"[GraphModel.run] times={type(times).__name__}; expected a dict (or None)"
            )
        feeds = self._feeds(feeds)
        metas_in = {k: Out(v.shape, v.dtype) for k, v in feeds.items()}
        with self._lock():
            key = tuple((k, m.shape, m.dtype) for k, m in metas_in.items())
            if key != self._key and not self._take_back(key):
                self._resize(metas_in, self._limit)  # planned within the last resize's limit
            if not self._blas_alone:
                return self._execute(feeds, times)
            with blas_alone():
                return self._execute(feeds, times)

    def _execute(self, feeds: dict, times: dict[str, float] | None = None) -> list[np.ndarray]:
        env = dict(self._values)
        env.update(feeds)
        fresh: dict[str, np.ndarray] = {}
        views, ctx, root, inplace = self._views, self._ctx, self._root, self._inplace
        for step, (node, metas, tmp_spec) in enumerate(self._steps):
            outs = []
            for name, m in zip(node.outputs, metas, strict=False):
                if not name or m.view or name not in root:
                    outs.append(None)
                elif name in inplace:
                    outs.append(env[inplace[name]])
                elif name in self._fresh:
                    fresh[name] = np.empty(m.shape, m.dtype)
                    outs.append(fresh[name])
                else:
                    outs.append(views[name])
            tmp = {k: views[self._scratch_name(step, node, k)] for k in tmp_spec}
            ins = [env[i] if i else None for i in node.inputs]
            if times is None:
                res = guard(node, OPS[node.op].run, ctx, node, ins, outs, metas, tmp)
            else:
                t0 = time.perf_counter()
                res = guard(node, OPS[node.op].run, ctx, node, ins, outs, metas, tmp)
                key = f"{node.op} {node.name}"
                times[key] = times.get(key, 0.0) + (time.perf_counter() - t0)
            for name, arr in zip(node.outputs, res, strict=False):
                if name:
                    env[name] = arr
        results = []
        handed = set()
        for t in self.loaded.graph.outputs:
            arr = env[t.name]
            r = root.get(t.name)
            if r in fresh and r not in handed:
                handed.add(r)
                results.append(arr)
            else:  # a constant, an input, or a second output of one family: the caller's copy
                results.append(np.array(arr, copy=True))
        return results


def _check_input_names(op: str, given, names: list[str], graph) -> None:
    """ShapeError naming every missing and unexpected input (sorted), and the model's inputs;
    an unexpected one that is an ONNX initializer listed among the graph's inputs is said to
    be one (a constant here, or an RNN node's weight packed at load)."""
    unknown = sorted(set(given) - set(names))
    missing = sorted(set(names) - set(given))
    if unknown or missing:
        fixed = [k for k in unknown if k in graph.constants or k in graph.fixed]
        raise ShapeError(
            f"[{op}] missing inputs {missing}; unexpected inputs {unknown}; "
            f"the model's inputs are {names}"
            + (f" ({fixed} are initializers of the ONNX file, listed among its inputs: "
               "constants here, folded at load, so they cannot be fed)" if fixed else "")
        )  # fmt: skip


def _scratch_prefix(g) -> str:
    """One '#' more than any of ``g``'s tensor names starts with: the nodes' scratch buffers,
    named after it, share the arena's namespace with the tensors (a tensor named "lstm#c"
    collided with LSTM node "lstm"'s scratch "c": "duplicate buffer names" on a valid file)."""
    names = {t.name for t in g.inputs} | set(g.constants)
    names.update(o for n in g.nodes for o in n.outputs)
    return "#" * (1 + max((len(n) - len(n.lstrip("#")) for n in names), default=0))
