"""The ahead-of-time kernels (kernels.aot/native/runner): the same results as numba's JIT and
the float64 oracle, a process that never loads numba, and clear fallbacks when a build fails."""

import multiprocessing as mp
import os
import re
import subprocess
import sys
import textwrap

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import leanrnn
from helpers import random_layers
from leanrnn import config, threads
from leanrnn.formats.packing import pack
from leanrnn.kernels import abi, runner
from leanrnn.kernels.reference import reference_forward
from leanrnn.spec import RNNSpec
from tolerances import (
    ATOL_MATMUL,
    ATOL_SAME_ARITHMETIC,
    RTOL,
    RTOL_MATMUL,
    RTOL_SAME_ARITHMETIC,
    atol,
)

Q0 = np.zeros((1, 0), np.uint8)  # matmul's int8-dynamic scratch: none for float weights
ALL = (np.zeros(0, np.int64), 0, 0)  # matmul's lengths, T, xw_bf_T: every row


def _run(backend, monkeypatch, model, *args):
    monkeypatch.setattr(config, "_backend", backend)
    return model.session.run(*args)


@settings(max_examples=25, deadline=None)
@given(
    cell=st.sampled_from(["lstm", "gru", "rnn"]),
    dtype=st.sampled_from([np.float32, np.float64]),
    H=st.integers(1, 70),
    N=st.integers(1, 9),
    T=st.integers(1, 12),
    threads=st.sampled_from([1, 2]),
    options=st.sampled_from(["plain", "bidirectional", "clip", "peep/lbr"]),
)
def test_native_equals_jit_and_oracle(jit_compiled, cell, dtype, H, N, T, threads, options):
    spec = RNNSpec(cell, 11, H, num_layers=2,
                   direction="bidirectional" if options == "bidirectional" else "forward",
                   clip=1.5 if options == "clip" else None,
                   peepholes=cell == "lstm" and options == "peep/lbr",
                   linear_before_reset=options != "peep/lbr")  # fmt: skip
    rng = np.random.default_rng(H * 100 + N * 10 + T)
    layers = random_layers(spec, rng, dtype, scale=0.3)
    model = leanrnn.Model(pack(spec, layers, dtype))
    model.session.threads = threads
    x = rng.standard_normal((T, N, 11)).astype(dtype)
    lengths = rng.integers(0, T + 1, N)
    with pytest.MonkeyPatch.context() as mp_:
        native = [
            a.copy() for a in _run("native", mp_, model, x, None, None, lengths) if a is not None
        ]
        jit = [a.copy() for a in _run("jit", mp_, model, x, None, None, lengths) if a is not None]
    want = [a for a in reference_forward(spec, layers, x, None, None, lengths) if a is not None]
    for n, j, w in zip(native, jit, want, strict=True):
        # The same numba code compiled twice: equal to rounding (it was bit-equal when written).
        np.testing.assert_allclose(n, j, rtol=0, atol=ATOL_SAME_ARITHMETIC[dtype])
        np.testing.assert_allclose(n, w, atol=atol(dtype), rtol=RTOL[dtype])


def test_native_entries_make_no_reference_count_calls():
    """numba leaves its NRT_incref / NRT_decref out of line; in a kernel they could only
    return at once (no array there owns memory, see native.c), and in a loop each call spills
    every vector register. The kernels compile without them (_jit): the matmul entry had 32
    such calls, now none, and it still defines its C entry point."""
    from numba.core.registry import cpu_target

    from leanrnn.kernels import aot

    tm = aot._target_machine(cpu_target.target_context.codegen())
    text = str(aot._compile_entry("matmul", "float32", tm))
    assert re.findall(r"call [^\n]*@NRT_(?:incref|decref)\(", text) == []
    assert f"define i32 @{abi.entry_name('matmul', 'float32')}(" in text


