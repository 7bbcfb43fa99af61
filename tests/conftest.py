import os
import subprocess
import sys
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
# tests on the other core; those tests run last and wait for it (fixture jit_compiled), then load
# the same code from the cache. Should it fail or miss a signature, the test compiles it itself.
_warm: subprocess.Popen | None = None


def _uses_jit(item) -> bool:
    callspec = getattr(item, "callspec", None)
    return "jit_compiled" in getattr(item, "fixturenames", ()) or (
        callspec is not None and callspec.params.get("backend") == "jit"
    )


@pytest.hookimpl(trylast=True)
def pytest_collection_modifyitems(session, config, items):
    jit = [i for i in items if _uses_jit(i)]
    if not jit:
        return
    items[:] = [i for i in items if not _uses_jit(i)] + jit  # stable: otherwise in order
    global _warm
    if _warm is None and not config.option.collectonly:
        _warm = subprocess.Popen(  # the same environment, so the same numba cache
            [sys.executable, str(Path(__file__).with_name("_warm_jit.py")), str(os.getpid())],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )  # fmt: skip


def pytest_sessionfinish(session, exitstatus):
    if _warm is not None and _warm.poll() is None:  # interrupted early: it stops with us
        _warm.kill()
        _warm.wait()


@pytest.fixture(scope="session")
def jit_compiled() -> str:
    """Waits for _warm_jit.py; returns numba's (fingerprint-keyed) cache directory, for tests
    that run the JIT in a child process with a cache of their own choosing."""
    if _warm is not None:
        _warm.wait()
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
