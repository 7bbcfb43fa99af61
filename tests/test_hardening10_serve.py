"""leanrnn serve against the tenth red-team pass, protocol conformance with Triton: a
sequence_start on a live id starts it anew (it was refused until the idle timeout), stream
answers carry triton_final_response, unknown routes answer the protocol's JSON error, and the
model config reports the sequences it holds. One server subprocess for the module, a tiny
model; every test failed before its fix."""

from __future__ import annotations

import http.client
import json
import queue

import numpy as np
import pytest

import leanrnn
from helpers import served
from leanrnn.engine.session import Pool
from leanrnn.serve.scheduler import Lane, Scheduler

pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
th = pytest.importorskip("tritonclient.http")
tg = pytest.importorskip("tritonclient.grpc")
from tritonclient.utils import InferenceServerException  # noqa: E402

C, K = 3, 8
STREAMS = 12
MODEL = leanrnn.GRU(C, K, seed=5)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    with served(tmp_path_factory.mktemp("hardening10_serve"), "gru", MODEL, "--max-batch", "4",
                "--threads", "1", "--max-streams", str(STREAMS)) as s:  # fmt: skip
        yield s


def _x(T: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((T, C)).astype(np.float32)


def _step(mod, client, x, **kw) -> np.ndarray:
    i = mod.InferInput("x", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    return client.infer("gru", [i], **kw).as_numpy("y")


def _offline(x: np.ndarray) -> np.ndarray:
    return MODEL(x[:, None])[0][:, 0]


@pytest.mark.parametrize("proto", ["http", "grpc"])
def test_a_start_on_a_live_sequence_begins_it_anew(server, proto):
    """Triton terminates the old sequence and starts a new one; leanrnn answered 400 /
    INVALID_ARGUMENT until --idle-timeout evicted the old one (a client that restarted with
    its correlation id was locked out of it)."""
    mod = th if proto == "http" else tg
    client = mod.InferenceServerClient(server[proto])
    a, b = _x(4, 1), _x(5, 2)
    _step(mod, client, a, sequence_id=77, sequence_start=True)
    ys = [_step(mod, client, b[:2], sequence_id=77, sequence_start=True)]  # fresh state
    ys.append(_step(mod, client, b[2:], sequence_id=77, sequence_end=True))
    np.testing.assert_allclose(np.concatenate(ys), _offline(b), rtol=0, atol=1e-6)


def test_a_start_on_a_live_sequence_with_steps_queued_lets_them_finish_first():
    """The old sequence's queued steps still run, in order, on its own state; its slot is
    freed after them; the new sequence runs on fresh state beside it."""
    pool = Pool()
    lane = Lane("g", MODEL, pool, threads=1, max_streams=2, max_batch=4, max_chunk=4,
                idle_timeout=60.0)  # fmt: skip
    lane.warm_up()
    sched = Scheduler({"g": lane}, max_wait=0.001)
    done: queue.Queue = queue.Queue()
    old, new = _x(6, 3), _x(3, 4)
    with sched.cond:  # all three queued before the engine takes any
        r1 = sched.submit("g", ("i", 5), True, False, old[:3], on_done=done.put)
        r2 = sched.submit("g", ("i", 5), False, False, old[3:], on_done=done.put)
        r3 = sched.submit("g", ("i", 5), True, True, new, on_done=done.put)
    sched.start()
    try:
        for _ in range(3):
            done.get(timeout=60)
    finally:
        sched.stop()
    for r in (r1, r2, r3):
        assert getattr(r, "error", None) is None
    np.testing.assert_allclose(np.concatenate([r1.y, r2.y]), _offline(old), rtol=0, atol=1e-6)
    np.testing.assert_allclose(r3.y, _offline(new), rtol=0, atol=1e-6)
    assert len(lane.free) == 2 and not lane.seqs  # both slots back


def test_a_refused_restart_leaves_the_live_sequence_as_it_was():
    """A start on a live id that is refused ended the old sequence anyway: its next step was
    refused as 'already has a sequence_end queued'. (Session 37: a restart no longer needs a
    slot of its own, so the refusal left is a bad initial state.)"""
    from leanrnn.errors import ShapeError

    lane = Lane("g", MODEL, Pool(), threads=1, max_streams=1, max_batch=4, max_chunk=4,
                idle_timeout=60.0)  # fmt: skip
    x = _x(3, 7)
    lane.submit(("i", 5), True, False, x[:1], None, None, False, None, 0.0)
    bad_h0 = np.zeros((1, K + 1), np.float32)
    with pytest.raises(ShapeError):
        lane.submit(("i", 5), True, False, x[1:2], bad_h0, None, False, None, 0.0)
    s = lane.seqs[("i", 5)]
    assert not s.ending and not s.queue[-1].end and len(s.queue) == 1
    lane.submit(("i", 5), False, True, x[1:], None, None, False, None, 0.0)  # continues


def test_stream_answers_carry_triton_final_response(server):
    """Triton marks every stream answer of a non-decoupled model final; clients that wait for
    the mark (Triton's decoupled loop) waited forever here."""
    client = tg.InferenceServerClient(server["grpc"])
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for t, x in enumerate(_x(3, 6)):
            i = tg.InferInput("x", [1, C], "FP32")
            i.set_data_from_numpy(x[None])
            client.async_stream_infer("gru", [i], request_id=str(t), sequence_id=91,
                                      sequence_start=t == 0, sequence_end=t == 2)  # fmt: skip
        i = tg.InferInput("x", [1, C], "FP32")
        i.set_data_from_numpy(np.zeros((1, C), np.float32))
        client.async_stream_infer("gru", [i], request_id="bad", sequence_id="ghost")  # an error
        got = [answers.get(timeout=30) for _ in range(4)]
    finally:
        client.stop_stream()
    finals = [r.get_response().parameters["triton_final_response"].bool_param
              for r, error in got if error is None]  # fmt: skip
    assert finals == [True, True, True], finals  # (the error comes as an exception, in order)
    assert sum(error is not None for _, error in got) == 1


def test_an_unknown_route_answers_the_protocols_json_error(server):
    """Starlette's plain-text 'Not Found' made tritonclient's calls of unsupported features
    fail with 'Parse error at offset 1' instead of the server's reason."""
    conn = http.client.HTTPConnection(server["host"], server["port"], timeout=30)
    try:
        for method, path, status in (("GET", "/v2/nope", 404),
                                     ("GET", "/v2/models/gru/infer", 405)):  # fmt: skip
            conn.request(method, path)
            r = conn.getresponse()
            body = json.loads(r.read())
            assert r.status == status and "unsupported" in body["error"], (status, body)
            if status == 405:
                assert "POST" in (r.getheader("Allow") or ""), r.getheaders()
    finally:
        conn.close()
    client = th.InferenceServerClient(server["http"])
    with pytest.raises(InferenceServerException, match="unsupported endpoint"):
        client.load_model("gru")


def test_the_config_reports_the_sequences_it_holds(server):
    """max_candidate_sequences reported --max-batch (4); the server holds --max-streams."""
    cfg = th.InferenceServerClient(server["http"]).get_model_config("gru")
    assert cfg["sequence_batching"]["oldest"]["max_candidate_sequences"] == STREAMS
