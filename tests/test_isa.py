"""The register tile comes from the CPU's ISA (kernels._cpu), and every ISA's tile computes the
same GEMM on any machine: the tile intrinsics compiled for each ISA against a float64 reference."""

from pathlib import Path

import numba
import numpy as np
import pytest

from leanrnn.errors import LeanRNNError
from leanrnn.formats.packing import B
from leanrnn.kernels import _cpu, _simd
from tolerances import atol


@pytest.mark.parametrize("flags, name", [
    ({"sse2", "avx", "avx2", "fma", "avx512f"}, "avx512"),
    ({"sse2", "avx", "avx2", "fma"}, "avx2"),
    ({"sse2", "sse4_2"}, "sse"),
])  # fmt: skip
def test_isa_of_flags(flags, name):
    assert _cpu.isa_of(flags) == name
    assert _cpu.isa_of(set(), "aarch64") == "neon"


@pytest.mark.parametrize("name", sorted(_cpu.ISAS))
@pytest.mark.parametrize("itemsize", [4, 8])
def test_tile_fits_the_register_file(name, itemsize):
    isa = _cpu.ISAS[name]
    t = _cpu.tile_for(isa, itemsize)
    assert t.registers() <= isa.regs, (name, itemsize, t)
    assert t.vecs * isa.width == B * itemsize  # a group of B columns is whole registers
    assert _cpu.MAX_GROUPS % t.groups == 0 and t.rows >= 1 and t.split >= 1


def test_tile_rule_reproduces_the_known_shapes():
    # AVX-512 float32: 6 rows x 64 columns (what leanrnn was tuned with on Zen 5);
    # AVX2: the classic 6 x 16 sgemm tile (6 x 64 needed 48 of 16 ymm registers)
    avx512 = _cpu.tile_for(_cpu.ISAS["avx512"], 4)
    avx2 = _cpu.tile_for(_cpu.ISAS["avx2"], 4)
    assert (avx512.rows, avx512.groups * B) == (6, 64)
    assert (avx512.gemv_groups, avx512.split) == (4, 4)  # a lone row: 4 x 4 zmm, as on Zen 5
    assert (avx2.rows, avx2.groups * B) == (6, 16)
    assert avx2.gemv_groups * B == 64  # a lone row streams whole 256-byte panel rows


@pytest.mark.parametrize("name", sorted(_cpu.ISAS))
@pytest.mark.parametrize("itemsize", [4, 8])
def test_gemv_prefetches_only_with_one_accumulator_set(name, itemsize):
    # One accumulator set (AVX2 float32) keeps too few loads in flight to stream the weights
    # from L3: the GEMV prefetches ahead. AVX-512's split GEMV does not (as tuned on Zen 5).
    t = _cpu.tile_for(_cpu.ISAS[name], itemsize)
    assert t.prefetch == (_cpu.GEMV_PREFETCH if t.split == 1 else 0)
    assert _cpu.tile_for(_cpu.ISAS["avx2"], 4).prefetch > 0
    assert _cpu.tile_for(_cpu.ISAS["avx512"], 4).prefetch == 0


def test_cache_rule():
    # Zen 5 (1 MiB L2): KC 1024 and 192 rows, as swept there; scales with L2
    assert _cpu.kc(1 << 20) == 1024 and _cpu.row_chunk(1 << 20, 1024, 6) == 192
    assert _cpu.kc(512 << 10) == 512 and _cpu.kc(2 << 20) == 2048


def test_cpu_model_names_the_core_generation():
    # A VM's brand-only name ("AMD EPYC": Zen 3 and Zen 5 alike) gets family and model numbers
    text = "processor\t: 0\nvendor_id\t: AuthenticAMD\ncpu family\t: 25\nmodel\t\t: 1\n" \
           "model name\t: AMD EPYC\n\nprocessor\t: 1\nmodel name\t: other\n"  # fmt: skip
    assert _cpu.cpu_model(text) == "AMD EPYC (family 25, model 1)"
    assert _cpu.cpu_model("Model\t: Raspberry Pi 4\n") == "Raspberry Pi 4"  # no x86 numbers
    assert _cpu.cpu_model("") == ""


