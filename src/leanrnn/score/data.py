"""Reading sequences for scoring, in pieces: Parquet, ``.npy``/``.npz`` (padded + lengths) or a
directory of those. Every piece is a list of [T_i, C] arrays in the model's dtype, with where
it came from, so an error names the file, row group, column and row.

Nothing is read whole: Parquet by record batches of one row group, ``.npy``/``.npz`` members by
rows straight from the file (a zip member is read as a stream, compressed or not). Declared
sizes (npy headers, Parquet metadata) are checked against what the file holds before reading.
"""

from __future__ import annotations

import logging
import math
import os
import stat
import tokenize
import zipfile
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from ..errors import DTypeError, LeanRNNError, LengthsError, ShapeError

_log = logging.getLogger("leanrnn")

SUFFIXES = (".parquet", ".pq", ".npy", ".npz")
# npz keys looked for when none are given.
NPZ_X_KEYS = ("x", "inputs", "input")
NPZ_LENGTH_KEYS = ("lengths", "length", "lens")
PARQUET_LENGTH_NAMES = ("length", "lengths")


class DataError(LeanRNNError, ValueError):
    """An input dataset file is unreadable, malformed, or holds values that cannot be scored."""


@dataclass
class Piece:
    """seqs: [T_i, C] arrays (views into one buffer); where: 'file, row group g' or 'file';
    first_row: row (within ``where``) of seqs[0]."""

    seqs: list[np.ndarray]
    where: str
    first_row: int
    nbytes: int = 0  # bytes the piece holds (the buffer the seqs view, padding included)


@dataclass(frozen=True)
class Options:
    column: str | None = None  # Parquet feature column (None: the only list column)
    length_column: str | None = None  # Parquet length column (None: 'length' if present)
    x_key: str | None = None  # npz key of the padded array
    lengths_key: str | None = None  # npz key of the lengths
    lengths_path: str | None = None  # lengths [N] for a single .npy input
    allow_nonfinite: bool = False


def list_files(path: str) -> list[str]:
    """The input files of ``path``: itself, or a directory's data files sorted by name."""
    path = os.fspath(path)
    if os.path.isdir(path):
        names = sorted(
            n for n in os.listdir(path)
            if not n.startswith((".", "_")) and n.lower().endswith(SUFFIXES)
        )  # fmt: skip
        if not names:
            raise DataError(
                f"[score] directory {path!r} holds no .parquet, .npy or .npz files; expected "
                "a dataset file or a directory of them"
            )
        files = [os.path.join(path, n) for n in names]
        for f in files:
            _regular(f)
        return files
    if not os.path.exists(path):
        raise DataError(f"[score] input {path!r} does not exist")
    _regular(path)
    if not path.lower().endswith(SUFFIXES):
        raise DataError(
            f"[score] input {path!r}: unknown kind; expected .parquet, .npy, .npz or a directory"
        )
    return [path]


def _regular(path: str) -> None:
    """Refuse what is not a regular file: opening a FIFO waits for a writer forever, and a
    device has no size to check declared sizes against."""
    try:
        mode = os.stat(path).st_mode
    except OSError as e:
        raise DataError(f"[score] cannot read {path!r}: {e.strerror}") from None
    if not stat.S_ISREG(mode):
        raise DataError(
            f"[score] {path!r} is not a regular file (a FIFO, device or directory); expected "
            ".parquet, .npy or .npz files"
        )


# What one sequence costs beyond its values while a piece and its window are held: its array
# view (~100 bytes), its slot in the piece's list and the window's, its length. Pieces are cut
# by it too: a file of short or empty sequences (3M empty rows in 7 KB of Parquet) made
# pieces of millions of rows, 623 MiB under a 16M memory limit. Callers add what each
# sequence's outputs take (Scorer.row_cost).
ROW_OBJECT_BYTES = 256


