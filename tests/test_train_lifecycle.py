"""The Trainer's life cycle around its steps: what inference sees right after an optimizer
step, how memory_limit picks a segment, and which tapes stay valid across other forwards.
Each test failed before its fix (found by a review of the training code)."""

from __future__ import annotations

import numpy as np
import pytest

import leanrnn
from leanrnn.errors import ShapeError
from leanrnn.train import SGD, TapeError, Trainer

RNG = np.random.default_rng(0)


def _x(*shape):
    return RNG.standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
def test_inference_and_save_right_after_an_optimizer_step_use_the_new_biases(cell, tmp_path):
    """The oracle: a model rebuilt from the trained model's own state_dict (packed afresh)."""
    model = getattr(leanrnn, cell)(4, 8, seed=0)
    tr = Trainer(model)
    opt = SGD(tr.parameters(), lr=0.5)
    x = _x(5, 2, 4)
    for _ in range(2):
        tape = tr.forward(x)
        tr.backward(tape, np.ones_like(tape.y), input_grad=False)
        opt.step()
        tr.zero_grad()
    want = type(model).from_state_dict(model.state_dict()).forward(x)[0]
    np.testing.assert_array_equal(model.forward(x)[0], want)
    model.save(tmp_path / "m.lrnn")
    np.testing.assert_array_equal(leanrnn.load(tmp_path / "m.lrnn").forward(x)[0], want)


def test_memory_limit_finds_the_segments_that_fit_below_sqrt_t():
    """Bytes per segment length S fall and then rise; where the minimum lies depends on the
    shapes (here S=5, not round(sqrt(T)) = 10). A limit between the two must be met."""
    model = leanrnn.LSTM(64, 128, num_layers=2, seed=0)
    N, T = 32, 100
    need = {S: Trainer(model)._need(N, T, S, S < T) for S in range(1, T + 1)}  # every S
    lowest = min(need.values())
    assert need[10] > lowest  # the case this test is about
    limit = (lowest + need[10]) // 2
    tr = Trainer(model, memory_limit=limit)
    S = tr.plan(N, T)["segment"]
    assert need[S] <= limit
    assert S == max(s for s in need if need[s] <= limit)  # the longest that fits
    tape = tr.forward(_x(T, N, 64))
    tr.backward(tape, np.ones_like(tape.y))


def _grads(tr):
    return np.concatenate([p.grad.ravel() for p in tr.parameters()])


def test_a_refused_forward_leaves_the_live_tape_intact():
    def grads(refuse: bool):
        model = leanrnn.LSTM(4, 8, num_layers=2, batch_first=True, seed=0)
        tr = Trainer(model)
        x = np.random.default_rng(1).standard_normal((2, 5, 4)).astype(np.float32)
        tape = tr.forward(x)
        if refuse:  # batch-first x is staged into the arena; the masks are then refused
            with pytest.raises(ShapeError):
                tr.forward(x + 3, masks=[np.ones((10, 8), np.float32)])
        tr.backward(tape, np.ones_like(tape.y))
        return _grads(tr)

    np.testing.assert_array_equal(grads(True), grads(False))


def test_an_own_memory_forward_does_not_stale_the_tape_in_the_arena():
    tr = Trainer(leanrnn.LSTM(4, 8, seed=0))
    x = _x(5, 2, 4)
    shared = tr.forward(x)
    own = tr.forward(x + 1, own_memory=True)
    tr.backward(own, np.ones_like(own.y))
    tr.backward(shared, np.ones_like(shared.y))  # refused before the fix
    # a second forward in the arena still stales the first
    a = tr.forward(x)
    tr.forward(x)
    with pytest.raises(TapeError):
        tr.backward(a, np.ones_like(a.y))


# ---------------------------------------------------------------------- leanrnn.torch
def test_torch_module_refuses_backward_after_x_changed_in_place_as_torch_does():
    torch = pytest.importorskip("torch")
    lt = pytest.importorskip("leanrnn.torch")
    for module in (torch.nn.LSTM(3, 4), lt.LSTM(3, 4)):
        x = torch.randn(5, 2, 3)
        y, _ = module(x)
        x.add_(1)  # the tape reads x in place
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            y.sum().backward()


def test_torch_module_used_by_two_threads_at_once_gives_each_its_own_results():
    """Oracle: the same calls one after another. Two threads share one module's trainer
    (arena, sync array, gradient buffer); before the fix most results came out wrong."""
    torch = pytest.importorskip("torch")
    lt = pytest.importorskip("leanrnn.torch")
    import threading

    torch.manual_seed(0)
    m = lt.LSTM(8, 32, num_layers=2)
    xs = [torch.randn(12, 6, 8, generator=torch.Generator().manual_seed(i)) for i in range(2)]

    def grads(x):
        y, _ = m(x)
        g = torch.autograd.grad((y * y).sum(), list(m.parameters()))
        return [y.detach().clone(), *(t.detach().clone() for t in g)]

    want = [grads(x) for x in xs]
    got: list[list] = [[], []]

    def work(i):
        for _ in range(8):
            got[i].append(grads(xs[i]))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for i in range(2):
        assert len(got[i]) == 8
        for res in got[i]:
            for a, b in zip(res, want[i], strict=True):
                torch.testing.assert_close(a, b, rtol=0, atol=0)
