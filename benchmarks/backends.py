"""The two kernel backends side by side: the ahead-of-time native module vs numba's JIT running
the same kernels, in one process, interleaved, on the same models and inputs.

    python benchmarks/backends.py [--rounds 3]

Per row: best-of-rounds time per forward of a 2-layer LSTM (C = H) on each backend, their
ratio (native / jit: below 1 the native module is faster) and the largest difference between
their outputs. Rounds alternate the backends so a slow spell of this shared machine hits both.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

import leanrnn
from leanrnn import config
from leanrnn.cli import positive_int

ROWS = [  # (threads, H, N, T)
    (1, 128, 1, 100), (1, 128, 64, 100), (1, 512, 1, 100), (1, 512, 64, 50), (1, 37, 3, 7),
    (2, 128, 1, 100), (2, 128, 64, 100), (2, 512, 1, 100), (2, 512, 64, 50), (2, 37, 3, 7),
]  # fmt: skip


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=positive_int, default=3)
    args = ap.parse_args()
    rng = np.random.default_rng(0)
    print("| threads | H | N | T | native | jit | native / jit | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    for threads, H, N, T in ROWS:
        m = leanrnn.LSTM(H, H, num_layers=2, seed=0)
        m.session.threads = threads
        x = rng.standard_normal((T, N, H)).astype(np.float32)
        reps = max(3, min(300, int(0.2 / max(1e-5, 16 * H * H * N * T / 5e10))))
        best, out = {}, {}
        for _ in range(args.rounds):
            for b in ("native", "jit"):
                config.set_backend(b)
                out[b] = m.forward(x)[0].copy()  # also the warm-up
                t0 = time.perf_counter()
                for _ in range(reps):
                    m.forward(x)
                best[b] = min(best.get(b, 1e9), (time.perf_counter() - t0) / reps)
        diff = float(np.abs(out["native"] - out["jit"]).max())
        print(f"| {threads} | {H} | {N} | {T} | {best['native'] * 1e3:.3f} ms | "
              f"{best['jit'] * 1e3:.3f} ms | {best['native'] / best['jit']:.2f} | {diff:.1e} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
