"""What the HTTP and gRPC front ends share: the models, authorization, and one ``infer_held`` that
hands a checked request to the scheduler and awaits its outputs on the event loop; the request
keeps counting against --max-queued-bytes until its front end says the answer has left."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable

import numpy as np

from .errors import (
    Busy,
    Internal,
    NotFound,
    QueueFull,
    ServeError,
    TooLarge,
    Unauthenticated,
    Unavailable,
)
from .protocol import ModelInfo, Parsed, check_version, clip
from .scheduler import Request, Scheduler

_log = logging.getLogger("leanrnn.serve")

# Requests and answers up to this many bytes are parsed and encoded on the event loop (a thread
# hop costs more than they do); larger ones in a worker thread, so that one large message does
# not hold up every other stream (HTTP and gRPC) for as long as its conversion takes.
INLINE = 256 << 10
# How often a gRPC stream's request looks for room in a full queue (Core.with_room): first
# after ROOM_POLL_S (the engine drains it in calls of ~max_call seconds), then at doubling
# intervals up to ROOM_POLL_MAX_S.
ROOM_POLL_S = 0.005
ROOM_POLL_MAX_S = 0.05


async def off_loop(nbytes: int, fn, *args):
    """``fn(*args)``: on the event loop for a message of at most INLINE bytes, else in a worker
    thread."""
    return fn(*args) if nbytes <= INLINE else await asyncio.to_thread(fn, *args)


# Refusals logged per second, at most (Core.error); the rest are counted in the next line
REFUSALS_LOGGED = 50


def nbytes(values: dict[str, np.ndarray]) -> int:
    """The bytes of an answer's arrays (what decides where it is encoded: INLINE)."""
    return sum(a.nbytes for a in values.values())


def hostport(host: str, port: int) -> str:
    """'HOST:PORT', an IPv6 address in brackets ('[::1]:8001'): gRPC read '::1:0' as the
    address ::0.1.0.0 on its default port, and clients need the brackets too."""
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _resolve(fut: asyncio.Future, r: Request) -> None:
    if not fut.done():  # the client may have gone (the task was cancelled)
        fut.set_result(r)


