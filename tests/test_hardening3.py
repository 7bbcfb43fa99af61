"""Hardening, third pass: what the last red team and review found in `serve`, the size options,
leanrnn.torch's messages and the gRPC stream, then a new user's bad input. Each test failed
before its fix; each bad call gives a clear leanrnn error and leaves things usable."""

from __future__ import annotations

import numpy as np
import pytest

import leanrnn
from helpers import fails_in_one_line
from leanrnn import cli
from leanrnn.engine.session import Pool
from leanrnn.serve import scheduler as sched_mod
from leanrnn.serve.errors import Exhausted
from leanrnn.serve.scheduler import Lane, Scheduler


@pytest.fixture(scope="module")
def gru_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("hardening3") / "g.lrnn"
    leanrnn.GRU(3, 4, seed=1).save(str(path))
    return str(path)


# ------------------------------------------------ serve: addresses checked before anything binds
def test_serve_bad_host_names_the_host_not_the_port(capsys, tmp_path):
    pytest.importorskip("uvicorn")
    # the model does not exist: the host must be refused first (before the fix the HTTP bind
    # failed with "Name or service not known; pick another --http-port")
    argv = ["serve", str(tmp_path / "none.lrnn"), "--host", "999.1.1.1", "--http-port", "0"]
    line = fails_in_one_line(
        capsys, [*argv, "--grpc-port", "0"], "--host", "999.1.1.1", "127.0.0.1"
    )
    assert "--http-port" not in line


def test_serve_one_port_for_http_and_grpc_is_refused_before_binding(capsys, tmp_path):
    pytest.importorskip("uvicorn")
    # before the fix HTTP bound the port, then the models loaded (here: a missing file, so the
    # error was about the file), and only gRPC's bind failed
    fails_in_one_line(
        capsys,
        ["serve", str(tmp_path / "none.lrnn"), "--http-port", "8123", "--grpc-port", "8123"],
        "--http-port",
        "--grpc-port",
        "8123",
        "different",
    )


# ------------------------------------------------ sizes: one parser, one clear message
@pytest.mark.parametrize("value", ["-1G", "0", "12Q", "-5", "0.1"])
@pytest.mark.parametrize(
    "argv",
    [
        ["score", "m.lrnn", "in.npy", "out.npz", "--memory-limit"],
        ["tune", "lstm:8", "--memory-limit"],
        ["plan", "lstm:8", "--memory-limit"],
        ["serve", "m.lrnn", "--max-queued-bytes"],
        ["serve", "m.lrnn", "--max-request-bytes"],
    ],
)
def test_size_options_refuse_negative_zero_and_garbage_by_name(argv, value, capsys):
    # before: '-1G' after the option was taken for another option ("expected one argument"),
    # 0 reached the library (score: "[tuning] memory_limit=0"; serve: a limit of 0 bytes)
    with pytest.raises(SystemExit) as e:
        cli.main([*argv, value])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"{argv[-1]}: " in err and value in err and "expected" in err, err
    assert "expected one argument" not in err


def test_size_options_share_one_parser():
    from leanrnn.commands import score, serve, tune

    parser = cli.build_parser()
    subs = next(a for a in parser._actions if a.dest == "command").choices
    flags = {"score": ["--memory-limit"], "tune": ["--memory-limit"], "plan": ["--memory-limit"],
             "serve": ["--max-request-bytes", "--max-queued-bytes"]}  # fmt: skip
    for cmd, names in flags.items():
        types = {a.option_strings[0]: a.type for a in subs[cmd]._actions if a.option_strings}
        # serve's request bound: cli.size within gRPC's largest message (_request_bytes)
        assert all(types[n] in (cli.size, serve._request_bytes) for n in names), (cmd, types)
    assert serve._request_bytes("512M") == cli.size("512M")
    assert cli.size("512M") == 512 << 20 and cli.size("2GiB") == 2 << 30
    assert cli.size("1.5k") == 1536 and cli.size("7") == 7
    for mod in (score, serve, tune):  # the copy in commands/score.py is gone
        assert not hasattr(mod, "parse_bytes")


# ------------------------------------------------ leanrnn.torch: T=0 names the module
# (N=0, torch's empty batch, returns empty outputs: test_hardening8)
@pytest.mark.parametrize("cls", ["LSTM", "GRU", "RNN"])
@pytest.mark.parametrize("shape", [(0, 2, 3), (0, 3)])
def test_torch_empty_input_names_the_module(cls, shape):
    torch = pytest.importorskip("torch")
    import leanrnn.torch as lt
    from leanrnn.errors import ShapeError

    m = getattr(lt, cls)(3, 4)
    with pytest.raises(ShapeError) as e:
        m(torch.zeros(shape))
    msg = str(e.value)
    assert msg.startswith(f"[leanrnn.torch.{cls}]"), msg  # before: [Trainer.forward]
    assert "Trainer" not in msg and "T >= 1" in msg and "expected" in msg
    y, _ = m(torch.zeros(2, 1, 3))  # still usable
    assert y.shape == (2, 1, 4)


