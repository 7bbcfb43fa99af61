"""Stream: feed a sequence chunk by chunk (down to one step per call) with every layer's state
carried between calls, in the session's arena; nothing grows with the number of steps fed.
Single steps of x [N, C] run a program bound once (Session._step_program) after the first."""

from __future__ import annotations

import contextlib

import numpy as np

from ..errors import DTypeError, LeanRNNError, ShapeError, SpecError
from ..memory.arena import check_fits
from . import _check, _fork
from ._turn import Turn, unpicklable


class Stream:
    """Created by ``Session.stream(batch)``. ``feed`` equals one long ``run`` over the
    concatenated chunks, whatever the chunking, to float rounding: the input projection's rows
    are blocked by the chunk, and one sample's single steps take the GEMV, which sums in
    another order than the batch's tile, so the last bits may differ — up to ~4e-7 in float32
    over a 3-layer stack and 1000 steps at batch 1 (both within ~1e-6 of torch). A feed
    changes the carried state all at once or, interrupted, not at all. Feeds, state reads and
    writes and resets take turns (a Stream's own lock): the state read by one thread while
    another feeds is that of a whole number of feeds, never half of one (it tore across layers).

    >>> s = session.stream(batch=1)
    >>> y = s.feed(x_chunk)            # [Tc, N, C] -> [Tc, N, K]; or [N, C] -> [N, K] (one step)
    >>> saved = s.state; s.reset(0); s.state = saved
    """

    def __init__(self, session, batch: int) -> None:
        if not hasattr(session, "_step_program"):  # Stream(model, 2): every feed then failed
            inner = getattr(session, "session", None)  # on a missing Session method
            if not hasattr(inner, "_step_program"):
                raise SpecError(f"[Stream] got {type(session).__name__}; expected a leanrnn "
                                "Session or recurrent model (model.stream(batch) makes one)")  # fmt: skip
            session = inner
        spec = session.spec
        if spec.direction != "forward":
            raise SpecError(
                f"[Session.stream] a {spec.direction} stack cannot stream: its reverse direction "
                "starts from the last step of the whole sequence; use run() on full sequences"
            )
        if not isinstance(batch, int | np.integer) or isinstance(batch, bool) or batch < 1:
            raise ShapeError(f"[Session.stream] batch={batch!r}; expected a positive int")
        self.session = session
        self._batch = int(batch)
        L, K, H, dt = spec.num_layers, spec.output_size, spec.hidden_size, session.dtype
        # h and c are views of one buffer, and a chunk's final states go to a second one,
        # copied over the first in one call once the whole chunk has run: updated in place, an
        # interrupted chunk (KeyboardInterrupt) left some layers advanced and others not
        Hc = H if spec.cell == "lstm" else 0
        # both, sized by the batch asked for: refused by arithmetic, by name
        check_fits(2 * L * self.batch * (K + Hc) * dt.itemsize,
                   f"the state of a stream of batch={self.batch}", "Session.stream")  # fmt: skip
        self._hc, self._h, self._c = _state(L, self._batch, K, Hc, dt)
        self._next = _state(L, self.batch, K, Hc, dt)  # (buffer, h, c): a chunk's final states
        self.steps = 0  # steps fed since creation or the last full reset
        # A single step bound once (Session._step_program), made after the first step that
        # took the general path; it runs while x and out fit it, else the general path does.
        self._step = None
        self._yshape = (self.batch, K)
        self._turn = _stream_turn()
        _fork.renew_lock(self, "_turn", make=_stream_turn)

    @property
    def batch(self) -> int:
        """The sequences this stream carries, fixed when it is opened (its state buffers are
        sized by it: a batch set afterwards ran the kernels past them)."""
        return self._batch

    @batch.setter
    def batch(self, value) -> None:
        raise AttributeError(f"[Stream] batch is fixed at {self._batch} when a stream is opened; "
                             f"open another (model.stream({value!r})) and copy the samples' "
                             "states across through .state")  # fmt: skip

    __reduce__ = unpicklable("Stream", "checkpoint it with saved = stream.state and restore "
                             "into a new stream with new.state = saved")  # fmt: skip

    def feed(self, x, lengths=None, out=None) -> np.ndarray:
        """Run the next chunk. ``x``: [Tc, N, C] ([N, Tc, C] batch-first) or [N, C] for one
        step; ``lengths``: valid steps of each sample in this chunk (a sample's state freezes
        after them). ``out``: optional preallocated y. Returns y for the chunk."""
        turn = self._turn
        if turn._is_owned():  # (a signal handler's feed inside this stream's feed)
            turn.refuse()
        with turn:  # (the C lock's own enter: the single step's ~1.5 us pays ~0.2 for it)
            step = self._step
            if step is not None and lengths is None:
                # One step, x [N, C] and out [N, K] as it was bound for: no checks but the
                # native module's few, no copies in Python. Anything else (a wrong dtype or
                # shape, out overlapping x, a re-planned session...) declines and goes the
                # general way, which raises the same errors as ever.
                y = np.empty(self._yshape, self._h.dtype) if out is None else out
                if self.session._step(step, x, y):
                    self.steps += 1
                    return y
            return self._feed_general(x, lengths, out)

    def _feed_general(self, x, lengths, out) -> np.ndarray:
        try:
            return self._feed(x, lengths, out)
        except LeanRNNError as e:
            err = e
        # in the caller's terms, if that is what is wrong (outside the except: the traceback
        # then does not show the internal [1, N, C] message it replaces)
        self._explain(x, out)
        raise err

    def _feed(self, x, lengths, out) -> np.ndarray:
        """feed() through Session._run: a single step as a chunk of one."""
        single = isinstance(x, np.ndarray) and x.ndim == 2
        if single:
            x = x[None] if not self.session.spec.batch_first else x[:, None]
        if isinstance(x, np.ndarray) and x.ndim == 3:
            n = x.shape[0] if self.session.spec.batch_first else x.shape[1]
            if n != self.batch:
                raise ShapeError(
                    f"[Stream.feed] x has batch {n}; this stream was opened for batch={self.batch}"
                )
        if out is not None:
            # run() trusts what a Stream passes: the state arrays are its own, y is checked here
            _check.disjoint("Stream.feed", (("y", out),), (("x", x), ("lengths", lengths)))
            if single:
                out = out[None] if not self.session.spec.batch_first else out[:, None]
        if out is None and isinstance(x, np.ndarray) and x.ndim == 3:
            spec = self.session.spec
            out = np.empty((*x.shape[:2], spec.num_directions * spec.output_size), self._h.dtype)
        # The carried state goes in; the final states come out into the second buffer, which
        # replaces it in one copy once the chunk has run (all or nothing: see __init__).
        buf, h_next, c_next = self._next
        outs = (out, h_next) if self._c is None else (out, h_next, c_next)
        y, _, _ = self.session._run(x, self._h, self._c, lengths, outs, True, True, "Stream.feed")
        np.copyto(self._hc, buf)
        self.steps += x.shape[1] if self.session.spec.batch_first else x.shape[0]
        if single:
            if lengths is None:  # the session is now planned for one step: bind it
                self._step = self.session._step_program(self._step, self.batch, self._h, self._c)
            return y[0] if not self.session.spec.batch_first else y[:, 0]
        return y

    def _explain(self, x, out) -> None:
        """On feed's error path: raise what is wrong with ``x`` or ``out`` as the caller passed
        them — x [N, C] for one step, not the [1, N, C] chunk it runs as, with its own strides —
        if that is what is wrong; else return (feed re-raises the error it got)."""
        op, dt, spec, N = "Stream.feed", self._h.dtype, self.session.spec, self.batch
        C, DK, bf = spec.input_size, spec.num_directions * spec.output_size, spec.batch_first
        if not isinstance(x, np.ndarray) or x.ndim not in (2, 3):
            chunk = f"[N={N}, T, C={C}]" if bf else f"[T, N={N}, C={C}]"
            want = f"expected [N={N}, C={C}] (one step) or {chunk} (a chunk of T steps)"
            if not isinstance(x, np.ndarray):
                raise DTypeError(f"[{op}] x is a {type(x).__name__}; {want}, a numpy.ndarray "
                                 f"of {dt}")  # fmt: skip
            raise ShapeError(f"[{op}] x has shape {tuple(x.shape)}; {want}")
        if x.ndim == 2:
            _check.array(op, "x", x, dt, (None, C), (f"N={N}", "C"))
            if x.shape[0] != N:
                raise ShapeError(f"[{op}] x has batch {x.shape[0]} (shape {x.shape}); this "
                                 f"stream was opened for batch={N}: expected [N={N}, C={C}]")  # fmt: skip
            _check.contiguous(op, "x", x)
            yshape, names = (N, DK), ("N", "D*K")
        elif x.dtype != dt or x.shape[2] != C or x.shape[0 if bf else 1] != N:
            return  # the chunk's own error (Session._run's, or feed's batch) says it
        else:
            T = x.shape[1] if bf else x.shape[0]
            yshape = (N, T, DK) if bf else (T, N, DK)
            names = ("N", "T", "D*K") if bf else ("T", "N", "D*K")
        if out is not None:
            _check.array(op, "out", out, dt, yshape, names)
            _check.writable(op, "out", out)

    @property
    def state(self) -> tuple[np.ndarray, np.ndarray | None]:
        """(h [L, N, K], c [L, N, H] or None): a copy, safe to keep as a checkpoint. Read in
        a signal handler that interrupted a feed on this thread, it is the state of a whole
        number of feeds, before that one or after it, never half of one (a feed changes it in
        one C call)."""
        with contextlib.nullcontext() if self._turn._is_owned() else self._turn:
            return self._h.copy(), (self._c.copy() if self._c is not None else None)

    @state.setter
    def state(self, value) -> None:
        if not isinstance(value, tuple | list) or len(value) != 2:
            raise ShapeError(f"[Stream.state] got a {type(value).__name__}; expected (h, c) as "
                             "Stream.state returns it (c None for GRU/RNN)")  # fmt: skip
        h, c = value
        dt = self.session.dtype
        # every array checked before any is written: a refused assignment changes nothing
        _check.array("Stream.state", "h", h, dt, self._h.shape, ("L", "N", "K"))
        if self._c is not None:
            _check.array("Stream.state", "c", c, dt, self._c.shape, ("L", "N", "H"))
        elif c is not None:  # a GRU/RNN state has no c: a given one was silently dropped
            raise ShapeError(
                f"[Stream.state] got a c for a {self.session.spec.cell.upper()} stream, which "
                "has none; expected (h, None) as Stream.state returns it"
            )
        with self._changing("Stream.state"):
            self._h[:] = h
            if self._c is not None:
                self._c[:] = c

    def reset(self, i: int | None = None) -> None:
        """Zero the state of sample ``i`` (a new sequence starts in that slot), or of all."""
        with self._changing("Stream.reset"):
            self._reset(i)

    def _changing(self, op: str):
        """The stream's turn, to change its state; refused on the thread feeding it (a signal
        handler inside a feed, whose end would overwrite the change)."""
        if self._turn._is_owned():
            raise LeanRNNError(f"[{op}] called while this stream's feed is in progress on this "
                               "thread (a signal handler's, or a callback's): the feed's end "
                               "would overwrite it; change the state after the feed returns")  # fmt: skip
        return self._turn

    def _reset(self, i: int | None) -> None:
        if i is None:
            self._h[:] = 0
            if self._c is not None:
                self._c[:] = 0
            self.steps = 0
            return
        if (
            not isinstance(i, int | np.integer)
            or isinstance(i, bool)
            or not -self.batch <= i < self.batch
        ):
            raise ShapeError(f"[Stream.reset] sample {i!r}; expected an int in -{self.batch}.."
                             f"{self.batch - 1} (a slot of this batch={self.batch} stream) or None "
                             "(all)")  # fmt: skip
        self._h[:, i] = 0
        if self._c is not None:
            self._c[:, i] = 0


def _stream_turn() -> Turn:
    return Turn("Stream")


def _state(L: int, N: int, K: int, H: int, dtype) -> tuple:
    """(buffer, h [L, N, K], c [L, N, H] or None for H=0): a stream's state in one buffer, so
    that one copy moves all of it."""
    buf = np.zeros(L * N * (K + H), dtype)
    h = buf[: L * N * K].reshape(L, N, K)
    return buf, h, (buf[L * N * K :].reshape(L, N, H) if H else None)
