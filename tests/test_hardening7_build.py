"""Regression tests for the seventh hardening pass (the build, the kernel cache, launches): each
failed before its fix. No test here builds the kernels: builds are stubbed (runner._build), or
fail at once for want of a compiler, and the signal test runs only where a build is in place."""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from leanrnn import config
from leanrnn.errors import LeanRNNError
from leanrnn.kernels import abi, native, runner

DAY = 86400.0


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    """An empty kernel cache of this test's own (runner's state restored afterwards)."""
    root = tmp_path / "cache"
    monkeypatch.setenv("LEANRNN_CACHE_DIR", str(root))
    monkeypatch.delenv("CC", raising=False)
    monkeypatch.setattr(runner, "_where", None)
    return root


# ---------------------------------------------------------------- 1. failures keyed on inputs


def test_a_failure_recorded_under_another_cc_no_longer_stands(cache, monkeypatch):
    """The issue: `CC=/bad leanrnn ...` recorded a permanent failure, and every later process
    fell back to the JIT even with CC unset, the message naming a CC no longer set."""
    d = native.build_dir()
    monkeypatch.setenv("CC", "/nonexistent/cc")
    native.record_failure(d, "BuildError: CC='/nonexistent/cc' is not an executable", False)
    assert "/nonexistent/cc" in native.failure(d)  # the same inputs: it stands
    monkeypatch.delenv("CC")
    assert native.failure(d) is None


def test_a_permanent_failure_under_the_same_inputs_still_stands(cache, monkeypatch):
    """A failure that will recur is still not retried by every process."""
    d = native.build_dir()
    monkeypatch.setenv("CC", "/nonexistent/cc")
    native.record_failure(d, "BuildError: no", False)
    assert native.failure(d) == "BuildError: no"


def test_a_new_process_builds_again_once_cc_is_fixed(cache, monkeypatch):
    """Through runner.native_module (the build stubbed): nothing retried before."""
    d = native.build_dir()
    monkeypatch.setenv("CC", "/nonexistent/cc")
    native.record_failure(d, "BuildError: CC='/nonexistent/cc' is not an executable", False)
    builds = []
    monkeypatch.setattr(runner, "_build", lambda d, fp: builds.append(fp))
    assert runner.native_module(build=True) is None and builds == []  # it stands
    monkeypatch.delenv("CC")
    assert runner.native_module(build=True) is None  # the stub builds nothing
    assert builds == [native.fingerprint()]


