"""The public surface is __all__; kernels never leak out."""

import os
import subprocess
import sys

import leanrnn


def test_all_names_exist_and_no_kernel_leaks():
    for name in leanrnn.__all__:
        assert hasattr(leanrnn, name), name
    public = {n for n in dir(leanrnn) if not n.startswith("_")}
    assert "kernels" not in leanrnn.__all__
    leaked = {n for n in public - set(leanrnn.__all__) if "serial" in n or "parallel" in n}
    assert not leaked


def test_cli_help_and_demo_run():
    out = subprocess.run(
        [sys.executable, "-m", "leanrnn", "--help"], capture_output=True, text=True
    )
    assert out.returncode == 0 and "demo" in out.stdout and "plan" in out.stdout
    out = subprocess.run(
        [sys.executable, "-m", "leanrnn", "demo", "--hidden", "32", "--steps", "5", "--repeat", "2"],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    assert "latency" in out.stdout and "arena" in out.stdout


def test_cli_plan_prints_every_buffer(tmp_path):
    png = tmp_path / "plan.png"
    out = subprocess.run(
        [sys.executable, "-m", "leanrnn", "plan", "gru:24x2", "--batch", "3", "--steps", "40",
         "--chunk", "8", "--png", str(png)],
        capture_output=True, text=True,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr
    for name in ("xw.0", "xw.1", "y.0", "gates.0", "h.1.b", "arena", "weights"):
        assert name in out.stdout
    assert "planned steps 8" in out.stdout
    assert png.stat().st_size > 1000


def test_memory_log_shows_acquire_and_release():
    code = (
        "import numpy as np, leanrnn; m = leanrnn.LSTM(4, 8, num_layers=2, seed=0); "
        "m(np.zeros((3, 2, 4), np.float32))"
    )
    env = {**os.environ, "LEANRNN_LOG": "memory"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr
    assert "op 0 acquire xw.0" in out.stderr and "op 1 release y.0" in out.stderr
