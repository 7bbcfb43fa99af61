"""The public surface is __all__; kernels never leak out."""

import os
import subprocess
import sys
import types

import leanrnn
import leanrnn.errors
from leanrnn.kernels import runner

# Packages behind the public surface: what lives there is never handed out by a public name.
INTERNAL = ("leanrnn.kernels", "leanrnn.commands", "leanrnn.bench", "leanrnn.cli")


def _is_public_module(name: str) -> bool:
    parts = name.split(".")
    return (
        parts[0] == "leanrnn"
        and not any(p.startswith("_") for p in parts[1:])
        and not any(name == i or name.startswith(i + ".") for i in INTERNAL)
    )


def _leaks(module: types.ModuleType) -> list[str]:
    """What ``module`` exposes beyond its ``__all__``, or hands out from an internal module.

    Every name in ``__all__`` must exist and be defined in a public leanrnn module (a module
    itself must be one). Any other public name of the namespace may only be a submodule the
    import system bound there (``leanrnn.engine`` as ``engine``), or ``annotations`` (what
    ``from __future__ import annotations`` leaves behind).
    """
    problems = []
    exported = set(module.__all__)
    for name in sorted(exported):
        if not hasattr(module, name):
            problems.append(f"{name} is in __all__ but missing")
            continue
        obj = getattr(module, name)
        if isinstance(obj, types.ModuleType):
            home = obj.__name__
        elif isinstance(obj, (str, int, float)):  # constants such as __version__
            continue
        else:
            home = getattr(obj, "__module__", None) or "?"
        if not _is_public_module(home):
            problems.append(f"{name} in __all__ comes from {home}")
    for name in sorted(set(dir(module)) - exported):
        if name.startswith("__") and name.endswith("__"):
            continue
        obj = getattr(module, name)
        if name == "annotations" and type(obj).__module__ == "__future__":
            continue
        if isinstance(obj, types.ModuleType) and obj.__name__ == f"{module.__name__}.{name}":
            continue  # a submodule, bound by importing it
        home = getattr(obj, "__name__" if isinstance(obj, types.ModuleType) else "__module__", "?")
        problems.append(f"{name} (from {home}) is reachable but not in __all__")
    return problems


def test_public_names_are_all_and_nothing_leaks():
    assert not _leaks(leanrnn)
    assert not _leaks(leanrnn.errors)
    assert "kernels" not in leanrnn.__all__


def test_star_import_gives_exactly_all():
    ns: dict = {}
    exec("from leanrnn import *", ns)
    assert set(ns) - {"__builtins__"} == set(leanrnn.__all__)


def test_the_leak_check_can_fail():
    """Negative control: a kernel re-exported beside __all__, listed in __all__, or a private
    module's object under a public name is each reported."""
    fake = types.ModuleType("leanrnn")
    fake.__all__ = ["LSTM"]
    fake.LSTM = leanrnn.LSTM
    assert not _leaks(fake)
    fake.run = runner.run
    assert _leaks(fake) == ["run (from leanrnn.kernels.runner) is reachable but not in __all__"]
    fake.__all__ = ["LSTM", "run"]
    assert _leaks(fake) == ["run in __all__ comes from leanrnn.kernels.runner"]
    del fake.run
    fake.__all__ = ["LSTM"]
    fake.runner = runner  # a module bound under another name than its own
    assert _leaks(fake) == ["runner (from leanrnn.kernels.runner) is reachable but not in __all__"]
    del fake.runner
    fake.check = leanrnn.engine._check
    fake.__all__ = ["LSTM", "check"]
    assert _leaks(fake) == ["check in __all__ comes from leanrnn.engine._check"]


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
