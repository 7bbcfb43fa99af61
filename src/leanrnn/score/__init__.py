"""Batch scoring (``leanrnn score``): a dataset of variable-length sequences through a model, to
a file of final states and/or per-step outputs in the input's order, streaming in pieces.

Layers: data (readers) -> batching (length-aware batches on one engine Session, sized by
leanrnn.tuning) -> writers; ``leanrnn.ray`` runs the same batching inside Ray Data actors.
"""

from __future__ import annotations

import os
import resource
import sys
import time
from dataclasses import dataclass

import numpy as np

from ..engine._check import bytes_or_none, count_or_none
from .batching import OUTPUTS, Scorer, engine_model
from .data import DataError, Options, Source
from .writers import open_output

__all__ = ["OUTPUTS", "DataError", "ScoreSummary", "score"]


@dataclass
class ScoreSummary:
    """What a score run did. padding: share of the steps run that were padding;
    padding_in_order: the same had batches been taken in input order (same batch size)."""

    output: str
    sequences: int
    steps: int
    seconds: float
    padding: float
    padding_in_order: float
    peak_rss: int  # bytes: the process's peak resident memory so far (ru_maxrss)
    batch: int
    chunk: int | None
    threads: int
    memory_limit: int
    workers: int = 1  # Ray actors (1 on the local path)

    @property
    def sequences_per_s(self) -> float:
        return self.sequences / self.seconds if self.seconds > 0 else float("inf")

    def __str__(self) -> str:
        saved = ""
        if self.padding_in_order > 0:
            saved = f" (in input order: {self.padding_in_order:.1%})"
        chunk = self.chunk if self.chunk is not None else "whole"
        pad = f"padding {self.padding:.1%} of steps run{saved}"
        if self.padding != self.padding:  # NaN: the Ray path's actors keep their own counts
            pad = "padding counted in the Ray actors"
        where = (f"{self.workers} Ray actors" if self.workers > 1
                 else f"{self.threads} thread{'s' if self.threads != 1 else ''}")  # fmt: skip
        return (
            f"scored {self.sequences:,} sequences ({self.steps:,} steps) in {self.seconds:.2f} s: "
            f"{self.sequences_per_s:,.0f} sequences/s on {where}\n"
            f"{pad}; batch {self.batch}, chunk {chunk}\n"
            f"peak memory {self.peak_rss / 2**20:.1f} MiB (limit for buffers "
            f"{self.memory_limit / 2**20:.0f} MiB) -> {self.output}"
        )


def peak_rss() -> int:
    """This process's peak resident memory in bytes (Linux reports KiB, macOS bytes)."""
    r = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return r if sys.platform == "darwin" else r * 1024


class _Progress:
    """A one-line progress bar on stderr, redrawn at most every 0.2 s. Best effort: a stderr
    that cannot take it (closed, full, a pipe whose reader left) turns it off (it failed the
    job, and the job's output was deleted with it)."""

    def __init__(self, total: int, enabled: bool) -> None:
        self.total, self.enabled, self.done = total, enabled, 0
        self.t0 = self.last = time.perf_counter()

    def update(self, n: int) -> None:
        self.done += n
        now = time.perf_counter()
        if self.enabled and (now - self.last > 0.2 or self.done >= self.total):
            self.last = now
            frac = self.done / self.total if self.total else 1.0
            bar = "#" * int(30 * frac)
            rate = self.done / max(now - self.t0, 1e-9)
            self._say(f"\r[{bar:<30}] {self.done:,}/{self.total:,} sequences  {rate:,.0f}/s")

    def close(self) -> None:
        if self.enabled:
            self._say("\n")

    def _say(self, text: str) -> None:
        try:
            sys.stderr.write(text)
            sys.stderr.flush()
        except (OSError, ValueError, AttributeError):  # full, closed, or None
            self.enabled = False


