"""leanrnn serve against the ninth red-team pass: connections and bodies that stall are timed
out (--read-timeout), bodies being read count against --max-queued-bytes, long lists and typed
contents are bounded before the work, answers that pass the checks can be sent, and what the
grace period does not finish gets 503/UNAVAILABLE. Two server subprocesses for the module, tiny
models; every test failed before its fix."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time

import numpy as np
import pytest

import leanrnn
from helpers import served, sigterm_seconds

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
th = pytest.importorskip("tritonclient.http")
tg = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

C, K = 2, 16
QUEUED = 300_000  # --max-queued-bytes
READ = 1.0  # --read-timeout
URL = "/v2/models/lstm/infer"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with served(tmp_path_factory.mktemp("hardening9_serve"), "lstm", leanrnn.LSTM(C, K, seed=3),
                "--max-batch", "4", "--threads", "1", "--read-timeout", str(READ),
                "--max-queued-bytes", str(QUEUED)) as s:  # fmt: skip
        yield s


def _closed_within(sock: socket.socket, seconds: float) -> bool:
    """Whether the server closes ``sock`` within ``seconds`` (what it sent before is skipped)."""
    sock.settimeout(seconds)
    try:
        while sock.recv(65536):
            pass
        return True
    except TimeoutError:
        return False
    except ConnectionResetError:
        return True


@pytest.mark.parametrize("sent", [b"", b"POST /v2/models/lstm/infer HTTP/1.1\r\nHost: x\r\n"],
                         ids=["nothing", "half a head"])  # fmt: skip
def test_a_connection_that_sends_no_whole_request_head_is_closed(server, sent):
    """Before: never closed; 4,300 of them held --max-concurrency and every other client got 503."""
    with socket.create_connection((server["host"], server["port"])) as s:
        s.sendall(sent)
        assert _closed_within(s, READ + 4)


def test_a_kept_alive_connection_has_the_same_bound_for_its_next_head(server):
    with socket.create_connection((server["host"], server["port"])) as s:
        s.sendall(b"GET /v2/health/live HTTP/1.1\r\nHost: x\r\n\r\n")
        s.settimeout(5)
        assert s.recv(4096).startswith(b"HTTP/1.1 200")
        for _ in range(3):  # a byte of the next head now and then stopped uvicorn's keep-alive
            s.sendall(b"G")
            time.sleep(READ / 2)
        assert _closed_within(s, READ + 4)


def test_a_body_that_stalls_is_answered_408_and_the_server_goes_on(server):
    with socket.create_connection((server["host"], server["port"])) as s:
        s.sendall(b"POST " + URL.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 1000\r\n"
                  b"\r\n{\"inputs\": [")  # fmt: skip
        s.settimeout(READ + 5)
        answer = b""
        while chunk := s.recv(65536):  # the server closes the connection after its answer
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert b"--read-timeout" in answer
    c = th.InferenceServerClient(server["http"])
    assert c.is_server_live()


def test_bodies_being_read_count_against_max_queued_bytes(server):
    """8 connections sending 48 of a 60 MiB body each and stalling held 400 MiB under a 16 MiB
    --max-queued-bytes. Here: one holds 250 KB of a 400 KB body; another request's body would
    pass the 300 KB limit, and is refused (429) until the first goes."""
    x = np.ones((8000, C), np.float32)  # 64 KB of binary data
    inp = th.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    c = th.InferenceServerClient(server["http"])
    with socket.create_connection((server["host"], server["port"])) as s:
        s.sendall(b"POST " + URL.encode() + b" HTTP/1.1\r\nHost: x\r\nContent-Length: 400000\r\n"
                  b"\r\n" + b" " * 250_000)  # fmt: skip
        deadline, status = time.monotonic() + 10, None
        while status != "429" and time.monotonic() < deadline:  # once the server has read it
            try:
                c.infer("lstm", [inp])
            except InferenceServerException as e:
                status = e.status()
                assert status == "429" and "--max-queued-bytes" in e.message(), e
        assert status == "429"
    deadline = time.monotonic() + 10
    while True:  # the first is gone: its bytes stop counting
        try:
            y = c.infer("lstm", [inp]).as_numpy("y")
            break
        except InferenceServerException:
            assert time.monotonic() < deadline
            time.sleep(0.05)
    want = server["model"](x[:, None])[0][:, 0]
    np.testing.assert_allclose(y, want, atol=1e-5)


def test_a_body_alone_larger_than_max_queued_bytes_still_goes(server):
    """A request alone always goes (as --max-queued-bytes has it for accepted requests): the
    bytes its own body had reserved counted as others', and a lone 480 KB body under the
    300 KB limit got 429 "retry later", for ever."""
    x = np.random.default_rng(1).standard_normal((60_000, C)).astype(np.float32)
    inp = th.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x, binary_data=True)
    out = [th.InferRequestedOutput("h_n", binary_data=True)]
    res = th.InferenceServerClient(server["http"]).infer("lstm", [inp], outputs=out)
    np.testing.assert_allclose(res.as_numpy("h_n")[0], server["model"](x[:, None])[1][0][0, 0],
                               atol=1e-5)  # fmt: skip


def test_an_output_requested_twice_is_refused_on_both_protocols(server):
    """[y, y] was answered and [y, h_n, c_n, y] refused by the list's length alone."""
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, C], "data": [0.5] * C}],
            "outputs": [{"name": "y"}, {"name": "y"}]}  # fmt: skip
    c = http.client.HTTPConnection(server["host"], server["port"], timeout=30)
    c.request("POST", URL, json.dumps(body).encode())
    r = c.getresponse()
    data = r.read()
    c.close()
    assert r.status == 400 and b"output 'y' is requested twice" in data, data
    g = tg.InferenceServerClient(server["grpc"])
    inp = tg.InferInput("x", [1, C], "FP32")
    inp.set_data_from_numpy(np.full((1, C), 0.5, np.float32))
    with pytest.raises(InferenceServerException, match="requested twice"):
        g.infer("lstm", [inp], outputs=[tg.InferRequestedOutput("y")] * 2)


