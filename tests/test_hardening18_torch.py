"""Session 44, from a red-team pass on leanrnn.torch's autograd semantics: under saved-tensor
hooks that copy (save_on_cpu, offloading, compression), an in-place change of the output y or
the input x after the forward gave wrong gradients, silently (the hooks' copies carry no
version check, and the tape reads y and an unstaged x where they lie); and a double backward
on the ops' path (under a function mode such as torch.device) got torch's message for op
authors instead of leanrnn's."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
lt = pytest.importorskip("leanrnn.torch")


def _clone_hooks():
    return torch.autograd.graph.saved_tensors_hooks(lambda t: t.clone(), lambda t: t)


HOOKS = [torch.autograd.graph.save_on_cpu, _clone_hooks]


def _pair(cls, **kw):
    torch.manual_seed(0)
    ref = getattr(torch.nn, cls)(3, 4, **kw).double()
    return ref, lt.from_module(ref)


@pytest.mark.parametrize("hooks", HOOKS, ids=["save_on_cpu", "clone"])
@pytest.mark.parametrize("cls", ["LSTM", "GRU", "RNN"])
def test_y_changed_in_place_under_copying_hooks_is_refused(cls, hooks):
    _, m = _pair(cls)
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    with hooks():
        y, _ = m(x)
    y.mul_(2)
    with pytest.raises(RuntimeError, match="output y was changed in place"):
        (y**2).sum().backward()  # (wrong weight gradients before: off by up to 13.5)


@pytest.mark.parametrize("cls", ["LSTM", "GRU"])
def test_x_changed_in_place_under_copying_hooks_is_refused(cls):
    _, m = _pair(cls)
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    with _clone_hooks():
        y, _ = m(x)
    x.mul_(3)  # e.g. a loader's buffer refilled before the backward
    with pytest.raises(RuntimeError, match="input x was changed in place"):
        (y**2).sum().backward()


@pytest.mark.parametrize("hooks", HOOKS, ids=["save_on_cpu", "clone"])
@pytest.mark.parametrize("batch_first", [False, True])
def test_under_copying_hooks_gradients_are_torch_s(hooks, batch_first):
    """Out of place (and, batch-first, whose y is a copy, in place too): torch's gradients."""
    ref, m = _pair("GRU", batch_first=batch_first)
    x = torch.randn(2, 5, 3, dtype=torch.float64)

    def grads(mod, in_place):
        mod.zero_grad()
        with hooks():
            y, _ = mod(x)
        if in_place:
            y.mul_(2)
        else:
            y = y * 2
        (y**2).sum().backward()
        return [p.grad.clone() for p in mod.parameters()]

    want = grads(ref, False)
    for in_place in [False, True] if batch_first else [False]:
        for g, w in zip(grads(m, in_place), want, strict=True):
            torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_a_double_backward_on_the_ops_path_says_what_to_do():
    m = lt.LSTM(3, 4)
    x = torch.randn(5, 2, 3, requires_grad=True)
    with torch.device("cpu"):  # a function mode: the forward takes the custom ops
        y, _ = m(x)
        (g,) = torch.autograd.grad(y.pow(2).sum(), x, create_graph=True)
        with pytest.raises(RuntimeError, match=r"double backward .*to_module\(\) converts"):
            g.pow(2).sum().backward()


def test_under_copying_hooks_x_and_y_go_with_their_last_reference():
    """A review of the check above: the node kept x and y (y -> its grad_fn -> the node ->
    y, a cycle), so every step's x and y waited for a garbage collection."""
    import gc
    import weakref

    _, m = _pair("GRU")
    gc.collect()
    gc.disable()
    try:
        for backward in (True, False):
            x = torch.randn(5, 2, 3, dtype=torch.float64)
            with torch.autograd.graph.save_on_cpu():
                y = m(x)[0]  # (h_n, kept, would keep the graph)
            if backward:
                (y**2).sum().backward()
            refs = [weakref.ref(x), weakref.ref(y)]
            del x, y
            assert [r() for r in refs] == [None, None], backward
    finally:
        gc.enable()


@pytest.mark.parametrize("cls", ["LSTM", "GRU"])
def test_a_hook_on_an_output_the_loss_does_not_use_is_not_called(cls):
    """It was called with None (y, h_n and c_n were outputs of one node), where torch.nn's
    modules never call it: a usual hook (g * 0.5) raised a TypeError."""
    ref, m = _pair(cls)
    x = torch.randn(5, 2, 3, dtype=torch.float64)
    grads = []
    for mod in (ref, m):
        y, h = mod(x)
        for t in h if isinstance(h, tuple) else (h,):
            t.register_hook(lambda g: g * 0.5)
        calls = []
        y.register_hook(lambda g, calls=calls: calls.append(g.shape))
        mod.zero_grad()
        (y**2).sum().backward()
        assert calls == [y.shape]
        grads.append([p.grad.clone() for p in mod.parameters()])
    for g, w in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)
    # a hook on h_n that the loss does use: called once, its scaling applied, as torch's
    for mod in (ref, m):
        mod.zero_grad()
        y, h = mod(x)
        hn = h[0] if isinstance(h, tuple) else h
        hn.register_hook(lambda g: g * 0.5)
        (y.sum() + hn.sum()).backward()
    for a, b in zip(ref.parameters(), m.parameters(), strict=True):
        torch.testing.assert_close(b.grad, a.grad, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("cls", ["LSTM", "GRU"])
def test_final_states_detach_in_place_between_chunks_as_torch_s(cls):
    """A review of the hook fix above: outputs handed out as views could not be detached in
    place ("Can't detach views in-place"), which truncated backprop does between chunks."""
    ref, m = _pair(cls)
    xs = torch.randn(3, 4, 2, 3, dtype=torch.float64)
    grads = []
    for mod in (ref, m):
        mod.zero_grad()
        h = None
        for x in xs:
            y, h = mod(x, h)
            (y**2).sum().backward()
            for t in h if isinstance(h, tuple) else (h,):
                t.detach_()
        grads.append([p.grad.clone() for p in mod.parameters()])
    for g, w in zip(grads[1], grads[0], strict=True):
        torch.testing.assert_close(g, w, rtol=1e-10, atol=1e-10)


def test_a_slice_of_x_changed_through_its_base_under_copying_hooks_is_refused():
    """The slice's Python object is gone by the backward; its base's in-place change must
    still be seen (a weak reference to the slice missed it)."""
    _, m = _pair("GRU")
    big = torch.randn(9, 2, 3, dtype=torch.float64)
    with _clone_hooks():
        y, _ = m(big[:5])
    big.add_(1)
    with pytest.raises(RuntimeError, match="input x was changed in place"):
        (y**2).sum().backward()
