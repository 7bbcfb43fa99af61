"""Issue 11's latency curve for ``leanrnn serve``: p50/p99 request latency against concurrent
streams for three servers behind the same front end (leanrnn.serve's HTTP/gRPC code), side by
side: (a) ``leanrnn serve`` (continuous batching, its max batch measured at start-up), (b)
``leanrnn serve --max-batch 1`` (one stream per engine call), (c) one onnxruntime
InferenceSession per stream (``--ort-server``: this file's OrtLane in place of the engine).

    python benchmarks/serve_bench.py                                  # H=512, 2 layers
    python benchmarks/serve_bench.py --hidden 128 --streams 8 16 32   # a quick look
    python benchmarks/serve_bench.py --plot benchmarks/serve_bench.png --json serve.json
    python benchmarks/serve_bench.py --engine-only 20 --streams 1 8 64   # no transport
    python benchmarks/serve_bench.py --only ort --streams 8 16        # one server

Load: every stream sends ``--steps`` steps (frames of C features) every ``--period`` seconds
through gRPC (tritonclient.grpc.aio) as one sequence (sequence_start on its first request,
sequence_end on its last), for ``--seconds`` seconds after a staggered start. The streams are
spread over ``--clients`` client processes (asyncio inside), separate from the server process.
``--rpc stream`` (the default): each client process sends its streams' requests on one
bidirectional ModelStreamInfer stream, as Triton's streaming clients send sequences, and
matches the answers by request id; ``--rpc unary``: one ModelInfer call per request (what
the tables before 2026-12-03 measured). On a 2-core machine the clients' and the front
end's CPU per request is CPU the engine does not get.
Latency = request sent -> response received, per request (a stream's first request,
which takes its slot and, in the baseline, makes its session, is not counted). A stream whose response comes later
than its next send time sends late (``late`` counts those): a server that falls behind shows
up as late sends and a long tail, not as a silently lower request rate.

The issue's bar (p99 <= 100 ms for 10 steps per 100 ms, H=512, 2 layers: batched holds >= 4x
the streams of --max-batch 1) is read off the table: the most streams with p99 <= --target.
On a shared 2-core machine the client processes take CPU from the server: compare the two
servers measured in the same run, not absolute numbers across runs. The servers all start first
and take each stream count in turn (the order rotating), so a slow spell of the machine falls
on all of them rather than on whichever ran then.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import queue
import shlex
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

from leanrnn.cli import positive_float, positive_int

SRC = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")


def launch(
    model_path: str, extra: list[str], ort: bool = False
) -> tuple[subprocess.Popen, str, str]:
    """``leanrnn serve`` (or, ``ort``, this file's onnxruntime-per-stream server) on free ports;
    (process, grpc address, http address)."""
    env = dict(os.environ, PYTHONPATH=SRC + os.pathsep + os.environ.get("PYTHONPATH", ""))
    if ort:
        cmd = [sys.executable, os.path.abspath(__file__), "--ort-server", model_path, *extra]
    else:
        cmd = [sys.executable, "-m", "leanrnn", "serve", f"m={model_path}", "--http-port", "0",
               "--grpc-port", "0", *extra]  # fmt: skip
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                            env=env)  # fmt: skip
    lines: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [lines.put(s) for s in proc.stdout], daemon=True).start()
    line = lines.get(timeout=120)
    fields = dict(w.split("=", 1) for w in line.split() if "=" in w)
    return proc, fields["grpc"], fields["http"]


def server_cpu(pid: int) -> float:
    """CPU seconds (user + system) the server process has used: what a request costs it, which
    other processes on a shared machine inflate far less than they inflate latency."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def counters(http: str) -> np.ndarray:
    """[engine seconds, engine calls, streams in those calls] so far, from /metrics."""
    import urllib.request

    text = urllib.request.urlopen(f"http://{http}/metrics", timeout=10).read().decode()
    names = ("leanrnn_serve_engine_seconds_total", "leanrnn_serve_batch_size_count",
             "leanrnn_serve_batch_size_sum")  # fmt: skip
    return np.array([sum(float(ln.split()[-1]) for ln in text.splitlines()
                         if ln.startswith(name)) for name in names])  # fmt: skip


def max_batch(http: str) -> int:
    """The server's max batch (its model config's max_candidate_sequences): measured at
    start-up unless --max-batch was given."""
    import urllib.request

    cfg = json.loads(urllib.request.urlopen(f"http://{http}/v2/models/m/config", timeout=10).read())
    return int(cfg["sequence_batching"]["oldest"]["max_candidate_sequences"])


def _client(url: str, first_id: int, n: int, C: int, steps: int, period: float,
            seconds: float, rpc: str, model: str, out) -> None:  # fmt: skip
    """One client process: n streams as asyncio tasks; puts (latencies, late sends, errors).
    ``rpc`` "stream": the process's streams share one bidirectional ModelStreamInfer stream
    (how Triton's streaming clients send sequences), answers matched to requests by id;
    "unary": one ModelInfer call per request."""
    import tritonclient.grpc.aio as tga

    async def main():
        c = tga.InferenceServerClient(url)
        lat, late, errors = [], [0], [0]
        rng = np.random.default_rng(first_id)
        frames = rng.standard_normal((steps, C)).astype(np.float32)
        outputs = [tga.InferRequestedOutput("y")]
        sends: asyncio.Queue = asyncio.Queue()
        waiting: dict[str, asyncio.Future] = {}

        async def requests():
            while (item := await sends.get()) is not None:
                yield item

        def fail_all(error: BaseException) -> None:
            for f in waiting.values():
                if not f.done():
                    f.set_exception(error)
            waiting.clear()

        async def answers(it):
            try:
                async for result, error in it:
                    if error is not None:  # a stream's error carries no id: fail them all
                        fail_all(error)
                    else:
                        waiting.pop(result.get_response().id).set_result(result)
            except BaseException as e:  # the stream broke: nothing more will be answered
                fail_all(e)
                raise

        reader = None
        if rpc == "stream":
            reader = asyncio.ensure_future(answers(c.stream_infer(requests())))

        async def infer(sid: int, k: int, start: bool, end: bool):
            i = tga.InferInput("x", [steps, C], "FP32")
            i.set_data_from_numpy(frames)
            if rpc == "unary":
                return await c.infer(model, [i], outputs=outputs, sequence_id=sid,
                                     sequence_start=start, sequence_end=end)  # fmt: skip
            if reader.done():
                raise RuntimeError("the request stream is closed")
            rid = f"{sid}.{k}"
            fut = waiting[rid] = asyncio.get_running_loop().create_future()
            sends.put_nowait({"model_name": model, "inputs": [i], "outputs": outputs,
                              "request_id": rid, "sequence_id": sid, "sequence_start": start,
                              "sequence_end": end})  # fmt: skip
            return await fut

        async def stream(sid: int):
            await asyncio.sleep(rng.uniform(0, period))  # staggered joins
            t_next = time.monotonic()
            end_at = t_next + seconds
            first = True
            k = 0
            while True:
                last = t_next + period >= end_at
                t0 = time.monotonic()
                k += 1
                try:
                    await infer(sid, k, first, last)
                    if not first:  # a stream's first request (its slot, and for the
                        lat.append(time.monotonic() - t0)  # baseline its session) not counted
                except Exception:  # counted; the stream starts over
                    errors[0] += 1
                    first = True
                else:
                    first = False
                if last:
                    return
                t_next += period
                wait = t_next - time.monotonic()
                if wait < 0:
                    late[0] += 1
                else:
                    await asyncio.sleep(wait)

        await asyncio.gather(*(stream(first_id + k) for k in range(n)))
        if reader is not None:
            sends.put_nowait(None)
            await asyncio.gather(reader, return_exceptions=True)
        await c.close()
        return lat, late[0], errors[0]

    out.put(asyncio.run(main()))


def measure(url: str, streams: int, clients: int, C: int, steps: int, period: float,
            seconds: float, base_id: int, rpc: str = "stream", model: str = "m") -> dict:  # fmt: skip
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    per = [streams // clients + (k < streams % clients) for k in range(clients)]
    procs, first = [], base_id
    for n in per:
        if n:
            args = (url, first, n, C, steps, period, seconds, rpc, model, out)
            p = ctx.Process(target=_client, args=args)
            p.start()
            procs.append(p)
            first += n
    lat, late, errors = [], 0, 0
    for _ in procs:
        a, b, e = out.get(timeout=seconds * 10 + 120)
        lat += a
        late += b
        errors += e
    for p in procs:
        p.join()
    ms = np.array(lat) * 1000
    return {
        "streams": streams,
        "requests": len(lat),
        "p50_ms": float(np.percentile(ms, 50)) if len(ms) else float("nan"),
        "p99_ms": float(np.percentile(ms, 99)) if len(ms) else float("nan"),
        "late": late,
        "errors": errors,
    }


# ------------------------------------------------------------------ (c) onnxruntime per stream
def onnx_stack(model) -> bytes:
    """An ONNX graph of a forward LSTM stack with ``model``'s weights: x [T, 1, C], h0 and c0
    [L, 1, H] in; y [T, 1, H], h_n, c_n [L, 1, H] out (one ONNX LSTM node per layer)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from leanrnn.bench.problem import _to_onnx_order

    spec = model.spec
    if spec.cell != "lstm" or spec.direction != "forward" or spec.proj_size:
        raise SystemExit("--ort-server builds forward LSTM stacks without projection only")
    L, H, C = spec.num_layers, spec.hidden_size, spec.input_size
    sd = model.state_dict()
    f32 = TensorProto.FLOAT
    inits, nodes = [], []

    def const(name, a):
        inits.append(numpy_helper.from_array(np.asarray(a), name))
        return name

    inp = "x"
    for layer in range(L):
        W = _to_onnx_order("lstm", sd[f"weight_ih_l{layer}"], H)[None]
        R = _to_onnx_order("lstm", sd[f"weight_hh_l{layer}"], H)[None]
        B = np.concatenate([_to_onnx_order("lstm", sd[f"{k}_l{layer}"], H)
                            for k in ("bias_ih", "bias_hh")])[None]  # fmt: skip
        s0, s1, ax = (const(f"s{layer}.{n}", np.array([v], np.int64))
                      for n, v in (("a", layer), ("b", layer + 1), ("ax", 0)))  # fmt: skip
        nodes += [
            helper.make_node("Slice", ["h0", s0, s1, ax], [f"h0.{layer}"]),
            helper.make_node("Slice", ["c0", s0, s1, ax], [f"c0.{layer}"]),
            helper.make_node(
                "LSTM",
                [inp, const(f"W{layer}", W), const(f"R{layer}", R), const(f"B{layer}", B), "",
                 f"h0.{layer}", f"c0.{layer}"],
                [f"Y{layer}", f"hn.{layer}", f"cn.{layer}"], hidden_size=H,
            ),
            helper.make_node("Squeeze", [f"Y{layer}", const(f"sq{layer}", np.array([1], np.int64))],
                             [f"y{layer}" if layer < L - 1 else "y"]),
        ]  # fmt: skip
        inp = f"y{layer}"
    nodes.append(helper.make_node("Concat", [f"hn.{k}" for k in range(L)], ["h_n"], axis=0))
    nodes.append(helper.make_node("Concat", [f"cn.{k}" for k in range(L)], ["c_n"], axis=0))
    ins = [helper.make_tensor_value_info("x", f32, ["T", 1, C]),
           helper.make_tensor_value_info("h0", f32, [L, 1, H]),
           helper.make_tensor_value_info("c0", f32, [L, 1, H])]  # fmt: skip
    outs = [helper.make_tensor_value_info("y", f32, ["T", 1, H]),
            helper.make_tensor_value_info("h_n", f32, [L, 1, H]),
            helper.make_tensor_value_info("c_n", f32, [L, 1, H])]  # fmt: skip
    g = helper.make_graph(nodes, "stack", ins, outs, inits)
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 14)])
    m.ir_version = 8
    onnx.checker.check_model(m)
    return m.SerializeToString()


def ort_lane_class():
    """OrtLane: leanrnn.serve's Lane (slots, sequences, eviction, the same scheduler and front
    end) whose calls run each stream's pending request through that stream's own onnxruntime
    InferenceSession, one stream per call: the per-stream deployment the issue compares with.
    Sessions are made when a slot is first used and kept for the next sequence on that slot
    (their state is an input, so nothing carries over); their weights are one shared copy
    (SessionOptions.add_initializer), so only each session's own buffers are per stream."""
    import onnxruntime as ort

    from leanrnn.serve.scheduler import Lane

    class OrtLane(Lane):
        def __init__(self, name, model, pool, **kw):
            kw["max_batch"] = 1
            super().__init__(name, model, pool, **kw)
            self._model = model
            self._onnx = onnx_stack(model)
            import onnx

            proto = onnx.load_from_string(self._onnx)
            self._shared = {
                t.name: ort.OrtValue.ortvalue_from_numpy(onnx.numpy_helper.to_array(t))
                for t in proto.graph.initializer
            }
            self._sessions: dict[int, ort.InferenceSession] = {}

        def _session(self, slot: int):
            sess = self._sessions.get(slot)
            if sess is None:
                so = ort.SessionOptions()
                so.intra_op_num_threads = self.threads or 1
                so.inter_op_num_threads = 1
                so.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
                for name, v in self._shared.items():
                    so.add_initializer(name, v)
                sess = self._sessions[slot] = ort.InferenceSession(
                    self._onnx, so, providers=["CPUExecutionProvider"]
                )
            return sess

        def warm_up(self) -> None:
            """One session, checked against the leanrnn model on a few steps."""
            x = np.random.default_rng(0).standard_normal((7, self.C)).astype(np.float32)
            z = np.zeros((self.L, 1, self.H), np.float32)
            y = self._session(0).run(None, {"x": x[:, None], "h0": z, "c0": z})[0][:, 0]
            err = float(np.abs(y - self._model(x)[0]).max())
            if err > 1e-4:
                raise SystemExit(f"the ONNX stack differs from the model by {err}")

        def run(self, picked, t_cap, now):
            steps = T = 0
            for s in picked:
                r = s.queue[0]
                p, k = r.pos, r.T - r.pos  # the whole request in one call
                if r.t_first is None:
                    r.t_first = now
                h0 = np.ascontiguousarray(self.h_store[:, s.slot][:, None])
                c0 = np.ascontiguousarray(self.c_store[:, s.slot][:, None])
                y, h, c = self._session(s.slot).run(
                    None, {"x": np.ascontiguousarray(r.x[p:, None]), "h0": h0, "c0": c0}
                )
                r.y[p:] = y[:, 0]
                self.h_store[:, s.slot] = h[:, 0]
                self.c_store[:, s.slot] = c[:, 0]
                r.pos = r.T
                steps += k
                T = max(T, k)
            self.calls += 1
            self.rows += len(picked)
            return T, steps

    return OrtLane


def ort_server(args) -> int:
    """The baseline server process: leanrnn.serve's front end and scheduler over OrtLane."""
    import asyncio as aio

    import leanrnn
    from leanrnn.serve.server import ServeConfig, serve_async

    model = leanrnn.load(args.ort_server)
    cfg = ServeConfig(models={"m": args.ort_server}, http_port=0, grpc_port=0,
                      threads=args.threads, max_batch=1, max_streams=args.max_streams)  # fmt: skip
    aio.run(serve_async(cfg, {"m": model}, lambda s: print(s, flush=True), ort_lane_class()))
    return 0


def held_counts(rows: list[dict], target: float) -> tuple[int, int, list[dict]]:
    """(the most streams measured within the bar, the most up to which every measured count
    was, the rows below the first that missed it) for one server's rows. Within the bar: p99
    <= ``target`` ms, no errors, and the streams kept their pace (a server that falls behind
    makes clients send late; at most 1% late sends). On a shared VM one stalled window can
    miss at a count below others that pass: both figures are reported."""

    def ok(r: dict) -> bool:
        return r["p99_ms"] <= target and not r["errors"] and r["late"] <= 0.01 * r["requests"]

    rows = sorted(rows, key=lambda r: r["streams"])
    most = max((r["streams"] for r in rows if ok(r)), default=0)
    missed = [r for r in rows if r["streams"] < most and not ok(r)]
    steady = 0
    for r in rows:
        if not ok(r):
            break
        steady = r["streams"]
    return most, steady, missed


def engine_only(model, streams: list[int], steps: int, rounds: int, threads: int) -> None:
    """The scheduler and engine without a transport, in this process: every stream has one
    request of ``steps`` steps pending at once (the engine never idles), ``rounds`` times.
    Reports the scheduler thread's CPU microseconds per stream-step, which other processes on
    a shared machine do not inflate the way they inflate wall-clock latency. First, the
    ceiling: the same streams as one dense batch of ``Session.run`` ([steps, streams, C] a
    call, the calling thread's CPU), what no scheduler can beat — its N=1 row against its
    largest one is the most that batching can gain on this CPU for this model."""
    from leanrnn.engine.session import Pool
    from leanrnn.serve.scheduler import Lane, Scheduler

    C = model.spec.input_size
    x = np.random.default_rng(0).standard_normal((steps, C)).astype(np.float32)
    print(f"{'scheduler':<22}{'streams':>8}{'cpu us/step':>13}{'wall us/step':>14}")
    session = model.session
    session.threads = threads
    for n in streams:
        xs = np.ascontiguousarray(np.broadcast_to(x[:, None, :], (steps, n, C)))
        session.run(xs)  # plans this batch's memory and warms it
        cpu0, t0 = time.thread_time(), time.perf_counter()
        for _ in range(rounds):
            session.run(xs)
        k = n * rounds * steps
        print(f"{'dense (Session.run)':<22}{n:>8}{(time.thread_time() - cpu0) / k * 1e6:>13.1f}"
              f"{(time.perf_counter() - t0) / k * 1e6:>14.1f}", flush=True)  # fmt: skip
    for name, max_batch in (("batched (64)", 64), ("--max-batch 1", 1)):
        for n in streams:
            lane = Lane("m", model, Pool(), threads=threads, max_streams=max(n, 1),
                        max_batch=max_batch, max_chunk=16, idle_timeout=600)  # fmt: skip
            lane.warm_up()
            sched = Scheduler({"m": lane}, max_wait=0)
            sched.start()
            clock = time.pthread_getcpuclockid(sched._thread.ident)
            done = threading.Semaphore(0)
            cpu0, t0 = time.clock_gettime(clock), time.perf_counter()
            for r in range(rounds):
                for sid in range(n):
                    sched.submit("m", ("i", sid), r == 0, r == rounds - 1, x,
                                 on_done=lambda _, d=done: d.release())  # fmt: skip
                for _ in range(n):
                    done.acquire()
            cpu = time.clock_gettime(clock) - cpu0
            wall = time.perf_counter() - t0
            sched.stop()
            k = n * rounds * steps
            print(f"{name:<22}{n:>8}{cpu / k * 1e6:>13.1f}{wall / k * 1e6:>14.1f}", flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=positive_int, default=512)
    ap.add_argument("--layers", type=positive_int, default=2)
    ap.add_argument("--input", type=positive_int, default=40, help="features per step (C)")
    ap.add_argument("--steps", type=positive_int, default=10, help="steps per request")
    ap.add_argument(
        "--period", type=positive_float, default=0.1, help="seconds between a stream's sends"
    )
    ap.add_argument("--seconds", type=positive_float, default=5.0, help="load per point")
    ap.add_argument("--streams", type=positive_int, nargs="+",
                    default=[4, 8, 16, 24, 32, 48, 64, 96, 128, 192, 256])  # fmt: skip
    ap.add_argument("--clients", type=positive_int, default=2, help="client processes")
    ap.add_argument("--rpc", choices=("stream", "unary"), default="stream",
                    help="stream: each client process's streams share one ModelStreamInfer "
                    "stream (default); unary: one ModelInfer call per request")  # fmt: skip
    ap.add_argument("--threads", type=positive_int, default=1, help="engine threads of the server")
    ap.add_argument("--target", type=positive_float, default=100.0, help="p99 bar in ms")
    ap.add_argument("--only", nargs="+", choices=sorted(VARIANTS), default=list(VARIANTS),
                    help="which servers to measure (default all three)")  # fmt: skip
    ap.add_argument("--serve-args", default="",
                    help="more arguments for (a) leanrnn serve, e.g. '--max-wait-ms 20'")  # fmt: skip
    ap.add_argument("--json", help="write the results here")
    ap.add_argument("--plot", help="write a p50/p99 plot here (matplotlib)")
    ap.add_argument(
        "--engine-only",
        type=positive_int,
        metavar="ROUNDS",
        help="measure the scheduler and engine in process instead (no transport)",
    )
    ap.add_argument("--ort-server", metavar="MODEL", help=argparse.SUPPRESS)  # the (c) process
    ap.add_argument("--max-streams", type=positive_int, default=1024, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    sys.path.insert(0, SRC)
    if args.ort_server:
        return ort_server(args)
    import leanrnn

    tmp = tempfile.mkdtemp(prefix="serve_bench_")
    path = os.path.join(tmp, "m.lrnn")
    model = leanrnn.LSTM(args.input, args.hidden, num_layers=args.layers, seed=0)
    if args.engine_only:
        engine_only(model, args.streams, args.steps, args.engine_only, args.threads)
        return 0
    model.save(path)
    results: dict[str, list[dict]] = {}
    print(f"LSTM C={args.input} H={args.hidden} L={args.layers}; {args.steps} steps every "
          f"{args.period * 1000:.0f} ms per stream; {args.seconds:g} s per point; "
          f"{args.clients} client processes; server --threads {args.threads}; "
          f"{os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}")  # fmt: skip
    print(f"{'server':<22}{'streams':>8}{'requests':>10}{'p50 ms':>9}{'p99 ms':>9}{'late':>6}"
          f"{'errors':>7}{'cpu ms/req':>11}{'engine ms/req':>14}{'batch':>6}{'load':>6}")  # fmt: skip
    base = 1
    most = max(args.streams)
    # Every server starts first and then each stream count is measured on each in turn, the
    # order rotating from one count to the next: on a VM whose speed drifts (50% steal for
    # minutes on the Xeon), one server after another let a slow spell fall on one of them
    # alone. An idle server computes nothing (the others wait on their sockets).
    servers = {}
    try:
        for key in args.only:
            name, extra, ort = VARIANTS[key]
            extra = ["--threads", str(args.threads), *extra]
            if key == "batched":
                extra += shlex.split(args.serve_args)
            if ort:
                extra += ["--max-streams", str(most)]
            servers[name] = launch(path, extra, ort)
            results[name] = []
            print(f"{name}: max batch {max_batch(servers[name][2])}", flush=True)
        running = list(servers)
        for i, n in enumerate(args.streams):
            k = i % max(len(running), 1)
            for name in running[k:] + running[:k]:
                proc, url, http = servers[name]
                time.sleep(0.5)  # the previous load's stragglers out of the way
                cpu0, m0 = server_cpu(proc.pid), counters(http)
                r = measure(url, n, args.clients, args.input, args.steps, args.period,
                            args.seconds, base, args.rpc)  # fmt: skip
                base += n
                req = max(r["requests"], 1)
                r["server_cpu_ms_per_request"] = (server_cpu(proc.pid) - cpu0) * 1000 / req
                eng, calls, in_calls = counters(http) - m0
                r["engine_ms_per_request"] = eng * 1000 / req
                r["mean_batch"] = in_calls / max(calls, 1)
                r["load"] = os.getloadavg()[0]
                results[name].append(r)
                print(f"{name:<22}{n:>8}{r['requests']:>10}{r['p50_ms']:>9.1f}"
                      f"{r['p99_ms']:>9.1f}{r['late']:>6}{r['errors']:>7}"
                      f"{r['server_cpu_ms_per_request']:>11.2f}"
                      f"{r['engine_ms_per_request']:>14.2f}{r['mean_batch']:>6.1f}"
                      f"{r['load']:>6.1f}", flush=True)  # fmt: skip
                if r["p99_ms"] > 3 * args.target:
                    running.remove(name)  # past the bar: larger loads say nothing more
    finally:
        for proc, _, _ in servers.values():
            proc.terminate()
        for proc, _, _ in servers.values():
            proc.wait(timeout=60)
    print()
    held, steady = {}, {}
    for name, rows in results.items():
        held[name], steady[name], missed = held_counts(rows, args.target)
        print(f"{name}: most streams measured with p99 <= {args.target:g} ms: {held[name]}"
              + (f"; every count up to {steady[name]} (missed below {held[name]}: "
                 + ", ".join(f"{r['streams']} at p99 {r['p99_ms']:.0f} ms" for r in missed)
                 + ")" if missed else ""))  # fmt: skip
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "results": results, "held": held,
                       "held_every_count": steady}, f, indent=1)  # fmt: skip
    if args.plot:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(6.5, 4.2))
        for name, rows in results.items():
            s = [r["streams"] for r in rows]
            also = f", all up to {steady[name]}" if steady[name] != held[name] else ""
            (line,) = ax.plot(s, [r["p99_ms"] for r in rows], "o-",
                              label=f"{name} p99 (holds {held[name]}{also})")  # fmt: skip
            ax.plot(s, [r["p50_ms"] for r in rows], "o--", color=line.get_color(),
                    label=f"{name} p50")  # fmt: skip
        ax.axhline(args.target, color="grey", lw=0.8)
        loads = [r["load"] for rows in results.values() for r in rows]
        ax.set(xscale="log", yscale="log", xlabel="concurrent streams", ylabel="latency (ms)",
               title=f"LSTM H={args.hidden} L={args.layers}, {args.steps} steps / "
               f"{args.period * 1000:.0f} ms per stream; load avg "
               f"{min(loads):.1f}-{max(loads):.1f}")  # fmt: skip
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(args.plot, dpi=120)
    return 0


# key -> (label, extra server arguments, the onnxruntime server)
VARIANTS = {
    "batched": ("leanrnn serve", [], False),
    "batch1": ("serve --max-batch 1", ["--max-batch", "1"], False),
    "ort": ("onnxruntime per stream", [], True),
}


if __name__ == "__main__":
    sys.exit(main())