def test_a_list_of_outputs_longer_than_the_models_is_refused_before_the_loop(server):
    """600,000 requested outputs in 15 KB of gzip held the event loop for 2.7 s."""
    body = {"inputs": [{"name": "x", "datatype": "FP32", "shape": [1, C], "data": [0.5] * C}],
            "outputs": [{"name": "y"}] * 10_000}  # fmt: skip
    c = http.client.HTTPConnection(server["host"], server["port"], timeout=30)
    c.request("POST", URL, json.dumps(body).encode())
    r = c.getresponse()
    data = r.read()
    c.close()
    assert r.status == 400 and b"10000 outputs listed" in data, data[:300]


def test_typed_contents_are_counted_before_and_converted_without_a_list(server):
    """fp32_contents: a wrong count is refused before any conversion; a large one (parsed in
    a worker thread) gives the model's outputs."""
    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc

    T = 40_000  # 80,000 values, 320 kB: past core.INLINE, so parsed in a worker thread
    x = np.random.default_rng(0).standard_normal((T, C)).astype(np.float32)
    with grpc.insecure_channel(server["grpc"]) as ch:
        stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)

        def call(values):
            req = pb.ModelInferRequest(model_name="lstm")
            t = req.inputs.add(name="x", datatype="FP32", shape=[T, C])
            t.contents.fp32_contents.extend(values)
            return stub.ModelInfer(req, timeout=60)

        with pytest.raises(
            grpc.RpcError,
            match=rf"needs {T * C} values in contents\.fp32_contents; got {T * C - 1}",
        ):
            call(x.reshape(-1)[:-1])
        res = call(x.reshape(-1))
    y = np.frombuffer(res.raw_output_contents[0], np.float32).reshape(T, K)
    np.testing.assert_allclose(y, server["model"](x[:, None])[0][:, 0], atol=1e-5)


def test_typed_contents_convert_in_about_their_arrays_memory():
    """np.asarray of the repeated field made a Python float of every value first: 13x the
    message in memory (57 MiB of contents peaked the server at 830 MiB)."""
    import tracemalloc

    from tritonclient.grpc import service_pb2 as pb

    from leanrnn.serve import rpc
    from leanrnn.serve.protocol import ModelInfo, Tensor

    info = ModelInfo("m", "FP32", np.dtype(np.float32), {"x": Tensor("x", (-1, 2))},
                     {"y": Tensor("y", (-1, 4))}, 60.0, 4, "gru")  # fmt: skip

    class Core:
        def info(self, model, version=None):
            return info

    T = 500_000
    req = pb.ModelInferRequest(model_name="m")
    req.inputs.add(name="x", datatype="FP32", shape=[T, 2]).contents.fp32_contents.extend(
        np.arange(2 * T, dtype=np.float32).tolist()
    )
    tracemalloc.start()
    _, p = rpc.parse(Core(), req)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    np.testing.assert_array_equal(p.x.reshape(-1), np.arange(2 * T, dtype=np.float32))
    assert peak < 3 * p.x.nbytes, (peak, p.x.nbytes)  # 4 MB of x; a float each took 32 MB


# ----------------------------------------------- a server of its own: the answer size, shutdown
@pytest.fixture(scope="module")
def big(tmp_path_factory):
    """A GRU with K=5 under a 64 MiB --max-request-bytes, a 1 s grace."""
    with served(tmp_path_factory.mktemp("hardening9_big"), "gru", leanrnn.GRU(1, 5, seed=1),
                "--max-batch", "4", "--threads", "1", "--grace", "1") as s:  # fmt: skip
        yield s


