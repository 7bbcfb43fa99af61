"""The engine: a Session binds a spec and packed weights to a planned arena and runs kernels."""

from .session import Pool, Session
from .stream import Stream

__all__ = ["Pool", "Session", "Stream", "kernel_backend"]


def kernel_backend() -> str:
    """The kernels this process runs on, resolved (loaded on first call): "native" or "jit"
    (LEANRNN_BACKEND=jit, or a native build that failed); leanrnn.config.backend() is what was
    asked for."""
    from ..kernels import runner

    return runner.backend().name
