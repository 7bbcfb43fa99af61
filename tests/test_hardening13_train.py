"""Session 39: the numpy-only training workflow used over a whole project (a red-team pass);
every case failed before its fix. Oracles: a fresh Trainer on the same weights, torch.optim."""

from __future__ import annotations

import numpy as np
import pytest

import leanrnn
from leanrnn.train import SGD, Adam, AdamW, Trainer
from leanrnn.train.session import TapeError

F32 = np.float32


def _x(seed=0, shape=(6, 3, 4), dtype=F32):
    return np.random.default_rng(seed).standard_normal(shape).astype(dtype)


def _step(tr, x):
    t = tr.forward(x)
    return t, tr.backward(t, np.ones_like(t.y))


@pytest.mark.parametrize("autocast", [None, "bf16"])
def test_second_trainer_over_one_model_sees_the_first_ones_steps(autocast):
    """Two Trainers over one model share its packed weights. Steps through A left B on its
    old dense copies (backward) and bf16 rounding (forward): B's gradients were 0.25 off a
    fresh trainer's, and under autocast its outputs 1.36 off."""
    m = leanrnn.LSTM(4, 5, seed=0)
    x = _x()
    A, B = Trainer(m), Trainer(m, autocast=autocast)
    _step(B, x)  # B has derived its copies from the first weights
    opt = SGD(A.parameters(), lr=0.5)
    for _ in range(3):
        A.zero_grad()
        _step(A, x)
        opt.step()
    fresh = Trainer(leanrnn.from_state_dict(m.state_dict()), autocast=autocast)
    B.zero_grad()
    tb, (dxb, dhb, dcb) = _step(B, x)
    tf, (dxf, dhf, dcf) = _step(fresh, x)
    np.testing.assert_array_equal(tb.y, tf.y)
    np.testing.assert_array_equal(dxb, dxf)
    np.testing.assert_array_equal(B.grad.buffer, fresh.grad.buffer)


def test_a_tape_taken_before_another_trainers_step_is_refused():
    """torch refuses a backward through weights changed in place since the forward."""
    m = leanrnn.GRU(4, 5, seed=0)
    x = _x(1)
    A, B = Trainer(m), Trainer(m)
    tape = B.forward(x)
    _step(A, x)
    SGD(A.parameters(), lr=0.1).step()
    with pytest.raises(TapeError, match="weights changed"):
        B.backward(tape, np.ones_like(tape.y))


@pytest.mark.parametrize("cls", [Adam, AdamW])
def test_adam_eps_zero_keeps_the_padding_and_the_model_finite(cls):
    """eps=0 (torch accepts it): 0/0 wrote NaN into every padding entry on the first step,
    and the next forward spread it to every weight. Against torch.optim step by step."""
    torch = pytest.importorskip("torch")
    tm = torch.nn.LSTM(4, 5).double()
    m = leanrnn.from_state_dict({k: v.detach().numpy() for k, v in tm.state_dict().items()})
    tr = Trainer(m)
    opt = cls(tr.parameters(), lr=1e-2, eps=0.0)
    topt = getattr(torch.optim, cls.__name__)(tm.parameters(), lr=1e-2, eps=0.0)
    x = _x(2, dtype=np.float64)
    for _ in range(3):
        tr.zero_grad()
        _step(tr, x)
        opt.step()
        topt.zero_grad()
        tm(torch.from_numpy(x))[0].sum().backward()
        topt.step()
    for p in tr.parameters():
        assert np.isfinite(p.value).all()
    for k, v in tm.state_dict().items():
        np.testing.assert_allclose(m.state_dict()[k], v.numpy(), rtol=1e-12, atol=1e-14)


def test_assigning_a_trainers_parameter_grad_copies_into_its_buffer_and_steps():
    """A replaced grad array never saw a gradient (backward writes the trainer's buffer) and
    every step moved the weights by 0, silently. Assigning now copies into the buffer, and the
    step uses it, also right after zero_grad (torch's p.grad = g after a None grad)."""
    tr = Trainer(leanrnn.GRU(4, 5, seed=0))
    p = tr.parameters()[0]
    tr.zero_grad()
    g = np.random.default_rng(0).standard_normal(p.shape).astype(p.dtype)
    p.grad = g
    assert np.shares_memory(p.grad, tr.grad.buffer)
    np.testing.assert_array_equal(p.grad, g)
    before = p.value.copy()
    SGD([p], lr=0.5).step()
    np.testing.assert_allclose(p.value, before - 0.5 * g, rtol=1e-6)
    with pytest.raises(leanrnn.errors.ShapeError):
        p.grad = np.zeros(3, p.dtype)
    _step(tr, _x())  # backward still accumulates into the same buffer
    assert np.shares_memory(p.grad, tr.grad.buffer) and np.abs(p.grad).sum() > 0