class Source:
    """All input files in order: ``count()`` sequences (from metadata, nothing read), then
    ``pieces(piece_bytes, row_cost)``: about ``piece_bytes`` of input (and ``row_cost`` bytes
    a sequence) per piece."""

    def __init__(self, path: str, C: int, dtype: np.dtype, options: Options | None = None):
        self.files = list_files(path)
        self.C, self.dtype = C, np.dtype(dtype)
        self.opts = options or Options()
        if self.opts.lengths_path and (len(self.files) != 1 or _kind(self.files[0]) != "npy"):
            raise DataError("[score] lengths= (--lengths) is for a single .npy input only; an "
                            ".npz or Parquet input carries its own lengths")  # fmt: skip
        kinds = {_kind(f) for f in self.files}
        for name, flag, kind in (("x_key", "--x-key", "npz"), ("lengths_key", "--lengths-key",
                                 "npz"), ("column", "--column", "parquet"),
                                 ("length_column", "--length-column", "parquet")):  # fmt: skip
            value = getattr(self.opts, name)
            if value is not None and kind not in kinds:  # it would be ignored
                raise DataError(
                    f"[score] {name}= / {flag} {value!r} is for .{kind} input, but input "
                    f"{path!r} holds no .{kind} file; drop it"
                )
        self._readers = [_reader(f, self) for f in self.files]

    def count(self) -> int:
        return sum(r.count() for r in self._readers)

    def pieces(self, piece_bytes: int, row_cost: int = ROW_OBJECT_BYTES) -> Iterator[Piece]:
        for r in self._readers:
            yield from r.pieces(piece_bytes, row_cost)

    def row_groups(self) -> list[tuple[str, int, int, int]]:
        """(file, row group, rows, uncompressed bytes) of every non-empty Parquet row group, in
        order, from the metadata alone: what the Ray path shares out."""
        out = []
        for r in self._readers:
            assert isinstance(r, _ParquetReader), r.path  # callers check the file names first
            md = r.metadata
            for g in range(md.num_row_groups):
                rg = md.row_group(g)
                if rg.num_rows:
                    out.append((r.path, g, rg.num_rows, rg.total_byte_size))
        return out

    def range_pieces(self, piece_bytes: int, ranges: list,
                     row_cost: int = ROW_OBJECT_BYTES) -> Iterator[Piece]:  # fmt: skip
        """The pieces of ``ranges`` ((row group, first row, end row) triples) of this Source's
        single Parquet file."""
        (r,) = self._readers
        return r.pieces(piece_bytes, row_cost, ranges)


def _kind(path: str) -> str:
    p = path.lower()
    return "npz" if p.endswith(".npz") else "npy" if p.endswith(".npy") else "parquet"


def _reader(path: str, src: Source):
    kind = _kind(path)
    if kind == "parquet":
        return _ParquetReader(path, src)
    return _NpyReader(path, src, kind)


def check_values(a: np.ndarray, where: str, what: str, first_row: int, offsets=None) -> None:
    """DataError naming the row and step of the first NaN/Inf. ``a``: [N, T, C] rows of padded
    steps, [L, C] the steps of the one row ``first_row``, or [sum L, C] rows' steps one after
    another, row i's from ``offsets[i]`` on."""
    if a.size == 0:
        return
    bad = ~np.isfinite(a)
    if not bad.any():
        return
    if a.ndim == 3:
        steps = bad.reshape(a.shape[0], a.shape[1], -1).any(axis=2)
        row = int(np.argmax(steps.any(axis=1)))
        step = int(np.argmax(steps[row]))
    else:
        first = int(np.argmax(bad.reshape(a.shape[0], -1).any(axis=1)))
        row = 0 if offsets is None else int(np.searchsorted(offsets, first, side="right") - 1)
        step = first - (0 if offsets is None else int(offsets[row]))
    raise DataError(
        f"[score] {where}, {what}, row {first_row + row}, step {step}: NaN or Inf in the "
        "input; expected finite values (clean the data, or pass allow_nonfinite=True / "
        "--allow-nonfinite to let them propagate to that sequence's outputs)"
    )


