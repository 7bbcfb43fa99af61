"""Parameter: one trainable array and its gradient, the unit optimizers and clipping work on."""

from __future__ import annotations

import numpy as np


class Parameter:
    """``value`` (updated in place by optimizers), ``grad`` (same shape and dtype; backward
    accumulates into it), ``name``, and ``version``: bumped by every update of ``value``, so
    whoever derives data from it (a Trainer's folded biases) knows to refresh."""

    __slots__ = ("grad", "name", "value", "version")

    def __init__(self, value: np.ndarray, grad: np.ndarray | None = None, name: str = "") -> None:
        self.value = value
        self.grad = np.zeros_like(value) if grad is None else grad
        self.name = name
        self.version = 0

    def zero_grad(self) -> None:
        self.grad[...] = 0

    def __repr__(self) -> str:
        return f"Parameter({self.name!r}, shape={self.value.shape}, dtype={self.value.dtype})"
