"""Regression tests for the red-team of the build, the caches and the environment (session 18):
each failed before its fix."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from leanrnn import config


def _python(code: str, **env) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", code], env={**os.environ, **env},
                          capture_output=True, text=True, timeout=120, check=False)  # fmt: skip


def test_numba_num_threads_caps_the_cores_and_never_raises_them():
    """NUMBA_NUM_THREADS=64 on this machine's cores ran 64 kernel threads on them (10x
    slower); the README says it caps leanrnn's cores."""
    have = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    out = _python("from leanrnn import config; print(config.cores())", NUMBA_NUM_THREADS="64")
    assert out.returncode == 0, out.stderr
    assert int(out.stdout) == have
    out = _python("from leanrnn import config; print(config.cores())", NUMBA_NUM_THREADS="1")
    assert int(out.stdout) == 1


def test_a_home_relative_cache_dir_is_expanded(monkeypatch):
    """A quoted '~/...' (a Dockerfile's ENV) made a directory named '~' in the working
    directory, and a build in it."""
    monkeypatch.setenv("LEANRNN_CACHE_DIR", "~/lrnn-cache")
    assert config.cache_dir() == Path.home() / "lrnn-cache"
    monkeypatch.delenv("LEANRNN_CACHE_DIR")
    monkeypatch.setenv("XDG_CACHE_HOME", "~/xdg")
    assert config.cache_dir() == Path.home() / "xdg" / "leanrnn"


def test_info_does_not_build_the_kernels(tmp_path):
    """`leanrnn info` timed a first run, which built the native kernels (minutes on a fresh
    install) and recorded a failure that depended on that run's environment (here a CC that
    does not exist: a permanent one)."""
    out = subprocess.run([sys.executable, "-m", "leanrnn", "info", "--json"],
                         env={**os.environ, "LEANRNN_CACHE_DIR": str(tmp_path),
                              "LEANRNN_BACKEND": "auto", "CC": "/nonexistent"},
                         capture_output=True, text=True, timeout=300, check=False)  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["warm_start_seconds"] is None
    assert "compiling the kernels" not in out.stderr
    assert not list(tmp_path.rglob("FAILED")) and not list(tmp_path.rglob("*.so"))


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_build_dies_with_the_process_that_started_it():
    """The build ran on, orphaned, after its starter was killed (kill PID, a supervisor, the
    OOM killer), then broke its progress pipe and recorded a failure that kept the native
    kernels off for ten minutes. The starter's child now gets SIGKILL with it."""
    starter = (
        "import subprocess, sys, time; from leanrnn.kernels import runner\n"
        "p = subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)'],"
        " preexec_fn=runner._dies_with_us())\n"
        "print(p.pid, flush=True); time.sleep(120)\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", starter], stdout=subprocess.PIPE, text=True)
    try:
        child = int(proc.stdout.readline())
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                os.kill(child, 0)
            except ProcessLookupError:
                break  # gone (reaped by init)
            with open(f"/proc/{child}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] == "Z":
                    break  # dead, waiting to be reaped
            time.sleep(0.05)
        else:
            os.kill(child, signal.SIGKILL)
            pytest.fail("the starter's child outlived it")
    finally:
        if proc.poll() is None:
            proc.kill()


def test_info_names_the_numba_cache_the_kernels_use(tmp_path):
    """info said "(next to the package sources, in __pycache__)" (or $NUMBA_CACHE_DIR itself)
    where kernels._jit caches in a folder named by the sources' fingerprint."""
    code = ("import os, leanrnn.kernels._jit, numba; from leanrnn import config; "
            "from leanrnn.kernels import native; "
            "print(numba.config.CACHE_DIR); print(config.numba_cache_dir(native.fingerprint()))")  # fmt: skip
    for env in ({"LEANRNN_CACHE_DIR": str(tmp_path / "c")},
                {"NUMBA_CACHE_DIR": str(tmp_path / "n")}):  # fmt: skip
        base = {k: v for k, v in os.environ.items() if k != "NUMBA_CACHE_DIR"}
        out = subprocess.run([sys.executable, "-c", code], env={**base, **env},
                             capture_output=True, text=True, timeout=120, check=False)  # fmt: skip
        assert out.returncode == 0, out.stderr
        used, said = out.stdout.split()
        assert Path(used) == Path(said), out.stdout
