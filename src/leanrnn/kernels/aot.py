"""Compiles the jobs (abi.JOBS) ahead of time into one CPython extension, with numba.

Why: numba and LLVM cost a process ~120 MiB of memory and ~0.3 s before the first kernel runs
(importing numba maps LLVM, about 60 MiB; the first dispatch builds numba's typing registries
and imports ~330 modules, about 57 MiB more). A model then weighs twice what it does in
onnxruntime. Compiled ahead of time, the same kernels load as a ~2.3 MB shared library.

How, per (job, dtype):
1. an entry ``entry(slots, me)`` is generated from abi.JOBS (abi.entry_source): it turns the int64 slots back
   into arrays (``numba.carray`` over the address and dimensions) and calls the numba job;
2. numba compiles it without its CPython/cfunc wrappers (those would need the Python C API
   and numba's helper library), so the object code needs only libm and one NRT stub (the
   kernels it calls compile without reference counting, see _jit);
3. a two-line LLVM wrapper gives it a C name and signature (numba's calling convention puts a
   return slot and an exception slot in front);
4. the module is emitted as position-independent object code for this CPU (numba's own CPU
   name and features, so the code is what the JIT would run);
then native.c, the marshaller and thread team, is compiled and linked with them by the C
compiler Python was built with.

The result lands in native.build_dir(); ``python -m leanrnn.kernels.aot`` builds it (the
engine starts that in a subprocess on first use; see kernels.runner).

It leans on numba internals (a CodeLibrary's final LLVM module, the codegen's host CPU name
and features, the no_cpython_wrapper/no_cfunc_wrapper flags). The fingerprint includes numba's
version, so a numba upgrade means a new build; should one break these, the build fails, says
why in FAILED, and the JIT runs the same kernels.
"""

from __future__ import annotations

import copy
import multiprocessing
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import llvmlite.binding as llvm
import numba
import numpy as np
from numba import carray, types
from numba.extending import intrinsic

from .. import config
from . import abi, native
from ._jit import FASTMATH
from .ops import JOBS

_NUMBA_TYPES = {"float32": types.float32, "float64": types.float64}


def _address_of(dtype):
    """An intrinsic turning an int64 address into a pointer to ``dtype``."""

    @intrinsic
    def address(typingctx, addr):
        def gen(context, builder, sig, args):
            return builder.inttoptr(args[0], context.get_value_type(sig.return_type))

        return types.CPointer(dtype)(types.int64), gen

    return address


_PTR = {"f": _address_of(types.float32), "d": _address_of(types.float64),
        "q": _address_of(types.int64), "c": _address_of(types.int8),
        "h": _address_of(types.uint16), "u": _address_of(types.uint8)}  # fmt: skip


def entry_source(job: str, dtype: str) -> str:
    """Python source of the entry: slots -> arrays and scalars -> the job (abi.entry_source)."""
    return abi.entry_source(job, dtype)[1]


def _compile_entry(job: str, dtype: str, tm) -> llvm.ModuleRef:
    ns = {"carray": carray, "job": JOBS[job], **{f"ptr_{k}": v for k, v in _PTR.items()}}
    name, source = abi.entry_source(job, dtype)
    exec(source, ns)  # a generated function, from the declaration (abi.JOBS) only
    disp = numba.njit(
        fastmath=set(FASTMATH), error_model="numpy", nogil=True,
        no_cpython_wrapper=True, no_cfunc_wrapper=True,
    )(ns[name])  # fmt: skip
    sig = (types.CPointer(types.int64), types.int64)
    disp.compile(sig)
    cres = disp.overloads[sig]
    mod = llvm.parse_assembly(str(cres.library._final_module))
    # numba's convention: i32 status fn(ret*, excinfo**, args...); the C name hides it.
    wrapper = llvm.parse_assembly(
        f'declare i32 @"{cres.fndesc.mangled_name}"(ptr, ptr, ptr, i64)\n'
        f"define i32 @{abi.entry_name(job, dtype)}(ptr %a, i64 %me) {{\n"
        "  %ret = alloca ptr\n  %exc = alloca ptr\n"
        f'  %s = call i32 @"{cres.fndesc.mangled_name}"(ptr %ret, ptr %exc, ptr %a, i64 %me)\n'
        "  ret i32 %s\n}\n"
    )
    wrapper.triple, wrapper.data_layout = mod.triple, mod.data_layout
    mod.link_in(wrapper)
    return mod


