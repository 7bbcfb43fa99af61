"""Lifetimes -> offsets: place every scratch buffer in one arena so buffers that are never live at
the same time share bytes (TFLite's greedy-by-size arena planner, MNN's dynamic buffer reuse).

A buffer is live over the closed interval of op indices ``[first, last]``. ``plan`` puts the
largest buffers first, each at the lowest aligned offset that does not overlap any already placed
buffer whose lifetime intersects its own. Offsets are multiples of ``align``.
"""

from __future__ import annotations

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

    def offset(self, name: str) -> int:
        for p in self.placements:
            if p.buffer.name == name:
                return p.offset
        raise KeyError(name)

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
    names = [b.name for b in buffers]
    if len(set(names)) != len(names):
        raise PlanError(
            f"[plan] duplicate buffer names: {sorted({n for n in names if names.count(n) > 1})}"
        )
    placed: list[Placement] = []
    order = sorted(buffers, key=lambda b: (-b.nbytes, b.first, b.name))
    total = 0
    for b in order:
        if b.nbytes < 0 or b.first > b.last:
            raise PlanError(
                f"[plan] buffer {b.name!r} has nbytes={b.nbytes}, first={b.first}, last={b.last}"
            )
        size = round_up(b.nbytes, align)
        busy = sorted(
            (p.offset, p.offset + round_up(p.buffer.nbytes, align))
            for p in placed
            if p.buffer.overlaps_in_time(b)
        )
        # Best fit: the smallest gap that holds the buffer, else the end of the live set.
        best, best_gap, cursor = None, None, 0
        for start, end in busy:
            gap = start - cursor
            if gap >= size and (best_gap is None or gap < best_gap):
                best, best_gap = cursor, gap
            cursor = max(cursor, end)
        offset = cursor if best is None else best
        placed.append(Placement(b, offset))
        total = max(total, offset + size)
    if limit is not None and total > limit:
        raise PlanError(f"[plan] arena needs {total} bytes; the limit is {limit} bytes")
    return Plan(tuple(sorted(placed, key=lambda p: p.offset)), total)
