"""ONNX files -> the graph IR (``leanrnn.ir.Graph``) + packed weights. The IR's op set is ONNX's,
so the work here is the file: protobuf reading, external data, initializers read lazily, the
opset import. LSTM/GRU/RNN nodes whose weights are initializers are packed with the IR's own
pass (``engine.graph.passes.pack_constant_rnns``), reading W and R from the file straight into
internal gate order. The ``onnx`` package is imported only when a file is read.

Memory: a file is parsed without its initializers' raw bytes (``_strip_raw_data`` re-encodes the
protobuf minus those fields, a few KiB), and each weight is read straight from the file into its
array — RNN weights directly in internal gate order, one node at a time, right before packing.
Peak memory while importing is about the model's weights plus one RNN node's, not several
copies of the file.

Files are untrusted: every initializer's declared shape and dtype is checked against the bytes it
actually holds before an array is made, external data must live next to the model (no absolute
paths, no ``..``), and nothing is ever executed.
"""

from __future__ import annotations

import contextlib
import graphlib
import math
import os

import numpy as np

from ..engine.graph.passes import pack_constant_rnns
from ..errors import LeanRNNError, ModelFormatError, WeightsError
from ..ir import (
    RNN_OPS,
    Graph,
    Node,
    TensorInfo,
    check_node_io,
    check_opset,
    check_rnn_io,
    rnn_attrs,
)
from .onnx_quant import lower_quantized_lstms
from .packing import reorder_gates

MAX_ONNX_BYTES = (2 << 30) - 1  # protobuf's own hard limit for one message

# ONNX TensorProto.DataType -> numpy (the types leanrnn computes with or passes through)
_DTYPES = {
    1: np.float32,
    2: np.uint8,
    3: np.int8,
    4: np.uint16,
    5: np.int16,
    6: np.int32,
    7: np.int64,
    9: np.bool_,
    10: np.float16,
    11: np.float64,
    12: np.uint32,
    13: np.uint64,
}
_DTYPE_NAMES = {
    0: "UNDEFINED",
    8: "STRING",
    14: "COMPLEX64",
    15: "COMPLEX128",
    16: "BFLOAT16",
}


def np_dtype(code: int, where: str) -> np.dtype:
    """numpy dtype of an ONNX TensorProto data type code, or a ModelFormatError naming it."""
    if code not in _DTYPES:
        name = _DTYPE_NAMES.get(code, f"code {code}")
        raise ModelFormatError(
            f"[load_onnx] {where} has element type {name}; leanrnn supports "
            "float32/float64/float16, integer and bool tensors"
        )
    return np.dtype(_DTYPES[code])


