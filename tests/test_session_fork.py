"""os.fork() while another thread is inside a run: the child can run the same model.

The thread that held a lock at the fork does not exist in the child, so a lock copied in its held
state would block the child forever; sessions and pools renew theirs (engine._fork).
"""

import os
import select
import signal
import threading
import time

import numpy as np
import pytest

import leanrnn
from leanrnn.engine import Pool, Session, _fork
from leanrnn.kernels.reference import reference_forward
from tolerances import atol

pytestmark = pytest.mark.skipif(not hasattr(os, "fork"), reason="needs os.fork")

CHILD_TIMEOUT = 60  # seconds: generous for a loaded machine; a deadlock never finishes


def _in_child(run, nbytes: int) -> bytes:
    """Fork; the child calls ``run()`` and sends back its result's bytes. Fails if the child
    does not finish within CHILD_TIMEOUT (killed then) or exits non-zero."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # pragma: no cover - the child
        code = 1
        try:
            os.close(r)
            data = np.ascontiguousarray(run()).tobytes()
            while data:
                data = data[os.write(w, data) :]
            code = 0
        finally:
            os._exit(code)
    os.close(w)
    got, deadline = b"", time.monotonic() + CHILD_TIMEOUT
    try:
        while len(got) < nbytes and time.monotonic() < deadline:
            ready, _, _ = select.select([r], [], [], 0.2)
            if ready:
                chunk = os.read(r, 1 << 16)
                if not chunk:
                    break
                got += chunk
        while time.monotonic() < deadline:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            pytest.fail(f"the forked child did not finish within {CHILD_TIMEOUT} s (deadlock)")
    finally:
        os.close(r)
    assert os.waitstatus_to_exitcode(status) == 0
    assert len(got) == nbytes
    return got


def _reference(model, x):
    return reference_forward(model.spec, model.weights.unpack(), x)[0]


def _fork_while_held(lock, run, want):
    held, release = threading.Event(), threading.Event()

    def holder():
        with lock:
            held.set()
            release.wait(CHILD_TIMEOUT)

    t = threading.Thread(target=holder)
    t.start()
    try:
        assert held.wait(10)
        got = _in_child(run, want.astype(np.float32).nbytes)
    finally:
        release.set()
        t.join()
    y = np.frombuffer(got, np.float32).reshape(want.shape)
    np.testing.assert_allclose(y, want, rtol=0, atol=atol(np.float32))


def test_child_runs_the_model_whose_session_lock_another_thread_holds():
    model = leanrnn.LSTM(6, 12, num_layers=2, seed=0)
    x = np.random.default_rng(0).standard_normal((5, 3, 6)).astype(np.float32)
    model(x)  # planned: the parent thread holds the lock of a session in use
    _fork_while_held(model.session._lock, lambda: model(x)[0], _reference(model, x))
    np.testing.assert_allclose(model(x)[0], _reference(model, x), rtol=0, atol=atol(np.float32))


def test_child_runs_a_pooled_session_whose_pool_lock_another_thread_holds():
    model = leanrnn.GRU(6, 12, seed=1)
    pool = Pool()
    s = Session(model.weights, pool=pool)
    x = np.random.default_rng(1).standard_normal((4, 2, 6)).astype(np.float32)
    s.run(x)
    _fork_while_held(pool.lock, lambda: s.run(x)[0], _reference(model, x))


def test_fork_while_another_thread_runs():
    """The realistic case: a thread keeps running (threaded kernels included) while the main
    thread forks; each child runs the same model."""
    model = leanrnn.LSTM(16, 64, seed=2, threads=2)  # above PARALLEL_MIN_MACS at N=4
    x = np.random.default_rng(2).standard_normal((20, 4, 16)).astype(np.float32)
    want = _reference(model, x)
    stop = threading.Event()

    def busy():
        while not stop.is_set():
            model(x)

    t = threading.Thread(target=busy)
    t.start()
    try:
        for _ in range(3):
            got = _in_child(lambda: model(x)[0], want.astype(np.float32).nbytes)
            y = np.frombuffer(got, np.float32).reshape(want.shape)
            np.testing.assert_allclose(y, want, rtol=0, atol=atol(np.float32))
    finally:
        stop.set()
        t.join()


def test_renew_lock_serves_any_engine_object():
    """engine._fork.renew_lock: what another engine object (a graph session) registers with."""

    class Holder:
        pass

    obj = Holder()
    obj._lock = threading.Lock()
    _fork.renew_lock(obj)

    def run():
        with obj._lock:
            return np.ones(3, np.float32)

    _fork_while_held(obj._lock, run, np.ones(3))


@pytest.mark.parametrize("which", ["model", "session"])
def test_child_runs_a_graph_whose_lock_another_thread_holds(tmp_path, which):
    """An ONNX graph's model and graph-session locks are renewed in the child too (a fork while
    another thread ran ``m(x)`` left them held: the child blocked forever)."""
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    C, H = 5, 8
    rng = np.random.default_rng(3)
    W, R, B = (rng.standard_normal(s).astype(np.float32) * 0.3
               for s in ((1, 3 * H, C), (1, 3 * H, H), (1, 6 * H)))  # fmt: skip
    node = helper.make_node("GRU", ["x", "W", "R", "B"], ["", "h"], hidden_size=H)
    graph = helper.make_graph(
        [node], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 2, C])],
        [helper.make_tensor_value_info("h", TensorProto.FLOAT, [1, 2, H])],
        [numpy_helper.from_array(a, n) for a, n in ((W, "W"), (R, "R"), (B, "B"))],
    )  # fmt: skip
    path = tmp_path / "gru.onnx"
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)]), path)
    m = leanrnn.load(path)
    x = rng.standard_normal((4, 2, C)).astype(np.float32)
    want = m.run({"x": x})[0]
    lock = m._lock if which == "model" else m.session._lock
    _fork_while_held(lock, lambda: m.run({"x": x})[0], want)


def test_resize_waits_for_a_run_on_another_thread():
    """resize() used to plan without the session's lock: called while another thread was
    inside run(), it swapped the views under the running kernels."""
    import threading

    m = leanrnn.LSTM(4, 8, seed=0)
    s = m.session
    s.resize(2, 5)
    done = threading.Event()
    with s._lock:  # what a run on another thread holds

        def other():
            s.resize(3, 7)
            done.set()

        t = threading.Thread(target=other)
        t.start()
        assert not done.wait(0.3)  # blocked behind the "run"
    t.join(5)
    assert done.is_set() and s.plan is not None


def test_child_runs_a_leanrnn_torch_module_whose_lock_another_thread_holds():
    """Session 41: a leanrnn.torch module's engine lock was not renewed: a parent thread in
    its forward at the fork (a DataLoader, a process pool) hung the child's first call."""
    torch = pytest.importorskip("torch")
    import leanrnn.torch as lt
    from leanrnn.torch import _ENGINES

    m = lt.LSTM(6, 12)
    x = torch.from_numpy(np.random.default_rng(3).standard_normal((5, 2, 6)).astype(np.float32))
    with torch.no_grad():
        want = m(x)[0].numpy()
    _fork_while_held(_ENGINES[m._key].lock, lambda: m(x)[0].detach().numpy(), want)


def test_child_chooses_the_gemm_while_a_parent_thread_was_choosing(monkeypatch):
    """Session 41: the lock of the first GEMM choice (a ~1 s measurement) was not renewed: a
    fork during it hung the child at its first training step."""
    from leanrnn.engine import products

    monkeypatch.setattr(products, "_CHOICE", {})  # not chosen yet: the child takes the lock
    m = leanrnn.LSTM(6, 12, seed=4)
    x = np.random.default_rng(4).standard_normal((5, 2, 6)).astype(np.float32)
    _fork_while_held(products._CHOOSING, lambda: (products.gemm_choice(np.float32),
                                                   m(x)[0])[1], _reference(m, x))  # fmt: skip