def _target_machine(codegen):
    """numba's own CPU and features, but position-independent code for a shared library."""
    return llvm.Target.from_triple(llvm.get_process_triple()).create_target_machine(
        cpu=codegen._get_host_cpu_name(), features=codegen._tm_features, opt=3, reloc="pic",
        codemodel="default",
    )  # fmt: skip


class BuildError(RuntimeError):
    """A build failure that will happen again on this machine (no compiler, a compile error)."""


def _compiler() -> list[str]:
    """The first of native.compiler_candidates whose program resolves: ``CC`` if set (and then
    only it), else the compiler Python was built with, else cc, gcc or clang."""
    cc, candidates = native.compiler_candidates()
    for cmd in candidates:
        if shutil.which(cmd[0]):
            return cmd
    if cc:
        raise BuildError(f"CC={cc!r} is not an executable")
    tried = ", ".join(repr(c[0]) for c in candidates)
    raise BuildError(f"no C compiler found (tried {tried}; set CC)")


def _say(message: str) -> None:
    """One line of progress on stdout, which kernels.runner shows as it comes (one write per
    line, so the lines of parallel workers never interleave)."""
    sys.stdout.write(message + "\n")
    sys.stdout.flush()


# Each dispatcher's own cache, set aside by _without_cache (for the process: on one core both
# groups' _objects run in this one, and the second call finds every cache set aside already).
_CACHES: dict = {}


def _without_cache() -> None:
    """Compile every kernel anew in this (build) process, never from numba's cache: the cache
    cannot tell that a callee changed (recurrent.py's cached lstm kept gemm.py's code from
    before an edit of gemm.py alone), and the module would carry stale code under a fingerprint
    that says otherwise. Each dispatcher's own cache goes into _CACHES, which _save_for_the_jit
    writes to (never reads)."""
    from numba.core.caching import NullCache
    from numba.core.dispatcher import Dispatcher

    for name, mod in list(sys.modules.items()):
        if name.startswith(__package__ + ".") and mod is not None:
            for v in list(vars(mod).values()):
                if isinstance(v, Dispatcher) and not isinstance(v._cache, NullCache):
                    _CACHES[v] = v._cache
                    v._cache = NullCache()


def _save_for_the_jit(entries: list[tuple[str, str]]) -> int:
    """Write the jobs this process compiled into numba's cache; returns how many signatures.

    Each entry calls its job (kernels.ops.JOBS), and numba compiles that job as it would for
    the JIT backend: a dispatcher's own overload, with its own flags and its Python wrapper.
    Saved where the JIT looks (kernels._jit: a directory keyed by the fingerprint of every
    kernel source, the build's own), a process that runs the JIT after a build (LEANRNN_BACKEND
    =jit, or the test suite's JIT runs) loads them instead of compiling the same code again:
    the three float jobs of both dtypes took ~130 s of a core, each reduced-precision one ~40 s.
    The two build processes save the same jobs' indexes (one dtype each), which numba rewrites
    whole: one at a time, under a lock."""
    import fcntl

    from . import _jit, ops

    if not _jit.CACHE:
        return 0
    saved = 0
    lock = Path(numba.config.CACHE_DIR) / ".leanrnn-save.lock"
    lock.parent.mkdir(parents=True, exist_ok=True)
    with open(lock, "w") as f:
        fcntl.flock(f, fcntl.LOCK_EX)  # released as f closes
        for job in dict.fromkeys(j for _, j in entries):
            disp = ops.JOBS[job]
            cache = _CACHES.get(disp)
            if cache is None:
                continue
            for sig, cres in list(disp.overloads.items()):
                cache.save_overload(sig, cres)
                saved += 1
    return saved