def test_the_build_process_records_the_inputs_the_parent_checks(cache, monkeypatch):
    """The real failure path: kernels.aot (the build subprocess) without a compiler. It fails
    before compiling anything (aot._compiler runs first)."""
    d = native.build_dir()
    out = subprocess.run([sys.executable, "-m", "leanrnn.kernels.aot", str(d),
                          native.fingerprint()],
                         env={**os.environ, "LEANRNN_CACHE_DIR": str(cache),
                              "CC": "/nonexistent/cc"},
                         capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert out.returncode == 1, out.stderr
    monkeypatch.setenv("CC", "/nonexistent/cc")
    assert "/nonexistent/cc" in native.failure(d)
    monkeypatch.setenv("CC", "/another/missing/cc")
    assert native.failure(d) is None


@pytest.mark.parametrize("cc", ["   ", "'gcc -O2", "/nonexistent/cc -O2"])
def test_a_bad_cc_is_one_build_error_naming_it(monkeypatch, cc):
    """CC of spaces raised IndexError, CC with unbalanced quotes shlex's ValueError, out of the
    build's compiler choice; each is now the BuildError that names CC."""
    from leanrnn.kernels import aot

    monkeypatch.setenv("CC", cc)
    with pytest.raises(aot.BuildError, match="is not an executable") as e:
        aot._compiler()
    assert repr(cc) in str(e.value)
    assert native.build_inputs("f")["compiler"] is None  # the failure's key: no compiler


def test_the_failure_key_names_the_compiler_the_build_takes(monkeypatch):
    """build_inputs (a failed build's key) and aot._compiler (the build) read one candidate
    list (native.compiler_candidates), so the key names the program the build runs."""
    import shutil

    from leanrnn.kernels import aot

    monkeypatch.delenv("CC", raising=False)
    try:
        cmd = aot._compiler()
    except aot.BuildError:
        pytest.skip("no C compiler on this machine")
    assert native.build_inputs("f")["compiler"] == native._identity(shutil.which(cmd[0]))
    monkeypatch.setenv("CC", f"{shutil.which(cmd[0])} -O2")
    assert aot._compiler() == [shutil.which(cmd[0]), "-O2"]
    assert native.build_inputs("f")["CC"] == f"{shutil.which(cmd[0])} -O2"


# ------------------------------------------------------------------------ 2. cache pruning


def _folder(root: Path, kind: str, fp: str, age_days: float, lock: bool = False) -> Path:
    """A fingerprint folder of ``kind`` (native, numba) whose files were last written and read
    ``age_days`` ago."""
    d = root / kind / fp
    (d / "sub").mkdir(parents=True)
    (d / "sub" / "k.nbi").write_bytes(b"x" * 1000)
    (d / "mod.so").write_bytes(b"y" * 3000)
    if lock:
        (d / ".lock").write_text("")
    t = time.time() - age_days * DAY
    for p in [*d.rglob("*"), d]:
        os.utime(p, (t, t))
    return d


FP_OLD, FP_NEW, FP_NOW, FP_BUSY = "a" * 24, "b" * 24, "c" * 24, "d" * 24


def test_prune_removes_only_old_folders_of_other_fingerprints(tmp_path):
    root = tmp_path / "cache"
    old = [_folder(root, k, FP_OLD, 40) for k in ("native", "numba")]
    recent = _folder(root, "native", FP_NEW, 5)
    now = [_folder(root, k, FP_NOW, 400) for k in ("native", "numba")]
    other = _folder(root, "native", "not-a-fingerprint", 400)
    busy = _folder(root, "native", FP_BUSY, 400, lock=True)
    with open(busy / ".lock") as f:  # a build in progress holds it
        fcntl.flock(f, fcntl.LOCK_EX)
        removed = native.prune(root, keep=FP_NOW, days=30)
    assert sorted(p for p, _ in removed) == sorted(old)
    assert all(n == 4000 for _, n in removed)
    assert not any(p.exists() for p in old)
    assert all(p.is_dir() for p in (recent, *now, other, busy))
    assert sorted(os.listdir(root / "native")) == sorted([FP_NEW, FP_NOW, FP_BUSY,
                                                           "not-a-fingerprint"])  # fmt: skip


def test_a_folder_read_recently_is_not_pruned(tmp_path):
    """A venv of an older leanrnn, which keeps no marker, still reads its module: its atime."""
    root = tmp_path / "cache"
    d = _folder(root, "native", FP_OLD, 40)
    t = time.time() - 40 * DAY
    os.utime(d / "mod.so", (time.time() - 3600, t))
    assert native.prune(root, keep=FP_NOW, days=30) == []
    assert d.is_dir()


def test_use_marks_a_fingerprint_folder_at_most_daily(tmp_path):
    d = _folder(tmp_path, "native", FP_OLD, 40)
    native.mark_used(d)
    marker = d / native.USED
    assert time.time() - marker.stat().st_mtime < 60
    hours_ago = time.time() - 5 * 3600
    os.utime(marker, (hours_ago, hours_ago))
    native.mark_used(d)  # marked today: left alone
    assert marker.stat().st_mtime == pytest.approx(hours_ago)
    assert native.prune(tmp_path, keep=FP_NOW, days=30) == []  # in use
    days_ago = time.time() - 2 * DAY
    os.utime(marker, (days_ago, days_ago))
    native.mark_used(d)
    assert time.time() - marker.stat().st_mtime < 60
    native.mark_used(tmp_path / "gone")  # never raises


def test_loading_the_kernels_marks_their_folders_used(cache, monkeypatch):
    fp = native.fingerprint()
    folders = [_folder(cache, k, fp, 40) for k in ("native", "numba")]
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.setattr(native, "load", lambda d, fp: object())  # a module, as if built
    assert runner.native_module(build=False) is not None
    for d in folders:
        assert time.time() - (d / native.USED).stat().st_mtime < 60, d


def test_a_successful_build_prunes_other_old_fingerprints(cache, monkeypatch):
    old = [_folder(cache, k, FP_OLD, 40) for k in ("native", "numba")]
    recent = _folder(cache, "numba", FP_NEW, 1)
    built = []
    monkeypatch.setattr(runner, "_build", lambda d, fp: built.append(d))
    monkeypatch.setattr(native, "load", lambda d, fp: object() if built else None)
    assert runner.native_module(build=True) is not None and built
    assert not any(p.exists() for p in old)
    assert recent.is_dir() and built[0].is_dir()


def test_compile_prune_frees_now_and_says_how_much(tmp_path):
    root = tmp_path / "cache"
    old = _folder(root, "numba", FP_OLD, 40)
    kept = _folder(root, "numba", FP_NEW, 1)
    out = subprocess.run([sys.executable, "-m", "leanrnn", "compile", "--prune",
                          "--cache-dir", str(root)],
                         env={**os.environ, "CC": "/nonexistent/cc"},
                         capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    assert not old.exists() and kept.is_dir()
    assert str(old) in out.stdout and "4.0 kB" in out.stdout, out.stdout
    assert "compiling" not in out.stderr and not (root / "native").exists()  # no build


# ------------------------------------------------------------- 3. a launch re-entered on a thread

REENTER = """
    import sys, numpy as np
    from leanrnn import config
    from leanrnn.kernels import runner

    calls = []

    class Fake:  # a backend whose launch is interrupted by a handler that runs a model
        name = "fake"

        def run(self, job, args, parts, threads, openmp=False):
            calls.append(threads)
            if len(calls) == 1:
                runner.run(job, args, parts)

        def _run_program(self, array, x, y, threads):
            calls.append(threads)
            if len(calls) == 1:
                runner.run_program(prog, x, y)
            return True

    fake = Fake()
    runner._backend, runner._choice = fake, config.backend()
    runner.pool_threads = lambda parts: 2
    prog = runner.Program(np.zeros(1, np.int64), fake, 2, [])
    if sys.argv[1] == "run":
        runner.run("lstm", (), 2)
    else:
        runner.run_program(prog, None, None)
    print(calls)
"""


@pytest.mark.parametrize("entry", ["run", "run_program"])
def test_a_launch_reentered_on_its_own_thread_runs_alone_instead_of_deadlocking(entry):
    """What a signal handler running a model does in the middle of a multi-threaded launch:
    it hung for ever on threads.POOL_LAUNCH. The nested launch runs on this thread alone."""
    try:
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(REENTER), entry],
                             capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("the re-entered launch deadlocked")
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["[2,", "1]"]


def test_on_the_jit_a_reentered_launch_of_the_interrupted_session_is_refused(monkeypatch):
    """The JIT's pool may still be running the interrupted launch's jobs: a nested launch on
    the same sync array (the same session) would claim from it with them; refused, in words.
    Another session's runs on the launching thread alone."""
    names = abi.JOBS["matmul"].names()

    def args(sync):
        a = [0] * len(names)
        a[names.index("sync")] = sync
        return tuple(a)

    mine, others, ran, interrupted = np.zeros(8, np.int64), np.zeros(8, np.int64), [], []

    def job(*a):  # a: the job's arguments, then me
        sync, me = a[names.index("sync")], a[-1]
        ran.append((sync is others, me, threading.current_thread() is threading.main_thread()))
        if sync is mine and me == 0 and not interrupted:  # code interrupting the launch
            interrupted.append(True)
            with pytest.raises(LeanRNNError, match="same model"):
                runner.run("matmul", args(mine), 2)
            runner.run("matmul", args(others), 2)

    jit = runner._Jit.__new__(runner._Jit)
    jit._jobs = {"matmul": job}
    monkeypatch.setattr(runner, "_backend", jit)
    monkeypatch.setattr(runner, "_choice", config.backend())
    monkeypatch.setattr(runner, "pool_threads", lambda parts: 2)
    runner.run("matmul", args(mine), 2)
    assert sorted(r for r in ran if r[0]) == [(True, 0, True), (True, 1, True)]  # here, alone
    assert sorted(r[1] for r in ran if not r[0]) == [0, 1]


SIGNAL = """
    import faulthandler, signal, time, numpy as np, leanrnn
    from leanrnn import threads
    from leanrnn.kernels import runner

    faulthandler.dump_traceback_later(50, exit=True)  # a deadlock shows where
    if runner.native_module(build=False) is None:
        print("SKIP no native build"); raise SystemExit(0)
    assert runner.backend().name == "native"
    model = leanrnn.LSTM(128, 384, num_layers=2, seed=0, threads=2)
    # The handler's model: another object (the same weights). One model's session is not
    # re-entrant: a run interrupted between two of its launches would resume on scratch and
    # sync counters the handler's run has overwritten.
    other = leanrnn.LSTM(128, 384, num_layers=2, seed=0, threads=2)
    x = np.random.default_rng(0).standard_normal((64, 8, 128)).astype(np.float32)
    t = time.perf_counter(); want = model(x)[0].copy(); took = time.perf_counter() - t
    nested, inside, outer = [], [], []

    def handler(signum, frame):  # a model run while the main thread is inside one
        nested.append(other(x)[0].copy())
        inside.append(threads.launching())
        if len(nested) < 6:  # again, once this one is done
            signal.setitimer(signal.ITIMER_REAL, took / 3)

    signal.signal(signal.SIGALRM, handler)
    signal.setitimer(signal.ITIMER_REAL, took / 3)
    while len(nested) < 6:
        outer.append(model(x)[0].copy())
    print("took", round(took, 3), "nested", len(nested), "inside", sum(inside))
    print("equal", all(np.array_equal(y, want) for y in nested + outer))
"""


def test_a_signal_handler_runs_a_model_while_a_threaded_run_is_in_progress():
    try:
        out = subprocess.run([sys.executable, "-c", textwrap.dedent(SIGNAL)],
                             env={**os.environ, "CC": "/nonexistent/cc",
                                  "LEANRNN_BACKEND": "auto"},
                             capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.fail("a model run from a signal handler deadlocked")
    assert out.returncode == 0, out.stderr[-3000:]
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout[5:].strip())
    assert "equal True" in out.stdout, out.stdout
    inside = int(out.stdout.split("inside")[1].split()[0])
    assert inside >= 1, out.stdout  # the case: the handler ran inside a threaded launch
