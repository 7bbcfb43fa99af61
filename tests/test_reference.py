"""The float64 oracle against independent implementations: torch (float64) and onnxruntime."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from helpers import max_err, random_layers
from leanrnn.errors import LengthsError, ShapeError
from leanrnn.formats.packing import ONNX_ORDER, ONNX_PEEP_ORDER, LayerWeights, reorder_gates
from leanrnn.kernels.reference import activation, layers_from_torch, reference_forward
from leanrnn.spec import ACTIVATIONS, USES_ALPHA, USES_BETA, Activation, RNNSpec
from tolerances import ATOL_ORT, MIN_WRONG, RTOL_ELEMENTWISE, atol

TORCH_TOL = atol(np.float64)  # the oracle vs torch, both float64
ORT_TOL = ATOL_ORT[np.float32]  # onnxruntime computes float32


def _lengths(rng, N: int, T: int, min_len: int = 1) -> np.ndarray:
    """Random lengths that always include the extremes min_len and T (when N >= 2)."""
    lens = rng.integers(min_len, T + 1, size=N)
    lens[0] = T
    if N > 1:
        lens[1] = min_len
    return rng.permutation(lens).astype(np.int64)


# ------------------------------------------------------------------ torch (float64)


def _run_torch_case(
    cell,
    C,
    H,
    L=1,
    bidir=False,
    proj=0,
    batch_first=False,
    with_state=False,
    with_lengths=False,
    nonlinearity="tanh",
    bias=True,
    T=6,
    N=4,
    seed=0,
):
    torch = pytest.importorskip("torch")
    nn = torch.nn
    torch.manual_seed(seed)
    kw = dict(input_size=C, hidden_size=H, num_layers=L, bidirectional=bidir, bias=bias)
    kw["batch_first"] = batch_first
    if cell == "lstm":
        m = nn.LSTM(proj_size=proj, **kw)
    elif cell == "gru":
        m = nn.GRU(**kw)
    else:
        m = nn.RNN(nonlinearity=nonlinearity, **kw)
    m = m.double().eval()
    with torch.no_grad():
        for p in m.parameters():
            p.uniform_(-0.8, 0.8)

    rng = np.random.default_rng(seed)
    D, K = (2 if bidir else 1), (proj or H)
    x = rng.standard_normal((N, T, C) if batch_first else (T, N, C))
    h0 = c0 = None
    if with_state:
        h0 = 0.5 * rng.standard_normal((L * D, N, K))
        if cell == "lstm":
            c0 = 0.5 * rng.standard_normal((L * D, N, H))
    lens = _lengths(rng, N, T) if with_lengths else None

    with torch.no_grad():
        xt = torch.from_numpy(x)
        hx = None
        if with_state and cell == "lstm":
            hx = (torch.from_numpy(h0), torch.from_numpy(c0))
        elif with_state:
            hx = torch.from_numpy(h0)
        if with_lengths:
            packed = nn.utils.rnn.pack_padded_sequence(
                xt, torch.from_numpy(lens), batch_first=batch_first, enforce_sorted=False
            )
            out, hn = m(packed, hx)
            out, _ = nn.utils.rnn.pad_packed_sequence(out, batch_first=batch_first, total_length=T)
        else:
            out, hn = m(xt, hx)
    if cell == "lstm":
        t_h, t_c = hn[0].numpy(), hn[1].numpy()
    else:
        t_h, t_c = hn.numpy(), None

    spec, layers = layers_from_torch(m)
    assert spec.cell == cell and spec.num_layers == L and spec.proj_size == proj
    assert spec.num_directions == D and spec.batch_first == batch_first and spec.bias == bias
    y, h_n, c_n = reference_forward(spec, layers, x, h0, c0, lens)
    assert y.dtype == np.float64 and h_n.dtype == np.float64
    assert max_err(y, out.numpy()) <= TORCH_TOL
    assert max_err(h_n, t_h) <= TORCH_TOL
    if cell == "lstm":
        assert c_n is not None and max_err(c_n, t_c) <= TORCH_TOL
    else:
        assert c_n is None
    return spec


TORCH_CASES = [
    # cell, C, H, L, bidir, proj, batch_first, state, lengths, nonlinearity, bias
    ("lstm", 3, 5, 1, False, 0, False, False, False, "tanh", True),
    ("lstm", 4, 8, 2, True, 0, False, True, True, "tanh", True),
    ("lstm", 5, 7, 3, True, 3, True, True, True, "tanh", True),
    ("lstm", 6, 4, 1, False, 2, False, True, True, "tanh", False),
    ("lstm", 3, 6, 2, False, 5, True, False, True, "tanh", True),
    ("gru", 3, 5, 1, False, 0, False, True, False, "tanh", True),
    ("gru", 4, 6, 2, True, 0, True, True, True, "tanh", True),
    ("gru", 7, 3, 3, True, 0, False, False, True, "tanh", False),
    ("rnn", 3, 5, 1, False, 0, False, True, True, "tanh", True),
    ("rnn", 4, 6, 2, True, 0, True, True, True, "relu", True),
    ("rnn", 5, 4, 3, True, 0, False, False, True, "relu", False),
    ("rnn", 2, 8, 2, False, 0, False, True, False, "tanh", True),
]


@pytest.mark.torch
@pytest.mark.parametrize("case", TORCH_CASES, ids=lambda c: "-".join(map(str, c)))
def test_matches_torch(case):
    cell, C, H, L, bidir, proj, bf, state, lens, nl, bias = case
    seed = TORCH_CASES.index(case)
    spec = _run_torch_case(cell, C, H, L, bidir, proj, bf, state, lens, nl, bias, seed=seed)
    if cell == "rnn":
        assert spec.activations[0][0].name == nl


@pytest.mark.torch
@settings(max_examples=40, deadline=None)
@given(
    cell=st.sampled_from(["lstm", "gru", "rnn"]),
    C=st.integers(1, 6),
    H=st.integers(2, 7),
    L=st.integers(1, 3),
    bidir=st.booleans(),
    proj=st.booleans(),
    batch_first=st.booleans(),
    with_state=st.booleans(),
    with_lengths=st.booleans(),
    relu=st.booleans(),
    T=st.integers(1, 6),
    N=st.integers(1, 4),
    seed=st.integers(0, 2**16),
)
def test_matches_torch_random(
    cell, C, H, L, bidir, proj, batch_first, with_state, with_lengths, relu, T, N, seed
):
    P = (seed % (H - 1)) + 1 if proj and cell == "lstm" else 0
    nl = "relu" if relu else "tanh"
    _run_torch_case(
        cell, C, H, L, bidir, P, batch_first, with_state, with_lengths, nl, True, T, N, seed
    )


@pytest.mark.torch
def test_torch_comparison_is_sensitive():
    """Negative control: a wrong gate order or GRU variant must be caught by the tolerance."""
    torch = pytest.importorskip("torch")
    torch.manual_seed(1)
    m = torch.nn.GRU(3, 4).double()
    x = np.random.default_rng(1).standard_normal((5, 2, 3))
    with torch.no_grad():
        out, _ = m(torch.from_numpy(x))
    spec, layers = layers_from_torch(m)
    assert max_err(reference_forward(spec, layers, x)[0], out.numpy()) <= TORCH_TOL
    y_onnx_gru = reference_forward(spec.with_(linear_before_reset=False), layers, x)[0]
    assert max_err(y_onnx_gru, out.numpy()) > MIN_WRONG[np.float64]
    swapped = [
        [dataclasses.replace(lw, W=reorder_gates(lw.W, (1, 0, 2), 4)) for lw in d] for d in layers
    ]
    assert max_err(reference_forward(spec, swapped, x)[0], out.numpy()) > MIN_WRONG[np.float64]


# ------------------------------------------------------------------ onnxruntime (float32)


def _ort_run(op, attrs, feeds):
    """One-node ONNX model over the given feeds (names X W R B seq h0 c0 P); returns outputs."""
    onnx = pytest.importorskip("onnx")
    ort = pytest.importorskip("onnxruntime")
    from onnx import TensorProto, helper

    names = ["X", "W", "R", "B", "seq", "h0"] + (["c0", "P"] if op == "LSTM" else [])
    inputs = [n if n in feeds else "" for n in names]
    while inputs[-1] == "":
        inputs.pop()
    outs = ["Y", "Y_h"] + (["Y_c"] if op == "LSTM" else [])
    node = helper.make_node(op, inputs, outs, **attrs)
    vi = [
        helper.make_tensor_value_info(
            k, TensorProto.INT32 if k == "seq" else TensorProto.FLOAT, list(v.shape)
        )
        for k, v in feeds.items()
    ]
    out_vi = [
        helper.make_tensor_value_info(o, TensorProto.FLOAT, [f"{o}_{i}" for i in range(rank)])
        for o, rank in zip(outs, (4, 3, 3), strict=False)
    ]
    graph = helper.make_graph([node], "g", vi, out_vi)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 14)])
    model.ir_version = 8
    onnx.checker.check_model(model)
    sess = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(None, feeds)


# ONNX spellings; ORT's RNN op (unlike LSTM/GRU) rejects other capitalisations.
ONNX_NAMES = {
    "sigmoid": "Sigmoid",
    "tanh": "Tanh",
    "relu": "Relu",
    "affine": "Affine",
    "leakyrelu": "LeakyRelu",
    "thresholdedrelu": "ThresholdedRelu",
    "scaledtanh": "ScaledTanh",
    "hardsigmoid": "HardSigmoid",
    "elu": "Elu",
    "softsign": "Softsign",
    "softplus": "Softplus",
}


def _onnx_activation_attrs(acts) -> dict:
    """ONNX activations / activation_alpha / activation_beta as onnxruntime consumes them:
    the alpha (beta) list holds one value per activation that takes an alpha (beta), in order."""
    flat = [a for d in acts for a in d]
    attrs = {"activations": [ONNX_NAMES[a.name] for a in flat]}
    alphas = [a.alpha for a in flat if a.name in USES_ALPHA]
    betas = [a.beta for a in flat if a.name in USES_BETA]
    if alphas:
        attrs["activation_alpha"] = alphas
    if betas:
        attrs["activation_beta"] = betas
    return attrs


def _onnx_to_canonical(cell, H, W, R, B, P):
    order, G = ONNX_ORDER[cell], W.shape[1]
    out = []
    for d in range(W.shape[0]):
        peep = None if P is None else reorder_gates(P[d], ONNX_PEEP_ORDER, H).reshape(3, H)
        out.append(
            LayerWeights(
                W=reorder_gates(W[d], order, H),
                R=reorder_gates(R[d], order, H),
                bW=reorder_gates(B[d, :G], order, H),
                bR=reorder_gates(B[d, G:], order, H),
                peep=peep,
            )
        )
    return [out]


def _acts(*per_dir):
    return tuple(tuple(Activation.make(*a) for a in d) for d in per_dir)


def _onnx_case(
    cell,
    direction="forward",
    acts=None,
    clip=None,
    input_forget=False,
    peepholes=False,
    lbr=False,
    with_lengths=False,
    with_state=False,
    C=3,
    H=5,
    T=7,
    N=4,
    seed=0,
    min_len=1,
):
    """Random float32 weights/inputs for a one-node ONNX op plus the matching spec and layers."""
    rng = np.random.default_rng(seed)
    spec = RNNSpec(
        cell=cell,
        input_size=C,
        hidden_size=H,
        direction=direction,
        activations=acts,
        clip=clip,
        input_forget=input_forget,
        peepholes=peepholes,
        linear_before_reset=lbr,
    )
    D, G = spec.num_directions, spec.gate_width

    def u(*shape):
        return rng.uniform(-0.9, 0.9, size=shape).astype(np.float32)

    feeds = {"X": rng.standard_normal((T, N, C)).astype(np.float32)}
    feeds["W"], feeds["R"], feeds["B"] = u(D, G, C), u(D, G, H), u(D, 2 * G)
    if with_lengths:
        feeds["seq"] = _lengths(rng, N, T, min_len).astype(np.int32)
    if with_state:
        feeds["h0"] = u(D, N, H)
        if cell == "lstm":
            feeds["c0"] = u(D, N, H)
    if peepholes:
        feeds["P"] = u(D, 3 * H)
    attrs = {"hidden_size": H, "direction": direction}
    attrs.update(_onnx_activation_attrs(spec.activations))
    if clip is not None:
        attrs["clip"] = clip
    if cell == "lstm":
        attrs["input_forget"] = int(input_forget)
    if cell == "gru":
        attrs["linear_before_reset"] = int(lbr)
    layers = _onnx_to_canonical(cell, H, feeds["W"], feeds["R"], feeds["B"], feeds.get("P"))
    return spec, layers, feeds, attrs


def _compare_with_ort(spec, layers, feeds, attrs, tol=ORT_TOL):
    """Max abs error of the reference vs ORT over Y, Y_h (and Y_c)."""
    op = {"lstm": "LSTM", "gru": "GRU", "rnn": "RNN"}[spec.cell]
    got = _ort_run(op, attrs, feeds)
    T, N = feeds["X"].shape[:2]
    D, H = spec.num_directions, spec.hidden_size
    y, h_n, c_n = reference_forward(
        spec, layers, feeds["X"], feeds.get("h0"), feeds.get("c0"), feeds.get("seq")
    )
    y_onnx = y.reshape(T, N, D, H).transpose(0, 2, 1, 3)  # ONNX Y is [T, D, N, H]
    # ORT returns zeros as the final state of a length-0 sample; leanrnn (and the oracle) return
    # the initial state, so those final states are not compared (Y is, everywhere).
    keep = feeds["seq"] > 0 if "seq" in feeds else np.ones(N, bool)
    errs = [
        max_err(y_onnx.astype(np.float32), got[0]),
        max_err(h_n[:, keep].astype(np.float32), got[1][:, keep]),
    ]
    if spec.cell == "lstm":
        errs.append(max_err(c_n[:, keep].astype(np.float32), got[2][:, keep]))
    return max(errs)


SIG_TANH = (("sigmoid",), ("tanh",))
LSTM_ODD = (("hardsigmoid", 0.3, 0.45), ("scaledtanh", 1.1, 0.7), ("elu", 0.9))
LSTM_ODD2 = (("sigmoid",), ("softsign",), ("affine", 0.6, 0.1))

ONNX_CASES = {
    "lstm-default": dict(cell="lstm"),
    "lstm-lens-state": dict(cell="lstm", with_lengths=True, with_state=True),
    "lstm-reverse-lens": dict(cell="lstm", direction="reverse", with_lengths=True),
    "lstm-bidir-peep-state": dict(
        cell="lstm", direction="bidirectional", peepholes=True, with_state=True, with_lengths=True
    ),
    "lstm-clip": dict(cell="lstm", clip=0.7, with_state=True),
    "lstm-clip-peep": dict(cell="lstm", clip=0.5, peepholes=True, with_state=True),
    "lstm-input-forget": dict(cell="lstm", input_forget=True, with_state=True),
    "lstm-input-forget-peep-reverse": dict(
        cell="lstm", direction="reverse", input_forget=True, peepholes=True, with_state=True
    ),
    "lstm-odd-acts": dict(cell="lstm", acts=_acts(LSTM_ODD), with_lengths=True),
    "lstm-everything": dict(
        cell="lstm",
        direction="bidirectional",
        acts=_acts(LSTM_ODD, LSTM_ODD2),
        clip=1.2,
        input_forget=True,
        peepholes=True,
        with_lengths=True,
        with_state=True,
        H=6,
        C=4,
    ),
    "gru-lbr0": dict(cell="gru", lbr=False, with_state=True),
    "gru-lbr1": dict(cell="gru", lbr=True, with_state=True),
    "gru-lbr0-bidir-lens": dict(
        cell="gru", direction="bidirectional", lbr=False, with_lengths=True, with_state=True
    ),
    "gru-lbr1-reverse-lens": dict(cell="gru", direction="reverse", lbr=True, with_lengths=True),
    "gru-clip-lbr0": dict(cell="gru", clip=0.6, lbr=False, with_state=True),
    "gru-clip-lbr1": dict(cell="gru", clip=0.6, lbr=True, direction="bidirectional"),
    "gru-odd-acts": dict(
        cell="gru",
        direction="bidirectional",
        acts=_acts(
            (("hardsigmoid", 0.25, 0.45), ("softsign",)), (("sigmoid",), ("leakyrelu", 0.2))
        ),
        lbr=True,
        with_lengths=True,
        with_state=True,
    ),
    "gru-odd-acts-lbr0": dict(
        cell="gru",
        acts=_acts(
            (("sigmoid",), ("thresholdedrelu", 0.1)),
        ),
        lbr=False,
        clip=1.5,
    ),
    "rnn-default": dict(cell="rnn", with_lengths=True, with_state=True),
    "rnn-bidir-relu": dict(
        cell="rnn", direction="bidirectional", acts=_acts((("relu",),), (("leakyrelu", 0.3),))
    ),
    "rnn-reverse-clip": dict(cell="rnn", direction="reverse", clip=0.5, with_lengths=True),
    "lstm-zero-length": dict(
        cell="lstm", direction="bidirectional", with_lengths=True, with_state=True, min_len=0
    ),
    "gru-zero-length": dict(cell="gru", with_lengths=True, with_state=True, min_len=0),
    "rnn-zero-length": dict(
        cell="rnn", direction="reverse", with_lengths=True, with_state=True, min_len=0
    ),
}


def _onnx_seed(name: str) -> int:
    return 100 + list(ONNX_CASES).index(name)


@pytest.mark.onnx
@pytest.mark.parametrize("name", list(ONNX_CASES))
def test_matches_onnxruntime(name):
    spec, layers, feeds, attrs = _onnx_case(seed=_onnx_seed(name), **ONNX_CASES[name])
    assert _compare_with_ort(spec, layers, feeds, attrs) <= ORT_TOL


# Parameters chosen so every activation is exercised away from trivial regions.
ACT_PARAMS = {
    "sigmoid": (None, None),
    "tanh": (None, None),
    "relu": (None, None),
    "affine": (0.7, -0.2),
    "leakyrelu": (0.15, None),
    "thresholdedrelu": (0.3, None),
    "scaledtanh": (1.3, 0.6),
    "hardsigmoid": (0.35, 0.4),
    "elu": (0.8, None),
    "softsign": (None, None),
    "softplus": (None, None),
}


@pytest.mark.onnx
@pytest.mark.parametrize("name", list(ACTIVATIONS))
def test_every_activation_matches_onnxruntime(name):
    alpha, beta = ACT_PARAMS[name]
    fwd = Activation.make(name, alpha, beta)
    bwd = Activation.make(name, None if alpha is None else alpha * 0.5, beta)  # per direction
    spec, layers, feeds, attrs = _onnx_case(
        "rnn",
        direction="bidirectional",
        acts=((fwd,), (bwd,)),
        with_lengths=True,
        with_state=True,
        T=5,
        seed=7,
    )
    assert _compare_with_ort(spec, layers, feeds, attrs) <= ORT_TOL


@pytest.mark.onnx
def test_thresholded_relu_is_strict_like_onnxruntime():
    """At x == alpha exactly, ORT gives 0 (x > alpha), and so must the reference."""
    H, alpha = 4, 0.5
    x = np.array([[[alpha, 0.25, 0.75, -1.0]]], np.float32)
    feeds = {"X": x, "W": np.eye(H, dtype=np.float32)[None], "R": np.zeros((1, H, H), np.float32)}
    attrs = {"hidden_size": H, "activations": ["ThresholdedRelu"], "activation_alpha": [alpha]}
    y = _ort_run("RNN", attrs, feeds)[0].ravel()
    np.testing.assert_array_equal(y, [0.0, 0.0, 0.75, 0.0])
    np.testing.assert_array_equal(activation("ThresholdedRelu", x.ravel(), alpha), y)


NEGATIVE_CONTROLS = {
    # (case, wrong spec change): the reference with the change must disagree with ORT.
    "lbr": ("gru-lbr0", dict(linear_before_reset=True)),
    "lbr1": ("gru-lbr1", dict(linear_before_reset=False)),
    "input_forget": ("lstm-input-forget", dict(input_forget=False)),
    "clip": ("lstm-clip", dict(clip=None)),
    "gru-clip": ("gru-clip-lbr1", dict(clip=None)),
    "gru-clip-lbr0": ("gru-clip-lbr0", dict(clip=None)),
    "rnn-clip": ("rnn-reverse-clip", dict(clip=None)),
    "reverse": ("lstm-reverse-lens", dict(direction="forward")),
}


@pytest.mark.onnx
@pytest.mark.parametrize("control", list(NEGATIVE_CONTROLS))
def test_onnxruntime_comparison_is_sensitive(control):
    name, change = NEGATIVE_CONTROLS[control]
    spec, layers, feeds, attrs = _onnx_case(seed=_onnx_seed(name), **ONNX_CASES[name])
    assert _compare_with_ort(spec, layers, feeds, attrs) <= ORT_TOL
    assert _compare_with_ort(spec.with_(**change), layers, feeds, attrs) > MIN_WRONG[np.float32]


@pytest.mark.onnx
def test_onnxruntime_peephole_placement_is_checked():
    """o must see the new cell state and (i, f) the old one: swapping them is caught."""
    spec, layers, feeds, attrs = _onnx_case(seed=3, **ONNX_CASES["lstm-bidir-peep-state"])
    assert _compare_with_ort(spec, layers, feeds, attrs) <= ORT_TOL
    for perm in ((1, 0, 2), (0, 2, 1)):
        wrong = [[dataclasses.replace(lw, peep=lw.peep[list(perm)]) for lw in layers[0]]]
        assert _compare_with_ort(spec, wrong, feeds, attrs) > MIN_WRONG[np.float32]


# ------------------------------------------------------------------ NumPy-only properties


PROPERTY_SPECS = [
    RNNSpec("lstm", 3, 5, num_layers=2, direction="bidirectional", proj_size=3),
    RNNSpec("lstm", 3, 4, direction="reverse", peepholes=True, input_forget=True, clip=1.0),
    RNNSpec("gru", 4, 3, num_layers=2, direction="bidirectional", linear_before_reset=False),
    RNNSpec("rnn", 2, 6, num_layers=3, direction="bidirectional"),
]


@pytest.mark.parametrize("spec", PROPERTY_SPECS, ids=lambda s: f"{s.cell}-{s.direction}")
def test_lengths_equal_separate_truncated_runs(spec):
    """Sample n with lengths[n] = t behaves exactly like that sample alone, cut to t steps;
    length 0 gives zero output and returns the initial state."""
    rng = np.random.default_rng(11)
    T, N = 6, 5
    L, D, H, K = spec.num_layers, spec.num_directions, spec.hidden_size, spec.output_size
    layers = random_layers(spec, rng, np.float64)
    x = rng.standard_normal((T, N, spec.input_size))
    h0 = rng.standard_normal((L * D, N, K))
    c0 = rng.standard_normal((L * D, N, H)) if spec.cell == "lstm" else None
    lens = np.array([6, 0, 3, 1, 5])
    y, h_n, c_n = reference_forward(spec, layers, x, h0, c0, lens)
    for n, t in enumerate(lens):
        c0_n = None if c0 is None else c0[:, n : n + 1]
        ys, hs, cs = reference_forward(spec, layers, x[:t, n : n + 1], h0[:, n : n + 1], c0_n)
        np.testing.assert_array_equal(y[:t, n], ys[:, 0])
        np.testing.assert_array_equal(y[t:, n], 0.0)
        np.testing.assert_array_equal(h_n[:, n], hs[:, 0])
        if c0 is not None:
            np.testing.assert_array_equal(c_n[:, n], cs[:, 0])
    np.testing.assert_array_equal(h_n[:, 1], h0[:, 1])  # length 0
    assert not np.array_equal(h_n[:, 0], h0[:, 0])


def test_batch_first_is_a_transpose():
    spec = RNNSpec("gru", 3, 4, num_layers=2, direction="bidirectional")
    rng = np.random.default_rng(5)
    layers = random_layers(spec, rng, np.float64)
    x = rng.standard_normal((5, 3, 3))
    y, h, _ = reference_forward(spec, layers, x, lengths=np.array([5, 2, 4]))
    yb, hb, _ = reference_forward(
        spec.with_(batch_first=True), layers, x.transpose(1, 0, 2), lengths=np.array([5, 2, 4])
    )
    np.testing.assert_array_equal(yb, y.transpose(1, 0, 2))
    np.testing.assert_array_equal(hb, h)


def test_activation_edge_values():
    big = np.array([-1000.0, -50.0, 0.0, 50.0, 1000.0])
    with np.errstate(over="raise", divide="raise", invalid="raise"):
        s = activation("Sigmoid", big)
        sp = activation("Softplus", big)
        e = activation("Elu", big, 1.0)
    rtol = RTOL_ELEMENTWISE[np.float64]
    np.testing.assert_allclose(s, [0.0, np.exp(-50.0), 0.5, 1.0, 1.0], rtol=rtol)
    np.testing.assert_allclose(sp, [0.0, np.exp(-50.0), np.log(2.0), 50.0, 1000.0], rtol=rtol)
    np.testing.assert_allclose(e, [-1.0, np.expm1(-50.0), 0.0, 50.0, 1000.0], rtol=rtol)
    assert activation("relu", np.float32(2.0)).dtype == np.float64
    np.testing.assert_array_equal(activation("HardSigmoid", big, 0.2, 0.5), [0, 0, 0.5, 1, 1])
    np.testing.assert_array_equal(activation("LeakyRelu", [-2.0, 3.0], 0.25), [-0.5, 3.0])
    np.testing.assert_array_equal(activation("ThresholdedRelu", [1.0, 1.5], 1.0), [0.0, 1.5])
    with pytest.raises(ValueError):
        activation("gelu", big)


def test_rejects_bad_inputs():
    spec = RNNSpec("lstm", 3, 4)
    layers = random_layers(spec, np.random.default_rng(0), np.float64)
    x = np.zeros((5, 2, 3))
    with pytest.raises(ShapeError):
        reference_forward(spec, layers, np.zeros((5, 2, 4)))
    with pytest.raises(ShapeError):
        reference_forward(spec, layers, x, h0=np.zeros((1, 2, 3)))
    with pytest.raises(ShapeError):
        reference_forward(spec, layers, x, c0=np.zeros((2, 2, 4)))
    with pytest.raises(LengthsError):
        reference_forward(spec, layers, x, lengths=np.array([6, 1]))
    with pytest.raises(LengthsError):
        reference_forward(spec, layers, x, lengths=np.array([-1, 1]))
    with pytest.raises(ShapeError):
        reference_forward(spec.with_(peepholes=True), layers, x)
