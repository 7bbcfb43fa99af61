"""Session 43, from the list earlier sessions noticed and left alone: JSON `true`/`false`
among an FP32 input's numbers was taken as 1.0/0.0 (numpy's asarray of [0.5, true]), where
Triton refuses a boolean in a numeric tensor."""

from __future__ import annotations

import time

import numpy as np
import pytest

from leanrnn.serve.errors import InvalidRequest
from leanrnn.serve.protocol import ModelInfo, Tensor, from_list

INFO = ModelInfo("m", "FP32", np.dtype(np.float32), {"x": Tensor("x", (-1, 2))},
                 {"y": Tensor("y", (-1, 3))}, 1.0, 8, "lstm")  # fmt: skip


@pytest.mark.parametrize("data", [[0.5, True], [[0.5, 1.0], [False, 2.0]], [[1, 2], [3, True]],
                                  [[[0.5, 1.5]], [[2.5, True]]]])  # fmt: skip
def test_json_booleans_are_not_numbers(data):
    shape = np.asarray(data, dtype=np.float64).shape
    with pytest.raises(InvalidRequest, match="list of numbers"):
        from_list(INFO, "x", shape, data)


def test_json_numbers_still_parse():
    data = [[0.5, 1], [2, -3.25]]
    np.testing.assert_array_equal(from_list(INFO, "x", (2, 2), data),
                                  np.array(data, np.float32))  # fmt: skip


def test_a_scheduler_dropped_without_stop_ends_its_thread():
    """Its thread held it (a bound method as the target): one dropped without stop() kept
    its thread, models and pool for the life of the process."""
    import gc
    import threading
    import time
    import weakref

    import leanrnn
    from leanrnn.engine.session import Pool
    from leanrnn.serve.scheduler import Lane, Scheduler

    m = leanrnn.GRU(4, 8, seed=0)
    lane = Lane("m", m, Pool(), threads=1, max_streams=4, max_batch=4, max_chunk=4,
                idle_timeout=0.2)  # fmt: skip
    s = Scheduler({"m": lane}, max_wait=0.0)
    s.start()
    thread = s._thread
    done = []
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    s.submit("m", 1, True, True, x, on_done=done.append)
    deadline = time.monotonic() + 10
    while not done and time.monotonic() < deadline:
        time.sleep(0.01)
    assert done and done[0].error is None
    np.testing.assert_allclose(done[0].y, m(x[:, None])[0][:, 0], atol=1e-6, rtol=0)
    ref = weakref.ref(s)
    del s, done, lane
    gc.collect()
    thread.join(timeout=5)
    assert ref() is None and not thread.is_alive()
    assert threading.active_count() < 50  # (nothing else piled up meanwhile)


# ---------------------------------------------------------------------------------------------
# A gRPC stream's requests of a sequence, refused in the middle by --max-queued-bytes, left a
# gap its later (already sent) requests silently ran across: a refused chunk's next chunk ran
# on the state before it, and a refused sequence_start on a live id let the next request
# continue the old sequence. Such a request now waits for room, its stream unread meanwhile.


@pytest.fixture(scope="module")
def queued_server(tmp_path_factory):
    import leanrnn
    from helpers import served

    pytest.importorskip("tritonclient.grpc")
    d = tmp_path_factory.mktemp("queued")
    with served(d, "m", leanrnn.LSTM(4, 8, num_layers=2, seed=1), "--max-queued-bytes",
                "200K") as s:  # fmt: skip
        yield s


def _stream(grpc_url, sends):
    """{request id: y} (or {"err": [...]}) for ``sends`` = [(sequence id, x, start)], all
    sent at once on one ModelStreamInfer stream."""
    import queue

    import tritonclient.grpc as tg

    client = tg.InferenceServerClient(grpc_url)
    answers: queue.Queue = queue.Queue()
    client.start_stream(callback=lambda result, error: answers.put((result, error)))
    try:
        for i, (sid, x, start) in enumerate(sends):
            inp = tg.InferInput("x", list(x.shape), "FP32")
            inp.set_data_from_numpy(x)
            client.async_stream_infer("m", [inp], outputs=[tg.InferRequestedOutput("y")],
                                      request_id=str(i), sequence_id=sid,
                                      sequence_start=start)  # fmt: skip
        got = {}
        for _ in sends:
            r, e = answers.get(timeout=120)
            if e is None:
                got[r.get_response().id] = r.as_numpy("y")
            else:
                got.setdefault("err", []).append(str(e))
    finally:
        client.stop_stream()
        client.close()
    return got


def test_a_full_queue_holds_a_streams_sequence_instead_of_gapping_it(queued_server):
    m = queued_server["model"]
    rng = np.random.default_rng(8)
    xs = [rng.standard_normal((n, 4)).astype(np.float32) for n in (3000, 3, 3000, 3)]
    got = _stream(queued_server["grpc"], [("hog", xs[0], True), ("S", xs[1], True),
                                          ("S", xs[2], False), ("S", xs[3], False)])  # fmt: skip
    assert "err" not in got, got["err"]  # chunk 2 was refused (429) and chunk 3 skipped it
    want = m(np.concatenate(xs[1:])[:, None])[0][:, 0]
    np.testing.assert_allclose(np.concatenate([got["1"], got["2"], got["3"]]), want,
                               atol=1e-5, rtol=0)  # fmt: skip


