"""leanrnn on Ray Data (the ``leanrnn[ray]`` extra): ``Predictor``, a callable class for
``Dataset.map_batches`` that loads a model once per actor, and ``score_on_ray``, the
``leanrnn score --ray`` pipeline: the files' row ranges, shared out -> map_batches(an actor
pool that reads its row ranges itself and scores them) -> the driver writes OUTPUT in order.

    >>> import ray, leanrnn.ray                                              # doctest: +SKIP
    >>> ds = ray.data.read_parquet("utterances/")                            # doctest: +SKIP
    >>> ds = ds.map_batches(leanrnn.ray.Predictor, fn_constructor_kwargs={"model": "lstm.lrnn"},
    ...                     batch_format="pyarrow", concurrency=2, num_cpus=0.5)  # doctest: +SKIP

(2 actors of num_cpus=0.5 on a 2-CPU cluster: the read tasks need a CPU slot of their own, and
at 0.9 each the job waited for one forever; slots are bookkeeping, the actors' threads still use
every core.)

Ray's traps, and what is done about them:
- Shipping the input through Ray costs more CPU than scoring leaves spare: a read task decodes
  the Parquet file (Ray read a whole 258 MiB file in one task, ~390 MiB of memory), copies the
  blocks into the object store, and starts worker processes of its own, all competing with the
  actors for the cores. So score_on_ray hands each actor row ranges of the files (planned
  from the metadata, on the driver) and the actor reads them with the local path's reader:
  the input is decoded once, in the process that scores it, and never crosses the object
  store. Only the scores (a few KiB per sequence with final states) travel back, and the
  driver writes them with the local path's writer: no write tasks, no merge of part files.
- Every worker would compile the kernels again under numba's JIT: leanrnn's native kernels are
  built once per machine (~/.cache/leanrnn) and a worker only loads them (numba is never
  imported); the driver builds them before the actors start, and ``Predictor.kernel_info``
  says which kernels an actor runs.
- Each actor runs its kernels on cores // actors threads, so actors do not oversubscribe.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import os
import shutil
import sys
import tempfile
import time
import traceback

from ._files import current_umask
from .errors import LeanRNNError, SpecError
from .score.batching import Counters, Scorer
from .score.data import DataError, Options, Source, arrow_to_seqs
from .score.writers import to_arrow

# CPU slots asked for by each write task (a directory OUTPUT only): they mostly wait on I/O.
READ_CPUS = 0.1
# Work items per actor: enough that an actor finishing early takes another (the items are
# similar in bytes, so the last one decides how long the others wait), few enough that each
# item's read-ahead window has thousands of sequences to sort by length.
ITEMS_PER_ACTOR = 4
# Restarts of an actor that died (and retries of the item it died on) before the job fails.
ACTOR_RETRIES = 2

__all__ = ["Predictor", "score_on_ray"]


def _model_from(model, threads):
    """A Model from a path, the bytes of a .lrnn/state-dict file, or a Model."""
    from .loading import load

    if isinstance(model, bytes | bytearray | memoryview):
        fd, path = tempfile.mkstemp(suffix=".lrnn")
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(model)
            return load(path, threads=threads)
        finally:
            os.remove(path)
    if isinstance(model, str | os.PathLike):
        return load(model, threads=threads)
    return model


def _in_actor() -> bool:
    """Whether this process is a Ray actor's (ray imported and initialised in it, with an
    actor id): its thread settings are then the actor's own to set."""
    ray = sys.modules.get("ray")
    try:
        return bool(ray and ray.is_initialized() and ray.get_runtime_context().get_actor_id())
    except Exception:  # an older Ray without the call: not known to be an actor
        return False


