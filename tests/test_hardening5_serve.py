"""leanrnn serve against a red-team's findings: JSON answers bounded and encoded off the event
loop, answers a client does not read kept under --max-queued-bytes, strict JSON numbers, echoed
input cut short, and protocol details (sequence_id false, outputs [], raw plus typed contents,
multi-member gzip, the bearer scheme's case). One server subprocess for the module, tiny model,
small limits: nothing here allocates more than a few MB."""

from __future__ import annotations

import gzip
import http.client
import json
import socket
import time
import zlib

import numpy as np
import pytest

import leanrnn
from helpers import ServeCoreStub, served

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
th = pytest.importorskip("tritonclient.http")
tg = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

TOKEN = "s3cret"
AUTH = {"authorization": f"Bearer {TOKEN}"}
C, K = 2, 16  # x [T, 2] in, y [T, 16] out: 64 bytes of y a step
LIMIT = 1_100_000  # --max-request-bytes: also the cap on a JSON answer
QUEUED = 2_500_000  # --max-queued-bytes
URL = "/v2/models/lstm/infer"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with served(tmp_path_factory.mktemp("hardening5_serve"), "lstm", leanrnn.LSTM(C, K, seed=5),
                "--max-batch", "4", "--max-streams", "2", "--token", TOKEN,
                "--max-request-bytes", str(LIMIT), "--max-queued-bytes", str(QUEUED),
                "--threads", "1") as s:  # fmt: skip
        yield s


def post(server, body, headers=None):
    """(status, body bytes) of a POST to the infer endpoint, with the token unless told."""
    c = http.client.HTTPConnection(server["host"], server["port"], timeout=30)
    if not isinstance(body, bytes):
        body = json.dumps(body).encode()
    c.request("POST", URL, body, {**AUTH, **(headers or {})})
    r = c.getresponse()
    data = r.read()
    c.close()
    return r.status, data


def x_json(T=1, data=None):
    data = [0.5] * (T * C) if data is None else data
    return {"name": "x", "datatype": "FP32", "shape": [T, C], "data": data}


def binary_request(x: np.ndarray, json_y: bool) -> tuple[bytes, dict]:
    """A body with x as binary data and y asked for as JSON or binary, and its headers."""
    blob = x.astype("<f4").tobytes()
    head = json.dumps({
        "inputs": [{"name": "x", "datatype": "FP32", "shape": list(x.shape),
                    "parameters": {"binary_data_size": len(blob)}}],
        "outputs": [{"name": "y", "parameters": {"binary_data": not json_y}}],
    }).encode()  # fmt: skip
    return head + blob, {"Inference-Header-Content-Length": str(len(head))}


def strict(data: bytes):
    """RFC 8259 JSON only: NaN and Infinity are refused."""

    def refuse(token):
        raise ValueError(f"not JSON: {token}")

    return json.loads(data, parse_constant=refuse)


def http_client(server):
    return th.InferenceServerClient(server["http"])


def grpc_client(server):
    return tg.InferenceServerClient(server["grpc"])


# ------------------------------------------------------------------ 1. JSON answers are bounded
def test_json_answer_over_the_cap_is_refused_naming_binary_output(server):
    T = LIMIT // (K * 26) + 10  # y as JSON could pass --max-request-bytes; as binary it does not
    body, headers = binary_request(np.zeros((T, C), np.float32), json_y=True)
    status, data = post(server, body, headers)
    assert status == 413, data[:200]
    assert "binary" in strict(data)["error"] and "--max-request-bytes" in strict(data)["error"]
    body, headers = binary_request(np.zeros((T, C), np.float32), json_y=False)
    status, data = post(server, body, headers)  # the same steps as binary data go
    assert status == 200
    c = http_client(server)  # and tritonclient's JSON path still works for a small answer
    i = th.InferInput("x", [3, C], "FP32")
    x = np.random.default_rng(1).standard_normal((3, C)).astype(np.float32)
    i.set_data_from_numpy(x, binary_data=False)
    r = c.infer("lstm", [i], outputs=[th.InferRequestedOutput("y", binary_data=False)],
                headers=dict(AUTH))  # fmt: skip
    np.testing.assert_allclose(r.as_numpy("y"), server["model"](x)[0], rtol=0, atol=1e-5)