def test_a_restart_on_a_full_queue_does_not_continue_the_old_sequence(queued_server):
    m = queued_server["model"]
    rng = np.random.default_rng(9)
    old, hog, new1 = (rng.standard_normal((n, 4)).astype(np.float32) for n in (5, 3000, 3000))
    new2 = rng.standard_normal((3, 4)).astype(np.float32)
    _stream(queued_server["grpc"], [("R", old, True)])
    got = _stream(queued_server["grpc"], [("hog", hog, True), ("R", new1, True),
                                          ("R", new2, False)])  # fmt: skip
    assert "err" not in got, got["err"]
    want = m(np.concatenate([new1, new2])[:, None])[0][-3:, 0]  # not old's continuation
    np.testing.assert_allclose(got["2"], want, atol=1e-5, rtol=0)


def test_a_uint64_id_sent_as_int64_is_that_id(queued_server):
    """Triton's C++ client sends a uint64 sequence_id as an int64 parameter: 2**64-1 arrives
    as -1 (refused: "expected an integer in 1..2**64-1"), where Triton reads it back."""
    from tritonclient.grpc import service_pb2 as pb

    from leanrnn.serve.rpc import _params

    req = pb.ModelInferRequest()
    req.parameters["sequence_id"].int64_param = -1
    req.parameters["sequence_start"].bool_param = True
    assert _params(req.parameters) == {"sequence_id": 2**64 - 1, "sequence_start": True}


@pytest.mark.parametrize("sid", [None, 0, ""])
@pytest.mark.parametrize("flag", ["sequence_start", "sequence_end"])
def test_start_or_end_needs_a_sequence_id(sid, flag):
    """The sequence extension: with start or end set, sequence_id "must be set to a non-zero
    or non-empty string value"; they were taken as a stateless call."""
    from leanrnn.serve.protocol import sequence

    params = {flag: True} if sid is None else {flag: True, "sequence_id": sid}
    with pytest.raises(InvalidRequest, match="without a sequence_id"):
        sequence(params)
    key, start, end = sequence({} if sid is None else {"sequence_id": sid})
    assert key[0] == "" and start and end  # a stateless call, as before


def test_string_ids_are_announced(queued_server):
    import tritonclient.http as th

    c = th.InferenceServerClient(queued_server["http"])
    try:
        assert "sequence(string_id)" in c.get_server_metadata()["extensions"]
    finally:
        c.close()


def test_a_refusal_on_a_stream_ends_the_sequence_and_the_wait_is_bounded():
    """The review's case: answers that are never released hold the queue full. A stream's
    request of a sequence waits for room for at most its model's idle timeout, then is
    refused; the sequence then ends after its accepted requests, so its next request (already
    sent on the stream) is refused too, naming why, instead of running across the gap."""
    import asyncio

    import leanrnn
    from leanrnn.engine.session import Pool
    from leanrnn.serve.core import Core
    from leanrnn.serve.errors import QueueFull, SequenceError
    from leanrnn.serve.protocol import Parsed
    from leanrnn.serve.scheduler import Lane, Scheduler

    m = leanrnn.GRU(4, 8, seed=0)
    lane = Lane("m", m, Pool(), threads=1, max_streams=8, max_batch=4, max_chunk=4,
                idle_timeout=0.5)  # fmt: skip
    x = np.ones((3, 4), np.float32)
    with Scheduler({"m": lane}, max_wait=0.0, max_queued_bytes=300) as s:
        core = Core.__new__(Core)  # (the parts infer_held uses)
        core.scheduler, core.draining = s, False
        core.io = lambda *a: None
        core._admissible = lambda p, j: None
        held = s.submit("m", ("i", 99), True, False, x, hold=True)  # never released
        done = []
        s.submit("m", ("i", 1), True, False, x, on_done=done.append)
        deadline = time.monotonic() + 10
        while not done and time.monotonic() < deadline:
            time.sleep(0.01)
        assert held.nbytes and done

        def parsed(start):  # (6 steps: past the limit beside the held request's 3)
            return Parsed("m", "r", ("i", 1), start, False, np.ones((6, 4), np.float32), None,
                          None, ["y"], {})  # fmt: skip

        async def stream_request(start):
            sub = asyncio.get_running_loop().create_future()
            return await core.infer_held(parsed(start), "grpc", 0, None, sub)

        t0 = time.monotonic()
        with pytest.raises(QueueFull):
            asyncio.run(stream_request(False))  # waited forever before the cap
        assert 0.4 < time.monotonic() - t0 < 5
        s.release(held)
        with pytest.raises(SequenceError, match="a request of it on its stream was refused"):
            s.submit("m", ("i", 1), False, False, x)  # ran on the state before the gap
        s.submit("m", ("i", 1), True, False, x)  # a start begins it again


