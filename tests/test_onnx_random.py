"""Randomized one-node LSTM/GRU/RNN models over every ONNX attribute, compared with onnxruntime.

Each case draws odd sizes, a direction, custom activations with alpha/beta, clip, input_forget,
linear_before_reset, peepholes, biases, sequence_lens (zeros included), initial states, any
subset of the outputs Y/Y_h/Y_c, layout 0 or 1, and weights as initializers (packed at load)
or as graph inputs (packed per run). onnxruntime rejects layout=1, so for those cases it runs
the same node with layout 0 on transposed inputs and its outputs are transposed back.
"""

from __future__ import annotations

import numpy as np
import pytest

from tolerances import ATOL_FLOAT64_TWINS, ATOL_ORT, RTOL, RTOL_ORT

onnx = pytest.importorskip("onnx")
ort = pytest.importorskip("onnxruntime")
from onnx import TensorProto, helper, numpy_helper  # noqa: E402

from leanrnn import GraphModel  # noqa: E402
from leanrnn.formats.onnx_import import read_onnx  # noqa: E402

pytestmark = pytest.mark.onnx

GATES = {"LSTM": 4, "GRU": 3, "RNN": 1}
PER_DIRECTION = {"LSTM": 3, "GRU": 2, "RNN": 1}
# ONNX spellings (onnxruntime's RNN op is case-sensitive) and ranges that keep outputs finite
ACTIVATIONS = {
    "Sigmoid": None,
    "Tanh": None,
    "Relu": None,
    "Affine": ((0.2, 1.2), (-0.5, 0.5)),
    "LeakyRelu": ((0.01, 0.5), None),
    "ThresholdedRelu": ((0.0, 0.8), None),
    "ScaledTanh": ((0.5, 1.5), (0.5, 1.5)),
    "HardSigmoid": ((0.1, 0.5), (0.3, 0.7)),
    "Elu": ((0.5, 1.5), None),
    "Softsign": None,
    "Softplus": None,
}
BOUNDED = ["Sigmoid", "HardSigmoid", "Tanh", "Softsign", "ScaledTanh"]
SEEDS = range(60)


def _case(op: str, seed: int) -> dict:
    rng = np.random.default_rng(1000 * GATES[op] + seed)
    direction = str(rng.choice(["forward", "reverse", "bidirectional"]))
    D = 2 if direction == "bidirectional" else 1
    T, N, C, H = (int(rng.integers(1, k)) for k in (9, 6, 24, 34))
    H = H | 1 if rng.random() < 0.7 else H  # mostly odd sizes
    G = GATES[op] * H
    attrs: dict = {"hidden_size": H, "direction": direction}
    if rng.random() < 0.6:
        names, alphas, betas = [], [], []
        for k in range(D * PER_DIRECTION[op]):
            # LSTM/GRU gates (the first activation of a direction) stay bounded, or the state
            # can grow without limit and float32 rounding dominates the comparison
            gate = op != "RNN" and k % PER_DIRECTION[op] == 0
            name = str(rng.choice(BOUNDED if gate else list(ACTIVATIONS)))
            names.append(name)
            ranges = ACTIVATIONS[name]
            # Every parameter is given: onnxruntime does not apply the ONNX defaults for missing
            # ones (Affine/ScaledTanh get 0); see test_missing_alpha_beta_take_onnx_defaults.
            if ranges:
                alphas.append(float(rng.uniform(*ranges[0])))
                if ranges[1]:
                    betas.append(float(rng.uniform(*ranges[1])))
        attrs["activations"] = names
        if alphas:
            attrs["activation_alpha"] = alphas
        if betas:
            attrs["activation_beta"] = betas
    if rng.random() < 0.5:
        attrs["clip"] = float(rng.uniform(0.5, 3.0))
    if op == "LSTM" and rng.random() < 0.4:
        attrs["input_forget"] = 1
    if op == "GRU":
        attrs["linear_before_reset"] = int(rng.integers(0, 2))

    def w(*shape, scale=0.5):
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    # R scaled by 1/sqrt(H) keeps the recurrence contractive even for unbounded activations
    tensors = {"W": w(D, G, C, scale=1 / np.sqrt(C)), "R": w(D, G, H, scale=0.8 / np.sqrt(H))}
    if rng.random() < 0.7:
        tensors["B"] = w(D, 2 * G, scale=0.3)
    if rng.random() < 0.6:
        tensors["seq"] = rng.integers(0 if rng.random() < 0.2 else 1, T + 1, N).astype(np.int32)
    if rng.random() < 0.5:
        tensors["h0"] = w(D, N, H)
    if op == "LSTM" and rng.random() < 0.5:
        tensors["c0"] = w(D, N, H)
    if op == "LSTM" and rng.random() < 0.5:
        tensors["P"] = w(D, 3 * H, scale=0.3)
    tensors["X"] = w(T, N, C, scale=1.0)
    outs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    keep = [o for o in outs if rng.random() < 0.7] or [str(rng.choice(outs))]
    return {
        "op": op,
        "attrs": attrs,
        "tensors": tensors,
        "outputs": [o if o in keep else "" for o in outs],
        "layout": int(rng.integers(0, 2)),
        "weights_as_inputs": bool(rng.random() < 0.3),
        "omit_hidden_size": bool(rng.random() < 0.3),
    }


