"""Flat-memory bars (issue 4), each figure measured in a fresh subprocess, side by side.

    python benchmarks/memory_bars.py [--threads 2] [--out bench-out/memory_bars.json]

1. Streaming 100 single steps, N=1, LSTM H=512: growth by tracemalloc and by RSS after warm-up.
2. LSTM H=512, N=1, return_sequences=False: peak RSS of a T=10,000 run vs a T=100 run, and the
   arena of a single step (weights excluded).
3. N=64, T=1,000, 2-layer LSTM H=512: peak memory beyond weights and the returned output, and
   time, for leanrnn (its automatic chunk: xw of a chunk within 2 MiB, or a quarter of the last-level cache
   when 2 threads run batch slices) vs torch
   vs onnxruntime.
Peak RSS is VmHWM after resetting it through /proc/self/clear_refs, minus RSS just before the
measured call: it counts everything the process touched (allocator caches included).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import textwrap

from leanrnn.cli import positive_int

PRELUDE = textwrap.dedent(
    """
    import json, os, time, tracemalloc
    import numpy as np
    def rss():
        with open('/proc/self/status') as f:
            d = dict(l.split(':', 1) for l in f)
        return int(d['VmRSS'].split()[0]) * 1024, int(d['VmHWM'].split()[0]) * 1024
    def reset_peak():
        with open('/proc/self/clear_refs', 'w') as f:
            f.write('5')
    def peak_of(fn):
        reset_peak(); r0, _ = rss(); t = time.perf_counter(); out = fn()
        dt = time.perf_counter() - t; _, hwm = rss(); return hwm - r0, dt, out
    """
)

LEANRNN_STREAM = """
import leanrnn
leanrnn.set_num_threads({threads})
m = leanrnn.LSTM(512, 512, seed=0)
s = m.session.stream(batch=1)
x = np.ones((1, 512), np.float32); out = np.empty((1, 512), np.float32)
for _ in range(20): s.feed(x, out=out)
tracemalloc.start()
for _ in range(100): s.feed(x, out=out)  # warm-up under tracing: first-traced-call caches
rss()  # the first read of /proc allocates a page itself: warm the measurement too
r0, _ = rss(); t0, _ = tracemalloc.get_traced_memory()
for _ in range(100): s.feed(x, out=out)
t1, _ = tracemalloc.get_traced_memory(); r1, _ = rss()
print(json.dumps(dict(tracemalloc_growth=t1 - t0, rss_growth=r1 - r0)))
"""

LEANRNN_LONG = """
import leanrnn
leanrnn.set_num_threads({threads})
m = leanrnn.LSTM(512, 512, seed=0)
x = np.random.default_rng(0).standard_normal(({T}, 1, 512)).astype(np.float32)
m.session.run(x[:40], return_sequences=False)  # compile/warm
peak, dt, _ = peak_of(lambda: m.session.run(x, return_sequences=False))
one = leanrnn.Session(m.weights); one.resize(1, 1)
print(json.dumps(dict(peak=peak, seconds=dt, arena=m.session.plan.total, arena_one_step=one.plan.total)))
"""

BIG_LEANRNN = """
import leanrnn
leanrnn.set_num_threads({threads})
m = leanrnn.LSTM(512, 512, num_layers=2, seed=0)
s = leanrnn.Session(m.weights)
x = np.random.default_rng(0).standard_normal((1000, 64, 512)).astype(np.float32)
y = np.empty((1000, 64, 512), np.float32); y.fill(1.0); h = np.empty((2, 64, 512), np.float32); c = h.copy()
s.run(x[:64], out=(y[:64], h, c))
peak, dt, _ = peak_of(lambda: s.run(x, out=(y, h, c)))
# y is pre-touched (it is the returned output); the arena is held for the job, so it counts.
print(json.dumps(dict(peak=peak + s.plan.total, seconds=dt, arena=s.plan.total)))
"""

BIG_TORCH = """
import torch
torch.set_num_threads({threads})
m = torch.nn.LSTM(512, 512, num_layers=2)
x = torch.randn(1000, 64, 512)
with torch.inference_mode():
    m(x[:64])
    peak, dt, out = peak_of(lambda: m(x))
