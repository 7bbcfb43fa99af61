"""State dicts of torch.nn.LSTM/GRU/RNN from files: PyTorch checkpoints, .safetensors, .npz.

PyTorch files are pickles underneath, so they are read only with
``torch.load(..., weights_only=True)`` (torch's restricted unpickler, which refuses any global
but tensors and containers) and only when torch is installed — leanrnn never unpickles anything
itself. ``.safetensors`` and ``.npz`` (``allow_pickle=False``) need no torch; every declared array
size is checked against the bytes actually present before anything is allocated.
"""

from __future__ import annotations

import os
import re
import struct
import tokenize
import zipfile
import zlib
from typing import Any

import numpy as np

from ..errors import ModelFormatError, WeightsError
from . import native
from .torch_format import tensor_array

# What zipfile raises on corrupt archives (RuntimeError: "encrypted", from a flipped flag bit)
_ZIP_ERRORS = (
    zipfile.BadZipFile,
    zipfile.LargeZipFile,
    zlib.error,
    struct.error,
    EOFError,
    OSError,
    ValueError,
    NotImplementedError,
    RuntimeError,
    KeyError,
)

# A zip member (of an .npz or a PyTorch zip checkpoint) may decompress to at most this many
# times its stored size (plus 1 MiB), and all members together to this many times the archive
# (plus 1 MiB): weights barely compress, a zip bomb compresses enormously.
MAX_ZIP_RATIO = 64
_ZIP_SLACK = 1 << 20

# A checkpoint's RNN weights may view at most this many times the bytes their storages hold
# (plus _ZIP_SLACK): each view is packed apart, and an RNN's own weights share nothing.
MAX_SHARED_VIEWS = 4

# numpy's limit on an array's rank (numpy 2; numpy 1 had 32, and refuses more itself)
_MAX_NDIM = 64

_RNN_KEY = re.compile(r"^(.*?)weight_ih_l0$", re.DOTALL)  # (a prefix may hold a newline)
# The entries of a torch RNN module that leanrnn packs (weight_ih_l0, bias_hh_l3_reverse, ...)
_RNN_PARAM = re.compile(r"(weight|bias)_(ih|hh|hr)_l\d+(_reverse)?$")


def sniff(path: str) -> str:
    """What a file holds, by content: 'lrnn', 'safetensors', 'npz', 'torch-zip', 'pickle',
    'onnx' (a protobuf that starts like a ModelProto) or 'unknown'."""
    with open(path, "rb") as f:
        head = f.read(64)
        size = os.fstat(f.fileno()).st_size
    # An ONNX file's ninth byte may be a '{' too: one whose declared header cannot fit is
    # ONNX, when it starts like a ModelProto (else the safetensors reader says it is truncated)
    if native.is_safetensors(head) and (native.is_safetensors(head, size) or head[:1] != b"\x08"):
        return "lrnn" if native.is_native(path) else "safetensors"
    if head[:4] == b"PK\x03\x04" or head[:4] == b"PK\x05\x06":
        try:
            with zipfile.ZipFile(path) as z:
                names = z.namelist()
        except _ZIP_ERRORS:
            return "unknown"
        if any(n.endswith("data.pkl") for n in names):
            return "torch-zip"
        if names and all(n.endswith(".npy") for n in names):
            return "npz"
        return "unknown"
    if head[:1] == b"\x80" or head[:2] in (b"(d", b"}q", b"(l", b"cc"):
        return "pickle"
    if head[:1] == b"\x08":  # ModelProto field 1 (ir_version), varint
        return "onnx"
    return "unknown"


