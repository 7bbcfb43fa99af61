"""Hardening, tenth pass: the numpy-only optimizers against torch.optim (a red team's
comparison). Each test failed before its fix."""

from __future__ import annotations

import numpy as np
import pytest

import leanrnn
from leanrnn.errors import ShapeError
from leanrnn.train import SGD, Adam, AdamW, Trainer

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("make", [lambda p: SGD(p, lr=0.1, momentum=0.9, weight_decay=0.01),
                                  lambda p: Adam(p, lr=0.01), lambda p: AdamW(p, lr=0.01)],
                         ids=["sgd", "adam", "adamw"])  # fmt: skip
def test_a_step_with_no_backward_since_zero_grad_leaves_the_weights(make):
    """torch's zero_grad sets gradients to None and its step skips such parameters; leanrnn's
    zeroed gradients still took a step of momentum and weight decay (SGD moved a weight by
    0.59, Adam by 6.7e-3, and Adam's step count advanced)."""
    m = leanrnn.LSTM(3, 4, seed=0)
    tr = Trainer(m)
    opt = make(tr.parameters())
    x = np.random.default_rng(0).standard_normal((5, 2, 3)).astype(np.float32)
    for _ in range(2):  # some state: momentum, moments
        opt.zero_grad()
        tape = tr.forward(x)
        tr.backward(tape, np.ones_like(tape.y))
        opt.step()
    before = [p.value.copy() for p in tr.parameters()]
    state = opt.state_dict()
    opt.zero_grad()
    opt.step()  # a skipped batch: nothing moves, as with torch
    for b, p in zip(before, tr.parameters(), strict=True):
        np.testing.assert_array_equal(p.value, b)
    after = opt.state_dict()
    assert repr(after["state"]) == repr(state["state"])
    tr.zero_grad()  # the trainer's own zero_grad too
    opt.step()
    for b, p in zip(before, tr.parameters(), strict=True):
        np.testing.assert_array_equal(p.value, b)
    tape = tr.forward(x)  # and a backward makes them step again
    tr.backward(tape, np.ones_like(tape.y))
    opt.step()
    assert any(not np.array_equal(p.value, b) for b, p in zip(before, tr.parameters(), strict=True))


def test_torch_optimizer_state_for_a_trainer_is_refused_by_name():
    """torch's Adam state for a trainer's parameters failed with the packed shape as the only
    clue ('has shape (28, 5); expected (1, 16, 64)')."""
    m = leanrnn.LSTM(5, 7, seed=0)
    tr = Trainer(m)
    t = torch.nn.LSTM(5, 7)
    topt = torch.optim.Adam(t.parameters())
    t(torch.ones(2, 1, 5))[0].sum().backward()
    topt.step()
    opt = Adam(tr.parameters())
    sd = topt.state_dict()
    with pytest.raises(ShapeError, match="torch's layout"):
        opt.load_state_dict({"state": {i: {k: v.numpy() if hasattr(v, "numpy") else v
                                           for k, v in s.items()} for i, s in sd["state"].items()},
                             "param_groups": sd["param_groups"]})  # fmt: skip
