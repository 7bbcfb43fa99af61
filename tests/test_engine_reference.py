"""The engine against the float64 NumPy oracle over every spec option (ONNX ones included)."""

from dataclasses import fields

import numpy as np
import pytest
from hypothesis import HealthCheck, assume, currently_in_test_context, given, settings
from hypothesis import strategies as st

import leanrnn
from helpers import max_err, random_layers
from leanrnn.formats.packing import LayerWeights, pack
from leanrnn.kernels.reference import reference_forward
from leanrnn.spec import ACTIVATIONS, DEFAULT_ACTIVATIONS, Activation, RNNSpec
from tolerances import CONDITIONING, MIN_WRONG, RTOL, RTOL_UNBOUNDED, atol

ACT_NAMES = sorted(ACTIVATIONS)
UNBOUNDED = {"relu", "affine", "leakyrelu", "thresholdedrelu", "elu", "softplus"}


@st.composite
def onnx_specs(draw):
    cell = draw(st.sampled_from(["lstm", "gru", "rnn"]))
    direction = draw(st.sampled_from(["forward", "reverse", "bidirectional"]))
    nd = 2 if direction == "bidirectional" else 1
    n_acts = len(DEFAULT_ACTIVATIONS[cell])
    acts = None
    if draw(st.booleans()):
        acts = tuple(
            tuple(
                Activation.make(
                    draw(st.sampled_from(ACT_NAMES)),
                    draw(st.floats(0.1, 1.5)),
                    draw(st.floats(-0.5, 0.5)),
                )
                for _ in range(n_acts)
            )
            for _ in range(nd)
        )
    return RNNSpec(
        cell,
        draw(st.integers(1, 19)),
        draw(st.integers(1, 37)),
        num_layers=draw(st.integers(1, 2)),
        direction=direction,
        bias=draw(st.booleans()),
        batch_first=draw(st.booleans()),
        activations=acts,
        clip=draw(st.sampled_from([None, 0.5, 3.0])),
        input_forget=cell == "lstm" and draw(st.booleans()),
        peepholes=cell == "lstm" and draw(st.booleans()),
        linear_before_reset=draw(st.booleans()),
    )


def _check(spec, seed, dtype, N, T, with_lengths, with_state, rtol=None, threads=None,
           lengths=None):  # fmt: skip
    rng = np.random.default_rng(seed)
    layers = random_layers(spec, rng, dtype)
    model = leanrnn.Model(pack(spec, layers, dtype))
    model.session.threads = threads
    C, K, H = spec.input_size, spec.output_size, spec.hidden_size
    LD = spec.num_layers * spec.num_directions
    x = rng.standard_normal((N, T, C) if spec.batch_first else (T, N, C)).astype(dtype)
    if lengths is None and with_lengths:
        lengths = rng.integers(0, T + 1, size=N)
    h0 = rng.standard_normal((LD, N, K)).astype(dtype) if with_state else None
    c0 = (
        rng.standard_normal((LD, N, H)).astype(dtype)
        if with_state and spec.cell == "lstm"
        else None
    )
    y, h_n, c_n = model.session.run(x, h0, c0, lengths)
    ry, rh, rc = reference_forward(spec, layers, x, h0, c0, lengths)
    if rtol is not None:
        # Unbounded activations can overflow; past 1e30 inf-vs-NaN depends on operation order,
        # which is no property of the kernels worth pinning.
        assume(np.isfinite(ry).all() and np.abs(ry).max() < 1e30)
    # Unbounded activations (Affine, Relu, Softplus...) can grow outputs to 1e3 and more, where
    # float32 rounding is relative: allow the dtype's tolerance relative to the magnitude too.
    tol = atol(dtype)
    sensitivity = _sensitivity(spec, layers, x, h0, c0, lengths, (ry, rh, rc), dtype)
    tol = max(tol, CONDITIONING * sensitivity)
    # A model this sensitive (a thresholded gate on its step, chaotic growth) would hide a wrong
    # formula inside its tolerance: nothing of the kernels' logic is checked by such a draw.
    if tol >= MIN_WRONG[dtype]:
        assume(not currently_in_test_context())
        pytest.fail(f"a fixed case amplifies rounding to {sensitivity:.2g}: pick another")
    rtol = rtol or RTOL[dtype]
    np.testing.assert_allclose(y, ry, rtol=rtol, atol=tol)
    np.testing.assert_allclose(h_n, rh, rtol=rtol, atol=tol)
    if spec.cell == "lstm":
        np.testing.assert_allclose(c_n, rc, rtol=rtol, atol=tol)