class Core:
    def __init__(self, scheduler: Scheduler, *, token: str | None, max_request_bytes: int,
                 metrics=None, read_timeout: float = 30.0,
                 max_in_flight: int | None = None) -> None:  # fmt: skip
        self.scheduler = scheduler
        # --max-concurrency, per transport, counted here (enter/leave, on the event loop) so
        # that its refusals are answered and counted like every other: the transports' own
        # limits (uvicorn's, gRPC's) refused before any of this code ran, and the metrics
        # never saw them; they stay, above this, as a backstop on connections (server.py)
        self.max_in_flight = max_in_flight
        self._in_flight = {"http": 0, "grpc": 0}
        self.read_timeout = read_timeout  # seconds a client may stall sending a request
        self.infos = {name: ModelInfo.of(lane) for name, lane in scheduler.lanes.items()}
        self.token = token
        self.max_request_bytes = max_request_bytes
        self.metrics = metrics
        # refusals logged per second at most (the metrics count every one): a client needs no
        # token to be refused, and one refusal a line let it write the log at its request rate
        self._refusal_log = [0.0, 0, 0]  # [this second began, lines in it, suppressed]
        self.ready = False
        self.draining = False
        # the deadlines (asyncio.Timeout) of HTTP bodies being read, which a shutdown cuts
        self.bodies: set = set()
        # Triton's statistics extension, per model: successes [count, total ns, queue ns,
        # compute ns], failures [count, ns], the last inference's time (ms since the epoch)
        self._stats = {name: {"ok": [0, 0, 0, 0], "fail": [0, 0], "last": 0,
                              "compute_input": [0, 0], "compute_output": [0, 0]}
                       for name in self.infos}  # fmt: skip

    @property
    def idle_timeout(self) -> float:
        """Seconds a sequence may go without a request before it is evicted (--idle-timeout)."""
        return max(lane.idle_timeout for lane in self.scheduler.lanes.values())

    def cut_bodies(self) -> None:
        """On the event loop, once ``draining``: the bodies still arriving stop being read, and
        their requests are answered 503 (left to arrive, they were cut by uvicorn's own
        shutdown and answered a plain-text 500)."""
        now = asyncio.get_running_loop().time()
        for deadline in list(self.bodies):
            if not deadline.expired():  # (one expiring now refuses a reschedule: it is done)
                deadline.reschedule(now)

    def info(self, model: str, version: str | None = None) -> ModelInfo:
        info = self.infos.get(model)
        if info is None:
            raise NotFound(
                f"[infer] unknown model {clip(model)}; this server has {sorted(self.infos)}"
            )
        check_version(model, version)
        return info

    def authorize(self, header: str | None) -> None:
        """Bearer token check (constant time); no token configured: everyone may call. The
        scheme is case-insensitive (RFC 7235): 'bearer' and 'BEARER' are 'Bearer'."""
        if self.token is None:
            return
        scheme, _, given = (header or "").strip().partition(" ")
        ok = scheme.lower() == "bearer"
        # compared even when the scheme is wrong: the time taken says nothing about the token
        if not hmac.compare_digest(given.strip().encode(), self.token.encode()) or not ok:
            raise Unauthenticated(
                "[auth] missing or wrong bearer token; send the header "
                "'Authorization: Bearer <token>' given to leanrnn serve --token"
            )

    def enter(self, protocol: str) -> None:
        """A request (or a gRPC stream) starts on ``protocol``; Busy past --max-concurrency.
        Pair with ``leave``."""
        n = self._in_flight[protocol]
        if self.max_in_flight is not None and n >= self.max_in_flight:
            raise Busy(
                f"[{protocol}] {n} requests in flight on {protocol}, the server's limit "
                "(--max-concurrency); retry later"
            )
        self._in_flight[protocol] = n + 1

    def leave(self, protocol: str) -> None:
        self._in_flight[protocol] -= 1

    def reserve(self, n: int, mine: int = 0) -> None:
        """``n`` more bytes of a body being read (holding ``mine``) count against
        --max-queued-bytes (Scheduler.reserve)."""
        self.scheduler.reserve(n, mine)

    def unreserve(self, n: int) -> None:
        self.scheduler.unreserve(n)

    async def with_room(self, attempt: Callable, model: str | None = None):
        """``attempt()`` (a submit, or a reserve of a message's bytes) once --max-queued-bytes
        has room for it: tried again while it raises QueueFull, first after ROOM_POLL_S and
        then at doubling intervals, for up to ``model``'s --idle-timeout (None: any model's,
        the longest), arriving for ``model`` meanwhile so the waiting request's sequence is
        not evicted as idle. QueueFull past that, or while the server drains. A gRPC
        stream's requests wait so: their stream's next ones are already sent."""
        t0 = time.monotonic()
        patience = self.idle_timeout if model is None else self.scheduler.lanes[model].idle_timeout
        pause, waiting = ROOM_POLL_S, None
        try:
            while True:
                try:
                    return attempt()
                except QueueFull:
                    if self.draining or time.monotonic() - t0 >= patience:
                        raise
                    if waiting is None:
                        waiting = self.scheduler.arriving(model)
                    await asyncio.sleep(pause)
                    pause = min(2 * pause, ROOM_POLL_MAX_S)  # (many waiters: fewer looks)
        finally:
            self.scheduler.arrived(waiting)

    def error(self, e: ServeError, protocol: str, model: str | None = None) -> None:
        """Count and log refusal ``e``; ``model``: the model the request named, if known
        (labelled only if served: a client's made-up names must not grow the metrics)."""
        if self.metrics is not None:
            self.metrics.error(e.kind, protocol, model if model in self.infos else "")
        now, window = time.monotonic(), self._refusal_log
        if now - window[0] >= 1.0:
            window[0], window[1] = now, 0
        if window[1] >= REFUSALS_LOGGED:
            window[2] += 1
            return
        window[1] += 1
        fields = {"protocol": protocol, "kind": e.kind, "error": str(e)[:1024]}
        if model in self.infos:  # (the metric's label, in the log line too)
            fields["model"] = model
        if window[2]:  # how many went unlogged before this one
            fields["suppressed"], window[2] = window[2], 0
        _log.info("refused", extra={"fields": fields})

    def stats(self, model: str) -> dict:
        """Triton's statistics for ``model`` (the JSON form of ModelStatistics)."""
        st = self._stats[model]
        count, ns, queue_ns, compute_ns = st["ok"]
        lane = self.scheduler.lanes[model]
        # compute_infer: from a request's first step in a batched engine call to its last (a
        # chunk's steps run one batched call each, among other streams' steps); compute_input
        # and compute_output: the front ends' parsing of a request and encoding of its answer.
        # execution_count: the engine calls that completed requests, so that, as in Triton,
        # inference_count / execution_count is the requests an execution answered (every
        # engine call counted, a 4000-step request read 250 executions for 1 inference, and
        # perf_analyzer's batch size 0.004)
        ci, co = st["compute_input"], st["compute_output"]
        return {
            "name": model,
            "version": "1",
            "last_inference": st["last"],
            "inference_count": count,
            "execution_count": lane.completing,
            "inference_stats": {
                "success": {"count": count, "ns": ns},
                "fail": {"count": st["fail"][0], "ns": st["fail"][1]},
                "queue": {"count": count, "ns": queue_ns},
                "compute_infer": {"count": count, "ns": compute_ns},
                "compute_input": {"count": ci[0], "ns": ci[1]},
                "compute_output": {"count": co[0], "ns": co[1]},
            },
        }

    def io(self, model: str, what: str, seconds: float) -> None:
        """Count one request in Triton's statistics ``what`` of ``model``, taking ``seconds``:
        its parsing ("compute_input"), its answer's encoding ("compute_output") or, from
        infer_held, a failure ("fail")."""
        c = self._stats[model][what]
        c[0] += 1
        c[1] += int(seconds * 1e9)

    def _admissible(self, p: Parsed, json_bytes: int) -> None:
        """Refuse ``p`` before it is queued: the server draining, or its answer past
        --max-request-bytes."""
        if self.draining:
            raise Unavailable("[infer] the server is shutting down; send new work elsewhere")
        info = self.infos[p.model]
        y_bytes = p.x.shape[0] * info.outputs["y"].shape[1] * info.dtype.itemsize
        if y_bytes > self.max_request_bytes:  # the limit holds for what comes back too
            raise TooLarge(
                f"[infer] y for {p.x.shape[0]} steps would be {y_bytes} bytes; the limit is "
                f"{self.max_request_bytes} (--max-request-bytes); send fewer steps per request"
            )
        if json_bytes > self.max_request_bytes:
            raise TooLarge(
                f"[infer] the outputs for {p.x.shape[0]} steps as JSON could take up to "
                f"{json_bytes} bytes; the limit is {self.max_request_bytes} (--max-request-bytes):"
                " request them as binary data (parameters binary_data_output=true, or "
                "tritonclient's InferRequestedOutput(name, binary_data=True)), or send fewer "
                "steps per request"
            )

    async def infer_held(
        self, p: Parsed, protocol: str, json_bytes: int = 0, arrival: int | None = None,
        submitted: asyncio.Future | None = None,
    ) -> tuple[dict[str, np.ndarray], Callable[[], None]]:  # fmt: skip
        """Run ``p`` through the scheduler; (the requested outputs by name, release). The
        request's bytes (x, y, and ``json_bytes``: at most what its outputs take as JSON)
        count against --max-queued-bytes until ``release()`` — call it once the answer has
        left (or failed to), so answers a client does not read stay counted. ``arrival``: the
        scheduler's token of this request while it arrived (Scheduler.arriving), let go of
        once it is submitted or refused. ``submitted``: a gRPC stream's request, resolved
        once it is queued or refused; such a request of a sequence that finds the queue full
        (QueueFull) waits for room rather than being refused, its stream unread meanwhile
        (the stream's later requests of the sequence, already sent, ran across the gap)."""
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        t0 = time.monotonic()
        scheduled = False  # refused by the scheduler (unknown or evicted sequence, full, ...)
        try:
            self._admissible(p, json_bytes)
            want_state = any(name != "y" for name in p.outputs)
            scheduled = True

            def submit():
                return self.scheduler.submit(
                    p.model, p.key, p.start, p.end, p.x, p.h0, p.c0, want_state,
                    lambda r: loop.call_soon_threadsafe(_resolve, fut, r), json_bytes, True,
                )  # fmt: skip

            if submitted is None or p.key[0] == "":
                sent = submit()
            else:  # a stream's request of a sequence: it waits for room (with_room)
                sent = await self.with_room(submit, p.model)
        except ServeError as e:
            if scheduled:  # a failure in the statistics, as the engine's are
                self.io(p.model, "fail", time.monotonic() - t0)
            if submitted is not None:  # a stream's later requests are already sent: they must
                # not run across the gap (nothing if the sequence is not live)
                self.scheduler.break_off(p.model, p.key, e)
            raise
        finally:
            self.scheduler.arrived(arrival)  # queued (or refused): no longer arriving
            if submitted is not None and not submitted.done():
                submitted.set_result(None)

        def release() -> None:
            # once, and the request let go of: gRPC keeps a call's done callbacks (this, from
            # rpc) in a cycle with its context, which held x and y until a garbage collection
            nonlocal sent
            if sent is not None:
                self.scheduler.release(sent)
                sent = None

        try:
            r: Request = await fut
        except BaseException:  # the client went (cancelled): its bytes go when the engine is done
            release()
            raise
        if r.error is not None:
            release()
            self.io(p.model, "fail", time.monotonic() - t0)
            if isinstance(r.error, ServeError):  # refused, not failed: the server stopping
                raise type(r.error)(str(r.error))  # (one instance is every request's)
            raise Internal(f"[infer] the engine failed on this request: {r.error}")
        try:  # (released here if the bookkeeping fails: the caller never gets the release)
            now = time.monotonic()
            seconds, queued = now - t0, (r.t_first or t0) - r.t_submit
            st = self._stats[p.model]
            ok = st["ok"]
            ok[0] += 1
            ok[1] += int(seconds * 1e9)
            ok[2] += int(queued * 1e9)
            done = r.t_done or now
            ok[3] += int((done - (r.t_first or done)) * 1e9)
            st["last"] = int(time.time() * 1000)
            if self.metrics is not None:
                self.metrics.request(p.model, protocol, seconds, queued)
            values = {"y": r.y, "h_n": r.h_out, "c_n": r.c_out}
            return {name: values[name] for name in p.outputs}, release
        except BaseException:
            release()
            raise