def _one_memo_per_inlining() -> None:
    """numba's inliner (InlineWorker.inline_ir) copies a callee's IR a block at a time, each
    block with copy.deepcopy and a memo of its own, so each block copies the callee's whole
    Scope again (every variable, reached through each Var): blocks x variables. The step loop
    (kernels.recurrent) inlines big callees (_steps, _phase, the cells' hooks): the rnn job made
    4.9M deepcopy calls, 0.7M with one memo per inlining, and compiled ~10-15% faster (the gru
    job 40 -> 34 s, 48 -> 43 s, run in turns). One memo copies each object once and keeps what
    the blocks shared shared, as in the IR copied; the copies are thrown away or renamed into
    the caller's scope either way. Only in the build's processes. Should numba's internals
    change shape, the build goes on as numba wrote it."""
    import types as pytypes

    from numba.core import inline_closurecall as icc

    worker = getattr(icc, "InlineWorker", None)
    if worker is None or getattr(icc, "copy", None) is not copy:
        return
    if getattr(worker.inline_ir, "one_memo", False):  # (one process, both groups)
        return
    plain = worker.inline_ir

    def inline_ir(self, *args, **kwargs):
        memo: dict = {}
        before = icc.copy

        def deepcopy(x, m=None):
            return copy.deepcopy(x, memo if m is None else m)

        icc.copy = pytypes.SimpleNamespace(deepcopy=deepcopy, copy=copy.copy)
        try:
            return plain(self, *args, **kwargs)
        finally:
            icc.copy = before

    inline_ir.one_memo = True
    worker.inline_ir = inline_ir


_PR_SET_PDEATHSIG = 1  # prctl's "signal me when my parent dies"