def _sensitivity(spec, layers, x, h0, c0, lengths, want, dtype) -> float:
    """How far the float64 oracle moves when every input (weights, x, states) is perturbed by up
    to one rounding of ``dtype`` (relative eps/2): the error a correct computation of this model
    in ``dtype`` may carry. Some draws amplify rounding past ATOL (float32: 2 layers of tanh gate
    activations; either dtype: a thresholded-relu gate whose input sits on its threshold jumps
    by O(1)); the kernels' error is measured against this, not against a fixed figure alone."""
    rng = np.random.default_rng(0)
    eps = np.finfo(dtype).eps / 2

    def nudge(a):
        if a is None:
            return None
        a = np.asarray(a, np.float64)
        return a * (1 + eps * rng.uniform(-1, 1, a.shape))

    worst = 0.0
    for _ in range(2):
        moved = [[LayerWeights(*(nudge(getattr(w, f.name)) for f in fields(w))) for w in d]
                 for d in layers]  # fmt: skip
        got = reference_forward(spec, moved, nudge(x), nudge(h0), nudge(c0), lengths)
        worst = max(
            worst, *(max_err(g, r) for g, r in zip(got, want, strict=True) if r is not None)
        )
    return worst if np.isfinite(worst) else np.inf


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    spec=onnx_specs(),
    seed=st.integers(0, 2**16),
    dtype=st.sampled_from([np.float32, np.float64]),
    N=st.integers(1, 5),
    T=st.integers(1, 6),
    with_lengths=st.booleans(),
    with_state=st.booleans(),
)
def test_engine_matches_reference(spec, seed, dtype, N, T, with_lengths, with_state):
    # Unbounded activations grow states polynomially per step (an all-Affine LSTM is cubic),
    # which turns float32 rounding into errors no fixed tolerance bounds; float64 checks the
    # same kernel logic for them at ATOL, and float32 covers the bounded activations.
    # Their chaotic growth still amplifies float64 rounding past that now and then, so they get
    # RTOL_UNBOUNDED (tolerances.py): a logic error shows up as O(1), far beyond it.
    loose = any(a.name in UNBOUNDED for d in spec.activations for a in d)
    if loose:
        dtype = np.float64
    rtol = RTOL_UNBOUNDED[dtype] if loose else None
    _check(spec, seed, dtype, N, T, with_lengths, with_state, rtol=rtol)


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn"])
def test_parallel_kernels_match_reference(cell):
    """Big enough for the multithreaded path, with every option that adds a barrier."""
    spec = RNNSpec(cell, 40, 100, direction="bidirectional", peepholes=cell == "lstm",
                   linear_before_reset=False, clip=2.0)  # fmt: skip
    _check(spec, 7, np.float64, 12, 9, True, True)


def test_projection_parallel_matches_reference():
    spec = RNNSpec("lstm", 30, 120, num_layers=2, proj_size=50)
    _check(spec, 3, np.float64, 16, 7, True, True)


