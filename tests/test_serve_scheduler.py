"""leanrnn.serve's scheduler in process (no transport): batched calls over state slots equal the
offline model per stream, pipelined requests of a stream keep their order, memory stays flat
while streams join and leave, and an engine failure fails only its own requests."""

from __future__ import annotations

import itertools
import os
import threading
import tracemalloc

import numpy as np
import pytest

import leanrnn
from leanrnn.engine.session import Pool
from leanrnn.errors import SpecError
from leanrnn.serve.errors import Exhausted, SequenceError
from leanrnn.serve.scheduler import Lane, Scheduler, bucket
from tolerances import ATOL_ORT, ATOL_SAME_ARITHMETIC, RTOL_ORT


def make(models: dict, **kw) -> Scheduler:
    opts = dict(threads=1, max_streams=256, max_batch=16, max_chunk=4, idle_timeout=60.0)
    opts.update(kw)
    pool = Pool()
    lanes = {}
    for name, m in models.items():
        lanes[name] = Lane(name, m, pool, **opts)
        lanes[name].warm_up()
    s = Scheduler(lanes, max_wait=0.001)
    s.start()
    return s


class Waiter:
    """Counts completions of submitted requests; ``wait()`` until all are done."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.pending = 0

    def submit(self, sched: Scheduler, *args, **kw):
        with self.cond:
            self.pending += 1
        return sched.submit(*args, on_done=self._done, **kw)

    def _done(self, r) -> None:
        with self.cond:
            self.pending -= 1
            self.cond.notify_all()

    def wait(self, timeout: float = 60) -> None:
        with self.cond:
            assert self.cond.wait_for(lambda: self.pending == 0, timeout)


def test_bucket_rounds_up_by_at_most_a_quarter():
    for n in range(1, 600):
        b = bucket(n)
        assert n <= b and (n <= 8 or b <= n * 1.25)
        assert bucket(b) == b


@pytest.mark.parametrize(
    "model",
    [
        leanrnn.LSTM(4, 7, num_layers=2, batch_first=True, seed=5),
        leanrnn.GRU(4, 5, num_layers=2, seed=6).astype(np.float64),
        leanrnn.RNN(4, 9, seed=7, nonlinearity="relu"),
    ],
    ids=["lstm-batch-first", "gru-f64", "rnn-relu"],
)
def test_pipelined_chunks_of_many_streams_equal_offline(model):
    """Every stream sends all its chunks at once (no waiting between them): they run in order,
    batched with the other streams, and equal the offline model on the whole sequence."""
    sched = make({"m": model})
    rng = np.random.default_rng(0)
    dt = model.dtype
    w = Waiter()
    streams = {}
    for s in range(24):
        T = int(rng.integers(1, 30))
        x = rng.standard_normal((T, 4)).astype(dt)
        cuts = sorted({0, T, *rng.integers(1, T, size=3).tolist()}) if T > 1 else [0, T]
        reqs = [
            w.submit(sched, "m", ("i", s), a == 0, b == T, x[a:b])
            for a, b in itertools.pairwise(cuts)
        ]
        streams[s] = (x, reqs)
    w.wait()
    sched.stop()
    for x, reqs in streams.values():
        xb = x[None] if model.spec.batch_first else x[:, None]
        want = model(xb)[0]
        want = want[0] if model.spec.batch_first else want[:, 0]
        got = np.concatenate([r.y for r in reqs])
        # each stream's rows see the same arithmetic in a batch as alone
        np.testing.assert_allclose(got, want, rtol=0, atol=ATOL_SAME_ARITHMETIC[dt])
    lane = sched.lanes["m"]
    assert not lane.seqs  # every stream ended: every slot is free again
    assert len(lane.free) == 256
    assert lane.rows > 2 * lane.calls  # streams were batched (all were pending at once)
    # every call had one of the shapes planned at start-up (none planned while serving)
    assert set(lane._calls) == set(lane.shapes)
    assert all(s.plan is not None and s._N == nb and s._T <= T
               for (nb, T), (s, *_) in lane._calls.items())  # fmt: skip


def test_a_request_shorter_than_the_chunk_runs_in_one_call():
    """A 10-step request with --max-chunk 16 runs as one call of T=10 (T is bucketed up, not
    rounded down to 8 + 2: two calls, twice the latency); streams of 10, 9 and 3 steps in one
    call ride its padded steps frozen (their rows leave the GEMMs) and equal the offline
    model."""
    model = leanrnn.LSTM(4, 20, seed=3)
    lane = Lane("m", model, Pool(), threads=1, max_streams=8, max_batch=4, max_chunk=16,
                idle_timeout=60.0)  # fmt: skip
    lane.warm_up()
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal((T, 4)).astype(np.float32) for T in (10, 9, 3)]
    for i, x in enumerate(xs):
        lane.submit(("i", i), True, True, x, None, None, False, None, 0.0)
    picked = lane.take()
    assert len(picked) == 3
    assert lane.run(picked, t_cap=16, now=0.0) == (10, 22)  # one call: every step
    done = lane.finish(picked, 0.0)
    assert len(done) == 3 and lane.calls == 1
    for r, x in zip(done, xs, strict=True):
        np.testing.assert_allclose(r.y, model(x[:, None])[0][:, 0], rtol=0,
                                   atol=ATOL_SAME_ARITHMETIC[np.float32])  # fmt: skip


def test_memory_flat_while_streams_join_and_leave():
    """After warm-up, 2,000 streams joining and leaving over ~20,000 steps allocate nothing
    that stays (traced Python and numpy memory grows by < 256 KiB)."""
    model = leanrnn.LSTM(3, 8, seed=1)
    sched = make({"m": model}, max_streams=64, max_batch=32)
    rng = np.random.default_rng(1)
    x = rng.standard_normal((4, 3)).astype(np.float32)
    w = Waiter()
    next_id = [0]
    live: dict[int, list] = {}  # stream id -> [requests left, not started yet]

    def round_() -> int:
        steps = 0
        while len(live) < 48:
            live[next_id[0]] = [int(rng.integers(1, 12)), True]
            next_id[0] += 1
        for sid, st in list(live.items()):
            k = int(rng.integers(1, 5))
            st[0] -= 1
            end = st[0] == 0
            w.submit(sched, "m", ("i", sid), st[1], end, x[:k])
            st[1] = False
            steps += k
            if end:
                del live[sid]
        w.wait()
        return steps

    for _ in range(60):  # warm-up: every (bucket, T) call shape gets its session
        round_()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    steps = 0
    n0 = next_id[0]
    while next_id[0] - n0 < 2000:
        steps += round_()
    grown = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    sched.stop()
    assert steps > 15000
    assert grown < 256 << 10, f"grew {grown} bytes"


def rss() -> int:
    """Resident bytes of this process (Linux /proc)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not os.path.exists("/proc/self/statm"), reason="reads RSS from /proc")
