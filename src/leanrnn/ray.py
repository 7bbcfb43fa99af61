"""leanrnn on Ray Data (the ``leanrnn[ray]`` extra): ``Predictor``, a callable class for
``Dataset.map_batches`` that loads a model once per actor, and ``score_on_ray``, the
``leanrnn score --ray`` pipeline: read_parquet -> map_batches(Predictor, actor pool) ->
write_parquet.

    >>> import ray, leanrnn.ray                                              # doctest: +SKIP
    >>> ds = ray.data.read_parquet("utterances/")                            # doctest: +SKIP
    >>> ds = ds.map_batches(leanrnn.ray.Predictor, fn_constructor_kwargs={"model": "lstm.lrnn"},
    ...                     batch_format="pyarrow", concurrency=2, num_cpus=0.9)  # doctest: +SKIP

Ray's traps, and what is done about them:
- Actors holding every CPU starve the read and write tasks (they need a CPU slot too): the
  actors ask for a little less than a whole CPU each, the reads and writes for READ_CPUS.
- Every worker would compile the kernels again under numba's JIT: leanrnn's native kernels are
  built once per machine (~/.cache/leanrnn) and a worker only loads them (numba is never
  imported); the driver builds them before the actors start, and ``Predictor.kernel_info``
  says which kernels an actor runs.
- Each actor runs its kernels on cores // actors threads, so actors do not oversubscribe.
"""

from __future__ import annotations

import os
import sys
import tempfile
import time

from .errors import LeanRNNError
from .score.batching import Counters, Scorer
from .score.data import DataError, Options, arrow_to_seqs
from .score.writers import to_arrow

# CPU slots asked for by each read/write task: they mostly wait on I/O.
READ_CPUS = 0.1
# Rows per batch handed to an actor: enough for length-sorting to find similar lengths.
RAY_BATCH_ROWS = 1024
# Bytes per block read (the unit Ray hands between tasks and actors).
BLOCK_BYTES = 4 << 20

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


class Predictor:
    """Scores batches of a Ray dataset: ``map_batches(Predictor, batch_format="pyarrow",
    fn_constructor_kwargs={"model": ...})``.

    model: a path every worker can read, the bytes of a model file, or a leanrnn Model;
    column / length_column: as for leanrnn.score (None: the only list column / 'length');
    outputs: 'final', 'steps' or 'both'; threads: kernel threads per actor (default: this
    node's cores // actors_per_node, at least 1).
    Each call sorts its batch by length, runs it in length-aware batches and returns a
    pyarrow Table in the batch's row order: length, h_n, c_n, y (see leanrnn.score.writers).
    """

    def __init__(self, model, *, outputs: str = "final", column: str | None = None,
                 length_column: str | None = None, threads: int | None = 1,
                 memory_limit: int | None = None, batch_size: int | None = None,
                 allow_nonfinite: bool = False) -> None:  # fmt: skip
        from . import config

        if threads is not None:
            config.set_num_threads(threads)
        m = _model_from(model, threads)
        self.scorer = Scorer(m, outputs, memory_limit, threads, batch_size)
        self.column, self.length_column = column, length_column
        self.allow_nonfinite = allow_nonfinite
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
        where = "Ray batch"
        if "path" in table.column_names and table.num_rows:
            where = f"{table.column('path')[0].as_py()!r} (Ray batch)"
        seqs = arrow_to_seqs(
            table.column(col), table.column(lc) if lc else None, self.scorer.C,
            self.scorer.dtype, where, col, lc, 0, self.allow_nonfinite,
        )  # fmt: skip
        return to_arrow(self.scorer.score(seqs))


