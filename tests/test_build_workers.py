"""A killed build leaves no workers behind (they once kept compiling for minutes, a core each)."""

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

_PARENT = textwrap.dedent("""
    import multiprocessing, os, sys, time
    from concurrent.futures import ProcessPoolExecutor
    from leanrnn.kernels import aot

    ctx = multiprocessing.get_context("spawn")  # as aot.build starts its workers
    ex = ProcessPoolExecutor(1, mp_context=ctx, initializer=aot._die_with_parent)
    print(ex.submit(os.getpid).result(), flush=True)
    ex.submit(time.sleep, 120)  # a long kernel
    time.sleep(120)
""")


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"  # a zombie is dead
    except FileNotFoundError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_build_workers_die_with_the_process_that_started_them():
    parent = subprocess.Popen([sys.executable, "-c", _PARENT], stdout=subprocess.PIPE, text=True)
    try:
        worker = int(parent.stdout.readline())
        assert _alive(worker)
    finally:
        parent.send_signal(signal.SIGKILL)  # no chance to shut its pool down
        parent.wait()
    deadline = time.monotonic() + 15
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.1)
    alive = _alive(worker)
    if alive:
        os.kill(worker, signal.SIGKILL)
    assert not alive, "the build worker outlived the killed build by 15 s"
