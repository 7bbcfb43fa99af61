"""Session 43, from a red-team pass over the Python API as a user coming from torch.nn meets
it: torch's attribute names assigned on a model (`m.batch_first = True`,
`m.weight_ih_l0 = w`, `m.weights = other.weights`) changed nothing and the model computed
something else in silence; a subclass's own forward was skipped by `model(x)`; copies and
pickles dropped what was set on the instance; `LSTM.from_torch(gru)` returned a GRU;
`Stream(model, 2)` failed on every feed and `stream.batch = 3` ran past its state; the
repr hid relu, bias=False and int8; torch tensors and lengths passed as h0 got no advice."""

from __future__ import annotations

import copy
import importlib.resources
import pickle

import numpy as np
import pytest

import leanrnn
from leanrnn.errors import DTypeError, SpecError

torch = pytest.importorskip("torch")


def _x(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


@pytest.mark.parametrize("name,value", [("batch_first", True), ("hidden_size", 8),
                                        ("weight_ih_l0", np.zeros((16, 3), np.float32)),
                                        ("bias_hh_l0_reverse", 0), ("weight_hr_l1", 0),
                                        ("weights", None), ("session", None)])  # fmt: skip
def test_torch_attributes_cannot_be_set_to_no_effect(name, value):
    tm = torch.nn.LSTM(3, 4)
    lm = leanrnn.from_torch(tm)
    x = _x(5, 2, 3)
    with pytest.raises(AttributeError, match=f"cannot set '{name}'"):
        setattr(lm, name, value)
    # and the model still computes torch's module
    want = tm(torch.from_numpy(x))[0].detach().numpy()
    np.testing.assert_allclose(lm(x)[0], want, atol=2e-6, rtol=0)


def test_weights_of_another_model_cannot_be_swapped_in():
    a, b = leanrnn.GRU(3, 4, seed=0), leanrnn.GRU(3, 8, seed=1)
    with pytest.raises(AttributeError, match="cannot set 'weights'"):
        a.weights = b.weights  # repr, state_dict and save said b; a(x) ran a's weights
    assert a.weights is a.session.weights and a.hidden_size == 4


@pytest.mark.parametrize("kind", ["LSTM", "GRU", "RNN"])
def test_torch_attributes_read_as_torch_reads_them(kind):
    kw = {"proj_size": 2} if kind == "LSTM" else {"nonlinearity": "relu"} if kind == "RNN" else {}
    tm = getattr(torch.nn, kind)(3, 5, num_layers=2, bias=False, batch_first=True,
                                 bidirectional=True, **kw)  # fmt: skip
    lm = leanrnn.from_torch(tm)
    for attr in ("input_size", "hidden_size", "num_layers", "bias", "batch_first",
                 "bidirectional", "proj_size"):  # fmt: skip
        assert getattr(lm, attr) == getattr(tm, attr, 0), attr
    assert lm.nonlinearity == (tm.nonlinearity if kind == "RNN" else None)


class Scaled(leanrnn.GRU):  # (at module level: pickle finds classes by name)
    scale = 1.0

    def forward(self, x, hx=None):
        return super().forward(x, hx)[0] * self.scale


def test_a_subclass_forward_is_what_calling_runs():
    m = Scaled(3, 4, seed=0)
    m.scale = 10.0
    x = _x(5, 2, 3)
    y = m(x)  # was the base (y, h_n) tuple
    assert isinstance(y, np.ndarray)
    np.testing.assert_allclose(y, 10.0 * leanrnn.GRU.forward(m, x)[0], rtol=1e-6)
    for twin in (copy.deepcopy(m), pickle.loads(pickle.dumps(m))):
        assert type(twin) is Scaled and twin.scale == 10.0  # was the class default, 1.0
        np.testing.assert_array_equal(twin(x), y)


def test_from_torch_keeps_to_its_class():
    with pytest.raises(SpecError, match="torch GRU; LSTM builds LSTM"):
        leanrnn.LSTM.from_torch(torch.nn.GRU(3, 4, num_layers=2))  # unpacked as (h, c) fine

    class Mine(leanrnn.GRU):
        pass

    tm = torch.nn.GRU(3, 4)
    m = Mine.from_torch(tm)
    assert type(m) is Mine
    x = _x(4, 1, 3)
    np.testing.assert_allclose(m(x)[0], tm(torch.from_numpy(x))[0].detach().numpy(),
                               atol=2e-6, rtol=0)  # fmt: skip


def test_stream_of_a_model_and_its_fixed_batch():
    g = leanrnn.GRU(3, 4, num_layers=2, seed=0)
    x = _x(6, 2, 3)
    s = leanrnn.Stream(g, 2)  # every feed failed: 'GRU' object has no attribute '_run'
    y = np.concatenate([s.feed(x[:4]), s.feed(x[4:])])
    np.testing.assert_allclose(y, g(x)[0], atol=1e-6, rtol=0)
    with pytest.raises(SpecError, match="expected a leanrnn Session or recurrent model"):
        leanrnn.Stream(object(), 2)
    st = g.stream(2)
    st.feed(x[:3])
    saved = st.state
    with pytest.raises(AttributeError, match="batch is fixed at 2"):
        st.batch = 3  # then a feed of 3 ran the kernels on 2-sample state buffers
    for a, b in zip(st.state, saved, strict=True):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_allclose(st.feed(x[3:]), g(x)[0][3:], atol=1e-6, rtol=0)


def test_repr_says_what_the_model_runs():
    assert "nonlinearity='relu'" in repr(leanrnn.RNN(3, 4, nonlinearity="relu"))
    assert "nonlinearity" not in repr(leanrnn.RNN(3, 4))
    assert "bias=False" in repr(leanrnn.GRU(3, 4, bias=False))
    q = leanrnn.quantize(leanrnn.LSTM(3, 4, seed=0), "int8")
    assert "precision='int8'" in repr(q) and "precision" not in repr(leanrnn.LSTM(3, 4))
    assert repr(leanrnn.LSTM(3, 4, bidirectional=True)).startswith(
        "LSTM(3, 4, num_layers=1, bidirectional=True, batch_first=False"
    )


def test_advice_for_tensors_and_for_lengths_passed_as_h0():
    g = leanrnn.GRU(3, 4, seed=0)
    with pytest.raises(DTypeError, match=r"x.numpy\(\); or leanrnn.torch"):
        g(torch.zeros(5, 2, 3))
    with pytest.raises(DTypeError, match="if these are lengths, pass them by name"):
        g(_x(5, 2, 3), np.array([5, 3]))


def test_the_package_is_typed():
    from leanrnn.engine.model import RunnableModel

    assert importlib.resources.files("leanrnn").joinpath("py.typed").is_file()
    assert "__call__" in RunnableModel.__dict__  # leanrnn.load(p)(x) type-checks


def test_rnn_takes_torchs_positional_order():
    tm = torch.nn.RNN(3, 4, 2, "relu", False)  # nonlinearity fourth, bias fifth
    lm = leanrnn.RNN(3, 4, 2, "relu", False, seed=0)  # was: bias='relu', refused
    assert (lm.nonlinearity, lm.bias, lm.num_layers) == (tm.nonlinearity, tm.bias, 2)
    lm = leanrnn.from_state_dict({k: v.detach().numpy() for k, v in tm.state_dict().items()},
                                 nonlinearity="relu")  # fmt: skip
    x = _x(5, 2, 3)
    np.testing.assert_allclose(lm(x)[0], tm(torch.from_numpy(x))[0].detach().numpy(),
                               atol=2e-6, rtol=0)  # fmt: skip


def test_state_dict_errors_name_the_mistake():
    from leanrnn.errors import WeightsError

    gru = {k: v.numpy() for k, v in torch.nn.GRU(3, 4).state_dict().items()}
    with pytest.raises(WeightsError, match=r"a GRU's state dict .* not an LSTM's"):
        leanrnn.LSTM.from_state_dict(gru)  # was "weight_hh_l0 has shape (12, 4); expected..."
    lstm = {k: v.numpy() for k, v in torch.nn.LSTM(3, 4).state_dict().items()}
    lstm["weight_ih_l0"] = lstm["weight_ih_l0"].T.copy()
    with pytest.raises(WeightsError, match=r"weight_ih_l0 has shape \(3, 16\).*transposed"):
        leanrnn.from_state_dict(lstm)


def test_run_and_resize_take_x_and_its_shape_bare():
    g = leanrnn.GRU(3, 4, seed=0)
    x = _x(5, 2, 3)
    np.testing.assert_array_equal(g.run(x)[0], g(x)[0])  # was "5 inputs"
    assert g.resize((7, 2, 3)).total == g.resize({"x": (7, 2, 3)}).total  # was "x shape 7"


def test_a_batch_of_no_sequences_gives_empty_outputs_as_torch():
    for kind in ("LSTM", "GRU"):
        tm = getattr(torch.nn, kind)(3, 4, num_layers=2, bidirectional=True, batch_first=True)
        lm = leanrnn.from_torch(tm)
        x = np.zeros((0, 5, 3), np.float32)
        want, got = tm(torch.from_numpy(x)), lm(x)  # was "T and N must be >= 1"
        if kind == "LSTM":
            want, got = [want[0], *want[1]], [got[0], *got[1]]
        assert [tuple(t.shape) for t in want] == [a.shape for a in got]
    with pytest.raises(leanrnn.errors.ShapeError, match="C=3"):
        lm(np.zeros((0, 5, 2), np.float32))


def test_copies_keep_the_sessions_chunk_and_limit():
    x = _x(200, 2, 3)
    for make in (copy.deepcopy, lambda m: pickle.loads(pickle.dumps(m))):
        m = leanrnn.LSTM(3, 16, seed=0)
        m.resize((50, 2, 3), memory_limit=20_000)
        twin = make(m)
        assert (twin.session.chunk, twin.session._limit) == (m.session.chunk, m.session._limit)
        np.testing.assert_array_equal(twin(x)[0], m(x)[0])
        assert twin.session.arena_bytes <= 20_000  # a copy planned T=200 whole, no limit
        for a in (m, twin):  # the limit lifted: both back to the automatic chunk
            a.resize((50, 2, 3))
        assert twin.session.chunk == m.session.chunk, "the copy kept the limit's chunk as asked"
    g = leanrnn.GRU(3, 4)
    g.session.chunk = 7
    assert copy.deepcopy(g).session.chunk == 7  # (was None)


def test_threads_mode_and_dropout_as_torch_names_them():
    m = leanrnn.RNN(3, 4, nonlinearity="relu", seed=0)
    assert (m.mode, m.dropout, m.threads) == ("RNN_RELU", 0.0, None)
    assert leanrnn.LSTM(3, 4).mode == torch.nn.LSTM(3, 4).mode
    m.threads = 1  # an attribute nothing read
    assert m.session.threads == 1
    with pytest.raises(SpecError, match="threads=0"):
        m.threads = 0
    with pytest.raises(AttributeError, match="dropout is the identity"):
        m.dropout = 0.5


def test_an_empty_batch_checks_its_state_as_torch():
    g = leanrnn.GRU(3, 4, seed=0)
    x = np.zeros((5, 0, 3), np.float32)
    with pytest.raises(leanrnn.errors.ShapeError, match=r"h0 has shape \(1, 7, 4\)"):
        g(x, np.zeros((1, 7, 4), np.float32))  # torch: "Expected hidden size (1, 0, 4)"
    assert g(x, np.zeros((1, 0, 4), np.float32))[1].shape == (1, 0, 4)
    assert g(x, lengths=np.zeros(0, np.int64))[0].shape == (5, 0, 4)
