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

from dataclasses import dataclass

from .engine import _check
from .errors import PlanError, SpecError
from .memory.arena import machine_memory

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
    from .kernels._cpu import caches  # sysfs's sizes, as the kernels' tiles read them

    c = caches()
    return Hardware(config.cores(), c["L1d"], c["L2"], c["L3"], _available())


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


def choose(session, *, memory_limit: int | float | None = None, per_step: bool = False,
           batch: int | None = None, threads: int | None = None,
           hw: Hardware | None = None) -> Tuning:  # fmt: skip
    """A Tuning for ``session`` (a leanrnn Session: its weights and spec) on this machine.

    per_step: per-step outputs are kept (y [T, N, D*K] buffers count); batch: a fixed batch
    size instead of the cache rule. Raises PlanError if even one sequence-step at batch 1 does
    not fit ``memory_limit``.
    """
    from . import config

    _session("choose", session)
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
        batch = _whole_tiles(n)
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
        # The largest chunk whose plan fits the arena's share of the limit, shrinking the
        # batch when not even MIN_CHUNK steps fit (the chunk went to 1 first: 1-step chunks
        # of 63 rows ran 2-6x slower than 15 rows of 8 steps under the same limit), and
        # below MIN_CHUNK steps only at batch 1. Batches stay multiples of the 6-row
        # register tile (31 left a row to the slower single-row path).
        while True:
            need = _arena(session, batch, chunk, per_step)
            if need <= arena_bytes:
                break
            if chunk > MIN_CHUNK or (chunk > 1 and batch == 1):
                chunk = max(1, chunk // 2)
            elif batch > 1:
                batch = max(1, _whole_tiles(batch // 2))
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


def _whole_tiles(n: int) -> int:
    """``n`` rows rounded down to whole 6-row register tiles (below 6: as it is): a row left
    alone runs the slower single-row path."""
    return n - n % 6 if n >= 6 else n


def _arena(session, batch: int, chunk: int, per_step: bool) -> int:
    from .memory.planner import plan

    staged = session.spec.batch_first
    return plan(session.buffers(batch, chunk, staged, not per_step)).total


# ------------------------------------------------------------------ measured (leanrnn tune)
# Serving picks its batch from measured call times rather than cache rules: the call's latency
# is what a stream waits for, and it depends on threads, ISA and the load on this machine.
# The latency target when none is given: one engine call (batch rows x chunk steps) of about
# 10 ms, the server's default --max-call-ms.
DEFAULT_LATENCY = 0.010
# Most rows tune tries: past this the recurrent GEMM is compute-bound on every core we know
# and a larger batch only adds latency.
MAX_TUNE_BATCH = 256
MAX_TUNE_CHUNK = 16


def bucket(n: int) -> int:
    """n rounded up to 1..8, then 4 values per octave (10, 12, 14, 16, 20, 24, ...): the row
    counts the server's calls are padded to (<= 25% padding), so they come in few shapes."""
    n = int(n)  # (a numpy integer has no bit_length)
    if n <= 8:
        return n
    step = 1 << (n.bit_length() - 3)
    return -(-n // step) * step


def batch_candidates(most: int) -> list[int]:
    """Every bucket up to ``most``, ascending: the batches ``tune`` may choose (O(log most))."""
    out, n = [], 1
    while n <= most:
        out.append(n)
        n = bucket(n + 1)
    return out


@dataclass(frozen=True)
class Point:
    """One measured shape: ``seconds`` for one engine call of ``batch`` rows x ``chunk`` steps;
    ``nbytes`` what the call holds (planned arena + its input, output and state buffers)."""

    batch: int
    chunk: int
    seconds: float
    nbytes: int

    @property
    def step_us(self) -> float:
        """Microseconds per stream-step: the throughput side of the trade."""
        return self.seconds / (self.batch * self.chunk) * 1e6


@dataclass(frozen=True)
class Measured:
    """What ``tune`` chose and the points it measured on the way (in measuring order).

    batch: most rows per call; chunk: steps per call (None: the stack cannot be chunked);
    latency: the target in seconds per call; memory_limit: bytes one call may hold.
    """

    batch: int
    chunk: int | None
    latency: float
    memory_limit: int
    threads: int
    points: tuple[Point, ...]

    def fits(self, p: Point) -> bool:
        return p.seconds <= self.latency and p.nbytes <= self.memory_limit

    @property
    def meets_target(self) -> bool:
        """Whether the chosen point's call fits the latency target (batch 1 is chosen when
        nothing does: a server must run)."""
        return any(self.fits(p) for p in self.points
                   if p.batch == self.batch and p.chunk == (self.chunk or p.chunk))  # fmt: skip

    def rows(self) -> list[tuple[str, ...]]:
        """The table's rows: batch, chunk, ms per call, us per stream-step, MiB, verdict."""
        out = []
        for p in sorted(self.points, key=lambda p: (p.batch, p.chunk)):
            chosen = p.batch == self.batch and p.chunk == (self.chunk or p.chunk)
            fits = self.fits(p)
            # a choice that misses the target says so ('chosen, over'): it is what runs, and
            # reading 'chosen' alone, a user took batch 1 to meet a target nothing meets
            verdict = (
                ("chosen" if fits else "chosen, over") if chosen else ("ok" if fits else "over")
            )
            out.append((str(p.batch), str(p.chunk), f"{p.seconds * 1e3:.3f}",
                        f"{p.step_us:.2f}", f"{p.nbytes / (1 << 20):.2f}", verdict))  # fmt: skip
        return out

    HEADER = ("batch", "chunk", "ms/call", "us/stream-step", "MiB", "")

    def table(self) -> str:
        """The measured points as plain text (``leanrnn tune`` uses rich when it can)."""
        rows = [self.HEADER, *self.rows()]
        widths = [max(len(r[i]) for r in rows) for i in range(len(self.HEADER))]
        return "\n".join("  ".join(c.rjust(w) for c, w in zip(r, widths, strict=True)).rstrip()
                         for r in rows)  # fmt: skip


def call_bytes(session, batch: int, chunk: int) -> int:
    """Bytes one call of ``batch`` x ``chunk`` holds: the planned arena (per-step outputs kept)
    and the caller's x [T, N, C], y [T, N, D*K], h [L*D, N, K] and c [L*D, N, H]."""
    spec = session.spec
    it = session.dtype.itemsize
    D, K, L = spec.num_directions, spec.output_size, spec.num_layers
    states = L * D * batch * (K + (spec.hidden_size if spec.cell == "lstm" else 0))
    io = chunk * batch * (spec.input_size + D * K) + states
    return _arena(session, batch, chunk, True) + io * it


class _Timer:
    """The default measure: a private session on the model's weights (the caller's plan and
    arena stay as they are) timing calls on zero state; the median of ``repeats`` after one
    warm-up call (which plans)."""

    def __init__(self, session, threads: int | None, repeats: int = 5) -> None:
        from .engine.session import Session

        self.session = Session(session.weights, threads=threads)
        self.repeats = repeats

    def __call__(self, batch: int, chunk: int) -> float:
        import time

        import numpy as np

        s = self.session
        spec, dt = s.spec, s.dtype
        D, L, K, H = spec.num_directions, spec.num_layers, spec.output_size, spec.hidden_size
        s.chunk = chunk
        shape = (batch, chunk) if spec.batch_first else (chunk, batch)
        # drawn in the session's dtype: a float64 draw, then a copy, was 2x x's bytes beyond
        # what call_bytes counts
        x = np.random.default_rng(0).standard_normal((*shape, spec.input_size), dtype=dt)
        y = np.empty((*shape, D * K), dt)
        h = np.zeros((L * D, batch, K), dt)
        out = (y, h)
        c = None
        if spec.cell == "lstm":
            c = np.zeros((L * D, batch, H), dt)
            out = (y, h, c)
        times = []
        for i in range(self.repeats + 1):
            t0 = time.perf_counter()
            s.run(x, h, c, out=out)
            if i:
                times.append(time.perf_counter() - t0)
        times.sort()
        return times[len(times) // 2]


def _session(op: str, session) -> None:
    """SpecError unless ``session`` is a Session (a model's is ``model.session``)."""
    from .engine.session import Session

    if not isinstance(session, Session):
        raise SpecError(f"[{op}] got a {type(session).__name__}; expected a leanrnn Session "
                        "(a model's: model.session)")  # fmt: skip


def _seconds(measure, b: int, c: int) -> float:
    """What ``measure(b, c)`` says one call takes, as a float of seconds >= 0."""
    v = measure(b, c)
    try:
        secs = float(v)
    except (TypeError, ValueError):
        secs = float("nan")
    if not secs >= 0:
        raise PlanError(f"[tune] measure({b}, {c}) returned {v!r}; expected the seconds a call "
                        "of that batch and chunk takes")  # fmt: skip
    return secs


def tune(session, *, latency: float | None = None, memory_limit: int | float | None = None,
         max_batch: int = MAX_TUNE_BATCH, max_chunk: int = MAX_TUNE_CHUNK,
         threads: int | None = None, measure=None, hw: Hardware | None = None,
         plan_steps: int | None = None) -> Measured:  # fmt: skip
    """The largest batch, then the largest chunk, whose engine call meets ``latency`` (seconds
    per call of batch rows x chunk steps; default DEFAULT_LATENCY) and ``memory_limit`` (bytes
    one call holds, ``call_bytes``; default ``default_memory_limit()``), measured on this
    machine.

    ``measure(batch, chunk) -> seconds`` times one call (default: ``_Timer``, real calls on a
    private session; tests pass a model of the machine). Call time is taken to grow with the
    batch and with the chunk, so a binary search over ``batch_candidates(max_batch)`` at one
    step per call (the smallest call a server makes: the batch comes first, since a stream's
    latency under load is its share of the engine's time per stream-step) finds the batch,
    then one over the powers of two up to ``max_chunk`` finds the chunk: ~10 calls measured. A stack that cannot
    be chunked (reverse, bidirectional) is measured and counted at ``plan_steps`` (default
    ``max_chunk``), the steps its calls run whole (``Session.resize("auto", steps)`` passes
    them), and gets chunk None. If not even batch 1 meets
    the target, batch 1 is chosen (the server must run), the table says "chosen, over" and
    ``meets_target`` is False; if not even batch 1 fits the memory limit, PlanError says so. A
    memory limit above half the machine's memory is taken as that half.
    """
    from . import config

    hw = hw or hardware()
    limit = int(memory_limit) if memory_limit is not None else default_memory_limit(hw)
    # a limit beyond the machine is the machine's: points past it would really be allocated
    # (--memory-limit 1T --max-batch 3000000 went on to a 6.9 GiB arena, then out of memory)
    limit = min(limit, machine_memory() // 2)
    target = DEFAULT_LATENCY if latency is None else float(latency)
    if not target > 0:
        raise PlanError(f"[tune] latency={latency!r}; expected seconds > 0, e.g. 0.01")
    max_batch = _check.count("tune", "max_batch", max_batch, PlanError)
    max_chunk = _check.count("tune", "max_chunk", max_chunk, PlanError)  # (2.0: no bit_length)
    _session("tune", session)
    threads = config.threads_for(_check.count_or_none("tune", "threads", threads))
    chunkable = session.chunkable
    top = 1 << (max_chunk.bit_length() - 1)  # chunks are powers of two (the scheduler's T)
    held = max(max_chunk, plan_steps or 0)  # a whole-sequence stack's steps
    # (timed at its whole calls' steps: at max_chunk's 16, a bidirectional stack's batch of
    # 160 "met" a 10 ms target its calls of 1000 steps took 210 ms over)
    chunks = [1 << i for i in range(top.bit_length())] if chunkable else [held]
    first = chunks[0]

    def nbytes_of(b: int, c: int) -> int:
        return call_bytes(session, b, c if chunkable else held)

    smallest = nbytes_of(1, first)
    if smallest > limit:
        # Too slow is served anyway (batch 1, "over"), but memory beyond the limit is what the
        # limit forbids: choosing batch 1 would hold it regardless.
        raise PlanError(
            f"[tune] memory_limit={limit} bytes; the smallest call (batch 1 x "
            f"{f'chunk {first}' if chunkable else f'{held} steps, held whole'}) "
            f"holds {smallest}: raise the memory limit to at least {smallest}"
        )
    measure = measure or _Timer(session, threads)
    points: list[Point] = []
    seen: dict[tuple[int, int], Point] = {}

    def point(b: int, c: int) -> Point:
        p = seen.get((b, c))
        if p is None:
            nbytes = nbytes_of(b, c)
            # Over the memory limit: never run it (that is what the limit protects).
            secs = _seconds(measure, b, c) if nbytes <= limit else float("inf")
            p = seen[(b, c)] = Point(b, c, secs, nbytes)
            points.append(p)
        return p

    def ok(p: Point) -> bool:
        return p.seconds <= target and p.nbytes <= limit

    def largest(values: list[int], good) -> int:
        """The largest v in ``values`` with good(v), taking good to be monotone; values[0] if
        none is good."""
        lo, hi = 0, len(values) - 1
        if good(values[hi]):
            return values[hi]
        best = 0 if good(values[0]) else -1
        lo = 1
        hi -= 1
        while lo <= hi:
            mid = (lo + hi) // 2
            if good(values[mid]):
                best, lo = mid, mid + 1
            else:
                hi = mid - 1
        return values[max(best, 0)]

    batch = largest(batch_candidates(max_batch), lambda b: ok(point(b, first)))
    chunk = largest(chunks, lambda c: ok(point(batch, c)))
    return Measured(batch, chunk if chunkable else None, target, limit, threads, tuple(points))
