"""Continuous batching across streams: the pending steps of every live stream of a model run as
one batched engine call; streams join and leave between calls; states live in fixed slots.

Per model (``Lane``):

- **Slots.** One preallocated ``SlotStates`` (engine.session) holds h [L, S, K] and (LSTM)
  c [L, S, Hp] (the kernels' padded width) for S = ``max_streams`` streams, in one aligned
  buffer of zeroed pages; a stream owns slot s from ``sequence_start`` until its
  ``sequence_end`` (freed at once) or its eviction after ``idle_timeout`` seconds without a
  request. A stream is idle from the moment its last answer has left (``release``), and a
  request still arriving counts as arrived: the front ends register one (``arriving``) from
  its first byte (HTTP, for its model), or for any model while they stop reading a gRPC
  stream whose requests are still being computed, to bound its bytes (given back once none
  is, or when no next request comes within a second of reading again). No sequence of that
  model that was idle for less than the timeout when such a request began is evicted, as it
  may be that request's (a sequence whose next request sat behind a large one on its gRPC
  stream was evicted "after 1.2 s idle"). Such a request, and an answer still being sent,
  postpone an eviction by one more timeout at most: a client that sends or reads slowly
  cannot keep sequences alive, its own or others', for longer. Beyond S live streams a new
  one gets ``Exhausted`` (HTTP 429 / RESOURCE_EXHAUSTED);
  live ones are unaffected. An idle stream costs its slot's bytes and nothing else: only
  streams with a pending request are in the ready queue.
- **A call.** Up to ``max_batch`` ready streams (first come, first served; a stream that still
  has work goes to the back) run together: each contributes the next k_i <= T steps of its
  oldest request, time-major into x [T, N, C]; ``lengths`` = k_i freezes a stream's state after
  its own steps, so streams with fewer pending steps ride along without being advanced. A
  chunk of steps is thus fed step by step in lockstep with the other streams, and one stream's
  steps are never reordered nor put side by side in one batch (it has one row per call).
- **States by slot.** A call passes its slot table (int64 [N]: row n is stream slot[n]; -1
  on padding rows) to ``Session.run_slots``, whose kernels work on the slots themselves
  (kernels.recurrent): before the first step each layer gathers its rows of h_{t-1} from
  their slots into the dense double buffer the step's GEMM reads, a row's last valid step
  (``lengths``) writes its h back to its slot, and c is updated in its slot for the whole
  call. Neither this module nor the Session copies a state in or out of a call (before: h
  and c taken from the slots into contiguous rows, copied into the arena's buffers, and both
  back out the same way: 8 numpy copies per LSTM layer and call); what is left is the
  kernel's own gather of h_{t-1}, N*K elements per layer against N*G*K multiply-adds per
  step. A slot is written only by its own stream's calls (the table's slots are distinct, and
  a stream has one call in flight), and a frozen row's slot is not written at all.
- **Shapes.** ``Session.run_slots`` plans again whenever N or T change (~1-20 ms), so calls come in
  few shapes, each with its own ``Session`` (on the model's weights and the server's shared
  ``Pool``) planned at start-up: N is rounded up to a bucket (4 per octave: <= 25% padding
  rows, lengths 0), and T up to one too (1..8, 10, 12, 14, 16, ...: a 10-step request runs in
  one call, where T rounded down to a power of two took two, 8 + 2, and doubled its latency).
  The padded steps cost next to nothing: no row is live in them, so the input projection
  leaves them out (kernels.gemm.input_projection) and their recurrent GEMMs are skipped
  (kernels.recurrent._live_end).

Adaptive batching (``Scheduler``): whenever the engine is free and streams are ready, they run
now, and everything that arrives during a call is batched into the next one, so the batch grows
with the load by itself. Only when the engine was idle does it wait for company, for at most
``max_wait`` seconds, and only while the running estimate of the gap between arrivals says the
next request should come before that budget ends (at low load it does not wait at all). T, the
steps per call, is chosen from the running per-step time so that a call takes about
``max_call`` seconds (at least one step): a stream that joins waits behind at most that much
of other streams' chunks, while short calls do not multiply the per-call overhead.
"""

from __future__ import annotations

import collections
import copy
import dataclasses
import hashlib
import itertools
import logging
import threading
import time
import weakref

import numpy as np

from ..engine import _check
from ..engine.session import Pool, Session, SlotStates
from ..errors import PlanError, SpecError
from ..graph_model import GraphModel
from ..memory.arena import machine_memory
from ..tuning import bucket  # one rule for the call shapes and the batches tune tries
from .errors import (
    Exhausted,
    InvalidRequest,
    NotFound,
    QueueFull,
    SequenceError,
    ServeError,
    Unavailable,
)

_log = logging.getLogger("leanrnn.serve")

# Evicted sequence ids remembered to tell their next request why (bounded: old ones fall off and
# are then reported as unknown), each by a 64-bit digest (_evicted_key): ids are the clients'
# strings, and 250-character ones held ~720 bytes an entry, 47-103 MiB per model when full.
EVICTED_MEMORY = 65536


def _evicted_key(key) -> int:
    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


def _remember(table: collections.OrderedDict, key, value) -> None:
    """``table[digest of key] = value``, the oldest entry dropped past EVICTED_MEMORY."""
    table[_evicted_key(key)] = value
    if len(table) > EVICTED_MEMORY:
        table.popitem(last=False)


