"""``load``, ``save`` and ``convert``: every supported model file in, the native ``.lrnn`` out.

The kind of file is decided by its content (magic bytes), not its name, so a pickle renamed to
``.onnx`` is still treated as a pickle — and pickles are only ever opened through
``torch.load(weights_only=True)``.

    >>> import leanrnn
    >>> model = leanrnn.load("model.onnx")               # doctest: +SKIP
    >>> leanrnn.convert("model.onnx", "model.lrnn")      # doctest: +SKIP
"""

from __future__ import annotations

import os

import numpy as np

from .engine._check import count_or_none
from .engine.model import RunnableModel
from .errors import DTypeError, ModelFormatError
from .formats import checkpoint, native
from .formats.onnx_import import read_onnx
from .formats.packing import SUPPORTED_DTYPES, PackedWeights
from .graph_model import GraphModel
from .nn import GRU, LSTM, RNN, Model

_CELL_MODULES: dict[str, type[Model]] = {"lstm": LSTM, "gru": GRU, "rnn": RNN}

__all__ = ["convert", "load", "save"]


def load(
    path,
    *,
    threads: int | np.integer | None = None,
    verify: bool = True,
    prefix: str | None = None,
    cell: str | None = None,
    nonlinearity: str | None = None,
    batch_first: bool | None = None,
    dtype=None,
) -> Model | GraphModel:
    """Load a model from ``path``; returns an ``LSTM``/``GRU``/``RNN`` for a recurrent stack or a
    ``GraphModel`` for a graph (ONNX, or a ``.lrnn`` converted from one).

    Supported: ``.lrnn`` (native; ``verify`` checks its checksum), ONNX, and state dicts of
    torch.nn.LSTM/GRU/RNN as PyTorch checkpoints (needs torch; read with weights_only=True),
    ``.safetensors`` or ``.npz``. For state dicts, ``prefix`` picks the module inside a larger
    state dict (e.g. ``"encoder.lstm."``), ``cell`` overrides the cell read off the weight
    shapes, ``nonlinearity`` ('tanh' (default) or 'relu', an RNN's) and ``batch_first``
    (default False) are what the file cannot record, and ``dtype`` converts the weights
    (default: as stored; also for a ``.lrnn`` stack). A ``.lrnn`` or ONNX file records its cell,
    layout and dtype: these options are refused there unless they agree with the file, never
    ignored.
    """
    path = _path(path, "load")
    threads = count_or_none("load", "threads", threads)
    if not isinstance(verify, bool | np.bool_):
        raise ModelFormatError(f"[load] verify={verify!r}; expected True or False")
    dtype = _float_dtype(dtype)
    asked = {k: v for k, v in (("prefix", prefix), ("cell", cell), ("nonlinearity", nonlinearity),
                               ("batch_first", batch_first)) if v is not None}  # fmt: skip
    if not os.path.isfile(path):
        raise ModelFormatError(f"[load] {path!r} does not exist or is not a file")
    kind = checkpoint.sniff(path)
    if kind == "lrnn":
        obj = native.load(path, verify=verify)
        if isinstance(obj, PackedWeights):
            _agree(path, asked, _recorded(obj.spec))
            model = _CELL_MODULES[obj.spec.cell]._from_packed(obj, threads)
            if dtype is not None and dtype != model.dtype and obj.precision != "float":
                # (astype's own advice is a Python call; this is also `run --dtype`'s error)
                raise DTypeError(
                    f"[load] {path!r} holds {obj.precision} weights, which run float32 only; "
                    f"load it without dtype={dtype.name} (run: without --dtype), or load the "
                    "float32 model it was made from in float64"
                )
            return model if dtype is None or dtype == model.dtype else model.astype(dtype)
        return _graph_model(path, obj, asked, dtype, threads)
    if kind in ("safetensors", "npz", "torch-zip", "pickle"):
        if prefix is not None and not isinstance(prefix, str):
            raise ModelFormatError(f"[load] prefix={prefix!r}; expected a str such as "
                                   "'encoder.lstm.' (the keys' common start)")  # fmt: skip
        sd = checkpoint.select_rnn(checkpoint.read_state_dict(path, kind), prefix, path)
        model = Model.from_state_dict(
            sd, cell=cell, nonlinearity="tanh" if nonlinearity is None else nonlinearity,
            batch_first=False if batch_first is None else batch_first, dtype=dtype,
        )  # fmt: skip
        if threads is not None:
            model.session.threads = threads
        return model
    # ONNX has no magic number; whatever is not recognized above is tried as an ONNX protobuf.
    try:
        graph = read_onnx(path)
    except ModelFormatError as e:
        if kind == "onnx" or path.lower().endswith(".onnx"):
            raise
        raise ModelFormatError(
            f"[load] {path!r} is not a recognized model file: expected .lrnn, ONNX, a PyTorch "
            f"checkpoint, .safetensors or .npz (as ONNX: {e})"
        ) from None
    return _graph_model(path, graph, asked, dtype, threads)


