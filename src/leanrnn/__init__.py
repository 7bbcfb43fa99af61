"""leanrnn: LSTM, GRU and RNN inference on the CPU with planned memory.

The whole public API is named in ``__all__``; everything else is private.
"""

from __future__ import annotations

from . import errors
from .config import get_num_threads, set_num_threads
from .engine import Pool, Session, Stream
from .engine.graph import GraphModel
from .formats.packing import LayerWeights, PackedWeights, pack
from .loading import convert, load, save
from .nn import GRU, LSTM, RNN, Model, from_state_dict, from_torch
from .score import score
from .spec import Activation, RNNSpec

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
    "save",
    "score",
    "set_num_threads",
]
