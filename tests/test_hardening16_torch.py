"""Session 42, from a red-team pass over leanrnn.torch's module semantics: under saved-tensor
hooks that copy (save_on_cpu), a tape lived as long as its graph (a loop keeping each step's
loss grew by a tape a step), and under torch.utils.checkpoint every tape was kept from the
forward to the backward (checkpointing saved nothing); torch.jit.script failed deep in forward
with TorchScript's own message; torch's `_flat_weights` was missing. Each test failed before."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
lt = pytest.importorskip("leanrnn.torch")

from torch.utils.checkpoint import checkpoint  # noqa: E402


def _pair(**kw):
    torch.manual_seed(0)
    ref = torch.nn.LSTM(3, 4, dtype=torch.float64, **kw)
    return ref, lt.from_module(ref)


def _grads(m):
    return [p.grad.clone() for p in m.parameters()]


def test_copying_hooks_free_the_tape_after_backward_while_the_loss_lives():
    ref, mine = _pair(num_layers=2)
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    before = set(lt._TAPES)
    kept = []
    for _ in range(3):
        with torch.autograd.graph.save_on_cpu():
            y, _ = mine(x)
        loss = (y**2).sum()
        loss.backward()
        kept.append(loss)  # the graph lives on; its saved tensors do not, nor the tape
    assert set(lt._TAPES) == before  # was 3 tapes alive, one per kept loss
    # a retained graph keeps the tape for the next backward, then lets it go
    for m in (ref, mine):
        m.zero_grad()
        with torch.autograd.graph.save_on_cpu():
            y, _ = m(x)
        loss = (y**2).sum()
        loss.backward(retain_graph=True)
        loss.backward()
    assert set(lt._TAPES) == before
    for a, b in zip(_grads(ref), _grads(mine), strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def test_checkpoint_keeps_no_tape_between_forward_and_backward():
    ref, mine = _pair()
    x = torch.randn(6, 2, 3, dtype=torch.float64, requires_grad=True)
    before = set(lt._TAPES)
    outs = []
    for m in (ref, mine):
        m.zero_grad()
        h = x
        for _ in range(3):  # three checkpointed calls of one module, as a stack of blocks
            h = checkpoint(lambda a, m=m: m(a)[0][..., :3], h, use_reentrant=False)
        if m is mine:
            assert set(lt._TAPES) == before  # was 3 tapes: the forward's, all kept
        (h**2).sum().backward()
        outs.append((_grads(m), x.grad.clone()))
        x.grad = None
    assert set(lt._TAPES) == before
    (ga, dxa), (gb, dxb) = outs
    torch.testing.assert_close(dxb, dxa, rtol=1e-10, atol=1e-12)
    for a, b in zip(ga, gb, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def test_jit_script_is_refused_with_the_ways_that_work():
    class Model(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.rnn = lt.LSTM(3, 4)

        def forward(self, x):
            return self.rnn(x)[0]

    for m in (lt.LSTM(3, 4), Model()):
        with (
            pytest.warns(DeprecationWarning),
            pytest.raises(NotImplementedError, match=r"torch\.jit\.script.*torch\.jit\.trace"),
        ):
            torch.jit.script(m)


@pytest.mark.parametrize("kw", [{}, {"num_layers": 2, "bidirectional": True, "proj_size": 2}])
def test_flat_weights_are_torch_modules_list(kw):
    ref, mine = _pair(**kw)
    assert [n for n in ref._flat_weights_names] == list(mine._flat_weights_names)
    assert len(mine._flat_weights) == len(ref._flat_weights)
    for a, b, n in zip(ref._flat_weights, mine._flat_weights, mine._flat_weights_names,
                       strict=True):  # fmt: skip
        assert b is getattr(mine, n)
        torch.testing.assert_close(b, a, rtol=0, atol=0)


def test_flat_weights_cannot_be_assigned_silently():
    # torch's forward reads the list, so wrappers assign it; leanrnn's reads the named
    # parameters, and an assignment taken would have been ignored
    _, mine = _pair()
    with pytest.raises(AttributeError, match=r"_flat_weights cannot be assigned.*to_module"):
        mine._flat_weights = [w * 0 for w in mine._flat_weights]
    x = torch.randn(2, 1, 3, dtype=torch.float64)
    assert mine(x)[0].abs().sum() > 0