@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn"])
@pytest.mark.parametrize("threads", [1, 2])
def test_recurrent_weights_beyond_half_of_l2_match_reference(cell, threads, backend):
    """Where R is larger than half of this core's L2 and a GEMM has 4 rows or more, each
    block's GEMM tile asks for the next block's panel over its k loop (kernels.gemm._ahead;
    reduced panels: its rows' updates, gemm.prefetch_next_panel): the smallest such H on this CPU (float32's; float64, checked to its tight tolerance, doubles R), every
    direction's blocks walked both ways, lengths cutting rows out."""
    from leanrnn.kernels import gemm

    gates = {"lstm": 4, "gru": 3, "rnn": 1}[cell]
    H = 16
    while H * gates * H * 4 <= gemm.PANEL_L2:
        H += 16
    spec = RNNSpec(cell, 8, H, direction="bidirectional")
    _check(spec, 5, np.float64, 2 * gemm.PANEL_PREFETCH_ROWS + 1, 3, True, True,
           threads=threads)  # fmt: skip


@pytest.mark.parametrize("spec", [
    RNNSpec("lstm", 9, 40, direction="bidirectional", proj_size=24),
    RNNSpec("gru", 9, 40, num_layers=2, direction="bidirectional", linear_before_reset=False),
    RNNSpec("rnn", 9, 40, direction="reverse"),
], ids=repr)  # fmt: skip
@pytest.mark.parametrize("N, threads", [(7, 1), (7, 2), (50, 2)])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_rows_sorted_longest_first_leave_the_gemm_as_they_end(spec, N, threads, dtype, backend,
                                                               many_cores):  # fmt: skip
    """Rows longest first, as serve's calls and score's batches order them: each step's GEMMs
    run only up to the last live row (kernels.recurrent._live_end), so the rows the GEMM covers
    shrink step by step down to a lone row and to none — on one thread, on two splitting the
    unit blocks (N=7) and on two batch slices (N=50: the second slice's rows all end first),
    both directions, the projection's and the GRU's second phases, with initial states and the
    frozen rows' states carried to the end."""
    T = 6
    lengths = np.linspace(T, 0, N).round().astype(np.int64)  # T ... 0: every count of live rows
    _check(spec, 4, dtype, N, T, True, True, threads=threads, lengths=lengths)
    # The live rows' bits do not depend on which rows have ended, nor on the thread count:
    # sample 0 (all T steps) against a run where every sample has all T steps, on one thread.
    rng = np.random.default_rng(5)
    model = leanrnn.Model(pack(spec, random_layers(spec, rng, dtype), dtype))
    x = rng.standard_normal((T, N, spec.input_size)).astype(dtype)
    model.session.threads = threads
    y, h_n = model.session.run(x, lengths=lengths)[:2]
    model.session.threads = 1
    y_all, h_all = model.session.run(x, lengths=np.full(N, T))[:2]
    np.testing.assert_array_equal(y[:, 0], y_all[:, 0])
    np.testing.assert_array_equal(h_n[:, 0], h_all[:, 0])


