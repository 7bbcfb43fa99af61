"""Session 41, from red-team passes on the forms of arrays handed to every entry point and on
the numpy-only optimizers: index arrays (lengths, slot tables) were checked and then handed to
the kernels as the caller's own array, so another thread changing one during the call sent the
kernels outside their buffers (a segfault); the Trainer gave numba's bare TypeError for an
unaligned x or dy; an optimizer's state_dict left out buffers the current settings do not use
(momentum 0, amsgrad switched on later), so a resumed run diverged; torch's parameter groups
were told to "wrap the array"."""

from __future__ import annotations

import numpy as np
import pytest

import leanrnn
from leanrnn.engine import _check
from leanrnn.engine.session import _slot_table
from leanrnn.errors import LeanRNNError
from leanrnn.train import SGD, Adam, Trainer

T, N, C, H = 5, 3, 4, 6


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8])
def test_lengths_are_checked_and_used_as_a_copy(dtype):
    """The kernels read lengths with the GIL released: the checked array must be the one they
    read (an int64 caller's array was used as it was, and another thread's write of 2**40 after
    the check made the reverse direction write rows past T)."""
    lengths = np.array([5, 2, 0], dtype)
    got = _check.lengths("run", lengths, N, T)
    assert got.dtype == np.int64 and got.tolist() == [5, 2, 0]
    assert not np.shares_memory(got, lengths)


def test_a_slot_table_is_checked_and_used_as_a_copy():
    slot = np.array([2, 0, 1], np.int64)
    got = _slot_table("run_slots", slot, N, 4, None)
    assert got.tolist() == [2, 0, 1] and not np.shares_memory(got, slot)


def test_lengths_changed_after_a_call_do_not_reach_its_results():
    """What the call returns is the computation of the lengths it was given (a float64 NumPy
    reference of the same stack, per sample, is the oracle)."""
    m = leanrnn.GRU(C, H, bidirectional=True, seed=1)
    x = np.random.default_rng(0).standard_normal((T, N, C)).astype(np.float32)
    lengths = np.array([5, 2, 4], np.int64)
    y, h = m(x, lengths=lengths)
    lengths[:] = 1  # (a no-op for the call that ran: it must have copied)
    for n, L in enumerate([5, 2, 4]):
        yn, hn = m(np.ascontiguousarray(x[:L, n : n + 1]))
        np.testing.assert_allclose(y[:L, n], yn[:, 0], atol=1e-6, rtol=0)
        np.testing.assert_allclose(h[:, n], hn[:, 0], atol=1e-6, rtol=0)


def _unaligned(a: np.ndarray) -> np.ndarray:
    u = np.frombuffer(b"\0" + a.tobytes(), a.dtype, offset=1).reshape(a.shape)
    assert u.flags.c_contiguous and not u.flags.aligned
    return u


@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_the_trainer_takes_unaligned_x_and_dy(cell):
    rng = np.random.default_rng(2)
    x = rng.standard_normal((T, N, C)).astype(np.float32)
    dy = rng.standard_normal((T, N, H)).astype(np.float32)
    make = leanrnn.LSTM if cell == "lstm" else leanrnn.GRU
    ref, tr = Trainer(make(C, H, seed=0)), Trainer(make(C, H, seed=0))
    tape = ref.forward(x)
    want_dx = ref.backward(tape, dy)[0]
    tape = tr.forward(_unaligned(x))  # (numba's bare TypeError before)
    np.testing.assert_array_equal(tape.y, ref.forward(x).y)
    dx = tr.backward(tape, _unaligned(dy))[0]
    np.testing.assert_array_equal(dx, want_dx)
    np.testing.assert_array_equal(tr.grad.buffer, ref.grad.buffer)


def _run(opt_cls, toggles, steps, state_at=None, **kw):
    """Weights after ``steps`` SGD/Adam steps on fixed gradients of one parameter, with
    ``toggles[k]`` (attribute, value) set before step k; with ``state_at``, the optimizer is
    rebuilt from its state_dict (and the weights) after that many steps, as a resume does."""
    rng = np.random.default_rng(3)
    w = np.linspace(-1, 1, 8).reshape(2, 4)
    grads = [rng.standard_normal(w.shape) for _ in range(steps)]
    p = leanrnn.train.Parameter(w.copy(), np.zeros_like(w))
    opt = opt_cls([p], **kw)
    for k in range(steps):
        for name, v in toggles.get(k, ()):
            setattr(opt, name, v)
        if k == state_at:
            saved = opt.state_dict()
            p = leanrnn.train.Parameter(p.value.copy(), np.zeros_like(w))
            opt = opt_cls([p], **kw)
            opt.load_state_dict(saved)
        p.grad[:] = grads[k]
        opt.step()
    return p.value


@pytest.mark.parametrize(
    "opt_cls, kw, toggles",
    [
        (SGD, {"lr": 0.1, "momentum": 0.9}, {2: [("momentum", 0.0)], 4: [("momentum", 0.9)]}),
        (Adam, {"lr": 0.1}, {3: [("amsgrad", True)]}),
    ],
)
def test_a_resumed_run_equals_the_one_that_went_on_after_settings_changed(opt_cls, kw, toggles):
    """state_dict kept only what the current settings use: the momentum buffer saved while
    momentum was 0, or everything of an Adam whose amsgrad was just switched on, was lost."""
    whole = _run(opt_cls, toggles, 7, **kw)
    for at in (3, 4, 5):
        np.testing.assert_array_equal(_run(opt_cls, toggles, 7, state_at=at, **kw), whole)


