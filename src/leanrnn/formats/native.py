"""The native format ``.lrnn``: packed recurrent stacks and the op-graph IR (``leanrnn.ir``).

A ``.lrnn`` file is a safetensors file: an 8-byte little-endian header length, a JSON header, then
the tensor bytes. Any safetensors reader opens it. The header's ``__metadata__`` holds
``format = "leanrnn"``, ``version``, ``kind`` (``"rnn"``: one recurrent stack; ``"graph"``: an op
graph around RNN nodes), the spec or graph as JSON, and a checksum over that metadata and the data.

The packed tensors are stored exactly as ``PackedWeights`` lays them out in memory (every tensor a
multiple of 64 bytes, so the safetensors rule "no holes" holds and the data section starts on a
64-byte boundary): loading reads each RNN's tensors straight into the engine's own aligned buffer
(in chunks shared between threads, each summed for the checksum as it arrives).
Loading never executes code, and every size is checked against the file before anything is
allocated.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import struct
import sys
import threading
import zlib
from dataclasses import dataclass

import numpy as np

from .. import threads
from .._files import replacing
from ..errors import LeanRNNError, ModelFormatError
from ..ir import (
    RNN_OPS,
    Graph,
    Node,
    TensorInfo,
    check_opset,
    check_rnn_io,
    is_count,
    rnn_attrs,
    rnn_from_node,
)
from ..memory.arena import aligned_empty, round_up
from ..spec import USES_ALPHA, USES_BETA, RNNSpec
from .packing import (
    PRECISIONS,
    SUPPORTED_DTYPES,
    PackedLayer,
    PackedWeights,
    check_precision,
    panel_format,
    tensor_dtype,
    unmarked_bf16,
)
from .quantize import bf16_value, check_loaded

FORMAT = "leanrnn"
# 2: one-pass block-weighted data checksum (version 1 files still load); 3: a graph's RNN node
# may share another's packed weights ({"shares": node}). A file is written in the oldest
# version that holds it (2 unless it shares), so an older leanrnn reads every file it can.
VERSION = SHARES_VERSION = 3
WRITTEN_VERSION = 2
# A header is JSON text: a tensor entry is ~80 bytes and a graph of 10,000 nodes ~1 MiB, so
# 16 MiB is far beyond any real model's (save refuses to write more). Parsed, JSON takes up to ~30x its text in Python
# objects (a 23 MiB header of empty objects peaked at 665 MiB under the old 64 MiB bound).
MAX_HEADER_BYTES = 16 << 20
MAX_NDIM = 64  # numpy's limit on an array's rank (numpy 2)

# safetensors dtype codes <-> numpy
_ST_DTYPES = {
    "F64": np.float64,
    "F32": np.float32,
    "F16": np.float16,
    "I64": np.int64,
    "I32": np.int32,
    "I16": np.int16,
    "I8": np.int8,
    "U64": np.uint64,
    "U32": np.uint32,
    "U16": np.uint16,
    "U8": np.uint8,
    "BOOL": np.bool_,
}
_ST_CODES = {np.dtype(v): k for k, v in _ST_DTYPES.items()}
# Read only: bfloat16 tensors of other writers' files (Hugging Face's) as their uint16 bits,
# widened to float32 by read_safetensors (exact); leanrnn writes none.
_ST_READ_ONLY = {"BF16": np.uint16}


# ------------------------------------------------------------------- safetensors: the container
@dataclass(frozen=True)
class _Entry:
    name: str
    dtype: np.dtype
    shape: tuple[int, ...]
    begin: int
    end: int
    bf16: bool = False  # a BF16 tensor read as its uint16 bits (read_safetensors widens it)


class _Container:
    """A parsed and size-checked safetensors header; tensors are read on demand, from ``f``
    when the header was read from it: a reader that opens the path once sees one file whole
    (opened by name for the size, the header and the data in turn, a load during another
    process's atomic save mixed two files: one's spec with the other's weights)."""

    def __init__(self, path: str, op: str, f=None) -> None:
        self.path, self.op = path, op
        with _opened(path, op) if f is None else contextlib.nullcontext(f) as f:
            self.size, n, header = _read_header(f, path, op)
        self.data_start = 8 + n
        self.data_size = self.size - self.data_start
        meta = header.pop("__metadata__", None) or {}
        if not isinstance(meta, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items()
        ):
            raise ModelFormatError(f"[{op}] {path!r}: __metadata__ must map strings to strings")
        self.metadata: dict[str, str] = meta
        self.entries: dict[str, _Entry] = {}
        for name, e in header.items():
            self.entries[name] = self._entry(name, e)
        # safetensors: the data section is exactly covered, without holes or overlaps.
        spans = sorted((e.begin, e.end, e.name) for e in self.entries.values())
        cursor = 0
        for begin, end, name in spans:
            if begin != cursor:
                raise ModelFormatError(
                    f"[{op}] {path!r}: tensor {name!r} starts at byte {begin}; expected {cursor} "
                    "(tensors must tile the data section without holes or overlaps)"
                )
            cursor = end
        if cursor != self.data_size:
            raise ModelFormatError(
                f"[{op}] {path!r}: tensors cover {cursor} bytes but the data section holds "
                f"{self.data_size} (truncated, or trailing bytes)"
            )
        # Entries by prefix ("" for a plain stack, "rnn:<node>:" for a graph's RNN node), in
        # file order: grouped once, so reading k packed nodes costs O(entries), not O(k*entries).
        self.groups: dict[str, list[_Entry]] = {}
        for *_, name in spans:
            prefix = name.rpartition(":")[0] + ":" if ":" in name else ""
            self.groups.setdefault(prefix, []).append(self.entries[name])

    def _entry(self, name: str, e) -> _Entry:
        op, path = self.op, self.path
        if not isinstance(e, dict):
            raise ModelFormatError(f"[{op}] {path!r}: entry {name!r} is not an object")
        code, shape, offs = e.get("dtype"), e.get("shape"), e.get("data_offsets")
        if code not in _ST_DTYPES and code not in _ST_READ_ONLY:
            raise ModelFormatError(
                f"[{op}] {path!r}: tensor {name!r} has dtype {code!r}; expected one of "
                f"{sorted(_ST_DTYPES)}"
            )
        if not isinstance(shape, list) or not all(is_count(s) for s in shape):
            raise ModelFormatError(
                f"[{op}] {path!r}: tensor {name!r} has shape {shape!r}; "
                "expected a list of non-negative ints"
            )
        if len(shape) > MAX_NDIM:
            raise ModelFormatError(
                f"[{op}] {path!r}: tensor {name!r} has {len(shape)} dims; numpy arrays have "
                f"at most {MAX_NDIM} (corrupt or hostile header)"
            )
        if not (isinstance(offs, list) and len(offs) == 2 and all(is_count(o) for o in offs)):
            raise ModelFormatError(
                f"[{op}] {path!r}: tensor {name!r} has data_offsets {offs!r}; expected [begin, end]"
            )
        dtype = np.dtype(_ST_DTYPES.get(code) or _ST_READ_ONLY[code])
        want = math.prod(shape) * dtype.itemsize  # Python ints: no overflow
        begin, end = offs
        if end < begin or end > self.data_size or end - begin != want:
            raise ModelFormatError(
                f"[{op}] {path!r}: tensor {name!r} {code}{shape} needs {want} bytes but its "
                f"offsets [{begin}, {end}] span {end - begin} of a {self.data_size}-byte data "
                "section"
            )
        return _Entry(name, dtype, tuple(shape), begin, end, code == "BF16")

    def read_into(self, f, entry_begin: int, buf: np.ndarray) -> None:
        f.seek(self.data_start + entry_begin)
        got = f.readinto(memoryview(buf).cast("B"))
        if got != buf.nbytes:
            raise self._short(got, buf.nbytes)

    def _short(self, got: int, want: int) -> ModelFormatError:
        return ModelFormatError(
            f"[{self.op}] {self.path!r}: read {got} of {want} bytes (file truncated while reading?)"
        )

    def read_regions(self, f, regions: list[tuple[int, np.ndarray]], version: int) -> list[str]:
        """Read each (data-section offset, contiguous uint8 buffer) of ``regions`` and return
        their digests ('' for an empty one; ``_region_digest``'s with the CRC of a tail of
        under 8 bytes).

        A version-2 digest is made as the bytes arrive: each chunk of ``_READ_CHUNK`` bytes is
        summed by 4 KiB block right after its read, while it is still in this core's cache,
        and from ``_PARALLEL_READ_BYTES`` on the chunks of all regions are shared between
        threads, one run of consecutive chunks each. On a VM where a fresh page's fault and the
        copy out of the page cache each ran at ~4 GB/s and the digest as a second pass at ~6,
        reading and summing a 16 MiB model went from 9.5 ms to 5.6 (benchmarks/bench_load.py,
        part 1). The reads are ``os.preadv`` at their own offsets (no shared file position)
        and release the GIL, as numpy's sums do. The threads are started for the call: a
        pool's first use (its import, its threads) cost more than the split saved."""
        if version < 2:
            out = []
            for begin, buf in regions:
                self.read_into(f, begin, buf)
                out.append(_region_digest_v1(_words(buf)) + _tail_crc(buf) if buf.nbytes else "")
            return out
        tasks = [  # (region, chunk start, chunk end): region order, then file order
            (r, a, min(a + _READ_CHUNK, buf.nbytes))
            for r, (_, buf) in enumerate(regions)
            for a in range(0, buf.nbytes, _READ_CHUNK)
        ]
        total = sum(buf.nbytes for _, buf in regions)
        parts = threads.pool_threads(len(tasks)) if total >= _PARALLEL_READ_BYTES and _PREADV else 1
        sums: list = [None] * len(tasks)
        failed: list[BaseException] = []
        fd = f.fileno()

        def run(lo: int, hi: int) -> None:
            try:
                for i in range(lo, hi):
                    r, a, b = tasks[i]
                    begin, buf = regions[r]
                    view, start, got = memoryview(buf).cast("B"), self.data_start + begin, a
                    while got < b:
                        if _PREADV:
                            k = os.preadv(fd, [view[got:b]], start + got)
                        else:  # pragma: no cover - one thread here (Windows has no preadv)
                            f.seek(start + got)
                            k = f.readinto(view[got:b])
                        if k <= 0:
                            raise self._short(got, buf.nbytes)
                        got += k
                    sums[i] = _block_sums(_words(buf[a:b]))
            except BaseException as e:  # re-raised by the caller, on its own thread
                failed.append(e)

        # runs of consecutive tasks of about equal bytes (every chunk but a region's last is
        # _READ_CHUNK): by count is close enough
        cuts = [len(tasks) * k // parts for k in range(parts + 1)]
        started, here = [], [(cuts[0], cuts[1])]
        for k in range(1, parts):
            t = threading.Thread(target=run, args=(cuts[k], cuts[k + 1]), name="leanrnn-read")
            try:
                t.start()
                started.append(t)
            except RuntimeError:  # no thread to be had (a process limit): read that share here
                here.append((cuts[k], cuts[k + 1]))
        for lo, hi in here:
            run(lo, hi)
        for t in started:
            t.join()
        if failed:
            raise failed[0]
        out, i = [], 0
        for _, buf in regions:
            n = -(-buf.nbytes // _READ_CHUNK)
            if not n:
                out.append("")
                continue
            out.append(_combine_sums(np.concatenate(sums[i : i + n])) + _tail_crc(buf))
            i += n
        return out

    def array(self, f, e: _Entry) -> np.ndarray:
        out = np.empty(e.shape, e.dtype)
        if out.nbytes:
            self.read_into(f, e.begin, out)
        if out.dtype.byteorder == ">":  # pragma: no cover - big-endian hosts
            out = out.byteswap().view(out.dtype.newbyteorder("<"))
        return out


@contextlib.contextmanager
def _opened(path: str, op: str):
    """``path`` open for reading; the OS's refusal as a ModelFormatError naming it."""
    try:
        f = open(path, "rb")
    except OSError as e:
        raise ModelFormatError(f"[{op}] cannot read {path!r}: {e.strerror}") from None
    with f:
        yield f


def _read_header(f, path: str, op: str) -> tuple[int, int, dict]:
    """(file size, header length, parsed header) of the safetensors file open as ``f`` (read
    from its start); the declared header length is checked against the file before it is
    read."""
    size = os.fstat(f.fileno()).st_size
    f.seek(0)
    head = f.read(8)
    if len(head) < 8:
        raise ModelFormatError(
            f"[{op}] {path!r} is {size} bytes; a safetensors/.lrnn file starts with "
            "an 8-byte header length (file truncated?)"
        )
    (n,) = struct.unpack("<Q", head)
    if MAX_HEADER_BYTES < n <= size - 8:
        raise ModelFormatError(
            f"[{op}] {path!r} declares a {n}-byte header; refusing more than "
            f"{MAX_HEADER_BYTES} bytes of JSON (no model's header is that large)"
        )
    if n < 2 or n > size - 8:
        raise ModelFormatError(
            f"[{op}] {path!r} declares a {n}-byte header but the file holds "
            f"{size - 8} bytes after the length field (truncated or corrupt)"
        )
    raw = f.read(n)
    if len(raw) != n:
        raise ModelFormatError(f"[{op}] {path!r}: header truncated ({len(raw)} of {n} bytes)")
    try:
        header = json.loads(raw.decode("utf-8"))
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError) as e:
        raise ModelFormatError(f"[{op}] {path!r}: header is not valid JSON ({e})") from None
    except ValueError:  # an integer of more than sys.get_int_max_str_digits() digits
        raise ModelFormatError(
            f"[{op}] {path!r}: header holds a number of over {sys.get_int_max_str_digits()} "
            "digits; no tensor size or offset is that long (corrupt or hostile file)"
        ) from None
    if not isinstance(header, dict):
        raise ModelFormatError(
            f"[{op}] {path!r}: header is {type(header).__name__}; expected a JSON object"
        )
    return size, n, header


def is_safetensors(head: bytes, size: int | None = None) -> bool:
    """Whether ``head`` (the first >= 9 bytes of a file) looks like a safetensors header; with
    the file's ``size``, also whether the header length it declares fits in the file."""
    if len(head) < 9 or head[8:9] != b"{":
        return False
    n = struct.unpack("<Q", head[:8])[0]
    return n >= 2 and (size is None or n <= size - 8)


def read_safetensors(path: str, op: str = "load") -> dict[str, np.ndarray]:
    """Every tensor of a plain safetensors file, sizes checked against the file first."""
    out = {}
    with _opened(str(path), op) as f:
        c = _Container(str(path), op, f)
        for name, e in sorted(c.entries.items()):
            a = c.array(f, e)
            out[name] = bf16_value(a) if e.bf16 else a  # bfloat16 bits: float32, exactly
    return out


def read_metadata(path: str, op: str = "load") -> dict[str, str]:
    return _Container(str(path), op).metadata


# ------------------------------------------------------------------------- packed layouts
def _weight_floor(spec: RNNSpec, dtype: np.dtype, precision: str = "float") -> int:
    """A lower bound of ``PackedWeights(spec, dtype).nbytes`` from the spec alone: the unpadded
    W and R. A file that holds fewer bytes cannot be honest, so nothing is allocated for it.
    Closed form (layer 0 reads C, every later layer D*K): a loop over the declared layers would
    itself be the work a lying ``num_layers`` buys."""
    G, K, L = spec.gate_width, spec.output_size, spec.num_layers
    per = G * (spec.input_size + K) + (L - 1) * G * (spec.num_directions * K + K)
    return per * spec.num_directions * tensor_dtype("Rt", dtype, precision).itemsize


def _region(pw: PackedWeights) -> list[tuple[str, np.ndarray, int]]:
    """(name, view, byte offset in pw.buffer) of every packed tensor, in buffer order."""
    base = pw.buffer.ctypes.data
    return [(k, v, v.ctypes.data - base if v.size else -1) for k, v in pw.tensors().items()]


# ----------------------------------------------------------------------------------- writing
_BLOCK_WORDS = 512  # version-2 checksum: 64-bit words per block (4 KiB)
# Reading: bytes per read-and-sum step (a multiple of the 4 KiB digest block, small enough to
# be summed from L2 right after its read), and the region size from which threads share it.
_READ_CHUNK = 1 << 20
_PARALLEL_READ_BYTES = 4 << 20
_PREADV = hasattr(os, "preadv")  # reads at an offset, so threads share no file position


def _checksum(meta: dict[str, str], regions, version: int = VERSION) -> str:
    """A fast integrity check of the metadata and the data regions (as read back: one per
    packed RNN, one for all constants): CRC-32 of the metadata JSON, then one digest per region
    (``_region_digest`` for version 2, ``_region_digest_v1`` for version-1 files). Catches
    corruption; it is not a cryptographic digest. CRC-32 over the weights would cost more than
    reading them, so the data digests are numpy reductions at memory speed."""
    digest = _region_digest if version >= 2 else _region_digest_v1
    return _joined(meta, [digest(_words(r)) + _tail_crc(r) for r in regions])


def _joined(meta: dict[str, str], digests: list[str]) -> str:
    """The stored checksum: the metadata's CRC-32, then each region's digest."""
    return "-".join([f"{zlib.crc32(json.dumps(meta, sort_keys=True).encode()):08x}", *digests])


def _words(region) -> np.ndarray:
    """A region's whole 64-bit words (its first ``nbytes // 8 * 8`` bytes), little-endian."""
    b = np.frombuffer(memoryview(region).cast("B"), np.uint8)
    return b[: b.size // 8 * 8].view("<u8")


def _tail_crc(region) -> str:
    """CRC-32 of a region's last ``nbytes % 8`` bytes, which no word holds."""
    b = memoryview(region).cast("B")
    return f"{zlib.crc32(b[len(b) // 8 * 8 :]):08x}"


def _region_digest(words: np.ndarray) -> str:
    """Version 2, one pass over the data: the sum s_k of each 4 KiB block of 64-bit words, then
    sum_k s_k and sum_k (k+1) s_k, wrapping mod 2**64 (Fletcher's checksum, block-wise).

    It catches any change to one word (so any single flipped bit), and two whole blocks k and j
    that trade places unless (j - k)(s_k - s_j) is 0 mod 2**64 (blocks of equal sum, say): the
    weighted sum moves by that much, where version 1's sum and XOR cannot see a swap at all.

    It does not catch what leaves every block's sum unchanged mod 2**64: words reordered
    within one block (two 8-byte words swapped, say), the same bit set in one word and cleared
    in another within one block, bit 63 flipped in two words of one block; nor changes in
    several blocks that cancel in both sums. It is a guard against accidental corruption, not
    against deliberate edits (the format must stay as files in the field carry it)."""
    return _combine_sums(_block_sums(words))


def _block_sums(words: np.ndarray) -> np.ndarray:
    """s_k of ``_region_digest`` for consecutive words starting on a block boundary (a last
    short block summed as it is): runs of whole blocks give the region's sums in pieces."""
    full = words.size // _BLOCK_WORDS * _BLOCK_WORDS
    sums = np.add.reduce(words[:full].reshape(-1, _BLOCK_WORDS), axis=1)
    if full < words.size:
        sums = np.append(sums, np.add.reduce(words[full:]))
    return sums


def _combine_sums(sums: np.ndarray) -> str:
    total = int(np.add.reduce(sums))
    weighted = int(np.add.reduce(sums * np.arange(1, sums.size + 1, dtype=np.uint64)))
    return f"{total:016x}{weighted:016x}"


def _region_digest_v1(words: np.ndarray) -> str:
    """Version 1 (read-only now): the wrapping sum and the XOR of the 64-bit words, two passes."""
    total = int(words.sum(dtype=np.uint64)) if words.size else 0
    xor = int(np.bitwise_xor.reduce(words)) if words.size else 0
    return f"{total:016x}{xor:016x}"


def _write(path: str, meta: dict[str, str], blocks: list[tuple[str, list]]) -> None:
    """Write a safetensors file. ``blocks`` is a list of (prefix, [(name, array, offset)]) where
    each block's arrays tile one contiguous byte region (offset -1: empty tensor)."""
    header: dict[str, dict] = {}
    chunks: list[np.ndarray] = []
    regions: list[bytes | np.ndarray] = []  # what the reader will check, region by region
    cursor = 0
    for prefix, items in blocks:
        block_start = cursor
        first_chunk = len(chunks)
        for name, arr, off in items:
            if arr.dtype.byteorder == ">":  # pragma: no cover - safetensors is little-endian
                arr = arr.astype(arr.dtype.newbyteorder("<"))
            code = _ST_CODES.get(np.dtype(arr.dtype.str.replace("<", "=")))
            if code is None:
                raise ModelFormatError(
                    f"[save] tensor {name!r} has dtype {arr.dtype}; the "
                    "native format stores numeric dtypes only"
                )
            begin = block_start + (off if off >= 0 else cursor - block_start)
            if off >= 0 and begin != cursor:
                raise ModelFormatError(
                    f"[save] tensor {prefix}{name} would leave a hole at byte {cursor}"
                )
            header[prefix + name] = {
                "dtype": code,
                "shape": list(arr.shape),
                "data_offsets": [begin, begin + arr.nbytes],
            }
            cursor = begin + arr.nbytes
            if arr.nbytes:
                chunks.append(np.asarray(arr, order="C"))
        if cursor > block_start:
            block = chunks[first_chunk:]
            regions.append(
                block[0] if len(block) == 1 else b"".join(memoryview(c).cast("B") for c in block)
            )
    meta = dict(meta)
    meta["checksum"] = _checksum(meta, regions, int(meta["version"]))
    header["__metadata__"] = meta
    text = json.dumps(header, separators=(",", ":")).encode()
    if len(text) > MAX_HEADER_BYTES:  # it would save, and then not load
        raise ModelFormatError(
            f"[save] {path!r}: the header (tensor table and graph) would be {len(text)} bytes; "
            f"a .lrnn file's may be at most {MAX_HEADER_BYTES} (what load reads): this model "
            "is too large a graph for one .lrnn file"
        )
    # Pad the header with spaces (allowed by safetensors) so the data starts 64-byte aligned.
    text += b" " * ((-(8 + len(text))) % 64)
    # A temporary file of this call's own: with the pid alone, two threads saving to one path
    # wrote one temp file, and the second rename found it gone (FileNotFoundError) or moved a mix.
    with replacing(path) as tmp, open(tmp, "wb") as f:
        f.write(struct.pack("<Q", len(text)))
        f.write(text)
        for c in chunks:
            f.write(memoryview(c).cast("B"))


def out_path(path, op: str = "save") -> str:
    """``path`` as a str, if a native file may be written there: a file path ending in ``.lrnn``
    (any case) in an existing directory. The one check of every writer (``Model.save``,
    ``GraphModel.save``, ``leanrnn.save``, ``convert``). str(path) wrote None as a file named
    'None' and b'm.lrnn' as "b'm.lrnn'", a missing directory was an OSError naming the temporary
    file, and a native file named m.onnx is read by nothing that expects ONNX."""
    try:
        p = os.fsdecode(os.fspath(path))
    except TypeError:
        raise ModelFormatError(f"[{op}] got a {type(path).__name__} ({path!r:.60}) as the path; "
                               "expected a file path (str, bytes or pathlib.Path)") from None  # fmt: skip
    if not p or os.path.isdir(p):
        raise ModelFormatError(f"[{op}] {p!r} is a directory; expected a file path in it, e.g. "
                               f"{os.path.join(p or '.', 'model.lrnn')!r}")  # fmt: skip
    if not p.lower().endswith(".lrnn"):
        raise ModelFormatError(f"[{op}] path {p!r} must end in .lrnn (leanrnn writes its native "
                               "format only, and other tools go by the name)")  # fmt: skip
    if os.path.exists(p) and not os.path.isfile(p):  # the rename would replace a FIFO, a device
        raise ModelFormatError(f"[{op}] {p!r} is not a regular file; expected a file path to "
                               "write (or replace)")  # fmt: skip
    parent = os.path.dirname(p) or "."
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise ModelFormatError(f"[{op}] cannot write {p!r}: {parent!r} {what}; create the "
                               "directory first or pick another path")  # fmt: skip
    return p


def _packed_items(pw: PackedWeights) -> list:
    items = _region(pw)
    total = sum(v.nbytes for _, v, _ in items)
    if total != pw.nbytes:  # every packed tensor is a multiple of 64 bytes (see packing)
        raise ModelFormatError(f"[save] packed tensors cover {total} of {pw.nbytes} buffer bytes")
    return items


def save_rnn(weights: PackedWeights, path: str) -> None:
    """Write one recurrent stack (spec + packed weights) as ``.lrnn``."""
    meta = {
        "format": FORMAT,
        "version": str(WRITTEN_VERSION),
        "kind": "rnn",
        "dtype": weights.dtype.name,
        "spec": json.dumps(weights.spec.to_dict()),
    }
    if weights.precision != "float":  # absent: the weights are of the working dtype
        meta["precision"] = weights.precision
        meta.update(_layout_meta(weights.precision))
    _write(out_path(path), meta, [("", _packed_items(weights))])


def save_graph(graph: Graph, path: str) -> None:
    """Write an op graph (constants + packed RNN weights) as ``.lrnn``."""
    blocks = []
    packed = {}
    owners = graph.weight_owners()
    for node_name, pw in graph.packed.items():
        if owners[node_name] != node_name:  # another node's weights: written once, with it
            packed[node_name] = {"shares": owners[node_name]}
            continue
        blocks.append((f"rnn:{node_name}:", _packed_items(pw)))
        packed[node_name] = {"spec": pw.spec.to_dict(), "dtype": pw.dtype.name}
        if pw.precision != "float":
            packed[node_name]["precision"] = pw.precision
            packed[node_name].update(_layout_meta(pw.precision))
    # Constants after the packed regions, widest items first, so each stays aligned to its itemsize.
    consts = sorted(graph.constants.items(), key=lambda kv: (-kv[1].dtype.itemsize, kv[0]))
    blocks.append(("const:", [(k, np.asarray(v, order="C"), -1) for k, v in consts]))
    g = graph.to_dict()
    g["packed"] = packed
    # the oldest version that reads the file: a leanrnn before sharing reads one without it
    shares = any(owner != name for name, owner in owners.items())
    version = SHARES_VERSION if shares else WRITTEN_VERSION
    meta = {"format": FORMAT, "version": str(version), "kind": "graph", "graph": json.dumps(g)}
    _write(out_path(path), meta, blocks)


# ----------------------------------------------------------------------------------- reading
def is_native(path: str) -> bool:
    try:
        with open(path, "rb") as f:
            if not is_safetensors(f.read(9), os.fstat(f.fileno()).st_size):
                return False
            # The header's metadata decides; load() checks the tensor entries against the file.
            meta = _read_header(f, path, "load")[2].get("__metadata__")
        return isinstance(meta, dict) and meta.get("format") == FORMAT
    except (OSError, LeanRNNError):
        return False


def load(path: str, verify: bool = True) -> PackedWeights | Graph:
    """Read a ``.lrnn`` file: ``PackedWeights`` for kind "rnn", a ``Graph`` for kind "graph".

    Every declared size is checked against the spec and the file size before allocation; with
    ``verify`` the checksum of metadata and data is checked too (catches bit flips)."""
    op, path = "load", str(path)
    with _opened(path, op) as f:  # one open file for the header and the data (_Container)
        c = _Container(path, op, f)
        meta = c.metadata
        version = _version(c)
        kind = meta.get("kind")
        if kind == "rnn":
            spec = _spec(meta.get("spec"), op, path)
            dtype = _dtype(meta.get("dtype"), op, path)
            precision = _precision(meta, dtype, op, path)
            begin = _check_packed(c, "", spec, dtype, precision)
            # _check_packed matched the unprefixed tensors to the layout; nothing else belongs
            extra = sorted(set(c.entries) - {e.name for e in c.groups[""]})
            if extra:
                raise ModelFormatError(f"[{op}] {path!r}: unexpected tensors {extra[:8]}")
            result = _packed(spec, dtype, precision)
            digests = c.read_regions(f, [(begin, result.buffer)], version)
            check_loaded(result, op, path)
        elif kind == "graph":
            result, digests = _read_graph(c, f, meta, version)
        else:
            raise ModelFormatError(f"[{op}] {path!r} has kind {kind!r}; expected 'rnn' or 'graph'")
    if verify:
        want = meta.get("checksum")
        body = {k: v for k, v in meta.items() if k != "checksum"}
        got = _joined(body, [d for d in digests if d])
        if want != got:
            raise ModelFormatError(
                f"[{op}] {path!r}: checksum mismatch (stored {want}, computed {got}); the file "
                "is corrupt"
            )
    return result


def _version(c: _Container) -> int:
    """The format version of a .lrnn file's header, which this leanrnn reads, else an error."""
    op, path, meta = c.op, c.path, c.metadata
    if meta.get("format") != FORMAT:
        raise ModelFormatError(
            f"[{op}] {path!r} is a safetensors file without leanrnn metadata; "
            "expected a .lrnn file (or load it as a state dict)"
        )
    bf16 = sorted(e.name for e in c.entries.values() if e.bf16)
    if bf16:  # other writers' code, read for state dicts only: leanrnn writes none
        raise ModelFormatError(f"[{op}] {path!r}: entries {bf16[:4]} are BF16, which .lrnn "
                               "files never hold (bf16 panels are U16); the file is corrupt")  # fmt: skip
    try:
        version = int(meta.get("version", ""))
    except ValueError:
        version = -1
    if version < 1 or version > VERSION:
        raise ModelFormatError(
            f"[{op}] {path!r} has format version {meta.get('version')!r}; this leanrnn reads "
            f"versions 1..{VERSION} (upgrade leanrnn for newer files)"
        )
    return version


# bf16 panels in input pairs: files say so (packing.unmarked_bf16 for those that do not)
BF16_LAYOUT = "pairs"


def _layout_meta(precision: str) -> dict[str, str]:
    return {"bf16_layout": BF16_LAYOUT} if panel_format(precision) == "bf16" else {}


def _spec(text, op, path) -> RNNSpec:
    try:
        return RNNSpec.from_dict(json.loads(text) if isinstance(text, str) else text)
    except (TypeError, ValueError, RecursionError) as e:
        raise ModelFormatError(f"[{op}] {path!r}: bad spec in header: {e}") from None


def _dtype(name, op, path) -> np.dtype:
    # by name only: np.dtype(None) is float64, and a dtype compares equal to None
    dt = next((d for d in SUPPORTED_DTYPES if d.name == name), None)
    if dt is None:
        raise ModelFormatError(
            f"[{op}] {path!r}: weights dtype {name!r}; expected float32 or float64"
        )
    return dt


def _precision(meta: dict, dtype: np.dtype, op, path) -> str:
    """The weight precision a header (a file's, or a graph node's packed entry) declares."""
    name = meta.get("precision", "float")
    if name not in PRECISIONS:
        raise ModelFormatError(f"[{op}] {path!r}: weight precision {name!r}; expected one of "
                               f"{', '.join(map(repr, PRECISIONS))} (a newer leanrnn's file?)")  # fmt: skip
    try:
        check_precision(name, dtype, op)
    except LeanRNNError as e:
        raise ModelFormatError(f"[{op}] {path!r}: {_bare(e)}; the file is corrupt") from None
    if panel_format(name) == "bf16" and meta.get("bf16_layout") != BF16_LAYOUT:
        raise ModelFormatError(f"[{op}] {path!r} holds {unmarked_bf16(name)}")
    return name


def _packed_layout(spec: RNNSpec, dtype: np.dtype,
                   precision: str = "float") -> tuple[dict, int]:  # fmt: skip
    """({name: (shape, byte offset or -1 if empty, dtype)}, total bytes) of
    ``PackedWeights(spec, dtype, precision=precision)``, computed from ``PackedWeights.layout``
    with Python ints, nothing allocated (an int8 panel's shape includes its scale rows, so the
    scale count is checked with the shape). The caller bounds ``spec.num_layers`` by the
    tensors present first: this loops per tensor."""
    fields = len(PackedLayer.__dataclass_fields__)
    per_layer = fields * spec.num_directions
    out, off = {}, 0
    for i, (name, shape) in enumerate(PackedWeights.layout(spec, precision)):
        dt = tensor_dtype(name, dtype, precision)
        n = math.prod(shape) * dt.itemsize
        key = f"l{i // per_layer}.d{i // fields % spec.num_directions}.{name}"
        out[key] = (tuple(shape), off if n else -1, dt)
        off += round_up(n, 64)
    return out, off


def _check_packed(c: _Container, prefix: str, spec: RNNSpec, dtype: np.dtype,
                  precision: str = "float") -> int:  # fmt: skip
    """The byte offset of the packed tensors of ``prefix`` in the data section, after checking
    that they are exactly what ``PackedWeights(spec, dtype)`` lays out; allocates nothing."""
    op, path = c.op, c.path
    what = f"node {prefix[4:-1]!r}" if prefix else "the model"
    mine = c.groups.get(prefix, [])
    if not mine:
        raise ModelFormatError(f"[{op}] {path!r}: no packed tensors for {what}")
    begin, end = mine[0].begin, mine[-1].end
    # Every declared count is checked against what the file holds before work proportional to
    # it: first the tensor count (bounds the layers), then the unpadded weight bytes (bound H
    # and C), then the exact layout (computed, not allocated).
    want_n = len(PackedLayer.__dataclass_fields__) * spec.num_layers * spec.num_directions
    floor = _weight_floor(spec, dtype, precision)
    if want_n != len(mine) or floor > end - begin:
        raise ModelFormatError(
            f"[{op}] {path!r}: the spec ({spec.cell.upper()} C={spec.input_size} "
            f"H={spec.hidden_size} layers={spec.num_layers} {spec.direction}) needs "
            f"{want_n} packed tensors of at least {floor} bytes in all, but the file holds "
            f"{len(mine)} tensors of {end - begin} bytes for {what}; the file is corrupt, or "
            "was written by another version: re-convert it"
        )
    want, nbytes = _packed_layout(spec, dtype, precision)
    got = {
        e.name[len(prefix) :]: (e.shape, e.begin - begin if e.end > e.begin else -1, e.dtype)
        for e in mine
    }
    if nbytes != end - begin or want != got:
        missing = sorted(set(want) - set(got))[:4]
        raise ModelFormatError(
            f"[{op}] {path!r}: stored packed tensors of {what} ({end - begin} "
            f"bytes) do not match this leanrnn's packing of the spec ({nbytes} bytes"
            + (f"; missing {missing}" if missing else "")
            + "); the file is corrupt, or was written by another version: re-convert it"
        )
    return begin


def _packed(spec: RNNSpec, dtype: np.dtype, precision: str) -> PackedWeights:
    """Unfilled packed weights for a spec ``_check_packed`` checked against the file: bounded
    by the bytes the file holds. No zero-fill: the read fills the whole buffer, padding
    included; the caller reads them, then checks reduced ones (quantize.check_loaded)."""
    return PackedWeights(spec, dtype, zero=False, precision=precision)


def _share(graph: Graph, own: dict, node: Node, pm: dict, version: int, op: str,
           path: str) -> None:  # fmt: skip
    """``node`` runs on the packed weights of the node its entry names (save_graph writes one
    region for weights several nodes share), its attributes checked against their spec."""
    other = pm["shares"]
    pw = own.get(other) if isinstance(other, str) else None
    if version < SHARES_VERSION or len(pm) != 1 or pw is None:
        why = (f"format version {version} has no shared weights" if version < SHARES_VERSION
               else f"the entry holds more than 'shares': {sorted(pm)[:4]}" if len(pm) != 1
               else "no node with packed weights of its own has that name")  # fmt: skip
        raise ModelFormatError(f"[{op}] {path!r}: packed entry {node.name!r} shares "
                               f"{repr(other)[:80]}, but {why}; the file is corrupt")  # fmt: skip
    _check_rnn_node(node, pw.spec, pw.dtype, op, path)
    graph.packed[node.name] = pw


def _check_rnn_node(node: Node, spec: RNNSpec | None, dtype, op: str, path: str) -> None:
    """Check a graph file's RNN node with the IR's own functions: its attributes as
    ``ir.rnn_attrs`` validates them, and (``spec`` given) the spec ``ir.rnn_from_node`` builds
    from them equal to the packed spec. Costs O(G): the weights it is handed are broadcast
    zeros in internal gate order, so nothing is copied."""
    where = f"node {node.name!r} ({node.op})"
    check_rnn_io(node.op, node.inputs, node.outputs, f"[{op}] {path!r}: {where}")
    a = node.attrs
    try:
        try:
            acts = [(str(n), float(al), float(be)) for n, al, be in a["activations"]]
            raw = {
                "hidden_size": a["hidden_size"],
                "direction": a["direction"],
                "activations": [n for n, _, _ in acts],
                "activation_alpha": [al for n, al, _ in acts if n in USES_ALPHA],
                "activation_beta": [be for n, _, be in acts if n in USES_BETA],
                "clip": a["clip"],
                "input_forget": int(a["input_forget"]),
                "linear_before_reset": int(a["linear_before_reset"]),
                "layout": a["layout"],
            }
        except (KeyError, TypeError, ValueError) as e:
            raise ModelFormatError(f"{where} has malformed attributes ({e!r})") from None
        attrs = rnn_attrs(node.op, raw, where)
        if any(a[k] != v for k, v in attrs.items()):
            raise ModelFormatError(
                f"{where} has attributes {a}; expected them as the ONNX importer normalizes "
                f"them: {attrs}"
            )
        if spec is None:
            return
        D, G, H = spec.num_directions, spec.gate_width, spec.hidden_size
        zero = np.zeros((), dtype)
        try:
            implied, _ = rnn_from_node(
                node.op,
                attrs,
                np.broadcast_to(zero, (D, G, spec.input_size)),
                np.broadcast_to(zero, (D, G, H)),
                np.broadcast_to(zero, (D, 2 * G)) if spec.bias else None,
                np.broadcast_to(zero, (D, 3 * H)) if spec.peepholes else None,
                where,
                gates_in_onnx_order=False,
            )
        except LeanRNNError as e:
            raise ModelFormatError(
                f"{where}: its attributes (hidden_size={attrs['hidden_size']}, "
                f"{attrs['direction']}) contradict its packed weights ({spec.cell.upper()} "
                f"C={spec.input_size} H={H} {spec.direction}): {_bare(e, where)}"
            ) from None
        if implied != spec:
            diff = {
                k: (getattr(implied, k), getattr(spec, k))
                for k in RNNSpec.__dataclass_fields__
                if getattr(implied, k) != getattr(spec, k)
            }
            raise ModelFormatError(
                f"{where}: its attributes and its packed spec disagree on "
                + ", ".join(f"{k} ({x!r} vs {y!r})" for k, (x, y) in diff.items())
            )
    except LeanRNNError as e:
        raise ModelFormatError(
            f"[{op}] {path!r}: {_bare(e)}; the file is corrupt or was edited (re-convert the model)"
        ) from None


def _bare(e: Exception, where: str = "") -> str:
    """An error's message without its "[op] " and ``where`` prefixes, to nest in another."""
    msg = str(e).split("] ", 1)[-1] if str(e).startswith("[") else str(e)
    return msg[len(where) + 2 :] if where and msg.startswith(where + ": ") else msg


def _read_graph(c: _Container, f, meta: dict, version: int) -> tuple[Graph, list[str]]:
    op, path = c.op, c.path
    try:
        g = json.loads(meta.get("graph", ""))
        if not isinstance(g, dict):
            raise TypeError("graph is not an object")
        graph = Graph(
            inputs=[TensorInfo.from_dict(d) for d in g["inputs"]],
            outputs=[TensorInfo.from_dict(d) for d in g["outputs"]],
            nodes=[Node.from_dict(d) for d in g["nodes"]],
            opset=g.get("opset", 17),
            name=str(g.get("name", "graph")),
        )
        packed_meta = g.get("packed") or {}
        if not isinstance(packed_meta, dict):
            raise TypeError("packed is not an object")
    except (
        json.JSONDecodeError,
        KeyError,
        TypeError,
        ValueError,
        AttributeError,
        RecursionError,
    ) as e:
        raise ModelFormatError(f"[{op}] {path!r}: malformed graph in header: {e!r}") from None
    check_opset(graph.opset, f"[{op}] {path!r}")
    rnn_nodes = {n.name: n for n in graph.nodes if n.op in RNN_OPS}
    for node in rnn_nodes.values():
        if node.name not in packed_meta:  # packed ones are checked against their spec below
            _check_rnn_node(node, None, None, op, path)
    reads, fresh = [], []  # every region is read at once, checked after
    used = set()
    for node_name, pm in packed_meta.items():
        if not isinstance(pm, dict):
            raise ModelFormatError(f"[{op}] {path!r}: packed entry {node_name!r} is malformed")
        if node_name not in rnn_nodes:
            raise ModelFormatError(
                f"[{op}] {path!r}: packed weights for {node_name!r}, which is no LSTM/GRU/RNN "
                "node of the graph; the file is corrupt"
            )
        if "shares" in pm:  # another node's weights: after every region is laid out
            continue
        spec = _spec(pm.get("spec"), op, path)
        dtype = _dtype(pm.get("dtype"), op, path)
        precision = _precision(pm, dtype, op, path)
        prefix = f"rnn:{node_name}:"
        # sizes first (against the file), then the node's attributes against the spec, then
        # the weights are read
        begin = _check_packed(c, prefix, spec, dtype, precision)
        _check_rnn_node(rnn_nodes[node_name], spec, dtype, op, path)
        pw = _packed(spec, dtype, precision)
        graph.packed[str(node_name)] = pw
        reads.append((begin, pw.buffer))
        fresh.append(pw)
        used |= {prefix + k for k in pw.tensors()}
    own = dict(graph.packed)  # (a share of a share is no file save_graph writes)
    for node_name, pm in packed_meta.items():
        if "shares" in pm:
            _share(graph, own, rnn_nodes[node_name], pm, version, op, path)
    consts = {k: e for k, e in c.entries.items() if k.startswith("const:")}
    unknown = sorted(set(c.entries) - used - set(consts))
    if unknown:
        raise ModelFormatError(f"[{op}] {path!r}: unexpected tensors {unknown[:8]}")
    if consts:
        # One aligned read for all constants; each becomes a read-only view into it.
        lo = min(e.begin for e in consts.values())
        hi = max(e.end for e in consts.values())
        buf = aligned_empty(hi - lo)
        reads.append((lo, buf[: hi - lo]))
    digests = c.read_regions(f, reads, version)
    for pw in fresh:
        check_loaded(pw, op, path)
    if consts:
        for k, e in consts.items():
            if (e.begin - lo) % e.dtype.itemsize:
                arr = np.frombuffer(buf[e.begin - lo : e.end - lo].tobytes(), e.dtype)
            else:
                arr = buf[e.begin - lo : e.end - lo].view(e.dtype)
            arr = arr.reshape(e.shape)
            arr.flags.writeable = False
            graph.constants[k[len("const:") :]] = arr
    return graph, digests