def test_an_answer_that_passes_the_size_check_is_sent(big):
    """y just under --max-request-bytes (64 MiB) passed the check and ran, its sequence
    advanced, and gRPC then refused to send it with h_n and the id beside it (its send limit
    was the same 64 MiB): the client got RESOURCE_EXHAUSTED and a retry applied the steps
    twice."""
    T = (64 << 20) // (5 * 4)  # y of 67,108,860 bytes
    x = np.zeros((T, 1), np.float32)
    c = tg.InferenceServerClient(big["grpc"])
    inp = tg.InferInput("x", [T, 1], "FP32")
    inp.set_data_from_numpy(x)
    out = [tg.InferRequestedOutput("y"), tg.InferRequestedOutput("h_n")]
    res = c.infer("gru", [inp], outputs=out, request_id="an-id", sequence_id=7,
                  sequence_start=True, sequence_end=True, client_timeout=120)  # fmt: skip
    assert res.as_numpy("y").shape == (T, 5)
    np.testing.assert_allclose(res.as_numpy("h_n")[0], big["model"](x[:, None])[1][0, 0],
                               atol=1e-5)  # fmt: skip


def test_what_the_grace_period_does_not_finish_gets_503_and_unavailable(big):
    """Before: HTTP requests still queued when --grace ran out got uvicorn's plain-text 500 a
    second grace period later (their handlers cancelled). Runs last: it stops the server."""
    T = 2_000_000
    x = np.zeros((T, 1), np.float32)
    got = {}

    def run(proto, i):
        mod = th if proto == "http" else tg
        if proto == "http":
            c = th.InferenceServerClient(big["http"], network_timeout=120,
                                         connection_timeout=120)  # fmt: skip
        else:
            c = tg.InferenceServerClient(big["grpc"])
        inp = mod.InferInput("x", [T, 1], "FP32")
        inp.set_data_from_numpy(x)
        try:
            c.infer("gru", [inp], outputs=[mod.InferRequestedOutput("h_n")],
                    sequence_id=100 + i, sequence_start=True, sequence_end=True)  # fmt: skip
            got[(proto, i)] = "ok"
        except InferenceServerException as e:
            got[(proto, i)] = f"{e.status()} {e.message()}"

    threads = [threading.Thread(target=run, args=(p, i)) for i in range(3)
               for p in ("http", "grpc")]  # fmt: skip
    for t in threads:
        t.start()
    time.sleep(1.0)
    stopped = sigterm_seconds(big["proc"], timeout=30)
    for t in threads:
        t.join(timeout=60)
    assert len(got) == 6, got
    refused = {k: v for k, v in got.items() if v != "ok"}
    assert refused, got  # six requests of 2M steps on one thread do not fit in 1 s
    for (proto, _), v in refused.items():
        code = "503" if proto == "http" else "StatusCode.UNAVAILABLE"
        assert v.startswith(code) and "--grace period ran out" in v, v
    assert stopped < 1 + 4, stopped  # grace, the engine call under way, the transports


# ----------------------------------------------------------------- options that broke later
def test_max_request_bytes_past_grpcs_largest_message_is_a_usage_error(capsys):
    """2G started HTTP, loaded the models and then died in gRPC's channel arguments."""
    from leanrnn import cli

    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "m=gru:8", "--max-request-bytes", "2G"])
    assert e.value.code == 2
    assert "at most 2147483647 bytes" in capsys.readouterr().err


def test_a_model_named_stats_is_refused_before_anything_loads(capsys):
    """GET /v2/models/stats is the statistics endpoint: a model named 'stats' had its
    metadata shadowed (tritonclient's get_model_metadata('stats') got every model's stats)."""
    from helpers import fails_in_one_line

    fails_in_one_line(capsys, ["serve", "stats=gru:8", "--http-port", "0", "--no-grpc"],
                      "a model named 'stats'")  # fmt: skip


def test_a_huge_idle_timeout_still_makes_a_model_config_grpc_can_send():
    """--idle-timeout 1e14: max_sequence_idle_microseconds past uint64 failed gRPC's
    ModelConfig (ParseError)."""
    from google.protobuf import json_format
    from tritonclient.grpc import model_config_pb2

    from leanrnn.serve.protocol import ModelInfo, Tensor

    info = ModelInfo("m", "FP32", np.dtype(np.float32), {"x": Tensor("x", (-1, 2))},
                     {"y": Tensor("y", (-1, 4))}, 1e14, 4, "gru")  # fmt: skip
    cfg = info.config()
    json_format.ParseDict(cfg, model_config_pb2.ModelConfig(), ignore_unknown_fields=True)
    assert cfg["sequence_batching"]["max_sequence_idle_microseconds"] == 2**64 - 1
