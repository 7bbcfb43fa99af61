"""Session 43, from a red-team pass over training numerics (float64 against torch, float32
under stress): NaN in x past a sample's length, padding torch's packed sequence never reads,
made the whole input-weight gradient NaN; Adam/AdamW with an eps that rounds to 0 in float32
(1e-50) turned every weight NaN; eps=0 left entries unmoved whose tiny gradient underflowed
v to 0 (torch: +-inf); clip_grad_norm's non-finite error was not a RuntimeError, as torch's."""

from __future__ import annotations

import numpy as np
import pytest

import leanrnn
from leanrnn.formats import torch_format
from leanrnn.train import Adam, AdamW, Parameter, Trainer, clip_grad_norm

torch = pytest.importorskip("torch")


@pytest.mark.parametrize("cell", ["LSTM", "GRU"])
@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("fill", [np.nan, np.inf])
def test_non_finite_padding_leaves_the_gradients_finite(cell, batch_first, fill):
    torch.manual_seed(0)
    ref = getattr(torch.nn, cell)(4, 16, num_layers=2, bidirectional=True,
                                  batch_first=batch_first).double()  # fmt: skip
    T, lens = 5, np.array([5, 2, 3])
    x = np.random.default_rng(0).standard_normal((T, 3, 4))
    for n, length in enumerate(lens):
        x[length:, n] = fill  # a loader's fill, or np.empty
    xin = x.transpose(1, 0, 2).copy() if batch_first else x
    tr = Trainer(leanrnn.from_torch(ref))
    tape = tr.forward(xin, lengths=lens)
    live = (np.arange(T)[:, None] < lens[None, :])[..., None]  # [T, N, 1]
    if batch_first:
        live = live.transpose(1, 0, 2)
    dy = np.broadcast_to(live, tape.y.shape).astype(float)  # d(sum of the valid y)
    dx = tr.backward(tape, dy)[0]
    # torch on the same data, packed: the padding is never read
    xt = torch.tensor(np.nan_to_num(xin, nan=0.0, posinf=0.0), requires_grad=True)
    packed = torch.nn.utils.rnn.pack_padded_sequence(xt, torch.tensor(lens),
                                                     batch_first=batch_first,
                                                     enforce_sorted=False)  # fmt: skip
    y, _ = ref(packed)
    y, _ = torch.nn.utils.rnn.pad_packed_sequence(y, batch_first=batch_first, total_length=T)
    y.sum().backward()
    np.testing.assert_allclose(tape.y, y.detach().numpy(), rtol=1e-10, atol=1e-12)
    grads = torch_format.to_state_dict(tr.spec, tr.gradients())
    for k, p in ref.named_parameters():
        assert np.isfinite(grads[k]).all(), k  # weight_ih: every entry was NaN
        np.testing.assert_allclose(grads[k], p.grad.numpy(), rtol=1e-9, atol=1e-11, err_msg=k)
    np.testing.assert_allclose(np.where(live, dx, 0), xt.grad.numpy(), rtol=1e-9, atol=1e-11)
    assert np.isnan(xin).any() or np.isinf(xin).any()  # the caller's x as it was


@pytest.mark.parametrize("Opt,TOpt", [(Adam, "Adam"), (AdamW, "AdamW")])
def test_adam_with_an_eps_that_is_zero_in_float32(Opt, TOpt):
    torch.manual_seed(0)
    ref = torch.nn.LSTM(3, 5)
    m = leanrnn.from_torch(ref)
    tr = Trainer(m)
    opt = Opt(tr.parameters(), lr=1e-2, eps=1e-50)
    topt = getattr(torch.optim, TOpt)(ref.parameters(), lr=1e-2, eps=1e-50)
    x = np.random.default_rng(0).standard_normal((4, 2, 3)).astype(np.float32)
    for _ in range(3):
        tape = tr.forward(x)
        tr.backward(tape, np.ones_like(tape.y))
        opt.step()
        tr.zero_grad()
        topt.zero_grad()
        ref(torch.from_numpy(x))[0].sum().backward()
        topt.step()
    sd = m.state_dict()
    for k, v in ref.state_dict().items():
        assert np.isfinite(sd[k]).all(), k  # was NaN everywhere (0/0 on the padding)
        np.testing.assert_allclose(sd[k], v.numpy(), atol=1e-6, rtol=0, err_msg=k)