def test_json_answer_is_encoded_in_pieces_off_the_event_loop(monkeypatch):
    """In process: _encode's JSON is the one json.dumps would give, built in pieces, and the
    handler runs it in a worker thread past INLINE bytes."""
    import asyncio
    import threading

    from leanrnn.serve import http as h
    from leanrnn.serve.protocol import Parsed

    monkeypatch.setattr(h, "JSON_PIECE", 7)
    a = np.random.default_rng(0).standard_normal((9, 4))
    p = Parsed("m", "id1", ("", 1), True, True, a, outputs=["y"], binary={"y": False})

    class Info:
        name, datatype = "m", "FP64"

    body, headers, media = h._encode(Info, p, {"y": a})
    assert media == "application/json" and headers == {}
    assert strict(body)["outputs"][0]["data"] == a.reshape(-1).tolist()
    threads = []
    real = h._encode

    def spy(*args):
        threads.append(threading.get_ident())
        return real(*args)

    monkeypatch.setattr(h, "_encode", spy)
    monkeypatch.setattr(h, "INLINE", 0)

    class Core:
        max_request_bytes = 1 << 30

        def enter(self, protocol):  # --max-concurrency: not the point here
            pass

        def leave(self, protocol):
            pass

        read_timeout = 30.0
        draining = False

        def __init__(self):
            self.bodies = set()  # (bodies being read, which a shutdown would cut)

        def reserve(self, n, mine=0):
            pass

        def unreserve(self, n):
            pass

        def io(self, model, what, seconds):  # (Triton's statistics: not the point here)
            pass

        def info(self, model, version=None):
            return Info

        def authorize(self, header):
            pass

        async def infer_held(self, p, protocol, json_bytes=0, arrival=None, submitted=None):
            if submitted is not None:  # queued at once, as the real one (stream order)
                submitted.set_result(None)
            return {"y": a}, lambda: None

        scheduler = ServeCoreStub.scheduler  # (a request's arrival: not the point here)

    monkeypatch.setattr(h, "_parse", lambda *args: p)
    monkeypatch.setattr(h, "json_bytes", lambda info, p: 0)
    app = h.make_app(Core())
    sent = []

    async def run():
        async def receive():
            return {"type": "http.request", "body": b"{}", "more_body": False}

        async def send(m):
            sent.append(m)

        scope = {"type": "http", "method": "POST", "path": "/v2/models/m/infer", "headers": [],
                 "query_string": b"", "root_path": ""}  # fmt: skip
        await app(scope, receive, send)

    asyncio.run(run())
    assert threads and threads[0] != threading.get_ident()
    assert sent[0]["status"] == 200
    out = b"".join(m.get("body", b"") for m in sent[1:])
    assert strict(out)["outputs"][0]["data"] == a.reshape(-1).tolist()


