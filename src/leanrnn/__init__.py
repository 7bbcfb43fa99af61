"""leanrnn: LSTM, GRU and RNN inference on the CPU with planned memory.

The whole public API is named in ``__all__``; everything else is private.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

from . import errors
from .config import get_num_threads, set_num_threads
from .engine import Pool, Session, Stream
from .formats.packing import LayerWeights, PackedWeights, pack
from .score import score  # imports the engine only (files are read by score's own readers)
from .spec import Activation, RNNSpec

if TYPE_CHECKING:
    from .graph_model import GraphModel
    from .loading import convert, load, save
    from .nn import GRU, LSTM, RNN, Model, from_state_dict, from_torch
    from .reduced import quantize

# The models and loading import the file formats (.lrnn, ONNX, torch checkpoints). They are
# imported on first use: ``import leanrnn.engine`` runs this file first and must stay free of
# every importer (tests/test_layers.py).
_LAZY = {
    **dict.fromkeys(("GRU", "LSTM", "RNN", "Model", "from_state_dict", "from_torch"), "nn"),
    **dict.fromkeys(("convert", "load", "save"), "loading"),
    "GraphModel": "graph_model",
    "quantize": "reduced",
}


if not TYPE_CHECKING:  # (seen by type checkers, it made every name, a typo too, exist as Any)

    def __getattr__(name: str) -> object:
        module = _LAZY.get(name)
        if module is None:
            raise AttributeError(f"module 'leanrnn' has no attribute {name!r}")
        value = getattr(importlib.import_module(f".{module}", __name__), name)
        globals()[name] = value
        return value


def __dir__() -> list[str]:
    """The public surface: __all__ and the submodules imported so far."""
    subs = (n for n, v in globals().items()
            if getattr(v, "__name__", None) == f"{__name__}.{n}")  # fmt: skip
    return sorted({*__all__, *subs})


__version__ = "0.1.0"

__all__ = [
    "GRU",
    "LSTM",
    "RNN",
    "Activation",
    "GraphModel",
    "LayerWeights",
    "Model",
    "PackedWeights",
    "Pool",
    "RNNSpec",
    "Session",
    "Stream",
    "__version__",
    "convert",
    "errors",
    "from_state_dict",
    "from_torch",
    "get_num_threads",
    "load",
    "pack",
    "quantize",
    "save",
    "score",
    "set_num_threads",
]
