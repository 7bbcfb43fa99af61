"""Threads on batch slices (kernels._sync.share): from SHARE_TILES register tiles of rows per
thread, each thread runs every step of its own tile-aligned samples with no barrier. The results
must equal the float64 reference and be bit-identical to one thread's, for every cell option
that adds a phase (LSTM projection, GRU r*h), odd batches, short sequences and small H."""

from itertools import pairwise

import numpy as np
import pytest

import leanrnn
from helpers import random_layers
from leanrnn.formats.packing import pack
from leanrnn.kernels import _cpu, _sync, abi
from leanrnn.kernels.reference import reference_forward
from leanrnn.spec import RNNSpec
from tolerances import RTOL, atol

SPECS = [
    RNNSpec("lstm", 40, 24, direction="bidirectional", peepholes=True, clip=2.0),
    RNNSpec("lstm", 20, 40, num_layers=2, proj_size=12),
    RNNSpec("lstm", 16, 8),  # the fused default path, one unit block (H < 16)
    RNNSpec("gru", 24, 40, direction="bidirectional", linear_before_reset=False, clip=2.0),
    RNNSpec("gru", 24, 40),
    RNNSpec("rnn", 24, 37, direction="reverse"),
]


def _smallest_split(parts: int) -> int:
    return _sync.SHARE_TILES * _sync.ALIGN * parts


@pytest.mark.parametrize("parts", [2, 3, 4])
@pytest.mark.parametrize("extra", [0, 1, 5, 29])
def test_share_cuts_tile_aligned_disjoint_slices(parts, extra):
    N = _smallest_split(parts) + extra
    got = [_sync.share.py_func(N, me, parts, _sync.SHARE_TILES, _sync.ALIGN) for me in range(parts)]
    assert all(s == 1 for _, _, s in got)  # no block slices: no barrier
    bounds = [(a, b) for a, b, _ in got]
    assert bounds[0][0] == 0 and bounds[-1][1] == N
    for (_, b), (a, _) in pairwise(bounds):
        assert a == b  # disjoint and covering
    for a, b in bounds:
        assert a % _sync.ALIGN == 0 and b - a >= (_sync.SHARE_TILES - 1) * _sync.ALIGN


def test_share_cuts_bf16_on_amx_at_whole_amx_tiles():
    """bf16 on AMX cuts at 16 rows (kernels.gemm.slice_rows): N=64 on 2 threads is 32 / 32
    rows, where 6-row cuts gave 30 / 34 (the 34: a 32-row AMX block and a 2-row one costing
    16); whether to slice is the engine's rule still (ALIGN's), so N=48 slices as before."""
    assert [_sync.share.py_func(64, me, 2, _sync.SHARE_TILES, 16) for me in (0, 1)] == [
        (0, 32, 1), (32, 64, 1)]  # fmt: skip
    N = _smallest_split(2)
    got = [_sync.share.py_func(N, me, 2, _sync.SHARE_TILES, 16) for me in (0, 1)]
    plain = [_sync.share.py_func(N, me, 2, _sync.SHARE_TILES, _sync.ALIGN) for me in (0, 1)]
    assert [s for _, _, s in got] == [s for _, _, s in plain] == [1, 1]
    assert got[0][0] == 0 and got[0][1] == got[1][0] and got[1][1] == N and got[0][1] % 16 == 0


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_share_keeps_small_batches_on_block_slices(parts):
    N = max(1, _smallest_split(parts) - 1) if parts > 1 else 1000
    for me in range(parts):
        assert _sync.share.py_func(N, me, parts, _sync.SHARE_TILES, _sync.ALIGN) == (0, N, parts)


def _run(spec, layers, x, h0, c0, lengths, threads, dtype):
    model = leanrnn.Model(pack(spec, layers, dtype))
    model.session.threads = threads
    out = model.session.run(x, h0, c0, lengths)
    return out, model.session