def test_a_build_leaves_its_jobs_in_numbas_cache_for_the_jit(tmp_path):
    """The build saves each job it compiled where numba's JIT looks (aot._save_for_the_jit):
    a JIT process after it loads the job instead of compiling the same code again. (Before,
    the JIT compiled every job anew after a build: ~130 s of a core for the float jobs; and on
    one core, where both groups compile in one process, the second group's were not saved.)"""
    build = """
        from leanrnn.kernels import aot
        # one group, then another in the same process: the build on one core does that
        parts = aot._objects([("float32", "matmul")]) + aot._objects([("float64", "matmul")])
        print(len(parts))
    """
    run = """
        import numpy as np
        from leanrnn.kernels import abi, ops
        job = ops.JOBS["matmul"]
        for dt in (np.float32, np.float64):
            x, W = np.ones((4, 8), dt), np.zeros((1, 8, 64), dt)
            bias, y = np.arange(64, dtype=dt), np.zeros((4, 64), dt)
            sync = np.zeros(abi.sync_size(1), np.int64)
            job(x, W, bias, 8, y, np.zeros(0, np.int64), 0, 0, sync,
                np.zeros((1, 0), np.uint8), False, 1, 0)
            assert (y == bias).all(), y
        print(len(job.stats.cache_hits), len(job.stats.cache_misses))
    """
    cache = {"NUMBA_CACHE_DIR": str(tmp_path)}
    built = _python(build, **cache)
    assert built.returncode == 0, built.stderr[-3000:]
    assert built.stdout.split() == ["2"], built.stdout  # (a failed save says why here)
    ran = _python(run, **cache)
    assert ran.returncode == 0, ran.stderr[-3000:]
    assert ran.stdout.split() == ["2", "0"]  # both dtypes loaded, none compiled


def test_marshaller_rejects_arguments_that_break_the_abi(monkeypatch):
    """The extension checks every argument against abi.ARGS before any kernel runs."""
    monkeypatch.setattr(config, "_backend", "native")
    b = runner.backend()
    assert b.name == "native"
    x = np.zeros((4, 8), np.float32)
    W = np.zeros((1, 8, 64), np.float32)
    bias = np.zeros(64, np.float32)
    y = np.zeros((4, 64), np.float32)
    sync = np.zeros(abi.sync_size(1), np.int64)
    b.run("matmul", (x, W, bias, 8, y, *ALL, sync, Q0, False, 1), 1, 1)  # the right arguments run
    with pytest.raises(TypeError, match=r"argument 4: expected a C-contiguous, aligned"):
        b.run("matmul", (x, W, bias, 8, y[:, ::2], *ALL, sync, Q0, False, 1), 1, 1)
    with pytest.raises(TypeError, match=r"argument 8: .*'q'"):
        b.run("matmul", (x, W, bias, 8, y, *ALL, sync.astype(np.int32), Q0, False, 1), 1, 1)
    with pytest.raises(TypeError, match=r"takes 12 arguments, got 6"):
        b.run("matmul", (x, W, bias, 8, y, sync), 1, 1)
    with pytest.raises(TypeError, match=r"argument 0: .*native-byte-order"):
        b.run("matmul", (x.astype(">f4"), W, bias, 8, y, *ALL, sync, Q0, False, 1), 1, 1)


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        env={**os.environ, **env},
        capture_output=True,
        text=True,
        timeout=600,
    )


RUN_ONE = """
    import sys, numpy as np, leanrnn
    from leanrnn.kernels import runner
    m = leanrnn.LSTM(8, 16, num_layers=2, seed=0)
    y = m(np.ones((5, 2, 8), np.float32))[0]
    print(runner.backend().name, float(y.sum()), "numba" in sys.modules, "llvmlite" in sys.modules)
"""


