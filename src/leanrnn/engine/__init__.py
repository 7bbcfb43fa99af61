"""The engine: a Session binds a spec and packed weights to a planned arena and runs kernels."""

from .session import Session

__all__ = ["Session"]