# ----------------------------------------------------------------------------- tensors
class _Reader:
    """Turns TensorProtos into arrays after checking every declared size against real bytes.

    ``raw`` maps an initializer's index to the (offset, length) of its raw bytes in the model
    file when the protobuf was parsed without them (see ``_strip_raw_data``)."""

    def __init__(
        self,
        base_dir: str | None,
        path: str | None = None,
        raw: dict[int, tuple[int, int]] | None = None,
        file=None,
    ) -> None:
        self.base_dir = base_dir
        self.path = path
        self.raw = raw or {}
        self._sizes: dict[str, int] = {}
        # The model file stays open for the whole load (read_onnx: its skeleton was parsed
        # from it): opened again by name per tensor, a file replaced in the middle (an atomic
        # rename of a new version) gave tensors read at the old skeleton's offsets from the
        # new bytes, silently (0.94 off onnxruntime). An external data file is opened per
        # tensor (a model saved one file per tensor held a descriptor each: "Too many open
        # files" at a thousand), and must be the version its first open saw (_seen).
        self._file = file
        self._seen: dict[str, tuple[int, ...]] = {}

    @contextlib.contextmanager
    def _open(self, path: str, where: str):
        """``path`` open to read for the block: the model file as read_onnx holds it, or an
        external data file, the same version as at its first open in this load."""
        if path == self.path and self._file is not None:
            yield self._file
            return
        try:
            f = open(path, "rb")
        except OSError as e:
            raise ModelFormatError(f"[load_onnx] {where}: cannot open {path!r}: {e}") from None
        with f:
            st = os.fstat(f.fileno())
            ident = (st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns)
            if self._seen.setdefault(path, ident) != ident:
                raise ModelFormatError(
                    f"[load_onnx] {where}: external data file {path!r} changed while the "
                    "model was loading; load it again once it is written"
                )
            yield f

    def initializer(
        self, g, index: int, rows: tuple[tuple[int, ...], int] | None = None
    ) -> np.ndarray:
        """Initializer ``index`` as an array. With ``rows = (order, H)`` a [D, G, X] tensor held
        as raw bytes in the file is read straight into internal gate order (``order`` as in
        ``packing.ONNX_ORDER``): each gate block is contiguous in the file, so no reordering
        copy is ever made."""
        from onnx import TensorProto

        t = g.initializer[index]
        where = f"initializer {t.name!r}"
        external = t.data_location == TensorProto.EXTERNAL
        if (index not in self.raw and not external) or t.HasField("segment"):
            arr = self.array(t, where)  # (a segmented tensor: its refusal)
            if rows is None:
                return arr
            order, H = rows
            return np.stack([reorder_gates(a, order, H) for a in arr])
        dtype, dims, nbytes = self._declared(t, where)
        if external:  # read in gate order too: a copy per direction and a stack took 1.5x
            path, offset = self._external_span(t, dtype, dims, nbytes, where)
        else:
            offset, length = self.raw[index]
            if length != nbytes:
                raise WeightsError(
                    f"[load_onnx] {where} declares {dtype}{dims} = {nbytes} bytes but holds "
                    f"{length} bytes of raw data"
                )
            assert self.path is not None
            path = self.path
        out = np.empty(dims, dtype.newbyteorder("<"))
        if not nbytes:  # an empty tensor: memoryview cannot cast a view with a 0 in its shape
            return out.astype(dtype, copy=False)
        if rows is None:
            spans = [(offset, out.reshape(-1))]
        else:  # out[d, k*H:(k+1)*H] <- source block order[k] of direction d
            order, H = rows
            block = H * math.prod(dims[2:]) * dtype.itemsize
            spans = [
                (offset + (d * len(order) + src) * block, out[d, k * H : (k + 1) * H])
                for d in range(dims[0])
                for k, src in enumerate(order)
            ]
        with self._open(path, where) as f:
            for start, dst in spans:
                f.seek(start)
                if dst.nbytes and f.readinto(memoryview(dst).cast("B")) != dst.nbytes:
                    raise ModelFormatError(f"[load_onnx] {where}: file truncated while reading")
        return out.astype(dtype, copy=False)

    def _declared(self, t, where: str) -> tuple[np.dtype, list[int], int]:
        dtype = np_dtype(t.data_type, where)
        dims = [int(d) for d in t.dims]
        if any(d < 0 for d in dims):
            raise ModelFormatError(f"[load_onnx] {where} has dims {dims}; expected dims >= 0")
        return dtype, dims, math.prod(dims) * dtype.itemsize

    def array(self, t, where: str) -> np.ndarray:
        from onnx import TensorProto

        dtype, dims, nbytes = self._declared(t, where)
        count = nbytes // dtype.itemsize
        if t.HasField("segment"):
            raise ModelFormatError(f"[load_onnx] {where} is a segmented tensor; not supported")
        if t.data_location == TensorProto.EXTERNAL:
            return self._external(t, dtype, dims, nbytes, where)
        if t.raw_data:
            raw = t.raw_data
            if len(raw) != nbytes:
                raise WeightsError(
                    f"[load_onnx] {where} declares {dtype}{dims} = {nbytes} bytes but holds "
                    f"{len(raw)} bytes of raw data"
                )
            return np.frombuffer(raw, dtype.newbyteorder("<")).astype(dtype).reshape(dims)
        field, cast = {
            np.dtype(np.float32): ("float_data", None),
            np.dtype(np.float64): ("double_data", None),
            np.dtype(np.int64): ("int64_data", None),
            np.dtype(np.uint64): ("uint64_data", None),
            np.dtype(np.uint32): ("uint64_data", None),
            np.dtype(np.float16): ("int32_data", np.uint16),
        }.get(dtype, ("int32_data", None))
        values = getattr(t, field)
        if len(values) != count:
            raise WeightsError(
                f"[load_onnx] {where} declares {dtype}{dims} ({count} values) but holds "
                f"{len(values)} in {field}"
            )
        if cast is not None:
            return np.array(values, dtype=cast).view(dtype).reshape(dims)
        return np.array(values, dtype=dtype).reshape(dims)

    def _external(self, t, dtype, dims, nbytes: int, where: str) -> np.ndarray:
        path, offset = self._external_span(t, dtype, dims, nbytes, where)
        out = np.empty(dims, dtype)
        if not nbytes:  # an empty tensor: memoryview cannot cast a view with a 0 in its shape
            return out
        with self._open(path, where) as f:
            f.seek(offset)
            if f.readinto(memoryview(out).cast("B")) != nbytes:  # pragma: no cover - raced
                raise ModelFormatError(f"[load_onnx] {where}: short read from {path!r}")
        return out

    def _external_span(self, t, dtype, dims, nbytes: int, where: str) -> tuple[str, int]:
        """(the file, the offset) of external tensor ``t``'s bytes, after checking that the
        location stays inside the model's directory and the file holds what ``t`` declares."""
        info = {e.key: e.value for e in t.external_data}
        loc = info.get("location", "")
        if self.base_dir is None:
            raise ModelFormatError(
                f"[load_onnx] {where} keeps its data in external file {loc!r};"
                " load the model from a path, not bytes"
            )
        norm = os.path.normpath(loc)
        if not loc or os.path.isabs(loc) or norm.startswith(".."):
            raise ModelFormatError(
                f"[load_onnx] {where}: external data location {loc!r} must be a relative path "
                "inside the model's directory"
            )
        base = os.path.realpath(self.base_dir)
        path = os.path.realpath(os.path.join(base, norm))
        if os.path.commonpath([base, path]) != base or not os.path.isfile(path):
            raise ModelFormatError(
                f"[load_onnx] {where}: external data file {loc!r} is missing "
                "or outside the model's directory"
            )
        raw = (info.get("offset", "0"), info.get("length", str(nbytes)))
        if not all(v.isascii() and v.isdigit() for v in raw):  # (int() took " 0", "+0", "0_0")
            raise ModelFormatError(
                f"[load_onnx] {where}: malformed external offset/length {info}; expected "
                "decimal byte counts"
            )
        offset, length = int(raw[0]), int(raw[1])
        size = self._sizes.get(path)
        if size is None:  # of the version the load reads (_open)
            with self._open(path, where) as f:
                size = self._sizes[path] = os.fstat(f.fileno()).st_size
        if length != nbytes or offset < 0 or offset + length > size:
            raise WeightsError(
                f"[load_onnx] {where} declares {dtype}{dims} = {nbytes} bytes at offset {offset} "
                f"length {length} of {loc!r}, which holds {size} bytes"
            )
        return path, offset