# ------------------------------------------------ serve: one count of a request's bytes
def test_queued_bytes_check_and_accounting_use_one_count(monkeypatch):
    """The --max-queued-bytes check (before Lane.submit) and Request.nbytes (after) counted
    x + y each their own way; now both call request_bytes. Patched to a fixed count, the
    running total and the refusal must both follow it."""
    lane = Lane("g", leanrnn.GRU(3, 4, seed=3), Pool(), threads=1, max_streams=4, max_batch=2,
                max_chunk=2, idle_timeout=60.0)  # fmt: skip
    x = np.ones((5, 3), np.float32)
    assert sched_mod.request_bytes(x, 4, np.float32) == x.nbytes + 5 * 4 * 4
    monkeypatch.setattr(sched_mod, "request_bytes", lambda x, width, dtype: 1000)
    sched = Scheduler({"g": lane}, max_wait=0.0, max_queued_bytes=1500)
    r = sched.submit("g", 1, True, True, x)
    assert r.nbytes == 1000 and sched.queued_bytes == 1000
    with pytest.raises(Exhausted, match=r"\(1000 B\)"):
        sched.submit("g", 2, True, True, x)
    assert 2 not in lane.seqs


# ------------------------------------------------ gRPC stream: a client that does not read
@pytest.fixture(scope="module")
def grpc_server(tmp_path_factory):
    pytest.importorskip("uvicorn")
    pytest.importorskip("prometheus_client")
    pytest.importorskip("tritonclient.grpc")
    from helpers import launch_server, stop_server

    path = tmp_path_factory.mktemp("hardening3_serve") / "wide.lrnn"
    model = leanrnn.GRU(3, 64, seed=4)  # answers 20x the size of the requests
    model.save(str(path))
    proc, http_url, grpc_url, logs = launch_server([f"wide={path}", "--max-batch", "4"])
    yield {"model": model, "http": http_url, "grpc": grpc_url, "logs": logs}
    assert stop_server(proc) == 0


def _scrape(http_url: str) -> tuple[int, float]:
    """(requests the model has answered, bytes gRPC streams hold) from the stats and metrics."""
    import json
    import urllib.request

    with urllib.request.urlopen(f"http://{http_url}/v2/models/wide/stats", timeout=10) as r:
        count = json.load(r)["model_stats"][0]["inference_count"]
    with urllib.request.urlopen(f"http://{http_url}/metrics", timeout=10) as r:
        lines = r.read().decode().splitlines()
    held = [float(s.split()[-1]) for s in lines if s.startswith("leanrnn_serve_stream_held_bytes")]
    return count, held[0] if held else float("nan")


def test_grpc_stream_not_read_by_its_client_stops_being_read(grpc_server):
    """A client sends N requests on one stream and reads no answer: the server must stop
    reading that stream (before the fix it computed and queued ~2/3 of them, ~40 MB of
    answers, and would go on as long as the client sent), serve other clients meanwhile, and
    deliver every answer once the client reads."""
    import time

    import grpc
    from tritonclient.grpc import service_pb2 as pb
    from tritonclient.grpc import service_pb2_grpc as pbg

    from leanrnn.serve import rpc
    from tolerances import ATOL_SCORE

    T, N = 256, 1200
    x = np.random.default_rng(0).standard_normal((T, 3)).astype(np.float32)
    want = grpc_server["model"](x[:, None])[0][:, 0]

    def request(i):
        r = pb.ModelInferRequest(model_name="wide", id=str(i))
        r.inputs.add(name="x", datatype="FP32", shape=[T, 3])
        r.raw_input_contents.append(x.tobytes())
        return r

    def y(res):
        return np.frombuffer(res.raw_output_contents[0], np.float32).reshape(T, -1)

    stalled = grpc.insecure_channel(grpc_server["grpc"])
    answers = pbg.GRPCInferenceServiceStub(stalled).ModelStreamInfer(request(i) for i in range(N))
    last, deadline = (-1, 0.0), time.monotonic() + 60
    while time.monotonic() < deadline:  # until the server stops taking the stream's requests
        time.sleep(0.3)
        now = _scrape(grpc_server["http"])
        if now == last:
            break
        last = now
    count, held = last
    one = x.nbytes + T * 64 * 4  # a request being computed: its x and y
    assert count < N // 4, (count, N)
    assert 0 < held <= rpc.WINDOW_BYTES + one, held

    # other clients are served meanwhile, on a call and on a stream of their own
    other = pbg.GRPCInferenceServiceStub(grpc.insecure_channel(grpc_server["grpc"]))
    tol = ATOL_SCORE[np.float32]
    np.testing.assert_allclose(y(other.ModelInfer(request(-1), timeout=30)), want, atol=tol)
    for m in other.ModelStreamInfer(iter([request(-2), request(-3)]), timeout=30):
        assert not m.error_message, m.error_message
        np.testing.assert_allclose(y(m.infer_response), want, atol=tol)

    # and the stalled stream gets every answer once its client reads
    ids = set()
    for m in answers:
        assert not m.error_message, m.error_message
        ids.add(int(m.infer_response.id))
    np.testing.assert_allclose(y(m.infer_response), want, atol=tol)
    assert ids == set(range(N))
    assert _scrape(grpc_server["http"])[1] == 0  # the stream gave back what it held
    stalled.close()