class Predictor:
    """Scores batches of a Ray dataset: ``map_batches(Predictor, batch_format="pyarrow",
    fn_constructor_kwargs={"model": ...})``.

    model: a path every worker can read, the bytes of a model file, or a leanrnn Model;
    column / length_column: as for leanrnn.score (None: the only list column / 'length');
    outputs: 'final', 'steps' or 'both'; threads: kernel threads per actor (default 1: an
    actor per core; None: the process's default, all its cores). In a Ray actor they are the
    process's (BLAS's too: set_num_threads); anywhere else (a driver, a notebook) only this
    predictor's, so that making one there does not leave your process on one thread.
    Each call sorts its batch by length, runs it in length-aware batches and returns a
    pyarrow Table in the batch's row order: length, h_n, c_n, y (see leanrnn.score.writers),
    then the batch's columns named in ``keep`` as they came (an id to join the scores back
    on: Ray Data does not keep row order across blocks unless told to).
    """

    def __init__(self, model, *, outputs: str = "final", column: str | None = None,
                 length_column: str | None = None, threads: int | None = 1,
                 memory_limit: int | float | None = None, batch_size: int | None = None,
                 allow_nonfinite: bool = False, keep: tuple[str, ...] = ()) -> None:  # fmt: skip
        from . import config
        from .engine._check import bytes_or_none, count_or_none, flag

        threads = count_or_none("Predictor", "threads", threads)
        memory_limit = bytes_or_none("Predictor", "memory_limit", memory_limit)  # 4.5 was 4
        flag("Predictor", "allow_nonfinite", allow_nonfinite)
        if threads is not None and _in_actor():
            config.set_num_threads(threads)
        m = _model_from(model, threads)
        self.scorer = Scorer(m, outputs, memory_limit, threads, batch_size)
        self.column, self.length_column = column, length_column
        self.allow_nonfinite = allow_nonfinite
        if (not isinstance(keep, list | tuple) or not all(isinstance(k, str) for k in keep)
                or len(set(keep)) != len(keep)):  # fmt: skip
            raise SpecError(f"[Predictor] keep={keep!r}; expected a tuple of distinct column names")
        clash = sorted(set(keep) & set(to_arrow(self.scorer.empty()).column_names))
        if clash:
            raise SpecError(f"[Predictor] keep names {clash}, which are output columns; rename "
                            "them in the dataset first")  # fmt: skip
        self.keep = tuple(keep)
        # Load the kernels here, once per actor, not on the first batch.
        import numpy as np

        self.scorer.score([np.zeros((1, self.scorer.C), self.scorer.dtype)])
        self.scorer.counters = Counters()  # the warm-up run is not part of the job

    def kernel_info(self) -> dict:
        """Which kernels this process runs and whether it ever imported numba (it must not
        need to: the native kernels are loaded, not compiled)."""
        from .kernels import runner  # diagnostics only: the backend the engine resolved

        return {"backend": runner.backend().name, "numba_imported": "numba" in sys.modules,
                "pid": os.getpid()}  # fmt: skip

    def _columns(self, table) -> tuple[str, str | None]:
        import pyarrow as pa

        names = table.column_names
        col = self.column
        if col is None:
            lists = [
                f.name for f in table.schema
                if pa.types.is_list(f.type) or pa.types.is_large_list(f.type)
                or pa.types.is_fixed_size_list(f.type)
            ]  # fmt: skip
            if len(lists) != 1:
                raise DataError(
                    f"[Predictor] batch columns {names}: expected exactly one list column of "
                    "sequences, or column="
                )
            col = lists[0]
        elif col not in names:
            raise DataError(f"[Predictor] batch has no column {col!r}; its columns are {names}")
        lc = self.length_column
        if lc is None:
            lc = next((n for n in ("length", "lengths") if n in names), None)
        elif lc not in names:
            raise DataError(
                f"[Predictor] batch has no length column {lc!r}; its columns are {names}"
            )
        return col, lc

    def __call__(self, batch):
        import pyarrow as pa

        table = batch if isinstance(batch, pa.Table) else pa.table(batch)
        col, lc = self._columns(table)
        where = "a Ray batch (rows counted from its first)"
        if "path" in table.column_names and table.num_rows:
            where = (
                f"{table.column('path')[0].as_py()!r} (a Ray batch; rows counted from its first)"
            )
        missing = [k for k in self.keep if k not in table.column_names]
        if missing:
            raise DataError(f"[Predictor] batch has no columns {missing} to keep; its columns "
                            f"are {table.column_names}")  # fmt: skip
        seqs = arrow_to_seqs(
            table.column(col), table.column(lc) if lc else None, self.scorer.C,
            self.scorer.dtype, where, col, lc, 0, self.allow_nonfinite,
        )  # fmt: skip
        out = to_arrow(self.scorer.score(seqs))
        for k in self.keep:
            out = out.append_column(k, table.column(k))
        return out