def _check_output(output, dataset, model, lengths, local: bool) -> None:
    """Refuse, before any work, an output that would replace one of the job's own inputs (the
    dataset, the model file, the lengths file) or land inside the input directory (the next
    run would read it as data), and one whose directory cannot take it."""
    from ..loading import same_file  # here: `import leanrnn` imports score but no file format

    out = os.path.realpath(os.fspath(output))
    for what, path in (("the input", dataset), ("the model", model), ("the lengths", lengths)):
        if isinstance(path, str | os.PathLike) and same_file(path, out):
            raise DataError(
                f"[score] output {os.fspath(output)!r} is {what} file itself; writing it would "
                "destroy it: pick another output path"
            )
    src = os.path.realpath(os.fspath(dataset))
    if os.path.isdir(src) and os.path.dirname(out) == src:
        raise DataError(
            f"[score] output {os.fspath(output)!r} is inside the input directory "
            f"{os.fspath(dataset)!r}, whose files are all read as data; write it elsewhere"
        )
    # (local: this process writes a file; else Ray's tasks write a directory's files)
    if os.path.exists(out) and not os.path.isfile(out) and not (os.path.isdir(out) and not local):
        # a directory failed at the final rename, after all the scoring; a device (/dev/null)
        # would have been replaced by a regular file
        what = "a directory" if os.path.isdir(out) else "not a regular file"
        raise DataError(
            f"[score] output {os.fspath(output)!r} is {what}; expected a .parquet or .npz file "
            "path (written whole at the end, replacing a file of that name)"
        )
    parent = os.path.dirname(out)
    if local and (not os.path.isdir(parent) or not os.access(parent, os.W_OK)):
        why = "is not writable" if os.path.isdir(parent) else "does not exist"
        raise DataError(
            f"[score] cannot write output {os.fspath(output)!r}: its directory {parent!r} {why}; "
            "create it or pick another path"
        )


def _check_parquet(dataset, output) -> None:
    """Parquet in or out needs pyarrow (the ``score`` extra): said before any work, not as an
    ImportError from inside the reader, or from the writer after all the scoring."""
    from .data import list_files

    paths = [os.fspath(output)]
    if isinstance(dataset, str | os.PathLike) and os.path.exists(dataset):
        paths += list_files(os.fspath(dataset))
    if not any(p.lower().endswith((".parquet", ".pq")) for p in paths):
        return
    try:
        import pyarrow  # noqa: F401
    except ImportError:
        raise DataError("[score] Parquet input or output needs pyarrow: pip install "
                        "'leanrnn[score]' (in a clone: pip install -e '.[score]'); .npy and .npz "
                        "need nothing more") from None  # fmt: skip


def _path(what: str, path):
    """``path`` as a str (str, bytes or os.PathLike); anything else is named."""
    try:
        return os.fsdecode(os.fspath(path))
    except TypeError:
        raise DataError(f"[score] {what} is a {type(path).__name__} ({path!r:.60}); expected a "
                        "file or directory path (str or pathlib.Path)") from None  # fmt: skip


def _load(model, threads):
    if isinstance(model, str | os.PathLike):
        from ..loading import load

        return load(model, threads=threads)
    return model


