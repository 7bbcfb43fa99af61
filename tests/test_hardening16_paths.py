"""Session 42, from a red-team pass forcing every kernel path: LEANRNN_ISA=avx2 (or avx512) on
a CPU without AVX2 aborted the process in LLVM at the first int8-dynamic model (its AVX2
intrinsics have no lowering there); on the JIT backend each process measured the training
GEMM choice again, and under load one in six chose the other, its gradients off in the last
bits. Each test failed before."""

from __future__ import annotations

import json

import numpy as np

from leanrnn.engine import products
from leanrnn.kernels import _cpu, runner


def test_a_forced_avx2_int8_dot_needs_the_cpus_avx2(monkeypatch):
    for isa in ("avx2", "avx512"):
        monkeypatch.setattr(_cpu, "_flags", lambda: ({"sse4_2", "fma"}, "x86_64"))
        assert _cpu.int8_dot(_cpu.ISAS[isa]) == "plain"  # was "avx2": LLVM ERROR, abort
        monkeypatch.setattr(_cpu, "_flags", lambda: ({"avx", "avx2", "fma"}, "x86_64"))
        assert _cpu.int8_dot(_cpu.ISAS[isa]) == "avx2"
    monkeypatch.setattr(_cpu, "_flags", lambda: (set(), "aarch64"))
    assert _cpu.int8_dot(_cpu.ISAS["avx2"]) == "plain"


def test_the_jit_remembers_its_gemm_choice(monkeypatch, tmp_path):
    calls = []

    def fake(rounds=5):
        calls.append(rounds)
        return {"choice": "blas", "native_gflops": 1.0, "blas_gflops": 2.0}

    monkeypatch.setenv("LEANRNN_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("NUMBA_CACHE_DIR", raising=False)
    monkeypatch.delenv(products.ENV_GEMM, raising=False)
    monkeypatch.setattr(runner, "binds", lambda: False)  # the JIT backend
    monkeypatch.setattr(products, "calibrate", fake)
    monkeypatch.setattr(products, "_CHOICE", {})
    path = products._wisdom_path()
    assert path is not None and tmp_path in path.parents  # was None: never remembered
    assert products.gemm_choice(np.float32) == "blas" and len(calls) == 1
    monkeypatch.setattr(products, "_CHOICE", {})  # a new JIT process reads the file
    assert products.gemm_choice(np.float32) == "blas" and len(calls) == 1
    assert json.loads(path.read_text())["gemm"]["choice"] == "blas"


def test_numbas_ir_notes_on_leanrnns_kernels_only_are_quiet():
    """The JIT's first compile of a float64 LSTM printed four ~12-line NumbaIRAssumptionWarning
    blocks asking the user to report them to numba; a user's own numba code keeps them."""
    import warnings

    from numba.core.errors import NumbaIRAssumptionWarning

    def shown(where: str) -> bool:
        with warnings.catch_warnings(record=True) as got:
            warnings.simplefilter("always")
            runner._jit()  # (the JIT backend as it is chosen; its filter goes in first)
            warnings.warn_explicit(f"an IR assumption\nFile \"{where}\", line 3",
                                   NumbaIRAssumptionWarning, "x.py", 1)  # fmt: skip
        return any(issubclass(w.category, NumbaIRAssumptionWarning) for w in got)

    assert not shown("/site-packages/leanrnn/kernels/_math.py")  # was shown
    assert shown("/home/me/my_kernels.py")


def test_info_under_the_jit_says_the_native_module_is_not_used(monkeypatch):
    """`leanrnn info` with LEANRNN_BACKEND=jit named the native module's path as the kernels
    in use."""
    import pytest

    from leanrnn import config
    from leanrnn.commands import info

    path, built = info._native_kernels()
    if not built:  # (the tests build it at their start wherever a compiler is)
        pytest.skip("no native build here")
    monkeypatch.setattr(config, "_backend", "jit")
    name, _ = info._native_kernels()
    assert name.startswith("not used (LEANRNN_BACKEND=jit") and path in name  # was: path
