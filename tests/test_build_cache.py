"""The native build's cache: a build that is not exactly what was published is refused before it
is mapped (a truncated one used to kill the process with SIGBUS), and an unwritable cache moves
the build (and numba's cache) to a private temp dir instead of failing every call.

The tests copy the suite's own build into temporary caches rather than build again (30-80 s)."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest

import leanrnn
from leanrnn.kernels import native, runner
from leanrnn.kernels.reference import reference_forward
from tolerances import atol


@pytest.fixture(scope="module")
def good_build() -> Path:
    """The directory of this machine's build (built here if the suite has none yet)."""
    mod = runner.native_module(build=True)
    assert mod is not None, runner.where()
    return Path(mod.__file__).parent


def _copy_build(src: Path, root: Path) -> Path:
    """``src`` as the build of cache ``root``; returns its directory."""
    d = native.build_dir(native.fingerprint(), root)
    shutil.copytree(src, d, ignore=shutil.ignore_patterns(".lock", "FAILED", ".*.tmp"))
    return d


def _python(code: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=600)  # fmt: skip


def _env(**changes) -> dict:
    env = {k: v for k, v in os.environ.items() if k not in ("NUMBA_CACHE_DIR", "XDG_CACHE_HOME")}
    env.update(changes)
    return env


# A 2-layer LSTM run in a fresh process; y is saved for the parent to check against the oracle.
RUN_MODEL = """
    import sys, numpy as np, leanrnn
    from leanrnn.kernels import runner
    m = leanrnn.LSTM(8, 16, num_layers=2, seed=0)
    np.save(sys.argv[1], m(np.linspace(-2, 2, 80, dtype=np.float32).reshape(5, 2, 8))[0])
    print(runner.backend().name)
"""


def _run_model(tmp_path: Path, env: dict) -> tuple[subprocess.CompletedProcess, np.ndarray]:
    out = tmp_path / "y.npy"
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(RUN_MODEL), str(out)], env=env,
                         capture_output=True, text=True, timeout=600)  # fmt: skip
    assert res.returncode == 0, f"exit {res.returncode}: {res.stderr[-3000:]}"
    return res, np.load(out)


def _oracle() -> np.ndarray:
    m = leanrnn.LSTM(8, 16, num_layers=2, seed=0)
    x = np.linspace(-2, 2, 80, dtype=np.float32).reshape(5, 2, 8)
    return reference_forward(m.weights.spec, m.weights.unpack(), x, None, None, None)[0]