@pytest.mark.parametrize("spec", SPECS, ids=repr)
@pytest.mark.parametrize("threads,extra", [(2, 1), (2, 16), (3, 5)])
def test_batch_slices_match_reference_and_one_thread(spec, threads, extra, many_cores, backend):
    N, T = _smallest_split(threads) + extra, 5
    for dtype in (np.float64, np.float32):
        if dtype == np.float32 and spec.proj_size:
            continue  # (random weights at this scale drive a float32 LSTMP chaotic)
        rng = np.random.default_rng(11)
        layers = random_layers(spec, rng, dtype, scale=0.3)
        C, K, H = spec.input_size, spec.output_size, spec.hidden_size
        LD = spec.num_layers * spec.num_directions
        x = rng.standard_normal((T, N, C)).astype(dtype)
        lengths = rng.integers(0, T + 1, size=N)
        h0 = rng.standard_normal((LD, N, K)).astype(dtype)
        c0 = rng.standard_normal((LD, N, H)).astype(dtype) if spec.cell == "lstm" else None
        got, session = _run(spec, layers, x, h0, c0, lengths, threads, dtype)
        # the slices ran: no thread claimed a block slice (kernels._sync: claim)
        assert session._sync[abi.CLAIM0 * abi.LINE] == 0
        one, _ = _run(spec, layers, x, h0, c0, lengths, 1, dtype)
        want = reference_forward(spec, layers, x, h0, c0, lengths)
        for g, o, w in zip(got, one, want, strict=True):
            if w is None:
                continue
            np.testing.assert_array_equal(g, o)  # the same tiles, the same bits
            np.testing.assert_allclose(g, w, rtol=RTOL[dtype], atol=atol(dtype))


def test_small_batch_still_splits_blocks(many_cores):
    """Below the threshold the threads split each step's unit blocks (and claim slices)."""
    spec = RNNSpec("lstm", 16, 40)
    rng = np.random.default_rng(2)
    layers = random_layers(spec, rng, np.float64, scale=0.3)
    N = _smallest_split(2) - 1
    x = rng.standard_normal((4, N, 16))
    (y, _, _), session = _run(spec, layers, x, None, None, None, 2, np.float64)
    assert session._sync[abi.CLAIM0 * abi.LINE] > 0
    want = reference_forward(spec, layers, x, None, None, None)[0]
    np.testing.assert_allclose(y, want, rtol=RTOL[np.float64], atol=atol(np.float64))


@pytest.mark.parametrize("parts", [1, 2, 3])
def test_engine_and_kernels_agree_on_when_batches_are_sliced(parts):
    """The engine plans its chunks with _cpu.batch_slices; the kernels cut with _sync.share."""
    for N in range(1, _smallest_split(max(parts, 2)) + 8):
        sliced = (
            _sync.share.py_func(N, 0, parts, _sync.SHARE_TILES, _sync.ALIGN)[2] == 1 and parts > 1
        )
        assert sliced == _cpu.batch_slices(N, parts)