def _twins(make_torch):
    """A float64 torch module and leanrnn's copy of it, a Trainer over the copy, and SGD with
    momentum and weight decay on each side (what a skipped or zero step changes)."""
    torch = pytest.importorskip("torch")
    tm = make_torch(torch).double()
    m = leanrnn.from_state_dict({k: v.detach().numpy() for k, v in tm.state_dict().items()})
    tr = Trainer(m)
    opt = SGD(tr.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    topt = torch.optim.SGD(tm.parameters(), lr=0.1, momentum=0.9, weight_decay=0.1)
    return torch, tm, m, tr, opt, topt


def _same_weights(tm, m):
    for k, v in tm.state_dict().items():
        np.testing.assert_allclose(m.state_dict()[k], v.numpy(), rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("case", ["fresh", "zero_grad twice"])
def test_parameters_without_a_gradient_are_skipped_as_torch(case):
    """torch skips a parameter whose grad is None: before any backward, and after
    zero_grad() then zero_grad(set_to_none=False) (None stays None). leanrnn applied weight
    decay and momentum to zeros in both (0.0044 and 1.83 off torch)."""
    torch, tm, m, tr, opt, topt = _twins(lambda torch: torch.nn.GRU(4, 5))
    if case == "zero_grad twice":
        x = _x(4, dtype=np.float64)
        _step(tr, x)
        opt.step()
        tm(torch.from_numpy(x))[0].sum().backward()
        topt.step()
        opt.zero_grad()
        opt.zero_grad(set_to_none=False)
        topt.zero_grad()
        topt.zero_grad(set_to_none=False)
    opt.step()
    topt.step()
    _same_weights(tm, m)


def test_trainer_zero_grad_checks_its_argument_before_zeroing():
    tr = Trainer(leanrnn.GRU(4, 5, seed=0))
    _step(tr, _x())
    kept = tr.grad.buffer.copy()
    with pytest.raises(leanrnn.errors.SpecError):
        tr.zero_grad(set_to_none="yes")
    np.testing.assert_array_equal(tr.grad.buffer, kept)


@pytest.mark.parametrize("how", ["optimizer", "trainer"])
def test_zero_grad_set_to_none_false_steps_on_the_zeros_as_torch(how):
    """torch's zero_grad(set_to_none=False) keeps zero gradients, and the next step applies
    momentum and weight decay to them; leanrnn skipped the parameters either way (0.43 off)."""
    torch, tm, m, tr, opt, topt = _twins(lambda torch: torch.nn.RNN(4, 5))
    x = _x(3, dtype=np.float64)
    _step(tr, x)
    opt.step()
    tm(torch.from_numpy(x))[0].sum().backward()
    topt.step()
    (opt if how == "optimizer" else tr).zero_grad(set_to_none=False)
    topt.zero_grad(set_to_none=False)
    opt.step()  # on the zeros
    topt.step()
    _same_weights(tm, m)


@pytest.mark.parametrize(
    "make, autocast",
    [
        (lambda: leanrnn.LSTM(12, 40, num_layers=2, proj_size=17, seed=0), None),
        (lambda: leanrnn.GRU(12, 64, bidirectional=True, seed=0), None),
        (lambda: leanrnn.RNN(12, 33, num_layers=3, seed=0), None),
        (lambda: leanrnn.LSTM(12, 64, num_layers=2, bidirectional=True, seed=0), "bf16"),
    ],
)
def test_plan_counts_backwards_dense_copies_of_the_weights(make, autocast):
    """plan and memory_limit left out what backward derives from the weights (dense W and R,
    R's column panels, W packed for the GEMM, the bf16 rounding): 35.9 MiB beyond a planned
    4 MiB at H=512. The figure is the bytes a step then holds, exactly."""
    tr = Trainer(make(), autocast=autocast)
    planned = tr.plan(3, 5)
    t = tr.forward(_x(shape=(5, 3, 12)))
    tr.backward(t, np.ones_like(t.y))
    made = 0
    for row in tr._dense_for(autocast):
        for item in row:
            for a in item:
                if a is not None:
                    made += a.W.nbytes + a.b.nbytes if hasattr(a, "W") else a.nbytes
    if autocast:
        made += tr._bf16.nbytes
    assert planned["dense_weight_bytes"] == made
    assert planned["total_bytes"] >= planned["arena_bytes"] + made


@pytest.mark.parametrize("batch_first", [False, True])
def test_a_steps_memory_stays_within_its_plan(batch_first):
    """What a training step takes beyond its inputs and outputs (traced: numpy's arrays) is at
    most what plan() says, which memory_limit is held to: batch-first steps keep time-major
    copies of y, dy and dx that the plan left out (2.2x a limit)."""
    import tracemalloc

    N, T, C = 8, 300, 16
    m = leanrnn.LSTM(C, 32, num_layers=2, seed=0, batch_first=batch_first)
    tr = Trainer(m)
    shape = (N, T, C) if batch_first else (T, N, C)
    x = np.random.default_rng(0).standard_normal(shape).astype(F32)
    dy = np.ones((*shape[:2], 32), F32)
    planned = tr.plan(N, T)["total_bytes"]
    warm = Trainer(leanrnn.LSTM(C, 32, num_layers=2, seed=1, batch_first=batch_first))
    w = warm.forward(x[:2, :2].copy())  # (what a first step imports is not the step's memory)
    warm.backward(w, dy[:2, :2].copy())
    tracemalloc.start()
    t = tr.forward(x)
    dx, _, _ = tr.backward(t, dy)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    beyond = peak - t.y.nbytes - dx.nbytes - t.h_n.nbytes - t.c_n.nbytes
    assert beyond <= planned + (256 << 10), (beyond, planned)
