"""Hardening, tenth pass: the model files users have, as a red team made them with torch 2.13
(training checkpoints, bfloat16 weights, parametrized and subclassed modules). Each test failed
before its fix; the oracle is torch running the same weights."""

from __future__ import annotations

import re

import numpy as np
import pytest

import leanrnn

torch = pytest.importorskip("torch")

C, H = 5, 8


def _x(batch_first: bool = False) -> np.ndarray:
    x = np.random.default_rng(0).standard_normal((7, 3, C)).astype(np.float32)
    return x.transpose(1, 0, 2).copy() if batch_first else x


def _same(model, module, x=None) -> None:
    x = _x() if x is None else x
    with torch.no_grad():
        want = module(torch.from_numpy(x))[0].float().numpy()
    np.testing.assert_allclose(model(x)[0], want, rtol=0, atol=2e-6)


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.rnn = torch.nn.LSTM(C, H)
        self.head = torch.nn.Linear(H, 2)


@pytest.mark.parametrize("layout", ["tutorial", "model", "extra_state"])
def test_training_checkpoints_load(tmp_path, layout):
    """{"epoch", "model_state_dict", "optimizer_state_dict", "loss"} (PyTorch's tutorial) failed
    with "entry 'epoch' is a int; expected tensors only", and prefix= could not help; so did a
    non-tensor _extra_state entry beside the RNN."""
    net = _Net()
    opt = torch.optim.Adam(net.parameters())
    net.rnn(torch.ones(2, 1, C))[0].sum().backward()
    opt.step()  # the optimizer's state holds tensors too
    sd = net.state_dict()
    if layout == "tutorial":
        obj, prefix = {"epoch": 5, "model_state_dict": sd, "optimizer_state_dict":
                       opt.state_dict(), "loss": 0.4}, "model_state_dict.rnn."  # fmt: skip
    elif layout == "model":
        obj, prefix = {"model": sd, "optimizer": opt.state_dict(), "epoch": 3}, "model.rnn."
    else:
        obj, prefix = {**sd, "rnn._extra_state": {"note": "x"}, "step": 7}, "rnn."
    path = tmp_path / "ckpt.pt"
    torch.save(obj, path)
    _same(leanrnn.load(path, prefix=prefix), net.rnn)
    with pytest.raises(leanrnn.errors.WeightsError, match=re.escape(f"prefix={prefix!r}")):
        leanrnn.load(path)  # several modules' tensors: the error names the prefix to pass


def test_bfloat16_weights_load_as_float32_exactly(tmp_path):
    """A bfloat16 .pt was refused even with dtype=float32 (which the CLI help promised), a
    bfloat16 .safetensors with a list of format codes, and one bfloat16 tensor anywhere in a
    file blocked loading its float32 RNN by prefix."""
    from safetensors.torch import save_file

    torch.manual_seed(1)
    m = torch.nn.GRU(C, H).to(torch.bfloat16)
    ref = torch.nn.GRU(C, H)
    ref.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
    torch.save(m.state_dict(), tmp_path / "bf16.pt")
    save_file({k: v.contiguous() for k, v in m.state_dict().items()}, str(tmp_path / "bf16.st"))
    for name in ("bf16.pt", "bf16.st"):
        _same(leanrnn.load(tmp_path / name, cell="gru"), ref)
    _same(leanrnn.from_torch(m), ref)
    net = _Net()
    net.head.to(torch.bfloat16)
    torch.save(net.state_dict(), tmp_path / "mixed.pt")
    _same(leanrnn.load(tmp_path / "mixed.pt", prefix="rnn."), net.rnn)


def test_float16_modules_say_which_dtype_to_pass():
    m = torch.nn.LSTM(C, H).half()
    with pytest.raises(leanrnn.errors.DTypeError, match=r"dtype=np\.float32"):
        leanrnn.from_torch(m)
    ref = torch.nn.LSTM(C, H)
    ref.load_state_dict({k: v.float() for k, v in m.state_dict().items()})
    _same(leanrnn.from_torch(m, dtype=np.float32), ref)


def test_live_modules_load_with_the_weights_they_compute_with():
    """A weight_norm-parametrized LSTM (torch runs it) failed: its state_dict names
    'parametrizations.weight_hh_l0.original0'; an LSTM subclass with a child Linear failed
    with "unexpected keys ['head.bias', 'head.weight']"."""
    import leanrnn.torch as lt

    torch.manual_seed(2)
    normed = torch.nn.utils.parametrizations.weight_norm(torch.nn.LSTM(C, H), "weight_hh_l0")

    class WithHead(torch.nn.LSTM):
        def __init__(self):
            super().__init__(C, H)
            self.head = torch.nn.Linear(H, 2)

    for module in (normed, WithHead()):
        _same(leanrnn.from_torch(module), module)
        twin = lt.from_module(module)
        with torch.no_grad():
            got = twin(torch.from_numpy(_x()))[0].numpy()
            want = module(torch.from_numpy(_x()))[0].numpy()
        np.testing.assert_allclose(got, want, rtol=0, atol=2e-6)