def test_sliced_runs_take_chunks_of_a_quarter_of_the_last_level_cache(many_cores):
    """Threads on batch slices meet only where chunks end: their automatic chunk fills a quarter
    of the L3 instead of XW_BUDGET; one thread, or small batches, keep XW_BUDGET."""
    from leanrnn.engine import session as engine

    spec = RNNSpec("lstm", 64, 128)
    model = leanrnn.Model(pack(spec, random_layers(spec, np.random.default_rng(0)), np.float32))
    s = model.session
    N = _smallest_split(2)
    step = N * s.weights.Gp * 4
    budget = max(engine.XW_BUDGET, min(_cpu.caches()["L3"] // 4, 2 * engine.SLICED_XW_PER_THREAD))
    s.threads = 2
    assert s.auto_chunk(N) == max(engine.MIN_AUTO_CHUNK, budget // step)
    assert s.auto_chunk(N - 1) == max(engine.MIN_AUTO_CHUNK, engine.XW_BUDGET // (step - step // N))
    s.threads = 1
    assert s.auto_chunk(N) == max(engine.MIN_AUTO_CHUNK, engine.XW_BUDGET // step)


def test_sliced_chunks_stay_a_few_mib_per_thread_where_l3_is_a_socket(many_cores, monkeypatch):
    """A VM reports its whole socket's L3 (300 MiB on a 2-vCPU Xeon): a quarter of it made the
    chunk of an N=64 LSTM 512 hold 75 MiB of xw (memory_bars: 148 MiB of scratch at T=1000
    where torch needs 254). The chunk's xw stays within SLICED_XW_PER_THREAD per thread."""
    from leanrnn.engine import session as engine

    monkeypatch.setattr(_cpu, "caches", lambda: {"L1d": 48 << 10, "L2": 2 << 20, "L3": 300 << 20})
    spec = RNNSpec("lstm", 512, 512)
    model = leanrnn.Model(pack(spec, random_layers(spec, np.random.default_rng(0)), np.float32))
    s = model.session
    s.threads = 2
    N = 64
    assert _cpu.batch_slices(N, 2)
    step = N * s.weights.Gp * 4
    chunk = s.auto_chunk(N)
    assert chunk * step <= 2 * engine.SLICED_XW_PER_THREAD
    assert chunk * step > engine.XW_BUDGET  # still longer than an unsliced run's


@pytest.mark.parametrize("spec", [*SPECS, RNNSpec("lstm", 16, 40, batch_first=True)], ids=repr)
@pytest.mark.parametrize("length", [7, 4, 3, 0])
def test_one_sample_loop_matches_reference_and_block_slices(spec, length, many_cores, backend,
                                                            monkeypatch):  # fmt: skip
    """One sample runs kernels.recurrent._steps_one, without the batch loop's bookkeeping (live-row
    ends, frozen rows); with a slot table (serve's run_slots) the same sample takes the batch
    loop. One thread, two threads' block slices, chunks and the slot path must give each
    other's bits and the reference's values — also for a length short of T (the steps after
    it not run, the state the last valid step's, y zero past it), zero steps, the reverse
    direction and a second phase (which keeps the batch loop)."""
    monkeypatch.setattr("leanrnn.engine.session.PARALLEL_MIN_MACS", 0)  # threads at any size
    T, N = 7, 1
    for dtype in (np.float64, np.float32):
        rng = np.random.default_rng(5)
        layers = random_layers(spec, rng, dtype, scale=0.3)
        C, K, H = spec.input_size, spec.output_size, spec.hidden_size
        LD = spec.num_layers * spec.num_directions
        x = rng.standard_normal((N, T, C) if spec.batch_first else (T, N, C)).astype(dtype)
        lengths = np.array([length])
        h0 = rng.standard_normal((LD, N, K)).astype(dtype)
        c0 = rng.standard_normal((LD, N, H)).astype(dtype) if spec.cell == "lstm" else None
        one, _ = _run(spec, layers, x, h0, c0, lengths, 1, dtype)
        two, session = _run(spec, layers, x, h0, c0, lengths, 2, dtype)
        if length > 0:  # (no step, no slice to claim)
            assert session._sync[abi.CLAIM0 * abi.LINE] > 0  # two threads took block slices
        want = reference_forward(spec, layers, x, h0, c0, lengths)
        model = leanrnn.Model(pack(spec, layers, dtype))
        model.session.threads = 1
        st = model.session.slot_states(3)
        st.put(2, h0[:, 0], None if c0 is None else c0[:, 0])
        y_slots = model.session.run_slots(x, st, np.array([2]), lengths)
        slots = (y_slots, st.h[:, 2:3], None if c0 is None else st.c[:, 2:3])
        if spec.num_directions == 1:
            model.session.chunk = 2  # chunks of 2 steps: the length cut per chunk
        chunked = model.session.run(x, h0, c0, lengths)
        for g, o, c, b, w in zip(one, two, chunked, slots, want, strict=True):
            if w is None:
                continue
            np.testing.assert_array_equal(g, o)  # the same GEMVs and updates, the same bits
            np.testing.assert_array_equal(g, c)
            np.testing.assert_array_equal(g, b)
            np.testing.assert_allclose(g, w, rtol=RTOL[dtype], atol=atol(dtype))


@pytest.mark.parametrize("precision", ["bf16", "bf16-act", "int8", "int8-dynamic"])
@pytest.mark.parametrize("cell", ["lstm", "gru", "rnn"])
def test_one_sample_loop_on_reduced_panels_matches_block_slices(cell, precision, many_cores,
                                                               monkeypatch):  # fmt: skip
    """The single-sample loop hands reduced panels their operand (q, bf16_act, me) and asks for
    their next panel as the batch loop does: one thread's bits equal two threads' block slices
    and the batch loop's (a slot table) for every precision, lengths T and short of it (the
    reduced kernels' own oracles are in test_quant.py)."""
    monkeypatch.setattr("leanrnn.engine.session.PARALLEL_MIN_MACS", 0)
    spec = RNNSpec(cell, 24, 40)
    layers = random_layers(spec, np.random.default_rng(7), np.float32, scale=0.3)
    x = np.random.default_rng(8).standard_normal((6, 1, 24)).astype(np.float32)
    for length in (6, 3):
        outs = []
        for threads in (1, 2):
            model = leanrnn.quantize(leanrnn.Model(pack(spec, layers, np.float32)), precision)
            model.session.threads = threads
            outs.append(model.session.run(x, None, None, np.array([length])))
            if threads == 2:
                assert model.session._sync[abi.CLAIM0 * abi.LINE] > 0
        for a, b in zip(*outs, strict=True):
            if a is not None:
                np.testing.assert_array_equal(a, b)
        model.session.threads = 1  # the batch loop: a slot table
        st = model.session.slot_states(2)
        y = model.session.run_slots(x, st, np.array([1]), np.array([length]))
        np.testing.assert_array_equal(y, outs[0][0])
        np.testing.assert_array_equal(st.h[:, 1:2], outs[0][1])