def test_adam_eps_zero_divides_a_gradient_too_small_for_v():
    g = np.array([3e-23, -5e-24, 0.0], np.float32)
    p = Parameter(np.ones(3, np.float32), np.zeros(3, np.float32))
    opt = Adam([p], lr=1e-3, eps=0.0)
    p.grad = g
    opt.step()
    tp = torch.nn.Parameter(torch.ones(3))
    topt = torch.optim.Adam([tp], lr=1e-3, eps=0.0)
    tp.grad = torch.from_numpy(g.copy())
    topt.step()
    want = tp.detach().numpy()
    np.testing.assert_array_equal(p.value[:2], want[:2])  # +-inf, as torch (was 1, 1)
    assert p.value[2] == 1.0  # a gradient 0 on every step: unmoved (torch: NaN), as documented


def test_clip_grad_norm_non_finite_is_a_runtime_error():
    p = Parameter(np.ones(3, np.float32), np.zeros(3, np.float32))
    p.grad = np.array([1.0, np.nan, 0.0], np.float32)
    with pytest.raises(RuntimeError, match="norm of the gradients is nan"):
        clip_grad_norm([p], 1.0, error_if_nonfinite=True)  # code written for torch catches it
    with pytest.raises(leanrnn.errors.LeanRNNError):
        clip_grad_norm([p], 1.0, error_if_nonfinite=True)


def test_trainable_names_what_it_takes():
    from leanrnn.errors import SpecError
    from leanrnn.train import trainable

    m = leanrnn.LSTM(3, 4, seed=0)
    assert trainable(m) is None and trainable(m.spec) is None
    with pytest.raises(SpecError, match="int8 weights; training updates float weights"):
        trainable(leanrnn.quantize(m, "int8"))  # the spec alone said "trainable"
    with pytest.raises(SpecError, match="expected an RNNSpec"):
        trainable(3)  # 'int' object has no attribute 'beyond_torch'


def test_a_trainer_of_a_graph_model_says_what_to_train(tmp_path):
    onnx = pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    from leanrnn.errors import SpecError

    rng = np.random.default_rng(0)
    g = helper.make_graph(
        [helper.make_node("GRU", ["x", "W", "R"], ["Y"], hidden_size=4, name="rnn",
                          linear_before_reset=1)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "N", 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(rng.standard_normal(s).astype(np.float32), n)
         for n, s in (("W", (1, 12, 3)), ("R", (1, 12, 4)))],
    )  # fmt: skip
    path = str(tmp_path / "g.onnx")
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)]), path)
    gm = leanrnn.load(path)
    with pytest.raises(SpecError, match=r"model.graph.packed\[name\], names \['rnn'\]"):
        Trainer(gm)  # said "load a file first with leanrnn.load(path)": it was
    Trainer(leanrnn.Model(gm.graph.packed["rnn"]))  # what the message offers


def test_alternating_shapes_under_a_memory_limit_keep_one_arena(monkeypatch):
    """A one-segment step whose boundary states do not fit in dx counted a second copy of its
    initial states against memory_limit: that tipped its plan under the limit by ~31 KiB, so
    the big step's arena was dropped and made again on every step two shapes alternated
    (1,000 arenas, 1 GiB of fresh pages, in 1,000 steps). Segment 0 now starts from the
    tape's own copy; the gradients are those of a run without a limit."""
    import leanrnn.train.session as ts

    made = []

    class Counting(ts.Arena):
        def __init__(self, nbytes, name="arena"):
            made.append(nbytes)
            super().__init__(nbytes, name)

    monkeypatch.setattr(ts, "Arena", Counting)
    # (one thread: the plan of two tipped under the limit otherwise too, or not at all)
    limited = Trainer(leanrnn.LSTM(16, 32, num_layers=2, seed=0), memory_limit=2 << 20)
    free = Trainer(leanrnn.LSTM(16, 32, num_layers=2, seed=0))
    limited.threads = free.threads = 1
    opts = [Adam(tr.parameters()) for tr in (limited, free)]
    rng = np.random.default_rng(0)
    for step in range(8):
        N, T = ((55, 95), (63, 2))[step % 2]
        x = rng.standard_normal((T, N, 16), dtype=np.float32)
        got = []
        for tr, opt in zip((limited, free), opts, strict=True):
            if tr is limited:
                made.clear()
            tape = tr.forward(x)
            tr.backward(tape, tape.y * 0.01, input_grad=False)
            got.append(torch_format.to_state_dict(tr.spec, tr.gradients()))
            if tr is limited:
                allocated = len(made)
            opt.step()
            tr.zero_grad()
        for k in got[1]:
            np.testing.assert_allclose(got[0][k], got[1][k], rtol=1e-4, atol=1e-6, err_msg=k)
        if step >= 2:
            assert allocated == 0, f"step {step}: a new arena ({made})"