def _model(case: dict, layout: int, tensors: dict, for_ort: bool) -> bytes:
    op = case["op"]
    names = ["X", "W", "R", "B", "seq", "h0", "c0", "P"][: 8 if op == "LSTM" else 6]
    inputs = [n if n in tensors else "" for n in names]
    while inputs[-1] == "":
        inputs.pop()
    outputs = list(case["outputs"])
    while outputs[-1] == "":
        outputs.pop()
    attrs = dict(case["attrs"])
    if layout:
        attrs["layout"] = 1
    if case["omit_hidden_size"] and not for_ort:
        del attrs["hidden_size"]
    node = helper.make_node(op, inputs, outputs, **attrs)
    as_init = {"W", "R", "B", "P"} if not case["weights_as_inputs"] else set()
    ty = {"seq": TensorProto.INT32}
    graph_inputs = [
        helper.make_tensor_value_info(k, ty.get(k, TensorProto.FLOAT), list(v.shape))
        for k, v in tensors.items()
        if k not in as_init
    ]
    inits = [numpy_helper.from_array(v, k) for k, v in tensors.items() if k in as_init]
    graph_outputs = [
        helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in outputs if o
    ]
    g = helper.make_graph([node], "g", graph_inputs, graph_outputs, inits)
    model = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    return model.SerializeToString()


def _to_layout1(tensors: dict) -> dict:
    t = dict(tensors)
    t["X"] = np.ascontiguousarray(t["X"].transpose(1, 0, 2))
    for k in ("h0", "c0"):
        if k in t:
            t[k] = np.ascontiguousarray(t[k].transpose(1, 0, 2))
    return t


def _feeds(case: dict, tensors: dict) -> dict:
    skip = {"W", "R", "B", "P"} if not case["weights_as_inputs"] else set()
    return {k: v for k, v in tensors.items() if k not in skip}


def _compare(op: str, seed: int) -> None:
    case = _case(op, seed)
    layout = case["layout"]
    # onnxruntime always runs layout 0 (it rejects layout=1)
    ort_model = _model(case, 0, case["tensors"], for_ort=True)
    sess = ort.InferenceSession(ort_model, providers=["CPUExecutionProvider"])
    expected = sess.run(None, _feeds(case, case["tensors"]))
    if layout:
        expected = [
            e.transpose(2, 0, 1, 3) if e.ndim == 4 else e.transpose(1, 0, 2) for e in expected
        ]
    tensors = _to_layout1(case["tensors"]) if layout else case["tensors"]
    ours = GraphModel(read_onnx(_model(case, layout, tensors, for_ort=False)))
    got = ours.run(_feeds(case, tensors))
    names = [o for o in case["outputs"] if o]
    assert len(got) == len(expected) == len(names)
    for name, g, e in zip(names, got, expected, strict=True):
        assert g.shape == e.shape, (name, g.shape, e.shape, case)
        assert g.dtype == np.float32
        np.testing.assert_allclose(
            g, e, rtol=RTOL_ORT[np.float32], atol=ATOL_ORT[np.float32],
            err_msg=f"{name}: {_describe(case)}",
        )  # fmt: skip


def _describe(case: dict) -> str:
    shapes = {k: list(v.shape) for k, v in case["tensors"].items()}
    rest = {k: v for k, v in case.items() if k != "tensors"}
    return f"{rest} shapes={shapes} seq={case['tensors'].get('seq')}"


@pytest.mark.parametrize("seed", SEEDS)
@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_matches_onnxruntime(op, seed):
    _compare(op, seed)


def test_cases_cover_every_attribute():
    """The seeds above really exercise every option (else the randomness proves little)."""
    seen: dict[str, set] = {}
    for op in GATES:
        for seed in SEEDS:
            c = _case(op, seed)
            a, t = c["attrs"], c["tensors"]
            for key, val in (
                ("direction", a["direction"]),
                ("layout", c["layout"]),
                ("clip", "clip" in a),
                ("input_forget", a.get("input_forget", 0)),
                ("lbr", a.get("linear_before_reset", -1)),
                ("P", "P" in t),
                ("B", "B" in t),
                ("seq", "seq" in t),
                ("zero_len", "seq" in t and not t["seq"].all()),
                ("h0", "h0" in t),
                ("c0", "c0" in t),
                ("dynamic", c["weights_as_inputs"]),
                ("no_hidden_size", c["omit_hidden_size"]),
                ("alpha", "activation_alpha" in a),
                ("beta", "activation_beta" in a),
                ("outputs", tuple(c["outputs"])),
            ):
                seen.setdefault(key, set()).add(val)
            for name in a.get("activations", []):
                seen.setdefault("act", set()).add(name)
    assert seen["direction"] == {"forward", "reverse", "bidirectional"}
    assert seen["layout"] == {0, 1}
    for key in (
        "clip",
        "input_forget",
        "P",
        "B",
        "seq",
        "zero_len",
        "h0",
        "c0",
        "dynamic",
        "no_hidden_size",
        "alpha",
        "beta",
    ):
        assert len(seen[key]) == 2, key
    assert seen["lbr"] >= {0, 1}
    assert seen["act"] == set(ACTIVATIONS)
    assert len(seen["outputs"]) >= 6