def check_zip_sizes(z: zipfile.ZipFile, path: str, op: str = "load",
                    error: type[Exception] = ModelFormatError) -> None:  # fmt: skip
    """Refuse an archive whose central directory (read without decompressing anything)
    declares more than its bytes can honestly hold: a stored member whose size is not its
    stored size, a compressed member inflating more than ``MAX_ZIP_RATIO`` times, or members
    that together inflate more than ``MAX_ZIP_RATIO`` times the archive; and a member
    compressed other than stored or deflated (what np.savez and torch.save write): zipfile
    bounds deflate's output per read, but inflates each read's bzip2 or LZMA input in full and
    cuts it afterwards, so a 1 KB member declaring 640 bytes took 2 GiB. The one check for
    every zip leanrnn opens (.npz models, arrays and score inputs; PyTorch checkpoints before
    ``torch.load``, whose reader inflates whole records before it checks them). ``error``: the
    class to raise (a model's ModelFormatError, an input's DataError)."""
    archive = os.path.getsize(path)
    total = 0
    for info in z.infolist():
        n, packed = info.file_size, info.compress_size
        if info.compress_type not in (zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED):
            raise error(
                f"[{op}] {path!r}: member {info.filename!r} is compressed with method "
                f"{info.compress_type}; expected stored or deflated (np.savez, "
                "np.savez_compressed and torch.save write only those). Save it again with one "
                "of them"
            )
        if info.compress_type == zipfile.ZIP_STORED:
            bad = n != packed or packed > archive
        else:
            bad = packed > archive or n > MAX_ZIP_RATIO * packed + _ZIP_SLACK
        if bad:
            raise error(
                f"[{op}] {path!r}: member {info.filename!r} claims to inflate {packed} stored "
                f"bytes to {n} (the archive is {archive} bytes); expected at most "
                f"{MAX_ZIP_RATIO}x its stored size; refusing (zip bomb?). Re-save the "
                "weights uncompressed"
            )
        total += n
    if total > MAX_ZIP_RATIO * archive + _ZIP_SLACK:
        raise error(
            f"[{op}] {path!r}: its {len(z.infolist())} members inflate to {total} bytes in "
            f"all from a {archive}-byte archive; expected at most {MAX_ZIP_RATIO}x; refusing "
            "(zip bomb?). Re-save the weights uncompressed"
        )


def read_npz(path: str) -> dict[str, np.ndarray]:
    """Arrays of an .npz without pickles; each member's declared shape is checked against its
    stored size before it is read."""
    op = "load"
    out = {}
    try:
        with zipfile.ZipFile(path) as z:
            check_zip_sizes(z, path, op)
            for info in z.infolist():
                name = info.filename
                if not name.endswith(".npy"):
                    raise ModelFormatError(f"[{op}] {path!r}: member {name!r} is not a .npy array")
                with z.open(info) as f:
                    shape, fortran, dtype = _npy_header(f, path, name, op)
                    if dtype.hasobject:
                        raise ModelFormatError(
                            f"[{op}] {path!r}: member {name!r} holds Python "
                            "objects; refusing (pickles are never loaded)"
                        )
                    want = int(np.prod(shape, dtype=object)) * dtype.itemsize
                    have = info.file_size - f.tell()
                    if want != have:
                        raise ModelFormatError(
                            f"[{op}] {path!r}: member {name!r} declares {dtype}{list(shape)} = "
                            f"{want} bytes but holds {have}"
                        )
                    data = f.read(want)
                    if len(data) != want:
                        raise ModelFormatError(f"[{op}] {path!r}: member {name!r} is truncated")
                arr = np.frombuffer(data, dtype).reshape(shape, order="F" if fortran else "C")
                out[name[: -len(".npy")]] = np.asarray(arr, order="C")
    except ModelFormatError:
        raise
    except _ZIP_ERRORS as e:
        raise ModelFormatError(f"[{op}] {path!r} is not a readable .npz: {e}") from None
    return out