class _RowGroupScorer(Predictor):
    """score_on_ray's actor: each batch row names a Parquet file and row ranges of it (see
    _work); the actor reads them with the local path's reader (same checks, same error messages), scores
    them window by window as the local path does, and yields one Arrow table per window."""

    def __init__(self, model, *, outputs: str, options: Options, threads: int | None,
                 memory_limit: int | None, batch_size: int | None) -> None:  # fmt: skip
        super().__init__(model, outputs=outputs, threads=threads, memory_limit=memory_limit,
                         batch_size=batch_size, allow_nonfinite=options.allow_nonfinite)  # fmt: skip
        self.options = options
        self._sources: dict[str, Source] = {}

    def __call__(self, batch):
        sc = self.scorer
        for item in batch.to_pylist():
            path = item["path"]
            src = self._sources.get(path)
            if src is None:
                src = self._sources[path] = Source(path, sc.C, sc.dtype, self.options)
            for r in sc.windows(src.range_pieces(sc.piece_bytes, item["ranges"], sc.row_cost)):
                yield to_arrow(r)


def _work(src: Source, actors: int) -> list[dict]:
    """``src``'s rows as ITEMS_PER_ACTOR * actors work items of about equal bytes, in input
    order: {"path": file, "ranges": [[row group, first row, end row], ...]}. A row group
    larger than an item is cut into equal row ranges (a file written as one row group still
    feeds every actor; each range decodes the rows before it, so smaller groups stay whole);
    a range goes to the item its middle byte falls in; an item never spans two files."""
    groups = src.row_groups()
    k = ITEMS_PER_ACTOR * actors
    total = sum(b for *_, b in groups) or 1
    target = total / k
    items: list[dict] = []
    acc, last = 0.0, -1
    for path, g, rows, nbytes in groups:
        parts = max(1, min(rows, math.ceil(nbytes / target - 0.5)))
        for p in range(parts):
            r0, r1 = rows * p // parts, rows * (p + 1) // parts
            part = nbytes * (r1 - r0) / rows
            slot = min(k - 1, int((acc + part / 2) / target))
            if not items or items[-1]["path"] != path or slot != last:
                items.append({"path": path, "ranges": []})
            items[-1]["ranges"].append([g, r0, r1])
            acc, last = acc + part, slot
    return items


def _reachable(address: str, timeout: float = 5.0) -> None:
    """Refuse an address ('host:port' or 'ray://host:port') where nothing listens, before
    ray.init: Ray retries such an address for ever, printing a warning every 40 s (--ray
    127.0.0.1:1 ran for 10 minutes without an error)."""
    import socket

    hostport = address.removeprefix("ray://")
    host, _, port = hostport.rpartition(":")
    if not host or not port.isdigit():
        return  # not host:port (Ray's own words, such as 'local'): Ray checks it
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout):
            pass
    except OSError as e:
        raise SpecError(
            f"[score --ray] nothing answers at {address!r} ({e.strerror or e}): start the "
            "cluster there (ray start --head), or pass --ray auto for a Ray on this machine"
        ) from None


def _init(address: str):
    import ray

    if address != "auto":
        _reachable(address)  # (also with a Ray already up here: the address named is wrong)
    if ray.is_initialized():
        return
    if address == "auto":
        # A cluster RAY_ADDRESS names, else a local Ray on this machine's cores.
        named = os.environ.get("RAY_ADDRESS") or None
        if named:
            _reachable(named)
        ray.init(address=named, log_to_driver=False)
    else:
        ray.init(address=address, log_to_driver=False)


def _parquet_files(dataset: str) -> list[str]:
    from .score.data import list_files

    files = list_files(dataset)
    bad = [f for f in files if not f.lower().endswith((".parquet", ".pq"))]
    if bad:
        raise DataError(
            f"[score --ray] {bad[0]!r}: the Ray path reads Parquet only; score .npy/.npz "
            "locally (without --ray) or convert them to Parquet"
        )
    return files


