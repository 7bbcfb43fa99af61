"""Session: spec + packed weights + one planned arena. ``resize`` plans, ``run`` executes.

Design (MNN's onResize/onExecute split): ``resize(batch, steps)`` lists every scratch buffer with
its lifetime in op order — one op per (layer, direction) — and the planner packs them into a single
aligned arena, so directions and layers reuse the same bytes. ``run`` then only validates inputs,
copies initial states in, and calls kernels on arena views made at resize time: no heap allocation
but the returned arrays, and none at all when the caller passes ``out=``.

Buffers (per op k = layer*D + direction unless noted):
  xw.{k}   [T*N, Gp]  input projection (rows in x's order)    live k..k
  h.{k}.a/b [N, Kp]   state double buffer                       live k..k
  c.{k}    [N, Hp]    LSTM cell state                           live k..k
  gates.{k} [N, Gp]   gate pre-activations                      live k..k
  aux.{k}  [N, Hp]    LSTM unprojected h / GRU r*h               live k..k
  y.{l}    [T*N, D*K] output of layer l < L-1 (time-major)      live first op of l .. last op of l+1
  lengths  [N] int64                                            live 0..end
  stage.x/stage.y  batch-first chunk staging (chunked runs only)   live 0..end

Chunked runs (``chunk=K``, unidirectional stacks): the plan is made for K steps and the whole
stack advances K steps at a time, layer after layer, carrying every layer's state — so xw and
the buffers between layers are O(K), not O(T). ``chunk=None`` (the default) picks K so that xw
fits XW_BUDGET for time-major input: chunking is also faster, because the recurrence then reads
the projection it needs while it is still in cache (batch-first input runs whole by default). With ``return_sequences=False`` the outputs of a
chunk are dropped once the next layer has consumed them, and peak memory does not depend on T.
Reverse and bidirectional stacks cannot be chunked: a reverse direction starts at each sample's
last step, so it needs xw [T, N, G] per direction and the layer output [T, N, D*K] for the whole
sequence; ``chunk`` (and memory_limit's choice of one) is ignored for them.

Threads: each op (the input projection, then the recurrence) is one launch of a thread team
(kernels.runner: the native module's thread team, or the JIT's Python threads): its threads
hand out projection tasks by ticket, then split every step's unit blocks, meeting through
atomics rather than a fork/join per step (kernels._sync).

Shared pools: sessions made with the same ``Pool`` share one arena, sized to the largest plan;
the pool's lock serializes their runs (two threads running two sessions of one pool take turns;
give each thread its own pool — or none — to run truly in parallel).
"""

from __future__ import annotations

import logging
import weakref
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, NoReturn, overload

import numpy as np
from numpy.typing import ArrayLike, NDArray

from .. import config
from ..errors import DTypeError, PlanError, ShapeError, SpecError
from ..formats.packing import PackedWeights
from ..kernels import _cpu, abi, runner
from ..memory.arena import ALIGN, Arena, check_fits, reusable, round_up
from ..memory.planner import Buffer, Plan, plan
from ..spec import RNNSpec
from ..threads import PARALLEL_MIN_MACS
from . import _check, _fork
from ._turn import Turn, unpicklable
from .stream import Stream

if TYPE_CHECKING:  # (tuning sits above the engine: imported at run time where it is used)
    from ..tuning import Measured

_log = logging.getLogger("leanrnn")
_Array = NDArray[Any]
# c_n: an LSTM's array, None for GRU/RNN. That is the model's cell, not the call's types, so
# Any stands beside the array (typeshed's way): "| None" made an LSTM's c_n.shape an error
_CellState = _Array | Any

# Steps per chunk when a run keeps only final states and no chunk was set: small enough that
# scratch stays a few hundred KiB at H=512, long enough that per-chunk overhead is noise.
DEFAULT_CHUNK = 32
# chunk=None picks chunks whose input projection (xw) fits this many bytes: the recurrence then
# reads xw while it is still in cache (H=128, N=64, T=100: 9.1 -> 7.7 ms on one thread), and
# at least MIN_AUTO_CHUNK steps, so per-chunk overhead stays small.
XW_BUDGET = 2 << 20
MIN_AUTO_CHUNK = 4
# Threads on batch slices take longer chunks (auto_chunk): a quarter of the last-level cache,
# but at most this much xw per thread — a VM reports its whole socket's L3 (300 MiB on a 2-vCPU
# Xeon), of which its own cores get a share, and a quarter of that made an N=64 T=1000 2-layer
# LSTM hold 148 MiB of scratch instead of ~16.
SLICED_XW_PER_THREAD = 4 << 20
# The job arguments (abi.JOBS) an op's launch sets; Session._call fixes all others per plan.
PER_CALL = ("x", "xw", "xw_bf_T", "T", "y", "y_bf_T", "parts")
# Outputs that may be the very same arrays as inputs: op k reads its state slot, then writes it.
IN_PLACE = (("h_n", "h0"), ("c_n", "c0"))


def _positive_or_none(op: str, name: str, v) -> int | None:
    if v is None:
        return None
    if not isinstance(v, int | np.integer) or isinstance(v, bool) or v < 1:
        raise ShapeError(f"[{op}] {name}={v!r}; expected a positive int or None")
    return int(v)


def kernel_constants(spec: RNNSpec, dtype) -> tuple:
    """(consts, acts, alphas, betas) the recurrence jobs take: consts [zero, one, tiny, clip]
    in ``dtype``, and per direction the activation codes and their parameters."""
    dt = np.dtype(dtype)
    clip = spec.clip if spec.clip is not None else 0.0
    consts = np.array([0.0, 1.0, np.finfo(dt).tiny, clip], dtype=dt)
    acts = [np.array([a.code for a in d], np.int64) for d in spec.activations]
    alphas = [np.array([a.alpha for a in d], dt) for d in spec.activations]
    betas = [np.array([a.beta for a in d], dt) for d in spec.activations]
    return consts, acts, alphas, betas


NO_SCRATCH = np.zeros((1, 0), np.uint8)  # the q of jobs whose weights need none (abi._SCRATCH)
NO_SLOTS = np.zeros(0, np.int64)  # the slot table of runs without one (abi._SLOTS)


def splits_operand(precision: str) -> bool:
    """Whether panel GEMMs of abi.split_min_rows rows or more on ``precision``'s weights
    ("bf16" or "int8") multiply a split operand here (which then needs a planned q):
    abi.SPLIT_PRECISIONS, as kernels.gemm reads it; pure Python, without importing the
    kernels."""
    from ..kernels import _cpu  # pure Python: the choice the kernels are compiled with

    return precision in abi.SPLIT_PRECISIONS.get(_cpu.bf16_dot(_cpu.isa()), ())


def _operand_scratch(spec: RNNSpec, layer: int, rows: int, batch: int, nbytes) -> int:
    """Bytes per thread of an op's q (kernels.gemm.operand): the larger of ``nbytes(n, K)``
    for a projection task's rows of layer input (a chunk of at most ROWS + ALIGN of the op's
    ``rows`` input rows, K its input size) and for the ``batch`` rows of recurrent input each
    step multiplies."""
    from ..kernels import _cpu  # pure Python: the same blocking the kernels are compiled with

    align, _, chunk = _cpu.blocking(_cpu.isa())
    C = spec.input_size if layer == 0 else spec.num_directions * spec.output_size
    return max(nbytes(min(rows, chunk + align), C), nbytes(batch, spec.output_size))


def split_scratch_bytes(spec: RNNSpec, layer: int, rows: int, batch: int,
                        one_term: bool = False) -> int:  # fmt: skip
    """Bytes per thread of a bf16 or int8 op's q where its GEMMs take a split operand
    (splits_operand): split rows (abi.split_row_floats), each count rounded up to 32 (an AMX
    block of the last rows reads whole tiles of 16 past them); none below abi.split_min_rows
    rows (those are not split). ``one_term`` (bf16-act, any CPU): rows rounded to one term,
    and room for every count of rows, since the float32 tile's rows are rounded too
    (kernels.gemm.round_rows: K floats per row, fewer than the split's)."""
    from ..kernels import _cpu  # pure Python: the choice the kernels are compiled with

    least = abi.split_min_rows(_cpu.bf16_dot(_cpu.isa()))

    def nbytes(n: int, K: int) -> int:
        if n < least and not one_term:
            return 0
        return (n + 31) // 32 * 32 * 4 * abi.split_row_floats(K, one_term)

    return _operand_scratch(spec, layer, rows, batch, nbytes)


