"""out= arrays that share memory with each other or with the inputs: a clear LayoutError, or
(h_n/c_n as the very arrays h0/c0, an in-place state update) the right result. Never a silent
wrong answer, and the session works after the error."""

import itertools

import numpy as np
import pytest

import leanrnn
from helpers import random_layers
from leanrnn import errors
from leanrnn.formats.packing import pack
from leanrnn.kernels.reference import reference_forward
from leanrnn.spec import RNNSpec
from tolerances import atol

T, N, H = 3, 2, 4
IN_PLACE = {("h_n", "h0"), ("c_n", "c0")}


def _model(cell, direction, layers, bf=False):
    # C = H = K: every array has the same trailing size, so any can be laid over any other.
    spec = RNNSpec(cell, H, H, num_layers=layers, direction=direction, batch_first=bf)
    w = random_layers(spec, np.random.default_rng(7), np.float32, scale=1 / np.sqrt(H))
    return leanrnn.Model(pack(spec, w, np.float32))


def _shapes(spec):
    LD, DK = spec.num_layers * spec.num_directions, spec.num_directions * H
    s = {
        "x": (N, T, H) if spec.batch_first else (T, N, H),
        "h0": (LD, N, H),
        "y": (N, T, DK) if spec.batch_first else (T, N, DK),
        "h_n": (LD, N, H),
    }
    if spec.cell == "lstm":
        s["c0"], s["c_n"] = (LD, N, H), (LD, N, H)
    return s


def _expect_refusal(arrays) -> bool:
    """The policy, stated independently of the engine: any two outputs sharing memory, or an
    output sharing memory with an input, unless it is an in-place pair laid exactly over it."""
    outs = [k for k in ("y", "h_n", "c_n") if k in arrays]
    ins = [k for k in ("x", "h0", "c0") if k in arrays]
    for a, b in itertools.combinations(outs, 2):
        if np.shares_memory(arrays[a], arrays[b]):
            return True
    for a in outs:
        for b in ins:
            if not np.shares_memory(arrays[a], arrays[b]):
                continue
            same = (arrays[a].ctypes.data, arrays[a].shape) == (
                arrays[b].ctypes.data,
                arrays[b].shape,
            )
            if (a, b) not in IN_PLACE or not same:
                return True
    return False


MODELS = [
    ("lstm", "bidirectional", 1, False),  # the reported case: y over x, read once per direction
    ("lstm", "forward", 2, True),
    ("gru", "bidirectional", 2, False),
    ("rnn", "reverse", 1, False),
]


@pytest.mark.parametrize("cell,direction,layers,bf", MODELS)
def test_every_overlap_of_outputs_and_inputs_errors_or_is_right(cell, direction, layers, bf):
    model = _model(cell, direction, layers, bf)
    spec, w = model.spec, model.weights.unpack()
    shapes = _shapes(spec)
    ins = [k for k in ("x", "h0", "c0") if k in shapes]
    outs = [k for k in ("y", "h_n", "c_n") if k in shapes]
    size = {k: int(np.prod(s)) for k, s in shapes.items()}
    region = max(size.values()) + 8
    # Each input in its own region; each output in its own too, or laid at the start of an
    # input's region or 4 elements into it (a partial overlap). Two outputs at one place overlap
    # each other as well.
    places = [None] + [(k, shift) for k in ins for shift in (0, 4)]
    rng = np.random.default_rng(0)
    refused = ran = 0
    for choice in itertools.product(places, repeat=len(outs)):
        mem = np.zeros(region * (len(ins) + len(outs)), np.float32)
        arrays = {}
        for i, k in enumerate(ins + outs):
            off = i * region
            if k in outs and choice[outs.index(k)] is not None:
                anchor, shift = choice[outs.index(k)]
                off = ins.index(anchor) * region + shift
            arrays[k] = mem[off : off + size[k]].reshape(shapes[k])
        for k in ins:
            arrays[k][...] = rng.standard_normal(shapes[k])
        x, h0, c0 = (arrays[k].copy() if k in arrays else None for k in ("x", "h0", "c0"))
        ry, rh, rc = reference_forward(spec, w, x, h0, c0)
        out = tuple(arrays[k] for k in outs)
        hx = (arrays["h0"], arrays["c0"]) if cell == "lstm" else arrays["h0"]
        if _expect_refusal(arrays):
            with pytest.raises(
                errors.LayoutError, match=r"\[Session.run\] out \w+ (and out \w+ )?share"
            ):
                model(arrays["x"], hx, out=out)
            refused += 1
            continue
        y, hs = model(arrays["x"], hx, out=out)
        ran += 1
        assert y is arrays["y"]
        tol = atol(np.float32)
        np.testing.assert_allclose(y, ry, rtol=0, atol=tol)
        h_n, c_n = hs if cell == "lstm" else (hs, None)
        np.testing.assert_allclose(h_n, rh, rtol=0, atol=tol)
        if c_n is not None:
            np.testing.assert_allclose(c_n, rc, rtol=0, atol=tol)
    assert refused and ran  # both branches taken: in-place h_n/c_n over h0/c0 runs
    # The session still works after every refusal.
    x = rng.standard_normal(shapes["x"]).astype(np.float32)
    np.testing.assert_allclose(
        model(x)[0], reference_forward(spec, w, x)[0], rtol=0, atol=atol(np.float32)
    )


