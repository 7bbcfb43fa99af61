"""Session 38: gRPC messages were decoded and encoded on the event loop by grpc.aio (upb takes
~1.2 ms a MiB for each of FromString, ByteSize and SerializeToString), so one 50 MiB answer
held every other stream for ~180 ms; a message that was not a ModelInferRequest got a bare
INTERNAL. Each test failed before."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

import leanrnn
from helpers import GrpcContextStub, ServeCoreStub, served

grpc = pytest.importorskip("grpc")
pytest.importorskip("tritonclient.grpc")
from tritonclient.grpc import service_pb2 as pb  # noqa: E402

C, H = 3, 5
MODEL = leanrnn.GRU(C, H, seed=12)
METHOD = "/inference.GRPCInferenceService/"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with served(tmp_path_factory.mktemp("hardening12_serve"), "gru", MODEL, "--threads",
                "1") as s:  # fmt: skip
        yield s


def _request(x: np.ndarray, **params) -> pb.ModelInferRequest:
    req = pb.ModelInferRequest(model_name="gru", id="r")
    req.inputs.add(name="x", datatype="FP32", shape=list(x.shape))
    req.raw_input_contents.append(x.tobytes())
    for key, v in params.items():
        setattr(req.parameters[key], "bool_param" if isinstance(v, bool) else "int64_param", v)
    return req


def _y(res) -> np.ndarray:
    return np.frombuffer(res.raw_output_contents[0], np.float32).reshape(-1, H)


@pytest.mark.parametrize("T, off", [(4, False), (24_000, True)], ids=["small", "large"])
def test_grpc_messages_past_inline_are_read_and_written_off_the_event_loop(monkeypatch, T, off):
    from types import SimpleNamespace

    from leanrnn.serve import rpc

    x = np.ones((T, C), np.float32)  # 288 kB, past core.INLINE, at T=24,000; its y 480 kB
    info = SimpleNamespace(name="gru", datatype="FP32", outputs={"y": SimpleNamespace(shape=[-1, H])},
                           dtype=np.dtype(np.float32))  # fmt: skip
    seen = {}

    def spy(name, fn):
        def wrapped(*args):
            seen[name] = threading.get_ident()
            return fn(*args)

        monkeypatch.setattr(rpc, name, wrapped)

    spy("decode", rpc.decode)
    spy("parse", lambda core, req: (info, SimpleNamespace(id=req.id, x=x)))
    spy("answer", rpc.answer)
    y = np.arange(T * H, dtype=np.float32).reshape(T, H)
    data = _request(np.ones((T, C), np.float32)).SerializeToString()

    async def main():
        servicer = rpc.Servicer(ServeCoreStub({"y": y}))
        unary = await servicer.ModelInfer(data, GrpcContextStub())

        async def one():
            yield data

        streamed = [m async for m in servicer.ModelStreamInfer(one(), GrpcContextStub())]
        return threading.get_ident(), unary, streamed

    loop_thread, unary, streamed = asyncio.run(main())
    assert set(seen) == {"decode", "parse", "answer"}
    assert all((t != loop_thread) == off for t in seen.values()), (seen, loop_thread)
    np.testing.assert_array_equal(_y(pb.ModelInferResponse.FromString(unary)), y)
    (m,) = [pb.ModelStreamInferResponse.FromString(b) for b in streamed]
    assert not m.error_message and m.infer_response.id == "r"
    assert m.infer_response.parameters["triton_final_response"].bool_param
    np.testing.assert_array_equal(_y(m.infer_response), y)


def test_a_message_that_is_not_a_request_is_invalid_and_the_stream_goes_on(server):
    with grpc.insecure_channel(server["grpc"]) as ch:
        infer = ch.unary_unary(METHOD + "ModelInfer")  # bytes in, bytes out
        with pytest.raises(grpc.RpcError) as e:
            infer(b"\xff\xff\xff", timeout=30)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT  # was INTERNAL
        assert "not a ModelInferRequest" in e.value.details()

        x = np.random.default_rng(0).standard_normal((7, C)).astype(np.float32)
        stream = ch.stream_stream(METHOD + "ModelStreamInfer",
                                  response_deserializer=pb.ModelStreamInferResponse.FromString)  # fmt: skip
        good = _request(x).SerializeToString()
        bad, ok = list(stream(iter([b"\xff\xff\xff", good]), timeout=30))
    assert "not a ModelInferRequest" in bad.error_message
    assert bad.infer_response.parameters["triton_final_response"].bool_param
    assert not ok.error_message
    np.testing.assert_allclose(_y(ok.infer_response), MODEL(x[:, None])[0][:, 0], rtol=0,
                               atol=1e-6)  # fmt: skip


def test_large_answers_over_grpc_match_the_model(server):
    """A request and answer past core.INLINE, through the worker thread, on both calls."""
    import tritonclient.grpc as tg

    T = 24_000  # x 288 kB, y 480 kB
    x = np.random.default_rng(1).standard_normal((T, C)).astype(np.float32)
    want = MODEL(x[:, None])[0][:, 0]
    with grpc.insecure_channel(server["grpc"]) as ch:
        res = ch.unary_unary(METHOD + "ModelInfer",
                             request_serializer=pb.ModelInferRequest.SerializeToString,
                             response_deserializer=pb.ModelInferResponse.FromString)(
            _request(x), timeout=60)  # fmt: skip
    np.testing.assert_allclose(_y(res), want, rtol=0, atol=1e-5)

    answers: list = []
    done = threading.Event()
    client = tg.InferenceServerClient(server["grpc"])
    try:
        client.start_stream(
            callback=lambda result, error: (answers.append((result, error)), done.set())
        )
        i = tg.InferInput("x", [T, C], "FP32")
        i.set_data_from_numpy(x)
        client.async_stream_infer("gru", [i], sequence_id=5, sequence_start=True,
                                  sequence_end=True)  # fmt: skip
        assert done.wait(60)
    finally:
        client.stop_stream()
        client.close()
    ((r, e),) = answers
    assert e is None, e
    np.testing.assert_allclose(r.as_numpy("y").reshape(T, H), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("protocol", ["http", "grpc"])
def test_extensions_the_server_does_not_implement_are_refused_not_ignored(server, protocol):
    """A classification (class_count) or shared-memory output was answered as the plain
    tensor in the body: the client read floats where it asked for class strings, or waited on
    its shared memory. Refused by name now; the server goes on."""
    import tritonclient.grpc as tg
    import tritonclient.http as th
    from tritonclient.utils import InferenceServerException

    t = th if protocol == "http" else tg
    client = t.InferenceServerClient(server[protocol])
    x = np.random.default_rng(2).standard_normal((4, C)).astype(np.float32)
    i = t.InferInput("x", [4, C], "FP32")
    i.set_data_from_numpy(x)
    try:
        with pytest.raises(InferenceServerException, match="classification extension"):
            client.infer("gru", [i], outputs=[t.InferRequestedOutput("y", class_count=3)])
        shm = t.InferRequestedOutput("y")
        shm.set_shared_memory("region", 4 * H * 4)
        with pytest.raises(InferenceServerException, match="shared-memory extensions"):
            client.infer("gru", [i], outputs=[shm])
        shm_in = t.InferInput("x", [4, C], "FP32")
        shm_in.set_shared_memory("region", x.nbytes)
        with pytest.raises(InferenceServerException, match="shared-memory extensions"):
            client.infer("gru", [shm_in])
        r = client.infer("gru", [i], outputs=[t.InferRequestedOutput("y")])
        np.testing.assert_allclose(r.as_numpy("y"), MODEL(x[:, None])[0][:, 0], rtol=0,
                                   atol=1e-6)  # fmt: skip
    finally:
        client.close()


_STARTING = """
import asyncio, sys, time
from leanrnn import cli
from leanrnn.serve import rpc, server
where, path, port = sys.argv[1:]
if where == "tuning":  # a long synchronous stretch: the first Ctrl-C lands at the next await
    build = server.build
    def slow(*args, **kwargs):
        print("WINDOW", file=sys.stderr, flush=True)
        time.sleep(3)
        return build(*args, **kwargs)
    server.build = slow
