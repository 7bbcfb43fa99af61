"""Batch size, chunk and read-ahead for throughput jobs (``leanrnn score``; a server can reuse it),
chosen from this machine's caches and cores and a memory limit.

Why these rules (an LSTM H=256 on this 2-core Zen 5, L2 512 KiB per core):
- batch: every step streams the recurrent weights R [K, G] once for the whole batch, so more
  sequences per batch amortize that read; the per-step state of the batch (gates, h, c:
  N x (G + 2K + H) values) should stay in L2 so the step's elementwise work does not spill.
  The GEMM register tile takes 6 rows at a time, so the batch is a multiple of 6.
- chunk: the input projection of a chunk (N x chunk x G values) is read by the recurrence right
  after it is written; it should fit half of this core's share of L3 (the engine's own default
  budget is 2 MiB) and, with a memory limit, the arena must fit the limit's share.
- memory: the limit is split between the engine arena, the padded batch buffers (input and,
  when per-step outputs are kept, output) and the read-ahead window the bucketing sorts.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import PlanError

# Cache sizes assumed when sysfs does not say (a typical x86 server core).
_DEFAULT_CACHES = {1: 32 << 10, 2: 1 << 20, 3: 16 << 20}
# The memory limit when none is given: this much of the available memory, at most _MAX_DEFAULT.
_DEFAULT_SHARE = 4
_MAX_DEFAULT = 256 << 20
MIN_MEMORY_LIMIT = 1 << 20
# Shares of the memory limit (the rest is slack for Python objects and file-reader buffers).
ARENA_SHARE = 1 / 8
BATCH_SHARE = 1 / 4
WINDOW_SHARE = 3 / 8
MAX_BATCH = 128
MIN_CHUNK = 4


@dataclass(frozen=True)
class Hardware:
    """cores: cores this process may use; l1d/l2: bytes per core; l3: bytes of the last level
    (shared)."""

    cores: int
    l1d: int
    l2: int
    l3: int
    available: int  # bytes of memory available now (MemAvailable), 0 if unknown


def _cache_sizes() -> dict[int, int]:
    sizes = dict(_DEFAULT_CACHES)
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        entries = sorted(os.listdir(base))
    except OSError:
        return sizes
    for e in entries:
        try:
            with open(f"{base}/{e}/level") as f:
                level = int(f.read())
            with open(f"{base}/{e}/type") as f:
                kind = f.read().strip()
            with open(f"{base}/{e}/size") as f:
                raw = f.read().strip().upper()
        except (OSError, ValueError):
            continue
        if kind == "Instruction":
            continue
        mult = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(raw[-1:], 1)
        digits = raw.rstrip("KMG")
        if digits.isdigit():
            sizes[level] = int(digits) * mult
    return sizes


def _available() -> int:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def hardware() -> Hardware:
    from . import config

    c = _cache_sizes()
    return Hardware(config.cores(), c[1], c[2], c[3], _available())


def default_memory_limit(hw: Hardware | None = None) -> int:
    hw = hw or hardware()
    if not hw.available:
        return 256 << 20
    return max(MIN_MEMORY_LIMIT, min(_MAX_DEFAULT, hw.available // _DEFAULT_SHARE))


@dataclass(frozen=True)
class Tuning:
    """What a throughput job runs with.

    batch: most sequences per engine run; chunk: engine steps per chunk (None: whole sequences,
    reverse/bidirectional stacks); threads: kernel threads; memory_limit: bytes the job may
    hold; window_bytes: input (plus buffered output) read ahead and sorted by length;
    batch_bytes: the padded batch buffers' budget; step_bytes: bytes one (sequence, step) costs
    in those buffers (and in the arena when it cannot be chunked).
    """

    batch: int
    chunk: int | None
    threads: int
    memory_limit: int
    window_bytes: int
    batch_bytes: int
    step_bytes: int

    def batch_for(self, steps: int) -> int:
        """Sequences per batch whose longest has ``steps`` steps: ``batch``, fewer when the
        padded buffers of that many would not fit their budget (never fewer than one)."""
        fit = self.batch_bytes // max(1, steps * self.step_bytes)
        return max(1, min(self.batch, fit))


def choose(session, *, memory_limit: int | None = None, per_step: bool = False,
           batch: int | None = None, threads: int | None = None,
           hw: Hardware | None = None) -> Tuning:  # fmt: skip
    """A Tuning for ``session`` (a leanrnn Session: its weights and spec) on this machine.

    per_step: per-step outputs are kept (y [T, N, D*K] buffers count); batch: a fixed batch
    size instead of the cache rule. Raises PlanError if even one sequence-step at batch 1 does
    not fit ``memory_limit``.
    """
    from . import config

    hw = hw or hardware()
    spec, w = session.spec, session.weights
    it = session.dtype.itemsize
    limit = int(memory_limit) if memory_limit is not None else default_memory_limit(hw)
    if limit < MIN_MEMORY_LIMIT:
        raise PlanError(
            f"[tuning] memory_limit={limit} bytes; expected at least {MIN_MEMORY_LIMIT} "
            "(1 MiB): below that the file readers' own buffers dominate"
        )
    threads = config.threads_for(threads)
    D, K, C = spec.num_directions, spec.output_size, spec.input_size
    per_state = (w.Gp + 2 * w.Kp + w.Hp) * it
    if batch is None:
        n = max(1, min(MAX_BATCH, hw.l2 // 2 // per_state))
        batch = n - n % 6 if n >= 6 else n
    batch = max(1, int(batch))
    # Padded input and (per_step) output per (sequence, step); unchunkable stacks also hold
    # their whole xw and layer outputs in the arena.
    step_bytes = (C + (D * K if per_step else 0)) * it
    chunkable = session.chunkable
    if not chunkable:
        step_bytes += sum(b.nbytes for b in session.buffers(1, 1))
    arena_bytes = int(limit * ARENA_SHARE)
    chunk = None
    if chunkable:
        cache = max(hw.l2, min(hw.l3 // max(1, hw.cores) // 2, 4 << 20))
        chunk = max(MIN_CHUNK, cache // (batch * w.Gp * it))
        # The largest chunk whose plan fits the arena's share of the limit (shrinking the
        # batch when not even MIN_CHUNK steps fit).
        while True:
            need = _arena(session, batch, chunk, per_step)
            if need <= arena_bytes:
                break
            if chunk > 1:
                chunk = max(1, chunk // 2)
            elif batch > 1:
                batch = max(1, batch // 2)
            else:
                raise PlanError(
                    f"[tuning] one step of one sequence needs {need} bytes of arena; the "
                    f"memory limit {limit} leaves {arena_bytes} for it: raise memory_limit"
                )
    batch_bytes = int(limit * BATCH_SHARE)
    if step_bytes > batch_bytes:
        raise PlanError(
            f"[tuning] one step of one sequence needs {step_bytes} bytes of batch buffers; "
            f"the memory limit {limit} leaves {batch_bytes}: raise memory_limit"
        )
    return Tuning(batch, chunk, threads, limit, int(limit * WINDOW_SHARE), batch_bytes, step_bytes)


def _arena(session, batch: int, chunk: int, per_step: bool) -> int:
    from .memory.planner import plan

    staged = session.spec.batch_first
    return plan(session.buffers(batch, chunk, staged, not per_step)).total
