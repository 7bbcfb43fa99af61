"""The KServe v2 protocol's content, independent of the transport: a model's metadata and config,
the sequence parameters (Triton's sequence extension), and tensors checked against the model.

A served recurrent stack takes, per request, ``x`` [T, C] (T steps of one stream; T >= 1) and
at ``sequence_start`` optionally ``h0`` [L, K] and ``c0`` [L, H] (a restored snapshot); it
returns ``y`` [T, K] and the state after the request, ``h_n`` [L, K] and ``c_n`` [L, H] (LSTM),
which a later ``sequence_start`` can take back as h0/c0. ``max_batch_size`` is 0: clients send
one stream per request and the server batches across streams itself.
"""

from __future__ import annotations

import itertools
import reprlib
from dataclasses import dataclass, field

import numpy as np

from .errors import InvalidRequest, NotFound

VERSION = "1"
PLATFORM = "leanrnn"
# "sequence(string_id)": string sequence ids work too (the sequence extension's word for it)
EXTENSIONS = ["binary_tensor_data", "sequence", "sequence(string_id)", "model_configuration",
              "statistics"]  # fmt: skip
DATATYPES = {np.dtype(np.float32): "FP32", np.dtype(np.float64): "FP64"}
CONFIG_TYPES = {"FP32": "TYPE_FP32", "FP64": "TYPE_FP64"}
_anonymous = itertools.count(1)
# Error messages echo what the client sent, cut to this many characters: a 1e6-element shape
# or a 7 MB datatype string came back whole, in the answer and in the log line.
ECHO = 100


_echo = reprlib.Repr()  # looks at no more of a container or string than it prints
_echo.maxlevel, _echo.maxlist, _echo.maxtuple, _echo.maxdict = 3, 30, 30, 10
_echo.maxstring, _echo.maxlong, _echo.maxother = ECHO, ECHO, ECHO


def clip(v) -> str:
    """``repr(v)`` cut to about ECHO characters, with '...' where cut: client input in
    messages."""
    r = _echo.repr(v)
    return r if len(r) <= ECHO else r[:ECHO] + "..."


@dataclass
class Tensor:
    """A model input or output as the protocol describes it; -1 is a free dimension."""

    name: str
    shape: tuple[int, ...]
    optional: bool = False


@dataclass
class ModelInfo:
    """What the protocol says about one served model (built from its ``Lane``)."""

    name: str
    datatype: str
    dtype: np.dtype
    inputs: dict[str, Tensor]
    outputs: dict[str, Tensor]
    idle_timeout: float
    max_streams: int
    cell: str

    @classmethod
    def of(cls, lane) -> ModelInfo:
        L, K, H, C = lane.L, lane.K, lane.H, lane.C
        ins = {"x": Tensor("x", (-1, C)), "h0": Tensor("h0", (L, K), optional=True)}
        outs = {"y": Tensor("y", (-1, K)), "h_n": Tensor("h_n", (L, K))}
        if lane.lstm:
            ins["c0"] = Tensor("c0", (L, H), optional=True)
            outs["c_n"] = Tensor("c_n", (L, H))
        return cls(lane.name, DATATYPES[lane.dtype], lane.dtype, ins, outs, lane.idle_timeout,
                   lane.max_streams, lane.spec.cell)  # fmt: skip

    def metadata(self) -> dict:
        def t(x: Tensor) -> dict:
            return {"name": x.name, "datatype": self.datatype, "shape": list(x.shape)}

        return {
            "name": self.name,
            "versions": [VERSION],
            "platform": PLATFORM,
            "inputs": [t(x) for x in self.inputs.values()],
            "outputs": [t(x) for x in self.outputs.values()],
        }

    def config(self) -> dict:
        """Triton's model configuration (model_config.proto's JSON form): the same dict fills
        the gRPC ModelConfig message through json_format.ParseDict."""
        dt = CONFIG_TYPES[self.datatype]
        return {
            "name": self.name,
            "platform": PLATFORM,
            "backend": PLATFORM,
            "max_batch_size": 0,
            "input": [
                {"name": x.name, "data_type": dt, "dims": list(x.shape), "optional": x.optional}
                for x in self.inputs.values()
            ],
            "output": [
                {"name": x.name, "data_type": dt, "dims": list(x.shape)}
                for x in self.outputs.values()
            ],
            "sequence_batching": {
                # a uint64 in Triton's ModelConfig (1e14 s failed gRPC's ModelConfig)
                "max_sequence_idle_microseconds": min(int(self.idle_timeout * 1e6), 2**64 - 1),
                # the live sequences it holds (--max-streams; past them a new one is refused
                # with 429, where Triton's backlog would queue it)
                "oldest": {"max_candidate_sequences": min(self.max_streams, 2**31 - 1)},
            },
            "parameters": {"cell": {"string_value": self.cell}},
        }


