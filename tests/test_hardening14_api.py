"""Session 40, from a red-team pass over the public API's docstrings and signatures: a model's
state_dict() dropped what PyTorch's names cannot hold (a reverse-only direction, peepholes,
clip, ONNX's other activations, GRU's linear_before_reset=0), so from_state_dict(state_dict())
built another model silently; pack() ran the biases of a bias=False spec and dropped peepholes
or a projection a spec does not have."""

from __future__ import annotations

import numpy as np
import pytest

import leanrnn
from leanrnn import Activation, LayerWeights, RNNSpec, pack
from leanrnn.errors import SpecError, WeightsError

C, H = 3, 4


def _layer(G, K, rng, peep=False, bias=True):
    b = (lambda: rng.standard_normal(G) * 0.5) if bias else (lambda: np.zeros(G))
    return LayerWeights(rng.standard_normal((G, C)) * 0.5, rng.standard_normal((G, K)) * 0.5,
                        b(), b(), peep=rng.standard_normal((3, H)) if peep else None)  # fmt: skip


@pytest.mark.parametrize(
    "spec, peep, words",
    [
        (RNNSpec("gru", C, H, direction="reverse"), False, "direction='reverse'"),
        (RNNSpec("lstm", C, H, peepholes=True), True, "peepholes"),
        (RNNSpec("lstm", C, H, clip=0.5), False, "clip=0.5"),
        (RNNSpec("lstm", C, H, input_forget=True), False, "input_forget"),
        (RNNSpec("gru", C, H, linear_before_reset=False), False, "linear_before_reset=0"),
        (RNNSpec("rnn", C, H, activations=((Activation.make("leakyrelu", 0.3),),)), False,
         "activations"),
    ],
)  # fmt: skip
def test_state_dict_refuses_what_torch_names_cannot_hold(spec, peep, words):
    rng = np.random.default_rng(0)
    m = leanrnn.Model(pack(spec, [[_layer(spec.gate_width, H, rng, peep)]]))
    with pytest.raises(SpecError, match=f"uses {words}.*save it as .lrnn"):
        m.state_dict()


def test_state_dict_of_torchs_own_cells_still_round_trips():
    x = np.random.default_rng(1).standard_normal((6, 2, C)).astype(np.float32)
    for m in (leanrnn.LSTM(C, H, num_layers=2, bidirectional=True, proj_size=2, seed=0),
              leanrnn.GRU(C, H, bias=False, seed=0), leanrnn.RNN(C, H, nonlinearity="relu", seed=0)):  # fmt: skip
        back = leanrnn.from_state_dict(m.state_dict(), nonlinearity=m.spec.activations[0][0].name
                                       if m.spec.cell == "rnn" else "tanh")  # fmt: skip
        np.testing.assert_array_equal(back(x)[0], m(x)[0])


def test_pack_refuses_weights_the_spec_does_not_have():
    rng = np.random.default_rng(0)
    with pytest.raises(WeightsError, match="bias=False but the biases are not zero"):
        pack(RNNSpec("rnn", C, H, bias=False), [[_layer(H, H, rng)]])
    pack(RNNSpec("rnn", C, H, bias=False), [[_layer(H, H, rng, bias=False)]])  # zeros: fine
    with pytest.raises(WeightsError, match="peepholes given for a spec without them"):
        pack(RNNSpec("lstm", C, H), [[_layer(4 * H, H, rng, peep=True)]])
    proj = _layer(4 * H, H, rng)
    proj = LayerWeights(proj.W, proj.R, proj.bW, proj.bR, None, np.ones((2, H)))
    with pytest.raises(WeightsError, match="a projection given for a spec without one"):
        pack(RNNSpec("lstm", C, H), [[proj]])


def test_a_predictor_made_outside_ray_leaves_the_process_threads_alone(tmp_path):
    # before: Predictor(...) in a driver or notebook set the whole process (and BLAS) to one
    # thread; allow_nonfinite="no" was taken as true and memory_limit=4.5 as 4
    pytest.importorskip("pyarrow")
    from leanrnn import config
    from leanrnn.ray import Predictor

    m = leanrnn.GRU(3, 4, seed=0)
    m.save(tmp_path / "m.lrnn")
    was = config.get_num_threads()
    config.set_num_threads(2)  # (1 on a 1-core machine: the test then cannot tell)
    try:
        mine = config.get_num_threads()
        p = Predictor(str(tmp_path / "m.lrnn"), threads=1)
        assert config.get_num_threads() == mine and p.scorer.session.threads == 1
    finally:
        config.set_num_threads(was)
    for bad, words in (({"allow_nonfinite": "no"}, "allow_nonfinite"),
                       ({"memory_limit": 4.5}, "memory_limit"), ({"threads": 0}, "threads")):  # fmt: skip
        with pytest.raises(leanrnn.errors.LeanRNNError, match=words):
            Predictor(m, **bad)