def test_sgd_keeps_its_momentum_buffer_through_momentum_0_as_torch_does():
    torch = pytest.importorskip("torch")
    toggles = {2: [("momentum", 0.0)], 4: [("momentum", 0.9)]}
    ours = _run(SGD, toggles, 7, lr=0.1, momentum=0.9)
    rng = np.random.default_rng(3)
    w = torch.nn.Parameter(torch.linspace(-1, 1, 8, dtype=torch.float64).reshape(2, 4))
    grads = [rng.standard_normal((2, 4)) for _ in range(7)]
    opt = torch.optim.SGD([w], lr=0.1, momentum=0.9)
    for k in range(7):
        for name, v in toggles.get(k, ()):
            opt.param_groups[0][name] = v
        w.grad = torch.from_numpy(grads[k])
        opt.step()
    np.testing.assert_allclose(ours, w.detach().numpy(), atol=1e-14, rtol=0)


def test_torch_parameter_groups_are_told_to_use_one_optimizer_each():
    tr = Trainer(leanrnn.LSTM(C, H, seed=0))
    params = tr.parameters()
    with pytest.raises(LeanRNNError, match=r"parameter group.*one optimizer per group"):
        Adam([{"params": params[:2]}, {"params": params[2:], "weight_decay": 0.0}])


def test_a_gemm_calibration_with_blas_on_several_threads_is_not_kept(monkeypatch, tmp_path):
    """A build's wisdom read BLAS at 202 GFLOP/s "on one thread" (over this core's 118 peak:
    BLAS ran on two) and chose it for training's products for as long as the build lived. A
    measurement whose BLAS is not on one thread is not trusted (the native path) nor kept."""
    import contextlib

    from leanrnn import threads
    from leanrnn.engine import products

    monkeypatch.setattr(threads, "blas_alone", contextlib.nullcontext)  # (as if it failed)
    monkeypatch.setattr(threads, "blas_threads", lambda: 2)
    monkeypatch.setattr(products, "_wisdom_path", lambda: tmp_path / "wisdom.json")
    got = products._measure_and_remember()
    assert got["choice"] == "native" and got["untrusted"]
    assert not (tmp_path / "wisdom.json").exists()
    monkeypatch.setattr(threads, "blas_threads", lambda: 1)  # one thread: measured and kept
    got = products._measure_and_remember()
    assert "untrusted" not in got and (tmp_path / "wisdom.json").exists()


def test_blas_threads_reads_what_blas_alone_sets():
    from leanrnn import threads

    if threads.blas_controller() is None or not any(
        i["user_api"] == "blas" for i in threads.blas_controller().info()
    ):
        pytest.skip("no BLAS threadpoolctl can see")
    with threads.blas_alone():
        assert threads.blas_threads() == 1


def test_a_copied_trainer_runs_the_backward_of_a_copied_tape_after_steps():
    """PackedWeights' copies dropped their generation: a (trainer, tape) copy taken after the
    first optimizer step took its own weights for another writer's and refused the tape."""
    import copy

    rng = np.random.default_rng(5)
    x = rng.standard_normal((T, N, C)).astype(np.float32)
    dy = rng.standard_normal((T, N, H)).astype(np.float32)
    tr = Trainer(leanrnn.LSTM(C, H, seed=0))
    opt = SGD(tr.parameters(), lr=0.1)
    for _ in range(2):
        tr.zero_grad()
        tr.backward(tr.forward(x), dy)
        opt.step()
    tr.zero_grad()
    tape = tr.forward(x)
    tr2, tape2 = copy.deepcopy((tr, tape))
    dx2 = tr2.backward(tape2, dy)[0]
    np.testing.assert_array_equal(dx2, tr.backward(tape, dy)[0])
    np.testing.assert_array_equal(tr2.grad.buffer, tr.grad.buffer)


def test_processes_choosing_the_gemm_together_take_one_answer(monkeypatch, tmp_path):
    """Four processes started together on a new cache each measured on shared cores, and one
    chose BLAS where three chose the tile (their gradients differed in the last bits). The
    measurement is taken under a lock between processes; who waited reads its answer."""
    import fcntl
    import json
    import threading

    from leanrnn.engine import products

    monkeypatch.setattr(products, "_wisdom_path", lambda: tmp_path / "wisdom.json")
    calls = []
    monkeypatch.setattr(products, "calibrate",
                        lambda rounds=5: calls.append(1) or {"choice": "native",
                                                             "native_gflops": 1.0,
                                                             "blas_gflops": 1.0})  # fmt: skip
    other = open(tmp_path / "wisdom.lock", "a")  # another process measuring: it holds the lock
    fcntl.flock(other, fcntl.LOCK_EX)
    got = {}
    t = threading.Thread(target=lambda: got.update(products._measure_and_remember()))
    t.start()
    t.join(0.5)
    assert t.is_alive()  # waiting for the other's measurement
    theirs = {"choice": "blas", "native_gflops": 1.0, "blas_gflops": 2.0}
    (tmp_path / "wisdom.json").write_text(json.dumps({"gemm": theirs, "rule": products._RULE}))
    other.close()  # (releases it)
    t.join(10)
    assert got == theirs and not calls  # its answer, not a measurement of its own
