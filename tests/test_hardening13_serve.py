"""Session 39: leanrnn serve over time (a red-team soak); each case failed before its fix."""

from __future__ import annotations

import gc
import http.client
import json
import logging
import time
import weakref

import numpy as np
import pytest

import leanrnn
from helpers import served
from leanrnn.engine.session import Pool
from leanrnn.serve.scheduler import Lane, Scheduler


def test_a_finished_request_is_freed_without_a_garbage_collection():
    """The front end's on_done closes over the future that the request becomes the result
    of; the request kept on_done, so request -> callback -> future -> request was a cycle and
    x and y lived until a full collection (a server under load: 1.4 MiB per finished request,
    past --max-queued-bytes 14 times over, until gc ran). Reference counting alone frees them
    now: collections are off while the requests run."""
    lane = Lane("m", leanrnn.GRU(4, 8, seed=0), Pool(), threads=1, max_streams=8, max_batch=4,
                max_chunk=4, idle_timeout=60.0)  # fmt: skip
    lane.warm_up()
    sched = Scheduler({"m": lane}, max_wait=0.0)
    sched.start()
    gc.collect()
    gc.disable()
    try:
        xs = []
        for i in range(3):
            x = np.random.default_rng(i).standard_normal((6, 4)).astype(np.float32)
            box: list = []  # what the future is to the front end: it ends up holding the request
            xs.append(weakref.ref(x))
            sched.submit("m", ("s", i), True, True, x, on_done=box.append)
            del x, box
        assert sched.drain(30)
        # drain returns once nothing is pending, a moment before the scheduler thread has
        # called on_done and let the batch go: wait for that (a slow machine's scheduling)
        deadline = time.monotonic() + 10
        while any(ref() is not None for ref in xs) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert all(ref() is None for ref in xs), "a finished request's x is still alive"
    finally:
        gc.enable()
        sched.stop()


def _post(srv, path, body: bytes, headers=None):
    conn = http.client.HTTPConnection(srv["host"], srv["port"], timeout=30)
    conn.request("POST", path, body=body, headers=headers or {})
    r = conn.getresponse()
    r.read()
    conn.close()
    return r.status


def test_logs_stay_bounded_under_refusals_and_long_sequence_ids(tmp_path):
    """A client with no token wrote one log line per refusal (~0.3 MB/s from one client),
    and each eviction logged the whole sequence id (a 250-character id of emoji: 3 KB a line).
    Refusals are now logged 50 a second at most, the rest counted in the next line and every
    one in the metrics; ids are cut in logs and errors."""
    pytest.importorskip("uvicorn")
    pytest.importorskip("prometheus_client")
    from leanrnn.serve.core import REFUSALS_LOGGED

    with served(tmp_path, "m", leanrnn.GRU(3, 4, seed=0), "--token", "sekret",
                "--idle-timeout", "0.3") as srv:  # fmt: skip
        body = json.dumps({"inputs": [{"name": "x", "shape": [1, 3], "datatype": "FP32",
                                       "data": [0.0, 0.0, 0.0]}]}).encode()  # fmt: skip
        n, t0 = 300, time.monotonic()
        assert all(_post(srv, "/v2/models/m/infer", body) == 401 for _ in range(n))
        seconds = time.monotonic() - t0
        long_id = "\U0001f600" * 250
        ok = {"Authorization": "Bearer sekret"}
        started = json.dumps({"inputs": json.loads(body)["inputs"], "parameters": {
            "sequence_id": long_id, "sequence_start": True}}).encode()  # fmt: skip
        assert _post(srv, "/v2/models/m/infer", started, ok) == 200
        time.sleep(1.5)  # evicted after 0.3 s idle
        conn = http.client.HTTPConnection(srv["host"], srv["port"], timeout=30)
        conn.request("GET", "/metrics", headers=ok)
        metrics = conn.getresponse().read().decode()
        conn.close()
    events = [json.loads(s) for s in srv["logs"] if s.startswith("{")]
    refused = [e for e in events if e["event"] == "refused"]
    assert 1 <= len(refused) <= REFUSALS_LOGGED * (int(seconds) + 2)
    assert len(refused) + sum(e.get("suppressed", 0) for e in refused) <= n
    counted = sum(float(ln.split()[-1]) for ln in metrics.splitlines()
                  if ln.startswith("leanrnn_serve_errors_total{"))  # fmt: skip
    assert counted >= n
    evicted = [s for s in srv["logs"] if '"evict"' in s]
    assert len(evicted) == 1 and len(evicted[0]) < 1000, evicted


