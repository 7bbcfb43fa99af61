"""What a wheel and an sdist built from this tree hold: every file the installed package reads
at run time (the kernels' C source was missing: an installed wheel ran no model, on either
backend), and in the sdist the tests' support files and data. Built with the environment's own
setuptools (no download), as pip builds a wheel."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tarfile
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
setuptools = pytest.importorskip("setuptools")
if int(setuptools.__version__.split(".")[0]) < 77:  # pyproject's build-system requires 77
    pytest.skip(f"setuptools {setuptools.__version__} here; the build needs >= 77",
                allow_module_level=True)  # fmt: skip


def _build(kind: str, tmp: Path) -> Path:
    """Build from a copy of the tree (setuptools writes build/ and egg-info beside the source)."""
    tree, out = tmp / "tree", tmp / "dist"
    skip = shutil.ignore_patterns(".*", "build", "dist", "*.egg-info", "__pycache__", "bench-out")
    shutil.copytree(ROOT, tree, ignore=skip)
    code = (
        "import os, sys; from setuptools import build_meta as b; os.chdir(sys.argv[1]); "
        f"print(b.build_{kind}(sys.argv[2]))"
    )
    done = subprocess.run([sys.executable, "-c", code, str(tree), str(out)], capture_output=True,
                          text=True, timeout=300)  # fmt: skip
    assert done.returncode == 0, done.stderr[-2000:]
    return out / done.stdout.strip().splitlines()[-1]


def _package_files() -> set[str]:
    src = ROOT / "src"
    return {p.relative_to(src).as_posix() for p in (src / "leanrnn").rglob("*")
            if p.is_file() and "__pycache__" not in p.parts}  # fmt: skip


def test_the_wheel_holds_every_file_of_the_package(tmp_path):
    wheel = _build("wheel", tmp_path)
    with zipfile.ZipFile(wheel) as z:
        held = {n for n in z.namelist() if n.startswith("leanrnn/")}
    assert "leanrnn/kernels/native.c" in held
    assert _package_files() <= held


def test_the_sdist_holds_the_package_and_the_tests_support_files(tmp_path):
    sdist = _build("sdist", tmp_path)
    with tarfile.open(sdist) as t:
        names = {n.split("/", 1)[1] for n in t.getnames() if "/" in n}
    assert {f"src/{f}" for f in _package_files()} <= names
    for support in ("tests/conftest.py", "tests/helpers.py", "tests/tolerances.py",
                    "tests/data/lstm_bf16_before_pairs.lrnn", "benchmarks/engine_bars.py"):  # fmt: skip
        assert support in names


@pytest.mark.parametrize(
    "missing, code, extra",
    [
        ("torch", "import leanrnn.torch", "torch"),
        ("onnx", "import leanrnn.onnx_backend", "onnx"),
        ("torch", "import leanrnn, sys; leanrnn.load(sys.argv[1])", "torch"),
    ],
)
def test_a_missing_extra_is_named_with_its_install_line(tmp_path, missing, code, extra):
    # before: a bare "No module named 'torch'", or "Install torch" (PyPI's plain torch is the
    # CUDA build, several GB)
    import zipfile as zf

    ckpt = tmp_path / "m.pt"
    with zf.ZipFile(ckpt, "w") as z:  # a torch zip checkpoint's shape is enough to be sniffed
        z.writestr("m/data.pkl", b"")
    prog = f"import sys; sys.modules[{missing!r}] = None\n{code}"
    done = subprocess.run([sys.executable, "-c", prog, str(ckpt)], capture_output=True,
                          text=True, timeout=120)  # fmt: skip
    assert done.returncode != 0
    assert f"pip install 'leanrnn[{extra}]'" in done.stderr, done.stderr[-1500:]