def quantized_scratch_bytes(spec: RNNSpec, layer: int, rows: int, batch: int) -> int:
    """Bytes per thread of an int8-dynamic op's q: its quantized rows."""
    return _operand_scratch(spec, layer, rows, batch, lambda n, K: n * abi.quantized_row_bytes(K))


def operand_scratch_bytes(spec: RNNSpec, precision: str, layer: int, rows: int,
                          batch: int) -> int:  # fmt: skip
    """Bytes per thread of the q of an op on ``precision``'s weights (0: it takes none):
    int8-dynamic's quantized rows, bf16-act's rounded ones on every CPU, bf16's and int8's
    split ones where the CPU multiplies them (splits_operand). The inference plan and the
    trainer's (train.session, under autocast) size theirs here."""
    if precision == "int8-dynamic":
        return quantized_scratch_bytes(spec, layer, rows, batch)
    if precision == "bf16-act":
        return split_scratch_bytes(spec, layer, rows, batch, one_term=True)
    if precision in ("bf16", "int8") and splits_operand(precision):
        return split_scratch_bytes(spec, layer, rows, batch)
    return 0


def recurrence_arguments(spec: RNNSpec, pl, d: int, constants: tuple, sync, *, h_a, h_b, gates,
                         aux, c, lengths, keep: bool, ghn, q=NO_SCRATCH,
                         bf16_act: bool = False) -> dict:  # fmt: skip
    """The arguments of direction ``d``'s recurrence job (abi.JOBS[spec.cell]) that stay the
    same from run to run of one plan: ``pl``'s weights, the state and scratch views, the
    activations and ``constants`` (kernel_constants). ``aux`` [N, Hp] is the LSTM's unprojected
    h or the GRU's r*h (an [N, 0] stand-in when the cell needs none); ``c`` the LSTM cell
    state; ``keep``, ``ghn``, ``q`` and ``bf16_act``: see kernels.recurrent. No slot table
    (run_slots sets slot, h_store and c per run). Not included: C and the per-run x, xw,
    xw_bf_T, T, y, y_bf_T, parts (engine.session PER_CALL)."""
    consts, acts, alphas, betas = constants
    K = spec.output_size
    named = dict(
        W=pl.Wt, b=pl.b, Rt=pl.Rt, K=K, h_a=h_a, h_b=h_b, gates=gates, lengths=lengths,
        reverse=spec.reversed_direction(d), y_off=d * K, acts=acts[d], alphas=alphas[d],
        betas=betas[d], consts=consts, sync=sync, keep=keep, q=q, bf16_act=bf16_act, slot=NO_SLOTS,
        h_store=h_a[:0, :0],
    )  # fmt: skip
    if spec.cell == "lstm":
        named.update(peep=pl.peep, use_peep=spec.peepholes, proj=pl.proj, P=spec.proj_size,
                     H=spec.hidden_size, c=c, hfull=aux, input_forget=spec.input_forget)  # fmt: skip
    elif spec.cell == "gru":
        named.update(rb=pl.rb, linear_before_reset=spec.linear_before_reset, rh=aux, ghn=ghn)
    return named


def _slot_table(op: str, slot, N: int, S: int, lengths) -> np.ndarray:
    """``slot`` as an int64 [N] array the kernels can index the states with: each in 0..S-1
    and distinct (two samples would update one state at once), or -1 on rows of length 0.
    Always a copy: the kernels index the states with it, the GIL released, and a caller's
    array changed by another thread after the check wrote outside the states (a segfault)."""
    arr = np.array(slot)
    if arr.dtype.kind not in "iu":
        raise DTypeError(
            f"[{op}] slot has dtype {arr.dtype}; expected integers (int64), one slot per sample"
        )
    if arr.shape != (N,):
        raise ShapeError(f"[{op}] slot has shape {tuple(arr.shape)}; expected [N={N}]")
    if arr.dtype.kind == "u" and int(arr.max()) >= S:  # before the cast: 2**64-1 would be -1
        _slot_range(op, [int(v) for v in arr if v >= S][:5], S)
    if arr.dtype != np.int64 or not arr.flags.c_contiguous or not arr.flags.aligned:
        arr = np.ascontiguousarray(arr, np.int64)
    lo, hi = int(arr.min()), int(arr.max())
    if lo < -1 or hi >= S:
        _slot_range(op, [int(v) for v in arr if v < -1 or v >= S][:5], S)
    if lo == -1:
        pad = arr == -1
        if lengths is None or lengths[pad].any():
            rows = np.flatnonzero(pad if lengths is None else pad & (lengths != 0))[:5].tolist()
            raise ShapeError(
                f"[{op}] rows {rows} have slot -1 (padding) but steps to run; expected length 0 "
                "there: pass lengths with 0 for padding rows, or give them a slot"
            )
    ordered = np.sort(arr)
    twice = ordered[1:][(ordered[1:] == ordered[:-1]) & (ordered[1:] >= 0)]
    if twice.size:
        raise ShapeError(
            f"[{op}] slot {sorted(set(twice.tolist()))[:5]} appears more than once; expected "
            "distinct slots (one sample per stream state in a call): run the same stream's "
            "steps in one row, or in successive calls"
        )
    return arr


def _slot_range(op: str, bad: list, S: int) -> NoReturn:
    raise ShapeError(
        f"[{op}] slot {bad} out of range; expected 0 <= slot < S={S} (the states' streams), "
        "or -1 for a padding row"
    )


class SlotStates:
    """The states of S streams in fixed slots, for ``Session.run_slots``: h [L*D, S, K] and
    (LSTM) c [L*D, S, Hp] of one model, in one aligned, zeroed buffer (numpy's zeroed pages:
    slots never used cost no memory). The kernels read and write a call's rows there by its
    slot table, so a call copies no state in or out.

    ``h`` [L*D, S, K] and ``c`` [L*D, S, H] (None for GRU/RNN) are views to read a slot's
    state; ``put`` sets one. c is stored with the kernels' padded width Hp (their cell update
    runs on whole blocks of 16 units; the padding units stay zero).

    >>> st = session.slot_states(1024); st.put(5, h0, c0)
    >>> y = session.run_slots(x, st, np.array([5, 9]))   # rows 0, 1 of x: streams 5 and 9
    """

    def __init__(self, weights: PackedWeights, S: int) -> None:
        spec, dt = weights.spec, weights.dtype
        LD, K, H = spec.num_layers * spec.num_directions, spec.output_size, spec.hidden_size
        Hp = weights.Hp if spec.cell == "lstm" else 0
        self.S, self.dtype, self.shape, self.cell = S, dt, (LD, K, H, Hp), spec.cell
        hb = round_up(LD * S * K * dt.itemsize, ALIGN)
        self.nbytes = hb + LD * S * Hp * dt.itemsize
        check_fits(self.nbytes, f"state slots for {S:,} streams", "Session.slot_states")
        raw = np.zeros(self.nbytes + ALIGN, np.uint8)  # calloc: untouched pages stay unbacked
        buf = raw[(-raw.ctypes.data) % ALIGN :][: self.nbytes]
        self._owner = raw  # of h and c (run_slots: _check.apart)
        self.h = buf[: LD * S * K * dt.itemsize].view(dt).reshape(LD, S, K)
        self._c = buf[hb:].view(dt).reshape(LD, S, Hp) if Hp else None
        self.c = self._c[:, :, :H] if Hp else None

    def put(self, slot: int, h=None, c=None) -> None:
        """Slot ``slot`` (0..S-1)'s state: h [L*D, K] and c [L*D, H] (LSTM), numpy arrays of
        the states' dtype, or zeros where None. Nothing converted or broadcast: a wrong slot,
        shape or dtype raises before anything is written."""
        op, S = "SlotStates.put", self.S
        if not isinstance(slot, int | np.integer) or isinstance(slot, bool) or not 0 <= slot < S:
            raise ShapeError(
                f"[{op}] slot {slot!r}; expected an int in 0..{S - 1} (a slot of these S={S} "
                "states; -1 marks padding rows in run_slots, it is no slot)"
            )
        self.check(h, c, op)
        self.h[:, slot] = 0 if h is None else h
        if self._c is not None:
            self._c[:, slot] = 0  # the padding units too
            if c is not None:
                self.c[:, slot] = c

    def check(self, h=None, c=None, op: str = "SlotStates.check") -> None:
        """Raise unless ``put(slot, h, c)`` would take ``h`` and ``c`` (for a put made later)."""
        LD, K, H, _ = self.shape
        if h is not None:
            _check.array(op, "h", h, self.dtype, (LD, K), ("L*D", "K"))
        if c is not None:
            if self._c is None:
                raise ShapeError(
                    f"[{op}] c was given but a {self.cell.upper()} has no cell state; pass h only"
                )
            _check.array(op, "c", c, self.dtype, (LD, H), ("L*D", "H"))


