"""Writing scores in input order, piece by piece, to Parquet or ``.npz``; a file appears under
its name only once complete (written to a temporary name in the same directory, renamed at the
end, removed on error).

Columns / arrays (one row per input sequence; K = proj_size or hidden, D directions, L layers):
  length  int64                        the sequence's length
  h_n     [L*D, K]  final hidden state of every layer and direction (zeros for length 0)
  c_n     [L*D, H]  final LSTM cell state
  y       [T_i, D*K] the last layer's per-step outputs. Parquet: a list (length T_i) of
          fixed-size lists; npz: padded [N, T_max, D*K] next to ``length``.
Parquet stores h_n/c_n as fixed_size_list<fixed_size_list<float>[K]>[L*D].
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
import zipfile
from dataclasses import dataclass

import numpy as np

from .._files import install, refused_as_error, temp_beside, through_link
from .data import DataError


@dataclass
class Results:
    """Scores of consecutive input sequences. y_flat [sum T_i, D*K] holds sequence i's steps at
    rows y_off[i]:y_off[i+1]."""

    lengths: np.ndarray
    h_n: np.ndarray | None
    c_n: np.ndarray | None
    y_flat: np.ndarray | None
    y_off: np.ndarray | None

    def __len__(self) -> int:
        return len(self.lengths)


def temp_name(path: str) -> str:
    """A hidden file next to ``path`` that is this call's own (files.temp_beside): the pid alone
    was shared by two threads writing one output (the second rename then found the file gone),
    and a name built from ``path``'s passed the 255-byte limit when ``path``'s was near it."""
    return temp_beside(path, os.path.splitext(path)[1])


def to_arrow(r: Results):
    """Results -> a pyarrow Table with the columns above."""
    import pyarrow as pa

    cols = {"length": pa.array(r.lengths, pa.int64())}
    for name in ("h_n", "c_n"):
        a = getattr(r, name)
        if a is not None:
            n, LD, K = a.shape
            inner = pa.FixedSizeListArray.from_arrays(pa.array(a.reshape(-1)), K)
            cols[name] = pa.FixedSizeListArray.from_arrays(inner, LD)
    if r.y_flat is not None:
        DK = r.y_flat.shape[1]
        steps = pa.FixedSizeListArray.from_arrays(pa.array(r.y_flat.reshape(-1)), DK)
        off = r.y_off
        if off[-1] < 2**31:
            cols["y"] = pa.ListArray.from_arrays(pa.array(off.astype(np.int32)), steps)
        else:
            cols["y"] = pa.LargeListArray.from_arrays(pa.array(off.astype(np.int64)), steps)
    return pa.table(cols)


class ParquetOut:
    def __init__(self, path: str) -> None:
        self.path = through_link(path)
        self.tmp = temp_name(self.path)
        self._w = None

    def write(self, r: Results) -> None:
        self.write_table(to_arrow(r))

    def write_table(self, t) -> None:
        """t: a pyarrow Table of to_arrow's columns (the Ray path's actors send these)."""
        import pyarrow.parquet as pq

        if self._w is None:
            # No dictionary pages for the float columns: model outputs hardly ever repeat, so
            # pyarrow's attempt (hash every value, then fall back to plain) costs ~40% of
            # writing them for nothing.
            dict_cols = [c for c in t.schema.names if c == "length"]
            with refused_as_error(self.path, "score"):
                self._w = pq.ParquetWriter(self.tmp, t.schema, use_dictionary=dict_cols)
        with refused_as_error(self.path, "score"):
            self._w.write_table(t)

    def close(self, empty: Results) -> None:
        if self._w is None:  # no input at all: an empty file with the right columns
            self.write(empty)
        with refused_as_error(self.path, "score"):
            self._w.close()
            install(self.tmp, self.path)

    def abort(self) -> None:
        if self._w is not None:
            try:
                self._w.close()
            except Exception:
                pass
        _remove(self.tmp)


class NpzOut:
    """Spools each array to a raw file next to the output, then writes the .npz (uncompressed,
    as np.savez) member by member in pieces: nothing is held whole, and the padded y needs the
    longest length, known only at the end."""

    PIECE = 16 << 20

    def __init__(self, path: str) -> None:
        self.path = through_link(path)
        self.tmp = temp_name(self.path)
        with refused_as_error(self.path, "score"):
            self._dir = tempfile.mkdtemp(prefix=".leanrnn-score-", dir=os.path.dirname(self.tmp))
        self._files: dict[str, object] = {}
        self._meta: dict[str, tuple] = {}  # name -> (row shape, dtype)
        self._n = 0
        self._tmax = 0

    def _spool(self, name: str, a: np.ndarray) -> None:
        f = self._files.get(name)
        if f is None:
            f = self._files[name] = open(os.path.join(self._dir, name), "wb")
            self._meta[name] = (a.shape[1:], a.dtype)
        f.write(np.ascontiguousarray(a).data)

    def write(self, r: Results) -> None:
        with refused_as_error(self.path, "score"):
            self._spool("length", r.lengths.astype(np.int64))
            for name in ("h_n", "c_n", "y"):
                a = r.y_flat if name == "y" else getattr(r, name)
                if a is not None:
                    self._spool(name, a)
        if len(r):
            self._tmax = max(self._tmax, int(r.lengths.max()))
        self._n += len(r)

    def close(self, empty: Results) -> None:
        if self._n == 0:
            self.write(empty)
        try:
            with refused_as_error(self.path, "score"):
                for f in self._files.values():
                    f.close()  # (flushing: a full disk may refuse the last piece here)
                with zipfile.ZipFile(self.tmp, "w", zipfile.ZIP_STORED, allowZip64=True) as z:
                    for name, (row, dt) in self._meta.items():
                        src = os.path.join(self._dir, name)
                        if name == "y":
                            self._write_y(z, src, row, dt)
                        else:
                            with (
                                open(src, "rb") as f,
                                z.open(name + ".npy", "w", force_zip64=True) as o,
                            ):
                                _header(o, (self._n, *row), dt)
                                shutil.copyfileobj(f, o, self.PIECE)
                install(self.tmp, self.path)
        finally:
            shutil.rmtree(self._dir, ignore_errors=True)

    def _write_y(self, z, src: str, row: tuple, dt: np.dtype) -> None:
        (DK,) = row
        lens = np.fromfile(os.path.join(self._dir, "length"), np.int64)
        T = self._tmax
        rows = max(1, self.PIECE // max(1, T * DK * dt.itemsize))
        with open(src, "rb") as f, z.open("y.npy", "w", force_zip64=True) as o:
            _header(o, (self._n, T, DK), dt)
            for r0 in range(0, self._n, rows):
                part = lens[r0 : r0 + rows]
                flat = np.frombuffer(f.read(int(part.sum()) * DK * dt.itemsize), dt)
                flat = flat.reshape(-1, DK)
                block = np.zeros((len(part), T, DK), dt)
                off = 0
                for i, t in enumerate(part):
                    block[i, :t] = flat[off : off + t]
                    off += t
                o.write(block.data)

    def abort(self) -> None:
        # (on a full disk a spool file's close flushes and fails again: that error replaced the
        # one naming the output, and the spool folder stayed behind)
        for f in self._files.values():
            with contextlib.suppress(OSError):
                f.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        _remove(self.tmp)


def _header(f, shape: tuple, dt: np.dtype) -> None:
    np.lib.format.write_array_header_2_0(
        f, {"descr": np.lib.format.dtype_to_descr(dt), "fortran_order": False, "shape": shape}
    )


def _remove(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def open_output(path: str):
    p = path.lower()
    if p.endswith((".parquet", ".pq")):
        return ParquetOut(path)
    if p.endswith(".npz"):
        return NpzOut(path)
    raise DataError(f"[score] output {path!r}: expected a .parquet or .npz file name")
