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


def _session():
    return leanrnn.LSTM(3, 4, seed=0).session


@pytest.mark.parametrize(
    "call, words",
    [
        (lambda: leanrnn.LSTM(3, 4, seed=-1), "seed=-1"),
        (lambda: leanrnn.LSTM(3, 4, seed=1.5), "seed=1.5"),
        (lambda: leanrnn.LSTM(3, 4, nonlinearity="bogus"), "is an RNN's argument"),
        (lambda: leanrnn.GRU(3, 4, nonlinearity="relu"), "is an RNN's argument"),
        (lambda: _session().planned(1, 2, memory_limit="x"), "memory_limit='x'"),
        (lambda: _session().resize(1, 2, latency=0.01), "choose an 'auto' batch"),
        (lambda: Activation("Tanh"), "name 'Tanh'"),
        (lambda: Activation.make("elu", "x"), "expected numbers"),
        (lambda: RNNSpec("lstm", 3, 4, clip="a"), "clip='a'"),
        (lambda: pack({"cell": "rnn"}, []), "spec is a dict"),
        (lambda: pack(RNNSpec("rnn", 3, 4), [[(1, 2, 3, 4)]]), "lists .per direction. of"),
        (lambda: leanrnn.tuning.tune(_session(), max_chunk=2.0), "max_chunk=2.0"),
        (lambda: leanrnn.tuning.tune(_session(), measure=lambda b, c: None), "returned None"),
        (lambda: leanrnn.tuning.choose(leanrnn.LSTM(3, 4)), "expected a leanrnn Session"),
        (lambda: leanrnn.LSTM(3, 4)(np.ones((2, 1, 3), np.float32), return_sequences="no"),
         "return_sequences='no'"),
    ],
)  # fmt: skip
def test_bad_arguments_get_leanrnn_errors_naming_them(call, words):
    # before: numpy's or Python's own errors from deep inside (or nothing: the argument was
    # ignored, or taken as true)
    with pytest.raises(leanrnn.errors.LeanRNNError, match=words):
        call()


def test_defaults_and_late_settings_mean_what_they_say(tmp_path):
    from leanrnn.train import Trainer

    assert leanrnn.LSTM(3, 4, dtype=None, seed=0).dtype == np.float32  # was float64
    assert leanrnn.tuning.bucket(np.int64(20)) == 20
    tr = Trainer(leanrnn.LSTM(3, 4, seed=0, dtype=np.float64))
    with pytest.raises(SpecError, match="own_memory='yes'"):
        tr.forward(np.ones((2, 1, 3)), own_memory="yes")
    tape = tr.forward(np.ones((2, 1, 3)))
    with pytest.raises(SpecError, match="input_grad='no'"):
        tr.backward(tape, np.ones_like(tape.y), input_grad="no")
    for bad in ((0, 5), (2.0, 5)):
        with pytest.raises(leanrnn.errors.ShapeError, match=r"batch=.*; expected a positive int"):
            tr.plan(*bad)
    np.savez(tmp_path / "d.npz", x=np.zeros((2, 3, 3), np.float32), lengths=np.array([3, 2]))
    with pytest.raises(leanrnn.errors.LeanRNNError, match="ray_actors=3 sizes a Ray job"):
        leanrnn.score(leanrnn.LSTM(3, 4), str(tmp_path / "d.npz"), str(tmp_path / "o.npz"),
                      ray_actors=3)  # fmt: skip


def test_a_cell_class_reads_only_its_own_cell_and_shows_its_signature():
    import inspect

    sd = leanrnn.GRU(3, 4, seed=0).state_dict()
    with pytest.raises(SpecError, match="LSTM builds LSTM models; for a GRU use"):
        leanrnn.LSTM.from_state_dict(sd, cell="gru")  # was an "LSTM" that ran a GRU
    assert isinstance(leanrnn.from_state_dict(sd, cell="gru"), leanrnn.GRU)
    for cls in (leanrnn.GRU, leanrnn.RNN):  # was (*args, **kwargs)
        assert "hidden_size" in inspect.signature(cls).parameters
        with pytest.raises(SpecError, match="proj_size is only defined for LSTM"):
            cls(3, 4, proj_size=2)


def test_out_and_state_shape_errors_speak_in_the_callers_terms():
    m = leanrnn.LSTM(4, 5, seed=0)
    x = np.ones((3, 2, 4), np.float32)
    three = (np.empty((3, 2, 5), np.float32), np.empty((1, 2, 5), np.float32),
             np.empty((1, 2, 5), np.float32))  # fmt: skip
    with pytest.raises(leanrnn.errors.ShapeError,
                       match=r"\(h_n, c_n\) \(return_sequences=False writes no y\); got 3 arrays"):  # fmt: skip
        m(x, out=three, return_sequences=False)  # said "got tuple of length 4"
    with pytest.raises(leanrnn.errors.ShapeError, match=r"h0 must be 2-D .* got shape \(1, 1, 5\)"):
        m(np.ones((3, 4), np.float32), (np.zeros((1, 1, 5), np.float32),) * 2)  # said (1,1,1,5)


def test_a_pool_takes_a_plan_of_no_member_and_graph_threads_keep_the_limit(tmp_path):
    # (review) Pool.acquire(nbytes, name) with its documented default member=None raised
    # TypeError; GraphModel.threads = n dropped the session and the limit of its last resize
    from leanrnn import Pool

    assert Pool().acquire(1024, "x").nbytes >= 1024
    pytest.importorskip("onnx")
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    g = helper.make_graph(
        [helper.make_node("GRU", ["x", "W", "R"], ["Y"], hidden_size=4)], "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["T", "N", 3])],
        [helper.make_tensor_value_info("Y", TensorProto.FLOAT, None)],
        [numpy_helper.from_array(rng.standard_normal((1, 12, 3)).astype(np.float32), "W"),
         numpy_helper.from_array(rng.standard_normal((1, 12, 4)).astype(np.float32), "R")],
    )  # fmt: skip
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    m.ir_version = 8
    (tmp_path / "g.onnx").write_bytes(m.SerializeToString())
    gm = leanrnn.load(tmp_path / "g.onnx")
    gm.resize({"x": (5, 2, 3)}, memory_limit=1 << 20)
    gm.threads = 1
    gm(np.ones((5, 2, 3), np.float32))
    assert gm.session._limit == 1 << 20