# ------------------------------------------------ red team: `leanrnn run --input` files
def _npy_declaring(shape) -> bytes:
    """A .npy header declaring float32 ``shape``, followed by only 100 bytes of data."""
    d = f"{{'descr': '<f4', 'fortran_order': False, 'shape': {tuple(shape)}, }}".encode()
    d = d.ljust(118) + b"\n"
    return b"\x93NUMPY\x01\x00" + len(d).to_bytes(2, "little") + d + b"\0" * 100


@pytest.mark.parametrize(
    "name, make, words",
    [
        # before: "out of memory ... try smaller sizes" (np.load allocated the declared 2 TiB)
        ("huge.npy", lambda p: p.write_bytes(_npy_declaring((10**11, 2, 3))),
         ["huge.npy", "declares", "holds 100", "truncated"]),
        # before: "ValueError: EOF: reading array data" (which file, which member?)
        ("huge.npz", lambda p: _zip(p, {"x.npy": _npy_declaring((10**9, 2, 3))}),
         ["huge.npz", "'x.npy'", "declares", "truncated"]),
        # before: a zipfile.BadZipFile traceback
        ("half.npz", lambda p: p.write_bytes(_npz_bytes()[:200]), ["half.npz", "truncated or corrupt"]),
        # before: "contains pickled (object) data ... load it unsafely using allow_pickle"
        ("garbage.npy", lambda p: p.write_bytes(b"hello world"), ["garbage.npy", "np.save"]),
    ],
)  # fmt: skip
def test_run_input_that_is_not_what_it_declares_is_one_line(gru_file, tmp_path, capsys, name,
                                                            make, words):  # fmt: skip
    path = tmp_path / name
    make(path)
    line = fails_in_one_line(capsys, ["run", gru_file, "--input", str(path)], *words)
    assert "allow_pickle" not in line and "out of memory" not in line
    good = tmp_path / "x.npy"
    np.save(good, np.ones((4, 2, 3), np.float32))
    assert cli.main(["run", gru_file, "--input", str(good)]) == 0  # still usable


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/urandom"])
def test_run_input_that_is_a_device_is_refused_without_reading_it(gru_file, device, capsys):
    # before: np.load took /dev/zero's zeros for a pickle ("allow_pickle"); a size check
    # through zipfile read it until memory ran out
    import os

    if not os.path.exists(device):
        pytest.skip(f"no {device}")
    fails_in_one_line(capsys, ["run", gru_file, "--input", device], device, "regular file")


def test_run_lengths_given_as_an_npz_is_named(gru_file, tmp_path, capsys):
    # before: "[Session.run] lengths has dtype <U7" (the array of the .npz's member names)
    x, lengths = tmp_path / "x.npy", tmp_path / "l.npz"
    np.save(x, np.ones((4, 2, 3), np.float32))
    np.savez(lengths, lengths=np.array([4, 2]))
    fails_in_one_line(capsys, ["run", gru_file, "--input", str(x), "--lengths", str(lengths)],
                      "--lengths", "l.npz", ".npy")  # fmt: skip


def _zip(path, members: dict) -> None:
    import zipfile

    with zipfile.ZipFile(path, "w") as z:
        for k, v in members.items():
            z.writestr(k, v)


def _npz_bytes() -> bytes:
    import io

    buf = io.BytesIO()
    np.savez(buf, x=np.ones((4, 2, 3), np.float32))
    return buf.getvalue()