@dataclass
class Parsed:
    """One inference request, decoded and checked against its model."""

    model: str
    id: str
    key: tuple
    start: bool
    end: bool
    x: np.ndarray
    h0: np.ndarray | None = None
    c0: np.ndarray | None = None
    outputs: list[str] = field(default_factory=list)
    binary: dict[str, bool] = field(default_factory=dict)


def check_version(model: str, version: str | None) -> None:
    if version not in (None, "", VERSION):
        raise NotFound(
            f"[infer] model {clip(model)} has no version {clip(version)}; it has version "
            f"{VERSION} only"
        )


def flag(params: dict, key: str, default: bool, whose: str = "") -> bool:
    """A boolean request parameter (``whose``: "output 'y''s ", to say where it was): "yes"
    or 1 was read as false without a word."""
    v = params.get(key, default)
    if not isinstance(v, bool):
        raise InvalidRequest(f"[infer] {whose}parameter {key}={clip(v)}; expected true or false")
    return v


def check_listed(info: ModelInfo, inputs: int, outputs: int) -> None:
    """A model has a handful of inputs and outputs, each listed once at most: a request listing
    more than one beyond them is refused before any loop over them (600,000 requested outputs
    in 15 KB of gzip held the event loop for 2.7 s; 16 MiB of empty gRPC ``outputs {}``
    entries took 12 s). The one beyond is named by the checks of each name."""
    for what, n, have in (("inputs", inputs, info.inputs), ("outputs", outputs, info.outputs)):
        # one more than the model has gets through, to be named by the checks of each name (a
        # GRU sent an LSTM's x, h0, c0 heard "3 inputs listed", not which one it lacks)
        if n > len(have) + 1:
            raise InvalidRequest(
                f"[infer] {n} {what} listed; model {info.name!r} has {len(have)}: "
                f"{sorted(have)}, each listed once at most"
            )


def unsupported(params: dict, what: str) -> None:
    """Refuse the parameters of protocol extensions this server does not implement (nor list
    in its metadata) on an input or requested output (``what``: "output 'y'"): a requested
    classification or shared-memory output was answered as the plain tensor in the body, and
    the client read strings that were not there, or its shared memory unwritten."""
    for key in params:
        if key == "classification":
            raise InvalidRequest(
                f"[infer] {what} asks for classification (class_count); this server does not "
                "implement the classification extension: request the tensor and take its top "
                "classes in the client"
            )
        if key.startswith("shared_memory_"):
            raise InvalidRequest(
                f"[infer] {what} has parameter {clip(key)}; this server does not implement the "
                "shared-memory extensions: send the data in the request (binary_data or raw "
                "contents)"
            )


def sequence(params: dict) -> tuple[tuple, bool, bool]:
    """(key, start, end) from the request parameters. A request without a sequence_id (or with
    0 or "", Triton's "no sequence") is a sequence of its own: it starts and ends with this
    request (Triton refuses such a request to a sequence model; this server lets a stateless
    call through)."""
    sid = params.get("sequence_id")
    start, end = flag(params, "sequence_start", False), flag(params, "sequence_end", False)
    # bool first: False == 0, and "sequence_id": false must be refused as true is
    if isinstance(sid, bool) or not isinstance(sid, int | str | None):
        raise InvalidRequest(
            f"[infer] parameter sequence_id={clip(sid)}; expected an unsigned integer or a string"
        )
    if sid is None or sid == 0 or sid == "":
        if start or end:  # the sequence extension: they need a non-zero, non-empty id
            raise InvalidRequest(
                '[infer] sequence_start/sequence_end without a sequence_id (or with 0 or "", '
                "which mean no sequence); give the sequence an id, or drop the flags for a "
                "stateless call"
            )
        return ("", next(_anonymous)), True, True
    if isinstance(sid, int) and not 0 < sid < 1 << 64:
        raise InvalidRequest(f"[infer] sequence_id={clip(sid)}; expected an integer in 1..2**64-1")
    if isinstance(sid, str) and len(sid) > 256:
        raise InvalidRequest(f"[infer] sequence_id is a {len(sid)}-character string; at most 256")
    return ("i" if isinstance(sid, int) else "s", sid), start, end


