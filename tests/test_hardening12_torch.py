"""Session 38, from a red-team pass swapping torch.nn.LSTM for leanrnn.torch.LSTM in real code
patterns: second derivatives through autograd.grad came back as zeros, not the promised error;
saved-tensor hooks that copy (activation offload, compression) lost the tape; forward-mode AD
and .half() failed with messages that named no way out. Each test failed before."""

from __future__ import annotations

import numpy as np
import pytest

torch = pytest.importorskip("torch")
lt = pytest.importorskip("leanrnn.torch")

from leanrnn.errors import DTypeError  # noqa: E402

F = torch.autograd.functional
TWICE = "double backward"


def _pair(cls="LSTM", dtype=torch.float64, **kw):
    torch.manual_seed(0)
    ref = getattr(torch.nn, cls)(3, 4, dtype=dtype, **kw)
    return ref, lt.from_module(ref)


def test_second_derivatives_through_autograd_grad_raise_instead_of_zeros():
    ref, mine = _pair()
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    v = torch.randn_like(x)

    def f(m):
        return lambda xx: (m(xx)[0] ** 2).sum()

    assert F.hvp(f(ref), x, v)[1].abs().sum() > 0  # torch's are not zero
    for call in (lambda: F.hvp(f(mine), x, v), lambda: F.hessian(f(mine), x),
                 lambda: F.jvp(lambda xx: mine(xx)[0], x, v)):  # fmt: skip
        with pytest.raises(RuntimeError, match=TWICE):
            call()
    for wrt in ("x", "weights"):
        xx = x.clone().requires_grad_()
        (g,) = torch.autograd.grad(f(mine)(xx), xx, create_graph=True)
        penalty = (g**2).sum()
        targets = [xx] if wrt == "x" else list(mine.parameters())
        with pytest.raises(RuntimeError, match=TWICE):  # was None (allow_unused) or zeros
            torch.autograd.grad(penalty, targets, allow_unused=True)


def test_first_order_gradients_under_create_graph_stay_torchs_with_an_infinite_input():
    """The error node's anchor adds exactly 0, whatever x holds."""
    ref, mine = _pair("GRU")
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    x[1, 0, 2] = float("inf")
    got = []
    for m in (ref, mine):
        w = next(m.parameters())
        (g,) = torch.autograd.grad(m(x)[0].sum(), w, create_graph=True)
        got.append(g.detach().numpy())
    np.testing.assert_allclose(got[1], got[0], rtol=1e-12, atol=1e-12, equal_nan=True)


def test_forward_mode_ad_is_refused_by_name():
    import torch.autograd.forward_ad as fwAD

    _, mine = _pair()
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    with fwAD.dual_level(), pytest.raises(NotImplementedError, match="forward-mode AD"):
        mine(fwAD.make_dual(x, torch.randn_like(x)))


@pytest.mark.parametrize("convert", ["half", "bfloat16"])
def test_a_16_bit_module_names_itself_and_autocast(convert):
    _, mine = _pair(dtype=torch.float32)
    getattr(mine, convert)()
    x = torch.randn(5, 2, 3).to(mine.weight_ih_l0.dtype)
    with pytest.raises(DTypeError, match=r"leanrnn\.torch\.LSTM.*torch\.autocast"):
        mine(x)


@pytest.mark.parametrize("hooks", ["clone", "save_on_cpu"])
def test_saved_tensor_hooks_that_copy_keep_the_tape(hooks):
    ref, mine = _pair(num_layers=2)
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    grads = []
    for m in (ref, mine):
        m.zero_grad()
        ctx = (torch.autograd.graph.saved_tensors_hooks(lambda a: a.clone(), lambda a: a)
               if hooks == "clone" else torch.autograd.graph.save_on_cpu())  # fmt: skip
        with ctx:
            y, _ = m(x)
        (y**2).sum().backward()  # was TapeError: "the tape of this forward is gone"
        grads.append([p.grad.clone() for p in m.parameters()])
    for a, b in zip(*grads, strict=True):
        torch.testing.assert_close(b, a, rtol=1e-10, atol=1e-12)


def test_a_vectorized_backward_is_refused_by_name():
    """torch's legacy vmap batches the gradients coming in: "Batching rule not implemented
    for aten::detach" from inside torch before."""
    ref, mine = _pair()
    x = torch.randn(2, 1, 3, dtype=torch.float64)
    assert F.jacobian(lambda xx: ref(xx)[0].sum(0), x, vectorize=True).shape == (1, 4, 2, 1, 3)
    with pytest.raises(NotImplementedError, match="vectorized backward"):
        F.jacobian(lambda xx: mine(xx)[0].sum(0), x, vectorize=True)
    xl = x.clone().requires_grad_()
    y = mine(xl)[0]
    eye = torch.eye(4, dtype=torch.float64).reshape(4, 1, 1, 4).expand(4, 2, 1, 4)
    with pytest.raises(NotImplementedError, match="vectorized backward"):
        torch.autograd.grad(y, xl, eye, is_grads_batched=True)
    # one backward per output, as vectorize=False does, gives torch's
    want = F.jacobian(lambda xx: ref(xx)[0].sum(0), x)
    torch.testing.assert_close(F.jacobian(lambda xx: mine(xx)[0].sum(0), x), want)


@pytest.mark.parametrize("how", ["no_grad", "frozen"])
def test_forward_mode_ad_is_refused_when_nothing_requires_grad_too(how):
    """Without an input requiring grad the forward skipped the autograd Function (whose jvp
    refuses) and the tangent was dropped: the output had none."""
    import contextlib

    import torch.autograd.forward_ad as fwAD

    _, mine = _pair()
    mine.requires_grad_(False)
    x = torch.randn(4, 2, 3, dtype=torch.float64)
    ctx = torch.no_grad() if how == "no_grad" else contextlib.nullcontext()
    with fwAD.dual_level(), ctx, pytest.raises(NotImplementedError, match="forward-mode AD"):
        mine(fwAD.make_dual(x, torch.randn_like(x)))
    with fwAD.dual_level():  # a dual level open, no dual input: runs
        torch.testing.assert_close(mine(x)[0], _pair()[1](x)[0])
