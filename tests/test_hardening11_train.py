"""Session 37: the numpy-only optimizers take torch.optim's idioms that training loops are
written in: ``param_groups`` (hand-written learning-rate schedules), ``step(closure)`` and
``zero_grad(set_to_none=...)``. Each failed before (AttributeError / TypeError)."""

import numpy as np
import pytest

from leanrnn.errors import SpecError
from leanrnn.train.optim import SGD, Adam, AdamW, Parameter

try:
    import torch
except ImportError:  # the numpy-only tests still run
    torch = None

needs_torch = pytest.mark.skipif(torch is None, reason="torch is not installed")
OURS = {"SGD": SGD, "Adam": Adam, "AdamW": AdamW}


def _pair(name, rng, **cfg):
    values = [rng.standard_normal(s) for s in [(5,), (3, 4)]]
    ours = [Parameter(v.copy(), name=f"p{i}") for i, v in enumerate(values)]
    theirs = [torch.nn.Parameter(torch.from_numpy(v.copy())) for v in values]
    return (ours, OURS[name](ours, lr=0.1, **cfg),
            theirs, getattr(torch.optim, name)(theirs, lr=0.1, foreach=False, **cfg))  # fmt: skip


@pytest.mark.torch
@needs_torch
@pytest.mark.parametrize("name", ["SGD", "Adam", "AdamW"])
def test_schedule_through_param_groups_matches_torch_scheduler(name, rng):
    """A step schedule written against param_groups, as torch users write one, follows
    torch's own StepLR over the same steps."""
    cfg = {"momentum": 0.9} if name == "SGD" else {}
    ours, opt, theirs, topt = _pair(name, rng, **cfg)
    sched = torch.optim.lr_scheduler.StepLR(topt, step_size=3, gamma=0.5)
    for step in range(10):
        for p, t in zip(ours, theirs, strict=True):
            g = rng.standard_normal(p.shape)
            p.grad[...] = g
            t.grad = torch.from_numpy(g.copy())
        opt.step()
        topt.step()
        sched.step()
        for group in opt.param_groups:  # the hand-written StepLR
            if (step + 1) % 3 == 0:
                group["lr"] *= 0.5
        assert opt.param_groups[0]["lr"] == topt.param_groups[0]["lr"] == opt.lr
        for p, t in zip(ours, theirs, strict=True):
            np.testing.assert_allclose(p.value, t.detach().numpy(), rtol=1e-12, atol=1e-14)


def test_param_groups_reads_and_checks_like_attributes(rng):
    p = Parameter(rng.standard_normal(4), name="w")
    opt = SGD([p], lr=0.1, momentum=0.9, nesterov=True)
    (group,) = opt.param_groups
    assert group["params"] == [p] and group["momentum"] == 0.9 and len(group) == len(dict(group))
    with pytest.raises(SpecError, match=r"lr=-1"):
        group["lr"] = -1
    assert opt.lr == 0.1  # refused: unchanged
    with pytest.raises(SpecError, match=r"cannot set \['betas'\]"):
        group["betas"] = (0.9, 0.99)
    with pytest.raises(SpecError, match="dampening"):
        group["dampening"] = 0.1  # one at a time: nesterov would need dampening 0
    group.update(nesterov=False, dampening=0.1)  # together: checked together
    assert (opt.nesterov, opt.dampening) == (False, 0.1)
    with pytest.raises(SpecError, match="cannot delete"):
        del group["lr"]


def test_step_closure_and_set_to_none(rng):
    p = Parameter(np.zeros(3), name="w")
    opt = Adam([p], lr=0.5)
    calls = []

    def closure():
        calls.append(1)
        p.grad[...] = [1.0, -1.0, 2.0]
        return 42.0

    assert opt.step(closure) == 42.0 and calls == [1]
    np.testing.assert_allclose(p.value, [-0.5, 0.5, -0.5])  # Adam's first step: -lr * sign(g)
    assert opt.step() is None
    opt.zero_grad(set_to_none=False)
    assert not p.grad.any()
    opt.zero_grad(set_to_none=True)
    with pytest.raises(SpecError, match="set_to_none"):
        opt.zero_grad(set_to_none="yes")
    with pytest.raises(SpecError, match="closure"):
        opt.step(3)


@pytest.mark.torch
@needs_torch
def test_compiled_weight_gradients_when_backward_needs_x_y_and_the_masks():
    """Under torch.compile (inductor), backward read x, y and the dropout masks in place while
    the compiled graph had freed them after the forward and reused their buffers (for 2*y, the
    gradient of y.pow(2), say): weight gradients off by 100% with the right loss. Three ways
    at once: x computed in the graph, a loss whose backward needs y, dropout between layers."""
    import leanrnn.torch as lt

    dt = torch.float64

    class Net(torch.nn.Module):
        def __init__(self, rnn):
            super().__init__()
            torch.manual_seed(1)
            self.pre = torch.nn.Linear(4, 4, dtype=dt)
            self.rnn = rnn

        def forward(self, inp):
            y, _ = self.rnn(torch.relu(self.pre(inp)))
            return y.pow(2).sum() + (torch.sigmoid(y) * y.flip(0)).sum()

    torch.manual_seed(0)
    ref = torch.nn.LSTM(4, 8, num_layers=2, dropout=0.5, dtype=dt)
    a, b = Net(ref), Net(lt.from_module(ref))
    inp = torch.randn(6, 3, 4, dtype=dt)
    torch._dynamo.reset()
    torch.manual_seed(5)
    la = a(inp)
    la.backward()
    torch.manual_seed(5)
    lb = torch.compile(b)(inp)
    lb.backward()
    assert abs(la.item() - lb.item()) < 1e-10
    for (name, p), q in zip(a.named_parameters(), b.parameters(), strict=True):
        np.testing.assert_allclose(q.grad.numpy(), p.grad.numpy(), rtol=1e-9, atol=1e-12,
                                   err_msg=name)  # fmt: skip