# ------------------------------------------------ red team: plan and tune of an ONNX file
def test_plan_and_tune_of_an_onnx_model_run(tmp_path, capsys):
    """Before: AttributeError tracebacks ('GraphSession' object has no attribute 'weights'):
    a GraphModel's own session was taken for a recurrent node's."""
    torch = pytest.importorskip("torch")
    pytest.importorskip("onnx")
    from helpers import torch_export

    torch.manual_seed(0)
    path = str(tmp_path / "g.onnx")
    torch_export(torch.nn.GRU(3, 4), (torch.zeros(5, 2, 3),), path, dynamo=False,
                 names=(["x"], ["y", "h"]), dynamic={"x": {0: "T", 1: "N"}})  # fmt: skip
    assert cli.main(["plan", path, "--batch", "2", "--steps", "5"]) == 0
    assert cli.main(["plan", path, "--train", "--batch", "2", "--steps", "5"]) == 0
    argv = ["tune", path, "--max-batch", "2", "--max-chunk", "2", "--json"]
    assert cli.main(argv) == 0
    assert '"batch"' in capsys.readouterr().out


# ------------------------------------------------ red team: serve's --max-streams/--max-batch
@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(max_streams=10**13), ["--max-streams", "10,000,000,000,000 stream slots"]),
        (dict(max_batch=10**9), ["--max-batch", "streams x 16 steps"]),
        (dict(max_chunk=10**9), ["--max-chunk", "536,870,912 steps"]),
    ],
)
def test_serve_sizes_past_the_machine_are_refused_by_name(kw, words):
    """Before: numpy's 'Unable to allocate 58.2 TiB for an array with shape ...', naming no
    option (or, below the overcommit limit, buffers the machine could not back)."""
    from leanrnn.errors import PlanError

    args = dict(threads=1, max_streams=4, max_batch=2, max_chunk=16, idle_timeout=60.0)
    args.update(kw)
    with pytest.raises(PlanError) as e:
        Lane("g", leanrnn.GRU(3, 4, seed=1), Pool(), **args)
    for w in words:
        assert w in str(e.value), (w, str(e.value))


def test_many_stream_slots_cost_only_their_state():
    """--max-streams 100000000 built a Python list of every free slot (3.6 GB, a minute)
    before the first stream came; the free slots now cost what is released, not S."""
    from helpers import traced_peak

    S = 10**6
    with traced_peak() as mem:
        lane = Lane("g", leanrnn.GRU(3, 4, seed=1), Pool(), threads=1, max_streams=S,
                    max_batch=2, max_chunk=2, idle_timeout=60.0)  # fmt: skip
    assert mem.peak - lane.h_store.nbytes < 4 << 20, mem.peak  # before: + ~36 MB of list
    assert len(lane.free) == S
    taken = [lane.free.pop() for _ in range(3)]
    assert taken == [0, 1, 2] and len(lane.free) == S - 3
    lane.free.append(1)
    assert lane.free.pop() == 1 and lane.free.pop() == 3  # released slots first


def test_grpc_stream_gone_mid_request_leaves_the_held_gauge_at_zero(monkeypatch):
    """A client that goes while its requests compute: the stream's bytes leave the gauge when
    it closes, and the answers that finish later must not count again (before: each moved
    the gauge by its answer's size minus its request's, forever)."""
    import asyncio
    from types import SimpleNamespace

    pytest.importorskip("grpc")
    pytest.importorskip("tritonclient.grpc")
    from leanrnn.serve import rpc

    info = SimpleNamespace(name="m", outputs={"y": SimpleNamespace(shape=[1, 1])},
                           dtype=np.float32)  # fmt: skip
    parsed = SimpleNamespace(x=np.zeros((1, 1), np.float32))
    monkeypatch.setattr(rpc, "parse", lambda core, req: (info, parsed))
    monkeypatch.setattr(rpc, "answer", lambda info, p, values, stream=False: b"")
    deltas = []

    from helpers import ServeCoreStub

    class Core(ServeCoreStub):
        metrics = SimpleNamespace(stream_held=deltas.append)

        async def infer_held(self, p, protocol, json_bytes=0, arrival=None, submitted=None):
            if submitted is not None:  # queued at once, as the real one (stream order)
                submitted.set_result(None)
            await gate.wait()
            return {}, lambda: None

    class Context:
        def invocation_metadata(self):
            return ()

    async def requests():
        for _ in range(3):
            yield rpc.pb.ModelInferRequest(model_name="m").SerializeToString()
        await asyncio.Event().wait()  # the client keeps the stream open, then goes

    async def main():
        answers = rpc.Servicer(Core()).ModelStreamInfer(requests(), Context())
        first = asyncio.ensure_future(answers.__anext__())
        await asyncio.sleep(0.05)  # the three requests are read and computing
        assert sum(deltas) == 3 * rpc.request_bytes(parsed.x, 1, np.float32)
        first.cancel()  # the client goes
        await asyncio.sleep(0.05)
        assert sum(deltas) == 0
        gate.set()  # ... and its requests finish afterwards
        await asyncio.sleep(0.05)

    gate = asyncio.Event()
    asyncio.run(main())
    assert sum(deltas) == 0, deltas