def test_y_over_x_in_a_bidirectional_model_is_refused_and_the_session_survives():
    """The issue's case: out y the same array as x (C == 2H) computed garbage silently."""
    model = leanrnn.LSTM(8, 4, bidirectional=True, seed=0)
    x = np.random.default_rng(0).standard_normal((5, 2, 8)).astype(np.float32)
    want = reference_forward(model.spec, model.weights.unpack(), x)
    xx = x.copy()
    h_n, c_n = np.empty((2, 2, 4), np.float32), np.empty((2, 2, 4), np.float32)
    with pytest.raises(errors.LayoutError, match="out y shares memory with x"):
        model(xx, out=(xx, h_n, c_n))
    np.testing.assert_array_equal(xx, x)  # refused before anything was written
    with pytest.raises(errors.LayoutError, match="out h_n and out c_n share memory"):
        model(x, out=(np.empty_like(xx), h_n, h_n))
    y, (h, c) = model(x, out=(np.empty_like(x), h_n, c_n))
    for got, ref in zip((y, h, c), want, strict=True):
        np.testing.assert_allclose(got, ref, rtol=0, atol=atol(np.float32))


def test_outputs_over_lengths_and_partial_in_place_views_are_refused():
    model = leanrnn.LSTM(4, 4, seed=0)
    s = model.session
    x = np.random.default_rng(0).standard_normal((3, 2, 4)).astype(np.float32)
    y, h_n, c_n = (np.empty(shape, np.float32) for shape in ((3, 2, 4), (1, 2, 4), (1, 2, 4)))
    lengths = y.reshape(-1).view(np.int32)[:2]  # int32 lengths laid over y's memory
    lengths[:] = 3
    with pytest.raises(errors.LayoutError, match="out y shares memory with lengths"):
        s.run(x, lengths=lengths, out=(y, h_n, c_n))
    h0 = np.zeros(12, np.float32)  # h_n one row into h0: overlapping, not the same array
    with pytest.raises(errors.LayoutError, match=r"h0 itself, for an in-place update"):
        s.run(x, h0[:8].reshape(1, 2, 4), out=(y, h0[4:].reshape(1, 2, 4), c_n))
    # Exactly in place works (the Stream relies on it), and inputs may share memory with each
    # other (they are only read): here c0 is x's first row.
    h0 = np.random.default_rng(1).standard_normal((1, 2, 4)).astype(np.float32)
    c0 = x[:1]
    want = reference_forward(model.spec, model.weights.unpack(), x, h0, c0)
    h = h0.copy()
    got = s.run(x, h, c0, out=(y, h, c_n))
    for g, r in zip(got, want, strict=True):
        np.testing.assert_allclose(g, r, rtol=0, atol=atol(np.float32))


def test_stream_feed_refuses_out_over_x_and_keeps_streaming():
    model = leanrnn.GRU(4, 4, seed=3)
    x = np.random.default_rng(3).standard_normal((6, 1, 4)).astype(np.float32)
    want = reference_forward(model.spec, model.weights.unpack(), x)[0]
    st = model.session.stream(batch=1)
    first = st.feed(x[:3])
    xs = x[3:].copy()
    with pytest.raises(errors.LayoutError, match="out y shares memory with x"):
        st.feed(xs, out=xs)
    with pytest.raises(errors.LayoutError, match="out y shares memory with x"):
        st.feed(xs[0], out=xs[0])  # one step, [N, C]
    rest = st.feed(x[3:], out=np.empty_like(xs))
    np.testing.assert_allclose(np.concatenate([first, rest]), want, rtol=0, atol=atol(np.float32))
