"""benchmarks/quant_bars.py --gemv at a tiny size: the int8-dynamic tile alone, called the way
the kernels call it. The tile intrinsic gained two arguments (the spread next-panel prefetch)
and this mode kept calling it with the old ones: a TypeError at its first compile, found on a
Zen 3 where the README sends AVX2 readers to it."""

from pathlib import Path


def test_gemv_mode_times_the_int8_tile(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(Path(__file__).resolve().parents[1] / "benchmarks"))
    import quant_bars

    quant_bars.gemv_bound((32,), 0.0)
    lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("  H=32")]
    assert [ln.split(":")[0] for ln in lines] == ["  H=32 GEMV (a step)", "  H=32 GEMM (100 rows)"]
    for ln in lines:  # a rate was measured: a positive number before its unit
        rate = float(ln.rsplit(",", 1)[1].split()[0])
        assert rate > 0