def score_on_ray(model, dataset, output, *, outputs: str = "final",
                 memory_limit: int | None = None, batch_size: int | None = None,
                 options: Options | None = None, address: str = "auto",
                 actors: int | None = None, progress: bool = False,
                 threads: int | None = None):  # fmt: skip
    """``leanrnn.score(..., ray=address)``: the same job on Ray Data actors. ``output``: a
    ``.parquet`` file (the driver writes it in order, as the local path does) or a directory
    (Ray's write tasks write its files). ``threads``: kernel threads per actor. The files must
    be readable at the same path on every node (a shared filesystem). Returns a
    ScoreSummary."""
    import numpy as np

    from . import config, save
    from .score import ScoreSummary, _Progress, peak_rss
    from .score.batching import engine_model
    from .score.writers import ParquetOut

    opts = options or Options()
    dataset, output = os.fspath(dataset), os.fspath(output)
    if output.lower().endswith(".npz"):  # (it became a directory of Parquet files)
        raise DataError(f"[score --ray] output {output!r}: the Ray path writes Parquet, a "
                        ".parquet file or a directory of them; for .npz, score without --ray")  # fmt: skip
    single = output.lower().endswith((".parquet", ".pq"))  # else a directory of them
    if not single and "://" not in output:
        _check_directory_output(output)
    _parquet_files(dataset)
    m = engine_model(model, "score --ray")
    # Columns and types of every file are checked here, on the driver, before any actor
    # starts (errors name the file); the row groups come from the metadata alone.
    src = Source(dataset, m.spec.input_size, m.dtype, opts)
    total = src.count()
    # Build (or find) the native kernels here, once, so no worker compiles anything.
    probe = Scorer(m, outputs, memory_limit, 1, batch_size)
    probe.score([np.zeros((1, m.spec.input_size), m.dtype)])
    try:
        import ray
        import ray.data
    except ImportError:
        raise DataError(
            "[score --ray] Ray is not installed; pip install 'leanrnn[ray]' (in a clone: "
            "pip install -e '.[ray]')"
        ) from None
    t0 = time.perf_counter()
    _init(address)
    cpus = int(ray.cluster_resources().get("CPU", 1))
    n = actors or max(1, cpus)
    # Logical CPU slots: the actors share all but one slot, which stays free for Ray Data's
    # own work (a directory OUTPUT's write tasks ask for READ_CPUS). The actors still use every
    # core: slots are bookkeeping, threads are real.
    per_actor = max(0.1, (cpus - 1) / n) if cpus > 1 else 0.5 / n
    if threads is None:  # actors share this machine's cores (on a cluster: one thread each)
        threads = max(1, config.cores() // n) if cpus <= config.cores() else 1
    with tempfile.NamedTemporaryFile(suffix=".lrnn", delete=False) as f:
        tmp_model = f.name
    try:
        save(m, tmp_model)
        with open(tmp_model, "rb") as f:
            blob = f.read()
    finally:
        os.remove(tmp_model)
    items = _work(src, n)
    ctx = ray.data.DataContext.get_current()
    saved = ctx.execution_options.preserve_order, ctx.enable_progress_bars
    ctx.execution_options.preserve_order = True
    # A single OUTPUT shows the local path's progress bar (sequences written), not Ray's.
    ctx.enable_progress_bars = progress and not single
    ds = None
    if items:  # no rows anywhere: nothing for an actor to do
        ds = ray.data.from_items(items, override_num_blocks=len(items))
        ds = ds.map_batches(
            _RowGroupScorer, batch_format="pyarrow", batch_size=1,
            # One item at a time: an item is seconds of work and a few bytes of input, so
            # queueing more only lets the first actor up take the others' share.
            compute=ray.data.ActorPoolStrategy(size=n, max_tasks_in_flight_per_actor=1),
            num_cpus=per_actor,
            # An actor that dies on an item (a crash, the OOM killer) is restarted and the
            # item retried ACTOR_RETRIES times, then the job fails (_actor_died); Ray Data's
            # default, -1, retried it for ever: a job that never ended and never said why.
            max_restarts=ACTOR_RETRIES, max_task_retries=ACTOR_RETRIES,
            fn_constructor_kwargs=dict(model=blob, outputs=outputs, options=opts,
                                       threads=threads, memory_limit=memory_limit,
                                       batch_size=batch_size),
        )  # fmt: skip
    steps = 0
    failure = None  # the LeanRNNError an actor raised
    written = None  # a directory OUTPUT's temporary directory, removed if the job fails
    out = ParquetOut(output) if single else None
    bar = _Progress(total, progress and single)
    try:
        if ds is None:
            if single:
                out.close(probe.empty())
            else:  # one file of no rows, with the columns (an empty directory had none)
                import pyarrow.fs
                import pyarrow.parquet as pq

                fs, root = pyarrow.fs.FileSystem.from_uri(
                    output if "://" in output else os.path.abspath(output)
                )
                fs.create_dir(root, recursive=True)
                pq.write_table(to_arrow(probe.empty()), f"{root}/empty.parquet", filesystem=fs)
        elif single:
            with _quiet_own_errors():
                for t in ds.iter_batches(batch_size=None, batch_format="pyarrow"):
                    out.write_table(t)
                    steps += int(np.asarray(t.column("length")).sum())
                    bar.update(t.num_rows)
            out.close(probe.empty())
        else:
            import pyarrow.fs

            local = "://" not in output
            fs_out = pyarrow.fs.LocalFileSystem() if local else None
            # a local directory is written to a hidden one and moved in whole: a failed job
            # left the part files its write tasks had finished (no partial output, as the
            # file's)
            to = _staging(output) if local else output
            written = to
            with _quiet_own_errors():
                ds.write_parquet(to, filesystem=fs_out, ray_remote_args={"num_cpus": READ_CPUS})
            lengths = _lengths(to)
            steps = int(lengths.sum()) if lengths is not None else 0
            if local:
                _move_in(to, output)
    except BaseException as e:
        if out is not None:
            out.abort()
        if written is not None and written != output:
            shutil.rmtree(written, ignore_errors=True)
        failure = None
        if isinstance(e, ray.exceptions.RayError):
            failure = _leanrnn_cause(e) or _actor_died(e)
        if failure is None:
            raise
        _release(e)
    finally:
        bar.close()
        ctx.execution_options.preserve_order, ctx.enable_progress_bars = saved
    if failure is not None:  # bad data found by an actor: leanrnn's own error
        # raised here, not in the except block, where it would carry Ray's error as its
        # __context__ (see _release)
        ds = None
        gc.collect()
        raise failure
    return ScoreSummary(
        output=output, sequences=total, steps=steps, seconds=time.perf_counter() - t0,
        padding=float("nan"), padding_in_order=float("nan"), peak_rss=peak_rss(),
        batch=probe.tuning.batch, chunk=probe.tuning.chunk, threads=threads,
        memory_limit=probe.tuning.memory_limit, workers=n,
    )  # fmt: skip


def _leanrnn_cause(e: BaseException) -> LeanRNNError | None:
    """The LeanRNNError an actor raised, from inside Ray's wrappers (cause / __cause__), or
    rebuilt from its "...Error: [op] ..." line when Ray kept only the text. Ray's
    RayTaskError(DataError) is itself a DataError, but its message is the worker's traceback:
    the error inside it is the one to raise."""
    from ray.exceptions import RayError

    for c in _chain(e):
        if isinstance(c, LeanRNNError) and not isinstance(c, RayError):
            # Ray Data appends its retry advice ("...if you believe this to be transient")
            # on lines of its own: wrong advice for bad data, and leanrnn's errors are one line
            # (a new one, with no context or traceback holding Ray's objects)
            try:
                return type(c)(str(c).split("\n", 1)[0])
            except TypeError:  # a subclass that takes other arguments
                return c
    lines = [ln for ln in str(e).splitlines() if "Error: [" in ln]
    if lines:
        return DataError(lines[-1].split("Error: ", 1)[1].strip())
    return None


def _actor_died(e: BaseException) -> LeanRNNError | None:
    """A DataError for a job whose actor died on one item more often than it may restart."""
    from ray.exceptions import RayActorError

    died = next((c for c in _chain(e) if isinstance(c, RayActorError)), None)
    if died is None:
        return None
    said = " ".join(str(died).split())[:300]
    return DataError(
        f"[score --ray] an actor died (restarted up to {ACTOR_RETRIES} times, its work item "
        "retried as often: a crash, or killed, e.g. out of memory); no output was written. "
        f"Ray said: {said}. The cause is in Ray's worker logs (/tmp/ray/session_latest/logs); "
        "if it was memory, a lower memory_limit or fewer actors per node"
    )


def _release(e: BaseException) -> None:
    """Clears the finished frames in the tracebacks of Ray's error ``e`` and those it chains:
    their locals hold the failed job's executor, so its actors and their CPU slots, for as
    long as anything keeps the error — a log record does (pytest's log capture kept them, and
    on a 2-CPU Ray a job after two failed ones waited for a slot forever)."""
    for c in _chain(e):
        traceback.clear_frames(c.__traceback__)  # (frames still running are left as they are)


def _chain(e: BaseException | None):
    """``e`` and the errors it wraps, outermost first: Ray's ``cause``, else ``__cause__``,
    else ``__context__`` (each once: a chain may loop)."""
    seen = set()
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        yield e
        e = getattr(e, "cause", None) or e.__cause__ or e.__context__


def _check_directory_output(output: str) -> None:
    """Refuse, before any work, a directory OUTPUT that is a file (it failed after the work,
    at the move), or a directory that holds Parquet files already (a second run there doubled
    the rows: readers read every file)."""
    if os.path.lexists(output) and not os.path.isdir(output):
        raise DataError(f"[score --ray] output {output!r} is a file; the Ray path writes a "
                        "directory of Parquet files there (or one .parquet file: name it so)")  # fmt: skip
    if os.path.isdir(output) and any(
            n.lower().endswith((".parquet", ".pq")) for n in os.listdir(output)):  # fmt: skip
        raise DataError(f"[score --ray] output directory {output!r} already holds Parquet files "
                        "(a run before?): the job's would join them, and readers would read "
                        "both; remove them or pick another directory")  # fmt: skip


def _staging(output: str) -> str:
    """A new hidden directory for a directory OUTPUT's files until the job succeeds: inside
    OUTPUT when it exists (its filesystem, even as a mount point or through a symlink; readers
    skip names starting with "."), else beside where it will be."""
    if os.path.isdir(output):
        return tempfile.mkdtemp(dir=output, prefix=".leanrnn-")
    real = os.path.realpath(output)
    return tempfile.mkdtemp(dir=os.path.dirname(real), prefix=f".{os.path.basename(real)}.")


def _move_in(tmp: str, output: str) -> None:
    """The finished job's files from ``tmp`` (_staging) into ``output``: the directory itself
    when there is none yet, else file by file (_check_output refused one holding Parquet files
    already: a second run there doubled the rows)."""
    if not os.path.isdir(output):
        # the umask's mode, as os.mkdir gives a new directory: mkdtemp's 0700 came along
        # with the rename, and other users could not read the results
        os.chmod(tmp, 0o777 & ~current_umask())
        os.replace(tmp, os.path.realpath(output))
        return
    for name in os.listdir(tmp):
        os.replace(os.path.join(tmp, name), os.path.join(output, name))
    os.rmdir(tmp)


class _OwnError(logging.Filter):
    """Drops Ray Data's log of a task that failed with a leanrnn error from the console: the
    caller gets that error itself, one line as on the local path, where Ray printed the
    worker's traceback twice (60 lines) before it; Ray's session log keeps the record."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        try:
            return exc is None or _leanrnn_cause(exc) is None
        except Exception:  # a filter that raises would stop Ray's thread that logged
            return True


@contextlib.contextmanager
def _quiet_own_errors():
    """_OwnError on the console handlers of Ray's loggers, for the job's duration."""
    f = _OwnError()
    # by type, not by stream: Ray's handler keeps the stderr it saw at import, which Jupyter
    # or redirect_stderr replace
    handlers = [h for name in ("ray", "ray.data") for h in logging.getLogger(name).handlers
                if isinstance(h, logging.StreamHandler)
                and not isinstance(h, logging.FileHandler)]  # fmt: skip
    for h in handlers:
        h.addFilter(f)
    try:
        yield
    finally:
        for h in handlers:
            h.removeFilter(f)


def _lengths(path: str):
    import numpy as np
    import pyarrow.parquet as pq

    try:
        return np.asarray(pq.read_table(path, columns=["length"]).column("length"))
    except Exception:
        return None