def check_input(info: ModelInfo, name: str, datatype: str, shape) -> tuple[int, ...]:
    """The shape of input ``name`` if its datatype and shape are what the model takes."""
    t = info.inputs.get(name)
    if t is None:
        raise InvalidRequest(
            f"[infer] unexpected input {clip(name)} for model {info.name!r}; it takes "
            f"{sorted(info.inputs)} (x required; the others only with sequence_start)"
        )
    if datatype != info.datatype:
        raise InvalidRequest(
            f"[infer] input {name!r} has datatype {clip(datatype)}; model {info.name!r} takes "
            f"{info.datatype}; convert the data"
        )
    if (
        not isinstance(shape, list | tuple)
        or not all(isinstance(d, int) and not isinstance(d, bool) and d >= 0 for d in shape)
        or len(shape) != len(t.shape)
        or any(want != -1 and d != want for d, want in zip(shape, t.shape, strict=False))
    ):
        raise InvalidRequest(
            f"[infer] input {name!r} has shape {clip(shape)}; model {info.name!r} expects "
            f"{list(t.shape)} (-1: any number of steps)"
        )
    if any(d > 1 << 40 for d in shape):
        raise InvalidRequest(f"[infer] input {name!r} has shape {list(shape)}: too large")
    return tuple(shape)


def from_bytes(info: ModelInfo, name: str, shape: tuple, data: bytes | memoryview) -> np.ndarray:
    """A tensor from its raw little-endian bytes; their count must match the shape exactly."""
    want = int(np.prod(shape)) * info.dtype.itemsize
    if len(data) != want:
        raise InvalidRequest(
            f"[infer] input {name!r} of shape {list(shape)} {info.datatype} needs {want} bytes "
            f"of data; got {len(data)}"
        )
    return np.frombuffer(data, info.dtype.newbyteorder("<")).astype(info.dtype).reshape(shape)


def _holds_bool(data) -> bool:
    """Whether JSON ``data`` holds a true/false among its numbers: numpy makes [0.5, true] a
    float array with 1.0 in it, silently (Triton refuses a BOOL in an FP32 tensor)."""
    todo = [data]
    while todo:
        v = todo.pop()
        if type(v) is bool:
            return True
        if type(v) is list:
            if any(type(e) is bool for e in v):
                return True
            todo.extend(e for e in v if type(e) is list)
    return False


def from_list(info: ModelInfo, name: str, shape: tuple, data) -> np.ndarray:
    """A tensor from JSON data: a flat or nested list of numbers, as many as the shape holds."""
    try:
        a = np.asarray(data)
    except ValueError:
        a = None
    if a is None or a.dtype.kind not in "fiu" or a.dtype == np.bool_ or _holds_bool(data):
        raise InvalidRequest(
            f"[infer] input {name!r}: data must be a (flat or nested) list of numbers"
        )
    n = int(np.prod(shape))
    if a.size != n:
        raise InvalidRequest(
            f"[infer] input {name!r} of shape {list(shape)} needs {n} values; got {a.size}"
        )
    # JSON has no NaN or infinity (RFC 8259), and a number past the datatype's range became
    # inf in the cast, silently (numpy's overflow warning went into the log instead)
    big = np.finfo(info.dtype).max
    if a.size and (not np.isfinite(a).all() or np.abs(a).max() > big):
        raise InvalidRequest(
            f"[infer] input {name!r}: data holds a value that is not a finite {info.datatype} "
            f"number (NaN, infinity, or beyond +-{big:.7g}); send finite numbers in range"
        )
    return np.ascontiguousarray(a.reshape(shape), dtype=info.dtype)


def assemble(info: ModelInfo, request_id: str, params: dict, tensors: dict,
             outputs: list[str] | None, binary: dict[str, bool]) -> Parsed:  # fmt: skip
    """Check the set of inputs and requested outputs; decode the sequence parameters."""
    if "x" not in tensors:
        raise InvalidRequest(
            f"[infer] no input 'x' in the request for model {info.name!r}; it takes "
            f"x {list(info.inputs['x'].shape)} {info.datatype}"
        )
    key, start, end = sequence(params)
    if outputs is None:
        outputs = list(info.outputs)
    for k, name in enumerate(outputs):
        if name not in info.outputs:
            raise InvalidRequest(
                f"[infer] unknown output {clip(name)} requested from model {info.name!r}; it has "
                f"{list(info.outputs)}"
            )
        if name in outputs[:k]:  # as an input listed twice is
            raise InvalidRequest(f"[infer] output {clip(name)} is requested twice")
    return Parsed(info.name, request_id, key, start, end, tensors["x"], tensors.get("h0"),
                  tensors.get("c0"), outputs, binary)  # fmt: skip