def _npy_header(f, path: str, name: str, op: str) -> tuple[tuple[int, ...], bool, np.dtype]:
    """(shape, fortran order, dtype) of the .npy member ``name`` open as ``f``. numpy parses
    the header's Python literal with tokenize and ast, which raise TokenError, SyntaxError or
    RecursionError as well as ValueError on hostile text: each means a malformed header, and
    the error names the file and the member."""
    shape, fortran, dtype = (), False, np.dtype(np.float32)  # an unknown version: refused below
    try:
        version = np.lib.format.read_magic(f)
        if version == (1, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_1_0(f)
        elif version == (2, 0):
            shape, fortran, dtype = np.lib.format.read_array_header_2_0(f)
    except (ValueError, TypeError, SyntaxError, tokenize.TokenError, RecursionError) as e:
        raise ModelFormatError(
            f"[{op}] {path!r}: member {name!r} has a malformed .npy header "
            f"({type(e).__name__}: {str(e)[:200]}); re-save it with numpy.savez"
        ) from None
    if version not in ((1, 0), (2, 0)):
        raise ModelFormatError(
            f"[{op}] {path!r}: member {name!r} uses .npy format {version}; expected 1.0 or 2.0"
        )
    if len(shape) > _MAX_NDIM or not all(isinstance(d, int) and d >= 0 for d in shape):
        raise ModelFormatError(
            f"[{op}] {path!r}: member {name!r} has a malformed .npy header: shape "
            f"{str(shape)[:200]}; expected at most {_MAX_NDIM} non-negative ints"
        )
    return shape, fortran, dtype


def read_torch(path: str) -> dict[str, np.ndarray]:
    """A PyTorch checkpoint's tensors via torch.load(weights_only=True); never without torch."""
    op = "load"
    try:
        import torch
    except ImportError:
        raise ModelFormatError(
            f"[{op}] {path!r} is a PyTorch (pickle-based) checkpoint; reading it safely needs "
            "torch (torch.load with weights_only=True): pip install 'leanrnn[torch]' (in a "
            "clone: pip install -e '.[torch]'), or re-save the state dict as .safetensors or .npz"
        ) from None
    if zipfile.is_zipfile(path):  # the zip format (torch >= 1.6); the legacy one is a pickle
        try:
            z = zipfile.ZipFile(path)
        except _ZIP_ERRORS as e:
            raise ModelFormatError(
                f"[{op}] {path!r} is not a readable PyTorch zip checkpoint: {e}"
            ) from None
        with z:
            check_zip_sizes(z, path, op)
    try:
        # A file object, not the path: torch.load picks its reader by the name (a path ending
        # in .safetensors goes to the safetensors library), and the content decided already.
        with open(path, "rb") as f:
            obj = torch.load(f, map_location="cpu", weights_only=True)
    except Exception as e:  # torch raises UnpicklingError, RuntimeError, EOFError, ...
        raise ModelFormatError(
            f"[{op}] {path!r}: {_torch_refusal(e)} (a checkpoint must be a state dict of "
            "tensors; leanrnn never unpickles code)"
        ) from None
    if isinstance(obj, dict) and "state_dict" in obj and isinstance(obj["state_dict"], dict):
        obj = obj["state_dict"]
    if not isinstance(obj, dict):
        raise ModelFormatError(
            f"[{op}] {path!r} holds a {type(obj).__name__}; expected a state "
            "dict (save module.state_dict(), not the module)"
        )
    # Training checkpoints nest the state dict ({"epoch": 5, "model_state_dict": sd,
    # "optimizer_state_dict": ...}, PyTorch's own tutorial): nested dicts become key prefixes
    # ("model_state_dict.rnn.weight_ih_l0", which prefix= picks), entries that are not tensors
    # (numbers, strings, a module's _extra_state) are left out.
    obj = _tensors_of(obj, path, op)
    # A tensor's shape and strides are declared in the pickle: a stride-0 view of one stored
    # float can declare 2**30 of them. Contiguous tensors become numpy views of the storage
    # torch already read (bounded by check_zip_sizes); only other views are copied, and those
    # copies may not exceed what the file stores.
    stored: dict[int, int] = {}
    rnn_stored: dict[int, int] = {}  # the storages of the entries an RNN packs, and their views
    copies = viewed = widened = 0
    for k, v in obj.items():
        # weights_only also unpickles sparse, quantized, nested and meta tensors and float8;
        # their storage and .numpy() raise torch's own errors (a traceback from the CLI)
        kind = _tensor_kind(v, torch)
        if kind:
            raise WeightsError(
                f"[{op}] {path!r}: entry {k!r} is a {kind} tensor; expected dense (strided) "
                "float or integer tensors on the CPU, as module.state_dict() holds them"
            )
        storage = v.untyped_storage()
        stored[storage.data_ptr()] = storage.nbytes()
        n = v.numel() * v.element_size()
        if n > storage.nbytes():
            raise ModelFormatError(
                f"[{op}] {path!r}: entry {k!r} declares {list(v.shape)} ({n} bytes) over "
                f"{storage.nbytes()} stored bytes (strides {list(v.stride())}); refusing a "
                "tensor larger than its storage. Save contiguous tensors (.contiguous())"
            )
        copies += 0 if v.is_contiguous() else n
        if v.dtype == torch.bfloat16:  # widened to float32 below: a copy of twice the bytes
            widened += 2 * n
        if _RNN_PARAM.search(str(k)):
            rnn_stored[storage.data_ptr()] = storage.nbytes()
            viewed += n
    # An RNN's entries are packed once each, layer by layer: a 1 MiB file of a 200-layer LSTM
    # whose every weight views one storage packed 810 MiB. (Other modules' entries may share
    # storage freely, as a layer registered under several names does: they are not packed.)
    if viewed > MAX_SHARED_VIEWS * sum(rnn_stored.values()) + _ZIP_SLACK:
        raise ModelFormatError(
            f"[{op}] {path!r}: its RNN weights view {viewed} bytes in all of "
            f"{sum(rnn_stored.values())} stored (tensors sharing storage); refusing more than "
            f"{MAX_SHARED_VIEWS}x. Save each weight in its own storage (.clone())"
        )
    if copies + widened > 2 * sum(stored.values()):
        # (bfloat16 entries viewing one storage each widen to a copy of their own: a 2 MB
        # file of 64 names for one tensor asked for 256 MiB)
        raise ModelFormatError(
            f"[{op}] {path!r}: its non-contiguous and bfloat16 tensors would copy "
            f"{copies + widened} bytes out of {sum(stored.values())} stored; refusing. Save "
            "contiguous tensors (.contiguous()), each in its own storage (.clone())"
        )
    return {str(k): tensor_array(v) for k, v in obj.items()}


def _tensors_of(obj: dict, path: str, op: str) -> dict:
    """The tensors of a (nested) checkpoint dict, by dotted key: dicts _NESTING levels deep at
    most, each walked once (a pickle can name one dict many times: 32 references a level made
    a 3 KB file a million entries), _MAX_ENTRIES entries in all, and no two entries under one
    key ({"rnn.w": a, "rnn": {"w": b}})."""
    import torch

    out: dict = {}
    walked = 0
    seen = {id(obj)}
    stack = [("", obj, 0)]
    while stack:
        prefix, d, depth = stack.pop()
        for k, v in d.items():
            walked += 1
            if walked > _MAX_ENTRIES:
                raise ModelFormatError(f"[{op}] {path!r}: more than {_MAX_ENTRIES} entries; "
                                       "expected a state dict")  # fmt: skip
            key = f"{prefix}{k}"
            if isinstance(v, dict):
                if id(v) in seen or depth >= _NESTING:
                    why = "is named twice" if id(v) in seen else f"nests past {_NESTING} levels"
                    raise ModelFormatError(f"[{op}] {path!r}: the dict at {key!r} {why}; "
                                           "expected a state dict (or one in a checkpoint dict)")  # fmt: skip
                seen.add(id(v))
                stack.append((key + ".", v, depth + 1))
            elif isinstance(v, torch.Tensor):
                if key in out:
                    raise ModelFormatError(f"[{op}] {path!r}: two entries are named {key!r} "
                                           "(one nested); expected unique names")  # fmt: skip
                out[key] = v
    if not out:
        raise ModelFormatError(f"[{op}] {path!r} holds no tensors; expected a state dict "
                               "(save module.state_dict(), not the module)")  # fmt: skip
    return dict(sorted(out.items()))


_NESTING = 4  # dict levels of a training checkpoint walked for tensors
_MAX_ENTRIES = 1 << 20


def _tensor_kind(v, torch) -> str | None:
    """What makes tensor ``v`` other than a dense CPU tensor numpy can view, or None."""
    if v.layout != torch.strided:
        return str(v.layout).removeprefix("torch.")
    if v.is_nested:
        return "nested"
    if v.is_quantized:
        return f"quantized ({v.dtype})"
    if v.device.type != "cpu":
        return f"{v.device.type}-device"
    if v.dtype.is_complex or (v.dtype.itemsize == 1 and v.dtype.is_floating_point):
        return f"{v.dtype}"
    return None


def _torch_refusal(e: Exception) -> str:
    """Why torch.load refused, without torch's advice: its message opens with "Re-running
    torch.load with weights_only set to False will likely succeed", which for a hostile file
    means running its code, and the reason (the global the pickle wanted) comes after it."""
    text = str(e)
    refused = re.search(r"GLOBAL ([\w.]+)", text)
    if refused:
        return (
            f"torch.load(weights_only=True) refused its pickle, which calls "
            f"{refused.group(1)}, not a tensor or container"
        )
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    if lines and lines[0].startswith("Weights only load failed"):
        lines = [ln for ln in lines[1:] if "weights_only" not in ln and "documentation" not in ln]
    why = lines[0][:300] if lines else ""
    return f"torch.load(weights_only=True) refused or failed: {type(e).__name__}: {why}"


def read_state_dict(path: str, kind: str | None = None) -> dict[str, np.ndarray]:
    """A state dict from any supported checkpoint file (``kind`` from ``sniff``)."""
    path = os.fspath(path)
    kind = kind or sniff(path)
    if kind == "safetensors":
        return native.read_safetensors(path)
    if kind == "npz":
        return read_npz(path)
    if kind in ("torch-zip", "pickle"):
        return read_torch(path)
    raise ModelFormatError(
        f"[load] {path!r} is not a state-dict file (.pt/.pth, .safetensors or .npz)"
    )


def select_rnn(sd: dict[str, Any], prefix: str | None, path: str | None,
               where: str = "load") -> dict[str, Any]:  # fmt: skip
    """The one RNN module's entries of a state dict, prefix stripped (``lstm.weight_ih_l0`` ->
    ``weight_ih_l0``). With several RNN modules, or other parameters besides, ``prefix`` must
    say which module to take — nothing is dropped silently. ``path``: the file the dict came
    from, for the messages (None: a dict passed in); ``where``: the caller's name for them."""
    if prefix is not None and not isinstance(prefix, str):
        raise WeightsError(f"[{where}] prefix={prefix!r}; expected a str such as 'encoder.rnn.'")
    of = f"{path!r}" if path is not None else "the state dict"
    prefixes = sorted({m.group(1) for k in sd if (m := _RNN_KEY.match(k))})
    if prefix is None:
        if not prefixes:
            raise WeightsError(
                f"[{where}] {of} has no '*weight_ih_l0' entry among keys "
                f"{sorted(sd)[:8]}; expected a torch.nn.LSTM/GRU/RNN state dict"
            )
        if len(prefixes) > 1:
            raise WeightsError(
                f"[{where}] {of} holds several RNN modules {prefixes}; pass prefix="
                + (" (on the command line: --prefix)" if path is not None else "")
                + " to pick one"
            )
        prefix = prefixes[0]
        others = sorted(k for k in sd if not k.startswith(prefix))
        if others:
            raise WeightsError(
                f"[{where}] {of} holds other parameters besides the RNN {prefix!r}: "
                f"{others[:8]}; pass prefix={prefix!r}"
                + (f" (on the command line: --prefix {prefix})" if path is not None else "")
                + " to load just the RNN"
            )
    if prefix and not prefix.endswith(".") and any(k.startswith(prefix + ".") for k in sd):
        prefix += "."  # prefix="rnn" means the module "rnn." (its keys go on after a dot)
    picked = {k[len(prefix) :]: v for k, v in sd.items() if k.startswith(prefix)}
    if not picked:
        raise WeightsError(
            f"[{where}] {of}: no keys start with prefix {prefix!r}; RNN prefixes "
            f"present: {prefixes}"
        )
    return picked
