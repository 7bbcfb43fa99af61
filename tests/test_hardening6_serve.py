"""leanrnn serve against memory no limit saw: the answers a ModelStreamInfer stream holds unsent
count against the global --max-queued-bytes (not only its own 4 MiB window), and large
compressed HTTP bodies are inflated off the event loop. One server subprocess for the module,
tiny model, small limits: nothing here allocates more than a few MB."""

from __future__ import annotations

import asyncio
import gzip
import threading
import time
import urllib.request

import numpy as np
import pytest

import leanrnn
from helpers import launch_server, stop_server

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")
grpc = pytest.importorskip("grpc")
pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2 as pb  # noqa: E402
from tritonclient.grpc import service_pb2_grpc as pbg  # noqa: E402

C, K = 2, 16  # x [T, 2] in, y [T, 16] out: 64 bytes of y a step
T = 1500  # a request counts 12 KB of x and 96 KB of y
QUEUED = 400_000  # --max-queued-bytes: three such requests, not four
# no BDP probing: the client's gRPC library then takes at most its initial window (64 KiB) of a
# stream's answers off the connection, so the rest stays in the server, where it is counted
QUIET = [("grpc.http2.bdp_probe", 0)]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    d = tmp_path_factory.mktemp("hardening6_serve")
    model = leanrnn.LSTM(C, K, seed=6)
    model.save(str(d / "lstm.lrnn"))
    args = [f"lstm={d}/lstm.lrnn", "--max-batch", "4", "--max-queued-bytes", str(QUEUED),
            "--max-request-bytes", "1000000", "--threads", "1"]  # fmt: skip
    proc, http_url, grpc_url, logs = launch_server(args)
    yield {"model": model, "http": http_url, "grpc": grpc_url, "logs": logs}
    assert stop_server(proc) == 0


def request(i: int):
    r = pb.ModelInferRequest(model_name="lstm", id=str(i))
    r.inputs.add(name="x", datatype="FP32", shape=[T, C])
    r.raw_input_contents.append(np.full((T, C), 0.25, np.float32).tobytes())
    return r


def stream_held(http_url: str) -> float:
    with urllib.request.urlopen(f"http://{http_url}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    return next(float(s.split()[-1]) for s in lines
                if s.startswith("leanrnn_serve_stream_held_bytes"))  # fmt: skip


# ------------------------------------------------------------------ 1. unread stream answers
def test_unread_stream_answers_count_against_max_queued_bytes(server):
    """Five streams, one after the other, send 2 requests each and read nothing: gRPC keeps
    their answers (96 KB each, past the client's 64 KiB window) in the server. Before the fix
    a request stopped counting once computed: the ten answers (960 KB) sat past
    --max-queued-bytes and every other request still went (4096 streams of 4 MiB: 16 GiB,
    bounded by no limit). Now what the streams hold stays within the
    limit, a call from elsewhere gets RESOURCE_EXHAUSTED, the requests past the limit are
    answered with its error, and the bytes come back once the clients read or go."""
    S, N = 5, 2
    channels = [grpc.insecure_channel(server["grpc"], options=QUIET) for _ in range(S)]
    other = pbg.GRPCInferenceServiceStub(grpc.insecure_channel(server["grpc"]))
    try:
        calls, held = [], 0.0
        for s, channel in enumerate(channels):  # one at a time: none refused for being at once
            calls.append(pbg.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                iter([request(s * N + i) for i in range(N)]), timeout=60))  # fmt: skip
            before, deadline = held, time.monotonic() + 2
            while held == before and time.monotonic() < deadline:
                time.sleep(0.1)
                held = stream_held(server["http"])
        time.sleep(0.3)
        held = stream_held(server["http"])
        assert 0 < held <= QUEUED, held
        with pytest.raises(grpc.RpcError) as e:
            other.ModelInfer(request(-1), timeout=30)
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED, e.value
        assert "--max-queued-bytes" in e.value.details()
        answered, refused = 0, 0
        for call in calls:  # now the clients read: every request has its answer or the error
            for m in call:
                if m.error_message:
                    assert "--max-queued-bytes" in m.error_message, m.error_message
                    refused += 1
                else:
                    assert m.infer_response.raw_output_contents[0]
                    answered += 1
        assert answered + refused == S * N and refused > 0, (answered, refused)
    finally:
        for channel in channels:
            channel.close()
    deadline = time.monotonic() + 10  # read and gone: their bytes are free again
    while True:
        try:
            res = other.ModelInfer(request(-2), timeout=30)
            break
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.1)
    y = np.frombuffer(res.raw_output_contents[0], np.float32).reshape(T, K)
    want = server["model"](np.full((T, 1, C), 0.25, np.float32))[0][:, 0]
    np.testing.assert_allclose(y, want, rtol=0, atol=1e-5)
    assert stream_held(server["http"]) == 0


