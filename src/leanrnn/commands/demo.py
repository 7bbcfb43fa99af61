"""``leanrnn demo``: build a default model with fixed seeds, run it, print latency and memory."""

from __future__ import annotations

import argparse
import time


def register(sub: argparse._SubParsersAction) -> None:
    from ..cli import positive_int
    from .plan import MAX_HIDDEN, MAX_LAYERS

    p = sub.add_parser("demo", help="run a default LSTM and print latency and memory")
    p.add_argument("--cell", choices=["lstm", "gru", "rnn"], default="lstm",
                   help="recurrent cell (default lstm)")  # fmt: skip
    p.add_argument("--hidden", type=positive_int, default=256,
                   help=f"H, hidden size = input size, at most {MAX_HIDDEN} (default 256)")  # fmt: skip
    p.add_argument("--layers", type=positive_int, default=2,
                   help=f"stacked layers, at most {MAX_LAYERS} (default 2)")  # fmt: skip
    p.add_argument("--batch", type=positive_int, default=1, help="N, sequences (default 1)")
    p.add_argument("--steps", type=positive_int, default=100, help="T, timesteps (default 100)")
    p.add_argument("--repeat", type=positive_int, default=20,
                   help="timed runs after the first; the median is reported (default 20)")  # fmt: skip
    p.set_defaults(func=run)


def _rss_kib() -> int:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        pass
    return 0


def run(args) -> int:
    import numpy as np

    import leanrnn
    from leanrnn.memory.arena import check_fits

    from .plan import random_model

    H, N, T = args.hidden, args.batch, args.steps
    # x is drawn in float64 then cast, and y comes back twice (the first run and out=): the
    # arena is checked when it is planned, these are checked here, before anything is built.
    check_fits(T * N * H * (8 + 4 + 2 * 4), f"demo inputs and outputs for T={T}, N={N}, H={H}",
               "demo")  # fmt: skip
    model = random_model("demo", args.cell, H, args.layers)
    x = np.random.default_rng(0).standard_normal((T, N, H)).astype(np.float32)
    from leanrnn.kernels import runner

    rss0 = _rss_kib()
    # the kernels first, timed apart: on a new machine this builds them (minutes, once), which
    # the first run's figure (milliseconds) once included
    tk = time.perf_counter()
    kernels = runner.backend()
    ready = time.perf_counter() - tk
    t0 = time.perf_counter()
    y, *_ = model(x)
    first = time.perf_counter() - t0
    rss_first = _rss_kib()
    s = model.session
    out = (np.empty_like(y), *[np.empty_like(a) for a in _states(model(x))])
    times = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        s.run(x, out=out)
        times.append(time.perf_counter() - t)
    rss_warm = _rss_kib()
    med = float(np.median(times))
    print(f"model      {model}")
    print(f"input      [T={T}, N={N}, C={H}] float32, threads={leanrnn.get_num_threads()}")
    built = " (built on this machine's first use, once)" if ready > 5 else ""
    print(f"kernels    {kernels.name}, ready in {ready:.2f} s{built}")
    # numba's JIT compiles (or loads from its cache) each job the first run calls
    jit = " and numba compiling the jobs it calls" if kernels.name == "jit" else ""
    print(f"first run  {first * 1e3:.1f} ms (includes planning the arena{jit})")
    print(f"latency    {med * 1e3:.3f} ms per forward (median of {args.repeat}), "
          f"{med / T * 1e6:.2f} us/step")  # fmt: skip
    print(f"weights    {model.weights.nbytes / 2**20:.2f} MiB packed")
    print(f"arena      {s.arena_bytes / 2**10:.1f} KiB planned "
          f"(without reuse: {s.plan.naive_total / 2**10:.1f} KiB)")  # fmt: skip
    print(f"outputs    {y.nbytes / 2**10:.1f} KiB")
    print(f"RSS        +{(rss_first - rss0) / 1024:.2f} MiB at the first run (the kernels load "
          f"and the arena is planned), +{(rss_warm - rss_first) / 1024:.2f} MiB over "
          f"{args.repeat + 1} more runs")  # fmt: skip
    print(f"checksum   y.sum() = {float(y.sum()):.6f}")
    return 0


def _states(result):
    _, hs = result
    return hs if isinstance(hs, tuple) else (hs,)