# -------------------------------------------------------------------- protobuf without weights
# Field numbers of onnx.proto3 that lead to initializer bytes: ModelProto.graph = 7,
# GraphProto.initializer = 5, TensorProto.raw_data = 9.
_MODEL_GRAPH, _GRAPH_INITIALIZER, _TENSOR_RAW_DATA = 7, 5, 9


def _varint(f, end: int, label: str) -> int:
    value, shift = 0, 0
    while True:
        if f.tell() >= end or shift > 63:
            raise ModelFormatError(
                f"[load_onnx] {label!r} is not a valid ONNX protobuf (bad varint; truncated?)"
            )
        byte = f.read(1)[0]
        value |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return value


def _encode_varint(v: int) -> bytes:
    out = bytearray()
    while True:
        byte = v & 0x7F
        v >>= 7
        if v:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def _copy_message(f, start: int, end: int, label: str, on_len) -> bytes:
    """Re-encode the message at [start, end) of ``f``; ``on_len(field, offset, length)`` may
    return replacement bytes for a length-delimited field (b"" drops it; None copies it)."""
    out = bytearray()
    f.seek(start)
    while f.tell() < end:
        tag = _varint(f, end, label)
        field, wire = tag >> 3, tag & 7
        if wire == 0:
            out += _encode_varint(tag) + _encode_varint(_varint(f, end, label))
            continue
        if wire in (1, 5):
            n = 8 if wire == 1 else 4
            data = f.read(n)
            if len(data) != n or f.tell() > end:
                raise ModelFormatError(f"[load_onnx] {label!r} is truncated")
            out += _encode_varint(tag) + data
            continue
        if wire != 2:
            raise ModelFormatError(
                f"[load_onnx] {label!r} is not a valid ONNX protobuf "
                f"(wire type {wire} in field {field})"
            )
        length = _varint(f, end, label)
        offset = f.tell()
        if offset + length > end:
            raise ModelFormatError(
                f"[load_onnx] {label!r}: field {field} claims {length} bytes "
                f"but its message ends {end - offset} bytes later "
                "(truncated or corrupt)"
            )
        body = on_len(field, offset, length)
        if body is None:
            f.seek(offset)
            body = f.read(length)
        if body or field != _TENSOR_RAW_DATA:
            out += _encode_varint(tag) + _encode_varint(len(body)) + body
        f.seek(offset + length)
    return bytes(out)


