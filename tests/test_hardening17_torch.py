"""Session 43, from a red-team pass over mixed-precision training: a leanrnn.torch module's
autocast_mode was a plain attribute, so a typo ('bf16act') ran every forward outside bf16
autocast and failed only at the first one inside it, long after it was set."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

torch = pytest.importorskip("torch")
lt = pytest.importorskip("leanrnn.torch")
from leanrnn.errors import SpecError  # noqa: E402


@pytest.mark.parametrize("bad", ["bf16act", "BF16", "fp16", True, 1, None])
def test_autocast_mode_is_checked_when_set(bad):
    m = lt.GRU(3, 4)
    with pytest.raises(SpecError, match="autocast_mode"):
        m.autocast_mode = bad
    assert m.autocast_mode == "bf16"


def test_autocast_mode_set_and_carried():
    m = lt.LSTM(3, 4)
    m.autocast_mode = "bf16-act"
    for twin in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert twin.autocast_mode == "bf16-act"
    old = lt.LSTM(3, 4)  # pickled before the check: a plain attribute in the module's dict
    del old.__dict__["_autocast_mode"]
    old.__dict__["autocast_mode"] = "bf16-act"
    assert old.autocast_mode == "bf16-act"
    x = torch.from_numpy(np.random.default_rng(0).standard_normal((5, 2, 3)).astype(np.float32))
    with torch.autocast("cpu", torch.bfloat16):
        a, b = m(x)[0], old(x)[0]
    assert a.shape == b.shape == (5, 2, 4)


def test_a_parametrized_modules_copy_gets_its_own_engine():
    """torch's parametrize gave the class a deepcopy of its own, which copied the engine key
    along: the module and its copy (an AveragedModel/EMA) shared one engine, repacking each
    other's weights and replaying the forward at every step."""
    from torch.nn.utils.parametrizations import weight_norm

    torch.manual_seed(0)
    m = lt.LSTM(3, 4)
    weight_norm(m, "weight_ih_l0")
    twin = copy.deepcopy(m)
    assert twin._key != m._key
    ref = torch.nn.LSTM(3, 4)
    weight_norm(ref, "weight_ih_l0")
    ref.load_state_dict(m.state_dict())
    x = torch.from_numpy(np.random.default_rng(1).standard_normal((5, 2, 3)).astype(np.float32))
    with torch.no_grad():
        for mod in (m, twin):
            np.testing.assert_allclose(mod(x)[0].numpy(), ref(x)[0].numpy(), atol=2e-6)


def test_engine_keys_do_not_restart_in_each_process():
    import subprocess
    import sys

    from helpers import src_env

    code = "import leanrnn.torch as lt; print(lt.LSTM(3, 4)._key)"
    keys = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           env=src_env(), timeout=120, check=True).stdout.strip()
            for _ in range(2)}  # fmt: skip
    assert len(keys) == 2, keys  # both were 1: a program traced in one named the other's


def test_conversions_leave_torchs_generator_alone():
    """from_module and to_module built their module with torch's initialisation, drawing from
    the caller's generator: the next nn.Linear came out otherwise (0.64 off)."""
    g = torch.nn.GRU(3, 4)
    torch.manual_seed(0)
    want = torch.nn.Linear(3, 3).weight.detach().clone()
    torch.manual_seed(0)
    lt.GRU.from_module(g).to_module()
    np.testing.assert_array_equal(torch.nn.Linear(3, 3).weight.detach().numpy(), want.numpy())


def test_a_pruned_module_is_told_to_remove_the_pruning():
    from torch.nn.utils import prune

    from leanrnn.errors import WeightsError

    g = torch.nn.GRU(3, 4)
    prune.l1_unstructured(g, "weight_ih_l0", amount=0.5)
    with pytest.raises(WeightsError, match=r"prune.remove\(module, 'weight_ih_l0'\)"):
        lt.GRU.from_module(g)  # advised remove_weight_norm, which raises on a pruned module
    prune.remove(g, "weight_ih_l0")
    assert lt.GRU.from_module(g).weight_ih_l0.shape == (12, 3)


def test_the_readmes_training_loop_runs_with_either_module():
    """The README's leanrnn.torch snippet ran one window only: with no zero_grad its
    gradients grew window by window, and its (None, None) state was refused by torch.nn's
    module, which the snippet offers through to_module()."""
    from pathlib import Path

    text = (Path(__file__).parent.parent / "README.md").read_text()
    start = text.index("```python\nimport torch, leanrnn.torch as lt\n") + len("```python\n")
    code = text[start : text.index("```", start)]
    rng = np.random.default_rng(0)
    windows = [torch.from_numpy(rng.standard_normal((2, 5, 64)).astype(np.float32))
               for _ in range(3)]  # fmt: skip
    for swap in (False, True):
        src = code if not swap else code.replace(
            "opt = torch.optim", "lstm = lstm.to_module()\nopt = torch.optim")  # fmt: skip
        ns = {"windows": windows, "loss_fn": lambda y: y.pow(2).mean()}
        exec(compile(src, "README.md", "exec"), ns)
        assert all(p.grad is None for p in ns["lstm"].parameters())  # zeroed after each step
        assert ns["state"][0].shape == (2, 2, 128) and not ns["state"][0].requires_grad


def test_frozen_weights_stay_frozen_across_a_swap():
    g = torch.nn.GRU(3, 4)
    g.weight_ih_l0.requires_grad_(False)  # was trained after from_module (0.038 in a step)
    m = lt.GRU.from_module(g)
    back = m.to_module()
    for mod in (m, back):
        frozen = [n for n, p in mod.named_parameters() if not p.requires_grad]
        assert frozen == ["weight_ih_l0"], frozen