class _Step:
    """A streaming step bound once (Session._step_program), with what it was bound for."""

    __slots__ = ("calls", "key", "program", "threads")

    def __init__(self, program: runner.Program, calls: list, key: tuple, threads: int) -> None:
        self.program, self.calls, self.key, self.threads = program, calls, key, threads


def _batch_steps(batch, steps) -> tuple[int, int]:
    for name, v in (("batch", batch), ("steps", steps)):
        if not isinstance(v, int | np.integer) or isinstance(v, bool) or v < 1:
            raise ShapeError(f"[Session.resize] {name}={v!r}; expected a positive int")
    return int(batch), int(steps)


@dataclass(frozen=True)
class _Limit:
    """A session's memory limit: ``nbytes`` of arena, chunks of at most ``cap`` steps (None: no
    cap; resize("auto")'s tuned chunk, or one set after the limit), searched up to ``steps``
    (the limited resize's)."""

    nbytes: int
    cap: int | None
    steps: int | np.integer  # (resize's, as given)


class Pool:
    """One arena shared by several sessions that run one at a time (MNN's multi-model sharing).

    >>> pool = Pool(); a = Session(w1, pool=pool); b = Session(w2, pool=pool)

    The arena holds the largest plan any live member has made since its last ``memory_limit``
    (as a session's own arena does, it does not shrink when a member plans smaller: it would be
    made again at each change of shape); a member resized with a ``memory_limit`` the arena
    exceeds shrinks it to the largest of the members' latest plans, and once the members whose
    plans made it that large are gone (garbage-collected), the next run shrinks it to what the
    others need. When the arena is replaced, every member drops its views of the old one
    (re-made at its next run), so the pool holds one arena, not one per member. ``lock``
    serializes runs of all members, so sharing is safe across threads.
    """

    def __init__(self) -> None:
        self.arena: Arena | None = None
        self.generation = 0
        self.lock = Turn("Pool member's run")
        self._needs: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # member -> bytes
        self._peaks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # since its limit
        _fork.in_child(self, Pool._after_fork)

    def _after_fork(self) -> None:
        # A thread of the parent may have held the lock (it does not exist here) or been
        # swapping the arena: a fresh lock, and members re-plan (Session._after_fork).
        self.lock = Turn("Pool member's run")
        self.generation += 1

    __reduce__ = unpicklable("Pool", "make a new Pool for the copies of its models")

    def acquire(self, nbytes: int, name: str, member=None, limit: int | None = None) -> Arena:
        """The arena, holding at least ``nbytes`` for ``member`` (the pool's lock held: no
        member is running). A new arena when there is none (or making it failed), when it is
        too small, when ``limit`` (the member's memory_limit) is below it and no member's
        latest plan needs all of it, or when no live member's plan ever needed all of it (the
        one that did was dropped: a pool kept a dropped 9.9 MB member's arena for a 3.5 KB one
        for good). A need is recorded once it is met: one refused (too large for the machine)
        must not become every member's."""
        others = [v for m, v in self._needs.items() if m is not member]
        size = max([nbytes, *others])
        mine = nbytes
        if limit is None and member is not None:
            mine = max(nbytes, self._peaks.get(member, 0))
        peak = max([mine, *(v for m, v in self._peaks.items() if m is not member)])
        a = self.arena
        if a is None or a.nbytes < nbytes:
            want = peak
        elif limit is not None and a.nbytes > max(limit, size):
            want = size  # over the limit: kept only while some member's latest plan needs it
        elif a.nbytes > peak:
            want = peak
        else:
            want = None
        if want is not None:
            for m in list(self._needs):  # their views would keep the old arena alive
                m._drop_views()
            self.arena = None
            self.arena = Arena(want, name=f"pool[{name}]")
            self.generation += 1
        if member is not None:
            if member not in self._needs:
                weakref.finalize(member, Pool._member_gone, weakref.ref(self))
            self._needs[member] = nbytes
            self._peaks[member] = mine
        return self.arena

    @staticmethod
    def _member_gone(pool_ref) -> None:
        """A member was garbage-collected: the others re-acquire at their next run (a new
        generation), which sizes the arena to what they need. (Any thread, any time: only
        the generation changes here; the arena is replaced under the lock, in acquire.)"""
        pool = pool_ref()
        if pool is not None:
            pool.generation += 1

    @property
    def nbytes(self) -> int:
        return self.arena.nbytes if self.arena is not None else 0


def _serves(planned: tuple, key: tuple, steps: int) -> bool:
    """Whether the plan of key ``planned`` serves a run of ``steps`` steps whose key is ``key``
    (keys: Session._key's (N, planned steps, staged, discard)): the same batch and kind of run,
    whole (a run in chunks runs the plan's chunk: it takes its own), no more steps."""
    return (key[1] == steps and planned[0] == key[0] and planned[2:] == key[2:]
            and steps <= planned[1])  # fmt: skip