def test_rss_flat_over_ten_thousand_streams_and_a_million_steps():
    """Issue 11's bar at full size (~2 s: a tiny model, 128 streams per batched call): after
    warm-up, 10,000 streams joining and leaving over 1,000,000 stream-steps, in requests of
    random sizes, grow the process's RSS by less than 1 MiB."""
    model = leanrnn.LSTM(3, 8, seed=1)
    sched = make({"m": model}, max_streams=136, max_batch=128, max_chunk=16)
    rng = np.random.default_rng(3)
    x = rng.standard_normal((16, 3)).astype(np.float32)
    done = threading.Semaphore(0)
    left: dict[int, list] = {}  # stream id -> [steps left, not started yet]
    count = [0, 0]  # streams started, stream-steps sent

    def round_() -> None:
        while len(left) < 128:
            left[count[0]] = [int(rng.integers(20, 181)), True]
            count[0] += 1
        for sid, st in list(left.items()):
            k = min(st[0], int(rng.integers(1, 17)))
            st[0] -= k
            sched.submit("m", ("i", sid), st[1], st[0] == 0, x[:k],
                         on_done=lambda r: done.release())  # fmt: skip
            st[1] = False
            count[1] += k
            if not st[0]:
                del left[sid]
        for _ in range(128):
            done.acquire()

    for _ in range(200):  # warm-up: every call shape planned, the allocator settled
        round_()
    base, streams0, steps0 = rss(), count[0], count[1]
    while count[0] - streams0 < 10_000 or count[1] - steps0 < 1_000_000:
        round_()
    grown = rss() - base
    sched.stop()
    assert not sched.lanes["m"].evicted  # they left by sequence_end
    assert grown < 1 << 20, f"RSS grew {grown} bytes over {count[1] - steps0} steps"


def test_engine_failure_fails_only_its_requests():
    model = leanrnn.GRU(3, 4, seed=2)
    sched = make({"a": model, "b": leanrnn.GRU(3, 4, seed=3)})
    lane = sched.lanes["a"]
    real = lane.run
    calls = {"n": 0}

    def flaky(picked, t_cap, now):
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("boom")
        return real(picked, t_cap, now)

    lane.run = flaky
    x = np.ones((3, 3), np.float32)
    w = Waiter()
    bad = w.submit(sched, "a", ("s", "x"), True, False, x)
    w.wait()
    assert isinstance(bad.error, RuntimeError)
    with pytest.raises(SequenceError, match="'x' is not live"):  # its stream ended
        sched.submit("a", ("s", "x"), False, False, x)
    good = [w.submit(sched, name, ("s", name), True, True, x) for name in ("a", "b")]
    w.wait()
    sched.stop()
    assert all(r.error is None for r in good)
    np.testing.assert_allclose(
        good[0].y, model(x)[0], rtol=0, atol=ATOL_SAME_ARITHMETIC[np.float32]
    )