def _strip_raw_data(f, path: str, size: int) -> tuple[bytes, dict[int, tuple[int, int]]]:
    """The protobuf of model file ``f`` (open, named ``path``) with every initializer's raw
    bytes left out, and where those bytes are in the file (by initializer index). Parsing then
    costs kilobytes, not the model's size, and each weight is read straight from the file into
    its array."""
    raw: dict[int, tuple[int, int]] = {}
    count = [0]

    def tensor(index):
        def on_len(field, offset, length):
            if field == _TENSOR_RAW_DATA:
                raw[index] = (offset, length)  # the last occurrence wins, as in protobuf
                return b""
            return None

        return on_len

    def graph(field, offset, length):
        if field != _GRAPH_INITIALIZER:
            return None
        index = count[0]
        count[0] += 1
        return _copy_message(f, offset, offset + length, path, tensor(index))

    def model(field, offset, length):
        if field != _MODEL_GRAPH:
            return None
        # (a repeated graph field merges, appending initializers: the count runs on)
        return _copy_message(f, offset, offset + length, path, graph)

    stripped = _copy_message(f, 0, size, path, model)
    return stripped, raw


# --------------------------------------------------------------------------------- graph
def _value_info(vi, where: str) -> TensorInfo:
    if vi.type.WhichOneof("value") is None and where == "graph output":
        # declared by name only (valid ONNX): a tensor whose type and shape the graph gives
        return TensorInfo(vi.name, "", None)
    tt = vi.type.tensor_type if vi.type.HasField("tensor_type") else None
    if tt is None and vi.type.WhichOneof("value") is None:
        raise ModelFormatError(f"[load_onnx] {where} {vi.name!r} declares no type; give it its "
                               "tensor type (elem_type and shape)")  # fmt: skip
    if tt is None:
        raise ModelFormatError(
            f"[load_onnx] {where} {vi.name!r} is not a tensor (sequence, map "
            "and optional values are not supported)"
        )
    dtype = np_dtype(tt.elem_type, f"{where} {vi.name!r}").name if tt.elem_type else ""
    shape = None
    if tt.HasField("shape"):
        dims: list[int | str | None] = []
        for d in tt.shape.dim:
            if d.HasField("dim_value") and d.dim_value >= 0:
                dims.append(int(d.dim_value))
            elif d.HasField("dim_value"):  # -1: a "make it dynamic" edit; onnxruntime takes
                dims.append(None)  # any size there (every input was refused)
            elif d.HasField("dim_param") and d.dim_param:
                dims.append(str(d.dim_param))
            else:
                dims.append(None)
        shape = tuple(dims)
    return TensorInfo(vi.name, dtype, shape)


