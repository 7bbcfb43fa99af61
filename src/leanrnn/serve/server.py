"""The server process: models loaded into one pool, the scheduler thread, the HTTP (uvicorn) and
gRPC (grpc.aio) front ends on one asyncio loop, JSON-lines logs, and graceful shutdown."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import signal
import socket
import sys
import time
from dataclasses import dataclass, field

from ..config import serve_log_level
from ..engine.session import Pool
from ..errors import LeanRNNError
from .core import Core, hostport
from .metrics import Metrics
from .scheduler import Lane, Scheduler, stack_of

_log = logging.getLogger("leanrnn.serve")


def default_concurrency(max_streams: int, models: int) -> int:
    """Requests in flight per transport when not told: room for every stream the models may
    hold to have a request in flight and another waiting (a client per stream is common),
    and never fewer than 4096."""
    return max(4096, 2 * max_streams * max(1, models))


@dataclass
class ServeConfig:
    models: dict[str, str] = field(default_factory=dict)  # name -> path
    host: str = "127.0.0.1"
    http_port: int = 8000
    grpc_port: int | None = 8001  # None: no gRPC
    threads: int | None = None
    max_batch: int | None = None  # None: measured at start-up (leanrnn.tuning.tune)
    max_chunk: int = 16
    max_wait: float = 0.002
    max_call: float = 0.01
    max_streams: int = 1024
    idle_timeout: float = 60.0
    max_request_bytes: int = 64 << 20
    max_queued_bytes: int = 1 << 30
    max_concurrency: int | None = None  # None: default_concurrency(max_streams, models)
    token: str | None = None
    grace: float = 30.0
    read_timeout: float = 30.0  # seconds to send a request's headers, or the next piece of a body


class _JSONLines(logging.Formatter):
    """One JSON object per line: ts, level, event, and the record's ``fields``."""

    def format(self, record: logging.LogRecord) -> str:
        d = {"ts": round(record.created, 3), "level": record.levelname.lower(),
             "event": record.getMessage()}  # fmt: skip
        d.update(getattr(record, "fields", {}))
        if record.exc_info:
            d["traceback"] = self.formatException(record.exc_info)
        return json.dumps(d, default=str)


class _Limited(logging.Filter):
    """At most ``rate`` records a second through; the rest are counted, and the next record
    let through says how many went (``suppressed``). For the transports' own loggers, which
    anyone who can connect makes write: 1,000 garbage connections printed 1,000 plain-text
    "Invalid HTTP request received." lines in 0.3 s."""

    def __init__(self, rate: int = 5) -> None:
        super().__init__()
        self.rate, self.second, self.count, self.suppressed = rate, 0, 0, 0

    def filter(self, record: logging.LogRecord) -> bool:
        second = int(record.created)
        if second != self.second:
            self.second, self.count = second, 0
        self.count += 1
        if self.count > self.rate:
            self.suppressed += 1
            return False
        fields = {"logger": record.name}
        if self.suppressed:
            fields["suppressed"], self.suppressed = self.suppressed, 0
        record.fields = {**getattr(record, "fields", {}), **fields}
        return True


# Loggers of the libraries under the server (uvicorn's connection and ASGI errors, asyncio's
# unretrieved exceptions, gRPC's): one JSON line each too, not plain text beside the log. They
# are the process's: a program that runs the server in process has them taken over as well.
_TRANSPORT_LOGGERS = ("uvicorn", "asyncio", "grpc")


def _setup_logging(level: str = "INFO") -> None:
    h = logging.StreamHandler(sys.stderr)
    h.setFormatter(_JSONLines())
    _log.handlers[:] = [h]
    _log.setLevel(level)
    _log.propagate = False
    limited = logging.StreamHandler(sys.stderr)
    limited.setFormatter(_JSONLines())
    limited.addFilter(_Limited())
    for name in _TRANSPORT_LOGGERS:
        lg = logging.getLogger(name)
        lg.handlers[:] = [limited]
        lg.propagate = False
        if lg.level == logging.NOTSET:
            lg.setLevel(logging.WARNING)


