"""C-contiguous but unaligned arrays (np.frombuffer at an odd offset) in and out: the right result,
as from aligned ones, instead of a bare TypeError from the native marshaller."""

import numpy as np
import pytest

import leanrnn
from leanrnn.engine import Session
from leanrnn.kernels.reference import reference_forward
from tolerances import atol


def _unaligned(shape, fill=None):
    """A writable float32 array of ``shape`` one byte into a buffer: C-contiguous, unaligned."""
    n = int(np.prod(shape))
    buf = bytearray(4 * n + 1)
    a = np.frombuffer(buf, np.float32, count=n, offset=1).reshape(shape)
    assert a.flags.c_contiguous and not a.flags.aligned and a.flags.writeable
    if fill is not None:
        a[...] = fill
    return a


@pytest.mark.parametrize(
    "make",
    [
        lambda: leanrnn.LSTM(6, 8, num_layers=2, bidirectional=True, seed=0),
        lambda: leanrnn.GRU(6, 8, batch_first=True, seed=1),
        lambda: leanrnn.RNN(6, 8, num_layers=2, seed=2),
    ],
    ids=["lstm-bidirectional", "gru-batch-first", "rnn"],
)
@pytest.mark.parametrize("chunk", [None, 2])
def test_unaligned_inputs_and_outputs_give_the_reference_result(make, chunk):
    model = make()
    spec = model.spec
    s = Session(model.weights, chunk=chunk)
    T, N = 5, 3
    LD, K, H = spec.num_layers * spec.num_directions, spec.output_size, spec.hidden_size
    rng = np.random.default_rng(0)
    xshape = (N, T, 6) if spec.batch_first else (T, N, 6)
    x = rng.standard_normal(xshape).astype(np.float32)
    h0 = rng.standard_normal((LD, N, K)).astype(np.float32)
    c0 = rng.standard_normal((LD, N, H)).astype(np.float32) if spec.cell == "lstm" else None
    lengths = np.array([5, 2, 4])
    want = reference_forward(spec, model.weights.unpack(), x, h0, c0, lengths)
    ux, uh0 = _unaligned(x.shape, x), _unaligned(h0.shape, h0)
    uc0 = _unaligned(c0.shape, c0) if c0 is not None else None
    out = tuple(_unaligned(a.shape) for a in want if a is not None)
    got = s.run(ux, uh0, uc0, lengths, out=out)
    for g, o, r in zip(got, out, want, strict=False):
        assert g is o  # written into the caller's arrays
        np.testing.assert_allclose(g, r, rtol=0, atol=atol(np.float32))
    # Without out=: fresh (aligned) outputs, same numbers.
    for g, r in zip(s.run(ux, uh0, uc0, lengths), want, strict=True):
        if r is not None:
            np.testing.assert_allclose(g, r, rtol=0, atol=atol(np.float32))


def test_unaligned_stream_chunks():
    model = leanrnn.LSTM(6, 8, seed=3)
    x = np.random.default_rng(3).standard_normal((4, 2, 6)).astype(np.float32)
    want = reference_forward(model.spec, model.weights.unpack(), x)[0]
    st = model.session.stream(batch=2)
    ys = []
    for t in range(4):
        out = _unaligned((2, 8))
        ys.append(st.feed(_unaligned((2, 6), x[t]), out=out))
        assert ys[-1].base is not None and np.shares_memory(ys[-1], out)
    np.testing.assert_allclose(np.stack(ys), want, rtol=0, atol=atol(np.float32))


def test_unbatched_unaligned_call_on_the_module():
    model = leanrnn.GRU(6, 8, seed=4)
    x = np.random.default_rng(4).standard_normal((5, 6)).astype(np.float32)
    want = reference_forward(model.spec, model.weights.unpack(), x[:, None])[0][:, 0]
    y, _ = model(_unaligned(x.shape, x))
    np.testing.assert_allclose(y, want, rtol=0, atol=atol(np.float32))
