"""Session 42, from a red-team pass over leanrnn serve's operations: a sequence was evicted as
idle while its next request was still arriving (an HTTP body coming slowly, a gRPC request
unread behind a large one on its stream) or while its last answer was still being sent to a
slow reader. Each test failed before."""

from __future__ import annotations

import time

import numpy as np
import pytest

import leanrnn
from leanrnn.engine.session import Pool
from leanrnn.serve.errors import SequenceError
from leanrnn.serve.scheduler import Lane, Scheduler

IDLE = 1.0  # seconds; the scheduler looks every IDLE / 4


@pytest.fixture
def sched():
    m = leanrnn.GRU(4, 8, seed=0)
    lanes = {name: Lane(name, m, Pool(), threads=1, max_streams=8, max_batch=4, max_chunk=4,
                        idle_timeout=IDLE) for name in ("m", "other")}  # fmt: skip
    with Scheduler(lanes, max_wait=0.0) as s:
        s.model = m
        yield s


def _run(s: Scheduler, key, start: bool, x, hold: bool = False):
    done = []
    r = s.submit("m", key, start, False, x, on_done=done.append, hold=hold)
    deadline = time.monotonic() + 10
    while not done and time.monotonic() < deadline:
        time.sleep(0.005)
    assert done and r.error is None, r.error
    return r


def test_requests_arriving_hold_off_eviction(sched):
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    a = _run(sched, 1, True, x)
    token = sched.arriving("m")  # its next request's first bytes came in: the body still comes
    time.sleep(1.5 * IDLE)
    b = _run(sched, 1, False, x)  # was: SequenceError, "evicted ... after 1.5 s idle"
    sched.arrived(token)
    want = sched.model(np.concatenate([x, x])[:, None])[0][:, 0]
    np.testing.assert_allclose(np.concatenate([a.y, b.y]), want, atol=1e-6, rtol=0)
    # a request for another model holds off nothing here
    other = sched.arriving("other")
    time.sleep(1.5 * IDLE)
    with pytest.raises(SequenceError, match="evicted"):
        _run(sched, 1, False, x)
    # and one that never comes postpones an eviction by one more timeout at most
    _run(sched, 2, True, x)
    forever = sched.arriving()  # (any model: a gRPC stream's)
    time.sleep(2.6 * IDLE)
    with pytest.raises(SequenceError, match="evicted"):
        _run(sched, 2, False, x)
    sched.arrived(other)
    sched.arrived(forever)


def test_an_answer_still_leaving_keeps_its_sequence(sched):
    x = np.ones((2, 4), np.float32)
    r = _run(sched, "s", True, x, hold=True)  # answered by the engine; being sent
    time.sleep(1.5 * IDLE)
    _run(sched, "s", False, x)  # was: evicted while its answer was on its way
    sched.release(r)  # the answer has left: idle from now
    time.sleep(1.5 * IDLE)
    with pytest.raises(SequenceError, match="evicted"):
        _run(sched, "s", False, x)
    # an answer that never leaves (a client that stopped reading) holds one timeout more
    _run(sched, "t", True, x, hold=True)
    time.sleep(2.6 * IDLE)
    with pytest.raises(SequenceError, match="evicted"):
        _run(sched, "t", False, x)


def test_call_steps_count_the_steps_run_not_the_bucket():
    pytest.importorskip("prometheus_client")
    from leanrnn.serve.metrics import Metrics

    m = leanrnn.GRU(4, 8, seed=0)
    metrics = Metrics()
    lane = Lane("m", m, Pool(), threads=1, max_streams=8, max_batch=4, max_chunk=16,
                idle_timeout=60.0)  # fmt: skip
    with Scheduler({"m": lane}, max_wait=0.0, metrics=metrics) as s:
        for key, T in enumerate((9, 11, 13)):  # one at a time: a call each, rounded to 10, 12, 14
            _run(s, key, True, np.ones((T, 4), np.float32))
    got = metrics.registry.get_sample_value("leanrnn_serve_call_steps_sum", {"model": "m"})
    assert got == 33  # was 36
    steps = metrics.registry.get_sample_value("leanrnn_serve_steps_total", {"model": "m"})
    assert steps == 33