def pow2_floor(n: int) -> int:
    """The largest power of two <= n (n >= 1)."""
    return 1 << (n.bit_length() - 1)


def request_bytes(x, out_width: int, dtype) -> int:
    """Bytes a request holds until it is answered: x [T, C] and its y [T, out_width] of
    ``dtype``. The one count both the --max-queued-bytes check (before the request exists)
    and the running total (``Request.nbytes``) use, so what is checked is what is held."""
    return int(x.nbytes) + x.shape[0] * out_width * np.dtype(dtype).itemsize


class Request:
    """One inference request of one stream: x [T, C] in, y [T, D*K] out, filled step by step."""

    __slots__ = (
        "T",
        "c_out",
        "end",
        "error",
        "finished",
        "h_out",
        "hold",
        "nbytes",
        "on_done",
        "pos",
        "reset",
        "seq",
        "t_done",
        "t_first",
        "t_submit",
        "want_state",
        "x",
        "y",
    )  # fmt: skip

    def __init__(self, x, y, end, want_state, on_done, extra: int = 0, hold: bool = False) -> None:
        self.x, self.y, self.T, self.pos = x, y, x.shape[0], 0
        self.nbytes = request_bytes(x, y.shape[1], y.dtype) + extra
        self.end, self.want_state, self.on_done = end, want_state, on_done
        # hold: its bytes stay counted after the engine is done, until Scheduler.release (the
        # front end calls it once the answer has left); finished: the engine is done with it
        self.hold, self.finished = hold, False
        self.h_out = self.c_out = self.error = None
        self.t_submit = time.monotonic()
        self.t_first: float | None = None  # its first step's engine call began
        self.t_done: float | None = None  # the engine was done with it
        # (h0, c0) a restart puts into its sequence's slot before its first step (Lane.submit)
        self.reset: tuple | None = None
        self.seq = None


def _notify(done: list[Request]) -> None:
    """Call each request's on_done once, and let go of it first: the front end's callback
    holds the future the request becomes the result of, so a request that kept it was in a
    cycle with its own x and y, freed only by a full garbage collection (a server under load
    held 1.4 MiB per finished request, 14x past --max-queued-bytes, until one ran)."""
    for r in done:
        cb, r.on_done = r.on_done, None
        if cb is not None:
            cb(r)


class _Slots:
    """The free state slots of 0..S-1, lowest first, released ones reused first. Holds only
    the released ones: a list of all S (36 bytes a slot) took 3.6 GB and a minute to build
    for --max-streams 100000000, before a single stream came."""

    __slots__ = ("S", "_back", "_next")

    def __init__(self, S: int) -> None:
        self.S, self._next, self._back = S, 0, []

    def __len__(self) -> int:
        return self.S - self._next + len(self._back)

    def pop(self) -> int:
        if self._back:
            return self._back.pop()
        if self._next >= self.S:
            raise IndexError("no free slot")
        self._next += 1
        return self._next - 1

    def append(self, slot: int) -> None:
        self._back.append(slot)


class Sequence:
    __slots__ = (
        "answering", "ending", "inflight", "key", "last", "queue", "released", "slot", "started",
        "steps",
    )  # fmt: skip

    def __init__(self, key, slot: int, now: float) -> None:
        self.key, self.slot, self.last, self.started = key, slot, now, now
        self.queue: collections.deque[Request] = collections.deque()
        self.ending = self.inflight = self.released = False
        self.steps = 0
        self.answering = 0  # held requests whose answers have not left (Scheduler.release)


def _stateless(key) -> bool:
    """Whether ``key`` is a request's own sequence (protocol.sequence: ("", counter)), not
    one a client named."""
    return isinstance(key, tuple) and key[:1] == ("",)


def describe(key) -> str:
    """A sequence id as the user sent it: 42 or 'abc', a long one cut (it goes into errors
    and the eviction log: 250-character ids made a 3 KB log line per eviction)."""
    sid = key[1] if isinstance(key, tuple) else key
    text = repr(sid)
    n = len(sid) if isinstance(sid, str) else len(text)
    return text if len(text) <= 80 else f"{text[:60]}... ({n} characters)"


def stack_of(name: str, model):
    """``model``, or the recurrent stack a graph model is (GraphModel.as_stack: an ONNX export
    of a torch.nn.LSTM and the glue around it); a graph that computes more is refused with
    what more (its other ops are not batched across streams)."""
    if not isinstance(model, GraphModel):
        return model
    try:
        return model.as_stack()
    except SpecError as e:
        raise SpecError(
            f"[serve] model {name!r} is a graph that computes more than a recurrent stack "
            f"({e}); serve batches recurrent stacks only: serve the stack (an ONNX file of it "
            "alone, or its weights as a state dict) and run the graph's other ops in the "
            "client"
        ) from None


