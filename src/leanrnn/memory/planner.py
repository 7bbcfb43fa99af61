"""Lifetimes -> offsets: place every scratch buffer in one arena so buffers that are never live at
the same time share bytes (TFLite's greedy-by-size arena planner, MNN's dynamic buffer reuse).

A buffer is live over the closed interval of op indices ``[first, last]``. ``plan`` puts the
largest buffers first, each at the lowest aligned offset that does not overlap any already placed
buffer whose lifetime intersects its own. Offsets are multiples of ``align``.
"""

from __future__ import annotations

import math
from bisect import bisect_right
from collections import Counter
from dataclasses import dataclass

from ..errors import PlanError
from .arena import ALIGN, round_up


@dataclass(frozen=True)
class Buffer:
    """A request: ``nbytes`` live from op ``first`` to op ``last`` (inclusive)."""

    name: str
    nbytes: int
    first: int
    last: int

    def overlaps_in_time(self, other: Buffer) -> bool:
        return self.first <= other.last and other.first <= self.last


@dataclass(frozen=True)
class Placement:
    buffer: Buffer
    offset: int

    @property
    def end(self) -> int:
        return self.offset + self.buffer.nbytes


@dataclass(frozen=True)
class Plan:
    placements: tuple[Placement, ...]
    total: int  # arena bytes

    @property
    def naive_total(self) -> int:
        """Bytes without reuse: what a framework allocating each temporary separately would hold."""
        return sum(round_up(p.buffer.nbytes, ALIGN) for p in self.placements)

    def table(self) -> list[dict]:
        return [
            {
                "name": p.buffer.name,
                "bytes": p.buffer.nbytes,
                "offset": p.offset,
                "first": p.buffer.first,
                "last": p.buffer.last,
            }
            for p in sorted(self.placements, key=lambda p: (p.buffer.first, p.offset))
        ]


def plan(buffers: list[Buffer], align: int = ALIGN, limit: int | None = None) -> Plan:
    """Assign offsets. Raises ``PlanError`` if the arena would exceed ``limit`` bytes."""
    dups = sorted(name for name, n in Counter(b.name for b in buffers).items() if n > 1)
    if dups:
        raise PlanError(f"[plan] duplicate buffer names: {dups}")
    for b in buffers:
        if b.nbytes < 0 or b.first > b.last:
            raise PlanError(
                f"[plan] buffer {b.name!r} has nbytes={b.nbytes}, first={b.first}, last={b.last}"
            )
    live = _LiveIndex(buffers)
    placed: list[Placement] = []
    ends: list[int] = []  # aligned end of placed[k]
    total = 0
    # largest first; ties by first use, then name (names are unique: the order is total)
    by_size = sorted(
        range(len(buffers)), key=lambda k: (-buffers[k].nbytes, buffers[k].first, buffers[k].name)
    )
    for k in by_size:
        b = buffers[k]
        size = round_up(b.nbytes, align)
        busy = sorted((placed[j].offset, ends[j]) for j in live.overlapping(b.first, b.last))
        # Best fit: the smallest gap that holds the buffer, else the end of the live set.
        best, best_gap, cursor = None, None, 0
        for start, end in busy:
            gap = start - cursor
            if gap >= size and (best_gap is None or gap < best_gap):
                best, best_gap = cursor, gap
            cursor = max(cursor, end)
        offset = cursor if best is None else best
        live.add(k, len(placed))
        placed.append(Placement(b, offset))
        ends.append(offset + size)
        total = max(total, offset + size)
    if limit is not None and total > limit:
        raise PlanError(f"[plan] arena needs {total} bytes; the limit is {limit} bytes")
    return Plan(tuple(sorted(placed, key=lambda p: p.offset)), total)


class _LiveIndex:
    """The placed buffers whose lifetimes meet a query interval, without scanning all of them.

    Buffers sit in a segment tree in order of ``first``; each tree node holds the latest
    ``last`` of the placed buffers below it. Those meeting [a, b] have first <= b (a prefix of
    the order) and last >= a (subtrees whose latest last < a are skipped), so a query costs
    O((k + 1) log n) for k answers instead of O(placed): planning a long chain of ops is
    O(n log n), not O(n^2)."""

    def __init__(self, buffers: list[Buffer]) -> None:
        self.order = sorted(range(len(buffers)), key=lambda k: buffers[k].first)
        self.firsts = [buffers[k].first for k in self.order]
        self.lasts = [buffers[k].last for k in self.order]
        self.rank = {k: r for r, k in enumerate(self.order)}
        self.size = 1 << max(len(buffers) - 1, 0).bit_length()
        self.latest: list[float] = [-math.inf] * (2 * self.size)  # nothing placed below
        self.slot = [-1] * len(buffers)  # rank -> index in ``placed``

    def add(self, k: int, slot: int) -> None:
        r = self.rank[k]
        self.slot[r] = slot
        i, last = r + self.size, self.lasts[r]
        while i and self.latest[i] < last:
            self.latest[i] = last
            i >>= 1

    def overlapping(self, a: int, b: int) -> list[int]:
        """Indices in ``placed`` of the placed buffers live at some step of [a, b]."""
        stop = bisect_right(self.firsts, b)  # ranks < stop start no later than b
        out, stack, latest, size = [], [(1, 0, self.size)], self.latest, self.size
        while stack:
            i, lo, hi = stack.pop()
            if lo >= stop or latest[i] < a:
                continue
            if i >= size:
                out.append(self.slot[lo])
                continue
            mid = (lo + hi) >> 1
            stack.append((2 * i, lo, mid))
            stack.append((2 * i + 1, mid, hi))
        return out