@pytest.mark.parametrize("op", ["LSTM", "GRU", "RNN"])
def test_float64_nodes_match_the_float64_reference(op):
    """float64 RNN nodes run in float64 (onnxruntime has no double LSTM/GRU/RNN kernels, so the
    oracle here is leanrnn's NumPy reference)."""
    from leanrnn.ir import rnn_attrs, rnn_from_node
    from leanrnn.kernels.reference import reference_forward

    case = _case(op, 7)
    t = {
        k: (v.astype(np.float64) if v.dtype == np.float32 else v)
        for k, v in case["tensors"].items()
    }
    case = dict(case, tensors=t, layout=0, outputs=["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else []))
    model = onnx.load_from_string(_model(case, 0, t, for_ort=True))
    for vi in [*model.graph.input, *model.graph.output]:
        if vi.type.tensor_type.elem_type == TensorProto.FLOAT:
            vi.type.tensor_type.elem_type = TensorProto.DOUBLE
    got = GraphModel(read_onnx(model.SerializeToString())).run(_feeds(case, t))
    # attributes as the file holds them (ONNX floats are float32)
    attrs = {a.name: helper.get_attribute_value(a) for a in model.graph.node[0].attribute}
    attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
    attrs["activations"] = [a.decode() for a in attrs.get("activations", [])]
    spec, layers = rnn_from_node(
        op, rnn_attrs(op, attrs, op), t["W"], t["R"], t.get("B"), t.get("P")
    )
    y, h, c = reference_forward(spec, layers, t["X"], t.get("h0"), t.get("c0"), t.get("seq"))
    T, N = t["X"].shape[:2]
    D, H = spec.num_directions, spec.hidden_size
    want = [y.reshape(T, N, D, H).transpose(0, 2, 1, 3), h] + ([c] if op == "LSTM" else [])
    if "seq" in t and not t["seq"].all():  # onnxruntime's convention, which leanrnn follows
        for w in want[1:]:
            w[:, t["seq"] == 0] = 0
    for g, w in zip(got, want, strict=True):
        assert g.dtype == np.float64
        np.testing.assert_allclose(g, w, rtol=RTOL[np.float64], atol=ATOL_FLOAT64_TWINS[np.float64])


@pytest.mark.parametrize("direction", ["forward", "reverse", "bidirectional"])
@pytest.mark.parametrize("outputs", [("Y", "Y_h"), ("", "Y_h")])
@pytest.mark.parametrize("layout", [0, 1])
def test_long_sequences_match_onnxruntime(direction, outputs, layout):
    """T longer than the engine's chunk of steps, with lengths and initial states: the chunked
    paths (forward nodes; nodes whose Y nobody reads) against onnxruntime."""
    rng = np.random.default_rng([len(direction), len(outputs[0]), layout])
    D = 2 if direction == "bidirectional" else 1
    T, N, C, H = 77, 3, 6, 9
    t = {
        "W": (rng.standard_normal((D, 4 * H, C)) / np.sqrt(C)).astype(np.float32),
        "R": (rng.standard_normal((D, 4 * H, H)) * 0.8 / np.sqrt(H)).astype(np.float32),
        "B": (rng.standard_normal((D, 8 * H)) * 0.3).astype(np.float32),
        "seq": np.array([T, 40, 33], np.int32),
        "h0": rng.standard_normal((D, N, H)).astype(np.float32),
        "c0": rng.standard_normal((D, N, H)).astype(np.float32),
        "X": rng.standard_normal((T, N, C)).astype(np.float32),
    }
    case = {
        "op": "LSTM",
        "attrs": {"hidden_size": H, "direction": direction},
        "tensors": t,
        "outputs": [*outputs, "Y_c"],
        "layout": layout,
        "weights_as_inputs": False,
        "omit_hidden_size": False,
    }
    sess = ort.InferenceSession(
        _model(case, 0, t, for_ort=True), providers=["CPUExecutionProvider"]
    )
    expected = sess.run(None, _feeds(case, t))
    if layout:
        expected = [
            e.transpose(2, 0, 1, 3) if e.ndim == 4 else e.transpose(1, 0, 2) for e in expected
        ]
    tensors = _to_layout1(t) if layout else t
    got = GraphModel(read_onnx(_model(case, layout, tensors, for_ort=False))).run(
        _feeds(case, tensors)
    )
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(
            g, e, rtol=RTOL_ORT[np.float32], atol=ATOL_ORT[np.float32], err_msg=_describe(case)
        )