def test_bench_reports_name_the_core_generation():
    # machine_info (every bench JSON's "cpu") read "model name" alone: "AMD EPYC" for Zen 3 and 5
    import pathlib

    from leanrnn.bench.harness import machine_info

    info = pathlib.Path("/proc/cpuinfo")
    text = info.read_text() if info.exists() else ""
    family = next(
        (ln.split(":")[1].strip() for ln in text.splitlines() if ln.startswith("cpu family")), None
    )
    cpu = machine_info()["cpu"]
    assert cpu and cpu in _cpu.describe()
    if family is not None:  # x86 Linux
        assert f"family {family}," in cpu


def test_forced_isa(monkeypatch):
    monkeypatch.setenv(_cpu.ENV_ISA, "avx512")
    assert _cpu.isa().name == "avx512" and "forced" in _cpu.describe()
    sig = _cpu.signature()
    monkeypatch.setenv(_cpu.ENV_ISA, "sse")
    assert _cpu.signature() != sig  # a different native build
    monkeypatch.setenv(_cpu.ENV_ISA, "avx9")
    with pytest.raises(LeanRNNError, match="LEANRNN_ISA"):
        _cpu.isa()


def _tile_gemm(name):
    """panel_gemm1, 3 and 4 compiled for ISA ``name``'s tiles, behind one jit function."""
    tiles = _simd.tiles(_cpu.ISAS[name])
    g1, g3, g4 = (_simd.make(n, tiles) for n in (1, 3, 4))

    @numba.njit
    def run(nvec, P, poff, A, acol, i0, i1, K, C, coff, mode, bias, boff, pf=0, lines=0):
        ks, lda, ldc = P.shape[1], A.shape[1], C.shape[1]
        if nvec == 1:
            g1(P, poff, ks, A, acol, i0, i1, lda, K, C, coff, ldc, mode, bias, boff, pf, lines)
        elif nvec == 3:
            g3(P, poff, ks, A, acol, i0, i1, lda, K, C, coff, ldc, mode, bias, boff, pf, lines)
        else:
            g4(P, poff, ks, A, acol, i0, i1, lda, K, C, coff, ldc, mode, bias, boff, pf, lines)

    return run