def _graph_model(path: str, graph, asked: dict, dtype, threads) -> GraphModel:
    """A graph file's GraphModel, the options asked of it agreeing with what it records: its
    weights' float dtype, when its packed RNN weights have one (dtype="float32" for a float32
    graph was refused as not agreeing)."""
    dts = {pw.dtype.name for pw in graph.packed.values()}
    if not dts:  # no packed RNN weights (none, or fed as inputs): the float inputs' declared
        dts = {t.dtype for t in graph.inputs if t.dtype in ("float32", "float64")}
    _agree(path, {**asked, **({"dtype": dtype.name} if dtype is not None else {})},
           {"dtype": dts.pop()} if len(dts) == 1 else {}, graph=True)  # fmt: skip
    return GraphModel(graph, threads=threads)


def _float_dtype(dtype) -> np.dtype | None:
    if dtype is None:
        return None
    try:
        dt = np.dtype(dtype)
    except TypeError:
        dt = None
    # by name: np.dtype(None) is float64, and a dtype compares equal to None
    if dt is None or dt.name not in {d.name for d in SUPPORTED_DTYPES}:
        raise DTypeError(f"[load] dtype={dtype!r}; expected np.float32, np.float64 or None (as "
                         "stored)")  # fmt: skip
    return dt


def _recorded(spec) -> dict:
    """What a stack's .lrnn file records of the options a state dict cannot."""
    rec = {"cell": spec.cell, "batch_first": spec.batch_first}
    if spec.cell == "rnn" and spec.activations:
        rec["nonlinearity"] = spec.activations[0][0].name
    return rec


def _agree(path: str, asked: dict, recorded: dict, graph: bool = False) -> None:
    """Refuse options a file has its own answer to, unless they agree with it: ignoring them
    (batch_first=True on a time-major .lrnn) would run other data than the caller meant."""
    bad = {k: v for k, v in asked.items() if recorded.get(k, object()) != v}
    if bad:
        what = ", ".join(f"{k}={v!r}" for k, v in bad.items())
        has = ", ".join(f"{k}={recorded[k]!r}" for k in bad if k in recorded)
        raise ModelFormatError(
            f"[load] {what} given for {path!r}, a .lrnn/ONNX file that records its own model"
            + (f" ({has})" if has else "")
            + "; these options are for state dicts (.pt, .safetensors, .npz), which cannot "
            + ("record them: drop them (a graph computes in the dtypes its file declares)"
               if graph else "record them: drop them (a stack's dtype converts: "
               "load(path, dtype=...) or model.astype)")
        )  # fmt: skip


def _path(path, op: str) -> str:
    """``path`` as a str: a str, bytes or os.PathLike; anything else is named. Bytes that
    cannot be a path (a serialized model, as onnxruntime takes) are refused as such: they were
    taken for a file name and quoted whole in the error (4x the model's size)."""
    if isinstance(path, bytes) and (len(path) > 4096 or b"\0" in path):
        raise ModelFormatError(
            f"[{op}] got {len(path)} bytes that cannot be a file path (a serialized model?); "
            "leanrnn loads models from files: write the bytes to a file and pass its path"
        )
    try:
        return os.fsdecode(os.fspath(path))
    except TypeError:
        raise ModelFormatError(
            f"[{op}] got a {type(path).__name__} ({path!r:.60}) as the path; expected a file "
            "path (str, bytes or pathlib.Path)"
        ) from None


def save(model: RunnableModel, path) -> str:
    """Write ``model`` in the native format to ``path``, which ends in ``.lrnn`` (as every
    native writer's output must: a native file under an ``.onnx`` name is read by nothing that
    expects ONNX); returns the path."""
    if not callable(getattr(model, "save", None)):
        raise ModelFormatError(
            f"[save] got a {type(model).__name__}; expected a leanrnn Model or GraphModel"
        )
    return model.save(_path(path, "save"))  # the model's save checks the path (native.out_path)


def same_file(a, b) -> bool:
    """``a`` and ``b`` name one file: the same path after links, or (hard links) one inode.
    What every command that writes a file checks of its inputs (convert, score, run --output):
    writing would destroy an input before, or while, it is read."""
    if os.path.realpath(a) == os.path.realpath(b):
        return True
    try:
        return os.path.samefile(a, b)
    except OSError:  # either does not exist (yet)
        return False


def convert(src, dst, precision: str | None = None, *, reduce_range: bool = False,
            **options) -> str:  # fmt: skip
    """Load ``src`` (any supported file; ``options`` as for ``load``) and write it as ``.lrnn``
    to ``dst``, its recurrent weights in ``precision`` ("bf16", "bf16-act", "int8" or
    "int8-dynamic", see ``leanrnn.quantize``, as is ``reduce_range``; default: as loaded).
    Returns ``dst``, which must not be ``src`` itself nor a link to it (the output would
    replace the source)."""
    src, dst = _path(src, "convert"), _path(dst, "convert")
    native.out_path(dst, "convert")  # the output is checked before the load, which may take long
    if same_file(src, dst):
        raise ModelFormatError(
            f"[convert] output {dst!r} is the input file itself ({src!r}); writing it would "
            "destroy it: pick another output path"
        )
    if precision is not None or reduce_range:
        from .reduced import check_reduced

        check_reduced(precision, "convert", reduce_range)
    model = load(src, **options)
    if precision is not None:
        from .reduced import _quantize

        model = _quantize(model, precision, "convert", reduce_range)
    return save(model, dst)