def test_leanrnn_torch_modules_convert_to_the_engine():
    """from_torch refused a leanrnn.torch module ("got LSTM; expected torch.nn.LSTM"): the way
    from a model trained with leanrnn.torch to the inference engine."""
    import leanrnn.torch as lt

    torch.manual_seed(3)
    m = lt.LSTM(C, H, batch_first=True)
    x = _x(batch_first=True)
    _same(leanrnn.from_torch(m), m, x)  # the oracle: the module itself, as it computes

    class Sub(lt.GRU):  # a user's subclass of one, with a child module
        def __init__(self):
            super().__init__(C, H)
            self.head = torch.nn.Linear(H, 2)

    sub = Sub()
    _same(leanrnn.from_torch(sub), sub)
    twin = lt.from_module(sub)
    with torch.no_grad():
        np.testing.assert_allclose(twin(torch.from_numpy(_x()))[0].numpy(),
                                   sub(torch.from_numpy(_x()))[0].numpy(), rtol=0, atol=2e-6)  # fmt: skip


def test_an_old_style_weight_norm_is_refused_not_read_stale():
    """torch.nn.utils.weight_norm recomputes the weight in a forward pre-hook: read between an
    optimizer step and the next forward it is the step before (4.5e-3 off torch)."""
    import leanrnn.torch as lt

    with pytest.warns(FutureWarning):
        m = torch.nn.utils.weight_norm(torch.nn.LSTM(C, H), "weight_hh_l0")
    for convert in (leanrnn.from_torch, lt.from_module):
        with pytest.raises(leanrnn.errors.WeightsError, match="remove_weight_norm"):
            convert(m)


# --------------------------------------------------- hostile shapes of the new reading
def test_bfloat16_names_for_one_storage_are_bounded(tmp_path):
    """Each bfloat16 entry widens to a float32 copy of its own: a 2 MB file naming one
    tensor 64 times asked for 256 MiB."""
    t = torch.zeros(32 * 1024, dtype=torch.bfloat16)
    torch.save({"rnn.weight_ih_l0": torch.zeros(4 * H, C), **{f"x{i}": t for i in range(64)}},
               tmp_path / "many.pt")  # fmt: skip
    with pytest.raises(leanrnn.errors.ModelFormatError, match="bfloat16"):
        leanrnn.load(tmp_path / "many.pt", prefix="rnn.")


def test_a_dict_named_twice_or_a_key_named_twice_is_refused(tmp_path):
    """A pickle naming one dict 32 times a level made a 3 KB file a million entries; a nested
    key could silently replace a top-level one."""
    net = _Net()
    sd = net.state_dict()
    inner = {"a": torch.zeros(2)}
    torch.save({"model": sd, "x": inner, "y": inner}, tmp_path / "shared.pt")
    with pytest.raises(leanrnn.errors.ModelFormatError, match="named twice"):
        leanrnn.load(tmp_path / "shared.pt", prefix="model.rnn.")
    torch.save({**sd, "rnn": {"weight_ih_l0": torch.zeros(4 * H, C)}}, tmp_path / "twice.pt")
    with pytest.raises(leanrnn.errors.ModelFormatError, match="two entries"):
        leanrnn.load(tmp_path / "twice.pt", prefix="rnn.")


def test_an_lrnn_file_never_holds_bf16_entries(tmp_path):
    """BF16 is read from other writers' safetensors only: a .lrnn relabelled so is corrupt."""
    import json
    import struct

    q = leanrnn.quantize(leanrnn.LSTM(C, H, seed=0), "bf16")
    path = tmp_path / "m.lrnn"
    q.save(path)
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    head = json.loads(raw[8 : 8 + n])
    name = next(k for k, v in head.items() if k != "__metadata__" and v["dtype"] == "U16")
    head[name]["dtype"] = "BF16"
    text = json.dumps(head, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + raw[8 + n :])
    with pytest.raises(leanrnn.errors.ModelFormatError, match="BF16"):
        leanrnn.load(path)


def test_a_prefix_without_its_dot_names_the_module(tmp_path):
    net = _Net()
    torch.save(net.state_dict(), tmp_path / "net.pt")
    _same(leanrnn.load(tmp_path / "net.pt", prefix="rnn"), net.rnn)