class Session:
    """Runs one model. Concurrent ``run`` calls on one session are serialized by a lock (use
    one session per thread for parallel throughput; they can share weights); a run re-entered
    on its own thread (a signal handler's, inside a run) is refused (engine._turn)."""

    def __init__(self, weights: PackedWeights, threads: int | np.integer | None = None,
                 chunk: int | np.integer | None = None,
                 pool: Pool | None = None) -> None:  # fmt: skip
        weights = _check.packed_weights("Session", weights)
        self.weights = weights
        self.spec: RNNSpec = weights.spec
        self.dtype = weights.dtype
        self.threads = threads  # checked by the property below
        self.chunk = chunk  # likewise
        if pool is not None and not isinstance(pool, Pool):
            raise SpecError(
                f"[Session] pool is a {type(pool).__name__}; expected a leanrnn.Pool (shared by "
                "the sessions that take turns on one arena) or None"
            )
        self.pool = pool
        # Members of a pool take its lock, read at each run: a forked child renews it.
        self._lock = Turn("Session.run") if pool is None else None
        self._gen = -1
        self._arena: Arena | None = None
        self._plan: Plan | None = None
        self._N = self._T = -1
        self.tuned: Measured | None = None  # resize(batch="auto")'s choice
        self._tuned_for: tuple | None = None  # what it was measured for (resize)
        # The last resize's (memory_limit, largest chunk, steps): the re-plans of later runs
        # (another N, T or return_sequences) keep within the limit too (_resize, _Limit).
        self._limit: _Limit | None = None
        self._streams: weakref.WeakSet = weakref.WeakSet()  # their bound steps view the arena
        self._key_now: tuple = ()
        self._keys: dict[tuple, tuple] = {}  # (N, T, return_sequences, chunk) -> _key(...)
        # The plans of the last PLANS_KEPT run shapes on the arena in place (_keep): a run of a
        # shape seen before takes its plan back (_take_back) instead of planning again
        self._plans: OrderedDict[tuple, tuple] = OrderedDict()
        spec, dt = self.spec, self.dtype
        # Per-call constants of the spec, read once (a streaming step is ~10 µs of which every
        # property lookup is a visible part).
        self._LDKH = (spec.num_layers, spec.num_directions, spec.output_size, spec.hidden_size)
        self._constants = kernel_constants(spec, dt)
        self._sync = np.zeros(abi.sync_size(config.max_threads()), np.int64)
        _fork.in_child(self, Session._after_fork)

    __reduce__ = unpicklable("Session", "pickle or copy the Model (its weights), whose copy "
                             "makes a session of its own")  # fmt: skip

    @property
    def _turn(self) -> Turn:
        """This session's turn on its arena: its own, or its pool's (read at each run: a
        forked child renews them)."""
        return self._lock if self.pool is None else self.pool.lock

    def _after_fork(self) -> None:
        """In a forked child: another thread of the parent may have been inside a run (holding
        the lock, which nobody here will release) or a resize (views half made): a fresh lock,
        and the next run plans again."""
        if self.pool is None:
            self._lock = Turn("Session.run")
        self._key_now = ()
        self._gen = -1
        self._plans = OrderedDict()  # (a half-kept one among them, as the views)

    @property
    def threads(self) -> int | None:
        """This session's kernel threads (None: the global setting, set_num_threads)."""
        return self._nthreads

    @threads.setter
    def threads(self, v: int | np.integer | None) -> None:
        # A property, so that ``session.threads = n`` (loading, scoring) is checked as the
        # constructor's argument is: threads=-1 or 2.5 used to reach the kernels.
        self._nthreads = _check.count_or_none("Session", "threads", v)

    @property
    def chunk(self) -> int | None:
        """Steps per chunk of a unidirectional stack's runs (None: auto_chunk's choice)."""
        return self._chunk

    @chunk.setter
    def chunk(self, v: int | np.integer | None) -> None:
        # A property, as threads: chunk=0, -5 or 2.5 set after construction reached the planner.
        # ``_asked`` is the chunk asked for (here, or resize("auto")'s tuned one); ``_chunk``
        # the one runs take: a memory limit's largest (at most the asked one), back to the
        # asked one when a resize lifts the limit (the limit's stayed: 3.4x slower runs)
        self._chunk = self._asked = _positive_or_none("Session", "chunk", v)
        limit = getattr(self, "_limit", None)
        if limit is not None:  # under a memory limit, the chunk asked for is its largest
            self._limit = _Limit(limit.nbytes, self._chunk, limit.steps)

    # ---------------------------------------------------------------- planning
    @property
    def plan(self) -> Plan | None:
        return self._plan

    @property
    def arena_bytes(self) -> int:
        return self._arena.nbytes if self._arena is not None else 0

    def buffers(self, batch: int, steps: int, staged: bool = False,
                discard: bool = False) -> list[Buffer]:  # fmt: skip
        """Every scratch buffer a run of ``batch`` x ``steps`` needs, with lifetimes.
        ``staged`` adds the batch-first staging buffers chunked runs use; ``discard`` adds a
        scratch output for the last layer (return_sequences=False writes no user y)."""
        spec, w = self.spec, self.weights
        it = self.dtype.itemsize
        N, T, D, L = batch, steps, spec.num_directions, spec.num_layers
        K = spec.output_size
        out: list[Buffer] = [Buffer("lengths", 8 * N, 0, L * D - 1)]
        for layer in range(L):
            for d in range(D):
                k = layer * D + d
                out.append(Buffer(f"xw.{k}", T * N * w.Gp * it, k, k))
                out.append(Buffer(f"h.{k}.a", N * w.Kp * it, k, k))
                out.append(Buffer(f"h.{k}.b", N * w.Kp * it, k, k))
                out.append(Buffer(f"gates.{k}", N * w.Gp * it, k, k))
                if spec.cell == "lstm":
                    out.append(Buffer(f"c.{k}", N * w.Hp * it, k, k))
                if spec.proj_size or (spec.cell == "gru" and not spec.linear_before_reset):
                    out.append(Buffer(f"aux.{k}", N * w.Hp * it, k, k))
                q = operand_scratch_bytes(spec, w.precision, layer, T * N, N)
                if q:
                    out.append(Buffer(f"q.{k}", config.max_threads() * q, k, k))
            if layer < L - 1:
                out.append(Buffer(f"y.{layer}", T * N * D * K * it, layer * D, (layer + 2) * D - 1))
        if discard:
            out.append(Buffer(f"y.{L - 1}", T * N * D * K * it, (L - 1) * D, L * D - 1))
        if staged:
            out.append(Buffer("stage.x", T * N * spec.input_size * it, 0, L * D - 1))
            out.append(Buffer("stage.y", T * N * D * K * it, 0, L * D - 1))
        return out

    @property
    def chunkable(self) -> bool:
        """Only forward stacks advance chunk by chunk: a reverse direction starts at each
        sample's last step, so it needs the whole sequence (as bidirectional layers do)."""
        return self.spec.direction == "forward"

    def resize(self, batch: int | np.integer | str, steps: int | np.integer,
               memory_limit: int | float | None = None, return_sequences: bool = True, *,
               latency: float | None = None,
               measure: Callable[[int, int], float] | None = None) -> Plan:  # fmt: skip
        """Plan every scratch buffer for ``batch`` sequences of up to ``steps`` steps, in one
        arena, and allocate it (reusing the current arena when the plan fits in it).

        With ``memory_limit`` (bytes of arena: an int, or a whole float such as 4e6), a
        unidirectional stack gets the largest chunk (timesteps) whose plan fits; ``PlanError`` —
        before anything is allocated — if not even one step fits, or if a bidirectional stack
        does not fit whole. The limit stays with the session: a later run of another shape
        (another batch, longer steps, ``return_sequences=False``) plans its chunk within it, or
        raises PlanError; an arena held from before that exceeds it is released (a resize
        without a limit lifts it, and the chunk goes back to the one asked for: ``chunk=``,
        else auto). A chunk asked for caps the limit's choice. ``return_sequences=False``
        plans for runs that keep only final states (chunked by default, see DEFAULT_CHUNK).
        Takes the session's (or its pool's) lock: a run on another thread finishes first.

        ``batch="auto"``: measure calls on this machine (``leanrnn.tuning.tune``) and plan for
        the largest batch, then chunk (<= steps), whose call of batch x chunk steps takes at
        most ``latency`` seconds (default 10 ms) and holds at most ``memory_limit`` bytes
        (arena and call buffers; default a share of available memory). The choice, with the
        measured points, is kept in ``self.tuned``; ``measure(batch, chunk) -> seconds``
        replaces the timing (tests).

        >>> s = Session(weights); s.resize("auto", 100, latency=0.005); s.tuned.batch
        """
        memory_limit = _check.bytes_or_none("Session.resize", "memory_limit", memory_limit)
        if isinstance(batch, str):
            if batch != "auto":
                raise ShapeError(
                    f"[Session.resize] batch={batch!r}; expected a positive int or 'auto'"
                )
            from ..tuning import MAX_TUNE_CHUNK, tune  # tuning sits above the engine: lazily

            if not isinstance(steps, int | np.integer) or isinstance(steps, bool) or steps < 1:
                raise ShapeError(f"[Session.resize] steps={steps!r}; expected a positive int")
            # Measured once per question: a second resize("auto") with the same target, limit,
            # steps, threads, weights and measure reuses the answer (each measured anew, ~1.4 s
            # at H=512, where an explicit resize takes 0.15 ms); ``session.tuned = None``
            # measures again (a machine whose load changed)
            asked = (latency, memory_limit, int(steps), config.threads_for(self.threads),
                     self.weights.generation, measure)  # fmt: skip
            if self.tuned is None or self._tuned_for != asked:
                # a stack that cannot be chunked holds all ``steps`` whatever the call's
                # chunk: its memory is checked at them (bidirectional at T=4000 went 50x over)
                self.tuned = tune(self, latency=latency, memory_limit=memory_limit,
                                  max_chunk=min(int(steps), MAX_TUNE_CHUNK),
                                  threads=self.threads, measure=measure,
                                  plan_steps=int(steps))  # fmt: skip
                self._tuned_for = asked
            with self._turn():
                if self.tuned.chunk is not None:
                    self._chunk = self._asked = self.tuned.chunk
                limit = None
                if memory_limit is not None:
                    limit = _Limit(int(memory_limit), self.tuned.chunk, int(steps))
                return self._resize(self.tuned.batch, steps, limit, return_sequences)
        if latency is not None or measure is not None:  # (they were ignored)
            raise ShapeError(f"[Session.resize] latency= and measure= choose an 'auto' batch; "
                             f"batch={batch!r} is given")  # fmt: skip
        with self._turn():
            limit = None
            if memory_limit is not None:  # (a chunk asked for caps the limit's choice)
                limit = _Limit(int(memory_limit), self._asked, steps)
            return self._resize(batch, steps, limit, return_sequences)

    def _resize(self, batch: int | np.integer, steps: int | np.integer, limit: _Limit | None,
                return_sequences: bool) -> Plan:  # fmt: skip
        """``limit``: the memory limit to plan within, kept for the re-plans of later runs."""
        batch, steps = _batch_steps(batch, steps)
        memory_limit = None if limit is None else limit.nbytes
        self._chunk = self._chunk_within(batch, steps, limit, not return_sequences)
        if limit != self._limit:
            self._plans.clear()  # made within another limit (a plan refused below keeps none)
        self._limit = limit
        key = self._key(batch, steps, return_sequences)
        _, T, staged, discard = key
        p = plan(self.buffers(batch, T, staged, discard), limit=memory_limit)
        self._allocate(p.total, f"{self.spec.cell} N={batch} T={T}")
        if config.log_enabled("memory"):
            for pl in p.placements:
                b = pl.buffer
                _log.info(
                    "plan %-10s %10d B at %10d  ops %d..%d",
                    b.name,
                    b.nbytes,
                    pl.offset,
                    b.first,
                    b.last,
                )
        self._plan = p
        # the key last: an exception in between (a KeyboardInterrupt) left it naming the new
        # shape over the old views, and every later run of that shape skipped the re-plan and
        # ran the kernels past the buffers (wrong results; a segfault at T=2000)
        self._key_now = ()
        self._N, self._T = batch, T
        self._make_views()
        self._key_now = key
        self._keep()
        return p

    # What a plan made the session's (_resize, _make_views), kept per shape; and how many.
    # A batch that changes between calls (a beam search's, the last batch of an epoch) and
    # lengths that grow then come back planned every call (~80 us per layer and direction:
    # 1.7-2.1x the same loop at one shape, slower than torch.nn's)
    _KEPT = ("_plan", "_N", "_T", "_views", "_layer_inputs", "_op_views", "_calls", "_slot_at",
             "_empty", "_key_now")  # fmt: skip
    PLANS_KEPT = 16

    def _keep(self) -> None:
        """Keep the plan just made, of views of the arena in place (_allocate clears them all
        when the arena is replaced, _resize when the limit changes). Not under a memory_limit:
        there each batch's resize sets the chunk (_largest_chunk), which a plan taken back
        would not redo."""
        plans = self._plans
        if self._limit is not None:
            plans.clear()
            return
        plans[self._key_now] = (self._arena, tuple(getattr(self, a) for a in self._KEPT))
        plans.move_to_end(self._key_now)
        if len(plans) > self.PLANS_KEPT:
            plans.popitem(last=False)  # the least recently used

    def _take_back(self, key: tuple, steps: int) -> bool:
        """The kept plan of ``key``, or the shortest kept one that serves it as ``_covers``
        would (the same batch and kind, a whole run, no fewer steps: lengths and batches that
        both change planned most calls), made the session's again; only plans that view the
        arena in place."""
        plans = self._plans
        fits = [k for k in plans if k == key or _serves(k, key, steps)]
        found = min(fits, key=lambda k: k[1], default=None)
        if found is None:
            return False
        if plans[found][0] is not self._arena:
            del plans[found]
            return False
        plans.move_to_end(found)  # now the most recently used
        kept = plans[found]
        # the key last (_KEPT ends with it), cleared first: interrupted part way (Ctrl-C), the
        # old key over the new views skipped the next run's plan and ran on a mix of the two
        self._key_now = ()
        for a, v in zip(self._KEPT, kept[1], strict=True):
            setattr(self, a, v)
        return True

    def auto_chunk(self, batch: int) -> int | None:
        """The chunk ``chunk=None`` means: steps whose input projection fits XW_BUDGET, for
        time-major input; None (whole sequences) for batch-first input, whose chunks would be
        staged through copies (H=128, N=64, 2 threads: 4.9 ms whole vs 5.7 ms chunked).
        Threads on batch slices (kernels._cpu.batch_slices) meet only where a chunk ends, so
        any of them the OS preempts stalls the others there: their chunks fill a quarter of the
        last-level cache instead (the rest left to the weights), fewer and longer, up to
        SLICED_XW_PER_THREAD per thread."""
        if self.spec.batch_first:
            return None
        step_bytes = batch * self.weights.Gp * self.dtype.itemsize
        budget = XW_BUDGET
        threads = self._threads()
        if _cpu.batch_slices(batch, threads):
            share = min(_cpu.caches()["L3"] // 4, threads * SLICED_XW_PER_THREAD)
            budget = max(budget, share)
        return max(MIN_AUTO_CHUNK, budget // step_bytes)

    def _key(self, batch: int, steps: int, return_sequences: bool) -> tuple:
        """(N, planned steps, staged, discard): what a plan depends on besides the model."""
        chunk = self.chunk
        if chunk is None:
            chunk = self.auto_chunk(batch)
            if not return_sequences:  # only final states: chunked, so memory ignores T
                chunk = min(chunk or DEFAULT_CHUNK, DEFAULT_CHUNK)
        T = steps if chunk is None or not self.chunkable else min(steps, chunk)
        return (batch, T, T < steps and self.spec.batch_first, not return_sequences)

    def planned(self, batch: int | np.integer, steps: int | np.integer,
                return_sequences: bool = True,
                memory_limit: int | float | None = None) -> Plan:  # fmt: skip
        """The plan ``resize(batch, steps, memory_limit, return_sequences)`` would make, without
        making it (nothing allocated, the session's plan and limit as they were; PlanError as
        resize's when the limit cannot be met)."""
        batch, steps = _batch_steps(batch, steps)
        memory_limit = _check.bytes_or_none("Session.planned", "memory_limit", memory_limit)
        limit = None if memory_limit is None else _Limit(int(memory_limit), self._asked, steps)
        with self._turn():
            chunk = self._chunk
            try:  # the chunk as resize would take it
                self._chunk = self._chunk_within(batch, steps, limit, not return_sequences)
                return plan(self.buffers(*self._key(batch, steps, return_sequences)))
            finally:
                self._chunk = chunk

    def _chunk_within(self, batch: int, steps: int, limit: _Limit | None,
                      discard: bool) -> int | None:  # fmt: skip
        """The chunk runs take: the largest ``limit`` allows (within its cap), or without one
        the chunk asked for (``chunk=``, resize("auto")'s; None: auto_chunk's)."""
        if limit is None:
            return self._asked
        return self._largest_chunk(batch, steps, limit.nbytes, discard, limit.cap, limit.steps)

    def _largest_chunk(self, batch: int, steps: int, limit: int, discard: bool,
                       cap: int | None = None, upto: int | None = None) -> int | None:  # fmt: skip
        """The chunk for runs of ``batch`` x ``steps`` within ``limit``: the largest (<= ``cap``,
        searched up to ``upto`` steps, the limited resize's: a short run, a stream's one step,
        must not shrink the chunk of the long runs after it) whose plan fits; PlanError naming
        what the smallest possible plan needs (final-states-only runs' buffers included)."""

        def need(t: int) -> int:  # the plan of such a run with chunk t
            t = min(t, steps)
            staged = t < steps and self.spec.batch_first
            return plan(self.buffers(batch, t, staged, discard)).total

        if not self.chunkable:
            if need(steps) > limit:
                raise PlanError(
                    f"[Session.resize] a {self.spec.direction} stack needs the whole sequence: "
                    f"{need(steps)} bytes of arena for N={batch}, T={steps}; "
                    f"memory_limit={limit}"
                )
            return self._chunk  # (ignored: such a stack runs whole)
        if need(1) > limit:
            raise PlanError(
                f"[Session.resize] even one step needs {need(1)} bytes of arena for N={batch}; "
                f"memory_limit={limit}"
            )
        reach = max(steps, upto or steps)
        top = min(reach, cap or reach)
        if need(top) <= limit:  # the whole run fits: the chunk stays as long as allowed
            return top
        lo, hi = 1, min(top, steps) - 1  # largest t that fits: plans grow with t
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if need(mid) <= limit:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def _allocate(self, nbytes: int, name: str) -> None:
        limit = None if self._limit is None else self._limit.nbytes
        if self.pool is not None:
            arena = self.pool.acquire(nbytes, name, self, limit)
            if arena is not self._arena:  # (a session's own arena before it joined the pool:
                self._plans.clear()  # kept plans' views held it alive)
            self._arena = arena
            self._gen = self.pool.generation
            return
        if not reusable(self._arena, nbytes, limit):
            self._drop_views()  # the old arena goes before the new one is taken (and the plans
            self._arena = Arena(nbytes, name=f"arena[{name}]")  # kept on it, _drop_views)

    def _drop_views(self) -> None:
        """Let go of the arena and everything viewing it (its pool is replacing it); the next
        run plans again. Called with the session's (its pool's) lock held. A stream's bound
        step is dropped too; one that a feed binds just after (outside the lock) keeps the old
        arena until that stream's next feed finds it stale (_step_valid) and binds anew."""
        self._key_now = ()
        self._gen = -1
        self._arena = None
        self._plans.clear()  # their views are of the arena going
        self._views, self._op_views, self._calls, self._layer_inputs = {}, [], [], []
        for st in list(self._streams):
            st._step = None

    def _make_views(self) -> None:
        spec, w, p, a = self.spec, self.weights, self._plan, self._arena
        assert p is not None and a is not None
        N, T, D, L, dt = self._N, self._T, spec.num_directions, spec.num_layers, self.dtype
        K = spec.output_size
        v = {}
        for pl in p.placements:
            name = pl.buffer.name
            kind = name.split(".")[0]
            if kind == "lengths":
                shape, dtype = (N,), np.int64
            elif kind == "xw":
                shape, dtype = (T * N, w.Gp), dt
            elif kind == "h":
                shape, dtype = (N, w.Kp), dt
            elif kind == "gates":
                shape, dtype = (N, w.Gp), dt
            elif kind in ("c", "aux"):
                shape, dtype = (N, w.Hp), dt
            elif kind == "q":  # a row per thread (buffers sized it)
                threads = config.max_threads()
                shape, dtype = (threads, pl.buffer.nbytes // threads), np.uint8
            elif name == "stage.x":
                shape, dtype = (N, T, spec.input_size), dt
            elif name == "stage.y":
                shape, dtype = (N, T, D * K), dt
            else:  # y.{layer}
                shape, dtype = (T * N, D * K), dt
            v[name] = a.view(pl.offset, shape, dtype)
        # Kernels always get an aux array; a zero-column stand-in when the cell needs none.
        self._empty = np.zeros((N, 0), dt)
        self._views = v
        self._layer_inputs = [None] + [v[f"y.{layer}"] for layer in range(L - 1)]
        # Per op k: its views, looked up once here rather than by name on every run, and its
        # job's arguments by name (abi.Call): all but those of a run (PER_CALL) are fixed here.
        self._op_views = [
            (
                v[f"xw.{k}"], v[f"h.{k}.a"], v[f"h.{k}.b"], v[f"gates.{k}"],
                v.get(f"aux.{k}", self._empty), v.get(f"c.{k}"),
            )
            for k in range(L * D)
        ]  # fmt: skip
        self._calls = [self._call(k // D, k % D) for k in range(L * D)]
        # Where run_slots puts the slot table, the h store and (LSTM) the c store (abi._SLOTS).
        names = abi.JOBS[self._calls[0].job].names()
        self._slot_at = tuple(names.index(n) for n in ("slot", "h_store", "c") if n in names)

    def _call(self, layer: int, d: int) -> abi.Call:
        """Op (layer, d)'s job arguments (abi.JOBS[cell]) but the per-run ones, PER_CALL."""
        spec, pl, k = self.spec, self.weights.layers[layer][d], layer * self._LDKH[1] + d
        L, D, K, H = self._LDKH
        _, ha, hb, gates, aux, c = self._op_views[k]
        named = recurrence_arguments(
            spec, pl, d, self._constants, self._sync, h_a=ha, h_b=hb, gates=gates, aux=aux, c=c,
            lengths=self._views["lengths"], keep=False, ghn=self._empty,
            q=self._views.get(f"q.{k}", NO_SCRATCH), bf16_act=self.weights.precision == "bf16-act",
        )  # fmt: skip
        job = abi.job_for(spec.cell, self.weights.precision)  # reduced weights: their own job
        return abi.Call(job, PER_CALL, C=spec.input_size if layer == 0 else D * K, **named)

    # ---------------------------------------------------------------- running
    def _threads(self) -> int:
        return config.threads_for(self.threads)

    # (y is None only with return_sequences=False)
    # fmt: off
    @overload
    def run(self, x: _Array, h0: _Array | None = None, c0: _Array | None = None,
            lengths: ArrayLike | None = None, out: Any = None,
            return_sequences: Literal[True] = True) -> tuple[_Array, _Array, _CellState]: ...
    @overload
    def run(self, x: _Array, h0: _Array | None = None, c0: _Array | None = None,
            lengths: ArrayLike | None = None, out: Any = None,
            return_sequences: bool = True) -> tuple[_Array | None, _Array, _CellState]: ...
    # fmt: on
    def run(self, x: _Array, h0: _Array | None = None, c0: _Array | None = None,
            lengths: ArrayLike | None = None, out: Any = None, return_sequences: bool = True,
            ) -> tuple[_Array | None, _Array, _CellState]:  # fmt: skip
        """Run the whole stack over ``x``.

        x:       [T, N, C] ([N, T, C] if spec.batch_first), the model's dtype, C-contiguous
        h0:      [L*D, N, K] initial hidden state (K = proj_size or hidden_size), or None = 0
        c0:      [L*D, N, H] initial LSTM cell state, or None = 0
        lengths: [N] ints in 0..T, or None = all T (PyTorch packed-sequence semantics)
        out:     None, or a tuple (y, h_n[, c_n]) of preallocated C-contiguous outputs
                 (y is omitted from the tuple when return_sequences=False). They share no
                 memory with each other or with an input (else LayoutError: a bidirectional
                 layer reads x again after the other direction wrote y), except that
                 h_n/c_n may be h0/c0 themselves (the state updated in place).
        return_sequences: False keeps only the final states; y is then None and, with
                 ``chunk`` set, peak memory does not depend on T
        returns  (y [T, N, D*K] (batch-first: [N, T, D*K]), h_n [L*D, N, K], c_n [L*D, N, H] or
                 None for GRU/RNN). NaN/Inf in inputs propagate to the outputs.
        Unaligned arrays (np.frombuffer at an odd offset) are copied for the kernels: x in, y
        out through a staging copy; aligned ones (numpy's own allocations) never are.
        """
        return self._run(x, h0, c0, lengths, out, return_sequences, False)

    def slot_states(self, streams: int) -> SlotStates:
        """States for ``streams`` slots of this model, all zero, for ``run_slots``. PlanError
        (before allocating) if they cannot fit in this machine's memory."""
        S = _check.count_or_none("Session.slot_states", "streams", streams)
        if S is None:
            raise ShapeError(f"[Session.slot_states] streams={streams!r}; expected a positive int")
        return SlotStates(self.weights, S)

    def run_slots(self, x, states: SlotStates, slot, lengths=None, out=None):
        """Run the stack over ``x`` with sample n's state in slot ``slot[n]`` of ``states``:
        read there before its first step, written there after its last (``lengths[n]``), no
        copies in or out of the call (the kernels index the slots). Slots not in ``slot``,
        and slots of samples with length 0, are left as they are.

        x:       [T, N, C] ([N, T, C] if spec.batch_first), as for ``run``
        states:  a ``SlotStates`` of this model (``slot_states``)
        slot:    [N] ints, distinct, in 0..S-1; -1 marks a padding row (its length must be 0)
        lengths: [N] ints in 0..T, or None = all T
        out:     None, or y [T, N, D*K] (batch-first: [N, T, D*K]) to write
        returns  y

        >>> st = session.slot_states(64)
        >>> y = session.run_slots(x, st, np.array([3, 0, 7]), lengths=np.array([5, 2, 0]))
        """
        spec, dt, op = self.spec, self.dtype, "Session.run_slots"
        x, T, N = self._input(op, x)
        L, D, K, H = self._LDKH
        if not isinstance(states, SlotStates):
            raise ShapeError(
                f"[{op}] states is a {type(states).__name__}; expected the SlotStates of this "
                "model: make them with session.slot_states(streams)"
            )
        Hp = self.weights.Hp if spec.cell == "lstm" else 0
        if states.dtype != dt or states.shape != (L * D, K, H, Hp):
            LD, Ks, Hs, _ = states.shape
            raise ShapeError(
                f"[{op}] states hold {states.dtype} states of [L*D={LD}, K={Ks}, H={Hs}]; "
                f"expected {dt} [L*D={L * D}, K={K}, H={H}] (this model's): make them with "
                "this session's slot_states(streams)"
            )
        given = lengths  # (the caller's array: an output over it is refused, copied or not)
        if lengths is not None:
            lengths = _check.lengths(op, lengths, N, T)
        slot = _slot_table(op, slot, N, states.S, lengths)
        # x (or the slot table) over the states would read what the run writes there
        updated = (("states.h", states.h), ("states.c", states._c))
        _check.apart(op, (("x", x), ("slot", slot)), updated, states._owner)
        bf = spec.batch_first
        yshape = (N, T, D * K) if bf else (T, N, D * K)
        if out is None:
            y = np.empty(yshape, dt)
        else:
            names = ("N", "T", "D*K") if bf else ("T", "N", "D*K")
            y = _check.array(op, "out (y)", out, dt, yshape, names)
            _check.writable(op, "out y", y)
            ins = (("x", x), ("states.h", states.h), ("states.c", states._c), ("slot", slot),
                   ("lengths", given))  # fmt: skip
            _check.disjoint(op, (("y", y),), ins)
        if not x.flags.aligned:
            x = x.copy()
        store = (states, slot)
        if y.flags.aligned:
            return self._run_locked(x, None, None, lengths, y, None, None, T, N, True, store)[0]
        y_out = y
        y_out[...] = self._run_locked(
            x, None, None, lengths, np.empty_like(y), None, None, T, N, True, store
        )[0]
        return y_out

    def _input(self, op: str, x) -> tuple:
        """(x, T, N): x checked (dtype, [T, N, C] or batch-first [N, T, C], C-contiguous)."""
        C = self.spec.input_size
        names = ("N", "T", "C") if self.spec.batch_first else ("T", "N", "C")
        x = _check.array(op, "x", x, self.dtype, (None, None, C), names)
        _check.contiguous(op, "x", x)
        if self.spec.batch_first:
            N, T = x.shape[0], x.shape[1]
        else:
            T, N = x.shape[0], x.shape[1]
        if N == 0 or T == 0:
            raise ShapeError(f"[{op}] x has shape {x.shape}; T and N must be >= 1")
        return x, T, N

    def _run(self, x, h0, c0, lengths, out, return_sequences: bool, _trusted: bool,
             op: str = "Session.run"):  # fmt: skip
        """run(); ``_trusted``: a Stream's own state arrays are h0/c0 and out's h_n/c_n
        (validated when it made them; a streaming step should not pay to check them again).
        ``op``: the operation errors name (Stream.feed's chunks)."""
        spec, dt = self.spec, self.dtype
        if not _trusted:
            _check.flag(op, "return_sequences", return_sequences, DTypeError)
        x, T, N = self._input(op, x)
        L, D, K, H = self._LDKH
        LD = L * D
        # A Stream passes its own state buffers as h0/c0: validated when it made them.
        if h0 is not None and not _trusted:
            h0 = _check.array(op, "h0", h0, dt, (LD, N, K), ("L*D", "N", "K"))
        if c0 is not None and not _trusted:
            if spec.cell != "lstm":
                raise ShapeError(f"[{op}] c0 was given but a {spec.cell.upper()} has no cell state")
            c0 = _check.array(op, "c0", c0, dt, (LD, N, H), ("L*D", "N", "H"))
        given = lengths  # (the caller's array: an output over it is refused, copied or not)
        if lengths is not None:
            lengths = _check.lengths(op, lengths, N, T)
        y, h_n, c_n = self._outputs(out, T, N, return_sequences, _trusted, op)
        if out is not None and not _trusted:  # a Stream checks the y it passes itself
            ins = (("x", x), ("h0", h0), ("c0", c0), ("lengths", given))
            _check.disjoint(op, (("y", y), ("h_n", h_n), ("c_n", c_n)), ins, IN_PLACE)
        # The kernels take aligned arrays only (h0, c0, lengths, h_n and c_n are copied by
        # numpy, which does not care); numpy allocates aligned, so this copies only arrays
        # made over foreign buffers.
        if not x.flags.aligned:
            x = x.copy()
        if y is None or y.flags.aligned:
            return self._run_locked(x, h0, c0, lengths, y, h_n, c_n, T, N, return_sequences)
        y_out = y
        y, h_n, c_n = self._run_locked(
            x, h0, c0, lengths, np.empty_like(y), h_n, c_n, T, N, return_sequences
        )
        y_out[...] = y
        return y_out, h_n, c_n

    def _run_locked(self, x, h0, c0, lengths, y, h_n, c_n, T, N, return_sequences, store=None):
        """``store``: run_slots's (SlotStates, slot table), in place of h0, c0, h_n, c_n."""
        with self._turn():
            stale = self.pool is not None and self._gen != self.pool.generation
            memo = (N, T, return_sequences, self._chunk)
            key = self._keys.get(memo)
            if key is None:
                if len(self._keys) > 64:  # many distinct lengths: keep the memo small
                    self._keys.clear()
                key = self._keys[memo] = self._key(N, T, return_sequences)
            if stale or (key != self._key_now and not self._covers(key, T)
                         and not self._take_back(key, T)):  # fmt: skip
                self._resize(N, T, self._limit, return_sequences)
            if self._T >= T:
                self._execute(x, h0, c0, lengths, y, h_n, c_n, T, N, store)
            else:
                self._execute_chunked(x, h0, c0, lengths, y, h_n, c_n, T, N, store)
        return y, h_n, c_n

    def _covers(self, key: tuple, steps: int) -> bool:
        """Whether the plan in place serves a run of ``steps`` steps, ``key``, as it is: the
        same batch and kind of run, whole (not in chunks: their length is the plan's, and a
        chunk set smaller must take effect), no more steps than planned (a shorter run uses
        the first T*N rows of each view). Lengths that change from call to call then plan
        once, for the longest so far: each re-plan (the plan, the views, the kernels'
        arguments) cost ~100 us of Python, 2.6x onnxruntime's whole call at H=64 with T drawn
        from 5..60."""
        return bool(self._key_now) and _serves(self._key_now, key, steps)

    def _execute_chunked(self, x, h0, c0, lengths, y, h_n, c_n, T: int, N: int,
                         store=None) -> None:  # fmt: skip
        """Advance the whole stack ``self._T`` steps at a time, carrying state in h_n/c_n (or
        in the slots of ``store``)."""
        spec, Tc, v = self.spec, self._T, self._views
        bf = spec.batch_first
        # The final states double as the carried state: each chunk starts from them.
        if store is None:
            if h0 is not None:
                h_n[:] = h0
            else:
                h_n[:] = 0
        if c_n is not None:
            if c0 is not None:
                c_n[:] = c0
            else:
                c_n[:] = 0
        for t0 in range(0, T, Tc):
            t1 = min(T, t0 + Tc)
            n_steps = t1 - t0
            if bf:
                # Contiguous [N, n_steps, ...] windows at the start of the staging buffers (a
                # [:, :n_steps] slice would not be contiguous when the last chunk is short).
                sx, sy = v["stage.x"], v["stage.y"]
                xs = sx.reshape(-1)[: N * n_steps * sx.shape[2]].reshape(N, n_steps, -1)
                xs[:] = x[:, t0:t1]
                ys = sy.reshape(-1)[: N * n_steps * sy.shape[2]].reshape(N, n_steps, -1)
            else:
                xs = x[t0:t1]
                ys = y[t0:t1] if y is not None else None
            lens = None
            if lengths is not None:
                lens = np.clip(lengths - t0, 0, n_steps)
            self._execute(xs, h_n, c_n, lens, ys, h_n, c_n, n_steps, N, store)
            if bf and y is not None:
                y[:, t0:t1] = ys

    def _outputs(self, out, T: int, N: int, return_sequences: bool = True,
                 trusted_states: bool = False, op: str = "Session.run"):  # fmt: skip
        """(y, h_n, c_n) to write: new arrays, or ``out`` checked. ``trusted_states``: out's
        h_n/c_n are a Stream's own state arrays (checked when it made them; a streaming step
        should not pay ~1.5 us to check them again) — y is checked all the same."""
        spec, dt = self.spec, self.dtype
        L, D, K, H = self._LDKH
        LD, DK = L * D, D * K
        yshape = (N, T, DK) if spec.batch_first else (T, N, DK)
        is_lstm = spec.cell == "lstm"
        if out is None:
            y = np.empty(yshape, dt) if return_sequences else None
            h_n = np.empty((LD, N, K), dt)
            c_n = np.empty((LD, N, H), dt) if is_lstm else None
            return y, h_n, c_n
        given = out
        if isinstance(out, np.ndarray):
            out = (out,)
        if not return_sequences and isinstance(out, tuple | list):
            out = (None, *out)
        if not is_lstm and isinstance(out, tuple | list) and len(out) == 3:
            # (y, h_n, None) is what run returns for a GRU/RNN: taken back as out, as an
            # LSTM's is (it was refused as 3 arrays); an array there would not be written
            if out[2] is not None:
                raise ShapeError(
                    f"[{op}] a {spec.cell.upper()} has no cell state: out[2] (c_n) must be "
                    f"None or left out; got {type(out[2]).__name__}"
                )
            out = out[:2]
        if not isinstance(out, tuple | list) or len(out) != (3 if is_lstm else 2):
            # in the caller's terms: the arrays this call takes, and what it was given
            want = (["y"] if return_sequences else []) + ["h_n"] + (["c_n"] if is_lstm else [])
            got = (f"{len(given)} arrays" if isinstance(given, tuple | list) else
                   "one array" if isinstance(given, np.ndarray) else type(given).__name__)  # fmt: skip
            raise ShapeError(
                f"[{op}] out must be a tuple ({', '.join(want)})"
                + ("" if return_sequences else " (return_sequences=False writes no y)")
                + f"; got {got}"
            )
        y = None
        if return_sequences:
            names = ("N", "T", "D*K") if spec.batch_first else ("T", "N", "D*K")
            y = _check.array(op, "out[0] (y)", out[0], dt, yshape, names)
        if trusted_states:
            if y is not None:
                _check.writable(op, "out y", y)
            return y, out[1], (out[2] if is_lstm else None)
        h_n = _check.array(op, "out[1] (h_n)", out[1], dt, (LD, N, K), ("L*D", "N", "K"))
        c_n = None
        if is_lstm:
            c_n = _check.array(op, "out[2] (c_n)", out[2], dt, (LD, N, H), ("L*D", "N", "H"))
        for name, a in (("y", y), ("h_n", h_n), ("c_n", c_n)):
            if a is not None:
                _check.writable(op, f"out {name}", a)
        return y, h_n, c_n

    def _execute(self, x, h0, c0, lengths, y, h_n, c_n, T: int, N: int, store=None) -> None:
        spec, w, v = self.spec, self.weights, self._views
        L, D, K, H = self._LDKH
        cell = spec.cell
        threads = self._threads()
        macs = N * w.Gp * w.Kp  # per step
        # Threads (one pool launch per op): below PARALLEL_MIN_MACS per step they
        # would wait on each other longer than they work.
        parts = threads if macs >= PARALLEL_MIN_MACS else 1
        lens = v["lengths"]
        if lengths is None:
            lens[:] = T
        else:
            lens[:] = lengths
        calls, sync = self._calls, self._sync
        ix, ixw, ixbf, iT, iy, iybf, ip = calls[0].slots  # (PER_CALL, the same for every op)
        TN = T * N  # planned views hold self._T steps; a shorter run uses their first T*N rows
        short = T < self._T
        bf_T = T if spec.batch_first else 0
        y_final = y.reshape(-1, D * K) if y is not None else v[f"y.{L - 1}"][:TN]
        log = config.log_enabled("memory")
        for layer in range(L):
            if layer == 0:
                xin, xin_bf = x.reshape(-1, spec.input_size), bf_T
            else:
                xin, xin_bf = self._layer_inputs[layer], 0
                xin = xin[:TN] if short else xin
            if layer == L - 1:
                yout, y_bf = y_final, (bf_T if y is not None else 0)
            else:
                yout, y_bf = self._layer_inputs[layer + 1], 0
                yout = yout[:TN] if short else yout
            for d in range(D):
                k = layer * D + d
                if log:
                    self._log_events(k, "acquire")
                xw, ha, hb, _, _, c = self._op_views[k]
                if short:
                    xw = xw[:TN]
                if store is not None:  # the kernel reads and writes the states by slot
                    pass
                elif h0 is not None:
                    ha[:, :K] = h0[k]  # padding columns K.. are never read by the kernels
                else:
                    ha[:] = 0
                if cell == "lstm" and store is None:
                    if c0 is None:
                        c[:] = 0  # padding units too: the projection reads every column of h(c)
                    elif c.shape[1] == H:
                        c[:] = c0[k]
                    else:
                        c[:, H:] = 0
                        c[:, :H] = c0[k]
                a = calls[k].args.copy()
                a[ix], a[ixw], a[ixbf], a[iT], a[iy], a[iybf], a[ip] = (
                    xin, xw, xin_bf, T, yout, y_bf, parts)  # fmt: skip
                if store is not None:
                    states, slot = store
                    a[self._slot_at[0]], a[self._slot_at[1]] = slot, states.h[k]
                    if cell == "lstm":
                        a[self._slot_at[2]] = states._c[k]
                sync[:] = 0
                runner.run(calls[k].job, tuple(a), parts)
                if store is None:
                    parity = T % 2  # which state buffer the last step wrote
                    if cell == "lstm":
                        c_n[k] = c[:, :H]
                    h_n[k] = (hb if parity else ha)[:, :K]
                if log:
                    self._log_events(k, "release")

    # ------------------------------------------------------- streaming steps, bound once
    def _step_program(self, step: _Step | None, N: int, h: np.ndarray, c: np.ndarray | None):
        """One step of N samples from the state ``h`` [L, N, K] (``c`` [L, N, H]), updated in
        place — a Stream's own arrays — bound once (runner.program) so that the stream's next
        steps pass only x and y (Session._step): the ~20 us of Python a step costs through run()
        on top of a few us of kernels. ``step``: the one bound before, returned as is while it
        is still valid (_step_valid). None when the session's plan does not serve one step of N
        (call it after such a run) or there is no native module (the JIT backend)."""
        with self._turn():
            if step is not None and self._step_valid(step):
                return step
            stale = self.pool is not None and self._gen != self.pool.generation
            L, D, K, H = self._LDKH
            if stale or not self._covers((N, 1, False, False), 1) or D != 1:
                return None
            if config.log_enabled("memory") or not runner.binds():  # each step then runs
                return None  # through _execute, which logs, or on the JIT
            spec, w, dt = self.spec, self.weights, self.dtype
            threads = self._threads()
            parts = threads if N * w.Gp * w.Kp >= PARALLEL_MIN_MACS else 1  # as _execute
            bf = 1 if spec.batch_first else 0  # xw_bf_T and y_bf_T = T for batch-first input
            # Stand-ins for x and y, bound for their shape: each step passes its own.
            x, y = np.empty((N, spec.input_size), dt), np.empty((N, K), dt)
            ops = []
            for k in range(L):  # one op per layer: _execute's, with T = 1 (the first N rows
                xw, ha, hb, _, _, cell = self._op_views[k]  # of views planned for more steps)
                xw = xw[:N]
                xin, xbf = (x, bf) if k == 0 else (self._layer_inputs[k][:N], 0)
                yout, ybf = (y, bf) if k == L - 1 else (self._layer_inputs[k + 1][:N], 0)
                a = self._calls[k].args.copy()
                ix, ixw, ixbf, iT, iy, iybf, ip = self._calls[k].slots
                a[ix], a[ixw], a[ixbf], a[iT], a[iy], a[iybf], a[ip] = (
                    xin, xw, xbf, 1, yout, ybf, parts)  # fmt: skip
                # The state in before the op and out after it; one step writes h_b.
                pre = [(self._sync, None), (ha[:, :K], h[k])]
                post = [(h[k], hb[:, :K])]
                if k == 0:  # every sample runs its one step (lengths = None)
                    pre.append((self._views["lengths"], np.ones(N, np.int64)))
                if c is not None:
                    if cell.shape[1] != H:
                        pre.append((cell[:, H:], None))  # padding units: see _execute
                    pre.append((cell[:, :H], c[k]))
                    post.append((c[k], cell[:, :H]))
                ops.append((self._calls[k].job, tuple(a), parts, pre, post))
            prog = runner.program(ops, x_at=(0, "x"), y_at=(L - 1, "y"))
            return None if prog is None else _Step(prog, self._calls, self._key_now, threads)

    def _step_valid(self, step: _Step) -> bool:
        """Whether ``step`` still matches the session: the same plan (a resize makes new
        calls, a plan taken back its own again; a forked child clears the key and the kept
        plans), arena generation and threads, and no memory log to write (_execute writes it)."""
        return (
            step.calls is self._calls
            and step.key is self._key_now
            and (self.pool is None or self._gen == self.pool.generation)
            and step.threads == config.threads_for(self._nthreads)  # _threads(), one call less
            and not config.log_enabled("memory")
        )

    def _step(self, step: _Step, x, y) -> bool:
        """Run a bound step (_step_program) on ``x`` [N, C] into ``y`` [N, K]; False, with
        nothing run, when it is no longer valid or x and y do not fit it (runner.run_program):
        the caller then takes run()'s path, whose checks say what is wrong."""
        turn = self._turn
        if turn._is_owned():  # (Turn's call, inline: a streaming step is a few us)
            turn.refuse()
        with turn:
            return self._step_valid(step) and runner.run_program(step.program, x, y)

    def _log_events(self, k: int, what: str) -> None:
        """MNN_PRINT-style memory log: which buffers op k acquires or releases, and where."""
        for pl in self._plan.placements:
            b = pl.buffer
            if (b.first if what == "acquire" else b.last) == k:
                _log.info("op %d %s %-10s %10d B at +%d", k, what, b.name, b.nbytes, pl.offset)

    def stream(self, batch: int = 1) -> Stream:
        """A ``Stream`` over this session: feed chunks, state carried (unidirectional stacks)."""
        st = Stream(self, batch)
        with self._turn():  # _drop_views walks the set under the same lock
            self._streams.add(st)
        return st

    def __repr__(self) -> str:
        planned = (
            f"N={self._N}, T={self._T}, arena={self.arena_bytes} B" if self._plan else "unplanned"
        )
        return f"Session({self.spec.cell}, H={self.spec.hidden_size}, {planned})"