def test_metric_series_exist_from_the_start():
    """The labelled series appeared only at their first event: /metrics at start-up had no
    series of any model."""
    pytest.importorskip("prometheus_client")
    from leanrnn.serve.metrics import Metrics

    reg = Metrics(("a", "b")).registry
    for name in ("active_streams", "steps_total", "engine_calls_total", "evictions_total",
                 "call_steps_count", "queue_wait_seconds_count"):  # fmt: skip
        for model in ("a", "b"):
            assert reg.get_sample_value(f"leanrnn_serve_{name}", {"model": model}) == 0, name
    for proto in ("http", "grpc"):
        labels = {"model": "a", "protocol": proto}
        assert reg.get_sample_value("leanrnn_serve_request_seconds_count", labels) == 0
        for kind in ("invalid", "sequence", "exhausted", "unauthenticated", "unavailable"):
            for model in ("", "a", "b"):
                labels = {"kind": kind, "protocol": proto, "model": model}
                assert reg.get_sample_value("leanrnn_serve_errors_total", labels) == 0


# ------------------------------------------------------------- one server: its operations
import json  # noqa: E402
import signal  # noqa: E402
import socket  # noqa: E402
import threading  # noqa: E402
import urllib.error  # noqa: E402
import urllib.request  # noqa: E402

from helpers import served, sigterm_seconds  # noqa: E402

TOKEN = "t0ken"
GRACE = 2.0


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    pytest.importorskip("starlette")
    pytest.importorskip("uvicorn")
    pytest.importorskip("prometheus_client")
    pytest.importorskip("tritonclient.grpc")
    with served(tmp_path_factory.mktemp("hardening16"), "gru", leanrnn.GRU(4, 8, num_layers=2, seed=2),
                "--token", TOKEN, "--grace", str(GRACE), "--threads", "1") as s:  # fmt: skip
        yield s


def _post(server, body: dict, token: str | None = TOKEN):
    req = urllib.request.Request(f"http://{server['http']}/v2/models/gru/infer",
                                 data=json.dumps(body).encode(), method="POST")  # fmt: skip
    if token:
        req.add_header("Authorization", f"Bearer {token}")
    try:
        with urllib.request.urlopen(req, timeout=30) as r:
            return r.status, dict(r.headers), json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, dict(e.headers), json.loads(e.read())


def _tensor(name, a):
    return {"name": name, "shape": list(a.shape), "datatype": "FP32", "data": a.ravel().tolist()}


def test_a_401_names_the_bearer_scheme(server):
    x = np.ones((2, 4), np.float32)
    status, headers, body = _post(server, {"inputs": [_tensor("x", x)]}, token=None)
    assert status == 401 and "bearer token" in body["error"]
    assert headers.get("www-authenticate") == "Bearer"  # RFC 6750; was absent


def test_a_grus_c0_is_named(server):
    x, h = np.ones((2, 4), np.float32), np.zeros((2, 8), np.float32)
    body = {"inputs": [_tensor("x", x), _tensor("h0", h), _tensor("c0", h)],
            "parameters": {"sequence_id": 5, "sequence_start": True}}  # fmt: skip
    status, _, got = _post(server, body)
    assert status == 400 and "'c0'" in got["error"], got  # was: "3 inputs listed"


def test_the_transports_log_json_lines_and_few_of_them(server):
    before = len(server["logs"])
    for _ in range(300):  # garbage connections: uvicorn warns of each
        with socket.create_connection((server["host"], server["port"])) as so:
            so.sendall(b"\x16\x03\x01 not http\r\n\r\n")
            so.recv(100)
    time.sleep(0.5)
    new = server["logs"][before:]
    assert all(line.startswith("{") and json.loads(line) for line in new), new[:3]
    assert len(new) <= 40, len(new)  # was 300 plain-text lines


