"""Session 39: reduced precision, from a red-team pass; each case failed before its fix."""

from __future__ import annotations

import copy
import pickle

import numpy as np
import pytest

import leanrnn
from leanrnn.errors import WeightsError

F32 = np.float32


@pytest.mark.parametrize("mode", ["bf16", "bf16-act"])
def test_bf16_refuses_infinite_weights(mode):
    """An inf weight times the zero low term of a split activation (x = 1.0: hi 1, lo 0) was
    NaN on the CPUs that multiply bf16, where float32 and the AVX2 path gave tanh(inf) = 1:
    the result depended on the path. Refused, as finite weights bf16 rounds to inf are."""
    sd = leanrnn.RNN(2, 2, seed=0).state_dict()
    sd["weight_ih_l0"][0, 0] = -np.inf
    m = leanrnn.from_state_dict(sd)
    with pytest.raises(WeightsError, match="infinite weights"):
        leanrnn.quantize(m, mode)
    x = np.array([[[1.0, 0.5]]], F32)
    assert np.isfinite(m(x)[0]).all()  # the float32 model is untouched and runs


@pytest.mark.parametrize("mode", ["bf16", "int8", "int8-dynamic"])
def test_quantize_to_the_same_precision_returns_a_copy(mode):
    """The docstring says a copy; the model came back on the very weights of the input, so a
    write into one (a Trainer, an in-place load) changed the other."""
    q = leanrnn.quantize(leanrnn.LSTM(4, 8, seed=0), mode)
    again = leanrnn.quantize(q, mode)
    assert again.weights is not q.weights
    assert not np.shares_memory(again.weights.buffer, q.weights.buffer)
    np.testing.assert_array_equal(again.weights.buffer, q.weights.buffer)
    x = np.random.default_rng(0).standard_normal((5, 2, 4)).astype(F32)
    np.testing.assert_array_equal(again(x)[0], q(x)[0])


@pytest.mark.parametrize("precision", [None, "int8-dynamic"])
def test_graph_models_pickle_and_deepcopy(precision, tmp_path):
    """A GraphModel (the ONNX models users quantize) raised a bare TypeError: cannot pickle
    '_thread.lock' object. A copy runs alone and gives the same outputs."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnx")
    from helpers import torch_export

    class Tagger(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.emb = torch.nn.Embedding(20, 6)
            self.rnn = torch.nn.LSTM(6, 8, batch_first=True)
            self.head = torch.nn.Linear(8, 3)

        def forward(self, ids):
            return self.head(self.rnn(self.emb(ids))[0])

    torch.manual_seed(0)
    ids = torch.randint(0, 20, (2, 5))
    path = torch_export(Tagger().eval(), (ids,), tmp_path / "tagger.onnx", dynamo=False,
                        names=(["ids"], ["logits"]), dynamic={"ids": {0: "N", 1: "T"}})  # fmt: skip
    g = leanrnn.load(path)
    if precision:
        g = leanrnn.quantize(g, precision)
    feed = {"ids": ids.numpy()}
    want = g.run(feed)[0]
    for copied in (pickle.loads(pickle.dumps(g)), copy.deepcopy(g)):
        assert type(copied) is type(g)
        np.testing.assert_array_equal(copied.run(feed)[0], want)
    np.testing.assert_array_equal(g.run(feed)[0], want)


def test_load_of_reduced_weights_in_float64_names_the_file(tmp_path):
    """`run --dtype float64` on an int8 file answered with a Python call to make
    (from_state_dict); the error now names the file and the option."""
    from leanrnn.errors import DTypeError

    path = tmp_path / "q.lrnn"
    leanrnn.quantize(leanrnn.LSTM(5, 8, seed=0), "int8").save(path)
    with pytest.raises(DTypeError, match=r"q\.lrnn.*int8 weights.*without --dtype"):
        leanrnn.load(path, dtype=np.float64)
    assert leanrnn.load(path, dtype=np.float32).weights.precision == "int8"