@pytest.mark.parametrize("name", sorted(_cpu.ISAS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_every_isa_tile_matches_reference(name, dtype):
    """Each ISA's tile (row counts cover full tiles, leftover rows and the lone-row GEMV;
    slice widths 1, 3, 4 groups whole and cut into chunks with a remainder;
    K 7 and 9 a k loop with and without a remainder; all three init modes)."""
    run = _tile_gemm(name)
    rng = np.random.default_rng(1)
    W = 4 * B
    for nvec in (1, 3, 4):
        for M in (1, 5, 6, 13):
            for K in (7, 9):
                P = rng.standard_normal((K + 1, W)).astype(dtype)  # row 0 skipped via poff
                A = rng.standard_normal((M, K + 2)).astype(dtype)
                bias = rng.standard_normal(W + 3).astype(dtype)
                C0 = rng.standard_normal((M, W + 2)).astype(dtype)
                cols = nvec * B
                prod = A[:, 1 : K + 1].astype(np.float64) @ P[1:, :cols].astype(np.float64)
                for mode, init in ((0, 0.0), (1, C0[:, 1 : cols + 1]), (2, bias[3 : cols + 3])):
                    C = C0.copy()
                    run(nvec, P, W, A, 1, 0, M, K, C, 1, mode, bias, 3 if mode == 2 else -1)
                    np.testing.assert_allclose(C[:, 1 : cols + 1], prod + init, rtol=0,
                                               atol=atol(dtype) * 10 * K)  # fmt: skip
                    # nothing outside the slice is written
                    np.testing.assert_array_equal(C[:, 0], C0[:, 0])
                    np.testing.assert_array_equal(C[:, cols + 1 :], C0[:, cols + 1 :])


@pytest.mark.parametrize("name", sorted(_cpu.ISAS))
def test_a_tile_asking_for_the_next_panel_computes_the_same(name):
    """The multi-row float tiles spread a prefetch of a next panel over their k loop (_simd's
    pf, nlines; gemm._ahead): whether it asks for no line, fewer lines than k steps, exactly
    as many or more (then a line a step), for lone rows, full tiles and leftover rows, the
    sums are the reference's and bit for bit those of the tile that asks for none."""
    run = _tile_gemm(name)
    rng = np.random.default_rng(2)
    W, K = 4 * B, 11
    P = rng.standard_normal((2 * K, W)).astype(np.float32)  # the second K rows: "next panel"
    for M in (1, 4, 6, 13):
        A = rng.standard_normal((M, K)).astype(np.float32)
        prod = A.astype(np.float64) @ P[:K].astype(np.float64)
        C0 = np.zeros((M, W), np.float32)
        run(4, P, 0, A, 0, 0, M, K, C0, 0, 0, P, -1)
        steps = -(-M // 6) * K
        for lines in (1, steps // 3, steps, 3 * steps, K * W * 4 // 64):
            C = np.full((M, W), np.nan, np.float32)
            run(4, P, 0, A, 0, 0, M, K, C, 0, 0, P, -1, K * W, lines)
            np.testing.assert_array_equal(C, C0)
        np.testing.assert_allclose(C0, prod, rtol=0, atol=atol(np.float32) * 10 * K)


@pytest.mark.parametrize("value, on", [("0", False), ("off", False), ("False", False),
                                       ("no", False), ("1", True), ("on", True), ("", True),
                                       ("TRUE", True)])  # fmt: skip
def test_the_amx_switch_reads_common_spellings(monkeypatch, value, on):
    """LEANRNN_AMX=off (or false, no) left AMX on: only "0" turned it off."""
    monkeypatch.setenv(_cpu.ENV_AMX, value)
    _cpu.amx_enabled.cache_clear()
    try:
        assert _cpu.amx_enabled() is on
    finally:
        _cpu.amx_enabled.cache_clear()


def test_an_unknown_amx_switch_is_an_error(monkeypatch):
    monkeypatch.setenv(_cpu.ENV_AMX, "maybe")
    _cpu.amx_enabled.cache_clear()
    try:
        with pytest.raises(LeanRNNError, match=r"LEANRNN_AMX.*'maybe'"):
            _cpu.amx_enabled()
    finally:
        monkeypatch.delenv(_cpu.ENV_AMX)
        _cpu.amx_enabled.cache_clear()


@pytest.mark.parametrize("vendor, amx, want", [
    ("AuthenticAMD", False, "dpbf16"),  # Zen 4/5: vdpbf16ps at the FMA's rate
    ("GenuineIntel", False, "fma"),  # Cooper Lake, or Sapphire Rapids with AMX off
    ("", False, "fma"),  # a vendor /proc/cpuinfo does not name
    ("GenuineIntel", True, "amx"),
    ("AuthenticAMD", True, "amx"),
])  # fmt: skip
def test_bf16_panels_take_vdpbf16ps_only_where_it_is_fast(monkeypatch, vendor, amx, want):
    """On an Intel CPU with AVX512-BF16 but no usable AMX, bf16_dot chose vdpbf16ps, which ran
    bf16 2.8x slower than float32 at batch 64 on a Sapphire Rapids-class Xeon with AMX off
    (its vdpbf16ps issues at half the FMA's rate); the widening FMA tile runs at float32's
    speed there."""
    flags = {"avx512f", "avx512bw", "avx512vl", "avx512_bf16"} | (
        {"amx_tile", "amx_bf16"} if amx else set()
    )
    monkeypatch.setattr(_cpu, "_flags", lambda: (flags, "x86_64"))
    monkeypatch.setattr(_cpu, "vendor", lambda: vendor)
    monkeypatch.setattr(_cpu, "amx_enabled", lambda: True)
    monkeypatch.setattr(_cpu, "amx_permitted", lambda: True)
    assert _cpu.bf16_dot(_cpu.ISAS["avx512"]) == want


def test_the_vendor_is_read_from_cpuinfo():
    """vendor() is /proc/cpuinfo's vendor_id (its first), "" where there is none."""
    info = Path("/proc/cpuinfo")
    text = info.read_text() if info.exists() else ""
    ids = [ln.split(":", 1)[1].strip() for ln in text.splitlines() if ln.startswith("vendor_id")]
    assert _cpu.vendor() == (ids[0] if ids else "")