def test_sigterm_exits_within_one_grace_period(server):
    """The drain took the grace period, then uvicorn's shutdown took another for an answer a
    client read slowly, and gRPC's a second more: exit came at ~2x --grace. Runs last."""
    import tritonclient.grpc as tg

    T = 300_000
    x = np.ones((T, 4), np.float32).tobytes()
    head = json.dumps({"inputs": [{"name": "x", "shape": [T, 4], "datatype": "FP32",
                                   "parameters": {"binary_data_size": len(x)}}],
                       "parameters": {"binary_data_output": True}}).encode()  # fmt: skip
    slow = socket.create_connection((server["host"], server["port"]))
    slow.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    slow.sendall(b"POST /v2/models/gru/infer HTTP/1.1\r\nHost: x\r\nContent-Type: "
                 b"application/octet-stream\r\n" + f"Authorization: Bearer {TOKEN}\r\n"
                 f"Inference-Header-Content-Length: {len(head)}\r\n"
                 f"Content-Length: {len(head) + len(x)}\r\n\r\n".encode() + head + x)  # fmt: skip
    time.sleep(2.0)  # its answer is computed and waits for a client that reads slowly

    def long():  # engine work that outlasts the grace period
        inp = tg.InferInput("x", [2_000_000, 4], "FP32")
        inp.set_data_from_numpy(np.ones((2_000_000, 4), np.float32))
        try:
            tg.InferenceServerClient(server["grpc"]).infer(
                "gru", [inp], headers={"authorization": f"Bearer {TOKEN}"}
            )
        except Exception:  # (refused when the grace runs out: what it should be)
            pass

    t = threading.Thread(target=long)
    t.start()
    time.sleep(1.0)
    stopped = sigterm_seconds(server["proc"])
    t.join(60)
    slow.close()
    assert stopped < GRACE + 1.5, stopped  # was ~2x GRACE + 1
    time.sleep(0.2)
    assert all(line.startswith("{") for line in server["logs"]), [
        line for line in server["logs"] if not line.startswith("{")][:3]  # fmt: skip