def test_a_native_process_never_loads_numba_or_llvm(jit_compiled):
    """What the native backend is for: numba and LLVM (~120 MiB) stay out of the process."""
    out = _python(RUN_ONE, LEANRNN_BACKEND="native")
    assert out.returncode == 0, out.stderr
    name, total, numba_loaded, llvm_loaded = out.stdout.split()
    assert (name, numba_loaded, llvm_loaded) == ("native", "False", "False")
    jit = _python(RUN_ONE, LEANRNN_BACKEND="jit")
    assert jit.returncode == 0, jit.stderr
    assert jit.stdout.split()[:1] == ["jit"]
    assert float(jit.stdout.split()[1]) == pytest.approx(
        float(total), rel=RTOL_SAME_ARITHMETIC[np.float32]
    )


def test_failed_build_falls_back_to_jit_and_says_why(tmp_path, jit_compiled):
    cache = str(tmp_path / "cache")
    # (numba's cache: the suite's, compiled already; which one is no matter here)
    auto = _python(RUN_ONE, LEANRNN_CACHE_DIR=cache, CC="/nonexistent/cc",
                   NUMBA_CACHE_DIR=jit_compiled)  # fmt: skip
    assert auto.returncode == 0, auto.stderr
    assert auto.stdout.split()[0] == "jit"
    assert "native ones are not available" in auto.stderr and "/nonexistent/cc" in auto.stderr
    failed = list((tmp_path / "cache" / "native").glob("*/FAILED"))
    assert len(failed) == 1 and "is not an executable" in failed[0].read_text()
    assert failed[0].read_text().startswith("permanent")
    # A recorded failure is not retried by every process built with the same inputs (the
    # same CC: without it, the next process builds again); asking for native says why.
    strict = _python(RUN_ONE, LEANRNN_CACHE_DIR=cache, LEANRNN_BACKEND="native",
                     CC="/nonexistent/cc")  # fmt: skip
    assert strict.returncode != 0
    assert "LEANRNN_BACKEND=native, but the native kernels are not available" in strict.stderr
    assert "/nonexistent/cc" in strict.stderr


def test_a_corrupt_build_is_never_run_but_rebuilt(tmp_path, jit_compiled):
    """A truncated or foreign module is refused and rebuilt (here the rebuild cannot find a
    compiler, so the process runs on the JIT and says why)."""
    from leanrnn.kernels import native

    d = tmp_path / "native" / native.fingerprint()
    d.mkdir(parents=True)
    native.module_path(d).write_bytes(b"\x7fELF not really a shared library")
    out = _python(RUN_ONE, LEANRNN_CACHE_DIR=str(tmp_path), CC="/nonexistent/cc",
                  NUMBA_CACHE_DIR=jit_compiled)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "jit"
    assert "rebuilding a broken native module" in out.stderr
    assert not native.module_path(d).exists()
    assert "/nonexistent/cc" in (d / "FAILED").read_text()


def test_transient_failures_are_retried_later(tmp_path, monkeypatch):
    from leanrnn.kernels import native

    native.record_failure(tmp_path, "MemoryError: out of memory", transient=True)
    assert native.failure(tmp_path) == "MemoryError: out of memory"
    old = (tmp_path / "FAILED").stat().st_mtime - native.RETRY_AFTER - 1
    os.utime(tmp_path / "FAILED", (old, old))
    assert native.failure(tmp_path) is None  # stale: the next process tries again
    native.record_failure(tmp_path, "BuildError: no C compiler found", transient=False)
    os.utime(tmp_path / "FAILED", (old, old))
    assert native.failure(tmp_path) == "BuildError: no C compiler found"  # until deleted


def _child_forward(model, x, q):
    q.put(model.session.run(x)[0])


