"""Defects a review of leanrnn.serve found, each test failing before its fix: a long gRPC
stream kept every answered request's task; a sequence_start on an id whose sequence_end was
still queued was refused (Triton queues it as a new sequence)."""

from __future__ import annotations

import asyncio
import gc
import threading
import tracemalloc
from types import SimpleNamespace

import numpy as np
import pytest

import leanrnn
from leanrnn.engine.session import Pool
from leanrnn.serve.errors import Exhausted, Unavailable
from leanrnn.serve.scheduler import Lane, Scheduler
from tolerances import ATOL_SAME_ARITHMETIC


def test_a_start_right_after_a_queued_end_on_the_same_id_is_a_new_sequence():
    """Oracle: each sequence's offline output on its own inputs. The first sequence's end is
    still queued (the engine thread starts only after both submits) when the second starts."""
    model = leanrnn.GRU(3, 5, seed=1)
    lane = Lane("g", model, Pool(), threads=1, max_streams=4, max_batch=4, max_chunk=4,
                idle_timeout=60.0)  # fmt: skip
    lane.warm_up()
    sched = Scheduler({"g": lane}, max_wait=0.0)
    rng = np.random.default_rng(0)
    xa, xb = rng.standard_normal((40, 3), np.float32), rng.standard_normal((7, 3), np.float32)
    ra = sched.submit("g", 7, True, True, xa, on_done=None)
    rb = sched.submit("g", 7, True, False, xb, on_done=None)  # refused before the fix
    sched.start()
    rc = sched.submit("g", 7, False, True, xb, on_done=None)  # the new sequence goes on
    assert sched.drain(30)
    sched.stop()
    tol = ATOL_SAME_ARITHMETIC[np.dtype(np.float32)]
    np.testing.assert_allclose(ra.y, model(xa[:, None])[0][:, 0], rtol=0, atol=tol)
    want = model(np.concatenate([xb, xb])[:, None])[0][:, 0]
    np.testing.assert_allclose(np.concatenate([rb.y, rc.y]), want, rtol=0, atol=tol)
    assert not lane.seqs and len(lane.free) == 4  # both slots came back


def test_stop_after_the_grace_period_fails_what_has_not_run():
    """stop() (SIGTERM's grace ran out) must not keep running queued work: before the fix the
    engine thread went on through the whole request while the process shut down."""
    model = leanrnn.GRU(3, 4, seed=2)
    lane = Lane("g", model, Pool(), threads=1, max_streams=2, max_batch=2, max_chunk=4,
                idle_timeout=60.0)  # fmt: skip
    lane.warm_up()
    sched = Scheduler({"g": lane}, max_wait=0.0)
    finished = threading.Event()
    r = sched.submit("g", 1, True, True, np.zeros((400_000, 3), np.float32),
                     on_done=lambda r: finished.set())  # fmt: skip
    sched.start()
    sched.stop()
    assert finished.wait(30)
    assert isinstance(r.error, Unavailable), r.error
    assert "grace" in str(r.error)
    assert not lane.seqs and len(lane.free) == 2


def test_accepted_work_is_bounded_by_max_queued_bytes():
    """A client sending faster than the engine runs gets RESOURCE_EXHAUSTED once the accepted,
    unanswered requests hold the limit; the streams already accepted finish exactly."""
    model = leanrnn.GRU(3, 4, seed=3)
    lane = Lane("g", model, Pool(), threads=1, max_streams=8, max_batch=4, max_chunk=4,
                idle_timeout=60.0)  # fmt: skip
    lane.warm_up()
    x = np.ones((100, 3), np.float32)
    one = x.nbytes + 100 * 4 * 4  # x and its y [100, D*K]
    sched = Scheduler({"g": lane}, max_wait=0.0, max_queued_bytes=int(2.5 * one))
    ra = sched.submit("g", 1, True, True, x)
    rb = sched.submit("g", 2, True, True, x)
    with pytest.raises(Exhausted, match="max-queued-bytes"):
        sched.submit("g", 3, True, True, x)
    assert 3 not in lane.seqs  # refused before it took a slot
    sched.start()
    assert sched.drain(30)
    sched.stop()
    want = model(x[:, None])[0][:, 0]
    for r in (ra, rb):
        np.testing.assert_allclose(r.y, want, rtol=0, atol=ATOL_SAME_ARITHMETIC[x.dtype])
    assert sched.queued_bytes == 0  # every answered request gave its bytes back


grpc = pytest.importorskip("grpc")
pytest.importorskip("tritonclient.grpc")

from helpers import GrpcContextStub, ServeCoreStub  # noqa: E402
from leanrnn.serve import rpc  # noqa: E402


async def _held_after(servicer, n: int) -> int:
    """Send ``n`` requests on one stream; the traced bytes held when the last one is answered
    (the stream still open, so what it keeps per request is still there)."""
    base = tracemalloc.get_traced_memory()[0]

    async def requests():
        for _ in range(n):
            yield rpc.pb.ModelInferRequest(model_name="m").SerializeToString()

    answered = 0
    async for _ in servicer.ModelStreamInfer(requests(), GrpcContextStub()):
        answered += 1
        if answered == n:
            return tracemalloc.get_traced_memory()[0] - base
    raise AssertionError(f"{answered} of {n} requests answered")


def test_a_long_grpc_stream_does_not_grow(monkeypatch):
    info = SimpleNamespace(name="m", outputs={"y": SimpleNamespace(shape=[1, 1])},
                           dtype=np.float32)  # fmt: skip
    parsed = SimpleNamespace(x=np.zeros((1, 1), np.float32))
    monkeypatch.setattr(rpc, "parse", lambda core, req: (info, parsed))
    monkeypatch.setattr(rpc, "answer", lambda info, p, values, stream=False: b"")
    servicer = rpc.Servicer(ServeCoreStub())
    asyncio.run(_held_after(servicer, 500))  # warm-up: the loop's and modules' own allocations

    def grown(n):
        gc.collect()
        tracemalloc.start()
        try:
            return asyncio.run(_held_after(servicer, n))
        finally:
            tracemalloc.stop()

    small, large = grown(200), grown(4000)
    # 3,800 more answered requests: before the fix ~3 MB more held
    assert large - small < 256 * 1024, (small, large)