def score(model, dataset, output, *, outputs: str = "final",
          memory_limit: int | float | None = None,
          threads: int | None = None, batch_size: int | None = None, bucket: bool = True,
          column: str | None = None, length_column: str | None = None,
          x_key: str | None = None, lengths_key: str | None = None, lengths: str | None = None,
          allow_nonfinite: bool = False, progress: bool = False, ray: str | None = None,
          ray_actors: int | None = None) -> ScoreSummary:  # fmt: skip
    """Score every sequence of ``dataset`` with ``model`` and write the scores to ``output``.

    model:   a leanrnn LSTM/GRU/RNN (or a path ``leanrnn.load`` opens)
    dataset: Parquet (a list column of feature vectors: list<list<float>>,
             list<fixed_size_list<float>[C]> or T*C floats per row, plus an optional integer
             length column), ``.npy`` [N, T, C] padded (``lengths``: a .npy of [N] lengths),
             ``.npz`` with x [N, T, C] and lengths [N], or a directory of such files (by name)
    output:  ``.parquet`` or ``.npz``: one row per input sequence, in input order, with
             ``length`` and, by ``outputs``, ``h_n`` [L*D, K] (+ ``c_n`` [L*D, H] for LSTM)
             ('final'), ``y`` [T_i, D*K] ('steps') or all ('both'); written to a temporary
             name and renamed when complete
    memory_limit: bytes for the job's buffers (engine arena, padded batches, read-ahead): an
             int, or a whole float such as 64e6; default a quarter of the available memory,
             at most 256 MiB
    bucket:  sort each read-ahead window by length before batching (False: input order)
    ray:     None (this process), 'auto' (a local Ray, or the one RAY_ADDRESS names) or an
             address: the same job as a Ray Data pipeline (needs leanrnn[ray]); ``ray_actors``
             actors (default: one per CPU Ray has), each reading its own share of the
             Parquet row groups; a ``.parquet`` OUTPUT is written by this process

    Sequences hold finite floats (float16, float32 or float64, converted to the model's dtype); a
    length-0 sequence scores zero states and no steps. Errors name the file, row group,
    column and row; no output file is left behind.

    >>> s = leanrnn.score(leanrnn.load("lstm.lrnn"), "utterances.parquet", "states.parquet")  # doctest: +SKIP
    >>> print(s)                                                                # doctest: +SKIP
    """
    dataset, output = _path("dataset", dataset), _path("output", output)
    memory_limit = bytes_or_none("score", "memory_limit", memory_limit)  # 4e6 is a byte count
    for name, v in (("threads", threads), ("batch_size", batch_size),
                    ("ray_actors", ray_actors)):  # fmt: skip
        count_or_none("score", name, v)  # 2.5 or True were truncated, 0 meant "default"
    if ray_actors is not None and ray is None:  # (it was ignored)
        raise DataError(f"[score] ray_actors={ray_actors} sizes a Ray job: pass ray='auto' "
                        "or a cluster's address too (--ray auto|ADDRESS)")  # fmt: skip
    for name, v in (("bucket", bucket), ("allow_nonfinite", allow_nonfinite),
                    ("progress", progress)):  # fmt: skip
        if not isinstance(v, bool | np.bool_):  # bucket="no" meant True
            raise DataError(f"[score] {name}={v!r}; expected True or False")
    opts = Options(column, length_column, x_key, lengths_key, lengths, allow_nonfinite)
    # This process writes the output unless Ray's write tasks do (a directory OUTPUT).
    here = ray is None or os.fspath(output).lower().endswith((".parquet", ".pq"))
    _check_output(output, dataset, model, lengths, local=here)
    _check_parquet(dataset, output)
    model = _load(model, threads)
    engine_model(model)
    if ray is not None:
        from ..ray import score_on_ray

        return score_on_ray(model, dataset, output, outputs=outputs, memory_limit=memory_limit,
                            batch_size=batch_size, options=opts, address=ray,
                            actors=ray_actors, progress=progress, threads=threads)  # fmt: skip
    t0 = time.perf_counter()
    scorer = Scorer(model, outputs, memory_limit, threads, batch_size, bucket)
    src = Source(os.fspath(dataset), scorer.C, scorer.dtype, opts)
    bar = _Progress(src.count(), progress)
    tb = scorer.tuning
    out = open_output(os.fspath(output))
    try:
        for r in scorer.windows(src.pieces(scorer.piece_bytes, scorer.row_cost)):
            out.write(r)
            bar.update(len(r))
        out.close(scorer.empty())
    except BaseException:
        out.abort()
        raise
    finally:
        bar.close()
    c = scorer.counters
    return ScoreSummary(
        output=os.fspath(output), sequences=c.sequences, steps=c.steps,
        seconds=time.perf_counter() - t0,
        padding=(c.padded - c.steps) / c.padded if c.padded else 0.0,
        padding_in_order=(c.padded_in_order - c.steps) / c.padded_in_order
        if c.padded_in_order else 0.0,
        peak_rss=peak_rss(), batch=tb.batch, chunk=tb.chunk, threads=tb.threads,
        memory_limit=tb.memory_limit,
    )  # fmt: skip
