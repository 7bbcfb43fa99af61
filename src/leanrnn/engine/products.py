"""Matrix products on the engine's GEMM tiles, and which GEMM the big data x data products
use on this machine.

``PackedMatmul`` holds a right-hand matrix [K, M] as the engine's panels ([U, K, 64]: the
layout of the gate-fused weights, kernels.gemm.input_projection), and ``packed_product``
multiplies rows by it on the ``matmul`` job: the tiles the native build compiled for this
CPU (AVX-512: 6 x 64), on the kernels' thread team. A graph's constant MatMul/Gemm operands
are packed once (engine.graph.passes); training packs its gradient operands per product
(train.session).

**Which GEMM** (``gemm_choice``). numpy's OpenBLAS picks its kernels by CPU model, and on a
CPU newer than the OpenBLAS a numpy wheel carries it falls back to an older family's: on a
Zen 5 (family 26) OpenBLAS 0.3.31 runs its 'Haswell' AVX2 kernels, ~100 GFLOP/s on one core
where the engine's tile runs 185-191 (training's weight-gradient and input-gradient products,
3200 x 2048 x 512, and calibrate's). On an Intel Xeon whose OpenBLAS kernels are its own the
two are level (OpenBLAS 81-92, the tile 74-86). So it is measured, not assumed: the first
training product times both on one shape, interleaved (``calibrate``), and the answer is
kept with the native build (``wisdom.json`` in its folder, read by later processes: FFTW's
wisdom, per build and CPU). ``LEANRNN_GEMM=native|blas`` overrides it (``auto``: measured).
Both give the same products to float32 rounding (sums in another order); tests run both.
"""

from __future__ import annotations

import contextlib
import json
import os
import stat
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np

from .._files import read_regular
from ..errors import LeanRNNError
from ..kernels import abi, runner
from ..memory.arena import aligned_empty
from ..threads import PACKED_MATMUL_PARALLEL_MACS
from . import _fork
from .session import NO_SCRATCH, NO_SLOTS

PANEL = 64  # output columns per panel: the widest register tile (4 x 16)
ENV_GEMM = "LEANRNN_GEMM"
GEMM_CHOICES = ("native", "blas")


