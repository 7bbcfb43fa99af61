"""Kernel launches on the caller's GNU OpenMP team (threads.openmp_team, native.c's
GOMP_parallel path), which leanrnn.torch uses: the same bits as leanrnn's own threads, no
threads of leanrnn's own started, and a forked child falls back to its own threads instead of
hanging in the parent's OpenMP team.

Each case runs in a fresh interpreter (the thread count of the process is what is checked, and
the fork must not happen inside pytest's process)."""

import subprocess
import sys
import textwrap

import pytest

torch = pytest.importorskip("torch")

if "parallel backend: OpenMP" not in torch.__config__.parallel_info():  # pragma: no cover
    pytest.skip("this torch build does not run on OpenMP", allow_module_level=True)

_PRELUDE = """
import os, numpy as np, torch
torch.set_num_threads(2)
import leanrnn
from leanrnn import config, threads
from leanrnn.kernels import runner
from leanrnn.train import Trainer
if runner.backend().name != "native":
    print("SKIP the native backend is not in use"); raise SystemExit(0)
config.set_num_threads(2)
torch.ones(512, 512) @ torch.ones(512, 512)  # torch's OpenMP team exists and has spun
rng = np.random.default_rng(0)
T, N, C, H = 6, 24, 5, 40  # N * 4H * H: past PARALLEL_MIN_MACS, so each op has 2 parts
x = rng.standard_normal((T, N, C)).astype(np.float32)
dy = rng.standard_normal((T, N, H)).astype(np.float32)

def step():
    tr = Trainer(leanrnn.LSTM(C, H, seed=3))
    tape = tr.forward(x)
    dx, dh, dc = tr.backward(tape, dy)
    assert tr._parts(N) == 2
    return np.concatenate([tape.y.ravel(), dx.ravel(), dh.ravel(), dc.ravel(),
                           *(np.ravel(a) for a in tr.grad.tensors().values())])

def tasks():
    return len(os.listdir("/proc/self/task"))
"""


def _run(body: str) -> str:
    code = _PRELUDE + textwrap.dedent(body)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    if out.stdout.startswith("SKIP"):
        pytest.skip(out.stdout[5:].strip())
    return out.stdout


def test_openmp_launches_give_the_same_bits_and_start_no_threads_of_ours():
    out = _run("""
        assert threads.gnu_openmp_parallel() != 0, "torch's libgomp is loaded"
        before = tasks()
        with threads.openmp_team():
            a = step()
        print("started", tasks() - before)
        b = step()  # leanrnn's own team: its worker thread starts now
        print("own", tasks() - before)
        print("equal", bool(np.array_equal(a, b)))
    """)
    assert "started 0" in out, out
    assert "own 1" in out, out  # the count can see a worker start (the check above can fail)
    assert "equal True" in out, out


def test_torchs_runtime_is_found_among_several_libgomp_copies(tmp_path):
    """MNN and scikit-learn bundle libgomp copies of their own; one mapped before torch's (its
    path sorts first) must not become the team the kernels run on (a second runtime beside
    torch's spinning one). Here: a copy of torch's own libgomp under another name."""
    import glob
    import os

    libs = glob.glob(os.path.join(os.path.dirname(torch.__file__), "lib", "libgomp*.so*"))
    if not libs:  # pragma: no cover - torch's wheels bundle it
        pytest.skip("torch bundles no libgomp here")
    copy = tmp_path / "aaa" / "libgomp-copy.so.1"
    copy.parent.mkdir()
    copy.write_bytes(open(libs[0], "rb").read())
    # loaded after torch, by path: a second runtime (loaded first, it would have been the one
    # torch's libraries bind to by its soname, the same in the copy)
    out = _run(
        f"""
        import ctypes
        extra = ctypes.CDLL({str(copy)!r})
        two = threads.gnu_openmp_parallel()  # no library named yet: two copies, no guess
        import leanrnn.torch as lt
        assert lt._torch_on_openmp()
        lib = os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so")
        want = ctypes.cast(ctypes.CDLL(lib, mode=os.RTLD_NOLOAD | os.RTLD_LAZY).GOMP_parallel,
                           ctypes.c_void_p).value
        other = ctypes.cast(extra.GOMP_parallel, ctypes.c_void_p).value
        print("ambiguous", two == 0, "torch's", threads.gnu_openmp_parallel() == want != other)
        before = tasks()
        with threads.openmp_team():
            step()
        print("started", tasks() - before)
        """
    )
    assert "ambiguous True torch's True" in out, out
    assert "started 0" in out, out


def test_a_forked_child_runs_on_its_own_threads_instead_of_the_parents_openmp_team():
    out = _run("""
        import select, signal, time
        with threads.openmp_team():
            a = step()
        r, w = os.pipe()
        pid = os.fork()
        if pid == 0:
            try:
                assert threads.gnu_openmp_parallel() == 0
                with threads.openmp_team():
                    data = step().tobytes()
                while data:
                    data = data[os.write(w, data):]
            finally:
                os._exit(0)
        os.close(w)
        got, deadline = b"", time.monotonic() + 120
        while len(got) < a.nbytes and time.monotonic() < deadline:
            if select.select([r], [], [], 0.2)[0]:
                chunk = os.read(r, 1 << 16)
                if not chunk:
                    break
                got += chunk
        if len(got) < a.nbytes:
            os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        same = len(got) == a.nbytes and np.array_equal(np.frombuffer(got, a.dtype), a)
        print("child", bool(same))
    """)
    assert "child True" in out, out
