"""Session 37: ``from_state_dict`` picks the RNN out of a whole model's state dict
(``prefix=``), as ``leanrnn.load`` does for files; before, a model's state dict was refused with
no way to say which module ("no weight_ih_l0/weight_hh_l0 among keys")."""

import numpy as np
import pytest

import leanrnn
from leanrnn.errors import WeightsError

torch = pytest.importorskip("torch")


class Tagger(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(7, 4)
        self.rnn = torch.nn.GRU(4, 6, num_layers=2, batch_first=True, bidirectional=True)
        self.head = torch.nn.Linear(12, 3)


@pytest.mark.torch
@pytest.mark.parametrize("prefix", ["rnn", "rnn."])
def test_prefix_picks_the_module_of_a_whole_models_state_dict(prefix):
    torch.manual_seed(0)
    m = Tagger()
    sd = m.state_dict()
    ours = leanrnn.from_state_dict(sd, prefix=prefix, batch_first=True)
    x = np.random.default_rng(0).standard_normal((3, 5, 4)).astype(np.float32)
    want, h = m.rnn(torch.from_numpy(x))
    y, h_n = ours(x)
    np.testing.assert_allclose(y, want.detach().numpy(), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(h_n, h.detach().numpy(), rtol=1e-5, atol=1e-6)
    # one module under a prefix and nothing else: taken as it is
    alone = {f"enc.{k}": v for k, v in m.rnn.state_dict().items()}
    y2, _ = leanrnn.from_state_dict(alone, batch_first=True)(x)
    np.testing.assert_array_equal(y2, y)


@pytest.mark.torch
def test_prefix_errors_name_what_is_there():
    sd = Tagger().state_dict()
    with pytest.raises(
        WeightsError, match=r"other parameters besides the RNN 'rnn.'.*prefix='rnn.'"
    ):
        leanrnn.from_state_dict(sd)
    with pytest.raises(WeightsError, match=r"no keys start with prefix 'nope'.*\['rnn.'\]"):
        leanrnn.from_state_dict(sd, prefix="nope")
    with pytest.raises(WeightsError, match=r"prefix=3; expected a str"):
        leanrnn.from_state_dict(sd, prefix=3)
    two = {**{f"a.{k}": v for k, v in sd.items() if k.startswith("rnn.")},
           **{f"b.{k}": v for k, v in sd.items() if k.startswith("rnn.")}}  # fmt: skip
    with pytest.raises(WeightsError, match=r"several RNN modules"):
        leanrnn.from_state_dict(two)