def tuned_batch(name: str, model, config: ServeConfig) -> int:
    """The most rows per call for ``model``: the largest batch whose one-step engine call takes
    at most ``config.max_call`` on this machine (``leanrnn tune``; a second or two at start-up),
    at most ``max_streams``. Only the batch is taken: the scheduler already sizes each call's
    steps to ``max_call`` from the running step time, at whatever batch the load brings."""
    from ..engine.session import Session
    from ..tuning import MAX_TUNE_BATCH, tune

    session = getattr(model, "session", None)
    if not isinstance(session, Session) or not session.chunkable:
        return 1  # Lane refuses it with the reason
    m = tune(session, latency=config.max_call, max_chunk=1, threads=config.threads,
             max_batch=min(MAX_TUNE_BATCH, config.max_streams))  # fmt: skip
    best = next(p for p in m.points if p.batch == m.batch)  # the search measured it
    _log.info("tuned", extra={"fields": {"model": name, "max_batch": m.batch,
                                          "call_ms": round(best.seconds * 1e3, 3),
                                          "target_ms": config.max_call * 1e3}})  # fmt: skip
    return m.batch


def build(config: ServeConfig, loaded: dict | None = None,
          make_lane=Lane) -> tuple[Core, Scheduler, Metrics]:  # fmt: skip
    """Load the models (or take ``loaded``: name -> model), make their lanes on one pool and
    warm them up; the scheduler is not started yet. ``make_lane``: Lane, or a subclass that
    runs its calls another way (benchmarks/serve_bench.py's onnxruntime-per-stream baseline)."""
    from ..loading import load

    pool = Pool()
    lanes = {}
    models = loaded or {name: load(path) for name, path in config.models.items()}
    committed = 0  # the lanes' state slots and call buffers, all checked against the machine
    for name, model in models.items():
        model = stack_of(name, model)  # (once: a graph's stack of several nodes is packed anew)
        max_batch = config.max_batch or tuned_batch(name, model, config)
        lane = make_lane(name, model, pool, threads=config.threads,
                         max_streams=config.max_streams, max_batch=max_batch,
                         max_chunk=config.max_chunk, idle_timeout=config.idle_timeout,
                         committed=committed)  # fmt: skip
        committed += lane.fixed_bytes
        lane.warm_up()
        lanes[name] = lane
    metrics = Metrics(tuple(lanes))
    scheduler = Scheduler(lanes, max_wait=config.max_wait, max_call=config.max_call,
                          metrics=metrics, max_queued_bytes=config.max_queued_bytes)  # fmt: skip
    # --max-concurrency is counted by the core (its refusals answered and in the metrics)
    concurrency = config.max_concurrency or default_concurrency(config.max_streams,
                                                                len(config.models))  # fmt: skip
    core = Core(scheduler, token=config.token, max_request_bytes=config.max_request_bytes,
                metrics=metrics, read_timeout=config.read_timeout,
                max_in_flight=concurrency)  # fmt: skip
    return core, scheduler, metrics


def check_addresses(config: ServeConfig) -> None:
    """Before anything binds or loads: the host is an address of this machine (a bad one was
    blamed on the port) and HTTP and gRPC are not given one port (HTTP bound it, the models
    loaded, and only then did gRPC fail)."""
    if "stats" in config.models:  # GET /v2/models/stats is every model's statistics
        raise LeanRNNError(
            "[serve] a model named 'stats': its metadata URL /v2/models/stats is the statistics "
            "endpoint of the protocol; name it otherwise (NAME=PATH)"
        )
    grpc_port = config.grpc_port
    if grpc_port is not None and grpc_port == config.http_port != 0:
        raise LeanRNNError(
            f"[serve] --http-port and --grpc-port are both {grpc_port}; expected two different "
            "ports: pick another for one of them (0: any free port), or pass --no-grpc"
        )
    host = config.host
    if host.startswith("["):
        raise LeanRNNError(
            f"[serve] --host {host!r}: expected an address without brackets, e.g. --host ::1 "
            "(the brackets belong in URLs only)"
        )
    hint = ("expected an IP address or name of this machine: 127.0.0.1 (this machine only), "
            "0.0.0.0 (every interface) or one of its own addresses; fix --host")  # fmt: skip
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(
            host, 0, _family(host), socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )[0]
    except (socket.gaierror, UnicodeError) as e:
        why = getattr(e, "strerror", None) or str(e)
        raise LeanRNNError(f"[serve] --host {host!r} is not an address ({why}); {hint}") from None
    with socket.socket(family, kind, proto) as probe:  # port 0: binds no port anyone asked for
        try:
            probe.bind(addr)
        except OSError as e:
            raise LeanRNNError(
                f"[serve] --host {host!r} cannot be listened on ({e.strerror}): it is not an "
                f"address of this machine; {hint}"
            ) from None


