"""``leanrnn demo``: build a default model with fixed seeds, run it, print latency and memory."""

from __future__ import annotations

import argparse
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("demo", help="run a default LSTM and print latency and memory")
    p.add_argument("--cell", choices=["lstm", "gru", "rnn"], default="lstm")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--steps", type=int, default=100)
    p.add_argument("--repeat", type=int, default=20)
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

    cls = {"lstm": leanrnn.LSTM, "gru": leanrnn.GRU, "rnn": leanrnn.RNN}[args.cell]
    H, N, T = args.hidden, args.batch, args.steps
    model = cls(H, H, num_layers=args.layers, seed=0)
    x = np.random.default_rng(0).standard_normal((T, N, H)).astype(np.float32)
    rss0 = _rss_kib()
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
    from leanrnn.kernels import runner

    print(f"first run  {first * 1e3:.1f} ms (includes planning and loading the "
          f"{runner.backend().name} kernels)")  # fmt: skip
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