@dataclass(frozen=True)
class PackedMatmul:
    """A right-hand matrix [K, M] as the engine's gate panels: the product then runs on the
    engine's GEMM tiles and threads.

    W: [U, K, 64] panels of B's columns (zero-padded to U*64); b: [U*64] the tile's bias
    slot, added in its final store: a fused bias [M] (passes.fuse_bias) or zeros; M: real
    columns."""

    W: np.ndarray
    b: np.ndarray
    M: int

    @classmethod
    def of(cls, B: np.ndarray, bias: np.ndarray | None = None) -> PackedMatmul:
        K, M = B.shape
        U = -(-M // PANEL)
        W = aligned_empty(U * K * PANEL * B.dtype.itemsize).view(B.dtype).reshape(U, K, PANEL)
        # one strided copy (formats.packing's gather by column index took 5 ms for the 4 MiB
        # of an H=512 layer's W, remade at every optimizer step of a training loop)
        pack_columns(B, W)
        W[U - 1, :, M - (U - 1) * PANEL :] = 0  # the last panel's padding
        b = np.zeros(U * PANEL, B.dtype)
        if bias is not None:
            b[:M] = bias
        return cls(W, b, M)


def pack_columns(src: np.ndarray, out: np.ndarray) -> None:
    """``out`` [U, R, 64] = the columns of ``src`` [R, M] in panels: the right-hand operand of
    a product whose columns change every call (a gradient), packed per call. ``src`` may be
    a strided view (a block of a wider matrix). The slots past M are left as they are: the
    output columns they make are never read (packed_product's tail)."""
    R, M = src.shape
    full = M // PANEL
    if full:
        out[:full] = src[:, : full * PANEL].reshape(R, full, PANEL).transpose(1, 0, 2)
    if full * PANEL < M:
        out[full, :, : M - full * PANEL] = src[:, full * PANEL :]


def transpose_into(src: np.ndarray, out: np.ndarray) -> None:
    """``out`` [C, R] = ``src`` [R, C]^T, 32 rows of ``src`` at a time: each block's 32-float
    runs of ``out`` fill whole cache lines, where numpy's one strided copy wrote a float per
    line it touched (3200 x 512: 4.8 -> 1.2-1.5 ms; 3200 x 128: 0.48 -> 0.17)."""
    R = src.shape[0]
    for r0 in range(0, R, _TRANSPOSE_ROWS):
        out[:, r0 : r0 + _TRANSPOSE_ROWS] = src[r0 : r0 + _TRANSPOSE_ROWS].T


_TRANSPOSE_ROWS = 32


def packed_product(pm: PackedMatmul, a: np.ndarray, out: np.ndarray, tail, threads: int,
                   sync: np.ndarray) -> None:  # fmt: skip
    """out [R, M] = a [R, K] @ B through ``pm``, on up to ``threads`` of the kernel team. The
    whole panels write straight into out's columns; when out has fewer columns than the
    panels (M not a multiple of 64) the last panel goes to ``tail`` [R, 64] and its real
    columns are copied over (a padded [R, U*64] product copied out whole was R x M extra
    bytes of scratch and traffic: 26 MB for a 1000-class head at 6400 rows). A C-contiguous
    ``tail`` of [R, >= U*64] (padded_tail_fits: few rows) takes the whole product in one
    launch instead when several threads share it, copied out: the last panel's launch of its
    own left a thread idle and cost a team wake-up (benchmarks/head_tail.py, the 1000-wide
    head on 2 threads, Zen 3: 0.93x the time at 100 rows, 0.88x at 30; one thread: the same
    launches). A one-panel ``tail`` of fewer rows than ``a`` (tail_rows: a block of them)
    takes the last panel block by block, each copied out before the next: the tail of a
    narrow head over a long sequence was rows x 64 floats, 21x a 3-wide output and most of a
    tagger's arena."""
    R, K = a.shape
    if R == 0:  # (no rows: nothing to launch, and no block of rows to step by)
        return
    U = pm.W.shape[0]
    full = min(U, out.shape[1] // PANEL)  # panels written straight into out
    parts = threads if threads > 1 and shares_threads(pm, R) else 1
    wide = full < U and tail is not None and tail.shape[0] == R and tail.shape[1] >= U * PANEL
    padded = wide and parts > 1
    if wide:  # the contract: C-contiguous, R rows (a view of it is then one too)
        assert tail.flags.c_contiguous, tail.strides
    if wide and not padded:  # its first R*64 elements as the one-panel tail
        tail = tail.reshape(-1)[: R * PANEL].reshape(R, PANEL)
    rest = out.shape[1] - full * PANEL  # the last panel's real columns
    for u0, u1, dst in ((0, U, tail),) if padded else ((0, full, out), (full, U, tail)):
        if u1 <= u0:
            continue
        call = abi.Call("matmul", ("x", "y", "parts"), W=pm.W[u0:u1],
                        b=pm.b[u0 * PANEL : u1 * PANEL], K=K, sync=sync,
                        lengths=NO_SLOTS, T=0, xw_bf_T=0,  # every row
                        q=NO_SCRATCH, bf16_act=False)  # fmt: skip
        for r0 in range(0, R, dst.shape[0]):
            r1 = min(R, r0 + dst.shape[0])
            sync[:] = 0
            runner.run("matmul", call.bind(x=a[r0:r1], y=dst[: r1 - r0], parts=parts), parts)
            if dst is tail and not padded:
                out[r0:r1, full * PANEL :] = tail[: r1 - r0, :rest]
    if padded:
        out[:] = tail[:, : out.shape[1]]


# Bytes of a one-panel tail a graph plans (tail_rows): a block of rows, not all of them.
TAIL_BLOCK_BYTES = 1 << 18


def tail_rows(rows: int, itemsize: int) -> int:
    """Rows of the one-panel tail planned for a product of ``rows`` rows: all of them up to
    TAIL_BLOCK_BYTES, else a block of whole 12-row tiles (packed_product runs the last panel
    block by block then)."""
    block = max(12, TAIL_BLOCK_BYTES // (PANEL * itemsize) // 12 * 12)
    return min(rows, block)


# The most bytes a padded [rows, U*64] product may take as packed_product's tail: a copy that
# costs less than the last panel's launch of its own. The 1000-wide head on 2 threads (Zen 3,
# benchmarks/head_tail.py): 30 and 100 rows (122 and 406 KiB) 0.88x and 0.93x the time, 200
# rows 1.00x-1.02x.
PADDED_TAIL_BYTES = 1 << 19


def padded_tail_fits(pm: PackedMatmul, rows: int, itemsize: int) -> bool:
    """Whether a product of ``rows`` rows through ``pm`` should be given a padded tail: its
    width is not a multiple of the panel, the tail stays within PADDED_TAIL_BYTES, and the
    product is large enough for threads to share it (packed_product takes the padded path
    only then)."""
    return (pm.M % PANEL != 0 and shares_threads(pm, rows)
            and rows * padded_tail_width(pm.W.shape[0]) * itemsize <= PADDED_TAIL_BYTES)  # fmt: skip


def shares_threads(pm: PackedMatmul, rows: int) -> bool:
    """Whether a product of ``rows`` rows through ``pm`` is large enough for several threads
    to share it (packed_product runs smaller ones on one)."""
    return rows * pm.W.shape[1] * pm.M >= PACKED_MATMUL_PARALLEL_MACS


def padded_tail_width(panels: int) -> int:
    """Columns of a padded tail: the panels' and a quarter panel more, so that its rows do not
    lie a power of two apart. A first version that ran the padded tail on one thread too
    put 16 panels' rows 4 KiB apart, the tile's six stores of a column in one L1 set, and ran
    the 1000-wide head at 100 rows 1.45x slower (Zen 3); on the two threads it runs on now,
    `benchmarks/head_tail.py --exact-width` read no difference (0.89x / 0.94x the one-panel
    tail's time at 30 / 100 rows, against 0.90x / 0.92x). 64 bytes a row keep it so."""
    return panels * PANEL + PANEL // 4


# ------------------------------------------------------------------ which GEMM
_CHOICE: dict[str, dict] = {}  # "float32" -> calibrate()'s result, once per process
# Renewed in a forked child: held by a parent's thread measuring at the fork, it hung the
# child's first training step.
_CHOOSING = threading.Lock()
_fork.renew_lock(sys.modules[__name__], "_CHOOSING")
_SHAPE = (768, 1536, 512)  # rows x K x columns of the timed product: ~1.2 GFLOP, a few ms


def gemm_choice(dtype=np.float32) -> str:
    """Which GEMM ("native" or "blas") runs this process's big data x data products of
    ``dtype`` (module docstring). float32 only: float64 stays on BLAS (the tile's float64
    build is for correctness tests, not speed), whatever LEANRNN_GEMM says."""
    if np.dtype(dtype) != np.float32:
        _env_choice()  # a bad LEANRNN_GEMM is an error for any dtype
        return "blas"
    return gemm_decision()["choice"]


def gemm_decision() -> dict:
    """{"choice", and how it was made: "by" LEANRNN_GEMM, else the measurement's
    "native_gflops" and "blas_gflops"}: measured once per process at most, remembered per
    build and CPU."""
    env = _env_choice()
    if env:
        return {"choice": env, "by": ENV_GEMM}
    got = _CHOICE.get("float32")
    if got is None:
        with _CHOOSING:
            got = _CHOICE.get("float32")
            if got is None:
                got = _CHOICE["float32"] = _remembered() or _measure_and_remember()
    return got


def _env_choice() -> str | None:
    """LEANRNN_GEMM's choice, None for auto (or unset); anything else is an error."""
    env = os.environ.get(ENV_GEMM, "").strip().lower()
    if env in GEMM_CHOICES:
        return env
    if env not in ("", "auto"):
        raise LeanRNNError(
            f"{ENV_GEMM}={os.environ[ENV_GEMM]!r}; expected native, blas or auto (the default: "
            "the faster on this machine, measured once)"
        )
    return None


def _wisdom_path():
    """wisdom.json in the native build's folder (per build and CPU), on the JIT in its numba
    cache's of the same fingerprint: each JIT process measured again, and under load one in
    six chose the other GEMM, its gradients off in the last bits."""
    from .. import config
    from ..kernels import native

    if runner.binds():
        return native.build_dir() / "wisdom.json"
    d = config.numba_cache_dir(native.fingerprint())
    d.mkdir(parents=True, exist_ok=True)
    return d / "wisdom.json"


def _remembered() -> dict | None:
    try:
        path = _wisdom_path()
        if path is None:
            return None
        # (a regular file: a FIFO put there blocked every process's first training step)
        wisdom = json.loads(read_regular(path, 1 << 20))
        got = wisdom["gemm"] if wisdom.get("rule") == _RULE else None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return got if isinstance(got, dict) and got.get("choice") in GEMM_CHOICES else None


def _measure_and_remember() -> dict:
    # One process of a build measures at a time, and the others then read its answer: four
    # started together on a new cache measured on shared cores, one chose BLAS where three
    # chose the tile, and their training gradients differed in the last bits.
    with _wisdom_lock():
        got = _remembered()
        if got is not None:
            return got
        result = calibrate()
        if result.get("untrusted"):  # (a build kept BLAS at 202 GFLOP/s a "thread" for good)
            return result  # not remembered: measured again by the next process
        try:
            path = _wisdom_path()
            if path is not None:
                tmp = path.with_name(f"wisdom.json.tmp{os.getpid()}")
                tmp.write_text(json.dumps({"gemm": result, "rule": _RULE}))
                os.replace(tmp, path)
        except OSError:  # an unwritable cache: measured again by the next process
            pass
        return result


@contextlib.contextmanager
def _wisdom_lock():
    """An exclusive lock on wisdom.json's folder between processes (flock on wisdom.lock), or
    none where that cannot be had (an unwritable cache, no fcntl)."""
    f = None
    try:
        import fcntl

        path = _wisdom_path()
        if path is not None:
            # O_NONBLOCK: a FIFO in its place would wait for a reader (the first training step
            # of every process, for ever); the lock is then not had, as with no fcntl
            fd = os.open(path.with_name("wisdom.lock"), os.O_WRONLY | os.O_APPEND
                         | os.O_CREAT | os.O_NONBLOCK, 0o644)  # fmt: skip
            f = os.fdopen(fd, "a")  # (closed below)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                raise OSError("wisdom.lock is not a regular file")
            fcntl.flock(f, fcntl.LOCK_EX)
    except (ImportError, OSError):
        if f is not None:
            f.close()
        f = None
    try:
        yield
    finally:
        if f is not None:
            f.close()  # (releases the lock)


# BLAS runs training's products only when its GEMM is this much faster than the tile: the
# native path does more than the GEMM (weight gradients read x, h_prev and G in place, the
# bias sums in the same job, no transposes or packing in numpy), so a tie on the product alone
# is no tie on a step. On an Intel Xeon (Sapphire Rapids class) where the two measured 75.6 vs
# 75.8 GFLOP/s, BLAS was chosen (the rule then: the tile only if 5% faster) and an LSTM H=128
# N=32 training step took 54 vs 43 ms on 1 thread, 79 vs 29 on 2 (torch: 42-50, 29-59).
BLAS_MARGIN = 1.25
# Wisdom made by an earlier rule is measured again (its choice may be one this rule rejects).
_RULE = 2


def decide(native_s: float, blas_s: float) -> str:
    """The GEMM for training's products, from the two product times: BLAS only where it
    takes less than 1 / BLAS_MARGIN of the tile's time."""
    return "blas" if blas_s * BLAS_MARGIN < native_s else "native"


def calibrate(rounds: int = 5) -> dict:
    """Time numpy's matmul and the engine's tile on one float32 product of training's kind
    (rows x K x columns = _SHAPE, operands fresh from memory as a gradient's are), one thread
    each, interleaved ``rounds`` times; ``decide`` picks from the minima. Returns {"choice",
    "native_gflops", "blas_gflops"}."""
    from ..threads import blas_alone, blas_threads

    R, K, M = _SHAPE
    rng = np.random.default_rng(0)
    a = rng.standard_normal((R, K), dtype=np.float32)
    b = rng.standard_normal((K, M), dtype=np.float32)
    out = np.empty((R, M), np.float32)
    packed = aligned_empty(M * K * 4).view(np.float32).reshape(M // PANEL, K, PANEL)
    pm = PackedMatmul(packed, np.zeros(M, np.float32), M)
    sync = np.zeros(abi.sync_size(1), np.int64)

    def native() -> None:
        pack_columns(b, packed)  # counted: a gradient is packed for every product
        packed_product(pm, a, out, None, 1, sync)

    def blas() -> None:
        np.matmul(a, b, out=out)

    best = {"native": float("inf"), "blas": float("inf")}
    with blas_alone():
        alone = blas_threads() <= 1
        for f in (native, blas):
            f()  # warm: first calls load code and fault pages
        for _ in range(rounds):
            for name, f in (("native", native), ("blas", blas)):
                t0 = time.perf_counter()
                f()
                best[name] = min(best[name], time.perf_counter() - t0)
    flops = 2 * R * K * M
    got = {
        "choice": decide(best["native"], best["blas"]),
        "native_gflops": round(flops / best["native"] / 1e9, 1),
        "blas_gflops": round(flops / best["blas"] / 1e9, 1),
    }
    if not alone:  # BLAS timed on several threads: no measure of one thread's speed
        got.update(choice="native", untrusted=True)
    return got
