"""Calls whose sequence length changes from one call to the next (requests of different lengths,
one at a time): what each engine's per-call work costs when no two calls in a row share a
shape, against the same calls all at one length.

A leanrnn Session plans its arena for the longest run so far and runs shorter ones in it
(Session._covers); a GraphModel keeps the plans of the shapes it has seen (GraphSession
._keep). Before both, every change of length planned again (~100 us of Python a call on a
Model, 0.3-0.4 ms on a GraphModel). Side by side in one process, one thread each, engines
taking turns round after round (each turn runs the same calls, after one untimed call):

- leanrnn ``model(x)`` (an LSTM), and a GraphModel of the same LSTM as an ONNX node
- onnxruntime on that ONNX file, and torch.nn.LSTM

    python benchmarks/varying_lengths.py                        # H=64, N=1, T in 5..60
    python benchmarks/varying_lengths.py --hidden 256 --batch 8 --shortest 20 --longest 200

Before timing, every engine's outputs are compared with leanrnn's (max abs difference printed),
which also runs every length once: the table is warm, the cost of a length's first call is
not in it. A GraphModel keeps 64 shapes' plans (and at most 1 MiB of their shape-computed
tensors): with more distinct lengths than that, most calls plan again.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

from leanrnn.cli import positive_int

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=positive_int, default=64)
    ap.add_argument("--batch", type=positive_int, default=1)
    ap.add_argument("--shortest", type=positive_int, default=5)
    ap.add_argument("--longest", type=positive_int, default=60)
    ap.add_argument("--calls", type=positive_int, default=100, help="calls per turn")
    ap.add_argument("--rounds", type=positive_int, default=7, help="turns per engine")
    args = ap.parse_args(argv)
    if args.longest < args.shortest:
        ap.error("--longest must be at least --shortest")
    sys.path.insert(0, SRC)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import leanrnn
    from leanrnn.bench.report import cpu_line
    from ragged_bench import onnx_lstm

    H, N = args.hidden, args.batch
    leanrnn.set_num_threads(1)
    model = leanrnn.LSTM(H, H, seed=0)
    rng = np.random.default_rng(0)
    Ts = rng.integers(args.shortest, args.longest + 1, args.calls)
    varying = [rng.standard_normal((T, N, H)).astype(np.float32) for T in Ts]
    mean_T = round(float(Ts.mean()))
    fixed = [rng.standard_normal((mean_T, N, H)).astype(np.float32) for _ in Ts]
    want = [model(x)[0] for x in varying]

    engines = {"leanrnn model(x)": lambda x: model(x)[0]}
    sd = model.state_dict()
    try:
        import onnxruntime as ort

        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), f"varying_lengths_{os.getpid()}.onnx")
        with open(path, "wb") as f:
            f.write(onnx_lstm(sd, H, H, lengths=False))
        graph = leanrnn.load(path, threads=1)
        so = ort.SessionOptions()
        so.intra_op_num_threads = so.inter_op_num_threads = 1
        sess = ort.InferenceSession(path, so, providers=["CPUExecutionProvider"])
        os.remove(path)
        engines["leanrnn GraphModel"] = lambda x: graph.run({"X": x})[0][:, 0]
        engines["onnxruntime"] = lambda x: sess.run(None, {"X": x})[0][:, 0]
    except ImportError:
        print("onnx/onnxruntime: not installed, skipped")
    try:
        import torch

        torch.set_num_threads(1)
        tm = torch.nn.LSTM(H, H)
        tm.load_state_dict({k: torch.from_numpy(np.asarray(v)) for k, v in sd.items()})

        def torch_run(x):
            with torch.inference_mode():
                return tm(torch.from_numpy(x))[0].numpy()

        engines["torch"] = torch_run
    except ImportError:
        print("torch: not installed, skipped")

    diffs = {name: max(float(np.abs(f(x) - w).max()) for x, w in zip(varying, want, strict=True))
             for name, f in engines.items()}  # fmt: skip
    runs = {(name, kind): (f, xs) for name, f in engines.items()
            for kind, xs in (("varying", varying), ("fixed", fixed))}  # fmt: skip
    per_call: dict[tuple, list[float]] = {k: [] for k in runs}
    keys = list(runs)
    for r in range(args.rounds):
        for key in keys[r % len(keys) :] + keys[: r % len(keys)]:
            f, xs = runs[key]
            f(xs[-1])  # opens the turn untimed
            t = time.perf_counter()
            for x in xs:
                f(x)
            per_call[key].append((time.perf_counter() - t) / len(xs))
    print(f"LSTM C=H={H}, N={N}, 1 thread; {args.calls} calls a turn, T uniform in "
          f"{args.shortest}..{args.longest} (varying) or all T={mean_T} (fixed); "
          f"{args.rounds} turns each; load average {os.getloadavg()[0]:.2f}")  # fmt: skip
    print(cpu_line())
    base = np.median(per_call[("leanrnn model(x)", "varying")])
    print(f"{'engine':<22}{'varying us/call':>17}{'fixed us/call':>15}{'varying vs leanrnn':>20}"
          f"{'max diff':>10}")  # fmt: skip
    for name in engines:
        v, fx = (np.median(per_call[(name, k)]) for k in ("varying", "fixed"))
        print(f"{name:<22}{v * 1e6:>17.1f}{fx * 1e6:>15.1f}{v / base:>19.2f}x"
              f"{diffs[name]:>10.1e}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
