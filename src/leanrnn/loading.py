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

from .engine.model import RunnableModel
from .errors import ModelFormatError
from .formats import checkpoint, native
from .formats.onnx_import import read_onnx
from .formats.packing import PackedWeights
from .graph_model import GraphModel
from .nn import GRU, LSTM, RNN, Model

_CELL_MODULES = {"lstm": LSTM, "gru": GRU, "rnn": RNN}

__all__ = ["convert", "load", "save"]


def load(
    path,
    *,
    threads: int | None = None,
    verify: bool = True,
    prefix: str | None = None,
    cell: str | None = None,
    nonlinearity: str = "tanh",
    batch_first: bool = False,
    dtype=None,
) -> RunnableModel:
    """Load a model from ``path``; returns an ``LSTM``/``GRU``/``RNN`` for a recurrent stack or a
    ``GraphModel`` for a graph (ONNX, or a ``.lrnn`` converted from one).

    Supported: ``.lrnn`` (native; ``verify`` checks its checksum), ONNX, and state dicts of
    torch.nn.LSTM/GRU/RNN as PyTorch checkpoints (needs torch; read with weights_only=True),
    ``.safetensors`` or ``.npz``. For state dicts, ``prefix`` picks the module inside a larger
    state dict (e.g. ``"encoder.lstm."``), ``cell`` overrides the cell read off the weight
    shapes, ``nonlinearity`` ('tanh'/'relu') and ``batch_first`` are what the file cannot
    record, and ``dtype`` converts the weights (default: as stored).
    """
    path = _path(path, "load")
    if not os.path.isfile(path):
        raise ModelFormatError(f"[load] {path!r} does not exist or is not a file")
    kind = checkpoint.sniff(path)
    if kind == "lrnn":
        obj = native.load(path, verify=verify)
        if isinstance(obj, PackedWeights):
            model = _CELL_MODULES[obj.spec.cell]._from_packed(obj, threads)
            return model if dtype is None else model.astype(dtype)
        return GraphModel(obj, threads=threads)
    if kind in ("safetensors", "npz", "torch-zip", "pickle"):
        sd = checkpoint.select_rnn(checkpoint.read_state_dict(path, kind), prefix, path)
        model = Model.from_state_dict(
            sd, cell=cell, nonlinearity=nonlinearity, batch_first=batch_first, dtype=dtype
        )
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
    return GraphModel(graph, threads=threads)


def _path(path, op: str) -> str:
    """``path`` as a str: a str, bytes or os.PathLike; anything else is named."""
    try:
        return os.fsdecode(os.fspath(path))
    except TypeError:
        raise ModelFormatError(
            f"[{op}] got a {type(path).__name__} ({path!r:.60}) as the path; expected a file "
            "path (str, bytes or pathlib.Path)"
        ) from None


def save(model: RunnableModel, path) -> str:
    """Write ``model`` in the native format (``.lrnn``); returns the path."""
    if not callable(getattr(model, "save", None)):
        raise ModelFormatError(
            f"[save] got a {type(model).__name__}; expected a leanrnn Model or GraphModel"
        )
    return model.save(_path(path, "save"))


def convert(src, dst, precision: str | None = None, **options) -> str:
    """Load ``src`` (any supported file; ``options`` as for ``load``) and write it as ``.lrnn``
    to ``dst``, its recurrent weights in ``precision`` ("bf16", "int8" or "int8-dynamic", see
    ``leanrnn.quantize``; default: as loaded). Returns ``dst``."""
    src, dst = _path(src, "convert"), _path(dst, "convert")
    if not dst.lower().endswith(".lrnn"):
        raise ModelFormatError(
            f"[convert] output {dst!r} must end in .lrnn (leanrnn writes its native format only)"
        )
    if precision is not None:  # checked before the load, which may take long
        from .reduced import check_reduced

        check_reduced(precision, "convert")
    model = load(src, **options)
    if precision is not None:
        from .reduced import _quantize

        model = _quantize(model, precision, "convert")
    return save(model, dst)
