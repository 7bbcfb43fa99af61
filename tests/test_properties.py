"""Invariants checked with hypothesis: batching, planning, packing."""

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import leanrnn
from helpers import random_layers
from leanrnn.formats.packing import pack
from leanrnn.memory.arena import ALIGN
from leanrnn.memory.planner import Buffer, plan
from leanrnn.spec import RNNSpec
from tolerances import atol

SETTINGS = settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@st.composite
def specs(draw):
    cell = draw(st.sampled_from(["lstm", "gru", "rnn"]))
    H = draw(st.integers(1, 40))
    proj = draw(st.integers(0, H - 1)) if cell == "lstm" and H > 1 and draw(st.booleans()) else 0
    return RNNSpec(
        cell,
        draw(st.integers(1, 20)),
        H,
        num_layers=draw(st.integers(1, 3)),
        direction=draw(st.sampled_from(["forward", "reverse", "bidirectional"])),
        proj_size=proj,
        bias=draw(st.booleans()),
        batch_first=draw(st.booleans()),
        linear_before_reset=draw(st.booleans()),
        peepholes=cell == "lstm" and not proj and draw(st.booleans()),
    )


@SETTINGS
@given(spec=specs(), seed=st.integers(0, 2**16), dtype=st.sampled_from([np.float32, np.float64]))
def test_pack_unpack_is_identity(spec, seed, dtype):
    layers = random_layers(spec, np.random.default_rng(seed), dtype)
    back = pack(spec, layers, dtype).unpack()
    for la, lb in zip(layers, back, strict=True):
        for a, b in zip(la, lb, strict=True):
            for name in ("W", "R", "bW", "bR", "peep", "proj"):
                va, vb = getattr(a, name), getattr(b, name)
                assert (va is None) == (vb is None), name
                if va is not None:
                    np.testing.assert_array_equal(va, vb)


@SETTINGS
@given(spec=specs(), seed=st.integers(0, 2**16))
def test_packed_storage_is_aligned(spec, seed):
    pw = pack(spec, random_layers(spec, np.random.default_rng(seed)))
    for name, t in pw.tensors().items():
        assert t.ctypes.data % 64 == 0, name
        if t.ndim == 2:
            assert (t.strides[0] % 64) == 0, name


@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 5000), st.integers(0, 12), st.integers(0, 12)),
        min_size=1,
        max_size=30,
    )
)
def test_planner_never_overlaps_live_buffers(reqs):
    bufs = [Buffer(f"b{i}", n, min(a, b), max(a, b)) for i, (n, a, b) in enumerate(reqs)]
    p = plan(bufs)
    for pl in p.placements:
        assert pl.offset % ALIGN == 0
        assert pl.end <= p.total
    for i, a in enumerate(p.placements):
        for b in p.placements[i + 1 :]:
            if a.buffer.overlaps_in_time(b.buffer) and a.buffer.nbytes and b.buffer.nbytes:
                assert a.end <= b.offset or b.end <= a.offset, (a, b)
    assert p.total <= p.naive_total


@SETTINGS
@given(spec=specs(), seed=st.integers(0, 2**16), N=st.integers(1, 6), T=st.integers(1, 7))
def test_batch_equals_separate_runs(spec, seed, N, T):
    """A batch of N (with per-sample lengths) equals N runs of batch 1 at their own lengths
    (up to float32 rounding: 4-sample tiles sum in another order than single samples)."""
    rng = np.random.default_rng(seed)
    # torch-like weight scale: batch tiles and single rows sum in different orders, and large
    # weights would amplify that float32 rounding past the tolerance over 3 layers
    layers = random_layers(spec, rng, scale=1 / np.sqrt(spec.hidden_size))
    model = leanrnn.Model(pack(spec, layers))
    C = spec.input_size
    x = rng.standard_normal((N, T, C) if spec.batch_first else (T, N, C)).astype(np.float32)
    lengths = rng.integers(1, T + 1, size=N)
    y, h_n, c_n = model.session.run(x, lengths=lengths)
    for n in range(N):
        L = int(lengths[n])
        xn = x[n : n + 1, :L] if spec.batch_first else x[:L, n : n + 1]
        yn, hn, cn = model.session.run(np.ascontiguousarray(xn))
        got = y[n, :L] if spec.batch_first else y[:L, n]
        want = yn[0] if spec.batch_first else yn[:, 0]
        np.testing.assert_allclose(got, want, rtol=0, atol=atol(np.float32))
        tail = y[n, L:] if spec.batch_first else y[L:, n]
        assert not tail.any()
        np.testing.assert_allclose(h_n[:, n], hn[:, 0], rtol=0, atol=atol(np.float32))
        if c_n is not None:
            np.testing.assert_allclose(c_n[:, n], cn[:, 0], rtol=0, atol=atol(np.float32))