def _ipv6_loopback() -> bool:
    import socket

    try:
        with socket.socket(socket.AF_INET6, socket.SOCK_STREAM) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def test_serve_on_an_ipv6_address_serves_both_protocols(gru_file):
    """Before: gRPC was bound to '::1:0', which it read as ::0.1.0.0 port 443 ('cannot bind
    gRPC ... pick another --grpc-port'), and the ready line said http=::1:PORT."""
    pytest.importorskip("uvicorn")
    tg = pytest.importorskip("tritonclient.grpc")
    th = pytest.importorskip("tritonclient.http")
    if not _ipv6_loopback():
        pytest.skip("no IPv6 loopback here")
    from helpers import launch_server, stop_server

    proc, http_url, grpc_url, _ = launch_server([gru_file, "--host", "::1", "--max-batch", "2"])
    try:
        assert http_url.startswith("[::1]:") and grpc_url.startswith("[::1]:")
        x = np.ones((2, 3), np.float32)
        for mod, url in ((th, http_url), (tg, grpc_url)):
            i = mod.InferInput("x", [2, 3], "FP32")
            i.set_data_from_numpy(x)
            assert mod.InferenceServerClient(url).infer("g", [i]).as_numpy("y").shape == (2, 4)
    finally:
        assert stop_server(proc) == 0


def test_serve_bracketed_host_says_to_drop_the_brackets(capsys, tmp_path):
    pytest.importorskip("uvicorn")
    argv = ["serve", str(tmp_path / "none.lrnn"), "--host", "[::1]", "--http-port", "0"]
    fails_in_one_line(capsys, argv, "--host", "'[::1]'", "without brackets")


def test_tune_json_is_strict_json_when_a_batch_is_past_the_memory_limit(capsys):
    """Calls past --memory-limit are not timed (seconds=inf), and --json printed 'Infinity',
    which strict JSON readers refuse."""
    import json

    def no_constants(name):
        raise AssertionError(f"{name} is not JSON")

    argv = ["tune", "lstm:8", "--max-batch", "4096", "--max-chunk", "1", "--memory-limit", "1M"]
    assert cli.main([*argv, "--json"]) == 0
    out = json.loads(capsys.readouterr().out, parse_constant=no_constants)
    assert any(p["seconds"] is None for p in out["points"])  # the untimed batch is there
    assert out["batch"] < 4096


@pytest.mark.parametrize("token", ["", "  "])
def test_serve_empty_token_is_refused(token, capsys):
    # before: accepted, and then only the header 'Authorization: Bearer ' got in
    with pytest.raises(SystemExit) as e:
        cli.main(["serve", "m.lrnn", "--token", token])
    assert e.value.code == 2
    assert "--token: an empty token" in capsys.readouterr().err


def test_serve_empty_token_variable_means_no_token(monkeypatch):
    monkeypatch.setenv("LEANRNN_SERVE_TOKEN", "")
    assert cli.build_parser().parse_args(["serve", "m.lrnn"]).token is None
    monkeypatch.setenv("LEANRNN_SERVE_TOKEN", "s3cret")
    assert cli.build_parser().parse_args(["serve", "m.lrnn"]).token == "s3cret"


@pytest.mark.parametrize("size", [-5, "5", 1.5, True])
def test_http_bad_binary_data_size_says_what_was_expected(grpc_server, size):
    import http.client
    import json

    header = json.dumps({"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32",
                                     "parameters": {"binary_data_size": size}}]}).encode()  # fmt: skip
    host, port = grpc_server["http"].rsplit(":", 1)
    c = http.client.HTTPConnection(host, int(port), timeout=30)
    c.request("POST", "/v2/models/wide/infer", body=header + b"\0" * 12,
              headers={"Inference-Header-Content-Length": str(len(header))})  # fmt: skip
    r = c.getresponse()
    msg = json.loads(r.read())["error"]
    assert r.status == 400 and "binary_data_size" in msg and "expected a byte count" in msg, msg
