"""Session 38, from a red-team pass on interruptions and faults: `leanrnn score` out of disk
said "OSError: [Errno 27] File too large" naming no file, and replaced a symlinked output with
a file (save and convert write through the link). Each test failed before."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest

import leanrnn
from helpers import src_env

MODEL = leanrnn.GRU(4, 16, seed=3)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    d = tmp_path_factory.mktemp("hardening12_score")
    MODEL.save(d / "m.lrnn")
    rng = np.random.default_rng(0)
    np.savez(d / "data.npz", x=rng.standard_normal((40, 50, 4)).astype(np.float32),
             lengths=rng.integers(1, 51, 40))  # fmt: skip
    return d


@pytest.mark.parametrize("ext", ["npz", "parquet"])
def test_a_full_disk_names_the_output_and_keeps_the_old_one(files, ext):
    if ext == "parquet":
        pytest.importorskip("pyarrow")
    out = files / f"out.{ext}"
    argv = ["score", str(files / "m.lrnn"), str(files / "data.npz"), str(out), "--outputs",
            "both", "--quiet"]  # fmt: skip
    limited = ("import resource, sys; from leanrnn import cli; "
               "resource.setrlimit(resource.RLIMIT_FSIZE, (20000,) * 2); "
               "sys.exit(cli.main(sys.argv[1:]))")  # fmt: skip
    from leanrnn import cli

    assert cli.main(argv) == 0
    before = out.read_bytes()
    r = subprocess.run([sys.executable, "-c", limited, *argv], env=src_env(),
                       capture_output=True, text=True, timeout=300)  # fmt: skip
    assert r.returncode != 0
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and "cannot write" in lines[0] and str(out) in lines[0], r.stderr
    assert out.read_bytes() == before
    assert not [p for p in os.listdir(files) if p.startswith(".")]  # no temporary left


def test_a_symlinked_output_is_written_through(files, tmp_path):
    target = tmp_path / "real.npz"
    target.write_bytes(b"old")
    link = tmp_path / "link.npz"
    link.symlink_to(target)
    leanrnn.score(MODEL, str(files / "data.npz"), str(link), progress=False)
    assert link.is_symlink() and os.readlink(link) == str(target)
    got = np.load(target)["h_n"]
    x = np.load(files / "data.npz")
    want = MODEL(np.ascontiguousarray(x["x"].transpose(1, 0, 2)), lengths=x["lengths"])[1]
    np.testing.assert_allclose(got, want.transpose(1, 0, 2), rtol=0, atol=1e-5)