def test_streams_gone_with_unsent_answers_give_their_bytes_back(server):
    """Streams whose client goes without reading: their computed answers stop counting against
    --max-queued-bytes (nothing stays in the global count)."""
    for _ in range(3):  # each time three streams hold about the whole budget, then go
        channel = grpc.insecure_channel(server["grpc"], options=QUIET)
        calls = [
            pbg.GRPCInferenceServiceStub(channel).ModelStreamInfer(
                iter([request(i) for i in range(2)]), timeout=60
            )
            for _ in range(3)
        ]
        deadline = time.monotonic() + 10
        while stream_held(server["http"]) < 3 * T * K * 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        for call in calls:
            call.cancel()
        channel.close()
    other = pbg.GRPCInferenceServiceStub(grpc.insecure_channel(server["grpc"]))
    deadline = time.monotonic() + 10
    while True:
        try:  # three requests at once fit only if nothing stayed counted
            futures = [other.ModelInfer.future(request(-i), timeout=30) for i in range(3)]
            assert all(f.result().raw_output_contents[0] for f in futures)
            break
        except grpc.RpcError as e:
            if e.code() != grpc.StatusCode.RESOURCE_EXHAUSTED or time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    assert stream_held(server["http"]) == 0


# ------------------------------------------------------------------ 2. inflating off the loop
class _BodyCore:
    """What http._body asks of the server's Core: the limits, and the queued-bytes budget."""

    read_timeout = 30.0
    draining = False

    def __init__(self, limit: int) -> None:
        self.max_request_bytes = limit
        self.held = 0
        self.bodies: set = set()

    def reserve(self, n: int, mine: int = 0) -> None:
        self.held += n

    def unreserve(self, n: int) -> None:
        self.held -= n


def _run_body(body: bytes, encoding: str, limit: int):
    """http._body on a Starlette request carrying ``body``; (result or exception, the thread
    _inflate ran in)."""
    from starlette.requests import Request

    from leanrnn.serve import http as h

    threads = []
    real = h._inflate

    def spy(*args):
        threads.append(threading.get_ident())
        return real(*args)

    h._inflate, sent = spy, [False]

    async def receive():
        if sent[0]:
            return {"type": "http.disconnect"}
        sent[0] = True
        return {"type": "http.request", "body": body, "more_body": False}

    scope = {"type": "http", "method": "POST", "path": "/", "query_string": b"",
             "headers": [(b"content-encoding", encoding.encode()),
                         (b"content-length", str(len(body)).encode())]}  # fmt: skip
    try:
        core = _BodyCore(limit)
        out, held = asyncio.run(h._body(Request(scope, receive), core))
        assert held == core.held == len(body)  # held until the caller has parsed it
    except Exception as e:  # handed back to be checked
        out = e
    finally:
        h._inflate = real
    return out, threads


def test_large_compressed_body_is_inflated_off_the_event_loop():
    """In process: a gzip body past http.INFLATE_INLINE is inflated in a worker thread (before,
    on the event loop's, holding up every other request while it ran), with the same result
    and the same errors; a small one stays on the loop (a thread hop costs more)."""
    from leanrnn.serve import http as h
    from leanrnn.serve.errors import InvalidRequest, TooLarge

    noise = np.random.default_rng(0).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    raw = noise + bytes(700_000)
    big = gzip.compress(raw, compresslevel=1)
    assert 256 << 10 < len(big) < 600_000
    loop_thread = threading.get_ident()
    out, threads = _run_body(big, "gzip", 1 << 20)
    assert out == raw
    assert threads and threads[0] != loop_thread
    out, threads = _run_body(big, "gzip", 600_000)  # inflates past the limit: still a 413
    assert isinstance(out, TooLarge) and threads[0] != loop_thread, out
    out, threads = _run_body(big[:-100], "gzip", 1 << 20)  # cut short: still a 400
    assert isinstance(out, InvalidRequest) and "cut short" in str(out), out
    small = gzip.compress(b"{}")
    out, threads = _run_body(small, "gzip", 1 << 20)
    assert out == b"{}" and threads == [loop_thread]
    assert h.INFLATE_INLINE >= len(small)


def test_an_answer_nobody_reads_is_dropped_after_the_send_timeout(monkeypatch):
    """Unread answers count against --max-queued-bytes until sent; without a deadline a few
    clients that never read held the budget, and every other client got 429, for as long as
    they kept their sockets open. Past SEND_TIMEOUT the connection goes and the bytes with it."""
    from leanrnn.serve import http

    monkeypatch.setattr(http, "SEND_TIMEOUT", 0.05)
    released = []
    answer = http._Answer(b"x" * (3 * http.SEND_PIECE), {}, "application/octet-stream",
                          lambda: released.append(1))  # fmt: skip
    sent = []

    async def send(m):
        sent.append(m)
        if len(sent) > 1:  # the head goes; the body never does (the client reads nothing)
            await asyncio.Event().wait()

    async def run():
        t0 = time.monotonic()
        with pytest.raises(ConnectionAbortedError, match="read none of its answer"):
            await answer({"type": "http"}, None, send)
        return time.monotonic() - t0

    took = asyncio.run(run())
    assert released == [1] and took < 5


def test_small_json_answers_keep_the_gil_on_the_event_loop(monkeypatch):
    """Encoding on the event loop's own thread yielded the GIL after every piece: each yield
    handed it to the scheduler thread for up to a switch interval (HTTP JSON throughput -30%).
    Only a worker thread yields."""
    from types import SimpleNamespace

    from leanrnn.serve import http

    sleeps = []
    monkeypatch.setattr(http.time, "sleep", lambda s: sleeps.append(s))
    info = SimpleNamespace(name="m", datatype="FP32")
    p = SimpleNamespace(id="", binary={})
    values = {"y": np.arange(3 * http.JSON_PIECE, dtype=np.float32)}
    inline = http._encode(info, p, values)
    assert sleeps == []
    assert http._encode(info, p, values, True) == inline and len(sleeps) == 3