class Lane:
    """One model: its state slots, live sequences, ready queue and batched calls. ``model``: a
    leanrnn.LSTM/GRU/RNN, or a graph model that is one (stack_of)."""

    def __init__(self, name: str, model, pool: Pool, *, threads: int | None, max_streams: int,
                 max_batch: int, max_chunk: int, idle_timeout: float,
                 committed: int = 0) -> None:  # fmt: skip
        """``committed``: bytes of state slots and call buffers the server's other lanes,
        made before this one, already hold (the machine's memory must take all of them)."""
        for what, v in (("max_streams", max_streams), ("max_batch", max_batch),
                        ("max_chunk", max_chunk)):  # fmt: skip
            _check.count("serve", what, v)
        if (not isinstance(idle_timeout, int | float) or isinstance(idle_timeout, bool)
                or not idle_timeout > 0):  # fmt: skip
            raise SpecError(f"[serve] idle_timeout={idle_timeout!r}; expected seconds > 0")
        model = stack_of(name, model)
        session = getattr(model, "session", None)
        if not isinstance(session, Session):
            raise SpecError(
                f"[serve] model {name!r} is a {type(model).__name__}; serve batches recurrent "
                "stacks (leanrnn.LSTM/GRU/RNN, a .lrnn saved from one, a PyTorch, "
                ".safetensors or .npz state dict, or an ONNX graph that is only a stack)"
            )
        weights = session.weights
        spec = weights.spec
        if spec.direction != "forward":
            raise SpecError(
                f"[serve] model {name!r} is {spec.direction}: its reverse direction starts from "
                "the last step of the whole sequence, so it cannot stream; serve a forward stack"
            )
        if spec.batch_first:  # the server lays batches out time-major; the weights do not care
            weights = copy.copy(weights)
            weights.spec = dataclasses.replace(spec, batch_first=False)
        self.name, self.weights, self.spec, self.pool = name, weights, weights.spec, pool
        self.dtype = weights.dtype
        self.threads = threads
        self.lstm = spec.cell == "lstm"
        L, K, H, C = spec.num_layers, spec.output_size, spec.hidden_size, spec.input_size
        self.L, self.K, self.H, self.C, self.DK = L, K, H, C, K
        S = self.max_streams = max_streams
        self.max_batch, self.idle_timeout = max_batch, idle_timeout
        self.max_chunk = max_chunk = pow2_floor(max_chunk)
        nb, T = bucket(max_batch), max_chunk
        self.fixed_bytes = self._check_fits(S, nb, T, committed)
        # The state slots: h [L, S, K], c [L, S, Hp]; h_store and c_store view the real units.
        self.states = SlotStates(weights, S)
        self.h_store, self.c_store = self.states.h, self.states.c
        self.free = _Slots(S)
        self.seqs: dict = {}
        self.ready: collections.deque[Sequence] = collections.deque()
        self.evicted: collections.OrderedDict = collections.OrderedDict()
        # Sequences ended because a request of theirs on a gRPC stream was refused (broken):
        # digest -> (when, why), as evicted ones are remembered
        self.broken: collections.OrderedDict = collections.OrderedDict()
        # Call buffers for the largest call; each call uses contiguous leading parts of them.
        self._x = np.zeros(T * nb * C, self.dtype)
        self._y = np.zeros(T * nb * K, self.dtype)
        self._lens = np.zeros(nb, np.int64)
        self._slot = np.full(nb, -1, np.int64)
        self._calls: dict[tuple[int, int], tuple] = {}
        self.step_seconds = 0.0  # running mean of one call's seconds per step
        self.steps = self.calls = self.rows = 0  # stream-steps, engine calls, streams in them
        self.completing = 0  # engine calls that completed a request (Triton's executions)

    def _check_fits(self, S: int, nb: int, T: int, committed: int) -> int:
        """The state slots and call buffers' bytes, by arithmetic, checked before any is
        allocated with the other lanes' (``committed``) against the machine's memory: past
        it numpy said 'out of memory' naming no option, or (below it, with overcommit: the
        slots are zeroed pages, touched as streams fill them) the server started and died
        later (three models of 0.6x the machine each started without a word)."""
        L, K, C, it = self.L, self.K, self.C, self.dtype.itemsize
        state = L * S * (K + (self.weights.Hp if self.lstm else 0)) * it  # as SlotStates
        calls = (T * nb * (C + K)) * it + 16 * nb
        limit = machine_memory()
        if committed + state + calls > limit:
            others = (f", beside the {committed:,} bytes of the models before it"
                      if committed else "")  # fmt: skip
            raise PlanError(
                f"[serve] model {self.name!r}: {S:,} stream slots (--max-streams) hold "
                f"{state:,} bytes of state and calls of {nb:,} streams x {T:,} steps "
                f"(--max-batch, --max-chunk) {calls:,} bytes of buffers{others}; expected "
                f"together at most this machine's {limit:,} bytes ({limit / 2**30:,.1f} GiB): "
                "lower --max-streams (per model), --max-batch or --max-chunk"
            )
        return state + calls

    # ------------------------------------------------------------ the model's tensors
    @property
    def state_shapes(self) -> dict[str, tuple[int, int]]:
        out = {"h": (self.L, self.K)}
        if self.lstm:
            out["c"] = (self.L, self.H)
        return out

    def _call(self, nb: int, T: int) -> tuple:
        """(session, x [T, nb, C], y [T, nb, K], lengths [nb], slot table [nb]) for a call of
        nb rows and T steps: views of the call buffers, and a session of its own so its plan
        stays made."""
        c = self._calls.get((nb, T))
        if c is None:
            K, C = self.K, self.C
            session = Session(self.weights, threads=self.threads, pool=self.pool)
            c = self._calls[(nb, T)] = (
                session,
                self._x[: T * nb * C].reshape(T, nb, C),
                self._y[: T * nb * K].reshape(T, nb, K),
                self._lens[:nb],
                self._slot[:nb],
            )
        return c

    @property
    def shapes(self) -> list[tuple[int, int]]:
        """Every (rows, steps) a call can have, largest first."""
        rows = sorted({bucket(n) for n in range(1, self.max_batch + 1)}, reverse=True)
        steps = sorted(set(bucket(t) for t in range(1, self.max_chunk + 1)), reverse=True)
        return [(nb, T) for nb in rows for T in steps]

    def warm_up(self) -> None:
        """Plan every call shape, the largest first (the shared arena then never grows while
        serving), and run the largest once (the kernels load), on padding rows only (slot -1,
        length 0: no slot is read or written)."""
        for nb, T in self.shapes:
            self._call(nb, T)[0].resize(nb, T)
        nb = bucket(self.max_batch)
        session, x, y, lens, slot = self._call(nb, self.max_chunk)
        lens[:], slot[:] = 0, -1
        session.run_slots(x, self.states, slot, lens, out=y)

    # ------------------------------------------------------------ requests (under the lock)
    def submit(self, key, start: bool, end: bool, x, h0, c0, want_state: bool, on_done,
               now: float, extra: int = 0, hold: bool = False) -> Request:  # fmt: skip
        """Queue ``x`` [T, C] for sequence ``key``; raises (and changes nothing) if it cannot."""
        s = self.seqs.get(key)
        name = self.name
        reset = None
        if start and s is not None and (s.queue or s.inflight):
            # A start on a live id begins a new sequence, as Triton's sequence batcher does (it
            # "terminates the old one early"): the old one's queued steps still run, in order,
            # and then the new one's, in the same slot, its state put there (h0/c0, or zeros)
            # just before its first step. No second slot: a restart is never refused for want
            # of one (at --max-streams it was, and the new sequence's next steps, accepted as
            # the old one's, silently continued it). A start after a queued sequence_end is
            # the same case: the slot is kept rather than freed.
            self._check_state(h0, c0)
            self.states.check(h0, c0, "infer")
            reset = (h0, c0)
            if s.ending:
                s.queue[-1].end = False  # (finish reads it under the lock, as this runs)
                s.ending = False
            self._forget(key)
        elif start:
            # A start on a live id with nothing queued: its slot is free at once, and taken
            # again. Everything that can refuse comes first: a refused start (429) leaves the
            # old sequence as it was.
            old = s
            self._check_state(h0, c0)
            self.states.check(h0, c0, "infer")
            if not self.free and old is None:
                what = (
                    "a request without a sequence_id (a sequence of its own) was not run"
                    if _stateless(key)  # an internal counter: no id the client knows
                    else f"sequence {describe(key)} was not started"
                )
                raise Exhausted(
                    f"[infer] model {name!r} holds {self.max_streams} live streams, the most it "
                    f"takes (--max-streams); {what}; retry later, end idle sequences, or raise "
                    "--max-streams"
                )
            if old is not None:
                self._release(old)
            slot = self.free.pop()
            try:
                self.states.put(slot, h0, c0)
            except BaseException:  # nothing taken: else the slot was gone and the id live
                self.free.append(slot)
                raise
            s = self.seqs[key] = Sequence(key, slot, now)
            self._forget(key)
        else:
            gone = self.broken.get(_evicted_key(key))
            if gone is not None and (s is None or s.ending):
                when, why = gone
                raise SequenceError(
                    f"[infer] sequence {describe(key)} of model {name!r} was ended {now - when:.1f}"
                    f" s ago: a request of it on its stream was refused ({why}), and the steps "
                    "after it would have run without that request's; start it again with "
                    "sequence_start=true"
                )
            if s is None:
                ev = self.evicted.get(_evicted_key(key))
                if ev is not None:
                    idle, when = ev
                    raise SequenceError(
                        f"[infer] sequence {describe(key)} of model {name!r} was evicted "
                        f"{now - when:.1f} s ago after {idle:.1f} s idle (idle timeout "
                        f"{self.idle_timeout:g} s); its state is gone: start it again with "
                        "sequence_start=true"
                    )
                raise SequenceError(
                    f"[infer] sequence {describe(key)} is not live on model {name!r} (never "
                    "started, or already ended); send sequence_start=true on its first request"
                )
            if s.ending:
                raise SequenceError(
                    f"[infer] sequence {describe(key)} of model {name!r} already has a "
                    "sequence_end queued; start a new sequence for more steps"
                )
            if h0 is not None or c0 is not None:
                raise InvalidRequest(
                    f"[infer] initial states (h0/c0) for sequence {describe(key)}, which is "
                    "already live; send them only with sequence_start=true"
                )
        y = np.empty((x.shape[0], self.DK), self.dtype)
        r = Request(x, y, end, want_state, on_done, extra, hold)
        r.seq, r.reset = s, reset
        s.answering += hold
        s.queue.append(r)
        s.last = now
        if end:
            s.ending = True
        if len(s.queue) == 1 and not s.inflight:
            self.ready.append(s)
        return r

    def answer_now(self, x, h0, c0, want_state: bool, on_done, extra: int,
                   hold: bool) -> Request:  # fmt: skip
        """A stateless request of 0 steps (Scheduler.submit), answered without a slot: y [0,
        DK] and, asked, its h0/c0 or zeros as the final states."""
        self._check_state(h0, c0)
        self.states.check(h0, c0, "infer")
        r = Request(x, np.empty((0, self.DK), self.dtype), True, want_state, on_done, extra, hold)
        r.t_first = r.t_submit  # (no queue: its queue time is 0, not negative)
        if want_state:
            LD, K, H, _ = self.states.shape
            r.h_out = np.zeros((LD, K), self.dtype) if h0 is None else np.array(h0)
            if self.lstm:
                r.c_out = np.zeros((LD, H), self.dtype) if c0 is None else np.array(c0)
        return r

    def break_off(self, key, why: str, now: float) -> bool:
        """Under the lock: end live sequence ``key`` after its accepted requests, because a
        later request of it was refused on a stream whose next requests are already sent
        (they would run across the gap, on the state before the refused steps); its next
        request other than a start is refused, saying so. Whether it ended it (not when
        ``key`` is not live, or already ended this way: the first reason stays)."""
        s = self.seqs.get(key)
        if s is None or _evicted_key(key) in self.broken:
            return False
        if s.queue:
            s.queue[-1].end = True  # (finish reads it under the lock, as this runs)
            s.ending = True
        elif not s.inflight:
            self._release(s)
        _remember(self.broken, key, (now, why))
        return True

    def _forget(self, key) -> None:
        """A start: what was remembered of an earlier sequence of ``key`` goes."""
        self.evicted.pop(_evicted_key(key), None)
        self.broken.pop(_evicted_key(key), None)

    def check_x(self, x) -> None:
        """InvalidRequest unless ``x`` is steps of this model: [T, C] of its dtype (T may be 0:
        a request that only ends its sequence, or starts it from h0/c0, and reads its state)."""
        ok = (isinstance(x, np.ndarray) and x.dtype == self.dtype and x.ndim == 2
              and x.shape[1] == self.C)  # fmt: skip
        if not ok:
            what = (f"{x.dtype} {list(x.shape)}" if isinstance(x, np.ndarray)
                    else type(x).__name__)  # fmt: skip
            raise InvalidRequest(f"[infer] x is {what}; model {self.name!r} takes [T, "
                                 f"C={self.C}] {self.dtype}")  # fmt: skip

    def _check_state(self, h0, c0) -> None:
        if c0 is not None and not self.lstm:
            raise InvalidRequest(
                f"[infer] c0 was given but model {self.name!r} is a {self.spec.cell.upper()}, "
                "which has no cell state; send h0 only"
            )

    def reap(self, now: float, arriving: float | None = None) -> list[tuple]:
        """Evict sequences idle longer than the timeout; returns [(key, idle seconds)].
        ``arriving``: when the oldest request that may be for this model began to arrive
        (Scheduler.arriving), None if there is none. Idleness is counted up to then, and up
        to one timeout ago for a sequence whose answer is still being sent, but never to
        earlier than one timeout ago (module docstring)."""
        out = []
        limit = self.idle_timeout
        floor = now - limit
        horizon = now if arriving is None else max(min(now, arriving), floor)
        for key, s in list(self.seqs.items()):
            at = floor if s.answering else horizon
            if not s.queue and not s.inflight and at - s.last > limit:
                idle = now - s.last
                self._release(s)
                _remember(self.evicted, key, (idle, now))
                out.append((key, idle))
        return out

    def _release(self, s: Sequence) -> None:
        """Free ``s``'s slot; by object, not by key: its id may already name a newer sequence."""
        if self.seqs.get(s.key) is s:
            del self.seqs[s.key]
        if not s.released:
            s.released = True
            self.free.append(s.slot)

    # ------------------------------------------------------------ a batched call
    def take(self) -> list[Sequence]:
        """Under the lock: the next batch of ready streams, marked in flight."""
        n = min(len(self.ready), self.max_batch)
        picked = [self.ready.popleft() for _ in range(n)]
        for s in picked:
            s.inflight = True
        return picked

    def run(self, picked: list[Sequence], t_cap: int, now: float) -> tuple[int, int]:
        """Outside the lock: one engine call over ``picked``; returns (the steps it ran, the
        stream-steps). Only the head requests of in-flight sequences are touched, and only
        their x, y and pos, which no other thread changes (a restart's submit may set a head's
        ``end``, which ``finish`` reads, under the lock)."""
        heads = [s.queue[0] for s in picked]
        for s, r in zip(picked, heads, strict=True):
            if r.reset is not None:  # a restart's first step: its state, in the slot it reuses
                self.states.put(s.slot, *r.reset)
                r.reset = None
            if r.t_first is None:
                r.t_first = now
        T = bucket(max(1, min(max(r.T - r.pos for r in heads), t_cap, self.max_chunk)))
        ks = [min(r.T - r.pos, T) for r in heads]
        # Rows longest first: a row whose steps are done leaves the step GEMMs with every row
        # after it (kernels.recurrent._live_end), and so do the padding rows at the end. A
        # request of 0 steps (a sequence_end, or a start with h0/c0, and nothing to run) has
        # no row: it is done once its reset is in its slot.
        rows = sorted((i for i in range(len(picked)) if ks[i]), key=ks.__getitem__, reverse=True)
        n = len(rows)
        if not n:
            return 0, 0
        session, x, y, lens, slot = self._call(bucket(n), T)
        slot[:n] = [picked[i].slot for i in rows]
        slot[n:] = -1  # padding rows (bucket): no slot, never advanced
        lens[:n] = [ks[i] for i in rows]
        lens[n:] = 0
        for j, i in enumerate(rows):
            r, k = heads[i], ks[i]
            p = r.pos
            x[:k, j] = r.x[p : p + k]
            if k < T:
                x[k:, j] = 0  # frozen rows still pass through the input projection
        session.run_slots(x, self.states, slot, lens, out=y)  # the states in place, by slot
        for j, i in enumerate(rows):
            r, k = heads[i], ks[i]
            p = r.pos
            r.y[p : p + k] = y[:k, j]
            r.pos = p + k
        self.calls += 1
        self.rows += n
        # the steps the call ran: its T is rounded up to a bucket, and steps past every row's
        # length are skipped (metrics counted 36 steps a call for requests of 9, 11 and 13)
        return max(ks), sum(ks)

    def finish(self, picked: list[Sequence], now: float, ran: int = 1) -> list[Request]:
        """Under the lock, after ``run`` (which ran ``ran`` steps: 0 for a turn of 0-step
        requests, which counts as no execution): complete finished requests, free ended
        slots, requeue streams with more work. Returns the completed requests."""
        done = []
        for s in picked:
            s.inflight = False
            s.last = now
            r = s.queue[0]
            if r.pos == r.T:
                s.queue.popleft()
                s.steps += r.T
                if r.want_state:
                    r.h_out = self.h_store[:, s.slot].copy()
                    if self.lstm:
                        r.c_out = self.c_store[:, s.slot].copy()
                done.append(r)
                if r.end:
                    self._release(s)
                    continue
            if s.queue:
                self.ready.append(s)
        self.completing += bool(done) and ran > 0
        return done

    def fail(self, picked: list[Sequence], error: BaseException) -> list[Request]:
        """Under the lock: an engine call raised; every request of those streams fails and the
        streams end (their state is unknown)."""
        done = []
        for s in picked:
            s.inflight = False
            for r in s.queue:
                r.error = error
                done.append(r)
            s.queue.clear()
            self._release(s)
        return done


