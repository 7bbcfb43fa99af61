"""Session 44, from a red-team pass on how leanrnn adapts to the CPUs and containers it runs
in: threadpoolctl 3.8 dropped every BLAS limit set from a thread other than the first to set
one (BLAS stuck at 1 thread after concurrent graph runs; blas_alone and set_num_threads doing
nothing on a worker thread); a cgroup CPU quota was never read; an affinity mask narrowed
after import was ignored; a sysfs cache size of "0K" crashed every run; numba's JIT backend
under NUMBA_NUM_THREADS=0 died with numba's traceback."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading

import pytest

from leanrnn import config, threads
from leanrnn.kernels import _cpu

TWO_CPUS = pytest.mark.skipif(
    not hasattr(os, "sched_getaffinity") or len(os.sched_getaffinity(0)) < 2,
    reason="needs a process allowed 2 CPUs",
)


def _openblas_threads():
    from threadpoolctl import threadpool_info

    return [i["num_threads"] for i in threadpool_info() if i["internal_api"] == "openblas"]


def _in_thread(fn):
    out = []
    t = threading.Thread(target=lambda: out.append(fn()))
    t.start()
    t.join()
    return out[0]


@TWO_CPUS
def test_blas_limits_apply_from_any_thread():
    pytest.importorskip("threadpoolctl")
    if not _openblas_threads():
        pytest.skip("numpy's BLAS here is not OpenBLAS")
    before = config.get_num_threads()
    try:
        config.set_num_threads(2)  # the main thread first: threadpoolctl 3.8's "controller"
        assert set(_openblas_threads()) == {2}

        def alone():
            with threads.blas_alone():
                return _openblas_threads()

        assert set(_in_thread(alone)) == {1}  # it was 2: the worker's limit was dropped
        assert set(_openblas_threads()) == {2}
        _in_thread(lambda: config.set_num_threads(1))
        assert set(_openblas_threads()) == {1}  # it stayed 2 while leanrnn said 1
        config.set_num_threads(2)
        # threads in and out of blas_alone at once, the last one out on another thread than
        # the first in: the limits found are back (it stayed at 1 for good)
        gate = threading.Barrier(4)

        def overlap(k):
            with threads.blas_alone():
                gate.wait()
                assert set(_openblas_threads()) == {1}
                gate.wait()

        ts = [threading.Thread(target=overlap, args=(k,)) for k in range(4)]
        for t in ts:
            t.start()
        for t in ts:
            t.join()
        assert set(_openblas_threads()) == {2}
    finally:
        config.set_num_threads(before)


def _tree(root, cgroup: str, files: dict[str, str]):
    (root / "proc" / "self").mkdir(parents=True)
    (root / "proc" / "self" / "cgroup").write_text(cgroup)
    for rel, text in files.items():
        p = root / "sys" / "fs" / "cgroup" / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)
    return str(root)


@pytest.mark.parametrize(
    ("cgroup", "files", "want"),
    [
        ("0::/a/b\n", {"a/b/cpu.max": "150000 100000\n"}, 2),  # --cpus=1.5
        ("0::/a/b\n", {"a/b/cpu.max": "max 100000\n"}, None),
        ("0::/a/b\n", {"a/b/cpu.max": "max 100000\n", "a/cpu.max": "50000 100000\n"}, 1),
        ("0::/\n", {"cpu.max": "300000 100000\n"}, 3),
        ("0::/a\n", {}, None),
        ("0::/a\n", {"a/cpu.max": "garbage\n"}, None),
        ("4:cpu,cpuacct:/d\n", {"cpu,cpuacct/d/cpu.cfs_quota_us": "100000\n",
                                "cpu,cpuacct/d/cpu.cfs_period_us": "100000\n"}, 1),
        ("4:cpu,cpuacct:/d\n", {"cpu/d/cpu.cfs_quota_us": "-1\n",
                                "cpu/d/cpu.cfs_period_us": "100000\n"}, None),
        ("4:cpuacct,cpu:/\n", {"cpu/cpu.cfs_quota_us": "250000\n",
                               "cpu/cpu.cfs_period_us": "100000\n"}, 3),
    ],
)  # fmt: skip
def test_a_cgroup_cpu_quota_caps_the_cores(tmp_path, cgroup, files, want):
    assert config._quota_cores(_tree(tmp_path, cgroup, files)) == want


def test_the_machine_s_own_quota_reads_without_error():
    got = config._quota_cores()
    assert got is None or got >= 1


@TWO_CPUS
def test_a_mask_narrowed_after_import_runs_fewer_threads_with_the_same_results():
    code = textwrap.dedent("""
        import os, time
        os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[:2])  # (2 at start-up)
        import numpy as np
        import leanrnn
        from leanrnn import config, threads
        x = np.random.default_rng(0).standard_normal((20, 8, 16)).astype(np.float32)
        m = leanrnn.LSTM(16, 64, seed=1)
        y2 = m(x)[0]
        assert config.cores() == 2, config.cores()
        pid = os.fork()
        if pid == 0:  # a fork's child pinning itself: counted at once
            os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
            ok = config.cores() == 1 and threads.pool_threads(2) == 1
            ok = ok and np.array_equal(m(x)[0], y2)
            os._exit(0 if ok else 3)
        assert os.waitpid(pid, 0)[1] == 0
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        time.sleep(0.3)  # (counted again at most every 0.25 s)
        assert config.cores() == 1 and config.get_num_threads() == 1
        assert np.array_equal(m(x)[0], y2)
        print("ok")
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr[-2000:]


