"""Session 40, from a red-team pass over every tritonclient call (HTTP and gRPC): gRPC's
is_model_ready raised NOT_FOUND for a model it does not serve (Triton, and HTTP, say False);
with --token the model-ready health endpoint needed the token (a probe read "not ready" for
ever); execution_count counted every engine call (a 4000-step request: 250 executions for 1
inference); the unimplemented gRPC methods answered with a leaked Python exception; health
Watch streams, open without the token, could take every gRPC call slot; FP32 values sent in
another contents field were refused as "got 0 in contents"."""

from __future__ import annotations

import numpy as np
import pytest

import leanrnn
from helpers import served

grpcclient = pytest.importorskip("tritonclient.grpc")
httpclient = pytest.importorskip("tritonclient.http")
from tritonclient.utils import InferenceServerException  # noqa: E402

TOKEN = "s3cret"


@pytest.fixture(scope="module")
def srv(tmp_path_factory):
    d = tmp_path_factory.mktemp("srv")
    with served(d, "lstm", leanrnn.LSTM(3, 5, seed=0), "--token", TOKEN, "--threads", "1",
                "--max-chunk", "8", "--max-concurrency", "2") as s:  # fmt: skip
        yield s


def _auth():
    return {"authorization": f"Bearer {TOKEN}"}


def test_model_ready_is_open_and_false_for_what_is_not_served(srv):
    h = httpclient.InferenceServerClient(srv["http"])
    g = grpcclient.InferenceServerClient(srv["grpc"])
    for c in (h, g):  # no token: a health endpoint
        assert c.is_model_ready("lstm")
        assert not c.is_model_ready("nope")
        assert not c.is_model_ready("lstm", "2")
    h.close()
    g.close()


def test_execution_count_counts_executions_that_answered_requests(srv):
    c = grpcclient.InferenceServerClient(srv["grpc"])
    x = np.random.default_rng(0).standard_normal((40, 3)).astype(np.float32)
    before = c.get_inference_statistics("lstm", headers=_auth(), as_json=True)["model_stats"][0]
    inp = grpcclient.InferInput("x", list(x.shape), "FP32")
    inp.set_data_from_numpy(x)
    res = c.infer("lstm", [inp], headers=_auth())  # 40 steps: 5 engine calls of --max-chunk 8
    want = leanrnn.LSTM(3, 5, seed=0)(x[:, None])[0][:, 0]
    np.testing.assert_allclose(res.as_numpy("y"), want, rtol=1e-5, atol=1e-6)
    after = c.get_inference_statistics("lstm", headers=_auth(), as_json=True)["model_stats"][0]
    runs = int(after.get("inference_count", 0)) - int(before.get("inference_count", 0))
    execs = int(after.get("execution_count", 0)) - int(before.get("execution_count", 0))
    assert runs == 1 and execs == 1
    c.close()


@pytest.mark.parametrize("call", ["load_model", "unload_model", "get_trace_settings",
                                  "get_log_settings", "get_system_shared_memory_status"])  # fmt: skip
def test_unimplemented_grpc_methods_name_their_extension(srv, call):
    c = grpcclient.InferenceServerClient(srv["grpc"])
    args = ("lstm",) if call.endswith("_model") else ()
    with pytest.raises(InferenceServerException) as e:
        getattr(c, call)(*args, headers=_auth())
    assert "UNIMPLEMENTED" in str(e.value.status()) and "does not implement the" in str(e.value)
    assert "NotImplementedError" not in str(e.value)
    c.close()


def test_health_watches_cannot_take_every_call_slot(srv):
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc

    ch = grpc.insecure_channel(srv["grpc"])
    stub = health_pb2_grpc.HealthStub(ch)
    watches = [stub.Watch(health_pb2.HealthCheckRequest()) for _ in range(70)]
    try:
        refused = 0
        for w in watches:
            try:
                next(w)
            except grpc.RpcError as e:
                assert e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
                assert "Watch streams are open" in e.details()
                refused += 1
        assert 0 < refused < 70
        c = grpcclient.InferenceServerClient(srv["grpc"])
        x = np.ones((2, 3), np.float32)
        inp = grpcclient.InferInput("x", [2, 3], "FP32")
        inp.set_data_from_numpy(x)
        assert c.infer("lstm", [inp], headers=_auth()).as_numpy("y").shape == (2, 5)
        c.close()
    finally:
        for w in watches:
            w.cancel()
        ch.close()


def test_values_in_the_wrong_contents_field_are_named(srv):
    import grpc
    from tritonclient.grpc import service_pb2, service_pb2_grpc

    ch = grpc.insecure_channel(srv["grpc"])
    stub = service_pb2_grpc.GRPCInferenceServiceStub(ch)
    req = service_pb2.ModelInferRequest(model_name="lstm")
    t = req.inputs.add(name="x", datatype="FP32", shape=[1, 3])
    t.contents.fp64_contents.extend([1.0, 2.0, 3.0])
    with pytest.raises(grpc.RpcError) as e:
        stub.ModelInfer(req, metadata=list(_auth().items()))
    assert "contents.fp32_contents" in e.value.details() and "fp64_contents" in e.value.details()
    ch.close()


def test_an_embedded_schedulers_bad_submit_is_refused_before_it_shares_a_call():
    # before: a wrong-C x was queued; its call failed with a bare broadcast ValueError for
    # the good request batched with it too, and ended the good sequence
    import time

    from leanrnn import Pool
    from leanrnn.errors import SpecError
    from leanrnn.serve import Lane, Scheduler
    from leanrnn.serve.errors import InvalidRequest, NotFound

    m = leanrnn.LSTM(3, 4, seed=0)
    lane = Lane("m", m, Pool(), threads=1, max_streams=4, max_batch=4, max_chunk=8,
                idle_timeout=10.0)  # fmt: skip
    sch = Scheduler({"m": lane}, max_wait=0.2)
    x = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)
    good = sch.submit("m", ("", "good"), True, False, x)
    # ((0, 3): a request of 0 steps is valid since session 44, test_hardening18_serve)
    for bad in (np.zeros((5, 7), np.float32), x.astype(np.float64), [[1.0, 2.0, 3.0]]):
        with pytest.raises(InvalidRequest, match="model 'm' takes"):
            sch.submit("m", ("", "bad"), True, True, bad)
    with pytest.raises(NotFound, match="no model 'nope'"):
        sch.submit("nope", ("", "x"), True, True, x)
    sch.start()
    try:
        deadline = time.monotonic() + 30
        while not good.finished and time.monotonic() < deadline:
            time.sleep(0.01)
        assert good.error is None
        np.testing.assert_allclose(good.y, m(x[:, None])[0][:, 0], rtol=1e-5, atol=1e-6)
    finally:
        sch.drain(5)
        sch.stop()
    with pytest.raises(SpecError, match="max_chunk=0"):
        Lane("m", m, Pool(), threads=1, max_streams=4, max_batch=4, max_chunk=0, idle_timeout=1.0)
