"""int8-dynamic (issue 14): int8 weights and activations quantized per row as the kernels run,
summed exactly in int32 (kernels._qdot, kernels.gemm.quantize_rows, formats.quantize.dot_panel).

The oracle (independent of the packing and the kernels): float64 reference_forward on the
canonical weights rounded to 7-bit codes per output unit and gate, with every vector a weight
matrix multiplies rounded the way the kernels round it — per vector, in float32 arithmetic,
s = max|a| / 127, a ~ s * rint(a * (127 / max|a|)). Where the kernels and the oracle quantize
the same float32 numbers (a single step from given states), they agree to float32 rounding;
over many steps the kernels' float32 states drift from the oracle's float64 ones by ~1e-7, and
a code can then land on the other side of a rounding tie, so long runs are checked against the
float32 model within the format's error instead."""

from __future__ import annotations

import dataclasses
import re

import numpy as np
import pytest

import leanrnn
from helpers import random_layers, tile_gemm
from leanrnn.errors import DTypeError, ModelFormatError
from leanrnn.formats.packing import pack
from leanrnn.formats.quantize import dot_codes, dot_panel
from leanrnn.kernels.abi import (
    CODE_OFFSET,
    DOT_NARROW,
    DOT_NARROW_QMAX,
    DOT_QMAX,
    B,
    quantized_row_bytes,
)
from leanrnn.kernels.reference import reference_forward
from leanrnn.spec import RNNSpec
from tolerances import ATOL_REDUCED, ATOL_SAME_ARITHMETIC

P = "int8-dynamic"
F32 = np.float32


# ------------------------------------------------------------------------------- the oracle
def _weights(w: np.ndarray, qmax: int = DOT_QMAX) -> np.ndarray:
    """Per row (output unit and gate) of canonical W or R: s = max|w| / qmax (float32),
    w ~ s * clip(rint(w / s), -qmax, qmax)."""
    w = np.asarray(w, np.float64)
    s = (np.abs(w).max(axis=1) / qmax).astype(F32).astype(np.float64)[:, None]
    q = np.clip(np.rint(np.divide(w, s, out=np.zeros_like(w), where=s > 0)), -qmax, qmax)
    return q * s