def test_a_second_sigterm_ends_the_grace_period(tmp_path):
    """A second SIGTERM (or Ctrl-C) during the drain was ignored: only SIGKILL stopped a drain
    of a long --grace. Now it fails what has not run as UNAVAILABLE and exits."""
    import tritonclient.grpc as tg

    # four requests of 60,000 steps at H=256 run one after another (--max-batch 1): ~30 s
    with served(tmp_path, "gru", leanrnn.GRU(4, 256, num_layers=2, seed=2), "--grace", "60",
                "--threads", "1", "--max-batch", "1") as s:  # fmt: skip
        got = []

        def long(i):  # engine work far past the test's patience
            inp = tg.InferInput("x", [60_000, 4], "FP32")
            inp.set_data_from_numpy(np.ones((60_000, 4), np.float32))
            try:
                tg.InferenceServerClient(s["grpc"]).infer("gru", [inp], sequence_id=i + 1,
                                                          sequence_start=True, sequence_end=True)  # fmt: skip
                got.append("ok")
            except Exception as e:  # (refused when the grace ends: what it should be)
                got.append(str(e))

        threads = [threading.Thread(target=long, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        time.sleep(1.5)
        s["proc"].send_signal(signal.SIGTERM)
        time.sleep(0.5)
        assert s["proc"].poll() is None  # draining, within its grace
        stopped = sigterm_seconds(s["proc"])
        for t in threads:
            t.join(60)
        assert stopped < 5, stopped  # was: the whole drain, up to --grace 60
        assert any("UNAVAILABLE" in g for g in got), got


# ------------------------------------------------- the gRPC stream's pump, in process
class _Tokens:
    """A scheduler's arrivals, counted: the tokens given and not yet given back."""

    def __init__(self) -> None:
        self.live: dict[int, str | None] = {}
        self.given = 0

    def arriving(self, model=None) -> int:
        self.given += 1
        self.live[self.given] = model
        return self.given

    def arrived(self, token) -> None:
        self.live.pop(token, None)


def _pump_core(fail_on: set | None = None):
    from helpers import ServeCoreStub

    tokens = _Tokens()

    class Core(ServeCoreStub):
        scheduler = tokens

        async def infer_held(self, p, protocol, json_bytes=0, arrival=None, submitted=None):
            if submitted is not None:  # queued at once, as the real one (stream order)
                submitted.set_result(None)
            import asyncio

            tokens.arrived(arrival)  # (as the real one: given back once submitted)
            await asyncio.sleep(0.05)  # the engine's work
            if fail_on and p.n in fail_on:
                raise RuntimeError("boom")
            return {}, lambda: None

    return Core(), tokens


def _pump_patches(monkeypatch):
    from types import SimpleNamespace

    from leanrnn.serve import rpc

    info = SimpleNamespace(name="m", outputs={"y": SimpleNamespace(shape=[1, 1])},
                           dtype=np.dtype(np.float32))  # fmt: skip
    monkeypatch.setattr(rpc, "parse", lambda core, req: (info, SimpleNamespace(
        n=int(req.id), x=np.zeros((1, 1), np.float32))))  # fmt: skip
    monkeypatch.setattr(rpc, "answer", lambda info, p, values, stream=False: b"ok")
    monkeypatch.setattr(rpc, "WINDOW", 2)  # two requests in flight fill the bound
    monkeypatch.setattr(rpc, "UNREAD_S", 0.2, raising=False)
    return rpc


@pytest.mark.parametrize("reads", [2, 6])
def test_a_stream_gives_its_arrival_back_when_the_client_stops(monkeypatch, reads):
    """A stream's token, taken while its bound stopped the reading, was kept until the next
    request came: a client that stopped reading its answers (reads=2 of 6), or sending
    requests (reads all 6, then sends nothing), held back every eviction of the server."""
    import asyncio

    from helpers import GrpcContextStub

    rpc = _pump_patches(monkeypatch)
    core, tokens = _pump_core()
    quiet = asyncio.Event()

    async def requests():
        for n in range(6):
            yield rpc.pb.ModelInferRequest(model_name="m", id=str(n)).SerializeToString()
        await quiet.wait()  # then nothing, the stream open

    async def main():
        answers = 0
        stream = rpc.Servicer(core).ModelStreamInfer(requests(), GrpcContextStub())
        async for _ in stream:
            answers += 1
            if answers == reads:
                break
        await asyncio.sleep(0.6)  # past the engine's work and UNREAD_S
        live = dict(tokens.live)
        quiet.set()
        await stream.aclose()
        return answers, live

    answers, live = asyncio.run(main())
    assert answers == reads and tokens.given >= 1  # (the bound did stop the reading)
    assert live == {}, live  # was: a token held while the client stayed away


def test_a_request_that_fails_is_answered_and_the_stream_goes_on(monkeypatch):
    """An exception other than a refusal in a stream's request left it unanswered, its place
    in the stream's bound taken for good (the client waited for ever)."""
    import asyncio

    from helpers import GrpcContextStub

    rpc = _pump_patches(monkeypatch)
    core, tokens = _pump_core(fail_on={1})

    async def requests():
        for n in range(3):
            yield rpc.pb.ModelInferRequest(model_name="m", id=str(n)).SerializeToString()

    async def main():
        got = []
        async for raw in rpc.Servicer(core).ModelStreamInfer(requests(), GrpcContextStub()):
            got.append(raw if isinstance(raw, bytes) else raw.SerializeToString())
        return got

    got = asyncio.run(asyncio.wait_for(main(), 10))
    assert len(got) == 3, got
    failed = [rpc.pb.ModelStreamInferResponse.FromString(g) for g in got if g != b"ok"]
    assert len(failed) == 1 and "RuntimeError: boom" in failed[0].error_message
    assert tokens.live == {}
