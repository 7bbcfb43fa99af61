"""One aligned allocation handed out as typed views; the only place leanrnn allocates scratch.

MNN's ``onAcquireBuffer``/``onReleaseBuffer`` in Python: ``resize`` plans offsets once
(``planner.plan``), the arena allocates the total once, and the run loop only takes views.
"""

from __future__ import annotations

import functools
import logging
import mmap
import os
import weakref

import numpy as np

from .. import config
from ..errors import PlanError

ALIGN = 64  # bytes: one cache line, and a whole AVX-512 register
HUGE = 2 << 20  # a transparent huge page
_log = logging.getLogger("leanrnn")


@functools.cache
def machine_memory() -> int:
    """Bytes of RAM this process can have: the machine's physical memory, or its cgroup's
    limit (a container) when that is lower. Read once, at the first large allocation."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    for path in ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory/memory.limit_in_bytes"):
        try:
            with open(path) as f:
                raw = f.read().strip()
        except OSError:
            continue
        if raw.isdigit():
            total = min(total, int(raw))
    return total


def check_fits(nbytes: int, what: str, op: str = "allocate") -> None:
    """``PlanError`` if ``nbytes`` cannot fit in this machine's memory: refused up front, by
    arithmetic, rather than by the OS (an OSError deep in mmap) or by swapping for minutes."""
    limit = machine_memory()
    if nbytes > limit:
        raise PlanError(
            f"[{op}] {what} needs {nbytes:,} bytes ({nbytes / 2**30:,.1f} GiB); this machine has "
            f"{limit:,} bytes ({limit / 2**30:,.1f} GiB) of memory; use smaller sizes "
            "(batch, steps, hidden, layers) or a chunk / memory limit"
        )


def aligned_empty(nbytes: int, align: int = ALIGN, what: str = "a buffer") -> np.ndarray:
    """A uint8 array of ``nbytes`` whose data pointer is a multiple of ``align``.

    From 4 MiB up (weights, big arenas) the buffer is its own anonymous mapping, started on a
    2 MiB boundary and advised to use huge pages over its whole 2 MiB chunks: faulting in
    4 KiB pages cost ~1.5 us each on this VM (a 16 MiB .lrnn read: 3.0 -> 1.4 ms), and fewer
    TLB entries cover the weights the kernels stream every step. A partial last chunk keeps
    small pages, so no request grows by up to 2 MiB of memory.

    More than the machine's memory is a ``PlanError`` before asking the OS; an OS refusal of
    a smaller request (memory in use elsewhere) is one too, naming the size.
    """
    n = max(int(nbytes), 1)
    check_fits(n, what)
    try:
        if n >= 2 * HUGE and hasattr(mmap, "MADV_HUGEPAGE"):
            mm = mmap.mmap(-1, n + HUGE, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
            raw = np.frombuffer(mm, np.uint8)  # keeps the mapping alive as long as the array
            skip = (-raw.ctypes.data) % HUGE
            mm.madvise(mmap.MADV_HUGEPAGE, skip, n // HUGE * HUGE)
            return raw[skip : skip + n]
        raw = np.empty(n + align, dtype=np.uint8)
    except (OSError, MemoryError) as e:
        raise PlanError(
            f"[allocate] {what} of {n:,} bytes ({n / 2**30:,.2f} GiB): the OS refused ({e}); "
            f"free memory or use smaller sizes"
        ) from None
    skip = (-raw.ctypes.data) % align
    return raw[skip : skip + n]


def round_up(n: int, m: int) -> int:
    return -(-int(n) // m) * m


def reusable(arena: Arena | None, nbytes: int, cap: int | None = None) -> bool:
    """Whether ``arena`` can serve a plan of ``nbytes``: it exists, is large enough, and holds
    no more than ``cap`` bytes (a memory limit: a larger arena kept from an earlier plan would
    hold more than the limit allows)."""
    return arena is not None and arena.nbytes >= nbytes and (cap is None or arena.nbytes <= cap)


class Arena:
    """A single aligned byte buffer; ``view`` returns typed, C-contiguous windows into it."""

    def __init__(self, nbytes: int, name: str = "arena") -> None:
        self.name = name
        self.nbytes = int(nbytes)
        self.buffer = aligned_empty(self.nbytes, what=name)
        if config.log_enabled("memory"):
            at = self.buffer.ctypes.data
            _log.info("%s: allocate %d bytes at 0x%x", name, self.nbytes, at)
            # and its free, when the last view of the buffer goes (an arena replaced by a
            # larger one logged only the new allocation: the lines did not add up)
            base = self.buffer if self.buffer.base is None else self.buffer.base
            weakref.finalize(base, _log.info, "%s: free %d bytes at 0x%x", name, self.nbytes, at)

    def view(self, offset: int, shape: tuple[int, ...], dtype) -> np.ndarray:
        dtype = np.dtype(dtype)
        count = int(np.prod(shape, dtype=np.int64))
        end = offset + count * dtype.itemsize
        assert offset % ALIGN == 0 and end <= self.nbytes, (offset, end, self.nbytes)
        return self.buffer[offset:end].view(dtype).reshape(shape)