def _init(address: str):
    import ray

    if ray.is_initialized():
        return
    if address == "auto":
        # A cluster RAY_ADDRESS names, else a local Ray on this machine's cores.
        ray.init(address=os.environ.get("RAY_ADDRESS") or None, log_to_driver=False)
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
    """``leanrnn.score(..., ray=address)``: the same job as a Ray Data pipeline. ``output``: a
    ``.parquet`` file (Ray writes a directory next to it, merged in order and removed) or a
    directory (Ray's files, kept). ``threads``: kernel threads per actor. Returns a
    ScoreSummary."""
    import numpy as np

    from . import config, save
    from .score import ScoreSummary, peak_rss
    from .score.batching import engine_model
    from .score.data import Source

    opts = options or Options()
    dataset, output = os.fspath(dataset), os.fspath(output)
    files = _parquet_files(dataset)
    m = engine_model(model, "score --ray")
    # Check columns and types on the driver, before any worker starts: errors name the file.
    src = Source(dataset, m.spec.input_size, m.dtype, opts)
    total = src.count()
    reader = src._readers[0]
    column, length_column = reader.column, reader.length_column
    for r in src._readers[1:]:  # Ray reads all files as one table: one schema
        if (r.column, r.length_column) != (column, length_column) or not r.pf.schema_arrow.field(
            r.column
        ).type.equals(reader.pf.schema_arrow.field(column).type):
            raise DataError(
                f"[score --ray] {r.path!r} has columns ({r.column!r}, {r.length_column!r}) of "
                f"another layout than {reader.path!r}; the Ray path reads every file with one "
                "schema: convert them alike, or score locally (without --ray)"
            )
    # Build (or find) the native kernels here, once, so no worker compiles anything.
    probe = Scorer(m, outputs, memory_limit, 1, batch_size)
    probe.score([np.zeros((1, m.spec.input_size), m.dtype)])
    try:
        import ray
        import ray.data
    except ImportError:
        raise DataError("[score --ray] Ray is not installed; pip install 'leanrnn[ray]'") from None
    t0 = time.perf_counter()
    _init(address)
    cpus = int(ray.cluster_resources().get("CPU", 1))
    n = actors or max(1, cpus)
    # Logical CPU slots: the actors share all but one slot, which stays free for Ray Data's
    # own tasks (listing files, reading, writing; each asks for READ_CPUS). The actors still
    # use every core: slots are bookkeeping, threads are real.
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
    ctx = ray.data.DataContext.get_current()
    saved = (ctx.execution_options.preserve_order, ctx.enable_progress_bars,
             ctx.target_max_block_size)  # fmt: skip
    ctx.execution_options.preserve_order = True
    ctx.enable_progress_bars = progress
    # Small blocks, so every actor has work (a file would otherwise be one block for one
    # actor) and blocks in flight stay a few MiB each.
    ctx.target_max_block_size = BLOCK_BYTES
    # Local paths get pyarrow's local filesystem explicitly: Ray otherwise probes fsspec's
    # optional filesystems (seen failing here when aiohttp was missing).
    import pyarrow.fs

    local = pyarrow.fs.LocalFileSystem()
    fs_in = local if all("://" not in f for f in files) else None
    fs_out = local if "://" not in output else None
    ds = ray.data.read_parquet(files, num_cpus=READ_CPUS, filesystem=fs_in)
    ds = ds.select_columns([c for c in (column, length_column) if c])
    ds = ds.map_batches(
        Predictor, batch_format="pyarrow", batch_size=RAY_BATCH_ROWS, compute=ray.data.ActorPoolStrategy(size=n), num_cpus=per_actor,
        fn_constructor_kwargs=dict(model=blob, outputs=outputs, column=column,
                                   length_column=length_column, threads=threads,
                                   memory_limit=memory_limit, batch_size=batch_size,
                                   allow_nonfinite=opts.allow_nonfinite),
    )  # fmt: skip
    single = output.lower().endswith((".parquet", ".pq"))
    target = (
        tempfile.mkdtemp(prefix=".leanrnn-ray-", dir=os.path.dirname(os.path.abspath(output)))
        if single
        else output
    )
    try:
        ds.write_parquet(target, filesystem=fs_out, ray_remote_args={"num_cpus": READ_CPUS})
        if single:
            _merge(target, output, probe.empty())
    except ray.exceptions.RayTaskError as e:
        cause = _leanrnn_cause(e)
        if cause is not None:  # bad data found by an actor: leanrnn's own error
            raise cause from None
        raise
    finally:
        (ctx.execution_options.preserve_order, ctx.enable_progress_bars,
         ctx.target_max_block_size) = saved  # fmt: skip
        if single:
            import shutil

            shutil.rmtree(target, ignore_errors=True)
    lengths = _lengths(output if single else target)
    steps = int(lengths.sum()) if lengths is not None else 0
    return ScoreSummary(
        output=output, sequences=total, steps=steps, seconds=time.perf_counter() - t0,
        padding=float("nan"), padding_in_order=float("nan"), peak_rss=peak_rss(),
        batch=probe.tuning.batch, chunk=probe.tuning.chunk, threads=threads,
        memory_limit=probe.tuning.memory_limit, workers=n,
    )  # fmt: skip


def _leanrnn_cause(e: BaseException) -> LeanRNNError | None:
    """The LeanRNNError an actor raised, from inside Ray's wrappers (cause / __cause__), or
    rebuilt from its "...Error: [op] ..." line when Ray kept only the text."""
    top, seen = e, set()
    while e is not None and id(e) not in seen:
        if isinstance(e, LeanRNNError):
            return e
        seen.add(id(e))
        e = getattr(e, "cause", None) or e.__cause__ or e.__context__
    lines = [ln for ln in str(top).splitlines() if "Error: [" in ln]
    if lines:
        return DataError(lines[-1].split("Error: ", 1)[1].strip())
    return None


def _ordered(directory: str) -> list[str]:
    # Ray names files {write_uuid}_{task_index:06}...: with preserve_order, task order is
    # dataset order.
    return [os.path.join(directory, f) for f in sorted(os.listdir(directory))
            if f.endswith(".parquet")]  # fmt: skip


def _merge(directory: str, output: str, empty) -> None:
    """Ray's part files -> one Parquet file, row group by row group, in order, atomically."""
    import pyarrow.parquet as pq

    from .score.writers import _remove, temp_name

    tmp = temp_name(output)
    w = None
    try:
        for path in _ordered(directory):
            pf = pq.ParquetFile(path)
            for g in range(pf.metadata.num_row_groups):
                t = pf.read_row_group(g)
                if w is None:
                    w = pq.ParquetWriter(tmp, t.schema)
                w.write_table(t)
        if w is None:  # no rows: Ray wrote no files
            w = pq.ParquetWriter(tmp, to_arrow(empty).schema)
            w.write_table(to_arrow(empty))
        w.close()
        os.replace(tmp, output)
    except BaseException:
        if w is not None:
            w.close()
        _remove(tmp)
        raise


def _lengths(path: str):
    import numpy as np
    import pyarrow.parquet as pq

    try:
        return np.asarray(pq.read_table(path, columns=["length"]).column("length"))
    except Exception:
        return None
