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
