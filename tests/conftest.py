import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest
from hypothesis import settings

# CI runs the same examples every time (a failure there must reproduce); local runs keep
# exploring new ones.
settings.register_profile("ci", derandomize=True, print_blob=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture
def rng():
    return np.random.default_rng(1234)


# ------------------------------------------------------------------ numba's JIT, compiled aside
# The JIT backend's tests need every job for both dtypes compiled (~2 min on one core). A process
# of its own (_warm_jit.py) compiles them into numba's cache while the suite runs the other
# tests; those tests run last and wait for it (fixture jit_compiled), then load the same code
# from the cache. Should it fail or miss a signature, the test compiles it itself.
# With pytest-xdist (the suite's default, pyproject.toml) one worker of the run starts it: the
# run's directory (WARM_DIR, made by the controller before the workers start, so they inherit
# it) holds "started" (its pid; created exclusively, so by one worker) and "done" (written by
# _warm_jit.py as it exits), which the other workers wait for.
WARM_DIR = "LEANRNN_TEST_WARM_DIR"
_warm: subprocess.Popen | None = None


def _uses_jit(item) -> bool:
    callspec = getattr(item, "callspec", None)
    return "jit_compiled" in getattr(item, "fixturenames", ()) or (
        callspec is not None and callspec.params.get("backend") == "jit"
    )


def pytest_configure(config):
    if not hasattr(config, "workerinput"):  # the xdist controller, or a run without xdist
        os.environ[WARM_DIR] = tempfile.mkdtemp(prefix="leanrnn-warm-jit-")


# ------------------------------------------------------------------ the native kernels, first
# A fresh cache (CI's) builds the native module on first use, as a new user's first run does,
# in 4-10 minutes on 2 cores. Inside a test that wait counted against the test's timeout
# (pyproject: 600 s), and on a slow VM both xdist workers, each waiting for the build in its
# first native test, were killed by it ("node down"). So the controller builds it here, by the
# same path a first use takes (runner.native_module), before the workers start (xdist starts
# them in its own, trylast, sessionstart) and before any timeout runs; with a built module
# this costs a load and a hash check. The JIT's warm-up (below) starts after it: the build
# saves every job it compiled into numba's cache (kernels.aot._save_for_the_jit), so the
# warm-up only loads them; started beside the build, it compiled the same code again (~130 s
# of a core). Should the build fail, the warm-up compiles them while the tests run.
def pytest_sessionstart(session):
    if hasattr(session.config, "workerinput") or session.config.option.collectonly:
        return
    from leanrnn import config
    from leanrnn.kernels import runner

    if config.backend() == "jit":
        return
    runner.native_module(build=True)  # a failed build is recorded; the JIT runs instead
    _start_warm()


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    jit = [i for i in items if _uses_jit(i)]
    if not jit:
        return
    items[:] = [i for i in items if not _uses_jit(i)] + jit  # stable: otherwise in order
    if not config.option.collectonly:
        _start_warm()


def _start_warm() -> None:
    """Start _warm_jit.py unless this run's controller or another worker has (WARM_DIR's
    "started", created exclusively, holds its pid)."""
    global _warm
    if _warm is not None:
        return
    run = Path(os.environ[WARM_DIR])
    try:
        fd = os.open(run / "started", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    except FileExistsError:  # another process of this run started it
        return
    _warm = subprocess.Popen(  # the same environment, so the same numba cache
        [sys.executable, str(Path(__file__).with_name("_warm_jit.py")), str(os.getpid()),
         str(run / "done")],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    os.write(fd, str(_warm.pid).encode())
    os.close(fd)


def _running(pid: int) -> bool:
    """pid is a live process (not gone, not a zombie its parent has yet to reap)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _wait_for_warm(run: Path, limit: float = 900.0) -> None:
    """Until another worker's _warm_jit.py is done or gone (at most ``limit`` seconds: then the
    tests compile what they need themselves)."""
    started, deadline = run / "started", time.monotonic() + limit
    while started.exists() and not (run / "done").exists() and time.monotonic() < deadline:
        pid = started.read_text()
        if pid and not _running(int(pid)):
            return
        time.sleep(0.5)


def pytest_sessionfinish(session, exitstatus):
    if _warm is not None and _warm.poll() is None:  # interrupted early: it stops with us
        _warm.kill()
        _warm.wait()
    if not hasattr(session.config, "workerinput") and os.environ.get(WARM_DIR):
        shutil.rmtree(os.environ[WARM_DIR], ignore_errors=True)


@pytest.fixture(scope="session")
def jit_compiled() -> str:
    """Waits for _warm_jit.py; returns numba's (fingerprint-keyed) cache directory, for tests
    that run the JIT in a child process with a cache of their own choosing."""
    if _warm is not None:
        _warm.wait()
    elif os.environ.get(WARM_DIR):
        _wait_for_warm(Path(os.environ[WARM_DIR]))
    from leanrnn.kernels import _jit  # noqa: F401 - sets NUMBA_CACHE_DIR (keyed)

    return os.environ.get("NUMBA_CACHE_DIR", "")


@pytest.fixture
def many_cores(monkeypatch):
    """Let sessions run more threads than this machine has cores (the kernels must be right
    for any thread count; only speed suffers)."""
    monkeypatch.setattr("leanrnn.config.max_threads", lambda: 4)


@pytest.fixture(params=["native", "jit"])
def backend(request, monkeypatch):
    """Each kernel backend (kernels.runner): the ahead-of-time module and numba's JIT."""
    if request.param == "jit":
        request.getfixturevalue("jit_compiled")  # compiled aside, meanwhile
    monkeypatch.setattr("leanrnn.config._backend", request.param)
    return request.param