else:  # gRPC starting
    health = rpc.Health.set
    async def slow(self, serving):
        print("WINDOW", file=sys.stderr, flush=True)
        await asyncio.sleep(5)
        await health(self, serving)
    rpc.Health.set = slow
cli.entry(["serve", path, "--http-port", port, "--grpc-port", "0", "--threads", "1"])
"""


@pytest.mark.parametrize("where", ["tuning", "grpc"])
def test_ctrl_c_while_starting_is_one_line_and_frees_the_port(where, tmp_path):
    """SIGINT before "ready" printed ~50 lines of traceback ending in grpc's "Event loop is
    closed", or InvalidStateError from stopping a server whose start was cancelled."""
    import signal
    import socket
    import subprocess
    import sys

    from helpers import src_env

    path = tmp_path / "m.lrnn"
    MODEL.save(path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    p = subprocess.Popen([sys.executable, "-W", "always", "-c", _STARTING, where, str(path),
                          str(port)], stderr=subprocess.PIPE, text=True, env=src_env())  # fmt: skip
    try:
        for line in p.stderr:
            if "WINDOW" in line:
                break
        time.sleep(0.3)
        p.send_signal(signal.SIGINT)
        err = p.stderr.read()
        p.wait(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == -signal.SIGINT, (p.returncode, err)  # died by SIGINT, as a shell needs
    assert "Traceback" not in err and "never awaited" not in err, err
    assert err.strip().splitlines()[-1] == "leanrnn: interrupted", err
    with socket.socket() as s:  # the HTTP port was let go
        s.bind(("127.0.0.1", port))


def test_a_stream_holds_only_x_of_a_request_while_it_computes(monkeypatch):
    """The serialized message stayed referenced (by the read's future, until the next request
    came) beside x while the request computed: the request's size again, which
    --max-queued-bytes did not count."""
    import tracemalloc
    from types import SimpleNamespace

    from leanrnn.serve import rpc

    info = SimpleNamespace(name="m", outputs={"y": SimpleNamespace(shape=[-1, 1])},
                           dtype=np.dtype(np.float32))  # fmt: skip

    def parse(core, req):
        return info, SimpleNamespace(id=req.id, x=np.frombuffer(req.raw_input_contents[0],
                                                                np.float32).copy())  # fmt: skip

    monkeypatch.setattr(rpc, "parse", parse)
    gate = asyncio.Event()
    entered = []

    class Core(ServeCoreStub):
        async def infer_held(self, p, protocol, json_bytes=0, arrival=None, submitted=None):
            if submitted is not None:  # queued at once, as the real one (stream order)
                submitted.set_result(None)
            entered.append(p.id)
            await gate.wait()
            return {}, lambda: None

    X = 8 << 20  # bytes of x

    async def requests():
        req = pb.ModelInferRequest(model_name="m", id="r")
        req.raw_input_contents.append(bytes(X))
        yield req.SerializeToString()
        del req
        await asyncio.Event().wait()  # the client keeps the stream open

    async def main():
        answers = rpc.Servicer(Core()).ModelStreamInfer(requests(), GrpcContextStub())
        first = asyncio.ensure_future(answers.__anext__())
        await asyncio.sleep(0.2)  # read, parsed, computing
        held = tracemalloc.get_traced_memory()[0] - base
        # computing indeed (a failing double was answered at once, and held nothing)
        assert entered == ["r"] and not first.done()
        first.cancel()
        return held

    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        held = asyncio.run(main())
    finally:
        tracemalloc.stop()
    assert held < 1.5 * X, f"{held / X:.2f} x the request's x"


def test_a_stream_abandoned_mid_read_leaves_no_unretrieved_task():
    """A client gone while its next request was being read: grpc's iterator ended the read
    with StopAsyncIteration after the cancel, and asyncio printed "Task exception was never
    retrieved" to stderr, outside the server's JSON log."""
    import gc

    from leanrnn.serve import rpc

    class Requests:  # a read that ends on its own as the stream closes
        def __aiter__(self):
            return self

        async def __anext__(self):
            try:
                await asyncio.sleep(30)
            except asyncio.CancelledError:
                pass
            raise StopAsyncIteration

    reported = []

    async def main():
        asyncio.get_running_loop().set_exception_handler(lambda loop, ctx: reported.append(ctx))
        answers = rpc.Servicer(ServeCoreStub()).ModelStreamInfer(Requests(), GrpcContextStub())
        first = asyncio.ensure_future(answers.__anext__())
        await asyncio.sleep(0.05)  # reading
        first.cancel()  # the client goes
        await asyncio.sleep(0.05)
        await answers.aclose()
        gc.collect()
        await asyncio.sleep(0.05)

    asyncio.run(main())
    gc.collect()
    assert not reported, [str(c.get("exception") or c.get("message")) for c in reported]


def test_a_request_of_many_small_fields_is_refused_before_it_is_decoded(server):
    """16 MiB of empty `outputs {}` entries took 2.4 GB and 12 s of Python before any check
    (and 256 KiB of them, parsed on the event loop, held every other stream ~180 ms)."""
    name = pb.ModelInferRequest(model_name="gru").SerializeToString()
    with grpc.insecure_channel(server["grpc"]) as ch:
        infer = ch.unary_unary(METHOD + "ModelInfer")
        with pytest.raises(grpc.RpcError) as e:
            infer(name + b"\x32\x00" * 100_000, timeout=30)  # field 6 (outputs), empty
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "more than 256 top-level fields" in e.value.details()
        with pytest.raises(grpc.RpcError) as e:  # few enough to decode: counted before loops
            infer(name + b"\x32\x00" * 200, timeout=30)
        assert "200 outputs listed" in e.value.details()
        x = np.random.default_rng(3).standard_normal((5, C)).astype(np.float32)
        ok = ch.unary_unary(METHOD + "ModelInfer",
                            response_deserializer=pb.ModelInferResponse.FromString)(
            _request(x).SerializeToString(), timeout=30)  # fmt: skip
    np.testing.assert_allclose(_y(ok), MODEL(x[:, None])[0][:, 0], rtol=0, atol=1e-6)


def test_a_refused_grpc_request_is_counted_while_decoded_and_let_go_at_once(monkeypatch):
    """Its bytes count against --max-queued-bytes from before decoding (12 calls of 60 MiB
    took the server 2.4 GB past a 1 GiB limit), and a refusal's traceback no longer keeps
    its frames, and the message, in a cycle until a garbage collection."""
    import gc
    import tracemalloc

    from leanrnn.serve import rpc
    from leanrnn.serve.errors import InvalidRequest

    events = []
    decode = rpc.decode
    monkeypatch.setattr(rpc, "decode", lambda data: (events.append("decode"), decode(data))[1])

    def parse(core, req):
        raise InvalidRequest("refused")

    monkeypatch.setattr(rpc, "parse", parse)

    class Core(ServeCoreStub):
        def reserve(self, n, mine=0):
            events.append(("reserve", n))

        def unreserve(self, n):
            events.append(("unreserve", n))

    class Aborted(Exception):
        pass

    class Context(GrpcContextStub):  # as grpc's: it keeps the error it raised
        async def abort(self, code, details):
            self.error = Aborted(details)
            raise self.error

    X = 8 << 20

    def call():
        req = pb.ModelInferRequest(model_name="m")
        req.raw_input_contents.append(bytes(X))
        box = [req.SerializeToString()]  # handed over, not kept: as grpc's (Cython) caller
        del req
        n = len(box[0])

        async def main():
            with pytest.raises(Aborted):
                await rpc.Servicer(Core()).ModelInfer(box.pop(), Context())

        return n, main

    gc.collect()
    gc.disable()
    tracemalloc.start()
    try:
        n, main = call()
        asyncio.run(main())
        del main
        held = tracemalloc.get_traced_memory()[0]
    finally:
        tracemalloc.stop()
        gc.enable()
    assert events[:2] == [("reserve", n), "decode"] and events[-1] == ("unreserve", n), events
    assert held < X / 2, f"{held / X:.2f} x the request held after its refusal"
