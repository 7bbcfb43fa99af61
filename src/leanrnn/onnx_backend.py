"""leanrnn as an ONNX backend (``onnx.backend.base.Backend``), so the official ONNX backend test
suite can run against it:

    >>> import onnx.backend.test                                   # doctest: +SKIP
    >>> from leanrnn.onnx_backend import LeanRNNBackend
    >>> tests = onnx.backend.test.BackendTest(LeanRNNBackend, __name__)   # doctest: +SKIP
"""

from __future__ import annotations

import numpy as np

try:
    from onnx.backend.base import Backend, BackendRep
except ImportError as e:
    raise ImportError(
        "leanrnn.onnx_backend needs onnx: pip install 'leanrnn[onnx]' (in a clone: pip install "
        "-e '.[onnx]')",
        name=e.name,
    ) from e

from .engine.graph import SUPPORTED_OPS
from .errors import LeanRNNError
from .formats.onnx_import import read_onnx
from .graph_model import GraphModel

__all__ = ["LeanRNNBackend", "LeanRNNRep"]


class LeanRNNRep(BackendRep):
    """A prepared model: ``run(inputs)`` takes a list (graph input order) or a dict."""

    def __init__(self, model: GraphModel) -> None:
        self.model = model

    def run(self, inputs, **kwargs) -> tuple[np.ndarray, ...]:
        if isinstance(inputs, np.ndarray):
            inputs = [inputs]
        return tuple(self.model.run(inputs))


class LeanRNNBackend(Backend):
    """CPU only. Models are converted with ``read_onnx`` and run by ``GraphModel``."""

    @classmethod
    def is_compatible(cls, model, device: str = "CPU", **kwargs) -> bool:
        return cls.supports_device(device) and all(
            n.op_type in SUPPORTED_OPS and n.domain in ("", "ai.onnx") for n in model.graph.node
        )

    @classmethod
    def prepare(cls, model, device: str = "CPU", **kwargs) -> LeanRNNRep:
        if not cls.supports_device(device):
            raise LeanRNNError(f"[LeanRNNBackend] device {device!r}; leanrnn runs on the CPU")
        return LeanRNNRep(GraphModel(read_onnx(model.SerializeToString())))

    @classmethod
    def run_model(cls, model, inputs, device: str = "CPU", **kwargs) -> tuple[np.ndarray, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return str(device).upper() == "CPU"
