"""Every error leanrnn raises on purpose: one base class, one subclass per kind of mistake.

Messages put the operation first, then what came in, what was expected and what to do, e.g.
``[Session.run] x has shape (7, 3); expected [T, N, 64] (time-major) ...``.
"""

from __future__ import annotations


class LeanRNNError(Exception):
    """Base class of all errors raised by leanrnn."""


class ShapeError(LeanRNNError, ValueError):
    """An array has the wrong rank or shape."""


class DTypeError(LeanRNNError, TypeError):
    """An array has the wrong dtype, or dtypes that should match do not."""


class LayoutError(LeanRNNError, ValueError):
    """An array is not laid out as the engine needs (non-contiguous, negative strides, read-only)."""


class LengthsError(LeanRNNError, ValueError):
    """Per-sample lengths are out of range or malformed."""


class SpecError(LeanRNNError, ValueError):
    """A model description is inconsistent (unknown cell, bad sizes, unsupported option)."""


class WeightsError(LeanRNNError, ValueError):
    """Weights are missing, unexpected or of the wrong shape for the model description."""


class ModelFormatError(LeanRNNError, ValueError):
    """A model file is corrupt, truncated, hostile or of an unsupported kind."""


class UnsupportedOpError(ModelFormatError):
    """A model graph contains an operator leanrnn does not implement."""


class PlanError(LeanRNNError, ValueError):
    """A memory plan cannot be made (e.g. it does not fit the memory limit)."""


class NonFiniteError(LeanRNNError, RuntimeError):
    """Gradients hold NaN or infinity where the caller asked for finite ones
    (``clip_grad_norm(error_if_nonfinite=True)``; a RuntimeError, as torch's is)."""


__all__ = [
    "DTypeError",
    "LayoutError",
    "LeanRNNError",
    "LengthsError",
    "ModelFormatError",
    "NonFiniteError",
    "PlanError",
    "ShapeError",
    "SpecError",
    "UnsupportedOpError",
    "WeightsError",
]