def _die_with_parent() -> None:
    """A build worker's initializer: ask Linux to kill it when the process that started it
    dies (prctl PR_SET_PDEATHSIG). Without it, killing a build (Ctrl-C in a terminal that
    does not signal the group, a test's timeout, kill PID) left both workers compiling their
    kernels for minutes, at a core each. Elsewhere, or if refused, nothing changes."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes
    import signal

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(_PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    except (OSError, AttributeError):
        return
    if os.getppid() == 1:  # the parent died before the request: go now
        os._exit(1)


# Seconds a cold build spent on each entry (a Sapphire Rapids-class Xeon, 2026-12-03: one
# dtype's float jobs ~190-205 s, a reduced-precision job by cell), only to share the
# reduced-precision jobs out between the build processes: their proportions are what count.
_BUILD_SECONDS = {"float32": 190.0, "float64": 205.0, "lstm": 66.0, "gru": 61.0, "rnn": 40.0}


def _groups() -> list[list[tuple[str, str]]]:
    """The (dtype, job) entries each build process compiles: one process per working dtype
    with that dtype's jobs, and the float32-only reduced-precision jobs (abi.PRECISIONS) shared
    out the longest first, each to the process with the least work so far (_BUILD_SECONDS).
    All on the float32 process, it took twice as long as the float64 one; one format each,
    ~140 s longer, with the other core idle meanwhile."""
    reduced = [(c, abi.job_for(c, p)) for c in abi.REDUCED_CELLS for p in abi.PRECISIONS]
    names = {j for _, j in reduced}
    groups = [[(d, j) for j in abi.ARGS if j not in names] for d in abi.DTYPES]
    load = [_BUILD_SECONDS[d] for d in abi.DTYPES]
    for cell, job in sorted(reduced, key=lambda cj: -_BUILD_SECONDS[cj[0]]):  # stable
        i = load.index(min(load))
        groups[i].append(("float32", job))
        load[i] += _BUILD_SECONDS[cell]
    return groups


def _objects(entries: list[tuple[str, str]], verbose: bool = False) -> list:
    """(symbol, kinds, object code, seconds) of the entries (dtype, job)."""
    from numba.core.registry import cpu_target

    _without_cache()
    _one_memo_per_inlining()

    if verbose:
        names = ", ".join(j if d == entries[0][0] else f"{d} {j}" for d, j in entries)
        _say(f"building {entries[0][0]} kernels ({names})")
    tm = _target_machine(cpu_target.target_context.codegen())
    out = []
    for dtype, job in entries:
        t = time.perf_counter()
        obj = tm.emit_object(_compile_entry(job, dtype, tm))
        seconds = time.perf_counter() - t
        out.append((abi.entry_name(job, dtype), abi.entry_kinds(job, dtype), obj, seconds))
        if verbose:
            _say(f"built the {dtype} {job} kernel in {seconds:.0f} s")
    try:
        saved = _save_for_the_jit(entries)
    except Exception as e:  # only a head start for the JIT, which compiles them itself
        _say(f"could not save the jobs for the JIT ({type(e).__name__}: {e})")
    else:
        if verbose and saved:
            _say(f"saved {saved} jobs for the JIT in numba's cache")
    return out


def build(directory: Path | None = None, *, expect: str | None = None,
          verbose: bool = False) -> Path:  # fmt: skip
    """Compile every (job, dtype) entry and the module; returns the module's path. ``expect``:
    the fingerprint the caller computed (the sources must not have changed since)."""
    t0 = time.perf_counter()
    fp = native.fingerprint()
    if expect and fp != expect:
        raise RuntimeError(f"the kernel sources changed during the build ({expect} -> {fp})")
    directory = Path(directory) if directory else native.build_dir(fp)
    cc = _compiler()  # fail before the long part
    # One process per dtype when there are cores for it: their kernels share no compiled code,
    # so the build takes about half the time (runner.BUILD_TIME: ~800 s of CPU on the Xeon VM,
    # in ~410 s on its 2 cores).
    groups = _groups()
    if config.cores() > 1:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(len(groups), mp_context=ctx,
                                 initializer=_die_with_parent) as ex:  # fmt: skip
            parts = list(ex.map(_objects, groups, [verbose] * len(groups)))
    else:
        parts = [_objects(g, verbose) for g in groups]
    objects, table = [], []
    with tempfile.TemporaryDirectory(prefix="leanrnn-aot-") as tmp:
        for symbol, kinds, code, _ in (e for part in parts for e in part):
            obj = Path(tmp) / f"{symbol}.o"
            obj.write_bytes(code)
            objects.append(str(obj))
            table.append(f'X({symbol}, "{kinds}")')
        (Path(tmp) / "entries.h").write_text(
            "#define LEANRNN_ENTRIES(X) \\\n  " + " \\\n  ".join(table) + "\n"
        )
        out = Path(tmp) / native.module_path(Path(tmp)).name
        cmd = [
            *cc, "-O2", "-fPIC", "-shared", "-pthread", "-fvisibility=hidden",
            f"-DLEANRNN_FINGERPRINT=\"{fp}\"",
            f"-I{tmp}", f"-I{sysconfig.get_paths()['include']}", f"-I{np.get_include()}",
            str(Path(__file__).with_name("native.c")), *objects, "-o", str(out), "-lm",
        ]  # fmt: skip
        if verbose:
            _say(f"linking the module ({cc[0]})")
        res = subprocess.run(cmd, capture_output=True, text=True, check=False)
        if res.returncode:
            raise BuildError(f"C compiler failed ({shlex.join(cmd)}):\n{res.stderr[-3000:]}")
        # Published whole, with the size and hash every loader checks (native.verify).
        final = native.publish(directory, out, fp)
        (directory / "FAILED").unlink(missing_ok=True)
    if verbose:
        _say(f"built {final} in {time.perf_counter() - t0:.0f} s")
    return final


def main() -> int:
    """``python -m leanrnn.kernels.aot [DIR [FINGERPRINT]]``: build, or record why not."""
    directory = Path(sys.argv[1]) if len(sys.argv) > 1 else None
    expect = sys.argv[2] if len(sys.argv) > 2 else None
    try:
        build(directory, expect=expect, verbose=True)
    except Exception as e:  # reported to the parent, which falls back to the jit kernels
        from numba.core.errors import NumbaError

        # Compiler and numba errors recur on every try; anything else (memory, disk, a
        # killed worker, edited sources) may not.
        transient = not isinstance(e, BuildError | NumbaError)
        native.record_failure(directory or native.build_dir(), f"{type(e).__name__}: {e}",
                              transient)  # fmt: skip
        print(f"leanrnn: native build failed: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