# Bytes of answers the kernel holds per HTTP connection (Linux doubles it): enough for ~5 ms
# of 1 Gbit/s, so throughput to a near client is not cut, and bounded for one that never reads.
SEND_BUFFER = 256 << 10


def _family(host: str) -> socket.AddressFamily:
    return socket.AF_INET6 if ":" in host else socket.AF_INET


def _listen(host: str, port: int) -> socket.socket:
    family = _family(host)
    # proto=IPPROTO_TCP: asyncio turns Nagle off only on sockets that say they are TCP; with
    # proto 0 every response (headers, then body) waits ~40 ms for the client's delayed ACK.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    # Accepted sockets inherit it: the kernel otherwise grows a connection's send buffer to
    # tcp_wmem's maximum (4 MiB here) for a client that does not read, memory no limit of ours
    # saw (and which a container's memory cgroup is charged for); the rest of an answer waits in
    # the process, counted against --max-queued-bytes (http._Answer)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER)
    sock.bind((host, port))
    sock.listen(2048)
    sock.setblocking(False)
    return sock


async def serve_async(config: ServeConfig, loaded=None, ready_line=print,
                      make_lane=Lane) -> None:  # fmt: skip
    """Serve until SIGTERM/SIGINT. ``loaded``: {name: model} already loaded, or a callable
    returning it, called once the HTTP port is bound (a taken port fails before a long load);
    None: the files of config.models, loaded plainly."""
    import uvicorn  # (here: not installed fails before a long load and tuning)

    from .http import make_app  # (starlette, likewise)

    check_addresses(config)
    _setup_logging(serve_log_level())
    t0 = time.monotonic()
    try:  # the port first: a taken one should fail before the models load
        sock = _listen(config.host, config.http_port)
    except OSError as e:
        raise OSError(
            f"[serve] cannot listen for HTTP on {hostport(config.host, config.http_port)}: "
            f"{e.strerror}; pick another --http-port"
        ) from None
    http_port = sock.getsockname()[1]
    try:  # (a failure or Ctrl-C while loading, tuning or starting gRPC closes the port)
        if callable(loaded):
            loaded = loaded()
        core, scheduler, metrics = build(config, loaded, make_lane)
        # Each connection or call in flight holds buffers of its own (its socket's, a request
        # being read) beyond what --max-queued-bytes counts (a request until its answer has
        # left): the core bounds requests (build); the transports' own limits, above that,
        # bound the connections and calls that have not reached it yet (idle connections,
        # which --read-timeout closes)
        backstop = max(2 * core.max_in_flight, core.max_in_flight + 64)
        grpc_server, grpc_port, health = None, None, None
        if config.grpc_port is not None:
            from . import rpc

            grpc_server, grpc_port, health = await rpc.start(
                core, config.host, config.grpc_port, config.max_request_bytes, backstop
            )
    except BaseException:
        sock.close()
        raise
    try:  # (the finally also when interrupted before the signal handlers are in: Ctrl-C
        # while starting)
        loop = asyncio.get_running_loop()
        scheduler.start()

        class _Server(uvicorn.Server):
            @contextlib.contextmanager
            def capture_signals(self):  # ours below: drain first, then stop the transports
                yield

        ucfg = uvicorn.Config(make_app(core, metrics), log_config=None, access_log=False,
                              lifespan="off", log_level="warning",
                              limit_concurrency=backstop,
                              http=_timed(config.read_timeout),
                              timeout_graceful_shutdown=max(1, int(config.grace)))  # fmt: skip
        http_server = _Server(ucfg)
        stopping = asyncio.Event()

        deadline = [0.0]  # when the grace period ends (set by the first signal)

        async def shutdown(signame: str) -> None:
            if stopping.is_set():
                # a second signal ends the grace period now (it was ignored, and only SIGKILL
                # stopped a drain of --grace 30): what has not run fails as UNAVAILABLE
                if deadline[0] > loop.time():
                    deadline[0] = loop.time()
                    _log.info("shutdown now", extra={"fields": {"signal": signame}})
                    await loop.run_in_executor(None, scheduler.stop)
                return
            stopping.set()
            # one grace period in all: the drain, then the transports get what is left of it
            # (each given a whole one, exit came at twice --grace)
            deadline[0] = loop.time() + config.grace
            _log.info(
                "shutdown", extra={"fields": {"signal": signame, "pending": scheduler.pending()}}
            )
            core.draining = True
            finished = False
            try:  # (whatever fails here, the server still exits: half-stopped, it answered 503s)
                core.cut_bodies()
                if health is not None:
                    await health.shutdown()
                finished = await loop.run_in_executor(None, scheduler.drain, config.grace)
                # what did not run within the grace period fails now as UNAVAILABLE (503): left
                # pending, uvicorn cancelled its handlers a second grace period later (plain-text
                # 500s)
                await loop.run_in_executor(None, scheduler.stop)
                await asyncio.sleep(0.05)  # let the last responses leave
                if grpc_server is not None:
                    await grpc_server.stop(grace=min(1.0, max(0.1, deadline[0] - loop.time())))
            finally:
                http_server.config.timeout_graceful_shutdown = max(0.1, deadline[0] - loop.time())
                http_server.should_exit = True
                _log.info("drained", extra={"fields": {"all_finished": finished}})

        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, lambda s=sig: asyncio.ensure_future(shutdown(s.name)))
        serving = asyncio.ensure_future(http_server.serve(sockets=[sock]))
        while not http_server.started and not serving.done():
            await asyncio.sleep(0.01)
        core.ready = True
        if health is not None and not stopping.is_set():
            await health.set(True)
        fields = {
            "http": hostport(config.host, http_port),
            "grpc": hostport(config.host, grpc_port) if grpc_port else None,
            "models": sorted(core.infos),
            "startup_s": round(time.monotonic() - t0, 2),
        }
        _log.info("ready", extra={"fields": fields})
        ready_line(f"leanrnn serve: ready http={fields['http']}"
                   + (f" grpc={fields['grpc']}" if grpc_port else ""))  # fmt: skip
        await serving
    finally:
        scheduler.stop()
        sock.close()  # (uvicorn's, once it serves; closing twice is nothing)
        if grpc_server is not None:
            await grpc_server.stop(grace=None)


def _timed(timeout: float):
    """The HTTP protocol uvicorn picks by default (httptools if installed, else h11), its
    connections made to send a whole request head within ``timeout`` seconds of connecting,
    or of the previous answer: uvicorn times only
    the wait after an answer (keep-alive), and that timer stops at the first byte, so 4,300
    connections that sent nothing (or a byte now and then) held --max-concurrency and every
    other client got 503s for as long as they stayed."""

    from uvicorn.protocols.http.auto import AutoHTTPProtocol

    class Timed(AutoHTTPProtocol):
        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._head_timer = None
            self._arm()

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(timeout, self._no_head)

        def _no_head(self) -> None:
            self._head_timer = None
            if self.cycle is None or self.cycle.response_complete:  # no request under way
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's head has ``timeout`` seconds too

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            super().connection_lost(exc)

    return Timed


def serve(config: ServeConfig) -> int:
    """Run the server until SIGTERM/SIGINT; returns the exit status."""
    asyncio.run(serve_async(config, ready_line=lambda s: print(s, flush=True)))
    return 0
