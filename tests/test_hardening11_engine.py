"""Session 37, from a property-based pass over whole / chunked / streamed runs: lengths of an
unsigned or narrow integer dtype were taken as they came, and a chunked run's per-chunk
lengths (lengths - t0) wrapped around (an ended sample ran again in every later chunk: h_n off
by 0.15, y by 0.5) or overflowed int8 (OverflowError). Each case failed before."""

import numpy as np
import pytest

import leanrnn

DTYPES = [np.int64, np.int32, np.int16, np.int8, np.uint8, np.uint16, np.uint32, np.uint64]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("cell", ["lstm", "gru"])
def test_lengths_of_any_integer_dtype_in_chunked_runs(cell, dtype):
    rng = np.random.default_rng(0)
    T = 300  # past uint8's and int8's range: t0 reaches 296
    x = rng.standard_normal((T, 3, 3)).astype(np.float32)
    lengths = np.array([T, 3, 127], np.int64)
    m = {"lstm": leanrnn.LSTM, "gru": leanrnn.GRU}[cell](3, 8, seed=0)
    if np.iinfo(dtype).max < T:
        lengths = np.minimum(lengths, np.iinfo(dtype).max)
    want = leanrnn.Session(m.weights).run(x, lengths=lengths)  # whole, int64
    got = leanrnn.Session(m.weights, chunk=4).run(x, lengths=lengths.astype(dtype))
    for a, b in zip(want, got, strict=True):
        if a is not None:
            np.testing.assert_array_equal(b, a)
    # the model call with final states only is chunked by default
    _, h = m(x, lengths=lengths.astype(dtype), return_sequences=False)
    np.testing.assert_array_equal(h[0] if cell == "lstm" else h, want[1])