def test_a_forked_child_runs_multithreaded_ops(monkeypatch):
    """Servers fork workers after loading a model: the child must start its own threads (GNU
    OpenMP, which the first version used, hangs here)."""
    monkeypatch.setattr(config, "_backend", "native")
    monkeypatch.setattr(config, "max_threads", lambda: 2)
    spec = RNNSpec("lstm", 16, 128)
    rng = np.random.default_rng(0)
    layers = random_layers(spec, rng, np.float64, scale=0.2)
    model = leanrnn.Model(pack(spec, layers, np.float64))
    model.session.threads = 2
    x = rng.standard_normal((12, 8, 16))
    want = model.session.run(x)[0].copy()  # the parent's team is running now
    ctx = mp.get_context("fork")
    q = ctx.Queue()
    p = ctx.Process(target=_child_forward, args=(model, x, q))
    p.start()
    got = q.get(timeout=60)
    p.join(10)
    np.testing.assert_array_equal(got, want)
    # Forked while another thread holds the launch lock mid-op: the child renews its locks.
    with threads.POOL_LAUNCH:
        p = ctx.Process(target=_child_forward, args=(model, x, q))
        p.start()
        got = q.get(timeout=60)
    p.join(10)
    np.testing.assert_array_equal(got, want)


def test_teams_of_changing_size_finish_every_job(monkeypatch):
    """Launches alternate between small and large teams (a session's recurrence on 2 threads,
    a graph's head on more): each op's jobs all finish before run() returns, whatever the
    workers left over from the op before do."""
    monkeypatch.setattr(config, "_backend", "native")
    b = runner.backend()
    rng = np.random.default_rng(0)
    x = rng.standard_normal((61, 40)).astype(np.float32)
    W = np.zeros((5, 40, 64), np.float32)
    W[:] = rng.standard_normal(W.shape)
    bias = rng.standard_normal(5 * 64).astype(np.float32)
    want = x @ W.transpose(0, 2, 1).reshape(-1, 40).T + bias
    sync = np.zeros(abi.sync_size(8), np.int64)
    for i in range(300):
        parts, threads = (2, 2) if i % 2 else (8, 1 + i % 8)
        y = np.full((61, 5 * 64), np.nan, np.float32)
        sync[:] = 0
        b.run("matmul", (x, W, bias, 40, y, *ALL, sync, Q0, False, parts), parts, threads)
        np.testing.assert_allclose(
            y, want, rtol=RTOL_MATMUL[np.float32], atol=ATOL_MATMUL[np.float32]
        )


def test_more_threads_than_the_team_can_start_still_finishes():
    """Asking for more threads than the module starts (255 workers) runs on those it has."""
    code = """
        import numpy as np
        from leanrnn.kernels import abi, runner
        b = runner.backend()
        x = np.ones((4, 8), np.float32); W = np.ones((1, 8, 64), np.float32)
        y = np.zeros((4, 64), np.float32); sync = np.zeros(abi.sync_size(300), np.int64)
        Q0, ALL = np.zeros((1, 0), np.uint8), (np.zeros(0, np.int64), 0, 0)
        b.run("matmul", (x, W, np.zeros(64, np.float32), 8, y, *ALL, sync, Q0, False, 300),
              300, 300)
        print(float(y.sum()))
    """
    out = _python(code, LEANRNN_BACKEND="native")
    assert out.returncode == 0, out.stderr
    assert float(out.stdout) == 4 * 64 * 8


def test_compile_command_reports_the_build_or_why_not(tmp_path, capsys, monkeypatch):
    from leanrnn import cli

    # The suite's own build is in place: compile finds it.
    runner.native_module(build=True)
    assert cli.main(["compile"]) == 0
    assert "_leanrnn_native" in capsys.readouterr().out
    # Elsewhere, without a compiler: the reason, and a non-zero exit.
    monkeypatch.setenv("CC", "/nonexistent/cc")
    monkeypatch.setenv("LEANRNN_CACHE_DIR", str(tmp_path))
    assert cli.main(["compile", "--cache-dir", str(tmp_path)]) == 1
    said = capsys.readouterr()  # on stderr, as every other error (session 41: it was stdout)
    assert "leanrnn: error: could not build the native kernels" in said.err
    assert "/nonexistent/cc" in said.err and "could not build" not in said.out