# ---------------------------------------------------------------------------------- Parquet
class _ParquetReader:
    def __init__(self, path: str, src: Source) -> None:
        import pyarrow as pa

        self.path, self.src = path, src
        # The footer is read and checked here, for every file before any work; the file is
        # opened again to read its rows (pieces). Kept open from here, a directory of 1,100
        # files ran out of descriptors, and a finished score's stayed open until a GC cycle.
        with self._open() as pf:
            self.metadata, schema = pf.metadata, pf.schema_arrow
        names = schema.names
        opts = src.opts
        lists = [f.name for f in schema if _is_list(f.type)]
        if opts.column is not None:
            if opts.column not in names:
                raise DataError(
                    f"[score] {path!r} has no column {opts.column!r}; its columns are {names}"
                )
            self.column = opts.column
        elif len(lists) == 1:
            self.column = lists[0]
        else:
            raise DataError(
                f"[score] {path!r}: {'no' if not lists else 'several'} list columns "
                f"({lists}) among {names}; expected one list column of sequences, or name it "
                "with column= / --column"
            )
        t = schema.field(self.column).type
        if not _is_list(t):
            raise DTypeError(
                f"[score] {path!r}, column {self.column!r} has type {t}; expected a list of "
                "feature vectors (list<list<float>> or list<fixed_size_list<float>>) or a "
                "flat list<float> of T*C values"
            )
        if opts.length_column is not None:
            if opts.length_column not in names:
                raise DataError(
                    f"[score] {path!r} has no length column {opts.length_column!r}; its columns "
                    f"are {names}"
                )
            self.length_column = opts.length_column
        else:
            self.length_column = next((n for n in PARQUET_LENGTH_NAMES if n in names), None)
        if self.length_column is not None:
            lt = schema.field(self.length_column).type
            if not pa.types.is_integer(lt):
                raise DTypeError(
                    f"[score] {path!r}, length column {self.length_column!r} has type {lt}; "
                    "expected integers"
                )

    def count(self) -> int:
        return self.metadata.num_rows

    def pieces(self, piece_bytes: int, row_cost: int = ROW_OBJECT_BYTES,
               ranges: list | None = None) -> Iterator[Piece]:  # fmt: skip
        """ranges: (row group, first row, end row) triples to read, in this order (None: every
        row; the Ray path hands each actor a share of a file). Rows before a range's first row
        are decoded and dropped: Parquet cannot start reading inside a row group."""

        md = self.metadata
        cols = [self.column] + ([self.length_column] if self.length_column else [])
        if ranges is None:
            ranges = [(g, 0, md.row_group(g).num_rows) for g in range(md.num_row_groups)]
        # pyarrow decodes a row group's column whole, whatever the batch size: a group larger
        # than a piece takes its size beyond the buffers the limit planned (pandas and pyarrow
        # write one group up to 1Mi rows: 10k sequences of T=32 peaked 2.6x a 64 MB limit).
        # The file cannot be read in less; say so, once, with the fix.
        big = max((md.row_group(g).total_byte_size for g, _, _ in ranges), default=0)
        if big > piece_bytes:
            _log.warning(
                "leanrnn: %r has row groups of up to %.1f MiB (uncompressed), which pyarrow "
                "decodes whole: memory will exceed the %.1f MiB read a piece may take under "
                "the memory limit by about that much. Rewrite the file with smaller row groups "
                "(pyarrow.parquet.write_table(table, path, row_group_size=N)) to stay within it",
                self.path,
                big / 2**20,
                piece_bytes / 2**20,
            )
        with self._open() as pf:
            # the rows are read as the footer read first says (self.metadata): a file
            # replaced since (a rename of a new version) was read as a mix of the two
            if not pf.metadata.equals(md):
                raise _changed(self.path)
            yield from self._read(pf, md, cols, ranges, piece_bytes, row_cost)

    def _open(self):
        """The file as a pyarrow ParquetFile (a context manager: closed after), or DataError."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        try:
            return pq.ParquetFile(self.path)
        except (OSError, pa.ArrowException) as e:
            raise DataError(f"[score] {self.path!r} is not a readable Parquet file: {e}") from None

    def _read(self, pf, md, cols, ranges, piece_bytes: int, row_cost: int) -> Iterator[Piece]:
        import pyarrow as pa

        for g, r0, r1 in ranges:
            rg = md.row_group(g)
            r1 = min(r1, rg.num_rows)
            if r1 <= r0:
                continue
            per_row = rg.total_byte_size // rg.num_rows + row_cost
            rows = max(1, min(r1 - r0, piece_bytes // per_row))
            where = f"{self.path!r}, row group {g}"
            start = 0  # row group row of b's first row
            try:
                batches = pf.iter_batches(batch_size=rows, row_groups=[g], columns=cols)
                for b in batches:
                    n = b.num_rows
                    lo, hi = max(0, r0 - start), min(n, r1 - start)
                    if hi > lo:
                        if hi - lo < n:
                            b = b.slice(lo, hi - lo)
                        lengths = None
                        if self.length_column:
                            lengths = b.column(self.length_column)
                        seqs = arrow_to_seqs(
                            b.column(self.column), lengths, self.src.C, self.src.dtype, where,
                            self.column, self.length_column, start + lo,
                            self.src.opts.allow_nonfinite,
                        )  # fmt: skip
                        nbytes = b.nbytes + sum(x.nbytes for x in seqs)
                        yield Piece(seqs, where, start + lo, nbytes)
                    start += n
                    if start >= r1:
                        break
            except (OSError, pa.ArrowException) as e:
                raise DataError(
                    f"[score] {where}, column {self.column!r}: cannot read ({e}); the file "
                    "is corrupt or truncated"
                ) from None


def _is_list(t) -> bool:
    import pyarrow as pa

    return pa.types.is_list(t) or pa.types.is_large_list(t) or pa.types.is_fixed_size_list(t)


def _floats(values, where: str, column: str, dtype: np.dtype) -> np.ndarray:
    import pyarrow as pa

    if not pa.types.is_floating(values.type):
        raise DTypeError(
            f"[score] {where}, column {column!r} holds {values.type} values; expected float32 "
            "or float64 (cast the column to float)"
        )
    if values.null_count:
        raise DataError(
            f"[score] {where}, column {column!r}: {values.null_count} null feature values; "
            "expected every value present"
        )
    a = values.to_numpy(zero_copy_only=False)
    # float32 <-> float64 is converted here (reading a file is a conversion anyway, and
    # pandas writes float64 by default); anything else was refused above.
    return a if a.dtype == dtype else a.astype(dtype)


def _offsets(arr) -> np.ndarray:
    import pyarrow as pa

    if pa.types.is_fixed_size_list(arr.type):
        n = arr.type.list_size
        return np.arange(len(arr) + 1, dtype=np.int64) * n
    off = arr.offsets.to_numpy().astype(np.int64)
    return off - off[0]


def _lengths(raw: np.ndarray, limit, message) -> np.ndarray:
    """``raw`` integer lengths as int64, after a LengthsError(message(row, length)) for the
    first row whose length is outside 0..limit[row] (uint64 past int64's range is out of it:
    cast first, 2**64 - 1 was named "length -1")."""
    if raw.dtype.kind == "u":
        bad = raw > np.minimum(np.asarray(limit), np.iinfo(np.int64).max).astype(np.uint64)
    else:
        bad = (raw < 0) | (raw > limit)
    if bad.any():
        row = int(np.argmax(bad))
        raise LengthsError(message(row, int(raw[row])))
    return raw.astype(np.int64)


def arrow_to_seqs(col, lengths, C: int, dtype, where: str, column: str,
                  length_column: str | None, first_row: int = 0,
                  allow_nonfinite: bool = False) -> list[np.ndarray]:  # fmt: skip
    """One Arrow list column (array or chunked) of sequences -> [T_i, C] arrays.

    col: list<list<float>> | list<fixed_size_list<float>[C]> (one feature vector per step) or
    list<float> (T*C values per row); lengths: optional integer array: each row's valid steps
    (its data may be longer: padding, dropped; never shorter).
    """
    import pyarrow as pa

    dtype = np.dtype(dtype)
    if isinstance(col, pa.ChunkedArray):
        col = col.combine_chunks()
    if isinstance(lengths, pa.ChunkedArray):
        lengths = lengths.combine_chunks()
    if lengths is not None and not pa.types.is_integer(lengths.type):
        # (the file readers check their schema first; a Ray batch reaches here unchecked, and
        # 2.9 ran as 2, NaN as 0: a pandas integer column with one missing value is float64)
        raise DTypeError(
            f"[score] {where}, length column {length_column!r} has type {lengths.type}; "
            "expected integers (fill or drop missing lengths, then cast the column to int)"
        )
    n = len(col)
    if col.null_count:
        row = int(np.argmax(col.is_null().to_numpy(zero_copy_only=False)))
        raise DataError(
            f"[score] {where}, column {column!r}, row {first_row + row}: null sequence; "
            "expected a list (an empty list for a length-0 sequence)"
        )
    if not _is_list(col.type):
        raise DTypeError(
            f"[score] {where}, column {column!r} has type {col.type}; expected a list column"
        )
    outer = _offsets(col)
    inner = col.flatten()
    if _is_list(inner.type):  # one feature vector per step
        if inner.null_count:
            raise DataError(
                f"[score] {where}, column {column!r}: null feature vectors; expected every "
                "step present"
            )
        ioff = _offsets(inner)
        widths = np.diff(ioff)
        if widths.size and (widths.min() != widths.max()):
            step = int(np.argmax(widths != widths[0]))
            row = int(np.searchsorted(outer, step, side="right") - 1)
            raise ShapeError(
                f"[score] {where}, column {column!r}, row {first_row + row}: ragged features "
                f"(a step with {int(widths[step])} values after steps with {int(widths[0])}); "
                f"expected every step to have C={C} values"
            )
        if widths.size and widths[0] != C:
            raise ShapeError(
                f"[score] {where}, column {column!r}: feature vectors have {int(widths[0])} "
                f"values; the model expects C={C}"
            )
        flat = _floats(inner.flatten(), where, column, dtype).reshape(-1, C)
        steps = np.diff(outer)
    else:  # flat list<float>: T*C values per row
        flat = _floats(inner, where, column, dtype)
        sizes = np.diff(outer)
        if sizes.size and (sizes % C).any():
            row = int(np.argmax(sizes % C))
            raise ShapeError(
                f"[score] {where}, column {column!r}, row {first_row + row}: {int(sizes[row])} "
                f"values, not a multiple of the model's C={C}; expected T*C values per row "
                "(or one list per step)"
            )
        flat = flat.reshape(-1, C)
        outer = outer // C
        steps = np.diff(outer)
    if lengths is not None:
        if lengths.null_count:
            raise LengthsError(
                f"[score] {where}, length column {length_column!r}: null lengths; expected "
                "an integer per row"
            )
        lens = _lengths(lengths.to_numpy(zero_copy_only=False), steps, lambda row, n: (
            f"[score] {where}, length column {length_column!r}, row {first_row + row}: "
            f"length {n} but the row holds {int(steps[row])} steps; expected "
            "0 <= length <= steps in the data"))  # fmt: skip
    else:
        lens = steps
    seqs = [flat[outer[i] : outer[i] + lens[i]] for i in range(n)]
    if not allow_nonfinite:
        if lengths is None:
            check_values(flat, where, f"column {column!r}", first_row, outer)
        else:
            for i, s in enumerate(seqs):
                check_values(s, where, f"column {column!r}", first_row + i)
    return seqs


# ----------------------------------------------------------------------------- npy / npz
def _changed(path: str) -> DataError:
    """A file replaced or rewritten between its header's read and its rows': read as a mix of
    the two versions before (2 rows scored from the new bytes read as the old [2, 6, 3],
    where they were [4, 3, 3]). Told by what the header says and the size, not by inode or
    modification time: a FUSE mount may renumber inodes of files nobody changed."""
    return DataError(
        f"[score] {path!r} changed while it was being scored (replaced or rewritten after its "
        "header was read, before its rows were): score it again once it is written"
    )


@dataclass
class _Member:
    """A stored .npy array: its header, and how to open its data as a stream."""

    path: str
    key: str | None  # npz member name (None for a plain .npy)
    shape: tuple[int, ...]
    dtype: np.dtype
    data_bytes: int  # bytes the file holds after the header

    def open(self):
        """(file object positioned at the data, closer); DataError if the file no longer holds
        what the header read first said (_changed)."""
        if self.key is None:
            f = open(self.path, "rb")
            closers = [f.close]
            size = os.fstat(f.fileno()).st_size
        else:
            z = zipfile.ZipFile(self.path)
            try:
                f = z.open(self.key)
            except BaseException:
                z.close()
                raise
            closers = [f.close, z.close]
            size = z.getinfo(self.key).file_size
        try:
            shape, dtype = _read_header(f, self.path, self.key)
            if (shape, dtype, size - f.tell()) != (self.shape, self.dtype, self.data_bytes):
                raise _changed(self.path)
        except BaseException:
            for close in closers:
                close()
            raise

        def close():
            for c in closers:
                c()

        return f, close


def _read_header(f, path: str, key: str | None):
    what = f"{path!r}" + (f" member {key!r}" if key else "")
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        else:
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    except (ValueError, OSError, SyntaxError, EOFError, tokenize.TokenError) as e:
        # TokenError: header text that never closes its dict or tuple (np's literal_eval)
        raise DataError(f"[score] {what} is not a readable .npy array: {e}") from None
    if dtype.hasobject:
        raise DTypeError(f"[score] {what} holds Python objects; expected a numeric array")
    if fortran and len(shape) > 1:
        raise DataError(
            f"[score] {what} is stored in Fortran order; expected C order (save "
            "np.ascontiguousarray(x)) so it can be read row by row"
        )
    return shape, dtype


def _members(path: str, kind: str) -> dict[str, _Member]:
    try:
        if kind == "npy":
            _regular(path)  # a --lengths FIFO would wait for a writer
            with open(path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                shape, dtype = _read_header(f, path, None)
                hdr = f.tell()
            return {"": _Member(path, None, shape, dtype, size - hdr)}
        from ..formats.checkpoint import check_zip_sizes  # here: `import leanrnn` loads score

        out = {}
        with zipfile.ZipFile(path) as z:
            check_zip_sizes(z, path, "score", DataError)  # before a read inflates a bomb
            for info in z.infolist():
                if not info.filename.endswith(".npy"):
                    continue
                with z.open(info) as f:
                    shape, dtype = _read_header(f, path, info.filename)
                    hdr = f.tell()
                out[info.filename[:-4]] = _Member(
                    path, info.filename, shape, dtype, info.file_size - hdr
                )
        return out
    except (OSError, zipfile.BadZipFile, EOFError) as e:
        raise DataError(f"[score] {path!r} is not a readable .{kind} file: {e}") from None


def _pick(members: dict, wanted: str | None, defaults: tuple, path: str, what: str, need: bool):
    if wanted is not None:
        if wanted not in members:
            raise DataError(
                f"[score] {path!r} has no array {wanted!r} ({what}); it holds {sorted(members)}"
            )
        return members[wanted]
    for k in defaults:
        if k in members:
            return members[k]
    if need and len(members) == 1:
        return next(iter(members.values()))
    if need:
        raise DataError(
            f"[score] {path!r}: which array holds the {what}? it holds {sorted(members)}; "
            f"expected one named {defaults[0]!r} (or pass x_key= / --x-key)"
        )
    return None


class _NpyReader:
    """Padded [N, T, C] sequences (batch-first) + optional lengths [N]."""

    def __init__(self, path: str, src: Source, kind: str) -> None:
        self.path, self.src = path, src
        opts = src.opts
        members = _members(path, kind)
        if kind == "npy":
            self.x = members[""]
            lm = None
            if opts.lengths_path:
                lm = _members(opts.lengths_path, "npy")[""]
        else:
            self.x = _pick(members, opts.x_key, NPZ_X_KEYS, path, "padded sequences", True)
            lm = _pick(members, opts.lengths_key, NPZ_LENGTH_KEYS, path, "lengths", False)
        x, C = self.x, src.C
        name = f"{path!r}" + (f" array {x.key[:-4]!r}" if x.key else "")
        self.name = name
        if x.dtype.kind != "f":
            raise DTypeError(
                f"[score] {name} has dtype {x.dtype}; expected float32 or float64 "
                f"(x.astype(np.{src.dtype.name}))"
            )
        if len(x.shape) != 3 or x.shape[2] != C:
            raise ShapeError(
                f"[score] {name} has shape {x.shape}; expected [N, T, C={C}] (padded, batch-first)"
            )
        if any(d < 0 for d in x.shape):  # (np.load refuses them; np.prod would wrap around)
            raise DataError(f"[score] {name} declares shape {x.shape}: a negative dimension")
        need = math.prod(x.shape) * x.dtype.itemsize
        if x.shape[0] and not x.shape[1]:
            # no bytes back each declared sequence: 2**40 of them in a 128-byte file
            raise DataError(
                f"[score] {name} declares {x.shape[0]} sequences of T=0 steps; the file holds no "
                "step to score (expected T >= 1)"
            )
        if need > x.data_bytes:
            raise DataError(
                f"[score] {name} declares shape {x.shape} ({need} bytes) but the file holds "
                f"{x.data_bytes}; it is truncated"
            )
        N, T = x.shape[0], x.shape[1]
        self.lengths = None
        if lm is not None:
            lname = f"{lm.path!r}" + (f" array {lm.key[:-4]!r}" if lm.key else "")
            if lm.dtype.kind not in "iu" or lm.shape != (N,):
                raise LengthsError(
                    f"[score] {lname} is {lm.dtype}{list(lm.shape)}; expected integer [N={N}]"
                )
            if lm.shape[0] * lm.dtype.itemsize > lm.data_bytes:
                raise DataError(f"[score] {lname} is truncated")
            f, close = lm.open()
            try:
                raw = np.frombuffer(f.read(N * lm.dtype.itemsize), lm.dtype)
            finally:
                close()
            self.lengths = _lengths(raw, T, lambda row, n: (
                f"[score] {lname}, row {row}: length {n}; expected 0 <= length <= T={T}"))  # fmt: skip

    def count(self) -> int:
        return self.x.shape[0]

    def pieces(self, piece_bytes: int, row_cost: int = ROW_OBJECT_BYTES) -> Iterator[Piece]:
        x, dt = self.x, self.src.dtype
        N, T, C = x.shape
        row_bytes = T * C * x.dtype.itemsize
        rows = max(1, piece_bytes // (row_bytes + row_cost))
        f, close = x.open()
        try:
            for r0 in range(0, N, rows):
                r1 = min(N, r0 + rows)
                raw = f.read((r1 - r0) * row_bytes)
                if len(raw) != (r1 - r0) * row_bytes:
                    raise DataError(f"[score] {self.name}, row {r0}: the file ends early")
                a = np.frombuffer(raw, x.dtype).reshape(r1 - r0, T, C)
                if a.dtype != dt:
                    a = a.astype(dt)
                lens = self.lengths[r0:r1] if self.lengths is not None else None
                seqs = [a[i, : (T if lens is None else lens[i])] for i in range(r1 - r0)]
                if not self.src.opts.allow_nonfinite:
                    if lens is None:
                        check_values(a, self.name, "x", r0)
                    else:
                        for i, s in enumerate(seqs):
                            check_values(s, self.name, "x", r0 + i)
                yield Piece(seqs, self.name, r0, a.nbytes)
        except (OSError, zipfile.BadZipFile, EOFError) as e:
            raise DataError(f"[score] {self.name}: cannot read ({e})") from None
        finally:
            close()
