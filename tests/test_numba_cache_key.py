"""numba's cache is keyed by the kernels' fingerprint (kernels._jit._cache).

numba re-validates a cached kernel against its own source file only: an edit to an inlined
helper in another file (_simd.py's tile) left the cached recurrence running the old code. The
cache directory is therefore named by the fingerprint of all kernel sources and the CPU's tile.
"""

import os
import subprocess
import sys
from pathlib import Path

_CODE = (
    "import os\n"
    "from leanrnn.kernels import _jit, native\n"
    "print(os.environ['NUMBA_CACHE_DIR']); print(native.fingerprint()); print(_jit.CACHE)\n"
)


def _numba_dir(tmp_path: Path, **env) -> tuple[Path, str]:
    full = {**os.environ, "LEANRNN_CACHE_DIR": str(tmp_path / "lr"), **env}
    full.pop("NUMBA_CACHE_DIR", None) if "NUMBA_CACHE_DIR" not in env else None
    out = subprocess.run([sys.executable, "-c", _CODE], env=full, capture_output=True, text=True,
                         check=True, timeout=300).stdout.split()  # fmt: skip
    assert out[2] == "True"
    return Path(out[0]), out[1]


def test_the_numba_cache_is_named_by_the_fingerprint(tmp_path):
    d, fp = _numba_dir(tmp_path)
    assert d == tmp_path / "lr" / "numba" / fp


def test_a_user_numba_cache_gets_the_fingerprint_below_it(tmp_path):
    d, fp = _numba_dir(tmp_path, NUMBA_CACHE_DIR=str(tmp_path / "nb"))
    assert d == tmp_path / "nb" / fp
    # a child process handed the keyed directory keeps it (no <fp>/<fp>)
    d2, _ = _numba_dir(tmp_path, NUMBA_CACHE_DIR=str(d))
    assert d2 == d


def test_another_tile_gets_another_cache(tmp_path):
    a, fa = _numba_dir(tmp_path, LEANRNN_ISA="avx2")
    b, fb = _numba_dir(tmp_path, LEANRNN_ISA="sse")
    assert fa != fb and a != b