@pytest.mark.parametrize("size", ["0K", "512", "0"])
def test_a_cache_size_under_1_kib_keeps_the_typical_core_s(tmp_path, size):
    for k, (level, kind, text) in enumerate(
        [(1, "Data", "48K"), (1, "Instruction", "32K"), (2, "Unified", size),
         (3, "Unified", "32768K")]
    ):  # fmt: skip
        d = tmp_path / f"index{k}"
        d.mkdir()
        (d / "level").write_text(f"{level}\n")
        (d / "type").write_text(f"{kind}\n")
        (d / "size").write_text(f"{text}\n")
    got = _cpu._read_caches(tmp_path)
    assert got == {"L1d": 48 << 10, "L2": 1 << 20, "L3": 32 << 20}


@pytest.mark.parametrize("l2", [0, 1, 1023, 1024])
def test_kc_of_a_tiny_l2_is_the_floor(l2):
    assert _cpu.kc(l2) == 128  # it raised "negative shift count" below 1 KiB


@pytest.mark.parametrize("value", ["0", "-2", "abc"])
def test_numba_num_threads_numba_refuses_is_a_clear_error_on_the_jit_backend(value):
    env = {**os.environ, "NUMBA_NUM_THREADS": value, "LEANRNN_BACKEND": "jit"}
    code = "import numpy as np, leanrnn; leanrnn.LSTM(4, 8)(np.zeros((2, 1, 4), np.float32))"
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=300)  # fmt: skip
    assert r.returncode != 0
    assert f"NUMBA_NUM_THREADS={value!r}" in r.stderr and "positive integer" in r.stderr


@TWO_CPUS
def test_bench_describes_the_cpus_it_may_use():
    code = textwrap.dedent("""
        import os
        os.sched_setaffinity(0, {min(os.sched_getaffinity(0))})
        from leanrnn.kernels import _cpu
        print(_cpu.describe())
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    assert f"1 of {os.cpu_count()} logical CPUs usable" in r.stdout


@TWO_CPUS
def test_leanrnn_gives_blas_control_back_to_a_user_s_thread():
    """A review of the fix above: it cleared threadpoolctl's controlling thread after its own
    calls, taking control from a user's threadpool_limits block on another thread (a third
    thread could then take it for good, and the user's restore was dropped)."""
    tp = pytest.importorskip("threadpoolctl")
    if not _openblas_threads() or not hasattr(tp, "OpenBLASController"):
        pytest.skip("numpy's BLAS here is not OpenBLAS, or threadpoolctl has no such rule")
    state = tp.OpenBLASController._SHARED_STATE
    if not hasattr(state, "controlling_thread"):
        pytest.skip("threadpoolctl before 3.8 has no controlling thread")
    entered, leave = threading.Event(), threading.Event()
    seen = []

    def user():
        with tp.threadpool_limits(limits=1, user_api="blas"):
            entered.set()
            leave.wait(30)
            seen.append(set(_openblas_threads()))

    u = threading.Thread(target=user)
    before = set(_openblas_threads())
    # (no thread in control: an earlier test's may still hold it, alive, and the user's
    # block would then be threadpoolctl's no-op)
    tp.OpenBLASController.clear_controlling_thread(force=True)
    u.start()
    try:
        assert entered.wait(30)
        with threads.blas_alone():
            assert set(_openblas_threads()) == {1}
        assert state.controlling_thread is u  # (None before: control taken from the user)
    finally:
        leave.set()
        u.join()
    assert seen == [{1}] and set(_openblas_threads()) == before


def _blas_after_scipy(first: str, then: str) -> str:
    """In a fresh process: ``first`` (leanrnn makes its threadpoolctl controller, knowing
    numpy's BLAS), scipy imported (its own OpenBLAS), then ``then``, which prints; its output
    (the test skips where scipy's BLAS is numpy's)."""
    pytest.importorskip("scipy")
    code = "\n".join([
        "import numpy, leanrnn",
        "from leanrnn import threads",
        "from threadpoolctl import ThreadpoolController, threadpool_info",
        "def blas(): return [i for i in threadpool_info() if i['user_api'] == 'blas']",
        first,
        "before = {i['filepath'] for i in blas()}",
        "import scipy.linalg",
        "if not {i['filepath'] for i in blas()} - before:",
        "    print('no new BLAS')",
        "    raise SystemExit(0)",
        then,
    ])  # fmt: skip
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    if r.stdout.strip() == "no new BLAS":
        pytest.skip("scipy's BLAS is numpy's here")
    return r.stdout.strip()


@TWO_CPUS
def test_set_num_threads_reaches_a_blas_loaded_after_leanrnn_s_first_limit():
    """Found by CI: leanrnn's threadpoolctl controller listed the libraries loaded when it
    was made; scipy's OpenBLAS, loaded later (and left at 1 thread by someone else's limit),
    kept that limit through set_num_threads(2)."""
    out = _blas_after_scipy(
        "leanrnn.set_num_threads(1)",
        "ThreadpoolController().limit(limits=1, user_api='blas')  # never restored\n"
        "leanrnn.set_num_threads(2)\n"
        "print(sorted(i['num_threads'] for i in blas()))",
    )
    assert out == "[2, 2]", out  # ([1, 2] before)


@TWO_CPUS
def test_blas_alone_reaches_a_blas_loaded_after_leanrnn_s_first_use():
    """A review of the fix above: blas_alone kept the first controller, and a BLAS loaded
    later (scipy's) ran its own threads beside the kernels' spinning ones."""
    out = _blas_after_scipy(
        "leanrnn.set_num_threads(2)\nwith threads.blas_alone(): pass",
        "with threads.blas_alone(): print(sorted(i['num_threads'] for i in blas()))",
    )
    assert out == "[1, 1]", out  # ([1, 2] before)