def _attrs(node, reader: _Reader, where: str) -> dict:
    from onnx import AttributeProto as A

    out = {}
    for a in node.attribute:
        t = a.type
        if t == A.FLOAT:
            out[a.name] = float(a.f)
        elif t == A.INT:
            out[a.name] = int(a.i)
        elif t == A.STRING:
            out[a.name] = a.s.decode("utf-8", "replace")
        elif t == A.FLOATS:
            out[a.name] = [float(v) for v in a.floats]
        elif t == A.INTS:
            out[a.name] = [int(v) for v in a.ints]
        elif t == A.STRINGS:
            out[a.name] = [s.decode("utf-8", "replace") for s in a.strings]
        elif t == A.TENSOR:
            arr = reader.array(a.t, f"{where} attribute {a.name!r}")
            if arr.size > 1 << 16:
                raise ModelFormatError(
                    f"[load_onnx] {where}: attribute {a.name!r} holds "
                    f"{arr.size} values; expected a small tensor"
                )
            out[a.name] = {
                "dtype": arr.dtype.name,
                "shape": list(arr.shape),
                "values": arr.ravel().tolist(),
            }
        else:
            out[a.name] = f"<unsupported attribute type {t}>"
    return out


def _constant_node(n, reader: _Reader, where: str) -> np.ndarray:
    """A Constant node's value. Its tensor is read as an initializer is (sizes checked against
    the file; exporters emit weights so): the small-tensor bound of other attributes, which
    keeps a graph's JSON header small, is not for it."""
    from onnx import AttributeProto as A

    if len(n.attribute) == 1 and n.attribute[0].name == "value" and n.attribute[0].type == A.TENSOR:
        return reader.array(n.attribute[0].t, f"{where} attribute 'value'")
    return _constant_value(_attrs(n, reader, where), where)


def _constant_value(attrs: dict, where: str) -> np.ndarray:
    if "value" in attrs and isinstance(attrs["value"], dict):
        v = attrs["value"]
        return np.array(v["values"], dtype=v["dtype"]).reshape(v["shape"])
    for key, dtype in (
        ("value_float", np.float32),
        ("value_floats", np.float32),
        ("value_int", np.int64),
        ("value_ints", np.int64),
    ):
        if key in attrs:
            return np.array(attrs[key], dtype=dtype)
    raise ModelFormatError(
        f"[load_onnx] {where}: Constant with attributes {sorted(attrs)}; "
        "leanrnn supports value, value_float(s) and value_int(s)"
    )


def read_onnx(source, *, pack_dtype=None) -> Graph:
    """Parse an ONNX model (path or bytes) into a ``Graph``. RNN nodes whose W/R/B/P are
    constants get packed weights (in their own dtype, or ``pack_dtype``)."""
    try:
        import onnx  # noqa: F401 - here for the error naming the extra
    except ImportError:  # pragma: no cover - exercised only without the optional dependency
        raise ModelFormatError(
            "[load_onnx] reading ONNX files needs the onnx package: pip install 'leanrnn[onnx]'"
        ) from None
    if isinstance(source, bytes | bytearray | memoryview):
        return _read_onnx(bytes(source), "<bytes>", _Reader(None), pack_dtype)
    label = os.fspath(source)
    with open(label, "rb") as f:  # one open file for the whole load (_Reader._file)
        size = os.fstat(f.fileno()).st_size
        if size > MAX_ONNX_BYTES:
            raise ModelFormatError(
                f"[load_onnx] {label!r} is {size} bytes; one ONNX protobuf "
                "holds at most 2 GiB (use external data)"
            )
        data, raw = _strip_raw_data(f, label, size)
        reader = _Reader(os.path.dirname(os.path.abspath(label)), label, raw, f)
        return _read_onnx(data, label, reader, pack_dtype)


