"""The kernels' calling convention (kernels.abi): each job is declared once, and the JIT jobs,
the native entries and the engine's argument assembly all follow that declaration."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
import textwrap

import numpy as np
import pytest

import leanrnn
from helpers import random_layers
from leanrnn.formats.packing import pack
from leanrnn.kernels import abi
from leanrnn.spec import RNNSpec


def test_every_declaration_matches_its_kernels_parameters():
    from leanrnn.kernels import ops

    for name, job in abi.JOBS.items():
        # The generated job takes exactly the declared arguments, then me ...
        assert ops.signature(ops.JOBS[name]) == [*job.names(), "me"]
        # ... and hands each kernel its parameters by name: every one is declared.
        for kernel, renames in abi.calls(name):
            for p in ops.signature(ops.KERNELS[kernel]):
                assert renames.get(p, p) in [*job.names(), "me"], (name, kernel, p)


@pytest.mark.parametrize("change", ["drop", "rename", "extra"])
def test_a_declaration_its_kernels_do_not_follow_is_refused(change, monkeypatch):
    """A job whose declaration drifts from its kernels' parameters is never generated."""
    from leanrnn.kernels import ops

    job = abi.JOBS["rnn"]
    args = job.args.split()
    if change == "drop":
        args.remove("consts:F1")
    elif change == "rename":
        args[args.index("h_a:F2")] = "h0:F2"
    else:
        args.insert(3, "alpha:F1")
    monkeypatch.setitem(abi.JOBS, "rnn", dataclasses.replace(job, args=" ".join(args)))
    sigs = {k: ops.signature(f) for k, f in ops.KERNELS.items()}
    with pytest.raises(ValueError, match="job 'rnn'"):
        abi.job_source("rnn", sigs)


def test_the_native_module_has_every_declared_entry():
    from leanrnn.kernels import runner

    mod = runner.native_module(build=True)
    if mod is None:
        pytest.skip(f"no native module: {runner._failure()}")
    entries = dict(mod.entries())
    want = {abi.entry_name(j, d): abi.entry_kinds(j, d) for j in abi.JOBS
            for d in abi.JOBS[j].dtypes}  # fmt: skip
    assert entries == want


@pytest.mark.parametrize(
    "spec",
    [
        RNNSpec("lstm", 5, 7, num_layers=2, proj_size=3, peepholes=True),
        RNNSpec("gru", 5, 7, direction="bidirectional", linear_before_reset=False),
        RNNSpec("rnn", 5, 7),
    ],
    ids=lambda s: s.cell,
)
def test_the_session_names_every_argument_of_its_job_once(spec):
    """Session fixes a plan's arguments by name and sets the per-run ones (PER_CALL): together
    they are the declaration, each once, and the fixed ones are all there."""
    from leanrnn.engine import session as session_mod

    layers = random_layers(spec, np.random.default_rng(0), np.float32)
    s = leanrnn.Model(pack(spec, layers, np.float32)).session
    s.resize(2, 3)
    names = abi.JOBS[spec.cell].names()
    for call in s._calls:
        assert call.job == spec.cell
        assert call.per_call == session_mod.PER_CALL
        assert sorted(call.slots) == sorted(names.index(n) for n in session_mod.PER_CALL)
        fixed = [n for i, n in enumerate(names) if i not in call.slots]
        assert [n for n in fixed if call.args[names.index(n)] is None] == []
        assert len(fixed) + len(call.per_call) == len(names)


def test_a_call_names_each_argument_exactly_once():
    W, b, y = np.zeros((1, 8, 64), np.float32), np.zeros(64, np.float32), np.zeros((4, 64))
    sync, q = np.zeros(abi.sync_size(1), np.int64), np.zeros((1, 0), np.uint8)
    rows = {"lengths": np.zeros(0, np.int64), "T": 0, "xw_bf_T": 0}  # every row
    c = abi.Call("matmul", ("x", "y", "parts"), W=W, b=b, K=8, sync=sync, q=q, bf16_act=False,
                 **rows)  # fmt: skip
    x = np.ones((4, 8), np.float32)
    got = c.bind(x=x, y=y, parts=1)
    assert got[:5] + got[8:] == (x, W, b, 8, y, sync, q, False, 1)
    assert got[5:8] == (rows["lengths"], 0, 0)
    kw = {"W": W, "b": b, "q": q, "bf16_act": False, **rows}
    with pytest.raises(TypeError, match=r"missing \['sync'\]"):
        abi.Call("matmul", ("x", "y", "parts"), K=8, **kw)
    with pytest.raises(TypeError, match=r"named twice \['y'\]"):
        abi.Call("matmul", ("x", "y", "parts"), K=8, y=y, sync=sync, **kw)
    with pytest.raises(TypeError, match=r"unknown \['C'\]"):
        abi.Call("matmul", ("x", "y", "parts"), K=8, C=8, sync=sync, **kw)
    # as many names as declared, one of them twice and so one missing
    with pytest.raises(TypeError, match=r"named twice \['x'\], missing \['y'\]"):
        abi.Call("matmul", ("x", "x", "parts"), K=8, sync=sync, **kw)
    with pytest.raises(TypeError, match=r"unknown \['C'\], named twice \[\], missing \['K'\]"):
        abi.Call("matmul", ("x", "y", "parts"), C=8, sync=sync, **kw)
    with pytest.raises(TypeError, match="per call"):
        c.bind(x=x, y=y)


def test_the_native_build_never_compiles_from_numbas_cache():
    """numba's cache does not notice a changed callee: a build from it could put old code in a
    module whose fingerprint says new (it did: an edit of gemm.py alone left the cached lstm's)."""
    code = """
        from numba.core.caching import NullCache
        from numba.core.dispatcher import Dispatcher
        from leanrnn.kernels import _math, aot, ops
        aot._without_cache()
        ds = [*ops.KERNELS.values(), *ops.JOBS.values(), _math.act]
        assert all(isinstance(d, Dispatcher) and isinstance(d._cache, NullCache) for d in ds)
        print("ok")
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True,
                         text=True, timeout=600, check=False)  # fmt: skip
    assert out.stdout.strip() == "ok", out.stderr
