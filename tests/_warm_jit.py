"""Compiles numba's JIT jobs into numba's cache, in a process of its own, while the suite runs
other tests (conftest.py starts it; the JIT tests wait for it, then load what it cached).

Why: the tests of the JIT backend need every job (lstm, gru, rnn) for both dtypes: ~2 min of
compiling on one core, which the suite's own process used to do with the machine's other core
idle (once compiled, a job runs on any number of threads: kernels.runner). The code they run is
the same either way: numba's cache (kernels._jit: keyed by the fingerprint of every kernel
source) holds what this process compiled, and a signature it missed is compiled by the test as
before. After a native build it compiles nothing: the build left every job it compiled in the
same cache (kernels.aot._save_for_the_jit), and this process only loads them (conftest starts
it once the build is in place).
"""

import os
import sys
import threading
import time
from pathlib import Path

import numpy as np

from leanrnn import config
from leanrnn.kernels import _jit


def _exit_with_parent(parent: int) -> None:
    """The suite killed outright (no pytest_sessionfinish): stop compiling for nobody."""
    while os.getppid() == parent:
        time.sleep(1.0)
    os._exit(0)


def main() -> int:
    """argv: the pid of the suite's process that started it, and a file to write when done
    (conftest.py: other xdist workers wait for it)."""
    if len(sys.argv) > 1:
        threading.Thread(target=_exit_with_parent, args=(int(sys.argv[1]),), daemon=True).start()
    try:
        return _compile()
    finally:
        if len(sys.argv) > 2:
            Path(sys.argv[2]).write_text("done")


def _compile() -> int:
    if not _jit.CACHE:  # nothing would be kept for the suite
        return 0
    import leanrnn
    from helpers import random_layers
    from leanrnn.formats.packing import pack
    from leanrnn.spec import RNNSpec

    config.set_backend("jit")
    for dtype in (np.float32, np.float64):
        for cell in ("lstm", "gru", "rnn"):
            spec = RNNSpec(cell, 40, 100)
            rng = np.random.default_rng(0)
            model = leanrnn.Model(pack(spec, random_layers(spec, rng, dtype), dtype))
            model.session.run(rng.standard_normal((2, 3, 40)).astype(dtype))
    return 0


if __name__ == "__main__":
    sys.exit(main())
