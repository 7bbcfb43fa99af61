"""One aligned allocation handed out as typed views; the only place leanrnn allocates scratch.

MNN's ``onAcquireBuffer``/``onReleaseBuffer`` in Python: ``resize`` plans offsets once
(``planner.plan``), the arena allocates the total once, and the run loop only takes views.
"""

from __future__ import annotations

import logging

import numpy as np

from .. import config

ALIGN = 64  # bytes: one cache line, and a whole AVX-512 register
_log = logging.getLogger("leanrnn")


def aligned_empty(nbytes: int, align: int = ALIGN) -> np.ndarray:
    """A uint8 array of ``nbytes`` whose data pointer is a multiple of ``align``."""
    raw = np.empty(max(int(nbytes), 1) + align, dtype=np.uint8)
    skip = (-raw.ctypes.data) % align
    return raw[skip : skip + max(int(nbytes), 1)]


def round_up(n: int, m: int) -> int:
    return -(-int(n) // m) * m


class Arena:
    """A single aligned byte buffer; ``view`` returns typed, C-contiguous windows into it."""

    def __init__(self, nbytes: int, name: str = "arena") -> None:
        self.name = name
        self.nbytes = int(nbytes)
        self.buffer = aligned_empty(self.nbytes)
        if config.log_enabled("memory"):
            _log.info("%s: allocate %d bytes at 0x%x", name, self.nbytes, self.buffer.ctypes.data)

    def view(self, offset: int, shape: tuple[int, ...], dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        end = offset + count * dtype.itemsize
        assert offset % ALIGN == 0 and end <= self.nbytes, (offset, end, self.nbytes)
        return self.buffer[offset:end].view(dtype).reshape(shape)
