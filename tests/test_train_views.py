"""Trainer._memory makes the views of an arena once per step shape: later steps reuse them
(the same gradients, no arena.view call), a copy of the trainer gets views of its own arenas,
and the views go with their arena (they hold its buffer)."""

from __future__ import annotations

import copy
import gc
import pickle

import numpy as np

import leanrnn
from leanrnn.memory.arena import Arena
from leanrnn.train import SGD, Trainer

T, N, C, H = 5, 3, 4, 6


def _data():
    g = np.random.default_rng(0)
    x = g.standard_normal((T, N, C)).astype(np.float32)
    dy = g.standard_normal((T, N, H)).astype(np.float32)
    return x, dy


def _grads(tr, x, dy, own=False):
    """One step: its tape's views of the x-projection buffer, dx, the weight gradients."""
    tr.zero_grad()
    tape = tr.forward(x, own_memory=own)
    xw = tape._saved["mem"]["xw.0"]
    dx, _, _ = tr.backward(tape, dy)
    if own:
        tr.release(tape)  # as leanrnn.torch does: the next own-memory step reuses the arena
    return xw, dx, tr.grad.buffer.copy()


def test_steps_of_one_shape_reuse_the_views(monkeypatch):
    tr = Trainer(leanrnn.LSTM(C, H, num_layers=2, seed=0))
    x, dy = _data()
    _, dx0, g0 = _grads(tr, x, dy)
    _, dx0_own, g0_own = _grads(tr, x, dy, own=True)
    made = []
    real = Arena.view
    monkeypatch.setattr(Arena, "view", lambda self, *a: made.append(a) or real(self, *a))
    for own in (False, True, False):
        _, dx, g = _grads(tr, x, dy, own=own)
        assert np.array_equal(dx, dx0_own if own else dx0)
        assert np.array_equal(g, g0_own if own else g0)
    assert made == []


def test_a_copied_trainer_has_views_of_its_own_arena():
    tr = Trainer(leanrnn.GRU(C, H, seed=0))
    x, dy = _data()
    mine, dx0, _ = _grads(tr, x, dy)
    for other in (copy.deepcopy(tr), pickle.loads(pickle.dumps(tr))):
        xw, dx, _ = _grads(other, x, dy)
        assert not np.shares_memory(xw, mine)
        assert np.array_equal(dx, dx0)
        _, dx_again, _ = _grads(tr, x, dy)  # the original unaffected
        assert np.array_equal(dx_again, dx0)


def test_a_copied_trainer_trains_like_the_original():
    """Its parameters view its own weights and gradients: a copy's came back detached (pickled
    by value), so backward wrote gradients its optimizer never read and the update changed
    arrays no forward read: the loss never moved, with no error."""
    x = np.random.default_rng(0).standard_normal((6, 3, C)).astype(np.float32)
    outputs = []
    for copied in (lambda t: t, copy.deepcopy, lambda t: pickle.loads(pickle.dumps(t))):
        tr = copied(Trainer(leanrnn.LSTM(C, H, num_layers=2, seed=0)))
        params = tr.parameters()
        opt = SGD(params, lr=0.5)
        for p in params:
            assert np.shares_memory(p.value, tr.weights.buffer)
            assert np.shares_memory(p.grad, tr.grad.buffer)
        tape = tr.forward(x)
        tr.backward(tape, np.ones_like(tape.y), input_grad=False)
        assert sum(float((p.grad**2).sum()) for p in params) > 0
        opt.step()
        outputs.append(tr.forward(x).y.copy())
    y0 = Trainer(leanrnn.LSTM(C, H, num_layers=2, seed=0)).forward(x).y
    assert not np.allclose(outputs[0], y0)  # the step changed the model
    for y in outputs[1:]:
        assert np.array_equal(y, outputs[0])


def test_views_do_not_keep_released_arenas_alive():
    tr = Trainer(leanrnn.LSTM(C, H, seed=0))
    x, dy = _data()
    tapes = [tr.forward(x, own_memory=True) for _ in range(5)]  # five arenas
    for t in tapes:
        tr.release(t)  # two kept as spares, three dropped
    del tapes, t
    gc.collect()
    live = {id(a) for a in tr._spare} | ({id(tr._arena)} if tr._arena is not None else set())
    assert {id(a) for a in tr._views.keys()} <= live