class Scheduler:
    """One thread that runs the batched calls of every lane (the models share one pool, whose
    arena one call uses at a time) and evicts idle streams. ``submit`` is thread-safe.

    ``start()`` starts the thread and ``stop()`` ends it (what is still queued fails: call
    ``drain()`` first); one dropped without ``stop()`` is collected and its thread ends within
    a second (``_drive``). ``with Scheduler(...) as s:`` starts and stops it."""

    def __init__(self, lanes: dict[str, Lane], *, max_wait: float, max_call: float = 0.01,
                 metrics=None, max_queued_bytes: int | None = None) -> None:  # fmt: skip
        self.lanes = lanes
        # Accepted requests hold their x and y until answered (held requests: until their
        # answers have left): a client sending faster than the engine runs, or not reading
        # its answers, must get 429s, not grow the server's memory without bound.
        self.max_queued_bytes = max_queued_bytes
        self.queued_bytes = 0
        self.max_wait = max_wait
        self.max_call = max_call
        self.metrics = metrics
        self.cond = threading.Condition()
        self._order = list(lanes.values())
        self._rr = 0
        self._gap = float("inf")  # running mean of the seconds between arrivals
        self._last_arrival: float | None = None
        self._accepting = True
        self._stop = False
        self._inflight = 0
        self._arriving: dict[int, tuple] = {}  # token -> (when, model or None) (arriving)
        self._tokens = itertools.count()
        self._reap_every = min(1.0, max(0.01, min(ln.idle_timeout for ln in self._order) / 4))
        self._next_reap = time.monotonic() + self._reap_every
        self._was_idle = True  # the engine had no work before this turn (max_wait applies)
        self._thread = threading.Thread(target=_drive, args=(weakref.ref(self), self.cond),
                                        name="leanrnn-scheduler", daemon=True)  # fmt: skip

    def start(self) -> None:
        self._thread.start()

    def __enter__(self) -> Scheduler:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop()

    # ---------------------------------------------------------------- submitting
    def submit(self, model: str, key, start: bool, end: bool, x, h0=None, c0=None,
               want_state: bool = False, on_done=None, extra: int = 0,
               hold: bool = False) -> Request:  # fmt: skip
        """Queue a request; it counts ``request_bytes`` + ``extra`` (what its answer takes
        beyond y, e.g. as JSON) against --max-queued-bytes until the engine is done with it,
        or with ``hold`` until ``release(request)`` as well (its answer has left). ``x`` is
        checked here, before it can share an engine call: the front ends check requests
        first, but one embedding the scheduler that passed a wrong x failed the other streams
        of its call, and ended their sequences."""
        lane = self.lanes.get(model)
        if lane is None:
            raise NotFound(f"[infer] no model {model!r}; this scheduler runs {sorted(self.lanes)}")
        lane.check_x(x)
        with self.cond:
            if not self._accepting:
                raise Unavailable("[infer] the server is shutting down; send new work elsewhere")
            now = time.monotonic()
            limit = self.max_queued_bytes
            if limit is not None:
                cost = request_bytes(x, lane.DK, lane.dtype) + extra
                # (one request alone always goes: a limit below it must not wedge the server)
                if self.queued_bytes and self.queued_bytes + cost > limit:
                    raise QueueFull(
                        f"[infer] {self.queued_bytes} bytes of accepted requests are waiting "
                        "for the engine or for their clients to read the answers, and this one "
                        f"({int(cost)} B) would pass the server's "
                        f"limit of {limit} (--max-queued-bytes); retry later or send less at once"
                    )
            if _stateless(key) and not x.shape[0]:
                # a stateless request of 0 steps: its answer is its h0/c0 (or zeros), with no
                # slot and no engine call (it took a slot: at --max-streams a flood of them
                # turned new sequences away)
                r = lane.answer_now(x, h0, c0, want_state, on_done, extra, hold)
                self.queued_bytes += r.nbytes
                self._done([r])
                answered = [r]
            else:
                r = lane.submit(key, start, end, x, h0, c0, want_state, on_done, now, extra,
                                hold)  # fmt: skip
                self.queued_bytes += r.nbytes
                answered = []
            if self._last_arrival is not None:
                gap = now - self._last_arrival
                self._gap = gap if self._gap == float("inf") else 0.9 * self._gap + 0.1 * gap
            self._last_arrival = now
            if self.metrics is not None:
                self.metrics.active(lane.name, len(lane.seqs))
            self.cond.notify()
        _notify(answered)  # (outside the lock, as every answer)
        return r

    def break_off(self, model: str, key, error: ServeError) -> None:
        """End sequence ``key`` of ``model`` after its accepted requests (Lane.break_off),
        ``error`` having refused a request of it on a stream. Not for a refusal about the
        sequence itself (SequenceError: it says so to every request) or the server stopping."""
        lane = self.lanes.get(model)
        if lane is None or _stateless(key) or isinstance(error, SequenceError | Unavailable):
            return
        why = _why(error)
        with self.cond:
            if not lane.break_off(key, why, time.monotonic()):
                return
            live = len(lane.seqs)
        _log.info("sequence ended", extra={"fields": {"model": model, "sequence": describe(key),
                                                      "why": why}})  # fmt: skip
        if self.metrics is not None:
            self.metrics.active(model, live)

    def reserve(self, n: int, mine: int = 0) -> None:
        """Count ``n`` more bytes of a request body being read, which holds ``mine`` already,
        against --max-queued-bytes (QueueFull past it, unless nothing but this body counts: a
        request alone always goes, as in submit): clients that send most of a large body and
        stall held it outside every limit (8 of 48 MiB grew the server by 400 MiB under a 16
        MiB limit). ``unreserve`` them once the request is parsed, or dropped."""
        with self.cond:
            limit = self.max_queued_bytes
            others = self.queued_bytes - mine
            if limit is not None and others and self.queued_bytes + n > limit:
                raise QueueFull(
                    f"[infer] {self.queued_bytes} bytes of requests being read or waiting for "
                    f"the engine or their clients, and this body's next {n} B would pass the "
                    f"server's limit of {limit} (--max-queued-bytes); retry later"
                )
            self.queued_bytes += n

    def unreserve(self, n: int) -> None:
        with self.cond:
            self.queued_bytes -= n

    def release(self, r: Request) -> None:
        """The answer of held request ``r`` has left (or never will): its bytes stop counting,
        now if the engine is done with it, else when it is. Safe to call more than once."""
        with self.cond:
            if r.hold:
                r.hold = False
                if r.finished:
                    self.queued_bytes -= r.nbytes
                if r.seq is not None:
                    # its stream is idle from now: the time its answer took to reach a slow
                    # reader is not the client's (its next request waits for this answer)
                    r.seq.answering -= 1
                    r.seq.last = max(r.seq.last, time.monotonic())

    def arriving(self, model: str | None = None) -> int:
        """Register a request for ``model`` (None: any model) that is arriving (its body still
        coming, or unread behind a large one) as of now; ``arrived(token)`` once it has been
        submitted, has failed or turned out not to be there. Until then no sequence of that
        model that was not past the idle timeout at this moment is evicted (it may be this
        request's), for one more timeout at most (Lane.reap)."""
        with self.cond:
            token = next(self._tokens)
            self._arriving[token] = (time.monotonic(), model)
            return token

    def arrived(self, token: int | None) -> None:
        if token is not None:
            with self.cond:
                self._arriving.pop(token, None)

    def _done(self, done: list[Request]) -> None:
        """Under the lock: the engine is done with ``done``; the bytes of those not held go."""
        now = time.monotonic()
        for r in done:
            r.finished = True
            r.t_done = now
            if not r.hold:
                self.queued_bytes -= r.nbytes

    def live(self, model: str) -> int:
        with self.cond:
            return len(self.lanes[model].seqs)

    def pending(self) -> int:
        with self.cond:
            return self._pending()

    def _pending(self) -> int:
        return self._inflight + sum(len(ln.ready) for ln in self._order)

    # ---------------------------------------------------------------- stopping
    def drain(self, timeout: float) -> bool:
        """Refuse new work, finish what was accepted (up to ``timeout`` s). True if all done."""
        deadline = time.monotonic() + timeout
        with self.cond:
            self._accepting = False
            self.cond.notify_all()
            while self._pending():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self.cond.wait(min(left, 0.05))
        return True

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        if self._thread.is_alive():  # (join raised on a scheduler never started)
            self._thread.join(timeout=5)

    # ---------------------------------------------------------------- the loop
    def _ready_count(self) -> int:
        return sum(len(ln.ready) for ln in self._order)

    def _reap(self, now: float) -> None:
        if now < self._next_reap:
            return
        self._next_reap = now + self._reap_every
        arriving = list(self._arriving.values())  # (under the lock)
        for lane in self._order:
            since = min((t for t, m in arriving if m is None or m == lane.name), default=None)
            gone = lane.reap(now, since)
            for key, idle in gone:
                fields = {"model": lane.name, "sequence": describe(key), "idle_s": round(idle, 3)}
                _log.info("evict", extra={"fields": fields})
            if gone and self.metrics is not None:
                self.metrics.evicted(lane.name, len(gone))
                self.metrics.active(lane.name, len(lane.seqs))

    def _next_lane(self) -> Lane | None:
        k = len(self._order)
        for i in range(k):
            lane = self._order[(self._rr + i) % k]
            if lane.ready:
                self._rr = (self._rr + i + 1) % k
                return lane
        return None

    def _idle(self) -> float | None:
        """Under the lock, before a turn: evict what has idled out; None when there is work
        to run (or, stopping, to fail), else the seconds to wait for it (0: stopped, end)."""
        self._reap(time.monotonic())
        if self._ready_count():
            return None
        self._was_idle = True
        return 0.0 if self._stop else self._reap_every

    def _turn(self) -> bool:
        """One batched engine call of the next lane with ready work (after waiting up to
        max_wait for company when the engine was idle); False when stopping ended the loop."""
        cond = self.cond
        with cond:
            stopping = self._stop
            if stopping:
                # stop() after the grace period: what was not run by now fails, at once
                done = self._abandon()
                cond.notify_all()
            elif self._was_idle and self.max_wait > 0:
                # The engine was idle: wait for company while the next arrival is expected
                # within the budget (never at low load, where the gap is long).
                deadline = time.monotonic() + self.max_wait
                while True:
                    left = deadline - time.monotonic()
                    ready = max(len(ln.ready) for ln in self._order)
                    full = ready >= min(ln.max_batch for ln in self._order)
                    if full or left <= 0 or self._gap > left or self._stop:
                        break
                    cond.wait(left)
            if not stopping:
                lane = self._next_lane()
                if lane is None:
                    return True
                picked = lane.take()
                self._inflight += len(picked)
        if stopping:
            _notify(done)  # outside the lock, as every answer
            return False
        self._was_idle = False
        t_cap = lane.max_chunk
        if lane.step_seconds > 0:
            t_cap = max(1, min(lane.max_chunk, int(self.max_call / lane.step_seconds)))
        t0 = time.monotonic()
        rows0 = lane.rows
        try:
            ran, steps = lane.run(picked, t_cap, t0)
            error = None
        except Exception as e:  # an engine failure: those requests fail, the server lives
            _log.exception("engine call failed", extra={"fields": {"model": lane.name}})
            # (logged: its traceback held Lane.run's frame, and so the batch's requests,
            # in a cycle with the requests that keep the error)
            error = e.with_traceback(None)
        t1 = time.monotonic()
        with cond:
            self._inflight -= len(picked)
            if error is None:
                done = lane.finish(picked, t1, ran)
            else:
                done = lane.fail(picked, error)
            self._done(done)
            if not self._pending():
                cond.notify_all()  # drain() waits for this
            live = len(lane.seqs)
        if self.metrics is not None:  # (a turn of 0-step requests ends sequences too)
            self.metrics.active(lane.name, live)
        if error is None and ran:  # (ran 0: only requests of 0 steps, no engine call)
            per_step = (t1 - t0) / ran
            lane.step_seconds = (
                per_step if lane.step_seconds == 0 else 0.8 * lane.step_seconds + 0.2 * per_step
            )
            lane.steps += steps
            if self.metrics is not None:
                # (the streams with rows: a 0-step request beside them had none)
                self.metrics.call(lane.name, lane.rows - rows0, ran, t1 - t0, steps, done, live)
        _notify(done)
        return True

    def _abandon(self) -> list[Request]:
        """Under the lock, when stopping: fail every queued request (none is in flight)."""
        done = []
        for lane in self._order:
            picked = list(lane.ready)
            lane.ready.clear()
            err = Unavailable(
                f"[infer] model {lane.name!r}: the server stopped (its --grace period ran out) "
                "before this request ran; its sequence is gone: start it again on a running "
                "server"
            )
            done += lane.fail(picked, err)
        self._done(done)
        return done


def _why(error: ServeError) -> str:
    """A refusal in a few words, for the message of a sequence it ended."""
    if isinstance(error, QueueFull) or "--max-queued-bytes" in str(error):
        return "the server's queue was full (--max-queued-bytes)"
    text = str(error).removeprefix("[infer] ").removeprefix("[stream] ")
    return f"{error.kind}: {text[:100]}{'...' if len(text) > 100 else ''}"


def _drive(ref: weakref.ref, cond: threading.Condition) -> None:
    """The scheduler's thread. It holds the scheduler only for a turn (``Scheduler._turn``);
    waiting for work, only a weak reference, so a scheduler dropped without ``stop()`` is
    collected, its models with it, and this thread ends within a reap interval (it lived as
    long as the process). A turn's batch is let go with its frame: a loop frame holding it
    kept the last batch's requests, x and y included, for as long as the server stayed idle."""
    while True:
        with cond:  # held from the look to the wait: no submit's notify falls between
            s = ref()
            if s is None:
                return
            wait = s._idle()
            del s
            if wait == 0.0:
                return
            if wait is not None:
                cond.wait(wait)
                continue
        s = ref()
        if s is None or not s._turn():
            return
        del s