# ------------------------------------------------------------------ 2. unread answers count
def test_answers_a_client_does_not_read_stay_counted_until_sent(server):
    # y 1.02 MB binary (under --max-request-bytes), x 128 KB: 1.15 MB counted; past the
    # kernel's send buffer (server.SEND_BUFFER, doubled) the rest of the answer waits in the server
    T = 16000
    body, headers = binary_request(np.zeros((T, C), np.float32), json_y=False)
    head = (f"POST {URL} HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKEN}\r\n"
            f"Inference-Header-Content-Length: {headers['Inference-Header-Content-Length']}\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()  # fmt: skip
    socks = []
    try:
        for _ in range(2):  # 2 x 1.15 MB = 2.3 MB of the 2.5 MB allowed, held by their answers
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
            s.connect((server["host"], server["port"]))
            s.sendall(head + body)
            socks.append(s)
        time.sleep(1.0)  # the engine has answered them all; nobody reads
        # 2000 steps: 144 KB as binary go; as JSON (976 KB counted) they would pass the limit
        small, small_headers = binary_request(np.zeros((2000, C), np.float32), json_y=False)
        assert post(server, small, small_headers)[0] == 200
        small, small_headers = binary_request(np.zeros((2000, C), np.float32), json_y=True)
        status, data = post(server, small, small_headers)
        assert status == 429 and "--max-queued-bytes" in strict(data)["error"], data[:300]
    finally:
        for s in socks:
            s.close()
    deadline = time.monotonic() + 10  # the clients went: their answers' bytes go too
    while time.monotonic() < deadline:
        status, data = post(server, small, small_headers)
        if status == 200:
            break
        time.sleep(0.1)
    assert status == 200, data[:300]


def test_held_requests_count_until_released_in_either_order():
    """In process: a held request's bytes stay counted after the engine is done with it,
    until release(); released first, they go when the engine is done; release twice is one."""
    from leanrnn.engine.session import Pool
    from leanrnn.serve.scheduler import Lane, Scheduler

    lane = Lane("g", leanrnn.GRU(3, 4, seed=3), Pool(), threads=1, max_streams=4, max_batch=2,
                max_chunk=2, idle_timeout=60.0)  # fmt: skip
    lane.warm_up()
    x = np.ones((5, 3), np.float32)
    sched = Scheduler({"g": lane}, max_wait=0.0, max_queued_bytes=1 << 20)
    kept = sched.submit("g", 1, True, True, x, extra=1000, hold=True)
    early = sched.submit("g", 2, True, True, x, hold=True)
    plain = sched.submit("g", 3, True, True, x)
    assert kept.nbytes == plain.nbytes + 1000
    sched.release(early)  # before the engine ran it
    assert sched.queued_bytes == kept.nbytes + early.nbytes + plain.nbytes
    sched.start()
    try:
        assert sched.drain(30)
        assert sched.queued_bytes == kept.nbytes  # done, but its answer has not left
        sched.release(kept)
        sched.release(kept)
        assert sched.queued_bytes == 0
    finally:
        sched.stop()


def test_grpc_answers_give_their_bytes_back(server):
    """Every call's 1.15 MB is released once its answer is sent (3 would pass the limit)."""
    c = grpc_client(server)
    x = np.zeros((16000, C), np.float32)
    for _ in range(5):
        i = tg.InferInput("x", list(x.shape), "FP32")
        i.set_data_from_numpy(x)
        assert c.infer("lstm", [i], headers=dict(AUTH)).as_numpy("y").shape == (16000, K)
    import queue

    done: queue.Queue = queue.Queue()
    c.start_stream(callback=lambda result, error: done.put((result, error)), headers=dict(AUTH))
    try:
        for _ in range(5):
            i = tg.InferInput("x", list(x.shape), "FP32")
            i.set_data_from_numpy(x)
            c.async_stream_infer("lstm", [i])
            result, error = done.get(timeout=30)
            assert error is None and result.as_numpy("y").shape == (16000, K)
    finally:
        c.stop_stream()


# ------------------------------------------------------------------ 3. header digits
def test_non_ascii_digit_header_length_is_a_400(server):
    body = json.dumps({"inputs": [x_json()]}).encode()
    for header in ("Inference-Header-Content-Length", "Content-Length"):
        s = socket.create_connection((server["host"], server["port"]), timeout=10)
        length = b"\xb2"
        extra = b"" if header == "Content-Length" else b"Content-Length: %d\r\n" % len(body)
        s.sendall(b"POST %s HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer %s\r\n%s%s: %s\r\n\r\n"
                  % (URL.encode(), TOKEN.encode(), extra, header.encode(), length) + body)  # fmt: skip
        reply = b""
        while b"\r\n\r\n" not in reply:
            chunk = s.recv(4096)
            if not chunk:
                break
            reply += chunk
        s.close()
        if header == "Content-Length":  # the HTTP parser may refuse it first: no 500 either way
            assert not reply.startswith(b"HTTP/1.1 5"), reply[:200]
            continue
        assert reply.startswith(b"HTTP/1.1 400"), reply[:300]


def test_parse_refuses_non_ascii_digits_in_process():
    from leanrnn.serve.errors import InvalidRequest
    from leanrnn.serve.http import _number, _parse

    assert _number("\xb2") is None and _number("12") == 12 and _number("") is None
    with pytest.raises(InvalidRequest, match="Inference-Header-Content-Length"):
        _parse(None, None, b"{}", "\xb2")


# ------------------------------------------------------------------ 4. strict JSON numbers
@pytest.mark.parametrize("token", ["NaN", "Infinity", "-Infinity", "1e300", "-3.5e38", "1e400"])
def test_json_input_must_be_finite_and_in_range(server, token):
    head = json.dumps({"inputs": [x_json(data=[0.0, 0.0])]}).replace("[0.0, 0.0]", f"[{token}, 0]")
    status, data = post(server, head.encode())
    assert status == 400, data[:200]
    assert "finite" in strict(data)["error"] or "JSON number" in strict(data)["error"]
    assert not any("RuntimeWarning" in line or "overflow" in line for line in server["logs"])


def test_non_finite_outputs_are_strict_json_that_tritonclient_reads(server):
    x = np.array([[np.nan, 0.0], [1.0, 2.0]], np.float32)  # binary data may hold NaN
    body, headers = binary_request(x, json_y=True)
    status, data = post(server, body, headers)
    assert status == 200
    ys = strict(data)["outputs"][0]["data"]
    assert "NaN" in ys and all(isinstance(v, float | str) for v in ys)
    i = th.InferInput("x", list(x.shape), "FP32")
    i.set_data_from_numpy(x, binary_data=True)
    r = http_client(server).infer("lstm", [i], headers=dict(AUTH),
                                  outputs=[th.InferRequestedOutput("y", binary_data=False)])  # fmt: skip
    assert np.isnan(r.as_numpy("y")).all() and r.as_numpy("y").dtype == np.float32


# ------------------------------------------------------------------ 5. echoes are bounded
def test_error_messages_cut_what_the_client_sent(server):
    cases = [
        {"inputs": [dict(x_json(), shape=[1] * 100_000)]},
        {"inputs": [dict(x_json(), datatype="F" * 200_000)]},
        {"inputs": [dict(x_json(), name="n" * 200_000)]},
        {"inputs": [x_json()], "id": ["i"] * 100_000},
        {"inputs": [x_json()], "parameters": {"sequence_id": [1] * 100_000}},
        {"inputs": [x_json()], "parameters": {"sequence_start": "s" * 100_000}},
        {"inputs": [x_json()], "outputs": [{"name": "o" * 100_000}]},
    ]
    for req in cases:
        status, data = post(server, req)
        assert status == 400 and len(strict(data)["error"]) < 600, (status, len(data))
        assert "..." in strict(data)["error"]
    time.sleep(0.2)
    assert max(len(line) for line in server["logs"]) < 2000


# ------------------------------------------------------------------ 6. sequence_id false
def test_sequence_id_false_is_refused_like_true(server):
    for v in (False, True):
        status, data = post(server, {"inputs": [x_json()],
                                     "parameters": {"sequence_id": v, "sequence_end": True}})  # fmt: skip
        assert status == 400 and "sequence_id" in strict(data)["error"], data


# ------------------------------------------------------------------ 7. no internal ids
def test_anonymous_request_at_capacity_names_no_internal_counter(server):
    for sid in (71, 72):  # --max-streams 2
        assert post(server, {"inputs": [x_json()],
                             "parameters": {"sequence_id": sid, "sequence_start": True}})[0] == 200  # fmt: skip
    try:
        status, data = post(server, {"inputs": [x_json()]})
        msg = strict(data)["error"]
        assert status == 429 and "without a sequence_id" in msg and "sequence " not in msg.replace(
            "without a sequence_id", "")[:40], msg  # fmt: skip
    finally:
        for sid in (71, 72):
            post(server, {"inputs": [x_json()], "parameters": {"sequence_id": sid,
                                                               "sequence_end": True}})  # fmt: skip


# ------------------------------------------------------------------ 8. outputs []
def test_empty_outputs_list_means_all_outputs(server):
    status, data = post(server, {"inputs": [x_json()], "outputs": []})
    assert status == 200
    assert sorted(o["name"] for o in strict(data)["outputs"]) == ["c_n", "h_n", "y"]


# ------------------------------------------------------------------ 9. raw and contents
def test_grpc_raw_and_typed_contents_together_are_refused(server):
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    req = service_pb2.ModelInferRequest(model_name="lstm")
    t = req.inputs.add(name="x", datatype="FP32", shape=[1, C])
    t.contents.fp32_contents.extend([9.0] * C)
    req.raw_input_contents.append(np.zeros((1, C), np.float32).tobytes())
    with grpc.insecure_channel(server["grpc"]) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
        with pytest.raises(grpc.RpcError) as e:
            stub.ModelInfer(req, metadata=list(AUTH.items()))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "raw_input_contents" in e.value.details()


def test_http_binary_and_json_data_together_are_refused(server):
    """As gRPC refuses raw plus typed contents: before, a 200 answered from the binary data
    and the JSON "data" was dropped without a word (a red team's finding, session 34)."""
    x = np.ones((2, C), np.float32)
    body, headers = binary_request(x, json_y=True)
    split = int(headers["Inference-Header-Content-Length"])
    head = json.loads(body[:split])
    head["inputs"][0]["data"] = [123.0] * (2 * C)
    h = json.dumps(head).encode()
    status, data = post(server, h + body[split:], {"Inference-Header-Content-Length": str(len(h))})
    assert status == 400 and "both" in strict(data)["error"], data[:300]
    status, data = post(server, body, headers)  # the same request, one way: answered
    assert status == 200, data[:300]


@pytest.mark.parametrize(
    ("where", "value"),
    [("output", "yes"), ("output", 1), ("request", "true"), ("input", 5), ("outparams", [1])],
)
def test_http_flags_and_parameters_of_the_wrong_type_are_refused(server, where, value):
    """binary_data "yes" was read as false, and a "parameters" that is no object as none."""
    req = {"inputs": [x_json()], "outputs": [{"name": "y"}]}
    if where == "output":
        req["outputs"][0]["parameters"] = {"binary_data": value}
    elif where == "request":
        req["parameters"] = {"binary_data_output": value}
    elif where == "input":
        req["inputs"][0]["parameters"] = value
    else:
        req["outputs"][0]["parameters"] = value
    status, data = post(server, req)
    assert status == 400, data[:300]
    err = strict(data)["error"]
    assert ("binary_data" in err and "true or false" in err) or '"parameters"' in err, err


# ------------------------------------------------------------------ 10. gzip members
def test_gzip_bodies_of_several_members_and_cut_ones(server):
    x = np.arange(2 * C, dtype=np.float32).reshape(2, C)
    body, headers = binary_request(x, json_y=False)
    split = int(headers["Inference-Header-Content-Length"])
    two = gzip.compress(body[:split]) + gzip.compress(body[split:])
    status, data = post(server, two, {**headers, "Content-Encoding": "gzip"})
    assert status == 200, data[:300]
    whole = gzip.compress(body)
    status, data = post(server, whole[:-6], {**headers, "Content-Encoding": "gzip"})
    assert status == 400 and "cut short" in strict(data)["error"], data[:300]
    deflated = zlib.compress(body)
    status, data = post(server, deflated + deflated, {**headers, "Content-Encoding": "deflate"})
    assert status == 400 and "after the end" in strict(data)["error"], data[:300]


# ------------------------------------------------------------------ 11. bearer case
def test_bearer_scheme_is_case_insensitive(server):
    for scheme in ("bearer", "BEARER", "Bearer"):
        status, data = post(server, {"inputs": [x_json()]},
                            {"authorization": f"{scheme} {TOKEN}"})  # fmt: skip
        assert status == 200, (scheme, data[:200])
    for header in (f"Basic {TOKEN}", "bearer wrong", f"bearer{TOKEN}"):
        assert post(server, {"inputs": [x_json()]}, {"authorization": header})[0] == 401
    with pytest.raises(InferenceServerException, match="bearer token"):
        grpc_client(server).get_model_metadata("lstm", headers={"authorization": "Basic x"})
    assert grpc_client(server).get_model_metadata(
        "lstm", headers={"authorization": f"bearer {TOKEN}"}
    )