def test_cap_refuses_new_streams_only():
    sched = make({"m": leanrnn.GRU(3, 4, seed=4)}, max_streams=2)
    x = np.ones((1, 3), np.float32)
    w = Waiter()
    w.submit(sched, "m", ("i", 1), True, False, x)
    w.submit(sched, "m", ("i", 2), True, False, x)
    with pytest.raises(Exhausted, match="holds 2 live streams"):
        sched.submit("m", ("i", 3), True, False, x)
    w.submit(sched, "m", ("i", 1), False, True, x)  # ends: frees its slot
    w.wait()
    w.submit(sched, "m", ("i", 3), True, True, x)
    w.wait()
    sched.stop()


def test_models_that_cannot_stream_are_refused_by_name():
    bi = leanrnn.LSTM(3, 4, bidirectional=True, seed=1)
    with pytest.raises(SpecError, match=r"model 'bi' is bidirectional.*serve a forward stack"):
        Lane("bi", bi, Pool(), threads=1, max_streams=2, max_batch=2, max_chunk=2,
             idle_timeout=1.0)  # fmt: skip

    class NotAStack:
        pass

    with pytest.raises(SpecError, match="model 'g' is a NotAStack; serve batches recurrent stacks"):
        Lane("g", NotAStack(), Pool(), threads=1, max_streams=2, max_batch=2, max_chunk=2,
             idle_timeout=1.0)  # fmt: skip


def test_cli_refuses_two_models_of_one_name(capsys):
    from leanrnn.cli import main

    assert main(["serve", "a=x.lrnn", "a=y.lrnn"]) == 1
    assert "two models named ['a']" in capsys.readouterr().err


def test_http_connections_send_without_nagle():
    """Responses leave at once: accepted connections have TCP_NODELAY (a regression: with a
    socket made as proto 0, asyncio left Nagle on and every HTTP response waited ~40 ms)."""
    import asyncio
    import socket

    pytest.importorskip("prometheus_client")
    pytest.importorskip("starlette")
    from leanrnn.serve.server import _listen

    async def main() -> int:
        loop = asyncio.get_running_loop()
        sock = _listen("127.0.0.1", 0)
        got = loop.create_future()

        class Probe(asyncio.Protocol):
            def connection_made(self, transport):
                s = transport.get_extra_info("socket")
                got.set_result(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY))
                transport.close()

        server = await loop.create_server(Probe, sock=sock)
        _, w = await asyncio.open_connection(*sock.getsockname())
        value = await got
        w.close()
        server.close()
        await server.wait_closed()
        return value

    assert asyncio.run(main()) != 0


def test_transport_libraries_are_imported_by_the_server_only():
    """import leanrnn, the CLI's parser (with the serve command) and the scheduler load none
    of grpc, starlette, uvicorn, prometheus_client, tritonclient (the serve extra)."""
    import os
    import subprocess
    import sys

    code = (
        "import sys, leanrnn, leanrnn.cli, leanrnn.serve.scheduler\n"
        "leanrnn.cli.build_parser()\n"
        "bad = sorted(m for m in sys.modules if m.split('.')[0] in "
        "('grpc', 'starlette', 'uvicorn', 'prometheus_client', 'tritonclient'))\n"
        "print(bad)\n"
    )
    src = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "src")
    env = dict(os.environ, PYTHONPATH=src)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                         timeout=120, check=True)  # fmt: skip
    assert out.stdout.strip() == "[]"


@pytest.mark.onnx
def test_bench_onnxruntime_baseline_computes_the_model():
    """benchmarks/serve_bench.py's baseline (c), one onnxruntime session per stream behind the
    same scheduler, gives each stream the offline model's outputs: its latencies compare like
    with like."""
    pytest.importorskip("onnx")
    pytest.importorskip("onnxruntime")
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "serve_bench.py"
    spec = importlib.util.spec_from_file_location("serve_bench", path)
    bench = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(bench)
    model = leanrnn.LSTM(4, 6, num_layers=2, seed=9)
    lane = bench.ort_lane_class()("m", model, Pool(), threads=1, max_streams=8, max_batch=8,
                                  max_chunk=4, idle_timeout=60.0)  # fmt: skip
    lane.warm_up()
    assert lane.max_batch == 1  # one stream per call, whatever was asked
    sched = Scheduler({"m": lane}, max_wait=0)
    rng = np.random.default_rng(4)
    w = Waiter()
    streams = []
    for s in range(6):  # all six live at once (queued before the engine starts): six slots
        x = rng.standard_normal((int(rng.integers(2, 20)), 4)).astype(np.float32)
        cut = x.shape[0] // 2
        reqs = [w.submit(sched, "m", s, True, False, x[:cut]),
                w.submit(sched, "m", s, False, True, x[cut:])]  # fmt: skip
        streams.append((x, reqs))
    sched.start()
    w.wait()
    sched.stop()
    for x, reqs in streams:
        got = np.concatenate([r.y for r in reqs])
        np.testing.assert_allclose(got, model(x)[0], rtol=RTOL_ORT[np.float32],
                                   atol=ATOL_ORT[np.float32])  # fmt: skip
    assert len(lane._sessions) > 1  # a session per stream slot