print(json.dumps(dict(peak=peak - out[0].numel() * 4, seconds=dt)))
"""

BIG_ORT = """
import onnx, onnxruntime as ort
from onnx import helper, TensorProto, numpy_helper
rng = np.random.default_rng(0)
H = 512
inits, nodes = [], []
src = 'x'
for l in range(2):
    W = (rng.standard_normal((1, 4 * H, H)) * 0.04).astype(np.float32)
    R = (rng.standard_normal((1, 4 * H, H)) * 0.04).astype(np.float32)
    inits += [numpy_helper.from_array(W, f'W{{l}}'), numpy_helper.from_array(R, f'R{{l}}')]
    nodes.append(helper.make_node('LSTM', [src, f'W{{l}}', f'R{{l}}'], [f'Y{{l}}'], hidden_size=H))
    nodes.append(helper.make_node('Squeeze', [f'Y{{l}}', 'ax'], [f'S{{l}}']))
    src = f'S{{l}}'
inits.append(numpy_helper.from_array(np.array([1], np.int64), 'ax'))
g = helper.make_graph(nodes, 'g', [helper.make_tensor_value_info('x', TensorProto.FLOAT, [None, None, H])],
                      [helper.make_tensor_value_info(src, TensorProto.FLOAT, None)], inits)
model = helper.make_model(g, opset_imports=[helper.make_opsetid('', 17)])
so = ort.SessionOptions(); so.intra_op_num_threads = {threads}; so.inter_op_num_threads = 1
sess = ort.InferenceSession(model.SerializeToString(), so, providers=['CPUExecutionProvider'])
x = rng.standard_normal((1000, 64, H)).astype(np.float32)
sess.run(None, {{'x': x[:64]}})
peak, dt, out = peak_of(lambda: sess.run(None, {{'x': x}}))
print(json.dumps(dict(peak=peak - out[0].nbytes, seconds=dt)))
"""


def child(code: str, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "OPENBLAS_NUM_THREADS": str(threads)}
    r = subprocess.run([sys.executable, "-c", PRELUDE + code], capture_output=True, text=True,
                       env=env)  # fmt: skip
    if r.returncode != 0:
        return {"error": r.stderr.strip().splitlines()[-1] if r.stderr else "failed"}
    return json.loads(r.stdout.strip().splitlines()[-1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--threads", type=positive_int, default=2)
    ap.add_argument("--out", default="bench-out/memory_bars.json")
    a = ap.parse_args()
    res = {"threads": a.threads}
    res["stream"] = child(LEANRNN_STREAM.format(threads=a.threads), a.threads)
    res["long_T100"] = child(LEANRNN_LONG.format(threads=a.threads, T=100), a.threads)
    res["long_T10000"] = child(LEANRNN_LONG.format(threads=a.threads, T=10000), a.threads)
    big = {}
    for name, code in (("leanrnn", BIG_LEANRNN), ("torch", BIG_TORCH), ("onnxruntime", BIG_ORT)):
        big[name] = child(code.format(threads=a.threads), a.threads)
    res["big"] = big
    os.makedirs(os.path.dirname(a.out) or ".", exist_ok=True)
    with open(a.out, "w") as f:
        json.dump(res, f, indent=2)
    mib = 2**20
    s, l1, l2 = res["stream"], res["long_T100"], res["long_T10000"]
    from leanrnn.bench.report import cpu_line

    print(cpu_line() + f"; {a.threads} thread(s)\n")
    print("| bar | measured | target |\n|---|---|---|")
    print(
        f"| stream 100 steps, N=1, H=512: tracemalloc growth | {s.get('tracemalloc_growth')} B | 0 |"
    )
    print(f"| stream 100 steps: RSS growth | {s.get('rss_growth', 0) / 1024:.0f} KiB | 0 |")
    print(
        f"| return_sequences=False peak RSS, T=100 / T=10,000 | {l1.get('peak', 0) / mib:.2f} / "
        f"{l2.get('peak', 0) / mib:.2f} MiB | within 1 MiB |"
    )
    print(
        f"| arena for a single step (weights excluded) | {l1.get('arena_one_step', 0) / 1024:.1f} KiB | <= 64 KiB |"
    )
    lb = big["leanrnn"]
    for name, r in big.items():
        if "error" in r:
            print(f"| N=64 T=1000 2x LSTM512: {name} | error: {r['error']} | |")
            continue
        ratio = r["peak"] / max(lb.get("peak", 1), 1)
        print(
            f"| N=64 T=1000 2x LSTM512: {name} peak beyond output | {r['peak'] / mib:.1f} MiB "
            f"({ratio:.1f}x leanrnn), {r['seconds']:.2f} s | leanrnn <= 1/10 of peers |"
        )


if __name__ == "__main__":
    main()
