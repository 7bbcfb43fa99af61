"""Session 37, from a red-team pass of leanrnn serve under concurrent load: a restart
(sequence_start on a live id) at --max-streams was refused for want of a second slot, and the
new sequence's next steps, accepted as the old one's, silently continued it. A restart now
reuses its sequence's slot: the old sequence's queued steps run first, then the new one's from
its own initial state. Each test failed before."""

from __future__ import annotations

import json
import queue
import time

import numpy as np
import pytest

import leanrnn
from leanrnn.engine.session import Pool
from leanrnn.serve.scheduler import Lane, Scheduler

C, H = 3, 6
LSTM = leanrnn.LSTM(C, H, num_layers=2, seed=11)


def _x(T: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((T, C)).astype(np.float32)


def _offline(x, h0=None, c0=None):
    hx = None if h0 is None else (h0[:, None], c0[:, None])
    return LSTM(x[:, None], hx)[0][:, 0]


def _run(max_streams: int, submits) -> list:
    """Queue ``submits`` [(key, start, end, x, h0, c0)] before the engine takes any, run them,
    and return their requests (each with y, or error)."""
    lane = Lane("m", LSTM, Pool(), threads=1, max_streams=max_streams, max_batch=4,
                max_chunk=4, idle_timeout=60.0)  # fmt: skip
    lane.warm_up()
    sched = Scheduler({"m": lane}, max_wait=0.001)
    done: queue.Queue = queue.Queue()
    with sched.cond:
        reqs = [sched.submit("m", key, start, end, x, h0, c0, on_done=done.put)
                for key, start, end, x, h0, c0 in submits]  # fmt: skip
    sched.start()
    try:
        for _ in reqs:
            done.get(timeout=60)
    finally:
        sched.stop()
    assert len(lane.free) == max_streams - len(lane.seqs)
    return reqs, lane


@pytest.mark.parametrize("ended_first", [False, True], ids=["live", "end-queued"])
def test_a_restart_at_the_stream_cap_runs_the_new_sequence_from_its_own_state(ended_first):
    rng = np.random.default_rng(0)
    old, new = _x(9, 1), _x(6, 2)
    h0 = rng.standard_normal((2, H)).astype(np.float32)
    c0 = rng.standard_normal((2, H)).astype(np.float32)
    other = _x(5, 3)
    key, busy = ("i", 1), ("i", 2)
    reqs, lane = _run(2, [
        (busy, True, False, other, None, None),  # the other slot: the cap is reached
        (key, True, False, old[:4], None, None),
        (key, False, ended_first, old[4:], None, None),
        (key, True, False, new[:2], h0, c0),  # a restart, at the cap, old steps queued
        (key, False, False, new[2:5], None, None),
        (key, False, True, new[5:], None, None),
    ])  # fmt: skip
    assert all(r.error is None for r in reqs), [r.error for r in reqs]
    np.testing.assert_allclose(reqs[0].y, _offline(other), rtol=0, atol=1e-6)
    np.testing.assert_allclose(np.concatenate([reqs[1].y, reqs[2].y]), _offline(old), rtol=0,
                               atol=1e-6)  # fmt: skip
    got_new = np.concatenate([r.y for r in reqs[3:]])
    np.testing.assert_allclose(got_new, _offline(new, h0, c0), rtol=0, atol=1e-6)
    assert key not in lane.seqs and busy in lane.seqs  # the restarted one ended: its slot freed


def test_a_restart_with_zero_state_and_state_snapshots_of_both_lives():
    old, new = _x(5, 4), _x(4, 5)
    key = ("s", "abc")
    reqs, _ = _run(1, [
        (key, True, False, old, None, None),
        (key, True, True, new, None, None),
    ])  # fmt: skip
    np.testing.assert_allclose(reqs[0].y, _offline(old), rtol=0, atol=1e-6)
    np.testing.assert_allclose(reqs[1].y, _offline(new), rtol=0, atol=1e-6)


# ----------------------------------------------- clients that hold the transports' call caps
pytest.importorskip("starlette")
pytest.importorskip("uvicorn")
tg = pytest.importorskip("tritonclient.grpc")
th = pytest.importorskip("tritonclient.http")

GRU = leanrnn.GRU(C, 4, seed=12)


def _infer_http(url: str, x: np.ndarray) -> np.ndarray:
    i = th.InferInput("x", list(x.shape), "FP32")
    i.set_data_from_numpy(x)
    return th.InferenceServerClient(url).infer("gru", [i]).as_numpy("y")


def _trickle(host: str, port: int, out: list, seconds: float) -> None:
    """An infer request whose body arrives a byte at a time, 0.3 s apart, for ``seconds``
    (or until the server answers); appends the status line."""
    import socket

    s = socket.create_connection((host, port), timeout=30)
    try:
        s.sendall(b"POST /v2/models/gru/infer HTTP/1.1\r\nHost: x\r\nContent-Type: "
                  b"application/json\r\nContent-Length: 1000\r\n\r\n")  # fmt: skip
        s.settimeout(0.3)
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            try:
                s.sendall(b" ")
                got = s.recv(200)
                if got:
                    out.append(got.split(b"\r\n")[0].decode())
                    return
            except TimeoutError:
                continue
            except OSError:
                break
        out.append("no answer")
    finally:
        s.close()


def test_trickled_bodies_and_idle_streams_do_not_hold_the_call_caps(tmp_path):
    """A body trickled a byte before each --read-timeout held a --max-concurrency slot for as
    long as its client liked (every other client: 503), and a ModelStreamInfer stream that sent
    nothing held a gRPC call slot forever (every other call: RESOURCE_EXHAUSTED)."""
    import threading

    from helpers import served

    with served(tmp_path, "gru", GRU, "--max-concurrency", "2", "--read-timeout", "1",
                "--idle-timeout", "1.5", "--threads", "1") as s:  # fmt: skip
        # HTTP: two tricklers take both slots; the minimum rate drops them after ~1 s
        statuses: list = []
        ts = [threading.Thread(target=_trickle, args=(s["host"], s["port"], statuses, 8.0))
              for _ in range(2)]  # fmt: skip
        for t in ts:
            t.start()
        time.sleep(0.5)
        x = _x(3, 9)
        t0 = time.monotonic()
        while True:  # a normal client gets through once they are dropped
            try:
                y = _infer_http(s["http"], x)
                break
            except Exception:  # 503 while the slots are held
                assert time.monotonic() - t0 < 6, "the tricklers held the HTTP slots"
                time.sleep(0.2)
        np.testing.assert_allclose(y, GRU(x[:, None])[0][:, 0], rtol=0, atol=1e-6)
        for t in ts:
            t.join()
        assert statuses == ["HTTP/1.1 408 Request Timeout"] * 2, statuses

        # gRPC: two streams that send nothing are closed after --idle-timeout
        errors: list = []
        clients = [tg.InferenceServerClient(s["grpc"]) for _ in range(2)]
        for c in clients:
            c.start_stream(callback=lambda result, error: errors.append(error))
        time.sleep(0.3)
        t0 = time.monotonic()
        while True:
            try:
                tg.InferenceServerClient(s["grpc"]).get_model_metadata("gru")
                break
            except Exception:  # RESOURCE_EXHAUSTED while the streams are open
                assert time.monotonic() - t0 < 6, "idle streams held the gRPC calls"
                time.sleep(0.2)
        time.sleep(0.3)
        for c in clients:
            c.stop_stream()
        assert len(errors) == 2 and all("--idle-timeout" in str(e) for e in errors), errors


def test_sigterm_while_a_body_arrives_answers_the_protocols_503(tmp_path):
    """A body still arriving at SIGTERM was cut by uvicorn's own shutdown: a plain-text 500 and
    a traceback in the log; every other request refused then gets the JSON 503."""
    import signal
    import socket

    from helpers import served

    with served(tmp_path, "gru", GRU, "--grace", "2", "--threads", "1") as s:
        sock = socket.create_connection((s["host"], s["port"]), timeout=30)
        try:
            sock.sendall(b"POST /v2/models/gru/infer HTTP/1.1\r\nHost: x\r\nContent-Type: "
                         b"application/json\r\nContent-Length: 1000\r\n\r\n{")  # fmt: skip
            time.sleep(0.3)
            s["proc"].send_signal(signal.SIGTERM)
            answer = b""
            while b"\r\n\r\n" not in answer or not answer.rstrip().endswith(b"}"):
                got = sock.recv(4096)
                if not got:
                    break
                answer += got
        finally:
            sock.close()
        assert s["proc"].wait(timeout=30) == 0
    head, _, body = answer.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 503"), answer
    assert "shutting down" in json.loads(body)["error"]
    assert not any("Traceback" in line for line in s["logs"]), "".join(s["logs"])


def test_cutting_bodies_spares_a_deadline_firing_in_the_same_turn():
    """A body's deadline that had just fired refused cut_bodies' reschedule (RuntimeError), and
    the shutdown stopped half done: health still SERVING, 503s for ever, SIGTERM ignored."""
    import asyncio
    import types

    from leanrnn.serve.core import Core

    async def main():
        core = types.SimpleNamespace(bodies=set())
        loop = asyncio.get_running_loop()
        timed_out = []

        async def body():
            try:
                async with asyncio.timeout(None) as d:
                    core.bodies.add(d)
                    d.reschedule(loop.time() + 0.05)
                    await asyncio.sleep(10)
            except TimeoutError:
                timed_out.append(True)

        t = asyncio.ensure_future(body())
        await asyncio.sleep(0)
        (d,) = core.bodies
        done = loop.create_future()
        # the shutdown's cut, due in the same loop turn as the deadline (which runs first)
        loop.call_at(d.when(), lambda: done.set_result(Core.cut_bodies(core)))
        await done
        await t
        return timed_out

    assert asyncio.run(main()) == [True]