# ---------------------------------------------------------------------------------------------
# The second review: a stream's request refused before infer_held (by --max-queued-bytes while
# its message was counted, or by parsing) left its sequence live, and the next request ran
# across the gap; a sequence's own refusals overwrote the first reason it was ended for.


def _stream_case(second, idle=1.0, limit=400):
    """On one stream: a start of sequence 1 (2 steps), then, once 352 of ``limit`` bytes are
    held by a request elsewhere that is never released, ``second`` (the serialized request)
    and a 2-step continuation. The three answers (error message or "ok"), and the lane."""
    import asyncio

    import leanrnn
    from helpers import GrpcContextStub
    from leanrnn.engine.session import Pool
    from leanrnn.serve import rpc
    from leanrnn.serve.core import Core
    from leanrnn.serve.scheduler import Lane, Scheduler

    lane = Lane("m", leanrnn.GRU(4, 8, seed=0), Pool(), threads=1, max_streams=8, max_batch=4,
                max_chunk=4, idle_timeout=idle)  # fmt: skip
    with Scheduler({"m": lane}, max_wait=0.0, max_queued_bytes=limit) as s:
        core = Core(s, token=None, max_request_bytes=1 << 20)
        core.ready = True
        gate = asyncio.Event()

        async def requests():
            yield _request(0, 2, start=True)
            await gate.wait()
            yield second
            yield _request(2, 2)

        async def main():
            out = []
            stream = rpc.Servicer(core).ModelStreamInfer(requests(), GrpcContextStub())
            async for raw in stream:
                msg = rpc.pb.ModelStreamInferResponse.FromString(raw)
                out.append(msg.error_message or "ok")
                if len(out) == 1:
                    s.submit("m", ("i", 99), True, False, np.ones((6, 4), np.float32), hold=True)
                    gate.set()
                if len(out) == 3:
                    break
            await stream.aclose()
            return out

        return asyncio.run(asyncio.wait_for(main(), 30)), lane


def _request(i, T, start=False, output="y"):
    from leanrnn.serve import rpc

    r = rpc.pb.ModelInferRequest(model_name="m", id=str(i))
    r.parameters["sequence_id"].int64_param = 1
    if start:
        r.parameters["sequence_start"].bool_param = True
    r.inputs.add(name="x", datatype="FP32", shape=[T, 4])
    r.raw_input_contents.append(np.ones((T, 4), np.float32).tobytes())
    r.outputs.add(name=output)
    return r.SerializeToString()


@pytest.mark.parametrize("case", ["counted while read", "refused by parsing"])
def test_a_stream_request_refused_before_the_scheduler_ends_its_sequence(case):
    second = _request(1, 6) if case == "counted while read" else _request(1, 2, output="bogus")
    out, lane = _stream_case(second)
    assert out[0] == "ok" and out[1] != "ok"
    # the continuation ran on the state before the refused request (answered "ok")
    assert "was ended" in out[2] and "refused" in out[2], out
    assert ("i", 1) not in lane.seqs


def test_a_sequences_own_refusals_keep_the_first_reason():
    import asyncio

    import leanrnn
    from leanrnn.engine.session import Pool
    from leanrnn.serve.core import Core
    from leanrnn.serve.errors import QueueFull, SequenceError
    from leanrnn.serve.protocol import Parsed
    from leanrnn.serve.scheduler import Lane, Scheduler

    lane = Lane("m", leanrnn.GRU(4, 8, seed=0), Pool(), threads=1, max_streams=8, max_batch=4,
                max_chunk=4, idle_timeout=0.2)  # fmt: skip
    s = Scheduler({"m": lane}, max_wait=0.0, max_queued_bytes=300)  # not started: work stays
    core = Core(s, token=None, max_request_bytes=1 << 20)
    s.submit("m", ("i", 1), True, False, np.ones((3, 4), np.float32))  # queued, live

    async def stream_request(T, start=False):
        sub = asyncio.get_running_loop().create_future()
        p = Parsed("m", "r", ("i", 1), start, False, np.ones((T, 4), np.float32), None, None,
                   ["y"], {})  # fmt: skip
        return await core.infer_held(p, "grpc", 0, None, sub)

    with pytest.raises(QueueFull):
        asyncio.run(stream_request(6))
    first = dict(lane.broken)
    for _ in range(2):  # its own refusals: the reason (and the time) stay the first
        with pytest.raises(SequenceError, match=r"refused \(the server's queue was full"):
            asyncio.run(stream_request(1))
    assert dict(lane.broken) == first
    # a restart while the old sequence still has work queued clears the tombstone
    s.submit("m", ("i", 1), True, False, np.ones((1, 4), np.float32))
    assert not lane.broken
    s.stop()
