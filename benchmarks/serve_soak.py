"""Server memory under a steady load of large requests: ``leanrnn serve``'s resident memory
(RSS) sampled while clients that read every answer send requests of T steps back to back,
against its ``--max-queued-bytes``. Until session 39 a finished request stayed in a reference
cycle (its on_done callback held the future it became the result of; over gRPC the call's
done callbacks held it too), so x and y lived until Python's full garbage collection: RSS grew
~1.4 MiB a request, far past the limit. The claim measured here: RSS stays within a small
multiple of the limit, flat over time.

    python benchmarks/serve_soak.py                      # HTTP and gRPC, 40 s each
    python benchmarks/serve_soak.py --protocol grpc --seconds 20 --steps 20000

The model is a 1-layer LSTM C=16 H=32 (x of T x 16 and y of T x 32 float32 a request), the
server runs ``--threads 1 --max-batch 8 --max-queued-bytes 64M``; ``--clients`` threads each
send one request at a time. The table gives RSS at each sample, its peak and the requests
answered. The engine's work is not the point: the request bytes are.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time

import numpy as np

from leanrnn.cli import positive_float, positive_int

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from serve_bench import launch  # the same server launch as the latency benchmark


def rss_mib(pid: int) -> float:
    with open(f"/proc/{pid}/status") as f:
        kb = next(int(ln.split()[1]) for ln in f if ln.startswith("VmRSS:"))
    return kb / 1024


def soak(protocol: str, model_path: str, steps: int, clients: int, seconds: float,
         every: float, limit: str) -> list[tuple[float, float, int]]:  # fmt: skip
    """[(seconds since start, server RSS MiB, requests answered so far)] while ``clients``
    threads send requests of ``steps`` steps over ``protocol`` for ``seconds``."""
    extra = ["--threads", "1", "--max-batch", "8", "--max-queued-bytes", limit]
    proc, grpc_addr, http_addr = launch(model_path, extra)
    done = [0]
    stop = time.monotonic() + seconds
    errors: list[str] = []

    def client() -> None:
        if protocol == "http":
            import tritonclient.http as tc

            c = tc.InferenceServerClient(http_addr, network_timeout=300, connection_timeout=300)
        else:
            import tritonclient.grpc as tc

            c = tc.InferenceServerClient(grpc_addr)
        x = np.ones((steps, 16), np.float32)
        inp = tc.InferInput("x", [steps, 16], "FP32")
        if protocol == "http":
            inp.set_data_from_numpy(x, binary_data=True)
            out = [tc.InferRequestedOutput("y", binary_data=True)]
        else:
            inp.set_data_from_numpy(x)
            out = [tc.InferRequestedOutput("y")]
        while time.monotonic() < stop:
            try:
                c.infer("m", [inp], outputs=out)
                done[0] += 1
            except Exception as e:  # counted and shown: the soak goes on
                errors.append(str(e)[:200])

    threads = [threading.Thread(target=client, daemon=True) for _ in range(clients)]
    t0 = time.monotonic()
    for t in threads:
        t.start()
    rows = [(0.0, rss_mib(proc.pid), 0)]
    try:
        while time.monotonic() < stop:
            time.sleep(every)
            rows.append((time.monotonic() - t0, rss_mib(proc.pid), done[0]))
        for t in threads:
            t.join(timeout=300)
        rows.append((time.monotonic() - t0, rss_mib(proc.pid), done[0]))
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    if errors:
        print(f"  {len(errors)} requests failed, e.g. {errors[0]}")
    return rows


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--protocol", choices=["http", "grpc", "both"], default="both")
    p.add_argument("--steps", type=positive_int, default=50_000, help="steps per request (T)")
    p.add_argument("--clients", type=positive_int, default=2)
    p.add_argument("--seconds", type=positive_float, default=40.0)
    p.add_argument("--every", type=positive_float, default=5.0, help="seconds between RSS samples")
    p.add_argument("--limit", default="64M", help="the server's --max-queued-bytes")
    args = p.parse_args(argv)
    import leanrnn

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "m.lrnn")
        leanrnn.LSTM(16, 32, seed=0).save(path)
        mib = args.steps * (16 + 32) * 4 / 2**20
        print(f"requests of T={args.steps} (x + y {mib:.1f} MiB), {args.clients} clients, "
              f"--max-queued-bytes {args.limit}")  # fmt: skip
        for protocol in ["http", "grpc"] if args.protocol == "both" else [args.protocol]:
            rows = soak(protocol, path, args.steps, args.clients, args.seconds, args.every,
                        args.limit)  # fmt: skip
            print(f"\n{protocol}: | s | server RSS MiB | requests answered |")
            print("|---:|---:|---:|")
            for t, rss, n in rows:
                print(f"| {t:.0f} | {rss:.0f} | {n} |")
            print(f"peak {max(r[1] for r in rows):.0f} MiB over {rows[-1][2]} requests")


if __name__ == "__main__":
    main()