def _codes(a: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """A float32 vector's activation codes (without the +128) and scale, in float32 as the
    kernels compute them."""
    a = np.asarray(a, F32)
    amax = np.abs(a).max(initial=F32(0))
    with np.errstate(divide="ignore", over="ignore"):
        inv = F32(127) / amax
    if not np.isfinite(inv):  # zero, or too small for 127 / max to be a float32: zero
        return np.zeros(a.shape, np.int64), F32(0)
    return np.rint(a * inv).astype(np.int64), amax / F32(127)


def _operand(a):
    q, s = _codes(np.asarray(a, F32))
    return q * np.float64(s)


def rounded(layers, qmax: int = DOT_QMAX):
    return [[dataclasses.replace(lw, W=_weights(lw.W, qmax), R=_weights(lw.R, qmax)) for lw in d]
            for d in layers]  # fmt: skip


SPECS = [
    RNNSpec("lstm", 5, 16),  # H on the panel width
    RNNSpec("lstm", 7, 19, direction="bidirectional"),  # off it
    RNNSpec("lstm", 6, 13, proj_size=5, peepholes=True, clip=2.0),  # the per-gate path
    RNNSpec("gru", 5, 16, direction="reverse"),
    RNNSpec("gru", 7, 21, direction="bidirectional", linear_before_reset=False),  # r*h too
    RNNSpec("rnn", 9, 17, direction="bidirectional", batch_first=True),
]


def _model(spec, seed, threads=None):
    rng = np.random.default_rng(seed)
    layers = random_layers(spec, rng, F32, scale=0.3)
    model = leanrnn.quantize(leanrnn.Model(pack(spec, layers, F32)), P)
    model.session.threads = threads
    return model, layers, rng


def _states(spec, rng, N):
    LD = spec.num_layers * spec.num_directions
    h0 = rng.standard_normal((LD, N, spec.output_size)).astype(F32)
    c0 = rng.standard_normal((LD, N, spec.hidden_size)).astype(F32) if spec.cell == "lstm" else None
    return h0, c0


def _one_step(spec, seed, N, threads=None):
    """One step (both directions see the same x), from random float32 states: the kernels and
    the oracle quantize the very same numbers."""
    model, layers, rng = _model(spec, seed, threads)
    x = rng.standard_normal((N, 1, spec.input_size) if spec.batch_first
                            else (1, N, spec.input_size)).astype(F32)  # fmt: skip
    h0, c0 = _states(spec, rng, N)
    y, h_n, c_n = model.session.run(x, h0, c0)
    ry, rh, rc = reference_forward(spec, rounded(layers), x, h0, c0, operand=_operand)
    tol = ATOL_REDUCED[np.uint8]
    np.testing.assert_allclose(y, ry, rtol=0, atol=tol)
    np.testing.assert_allclose(h_n, rh, rtol=0, atol=tol)
    if c_n is not None:
        np.testing.assert_allclose(c_n, rc, rtol=0, atol=tol)
    # ... and the check can fail: the oracle without the activations' rounding is farther off
    ry_w, _, _ = reference_forward(spec, rounded(layers), x, h0, c0)
    assert np.abs(y - ry_w).max() > 10 * tol


@pytest.mark.parametrize("spec", SPECS, ids=repr)
def test_a_step_matches_the_oracle_that_rounds_weights_and_activations(spec):
    _one_step(spec, 3, N=3)


@pytest.fixture
def many_cores(monkeypatch):
    monkeypatch.setattr(leanrnn.config, "max_threads", lambda: 4)


@pytest.mark.parametrize("spec", [RNNSpec("lstm", 24, 96), RNNSpec("gru", 24, 80),
                                  RNNSpec("rnn", 24, 112, direction="bidirectional")],
                         ids=repr)  # fmt: skip
def test_a_step_on_two_threads(spec, many_cores):
    """Big enough (threads.PARALLEL_MIN_MACS) that two threads split the blocks: each
    quantizes h into its own scratch row."""
    _one_step(spec, 5, N=3, threads=2)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("spec", [RNNSpec("lstm", 24, 96), RNNSpec("gru", 70, 80)], ids=repr)
def test_a_step_of_a_batch_in_tiles_of_16_rows(spec, threads, many_cores):
    """A batch of 70: on an AMX machine the projection's and the recurrence's rows in whole
    tiles of 16 run on AMX, the rest on VNNI (one thread: 64 + 6; two: each thread's share);
    K = 24 (under one k tile: all on VNNI), 70 (a K tail of 2 k4 steps), 80, 96. Elsewhere
    the same on VNNI or AVX2."""
    _one_step(spec, 11, N=70, threads=threads)


def test_a_two_layer_step_quantizes_the_first_layers_output():
    """Layer 2's input is layer 1's float32 output: the oracle rounds it to float32 first too
    (a tie flipped by float32 noise would show as one code's step, far above the tolerance)."""
    _one_step(RNNSpec("lstm", 6, 20, num_layers=2), 7, N=2)


@pytest.mark.parametrize("cell", ["LSTM", "GRU", "RNN"])
def test_long_runs_stay_within_the_formats_error_of_float32(cell):
    """T=200 with lengths, torch's default initialisation (random weights of scale 0.3 make a
    chaotic RNN, where even bf16 ends O(1) away): int8-dynamic against the float32 model, max
    abs error — measured 1.4e-3 (LSTM), 5.1e-3 (GRU), 1.3e-2 (RNN); a wrong scale or
    correction anywhere gives O(1). Each sample's tail past its length is zero."""
    m32 = getattr(leanrnn, cell)(12, 48, num_layers=2, seed=11)
    model = leanrnn.quantize(m32, P)
    x = np.random.default_rng(11).standard_normal((200, 4, 12)).astype(F32)
    lengths = np.array([200, 150, 1, 0])
    y, h_n, _ = model.session.run(x, lengths=lengths)
    y32, _, _ = m32.session.run(x, lengths=lengths)
    err = np.abs(y - y32).max()
    assert 1e-4 < err < 5e-2, err  # quantized (not float32), and close to it
    assert (y[1:, 2] == 0).all() and (y[:, 3] == 0).all() and (y[150:, 1] == 0).all()
    np.testing.assert_array_equal(h_n[:, 3], 0)  # length 0: the initial state


def test_a_stream_of_single_steps_equals_one_run():
    m = leanrnn.quantize(leanrnn.LSTM(6, 20, num_layers=2, seed=1), P)
    x = np.random.default_rng(0).standard_normal((5, 2, 6)).astype(F32)
    y, _, _ = m.session.run(x)
    st = m.session.stream(batch=2)
    steps = np.stack([st.feed(x[t]) for t in range(5)])
    # the same rows quantized the same way: only the projection's tiling differs
    np.testing.assert_allclose(steps, y, rtol=0, atol=ATOL_SAME_ARITHMETIC[F32])


def test_non_finite_input_propagates_and_the_session_stays_usable():
    m = leanrnn.quantize(leanrnn.GRU(4, 16, seed=2), P)
    x = np.random.default_rng(1).standard_normal((3, 2, 4)).astype(F32)
    good = m(x)[0]
    bad = x.copy()
    bad[1, 0, 2] = np.nan
    y = m(bad)[0]
    assert np.isnan(y[1:, 0]).all() and np.isfinite(y[:, 1]).all()
    np.testing.assert_allclose(y[:, 1], good[:, 1], rtol=0, atol=ATOL_SAME_ARITHMETIC[F32])
    np.testing.assert_array_equal(m(x)[0], good)


def test_the_jit_backend_runs_int8_dynamic_jobs_too(monkeypatch):
    """The same jobs on numba's JIT (what runs where no C compiler is): one small cell."""
    monkeypatch.setattr(leanrnn.config, "_backend", "jit")
    _one_step(RNNSpec("rnn", 5, 17, direction="bidirectional"), 9, N=2)


# ---------------------------------------------------- the kernels' own pieces, on any machine
@pytest.mark.parametrize("qmax", [DOT_QMAX, DOT_NARROW_QMAX], ids=["8-bit", "7-bit"])
@pytest.mark.parametrize("K", [11, 37])
@pytest.mark.parametrize("name", ["avx512", "avx2", "sse"])
def test_the_integer_tile_on_vnni_avx2_and_plain_integer_ops(name, K, qmax):
    """AVX-512 VNNI's vpdpbusd tile (where this CPU has VNNI; AVX2's elsewhere), AVX2's
    vpmaddubsw/vpmaddwd tile (what every x86 with AVX2 runs: its sign trick on 8-bit codes,
    its direct products on 7-bit ones) and the plain-IR one (every other CPU): exact integer
    sums, codes at the extremes (255 x +-qmax, and 1: the largest products of each path, whose
    pair sums must not saturate int16 on AVX2), the lone-row GEMV (its k loop split over
    accumulator sets with VNNI: K=37 has an odd number of 4-input steps) and several rows, one
    and four groups, panel 1 of 2 (its own scales), K off a multiple of 4, modes 0, 1, 2."""
    run = tile_gemm(name)
    rng = np.random.default_rng(4)
    bias = rng.standard_normal(4 * B).astype(F32)
    for nvec in (1, 4):
        cols = nvec * B
        for M in (1, 7):
            panel, deq, A, act = _dot_operands(rng, K, M, Xp=40, qmax=qmax)  # rows past K: 0
            C0 = rng.standard_normal((M, cols)).astype(F32)
            prod = act @ deq[1, :, :cols]
            for mode, init in ((0, 0.0), (1, C0.astype(np.float64)), (2, bias[:cols])):
                C = C0.copy()
                run(nvec, panel, panel.shape[1] * panel.shape[2], A, 0, M, K, C, mode, bias)
                np.testing.assert_allclose(C, prod + init, rtol=2e-7, atol=ATOL_REDUCED[np.uint8])


@pytest.mark.parametrize("qmax", [DOT_QMAX, DOT_NARROW_QMAX], ids=["8-bit", "7-bit"])
def test_avx2_multiplies_flagged_panels_directly_from_any_column_slice(qmax):
    """AVX2's two loops give the same exact sums, so tell them apart by what they read: the
    direct loop (flagged, 7-bit panels) takes the corrections out, the sign trick (8-bit) never
    reads them. With every correction of panel 1 raised by 128 (the flag kept), the direct
    loop's outputs drop by 128 * s_i * s_j and the sign trick's stay — here from a slice that
    starts at column group 1 (the flag is read at the slice's first column)."""
    run = tile_gemm("avx2")
    rng = np.random.default_rng(7)
    K, M = 37, 7
    panel, deq, A, act = _dot_operands(rng, K, M, qmax=qmax)
    X4 = panel.shape[1] - 2
    panel[1, X4 + 1].view(np.int32)[...] += CODE_OFFSET
    srow = A[:, -4:].copy().view(F32).astype(np.float64)  # [M, 1]
    scol = dot_codes(panel)[1][1].astype(np.float64)
    g = 1  # columns 16..31 of panel 1, 4 bytes per column in a panel row
    C = np.zeros((M, B), F32)
    run(1, panel, panel.shape[1] * panel.shape[2] + 4 * B * g, A, 0, M, K, C, 0, C[0])
    want = act @ deq[1, :, g * B : (g + 1) * B]
    if qmax <= DOT_NARROW_QMAX:
        want = want - CODE_OFFSET * srow * scol[g * B : (g + 1) * B]
    np.testing.assert_allclose(C, want, rtol=2e-7, atol=ATOL_REDUCED[np.uint8])


def _dot_operands(rng, K, M, Xp=None, qmax=DOT_QMAX):
    """A two-panel int8-dynamic panel of 64 columns over K inputs (Xp rows, default K rounded
    up to 4; panel 1: codes +qmax along column 0, -qmax along column 1) with its float64
    dequantized weights [2, K, 64], and M activation rows (row 0 all 255, row 1 all 1: the
    extremes; a lone row all 1) with their float64 values."""
    Wd, Xp = 4 * B, Xp or (K + 3) // 4 * 4
    w = rng.standard_normal((2, Xp, Wd)).astype(F32)
    w[:, K:] = 0
    w[1, :K, 0], w[1, :K, 1] = 127.0, -127.0
    panel = dot_panel(w, qmax)
    q, s, corr = dot_codes(panel)
    assert (corr & DOT_NARROW == (DOT_NARROW if qmax <= DOT_NARROW_QMAX else 0)).all()
    deq = q.astype(np.float64)[:, :K] * s.astype(np.float64)[:, None, :]
    ld = quantized_row_bytes(K)
    A = np.zeros((M, ld), np.uint8)
    codes = rng.integers(1, 256, (M, K))
    codes[0], codes[min(1, M - 1)] = 255, 1
    A[:, :K] = codes
    srow = rng.random(M).astype(F32)
    A[:, ld - 4 :] = srow.view(np.uint8).reshape(M, 4)
    return panel, deq, A, (codes - CODE_OFFSET) * srow.astype(np.float64)[:, None]


def test_the_amx_tile_on_whole_and_partial_tiles_of_rows():
    """int8-dynamic's AMX tile (_qdot: tdpbusd on 2 x 2 blocks of 16-row tiles, the rows and
    k4 steps past whole tiles on VNNI) where this process can run AMX — and then it must be
    AMX: the machine code has tdpbusd (a CPU listing AMX whose kernel refuses the tile state —
    an old kernel, a sandbox — gets the fallback, checked as below: refusing is the OS's
    right, not a defect); elsewhere the tile int8_dot picks, on
    the same shapes, and int8_dot never says "amx" nor does the AMX tile compile. Rows 16 (one
    tile), 17, 33, 64 (two 2 x 2 blocks), 70; K 11 (no whole k tile), 64, 100, 130 (K tails of
    9 and 1 k4 steps), 512; one and four groups; modes 0, 1, 2; exact integer sums, so
    bit-for-bit the VNNI tile's output."""
    from leanrnn.kernels import _cpu, _qdot

    avx512 = _cpu.ISAS["avx512"]
    if _cpu.amx_usable():
        run, vnni = tile_gemm("avx512", "amx"), tile_gemm("avx512", "vnni")
    else:
        assert _cpu.int8_dot(avx512) != "amx"
        with pytest.raises(ValueError, match="AMX"):
            _qdot.codegen(4, avx512, "amx")
        run, vnni = tile_gemm("avx512"), None
    rng = np.random.default_rng(7)
    for K in (11, 64, 100, 130, 512):
        panel, deq, A0, act0 = _dot_operands(rng, K, 70)
        bias = rng.standard_normal(4 * B).astype(F32)
        for nvec in (1, 4):
            cols = nvec * B
            for M in (16, 17, 33, 64, 70):
                A, act = A0[:M], act0[:M]
                C0 = rng.standard_normal((M, cols)).astype(F32)
                prod = act @ deq[1, :, :cols]
                for mode, init in ((0, 0.0), (1, C0.astype(np.float64)), (2, bias[:cols])):
                    C = C0.copy()
                    run(nvec, panel, panel.shape[1] * panel.shape[2], A, 0, M, K, C, mode, bias)
                    np.testing.assert_allclose(C, prod + init, rtol=2e-7,
                                               atol=ATOL_REDUCED[np.uint8])  # fmt: skip
                    if vnni is not None:
                        C2 = C0.copy()
                        vnni(nvec, panel, panel.shape[1] * panel.shape[2], A, 0, M, K, C2, mode,
                             bias)  # fmt: skip
                        np.testing.assert_array_equal(C, C2)
    if vnni is not None:
        asm = "\n".join(run.inspect_asm().values())
        assert re.search(r"\btdpbusd\b", asm) and re.search(r"\bldtilecfg\b", asm)
        assert not re.search(r"\btdpbusd\b", "\n".join(vnni.inspect_asm().values()))


def test_a_cpu_without_amx_never_gets_amx_code(monkeypatch):
    """int8_dot's choice from the CPU's flags (whatever this machine has): AVX-512 VNNI
    without AMX-INT8 is "vnni", and the AMX tile refuses to compile there."""
    from leanrnn.kernels import _cpu, _qdot

    monkeypatch.setattr(_cpu, "_flags", lambda: ({"avx512f", "avx512_vnni", "amx_tile"}, "x86_64"))
    avx512 = _cpu.ISAS["avx512"]
    assert _cpu.int8_dot(avx512) == "vnni" and not _cpu.amx_usable()
    with pytest.raises(ValueError, match="AMX"):
        _qdot.codegen(4, avx512, "amx")


@pytest.mark.parametrize("K", [13, 100, 517])
def test_activation_codes_are_numpys_float32_rounding(K):
    """quantize_rows against numpy in float32: the same codes (ties to even) and scale bytes;
    an all-zero row (with -0.0), a NaN row, an inf row, and a row so small (max 2e-37, a
    denormal among them) that 127 / max overflows: it quantizes as zero, scale 0. K past the
    vector loops' width and off it (the max is taken on the bits, the rounding by adding
    1.5 * 2**23: both vectorized)."""
    from leanrnn.kernels.gemm import quantize_rows

    rng = np.random.default_rng(6)
    A = rng.standard_normal((7, K + 3)).astype(F32)
    A[1, :K] = np.arange(K, dtype=F32) % 13 - 6.0  # max 6: codes 127 * v / 6 hit .5 ties
    A[1, K - 1] = -6.0  # the largest magnitude negative, last
    A[2] = 0
    A[2, K // 2] = -0.0
    A[3, 4] = np.nan
    A[4, 5] = np.inf
    A[6, :K] = np.linspace(-2e-37, 1e-39, K, dtype=F32)
    ld = quantized_row_bytes(K)
    flat = np.full(6 * ld + 3, 7, np.uint8)
    quantize_rows(A, 1, 7, K, flat)
    assert (flat[6 * ld :] == 7).all()  # nothing past the rows
    out = flat[: 6 * ld].reshape(6, ld)
    scales = out[:, ld - 4 :].copy().view(F32).ravel()
    for r, row in enumerate(A[1:7]):
        if not np.isfinite(row[:K]).all():
            assert np.isnan(scales[r])
            continue
        q, s = _codes(row[:K])
        np.testing.assert_array_equal(out[r, :K].astype(np.int64) - CODE_OFFSET, q)
        assert scales[r] == s
    assert (out[1, :K] == CODE_OFFSET).all() and scales[1] == 0
    assert (out[5, :K] == CODE_OFFSET).all() and scales[5] == 0


@pytest.mark.parametrize("backend", ["native", "jit"])
def test_huge_finite_inputs_keep_their_codes_inside_the_kernels(backend, monkeypatch):
    """Input rows whose every |x| is past float32's max / 127 (~2.7e36): their codes are
    rint(x * (127 / max|x|)) as numpy's float32 gives them. quantize_rows runs inside the
    fast-math kernels, and numba compiles a callee with its caller's fast-math flags unless
    it sets its own: reassociated to (x * 127) / max|x|, every product overflowed to inf and
    the whole row's codes became 0 — outputs of tanh(b + R h) instead of +-1."""
    monkeypatch.setattr(leanrnn.config, "_backend", backend)
    spec = RNNSpec("rnn", 5, 17)
    model, layers, rng = _model(spec, 13)
    mag = rng.uniform(0.3, 1.0, (1, 3, 5)) * np.where(rng.random((1, 3, 5)) < 0.5, -1, 1)
    x = (mag * 1e37).astype(F32)
    h0, _ = _states(spec, rng, 3)
    y = model.session.run(x, h0)[0]
    ry = reference_forward(spec, rounded(layers), x, h0, operand=_operand)[0]
    np.testing.assert_allclose(y, ry, rtol=0, atol=ATOL_REDUCED[np.uint8])


def test_panel_codes_are_8_bit_and_dequantize_within_half_a_step():
    rng = np.random.default_rng(8)
    w = rng.standard_normal((3, 32, 64)).astype(F32)
    q, s, corr = dot_codes(dot_panel(w))
    assert np.abs(q.astype(np.int64)).max() == DOT_QMAX
    np.testing.assert_array_equal(corr, CODE_OFFSET * q.astype(np.int64).sum(axis=1))
    err = np.abs(q * s[:, None, :].astype(np.float64) - w)
    assert (err <= s[:, None, :] * (0.5 + 1e-6)).all()


def test_weights_shrink_to_about_a_quarter():
    m = leanrnn.LSTM(64, 256, seed=0)
    q = leanrnn.quantize(m, P)
    assert q.weights.precision == P
    assert q.weights.weight_bytes < m.weights.weight_bytes / 3.8


def test_lrnn_round_trip_is_bit_exact(tmp_path):
    m = leanrnn.quantize(leanrnn.GRU(5, 20, num_layers=2, seed=3), P)
    path = leanrnn.save(m, tmp_path / "q.lrnn")
    back = leanrnn.load(path)
    assert back.weights.precision == P
    for name, a in m.weights.tensors().items():
        np.testing.assert_array_equal(back.weights.tensors()[name], a)
    x = np.random.default_rng(0).standard_normal((4, 2, 5)).astype(F32)
    np.testing.assert_array_equal(back(x)[0], m(x)[0])


def _flags(model) -> list[np.ndarray]:
    """Every int8-dynamic panel's DOT_NARROW flags, [U, Wd] per W and R panel."""
    return [dot_codes(getattr(pl, name))[2] & DOT_NARROW
            for dirs in model.weights.layers for pl in dirs for name in ("Wt", "Rt")]  # fmt: skip


def test_a_file_with_7_bit_codes_still_runs_to_its_own_rounding(tmp_path, monkeypatch):
    """Files written before the codes were 8-bit (s = max|w| / 63, and no DOT_NARROW flag in
    the corrections then) load and run as they are, flagged as they load (so AVX2 takes its
    direct loop): one step against the oracle that rounds the weights to 7 bits — and 8 bits
    would be farther off, so the kernels really did use the file's codes and scales."""
    from leanrnn.formats import quantize as fq

    spec = RNNSpec("lstm", 5, 19)
    rng = np.random.default_rng(11)
    layers = random_layers(spec, rng, F32, scale=0.3)
    with monkeypatch.context() as mp:
        mp.setattr(fq, "_narrow", lambda amax: np.zeros(amax.shape, np.int32))  # the old writer
        old = leanrnn.quantize(leanrnn.Model(pack(spec, layers, F32)), P, reduce_range=True)
        assert not any(f.any() for f in _flags(old))
        path = leanrnn.save(old, tmp_path / "old.lrnn")
    model = leanrnn.load(path)
    assert all((f == DOT_NARROW).all() for f in _flags(model))
    x = rng.standard_normal((1, 3, 5)).astype(F32)
    h0, c0 = _states(spec, rng, 3)
    y = model.session.run(x, h0, c0)[0]
    tol = ATOL_REDUCED[np.uint8]

    def oracle(qmax):
        return reference_forward(spec, rounded(layers, qmax), x, h0, c0, operand=_operand)[0]

    np.testing.assert_allclose(y, oracle(63), rtol=0, atol=tol)
    assert np.abs(y - oracle(DOT_QMAX)).max() > 10 * tol


def test_8_bit_codes_halve_the_weights_error():
    """The same model's outputs over T=200 against float32: 8-bit codes (this format) against
    7-bit ones (the format before): clearly closer, as half the weight step should make them."""
    spec = RNNSpec("lstm", 16, 64)
    rng = np.random.default_rng(12)
    layers = random_layers(spec, rng, F32, scale=0.15)
    x = rng.standard_normal((200, 2, 16)).astype(F32)
    want = reference_forward(spec, layers, x)[0]
    err = {}
    for qmax in (63, DOT_QMAX):
        got = reference_forward(spec, rounded(layers, qmax), x, operand=_operand)[0]
        err[qmax] = np.abs(got - want).mean()
    model = leanrnn.quantize(leanrnn.Model(pack(spec, layers, F32)), P)
    mine = np.abs(model.session.run(x)[0] - want).mean()
    assert err[DOT_QMAX] < 0.75 * err[63]
    assert mine < 0.75 * err[63]


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("spec", [SPECS[1], SPECS[4], SPECS[5]], ids=repr)
def test_reduce_range_steps_match_the_oracle_of_7_bit_weights(spec, threads):
    """reduce_range=True: 7-bit codes (twice the weight step), every panel flagged, and one
    step on this CPU's int8 path (on AVX2 its direct loop) against the oracle that rounds the
    weights to 7 bits — farther from the 8-bit oracle, so the codes really are 7-bit."""
    rng = np.random.default_rng(21)
    layers = random_layers(spec, rng, F32, scale=0.3)
    model = leanrnn.quantize(leanrnn.Model(pack(spec, layers, F32)), P, reduce_range=True)
    model.session.threads = threads
    assert all((f == DOT_NARROW).all() for f in _flags(model))
    for dirs in model.weights.layers:
        for pl in dirs:
            assert np.abs(dot_codes(pl.Rt)[0].astype(np.int16)).max() == DOT_NARROW_QMAX
    N = 5
    x = rng.standard_normal((N, 1, spec.input_size) if spec.batch_first
                            else (1, N, spec.input_size)).astype(F32)  # fmt: skip
    h0, c0 = _states(spec, rng, N)
    y = model.session.run(x, h0, c0)[0]
    tol = ATOL_REDUCED[np.uint8]

    def oracle(qmax):
        return reference_forward(spec, rounded(layers, qmax), x, h0, c0, operand=_operand)[0]

    np.testing.assert_allclose(y, oracle(DOT_NARROW_QMAX), rtol=0, atol=tol)
    assert np.abs(y - oracle(DOT_QMAX)).max() > 10 * tol


def test_an_8_bit_file_claiming_7_bit_codes_runs_as_8_bit(tmp_path):
    """A file whose 8-bit panels carry the DOT_NARROW flag (corrections otherwise right): the
    flag is set again from the codes at load, so AVX2 never runs its direct loop on codes whose
    int16 pair sums would saturate — the outputs are the honest file's, bit for bit."""
    m = leanrnn.quantize(leanrnn.LSTM(24, 48, num_layers=2, seed=5), P)
    honest = leanrnn.load(leanrnn.save(m, tmp_path / "honest.lrnn"))
    for dirs in m.weights.layers:
        for pl in dirs:
            for name in ("Wt", "Rt"):
                panel = getattr(pl, name)
                panel[:, -1].view(np.int32)[...] |= DOT_NARROW
    lying = leanrnn.load(leanrnn.save(m, tmp_path / "lying.lrnn"))
    assert not any(f.any() for f in _flags(lying))
    x = np.random.default_rng(1).standard_normal((30, 3, 24)).astype(F32) * 4
    np.testing.assert_array_equal(lying(x)[0], honest(x)[0])


def test_reduce_range_is_int8_dynamics_alone():
    m = leanrnn.LSTM(4, 16, seed=1)
    for precision in ("bf16", "int8"):
        with pytest.raises(DTypeError, match=r"reduce_range.*int8-dynamic"):
            leanrnn.quantize(m, precision, reduce_range=True)
    with pytest.raises(DTypeError, match=r"reduce_range='no'; expected True or False"):
        leanrnn.quantize(m, P, reduce_range="no")
    # 8-bit codes are not rounded again (before: handed back as they were, silently)
    q8 = leanrnn.quantize(m, P)
    with pytest.raises(DTypeError, match=r"8-bit codes already.*float32 model with reduce_range"):
        leanrnn.quantize(q8, P, reduce_range=True)
    q7 = leanrnn.quantize(m, P, reduce_range=True)
    again = leanrnn.quantize(q7, P, reduce_range=True).weights  # not rounded again: a copy
    assert again is not q7.weights and np.array_equal(again.buffer, q7.weights.buffer)


def test_pickles_and_copies_get_their_flags_from_their_codes():
    """A pickle of a 7-bit model without flags (as before them) comes back flagged; one whose
    8-bit panels claim the flag comes back without it, running as the honest model."""
    import copy
    import pickle

    from leanrnn.formats import quantize as fq

    m = leanrnn.LSTM(12, 40, num_layers=2, seed=4)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fq, "_narrow", lambda amax: np.zeros(amax.shape, np.int32))
        old = leanrnn.quantize(m, P, reduce_range=True)
    assert not any(f.any() for f in _flags(old))
    for back in (pickle.loads(pickle.dumps(old)), copy.deepcopy(old)):
        assert all((f == DOT_NARROW).all() for f in _flags(back))
    honest = leanrnn.quantize(m, P)
    lying = copy.deepcopy(honest)
    for dirs in lying.weights.layers:
        for pl in dirs:
            for panel in (pl.Wt, pl.Rt):
                panel[:, -1].view(np.int32)[...] |= DOT_NARROW
    back = pickle.loads(pickle.dumps(lying))
    assert not any(f.any() for f in _flags(back))
    x = np.random.default_rng(2).standard_normal((20, 2, 12)).astype(F32) * 4
    np.testing.assert_array_equal(back(x)[0], honest(x)[0])


def test_convert_reduce_range_writes_7_bit_codes(tmp_path, capsys):
    from leanrnn.cli import main

    src = leanrnn.save(leanrnn.GRU(6, 20, seed=2), tmp_path / "f.lrnn")
    dst = str(tmp_path / "q.lrnn")
    assert main(["convert", str(src), dst, "--precision", P, "--reduce-range"]) == 0
    q = leanrnn.load(dst)
    assert q.weights.precision == P
    assert all((f == DOT_NARROW).all() for f in _flags(q))
    capsys.readouterr()
    assert main(["inspect", dst]) == 0
    assert "weight precision: int8-dynamic, 7-bit codes (" in capsys.readouterr().out
    full = str(tmp_path / "q8.lrnn")
    assert main(["convert", str(src), full, "--precision", P]) == 0
    assert main(["inspect", full]) == 0
    assert "weight precision: int8-dynamic (" in capsys.readouterr().out
    assert main(["convert", str(src), str(tmp_path / "b.lrnn"), "--precision", "bf16",
                 "--reduce-range"]) == 1  # fmt: skip
    assert "reduce_range" in capsys.readouterr().err
    assert main(["convert", str(src), str(tmp_path / "b.lrnn"), "--reduce-range"]) == 1
    assert "needs precision 'int8-dynamic'" in capsys.readouterr().err
    # an 8-bit int8-dynamic file is not rounded again to 7 bits (before: written as it was)
    assert main(["convert", full, str(tmp_path / "b.lrnn"), "--precision", P,
                 "--reduce-range"]) == 1  # fmt: skip
    assert "8-bit codes already" in capsys.readouterr().err
    assert not (tmp_path / "b.lrnn").exists()


@pytest.mark.parametrize("dot", ["avx2", "vnni"])
def test_convert_to_8_bit_codes_names_reduce_range_where_avx2_multiplies(tmp_path, capsys,
                                                                        monkeypatch, dot):  # fmt: skip
    from leanrnn.cli import main
    from leanrnn.kernels import _cpu

    monkeypatch.setattr(_cpu, "int8_dot", lambda isa: dot)
    src = leanrnn.save(leanrnn.GRU(6, 20, seed=2), tmp_path / "f.lrnn")
    assert main(["convert", str(src), str(tmp_path / "q.lrnn"), "--precision", P]) == 0
    err = capsys.readouterr().err
    assert ("--reduce-range" in err) == (dot == "avx2"), err
    assert main(["convert", str(src), str(tmp_path / "q7.lrnn"), "--precision", P,
                 "--reduce-range"]) == 0  # fmt: skip
    assert "--reduce-range" not in capsys.readouterr().err


def test_a_file_with_corrections_that_do_not_match_its_codes_is_refused(tmp_path):
    m = leanrnn.quantize(leanrnn.LSTM(4, 16, seed=1), P)
    path = str(leanrnn.save(m, tmp_path / "q.lrnn"))
    panel = m.weights.layers[0][0].Rt
    corr_row = panel[0, -1].tobytes()  # panel 0's corrections
    data = bytearray(open(path, "rb").read())
    at = data.find(panel[0].tobytes())
    assert at > 0
    off = at + panel.shape[1] * panel.shape[2] - len(corr_row)
    data[off] ^= 2  # one correction off by two (bit 0 is the DOT_NARROW flag, set at load)
    bad = tmp_path / "bad.lrnn"
    bad.write_bytes(bytes(data))
    with pytest.raises(ModelFormatError, match="corrections"):
        leanrnn.load(str(bad))
