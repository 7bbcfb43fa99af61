"""The engine: a Session binds a spec and packed weights to a planned arena and runs kernels."""

from .session import Pool, Session
from .stream import Stream

__all__ = ["Pool", "Session", "Stream"]