def test_a_truncated_build_is_refused_and_the_model_still_runs(tmp_path, good_build,
                                                              jit_compiled):  # fmt: skip
    """The issue's case: the module cut short (full disk, interrupted copy). It must not be
    mapped (SIGBUS); it is refused and rebuilt, and here the rebuild cannot find a compiler, so
    the JIT runs the model and says why."""
    d = _copy_build(good_build, tmp_path / "cache")
    path = native.module_path(d)
    with open(path, "r+b") as f:
        f.truncate(path.stat().st_size // 2)
    # (numba's cache: the suite's, compiled already; which one is no matter here)
    res, y = _run_model(tmp_path, _env(LEANRNN_CACHE_DIR=str(tmp_path / "cache"),
                                       CC="/nonexistent/cc", NUMBA_CACHE_DIR=jit_compiled))  # fmt: skip
    assert res.stdout.split() == ["jit"]
    assert "rebuilding a broken native module" in res.stderr
    assert "does not match its MANIFEST: size" in res.stderr
    assert "/nonexistent/cc" in (d / "FAILED").read_text()
    np.testing.assert_allclose(y, _oracle(), atol=atol(np.float32), rtol=atol(np.float32))


def _corrupt(d: Path, how: str) -> None:
    path, manifest = native.module_path(d), d / native.MANIFEST
    data = path.read_bytes()
    if how == "truncated":
        path.write_bytes(data[: len(data) // 3])
    elif how == "empty":
        path.write_bytes(b"")
    elif how == "garbled":  # same size, code bytes changed
        mid = len(data) // 2
        path.write_bytes(data[:mid] + bytes(b ^ 0xFF for b in data[mid : mid + 4096])
                         + data[mid + 4096 :])  # fmt: skip
    elif how == "longer":
        path.write_bytes(data + b"\0" * 4096)
    elif how == "no manifest":
        manifest.unlink()
    elif how == "foreign manifest":  # describes the module, but for other sources
        m = json.loads(manifest.read_text())
        manifest.write_text(json.dumps({**m, "fingerprint": "0" * 24}))
    elif how == "garbage manifest":
        manifest.write_bytes(os.urandom(300))
    elif how == "huge manifest":
        manifest.write_text(json.dumps({"pad": "x" * 100_000}))
    else:
        assert how == "intact"


CASES = {
    "intact": "loaded",
    "truncated": "size",
    "empty": "size",
    "garbled": "sha256",
    "longer": "size",
    "no manifest": "has no MANIFEST",
    "foreign manifest": "fingerprint",
    "garbage manifest": "unreadable",
    "huge manifest": "unreadable",
}


def test_every_kind_of_broken_build_is_refused_before_it_is_mapped(tmp_path, good_build):
    """In a child process, since mapping a truncated module kills the process: each broken
    copy raises ImportError naming what is wrong; the intact copy loads."""
    dirs = {}
    for i, how in enumerate(CASES):
        dirs[how] = d = _copy_build(good_build, tmp_path / f"c{i}")
        _corrupt(d, how)
    code = """
        import sys, json
        from pathlib import Path
        from leanrnn.kernels import native
        fp = native.fingerprint()
        for how, d in json.loads(sys.argv[1]).items():
            try:
                mod = native.load(Path(d), fp)
                print(how, "=", "loaded" if mod is not None else "none", flush=True)
            except ImportError as e:
                print(how, "=", e, flush=True)
    """
    res = subprocess.run([sys.executable, "-c", textwrap.dedent(code),
                          json.dumps({k: str(v) for k, v in dirs.items()})],
                         capture_output=True, text=True, timeout=120)  # fmt: skip
    assert res.returncode == 0, f"exit {res.returncode}: {res.stdout}{res.stderr[-2000:]}"
    seen = dict(line.split(" = ", 1) for line in res.stdout.splitlines())
    assert list(seen) == list(CASES)
    for how, want in CASES.items():
        assert want in seen[how], (how, seen[how])


def test_publish_writes_the_manifest_verify_checks(tmp_path):
    built = tmp_path / "out.so"
    built.write_bytes(b"module bytes" * 1000)
    d = tmp_path / "native" / "fp"
    final = native.publish(d, built, "fp")
    assert final == native.module_path(d) and final.read_bytes() == built.read_bytes()
    manifest = json.loads((d / native.MANIFEST).read_text())
    assert manifest == {"fingerprint": "fp", "module": final.name, "size": 12000,
                        "sha256": hashlib.sha256(built.read_bytes()).hexdigest()}  # fmt: skip
    assert native.verify(d, "fp") == final
    assert sorted(p.name for p in d.iterdir()) == sorted([final.name, native.MANIFEST])
    with pytest.raises(ImportError, match="fingerprint"):
        native.verify(d, "other")
    native.discard(d)
    assert native.verify(d, "fp") is None and list(d.iterdir()) == []


def _unwritable_env(tmp_path: Path, **changes) -> tuple[dict, Path]:
    """The issue's machine: LEANRNN_CACHE_DIR and HOME cannot be written (paths under a regular
    file, which blocks root too), NUMBA_CACHE_DIR unset; the temp dir is tmp_path/tmp. Returns
    the env and the private temp cache leanrnn should fall back to."""
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    (tmp_path / "tmp").mkdir()
    env = _env(LEANRNN_CACHE_DIR=str(blocker / "cache"), HOME=str(blocker / "home"),
               TMPDIR=str(tmp_path / "tmp"), **changes)  # fmt: skip
    uid = os.getuid() if hasattr(os, "getuid") else "user"
    return env, tmp_path / "tmp" / f"leanrnn-{uid}"


def test_an_unwritable_cache_uses_a_private_temp_dir_and_says_so(tmp_path, good_build):
    env, fallback = _unwritable_env(tmp_path)
    fallback.mkdir(mode=0o700)
    _copy_build(good_build, fallback)  # what an earlier process would have built there
    res, y = _run_model(tmp_path, env)
    assert res.stdout.split() == ["native"]
    assert "LEANRNN_CACHE_DIR" in res.stderr and str(fallback) in res.stderr
    assert env["LEANRNN_CACHE_DIR"] in res.stderr
    np.testing.assert_allclose(y, _oracle(), atol=atol(np.float32), rtol=atol(np.float32))


def test_a_temp_dir_someone_else_can_write_is_not_used(tmp_path, good_build, jit_compiled):
    """Code is loaded from the fallback dir: one open to others is refused (JIT instead)."""
    # (numba's cache: the suite's, compiled already; the native build's fallback is the point)
    env, fallback = _unwritable_env(tmp_path, CC="/nonexistent/cc", NUMBA_CACHE_DIR=jit_compiled)
    fallback.mkdir()
    fallback.chmod(0o777)
    _copy_build(good_build, fallback)
    res, y = _run_model(tmp_path, env)
    assert res.stdout.split() == ["jit"]
    assert "not a private directory" in res.stderr and "LEANRNN_CACHE_DIR" in res.stderr
    np.testing.assert_allclose(y, _oracle(), atol=atol(np.float32), rtol=atol(np.float32))


def test_numba_with_nowhere_to_cache_gets_a_cache_dir_instead_of_failing(tmp_path):
    """numba caches next to the package sources or under HOME; with neither writable (a
    read-only install: numba's in-tree locator left out here, as tests may run as root) every
    cached kernel used to raise "cannot cache function 'claim': no locator available"."""
    env, fallback = _unwritable_env(
        tmp_path, LEANRNN_BACKEND="jit",
        NUMBA_CACHE_LOCATOR_CLASSES="UserProvidedCacheLocator,UserWideCacheLocator",
    )  # fmt: skip
    code = """
        import os, numpy as np
        from leanrnn.kernels import _math, ops  # every kernel is decorated (where it failed)
        f = np.float32
        y = _math.act(_math.TANH, f(0.5), f(0), f(0), f(0), f(1))  # compiled, and cached
        print(repr(float(y)), os.environ["NUMBA_CACHE_DIR"])
    """
    res = _python(code, env)
    assert res.returncode == 0, res.stderr[-3000:]
    assert "no locator available" not in res.stderr
    assert "NUMBA_CACHE_DIR" in res.stderr and str(fallback / "numba") in res.stderr
    y, where = res.stdout.split()
    assert Path(where).parent == fallback / "numba"  # keyed by the fingerprint below it
    assert any((fallback / "numba").rglob("_math.act-*.nbi"))  # numba did cache there
    np.testing.assert_allclose(float(y), np.tanh(0.5), atol=atol(np.float32), rtol=0)


def test_a_writable_cache_leaves_no_temp_dir_behind(tmp_path):
    """The private temp dir is the fallback only: it used to be made (and left, empty) by every
    process, its cache writable or not."""
    (tmp_path / "tmp").mkdir()
    env = _env(LEANRNN_CACHE_DIR=str(tmp_path / "cache"), TMPDIR=str(tmp_path / "tmp"))
    res = _python("import os; from leanrnn.kernels import _jit; "
                  "print(_jit.CACHE, os.environ['NUMBA_CACHE_DIR'])", env)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    cached, where = res.stdout.split()
    assert cached == "True" and Path(where).parent == tmp_path / "cache" / "numba"
    assert list((tmp_path / "tmp").iterdir()) == []


def test_the_build_processes_compile_every_entry_once_and_about_as_long():
    """kernels.aot._groups: each (dtype, job) entry in exactly one process, and the
    reduced-precision jobs shared out so that the processes' estimated times differ by less
    than one such job (all of them on the float32 process, or one format per process, left
    a core idle for minutes at the end of a cold build)."""
    from leanrnn.kernels import abi, aot

    groups = aot._groups()
    entries = [e for g in groups for e in g]
    assert sorted(entries) == sorted((d, j) for j in abi.ARGS for d in abi.JOBS[j].dtypes)
    cell_of = {abi.job_for(c, p): c for c in abi.REDUCED_CELLS for p in abi.PRECISIONS}

    def estimate(dtype, group):
        return aot._BUILD_SECONDS[dtype] + sum(
            aot._BUILD_SECONDS[cell_of[j]] for _, j in group if j in cell_of
        )

    seconds = [estimate(d, g) for d, g in zip(abi.DTYPES, groups, strict=True)]
    assert max(seconds) - min(seconds) < max(aot._BUILD_SECONDS[c] for c in abi.REDUCED_CELLS)
    assert all({j for _, j in g} & set(cell_of) for g in groups)  # each its share