@pytest.mark.parametrize("batch_first", [False, True])
@pytest.mark.parametrize("threads", [1, 2])
def test_the_input_projection_computes_the_live_steps_only(batch_first, threads, backend):
    """The input projection (kernels.gemm.input_projection, here through the matmul job that
    shares it) multiplies only the row groups that hold a step within its sample's length:
    rows of steps past every length in their group are left as they were (NaN here), the
    live rows are x W^T + b against a float64 product, and bit for bit what a product of
    every row (T = 0) gives them, on any thread count — rows t*N + n and, batch-first,
    n*T + t; N off every tile height."""
    from leanrnn.kernels import abi, runner

    rng = np.random.default_rng(3)
    T, N, K, U = 7, 37, 40, 3
    lengths = np.sort(rng.integers(0, T + 1, N))[::-1].copy()
    lengths[:2] = T  # some rows live at every step; many ended early
    lengths[-6:] = 0
    x = rng.standard_normal((T * N, K)).astype(np.float32)
    W = rng.standard_normal((U, K, 64)).astype(np.float32)
    b = rng.standard_normal(U * 64).astype(np.float32)
    want = x.astype(np.float64) @ W.transpose(0, 2, 1).reshape(-1, K).T.astype(np.float64) + b
    r = np.arange(T * N)
    live = (r % T < lengths[r // T]) if batch_first else (r // N < lengths[r % N])
    q0, sync = np.zeros((1, 0), np.uint8), np.zeros(abi.sync_size(threads), np.int64)

    def product(lengths_, T_):
        y = np.full((T * N, U * 64), np.nan, np.float32)
        sync[:] = 0
        bf = T_ if batch_first else 0
        runner.run("matmul", (x, W, b, K, y, lengths_, T_, bf, sync, q0, False, threads),
                   threads)  # fmt: skip
        return y

    every = product(np.zeros(0, np.int64), 0)
    y = product(lengths, T)
    np.testing.assert_allclose(y[live], want[live], rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(y[live], every[live])
    untouched = np.isnan(y).all(axis=1)
    assert not untouched[live].any()
    assert untouched[~live].mean() > 0.3  # most dead rows are left out (whole groups)
    computed = ~untouched & ~live  # dead rows riding along in a live group: right too
    np.testing.assert_array_equal(y[computed], every[computed])


BARRIER_SPECS = [
    RNNSpec("lstm", 40, 100, direction="bidirectional", peepholes=True, clip=2.0),
    RNNSpec("lstm", 30, 120, num_layers=2, proj_size=50),
    RNNSpec("lstm", 24, 96),  # the fused default path
    RNNSpec("gru", 40, 100, direction="bidirectional", linear_before_reset=False, clip=2.0),
    RNNSpec("gru", 40, 100),
    RNNSpec("rnn", 40, 100, direction="reverse"),
]


@pytest.mark.parametrize("spec", BARRIER_SPECS, ids=repr)
@pytest.mark.parametrize("threads", [2, 3])
def test_threads_meeting_every_step_match_reference(spec, threads, many_cores, backend):
    """The threads split every step's blocks and meet at each phase through atomics
    (kernels._sync), on real threads."""
    _check(spec, 7, np.float64, 3, 9, True, True, threads=threads)
    if not spec.proj_size:  # (random weights at this scale drive a float32 LSTMP chaotic)
        _check(spec, 7, np.float32, 3, 9, True, True, threads=threads)


@pytest.mark.parametrize("spec", BARRIER_SPECS[:2] + BARRIER_SPECS[3:4], ids=repr)
def test_one_thread_running_every_job_loses_nothing(spec, many_cores, monkeypatch, backend):
    """A pool may run several of an op's jobs one after another on one thread: the
    first then does every slice alone and the later ones find them done — nobody waits for a
    particular thread, so the result is the same."""
    from leanrnn.kernels import runner

    monkeypatch.setattr(runner, "pool_threads", lambda parts: 1)
    _check(spec, 5, np.float64, 2, 6, True, True, threads=3)


def test_sessions_on_two_python_threads_with_threads_each(many_cores, backend):
    """Two multi-threaded sessions run from two Python threads at once: launches take turns
    (kernels.runner.POOL_LAUNCH), results stay right, nothing hangs."""
    import threading

    rng = np.random.default_rng(3)
    specs = [RNNSpec("lstm", 32, 96), RNNSpec("gru", 32, 96)]
    models, xs, want = [], [], []
    for spec in specs:
        layers = random_layers(spec, rng, np.float64, scale=0.2)
        m = leanrnn.Model(pack(spec, layers, np.float64))
        m.session.threads = 2
        x = rng.standard_normal((20, 4, 32))
        models.append(m)
        xs.append(x)
        want.append(reference_forward(spec, layers, x, None, None, None)[0])
    errors = []

    def work(i):
        try:
            for _ in range(15):
                got = models[i].session.run(xs[i])[0]
                np.testing.assert_allclose(got, want[i], rtol=0, atol=atol(np.float64))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=work, args=(i,)) for i in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads)
    assert not errors
