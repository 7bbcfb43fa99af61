"""How the threads running one recurrence meet at every step: atomics on a small int64 array.

numba's ``prange`` forks and joins its pool at every timestep; at batch 1 that costs more than
the step itself (H=128: ~2 us of work per step). Here the engine instead starts one job per
thread for a whole op, and the threads meet through a ``sync`` array (ints in separate cache
lines, zeroed by the caller before the jobs start):

- **Work-claiming phases.** A step (a *phase*; the LSTM projection and the GRU's r*h product add
  a second phase per step) is cut into ``parts`` slices of unit blocks. A thread claims slice p
  of phase g by compare-and-swap of ``claim[p]`` from g to g+1, computes it, and counts it in
  ``done``; before phase g+1 it waits until ``done`` reaches (g+1)*parts. Thread ``me`` tries its
  own slice first (so each core keeps streaming the same weights), then the others.
- **Never a deadlock.** Nobody waits for a particular thread: a job that starts late (a busy
  pool, the OS) finds its slices taken and the caller's thread having done them — slower, never
  stuck. A single thread (parts == 1) skips the atomics entirely.
- **Batch slices** (``share``): from _cpu.SHARE_TILES register tiles of rows per thread on, the
  threads instead take tile-aligned slices of the batch, each running every step of its own
  samples: they never meet inside the recurrence, so a thread the OS preempts (a shared VM,
  another process) delays only its own samples instead of stalling the others at every step's
  barrier. onnxruntime's LSTM splits batches above 4 the same way (the backward kernels do
  from fewer tiles: backward.BACK_SHARE_TILES). A slice job must run (no
  thread can take it over), which both backends guarantee: every job index runs exactly once.
- **Ticket queues** (``take``): the input projection's row x panel tasks are handed out by an
  atomic counter, so whichever threads are running share them; ``done`` again tells when all
  are finished.

Memory order: the atomics are sequentially consistent, so a slice's plain stores (h, c, y) are
visible to a thread that has seen its ``done`` count.
"""

from __future__ import annotations

import platform

from llvmlite import ir
from numba import types
from numba.core import cgutils
from numba.extending import intrinsic

from . import _cpu
from ._jit import inline
from .abi import CLAIM0, LINE, PROJ_DONE, PROJ_TICKET, STEP_DONE

# Slice boundaries are multiples of every dtype's tile height (ALIGN, as the projection's row
# chunks): each slice then starts a register tile where the whole batch would, so every row is
# computed by the same tile shape and summation order whichever way the threads split — the
# results are bit-identical across thread counts (a lone leftover row, say, would otherwise be
# a GEMV, whose k loop may be split into several accumulator sets). bf16 and int8 on AMX cut at 16
# rows instead (gemm.slice_rows): an AMX tile's rows are independent dot products, the same
# bits in any block, and every slice there has 4 rows or more, all on AMX.
ALIGN = _cpu.blocking(_cpu.isa())[0]
SHARE_TILES = _cpu.SHARE_TILES  # share() is _cpu.batch_slices' rule (the engine plans with it)


def _slot_ptr(context, builder, sig, args):
    arr = cgutils.create_struct_proxy(sig.args[0])(context, builder, value=args[0])
    return builder.gep(arr.data, [args[1]])


def _is_int64_array(a) -> bool:
    return isinstance(a, types.Array) and a.dtype == types.int64 and a.ndim == 1


@intrinsic
def atomic_add(typingctx, arr, idx, val):
    """arr[idx] += val atomically; returns the old value."""
    if not _is_int64_array(arr):
        return None

    def gen(context, builder, sig, args):
        return builder.atomic_rmw("add", _slot_ptr(context, builder, sig, args), args[2], "seq_cst")

    return types.int64(arr, types.intp, types.int64), gen


@intrinsic
def atomic_cas(typingctx, arr, idx, expected, new):
    """If arr[idx] == expected, set it to new; True if this call did."""
    if not _is_int64_array(arr):
        return None

    def gen(context, builder, sig, args):
        ptr = _slot_ptr(context, builder, sig, args)
        res = builder.cmpxchg(ptr, args[2], args[3], "seq_cst", "seq_cst")
        return builder.extract_value(res, 1)

    return types.boolean(arr, types.intp, types.int64, types.int64), gen


@intrinsic
def atomic_load(typingctx, arr, idx):
    """arr[idx], read atomically."""
    if not _is_int64_array(arr):
        return None

    def gen(context, builder, sig, args):
        return builder.load_atomic(_slot_ptr(context, builder, sig, args), "seq_cst", 8)

    return types.int64(arr, types.intp), gen


_X86 = platform.machine().lower() in ("x86_64", "amd64", "i686", "i386")


@intrinsic
def cpu_relax(typingctx):
    """A spin-wait hint (x86 ``pause``: lets the sibling hyperthread run, saves power)."""

    def gen(context, builder, sig, args):
        if _X86:
            fn = cgutils.get_or_insert_function(
                builder.module, ir.FunctionType(ir.VoidType(), []), "llvm.x86.sse2.pause"
            )
            builder.call(fn, [])
        return context.get_dummy_value()

    return types.void(), gen


@inline
def claim(sync, me, q, parts, g, n):
    """Thread ``me``'s q-th try at phase ``g``'s slices of range(n) (its own slice first):
    the slice's (lo, hi) if this call took it, (0, -1) if another thread has."""
    part = (me + q) % parts
    if parts > 1 and not atomic_cas(sync, (CLAIM0 + part) * LINE, g, g + 1):
        return 0, -1
    return n * part // parts, n * (part + 1) // parts


@inline
def finish(sync, parts):
    """Count one computed slice of the current phase."""
    if parts > 1:
        atomic_add(sync, STEP_DONE * LINE, 1)


@inline
def end_phase(sync, parts, g):
    """Return the next phase once every slice of phase ``g`` is done."""
    if parts > 1:
        while atomic_load(sync, STEP_DONE * LINE) < (g + 1) * parts:
            cpu_relax()
    return g + 1


@inline
def take(sync):
    """The next task ticket (past the last task: none left)."""
    return atomic_add(sync, PROJ_TICKET * LINE, 1)


@inline
def task_done(sync):
    atomic_add(sync, PROJ_DONE * LINE, 1)


@inline
def wait_tasks(sync, ntasks):
    while atomic_load(sync, PROJ_DONE * LINE) < ntasks:
        cpu_relax()


@inline
def share(N, me, parts, tiles_each, align):
    """(n0, n1, slices): thread ``me``'s samples n0..n1 and the number of block slices per phase
    its recurrence claims from — its own batch slice, cut at a multiple of ``align`` rows (its
    GEMM's tile height: ALIGN, or 16 for bf16 and int8 on AMX, kernels.gemm.slice_rows), and 1 (no
    barrier) when every thread gets at least ``tiles_each`` tiles of ALIGN rows (SHARE_TILES
    for the forward: the engine plans with this rule), else every sample and ``parts``."""
    if parts > 1 and N >= tiles_each * ALIGN * parts:
        tiles = (N + align - 1) // align  # the last one may be short
        return (min(N, tiles * me // parts * align), min(N, tiles * (me + 1) // parts * align), 1)
    return 0, N, parts
