"""The graph runtime: the op library (``ops``), the load-time passes (``passes``: ``LoadedGraph``)
and the planned, runnable session (``session``: ``GraphSession``). It reads the IR
(``leanrnn.ir``) and knows no file format; ``leanrnn.GraphModel`` is the user-facing model."""

from .ops import OPS, SUPPORTED_OPS
from .passes import LoadedGraph
from .session import GraphSession

__all__ = ["OPS", "SUPPORTED_OPS", "GraphSession", "LoadedGraph"]
