"""Length-aware batching on one Session: a window of sequences is sorted by length and cut into
batches whose members have similar lengths (little padding), run, and the scores put back in
the window's order.

Semantics are the engine's (PyTorch packed sequences): a sequence's final state comes from its
last valid step; a length-0 sequence gets zero states and no steps (it never reaches the
engine, which needs T >= 1).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np

from .. import tuning
from ..engine import Session
from ..errors import SpecError
from .data import ROW_OBJECT_BYTES
from .writers import Results

OUTPUTS = ("final", "steps", "both")
# Most padding a length-sorted batch may carry before it is cut short (see Scorer.batches).
MAX_PADDING = 0.15
# Input read per piece, as a share of the read-ahead window (a window holds several pieces, so
# sorting by length has sequences from more than one piece to choose from).
PIECES_PER_WINDOW = 4


def engine_model(model, op: str = "score"):
    """The recurrent Model inside ``model`` (a leanrnn LSTM/GRU/RNN/Model), or a clear error."""
    from ..graph_model import GraphModel
    from ..nn import Model

    if isinstance(model, Model):
        return model
    if isinstance(model, GraphModel):
        raise SpecError(
            f"[{op}] the model is a GraphModel (an ONNX graph): graphs take no per-sequence "
            "lengths, so variable-length batches cannot be scored exactly; score the recurrent "
            "stack itself (export or load its state dict as a leanrnn LSTM/GRU/RNN), or run "
            "the graph per sequence with GraphModel.run"
        )
    raise SpecError(f"[{op}] got a {type(model).__name__}; expected a leanrnn Model (LSTM/GRU/RNN)")


@dataclass
class Counters:
    sequences: int = 0
    steps: int = 0  # valid steps run
    padded: int = 0  # steps run including padding (batch x longest, per batch)
    padded_in_order: int = 0  # what batches in input order would have run (same batch size)
    batches: int = 0


class Scorer:
    """Scores windows of sequences on one model.

    outputs: 'final' (h_n, and c_n for LSTM), 'steps' (y) or 'both'; bucket: sort each window
    by length (False: batches in input order, padded to their longest; for comparison).
    """

    def __init__(self, model, outputs: str = "final", memory_limit: int | None = None,
                 threads: int | None = None, batch_size: int | None = None,
                 bucket: bool = True) -> None:  # fmt: skip
        m = engine_model(model)
        if outputs not in OUTPUTS:
            raise SpecError(f"[score] outputs={outputs!r}; expected one of {OUTPUTS}")
        self.spec, self.dtype = m.spec, m.dtype
        self.final = outputs in ("final", "both")
        self.steps = outputs in ("steps", "both")
        self.bucket = bucket
        self.session = Session(m.weights, threads=threads)
        self.tuning = tuning.choose(
            self.session, memory_limit=memory_limit, per_step=self.steps, batch=batch_size,
            threads=threads,
        )  # fmt: skip
        self.session.chunk = self.tuning.chunk
        self.session.threads = self.tuning.threads
        s = self.spec
        self.LD, self.K, self.H = s.num_layers * s.num_directions, s.output_size, s.hidden_size
        self.DK, self.C = s.num_directions * s.output_size, s.input_size
        self.lstm = s.cell == "lstm"
        self._bufs: dict[str, np.ndarray] = {}
        self.counters = Counters()

    def _buf(self, name: str, size: int) -> np.ndarray:
        """The first ``size`` elements of a padded batch buffer, grown as batches need (their
        size is bounded by tuning.batch_bytes through batch_for)."""
        b = self._bufs.get(name)
        if b is None or b.size < size:
            self._bufs.pop(name, None)
            b = self._bufs[name] = np.empty(size, self.dtype)
        return b[:size]

    def empty(self) -> Results:
        return self._alloc(np.zeros(0, np.int64))

    def _alloc(self, lengths: np.ndarray) -> Results:
        n, dt = len(lengths), self.dtype
        h = np.zeros((n, self.LD, self.K), dt) if self.final else None
        c = np.zeros((n, self.LD, self.H), dt) if self.final and self.lstm else None
        y = off = None
        if self.steps:
            off = np.zeros(n + 1, np.int64)
            np.cumsum(lengths, out=off[1:])
            y = np.empty((int(off[-1]), self.DK), dt)
        return Results(lengths, h, c, y, off)

    def batches(self, lengths: np.ndarray) -> list[np.ndarray]:
        """Index arrays (into the window) of the batches to run, length-0 sequences left out."""
        order = np.argsort(lengths, kind="stable") if self.bucket else np.arange(len(lengths))
        order = order[lengths[order] > 0]
        out, i = [], 0
        while i < len(order):
            n = self.tuning.batch
            # Shrink until the padded buffers of this batch fit (the longest decides).
            while True:
                idx = order[i : i + n]
                T = int(lengths[idx].max())
                fit = self.tuning.batch_for(T)
                if fit >= len(idx):
                    break
                n = fit
            if self.bucket and len(idx) > 1:
                # Log-normal tails: the last batches of a window span wide length ranges;
                # cut a batch where it would pad more than MAX_PADDING (a smaller batch wastes
                # less than padding does).
                lens = lengths[idx]
                k = np.arange(1, len(idx) + 1)
                pad = 1.0 - np.cumsum(lens) / (k * lens)
                idx = idx[: int(np.nonzero(pad <= MAX_PADDING)[0][-1]) + 1]
            # longest first: a row whose sequence has ended leaves the step GEMMs with every
            # row after it (kernels.recurrent._live_end), so the padding costs no recurrence
            out.append(idx[::-1] if self.bucket else idx)
            i += len(idx)
        return out

    @property
    def piece_bytes(self) -> int:
        """Bytes of input to read per piece (see PIECES_PER_WINDOW)."""
        return max(1, self.tuning.window_bytes // PIECES_PER_WINDOW)

    @property
    def row_cost(self) -> int:
        """Bytes a sequence costs a piece and its window beyond its values: its objects, and
        its final states when they are scored."""
        return ROW_OBJECT_BYTES + self._final_bytes

    @property
    def _final_bytes(self) -> int:
        return (self.LD * (self.K + self.H)) * self.dtype.itemsize if self.final else 0

    def windows(self, pieces: Iterable) -> Iterator[Results]:
        """Scores of the sequences of ``pieces`` (leanrnn.score.data.Piece: .seqs, .nbytes), one
        Results per read-ahead window, in input order. A window closes once the pieces it holds
        and the outputs it will produce reach tuning.window_bytes: the local path and each Ray
        actor run this same loop."""
        row_cost = self.row_cost
        step_out = self.DK * self.dtype.itemsize if self.steps else 0
        window, held = [], 0
        for piece in pieces:
            held += piece.nbytes
            for s in piece.seqs:
                window.append(s)
                held += row_cost + len(s) * step_out
            if held >= self.tuning.window_bytes:
                yield self.score(window)
                window, held = [], 0
        if window:
            yield self.score(window)

    def score(self, seqs: list[np.ndarray]) -> Results:
        """Scores of ``seqs`` ([T_i, C] arrays of the model's dtype), in their order."""
        lengths = np.fromiter((len(s) for s in seqs), np.int64, len(seqs))
        r = self._alloc(lengths)
        cnt = self.counters
        cnt.sequences += len(seqs)
        cnt.steps += int(lengths.sum())
        B, nz = self.tuning.batch, lengths[lengths > 0]
        for b0 in range(0, len(nz), B):  # what batches in input order would pad, for the summary
            part = nz[b0 : b0 + B]
            cnt.padded_in_order += int(part.max()) * len(part)
        bf = self.spec.batch_first
        for idx in self.batches(lengths):
            n = len(idx)
            lens = lengths[idx]
            T = int(lens.max())
            cnt.padded += T * n
            cnt.batches += 1
            xs = (n, T, self.C) if bf else (T, n, self.C)
            x = self._buf("x", T * n * self.C).reshape(xs)
            x.fill(0)
            for j, i in enumerate(idx):
                t = lens[j]
                if bf:
                    x[j, :t] = seqs[i]
                else:
                    x[:t, j] = seqs[i]
            h = np.empty((self.LD, n, self.K), self.dtype)
            c = np.empty((self.LD, n, self.H), self.dtype) if self.lstm else None
            if self.steps:
                ys = (n, T, self.DK) if bf else (T, n, self.DK)
                y = self._buf("y", T * n * self.DK).reshape(ys)
                out = (y, h, c) if self.lstm else (y, h)
            else:
                y = None
                out = (h, c) if self.lstm else (h,)
            self.session.run(x, lengths=lens, out=out, return_sequences=self.steps)
            if self.final:
                r.h_n[idx] = h.transpose(1, 0, 2)
                if self.lstm:
                    r.c_n[idx] = c.transpose(1, 0, 2)
            if self.steps:
                off = r.y_off
                for j, i in enumerate(idx):
                    t = lens[j]
                    r.y_flat[off[i] : off[i] + t] = y[j, :t] if bf else y[:t, j]
        return r