def test_a_released_answer_lets_go_of_its_request():
    """gRPC keeps a call's done callbacks (release, from rpc.ModelInfer) in a cycle with the
    call's context: the release closure held the request, x and y with it, until a garbage
    collection (a server answering 3 MiB requests grew to 500 MiB). Once released, the
    request is gone though release itself is still held."""
    import asyncio

    from leanrnn.serve.core import Core
    from leanrnn.serve.protocol import Parsed

    lane = Lane("m", leanrnn.GRU(4, 8, seed=0), Pool(), threads=1, max_streams=8, max_batch=4,
                max_chunk=4, idle_timeout=60.0)  # fmt: skip
    lane.warm_up()
    sched = Scheduler({"m": lane}, max_wait=0.0)
    sched.start()
    core = Core(sched, token=None, max_request_bytes=1 << 20)

    async def one():
        x = np.random.default_rng(0).standard_normal((6, 4)).astype(np.float32)
        ref = weakref.ref(x)
        p = Parsed("m", "", ("s", 1), True, True, x, outputs=["y"])
        values, release = await core.infer_held(p, "grpc")
        del x, p, values
        release()
        return ref, release

    gc.collect()
    gc.disable()
    try:
        ref, release = asyncio.run(one())
        # (the scheduler thread lets go of its finished batch a moment after the answer)
        deadline = time.monotonic() + 10
        while ref() is not None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert ref() is None, "released, the request's x is still alive"
    finally:
        gc.enable()
        sched.stop()


def test_evicted_ids_are_remembered_in_bounded_bytes_and_still_named():
    """The ids of evicted sequences (remembered to tell their next request why) were kept
    whole: 250-character ids took ~720 bytes an entry, up to 47-103 MiB per model. A digest
    is kept now, and the error still names the id the request sent."""
    import tracemalloc

    from leanrnn.serve.errors import SequenceError

    lane = Lane("m", leanrnn.GRU(3, 4, seed=0), Pool(), threads=1, max_streams=4096,
                max_batch=64, max_chunk=4, idle_timeout=1.0)  # fmt: skip
    lane.warm_up()
    x = np.zeros((1, 3), np.float32)

    def sid(i: int) -> str:  # made afresh each time, as a server parses each request's id
        return f"{i:06d}" + "\U0001f600" * 244

    tracemalloc.start()
    before = tracemalloc.take_snapshot()  # what the 2000 sequences leave behind, from here
    for i in range(2000):
        lane.submit(("s", sid(i)), True, False, x, None, None, False, None, 0.0)
    while lane.ready:  # their first steps run: the sequences go idle
        picked = lane.take()
        lane.run(picked, t_cap=4, now=0.0)
        lane.finish(picked, 0.0)
    assert len(lane.reap(100.0)) == 2000  # (the list it returns, with the ids, goes here)
    grown = sum(s.size_diff for s in tracemalloc.take_snapshot().compare_to(before, "filename"))
    tracemalloc.stop()
    assert grown / 2000 < 500, f"{grown / 2000:.0f} bytes an evicted id"
    with pytest.raises(SequenceError, match=r"sequence '000007.*was evicted"):
        lane.submit(("s", sid(7)), False, False, x, None, None, False, None, 101.0)


def test_a_failed_engine_call_lets_go_of_its_batch():
    """A failed call's requests keep the error; its traceback held Lane.run's frame and so
    the batch, in a cycle: their x and y lived until a garbage collection."""
    lane = Lane("m", leanrnn.GRU(3, 4, seed=0), Pool(), threads=1, max_streams=8, max_batch=4,
                max_chunk=4, idle_timeout=60.0)  # fmt: skip
    lane.warm_up()
    real = lane.run

    def failing(picked, t_cap, now):
        heads = [q.queue[0] for q in picked]  # the batch's requests, as Lane.run's frame holds
        assert heads is not None
        raise RuntimeError("boom")

    lane.run = failing
    sched = Scheduler({"m": lane}, max_wait=0.0)
    sched.start()
    log = logging.getLogger("leanrnn.serve")
    log.disabled = True  # (pytest's log capture keeps each record's traceback: the batch too)
    gc.collect()
    gc.disable()
    try:
        x = np.ones((3, 3), np.float32)
        ref = weakref.ref(x)
        errors = []
        sched.submit("m", ("s", 1), True, True, x, on_done=lambda r: errors.append(r.error))
        del x
        assert sched.drain(30)
        deadline = time.monotonic() + 10
        while (ref() is not None or not errors) and time.monotonic() < deadline:
            time.sleep(0.01)
        assert isinstance(errors[0], RuntimeError)
        assert ref() is None, "the failed request's x is still alive"
    finally:
        gc.enable()
        log.disabled = False
        lane.run = real
        sched.stop()