def _read_onnx(data: bytes, label: str, reader: _Reader, pack_dtype) -> Graph:
    """read_onnx of the protobuf ``data`` (the raw weights left out, read by ``reader``)."""
    import onnx
    from google.protobuf.message import DecodeError

    model = onnx.ModelProto()
    try:
        model.ParseFromString(data)
    except (DecodeError, ValueError, RuntimeError) as e:
        raise ModelFormatError(f"[load_onnx] {label!r} is not a valid ONNX protobuf: {e}") from None
    if not model.HasField("graph") or not model.graph.output:
        raise ModelFormatError(
            f"[load_onnx] {label!r} holds no ONNX graph with outputs "
            "(not an ONNX model, or truncated)"
        )
    # The last entry, as onnxruntime and onnx's reference evaluator take it: a file "upgraded"
    # by appending ("", 13) to its ("", 11) ran 11's Softmax (0.55 off onnxruntime's)
    opset = [o.version for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if not opset:
        raise ModelFormatError(f"[load_onnx] {label!r} imports no opset of the default ONNX "
                               "domain (opset_import); leanrnn needs the version its ops follow")  # fmt: skip
    check_opset(opset[-1], f"[load_onnx] {label!r}")
    try:
        return _convert(model.graph, opset[-1], reader, pack_dtype)
    except LeanRNNError:
        raise
    except (ValueError, TypeError, KeyError, IndexError, OverflowError, MemoryError) as e:
        # protobuf accepts many byte strings; anything inconsistent that slipped past the
        # checks above still surfaces as a format error, never as a crash
        raise ModelFormatError(f"[load_onnx] {label!r}: malformed model ({e!r})") from None


def _convert(g, opset: int, reader: _Reader, pack_dtype) -> Graph:
    # Initializers read only as RNN weights (W, R, B, P) are read when their node is packed and
    # dropped right after, so at most one node's unpacked weights are in memory at a time.
    uses: dict[str, set[bool]] = {}
    for n in g.node:
        rnn = n.op_type in RNN_OPS and n.domain in ("", "ai.onnx")
        for k, name in enumerate(n.input):
            uses.setdefault(name, set()).add(rnn and k in (1, 2, 3, 7))
    for vi in g.output:
        uses.setdefault(vi.name, set()).add(False)
    constants: dict[str, np.ndarray] = {}
    lazy: dict = {}
    for i, t in enumerate(g.initializer):
        if not t.name:
            raise ModelFormatError("[load_onnx] an initializer has no name")
        if t.name in constants or t.name in lazy:
            # onnxruntime takes the first, a dict the last, and onnx.checker refuses the file:
            # there is no one right answer, so the file is refused, not read either way
            raise ModelFormatError(
                f"[load_onnx] two initializers are named {t.name!r}; expected unique names "
                "(onnx.checker.check_model rejects this file too). Rename or drop one"
            )
        if uses.get(t.name) == {True}:
            lazy[t.name] = _Lazy(reader, g, i)
        else:
            constants[t.name] = reader.initializer(g, i)
    if len(g.sparse_initializer):
        raise ModelFormatError("[load_onnx] sparse initializers are not supported")
    inputs = [
        _value_info(vi, "graph input")
        for vi in g.input
        if vi.name not in constants and vi.name not in lazy
    ]
    outputs = [_value_info(vi, "graph output") for vi in g.output]
    defined = set(constants) | set(lazy) | {t.name for t in inputs}
    nodes: list[Node] = []
    seen_names: set[str] = set()
    reserved = frozenset(o for n in g.node for o in n.output) | {vi.name for vi in g.output}
    if opset < 14:  # (onnxruntime refuses such a node; it ran batch-first here)
        for n in _every_node(g.node):
            if n.op_type in RNN_OPS and any(a.name == "layout" for a in n.attribute):
                raise ModelFormatError(
                    f"[load_onnx] node {n.name!r} ({n.op_type}): layout is an attribute of "
                    f"{n.op_type} from opset 14; the model imports opset {opset}"
                )
    protos = _topological(g.node, defined)
    _add_nodes(protos, {}, (), "", nodes, constants, defined, seen_names, reader, reserved)
    for t in outputs:
        if t.name not in defined:
            raise ModelFormatError(f"[load_onnx] graph output {t.name!r} is never produced")
    fixed = frozenset(vi.name for vi in g.input if vi.name in constants or vi.name in lazy)
    graph = Graph(inputs, outputs, nodes, constants, {}, opset, g.name or "graph", fixed)
    lower_quantized_lstms(graph)  # onnxruntime's DynamicQuantizeLSTM -> LSTM
    pack_constant_rnns(graph, pack_dtype, lazy)
    # A node left unpacked has a weight computed by other nodes: a constant subgraph (torch's
    # dynamo exporter builds W and R with Slice/Concat of initializers from H=48 on, while B
    # stays an initializer) that GraphModel folds at load before packing, or a graph input.
    # Its initializer weights become ordinary constants for that later packing.
    read = {i for n in graph.nodes for i in n.inputs}
    for k in sorted(k for k in lazy if k in read):
        graph.constants[k] = lazy[k].read()
    return graph


def _topological(protos, defined: set[str]) -> list:
    """The graph's nodes in an order that defines every tensor before it is read, the file's
    own where it does. onnx.checker refuses a file whose nodes are out of order, but
    onnxruntime sorts them and runs it (and tools that edit graphs append nodes at the end):
    graphlib's sort of them. Only the top-level list is sorted (a branch's own nodes must be
    in order). A cycle or a dangling name is left for check_node_io to name."""
    protos = list(protos)
    made: dict[str, int] = {}
    for k, n in enumerate(protos):
        for o in n.output:
            made.setdefault(o, k)

    def reads(n):  # its inputs and what its branches read from outside them
        names = set(n.input)
        for a in n.attribute:
            if a.HasField("g"):  # (its own initializers and outputs are not outer reads)
                inner = {o for m in _every_node(a.g.node) for o in m.output}
                inner |= {t.name for t in a.g.initializer}
                names |= {i for m in _every_node(a.g.node) for i in m.input if i not in inner}
                names |= {vi.name for vi in a.g.output if vi.name not in inner}
        return names

    needs = [{made[i] for i in reads(n) if i and i not in defined and i in made} - {k}
             for k, n in enumerate(protos)]  # fmt: skip
    if all(d < k for k, deps in enumerate(needs) for d in deps):
        return protos  # in order already (every file onnx.checker passes)
    try:
        order = graphlib.TopologicalSorter(dict(enumerate(needs))).static_order()
        return [protos[k] for k in order]
    except graphlib.CycleError:  # the file's order, refused by the check
        return protos


def _every_node(protos):
    """``protos`` and the nodes of every branch (If's) below them."""
    for n in protos:
        yield n
        for a in n.attribute:
            if a.HasField("g"):
                yield from _every_node(a.g.node)


def _add_nodes(protos, rename: dict, when: tuple, prefix: str, nodes: list, constants: dict,
               defined: set, seen_names: set, reader: _Reader,
               reserved: frozenset) -> None:  # fmt: skip
    """Convert ``protos`` (a graph's or a branch's nodes) into ``nodes``. ``rename`` maps a
    branch's own tensor names to graph-unique ones (names from outer scopes stay as they are);
    ``when`` is the conditions the nodes run under, ``prefix`` goes before their names (a
    branch's nodes are named under their If). An If's branches are flattened in front of
    it (see ``ir.Node``). ``reserved``: the top-level graph's tensor names, which a branch's
    renamed ones must avoid too (one defined after the If was refused as redefined)."""
    for i, n in enumerate(protos):
        op = n.op_type if n.domain in ("", "ai.onnx") else f"{n.domain}::{n.op_type}"
        name = prefix + (n.name or f"{n.op_type}_{i}")
        while name in seen_names:
            name = f"{name}_{i}"
        seen_names.add(name)
        where = f"node {name!r} ({op})"
        ins = tuple(rename.get(x, x) for x in n.input)
        for o in n.output:  # a branch's outputs get names no other tensor has
            if o and when:
                rename[o] = _fresh(f"{name}:{o}", defined, reserved)
        outs = tuple(rename.get(o, o) for o in n.output)
        check_node_io(f"[load_onnx] {where}", ins, outs, defined)
        if op == "Constant":
            if len(outs) != 1 or not outs[0]:
                raise ModelFormatError(f"[load_onnx] {where} must have exactly one output")
            constants[outs[0]] = _constant_node(n, reader, where)
            defined.add(outs[0])
            continue
        if op == "If":
            _add_if(n, name, ins, outs, rename, when, nodes, constants, defined, seen_names,
                    reader, reserved)  # fmt: skip
            continue
        attrs = _attrs(n, reader, where)
        if op == "Cast" and "to" in attrs:
            attrs["to"] = np_dtype(int(attrs["to"]), f"{where} attribute 'to'").name
        if op == "ConstantOfShape" and "value" in attrs:
            v = attrs["value"]
            if not isinstance(v, dict) or len(v["values"]) != 1:
                raise ModelFormatError(f"[load_onnx] {where}: value must be a one-element tensor")
        node = Node(op, name, ins, outs, attrs, when)
        if op in RNN_OPS:
            check_rnn_io(op, ins, outs, f"[load_onnx] {where}")
            node.attrs = rnn_attrs(op, attrs, where)
        nodes.append(node)
        defined |= {o for o in outs if o}


def _fresh(base: str, defined: set, reserved: frozenset) -> str:
    """``base``, primed until no tensor defined so far nor any top-level name has it."""
    while base in defined or base in reserved:
        base += "'"
    return base


def _add_if(n, name: str, ins, outs, rename: dict, when: tuple, nodes: list, constants: dict,
            defined: set, seen_names: set, reader: _Reader,
            reserved: frozenset) -> None:  # fmt: skip
    """An ONNX If: each branch's initializers become constants and its nodes are added under
    the condition (true for then_branch, false for else_branch), then one If node picks the
    branch outputs. A branch's names are its own: renamed apart from every other scope's."""
    from onnx import AttributeProto as A

    where = f"node {name!r} (If)"
    branches = {a.name: a.g for a in n.attribute if a.type == A.GRAPH}
    if len(ins) != 1 or not ins[0] or set(branches) != {"then_branch", "else_branch"}:
        raise ModelFormatError(
            f"[load_onnx] {where} needs one condition input and then_branch and else_branch "
            f"graphs; it has inputs {list(ins)} and graphs {sorted(branches)}"
        )
    picked = []
    for key, truth in (("then_branch", True), ("else_branch", False)):
        b = branches[key]
        if len(b.output) != len(outs):
            raise ModelFormatError(
                f"[load_onnx] {where}: {key} has {len(b.output)} outputs; the If has {len(outs)}"
            )
        if len(b.input) or len(b.sparse_initializer):
            raise ModelFormatError(f"[load_onnx] {where}: {key} declares inputs or sparse "
                                   "initializers; an If's branches take neither")  # fmt: skip
        inner = dict(rename)  # a branch sees the outer names, and its own apart
        for t in b.initializer:
            fresh = inner[t.name] = _fresh(f"{name}/{key}:{t.name}", defined, reserved)
            constants[fresh] = reader.array(t, f"{where} {key} initializer {t.name!r}")
            defined.add(fresh)
        _add_nodes(b.node, inner, (*when, (ins[0], truth)), f"{name}/{key}/", nodes,
                   constants, defined, seen_names, reader, reserved)  # fmt: skip
        got = [inner.get(o.name, o.name) for o in b.output]
        for o in got:
            if o not in defined:
                raise ModelFormatError(f"[load_onnx] {where}: {key} output {o!r} is never "
                                       "produced")  # fmt: skip
        picked += got
    nodes.append(Node("If", name, (ins[0], *picked), outs, {}, when))
    defined |= set(outs)


class _Lazy:
    """An initializer read only when its RNN node is packed (dtype and dims checked now)."""

    def __init__(self, reader: _Reader, g, index: int) -> None:
        self.reader, self.g, self.index = reader, g, index
        t = g.initializer[index]
        self.dims = reader._declared(t, f"initializer {t.name!r}")[1]

    def read(self, rows=None) -> np.ndarray:
        return self.reader.initializer(self.g, self.index, rows)
