"""KServe v2 over HTTP/REST (an ASGI app on Starlette): health, server and model metadata, model
config and statistics, the repository index, infer with the binary tensor data extension, and
Prometheus metrics at /metrics. Every error is ``{"error": "..."}`` with the status its kind says.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
import zlib

import numpy as np
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .core import INLINE, Core, nbytes, off_loop
from .errors import InvalidRequest, ServeError, Timeout, TooLarge, Unavailable
from .protocol import (
    EXTENSIONS,
    VERSION,
    assemble,
    check_input,
    check_listed,
    clip,
    flag,
    from_bytes,
    from_list,
    unsupported,
)

HEADER_LENGTH = "Inference-Header-Content-Length"
# The JSON part of a request becomes Python objects (~30 bytes a number): larger tensors come as
# binary data (the extension every Triton client has), so memory stays near the body's size.
MAX_JSON = 8 << 20
# The most bytes one number takes in a JSON answer, with its ", ": a finite double's repr is at
# most 24 characters ('-1.2345678901234567e-308'), '"-Infinity"' 11. A JSON answer is counted
# at this much per number against --max-request-bytes and --max-queued-bytes before it runs.
JSON_NUMBER = 26
# Numbers encoded per piece (~1 ms), off the event loop: json.dumps holds the GIL for a whole
# list, so a 100 MB answer in one call held up every other stream (HTTP and gRPC) for seconds.
JSON_PIECE = 1024
# Answer bodies go to the transport in pieces this large; each send waits until the transport
# has room (uvicorn's flow control), so an answer a client does not read stays with its request
# (counted) instead of being copied whole into the transport's buffer.
SEND_PIECE = 256 << 10
# Seconds an answer's piece may wait for a client that does not read (_sent).
SEND_TIMEOUT = 30.0
# A gzip body is inflated INFLATE_PIECE compressed bytes at a time, and may have at most
# MAX_MEMBERS members (concatenated gzip streams: RFC 1952; BGZF writes one per 64 KiB).
INFLATE_PIECE = 64 << 10
MAX_MEMBERS = 65536
# Compressed bodies larger than this are inflated in a worker thread: a few MB of gzip take
# tens of ms or more to inflate (up to --max-request-bytes), which on the event loop held up
# every other stream (HTTP and gRPC) meanwhile.
INFLATE_INLINE = 256 << 10
# A body must keep arriving at this average rate once --read-timeout has passed (Apache's
# mod_reqtimeout MinRate): a client that trickled a byte before each --read-timeout held a
# --max-concurrency slot for as long as it liked. 64 KiB/s lets the largest 64 MiB body take 17
# minutes, and holding a slot costs that much bandwidth.
MIN_BODY_RATE = 64 << 10
# JSON has no NaN or infinity (RFC 8259): they go as these strings (proto3's JSON mapping of
# floats), which tritonclient's as_numpy (numpy) reads back as nan and +-inf.
_NONFINITE = {"nan": '"NaN"', "inf": '"Infinity"', "-inf": '"-Infinity"'}


def _number(header: str | None) -> int | None:
    """A header's non-negative decimal integer; None when it is not one (ASCII digits only:
    str.isdigit() takes superscript digits, which int() refuses)."""
    if header is None or not header.isascii() or not header.isdigit():
        return None
    return int(header)


def _inflate(body: bytes, encoding: str, limit: int) -> bytes:
    """``body`` decompressed, every member of a gzip stream (RFC 1952 allows several), at
    most ``limit`` bytes; a stream cut short or with bytes after its end is refused. Fed in
    pieces, so the bytes after a member's end are never copied whole (quadratic in members)."""
    wbits = zlib.MAX_WBITS | (16 if encoding == "gzip" else 0)
    view, pos, parts, n = memoryview(body), 0, [], 0
    for _ in range(MAX_MEMBERS):
        d = zlib.decompressobj(wbits)
        while not d.eof and pos < len(view):
            piece = view[pos : pos + INFLATE_PIECE]
            pos += len(piece)
            try:
                part = d.decompress(piece, limit + 1 - n)
            except zlib.error as e:
                raise InvalidRequest(f"[infer] body is not valid {encoding} data: {e}") from None
            n += len(part)
            parts.append(part)
            if n > limit or d.unconsumed_tail:
                raise TooLarge(f"[infer] {encoding} body inflates past {limit} bytes")
        if not d.eof:
            raise InvalidRequest(
                f"[infer] {encoding} body is cut short ({len(body)} bytes sent, the stream does "
                "not end): send the whole compressed body"
            )
        pos -= len(d.unused_data)
        if pos >= len(view):
            return b"".join(parts)
        if encoding != "gzip":
            raise InvalidRequest(
                f"[infer] {len(view) - pos} bytes after the end of the deflate stream; send one "
                "stream"
            )
    raise InvalidRequest(f"[infer] gzip body of more than {MAX_MEMBERS} members; send fewer")


async def _body(request: Request, core: Core) -> tuple[bytes, int]:
    """(the request body, decompressed (gzip/deflate), refused past --max-request-bytes before
    it is all read or inflated; the bytes it reserved). Its bytes count against
    --max-queued-bytes from their arrival until the caller's ``core.unreserve(held)``, once the
    request is parsed (and submitted: it is counted from then on); a client that sends
    nothing for --read-timeout seconds mid-body, or sends it slower than MIN_BODY_RATE on
    average after that, is dropped (408); a SIGTERM stops the reading (503, as every other
    request refused then: Core.cut_bodies)."""
    limit = core.max_request_bytes
    declared = _number(request.headers.get("content-length"))
    if declared is not None and declared > limit:
        raise TooLarge(
            f"[infer] request body of {declared} bytes; the limit is {limit} "
            "(--max-request-bytes); send fewer steps per request"
        )
    parts, n = [], 0
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    deadline = None
    try:
        # one deadline, moved on at each piece (wait_for made a task per piece): --read-timeout
        # after the last piece, but no later than the minimum rate allows for what came
        async with asyncio.timeout(core.read_timeout) as deadline:
            core.bodies.add(deadline)
            if core.draining:  # began after the shutdown's cut: due at once as well
                deadline.reschedule(loop.time())
            async for chunk in request.stream():
                if n + len(chunk) > limit:
                    raise TooLarge(
                        f"[infer] request body over {limit} bytes (--max-request-bytes); send "
                        "fewer steps per request"
                    )
                core.reserve(len(chunk), n)
                n += len(chunk)
                parts.append(chunk)
                now = loop.time()
                if not core.draining:  # (cut: it stays due)
                    deadline.reschedule(min(now, t0 + n / MIN_BODY_RATE) + core.read_timeout)
        body = b"".join(parts)
        encoding = request.headers.get("content-encoding", "identity").lower()
        if encoding in ("gzip", "deflate"):
            if len(body) <= INFLATE_INLINE:
                body = _inflate(body, encoding, limit)
            else:
                body = await asyncio.to_thread(_inflate, body, encoding, limit)
        elif encoding != "identity":
            raise InvalidRequest(
                f"[infer] Content-Encoding {clip(encoding)}; expected gzip, deflate or none"
            )
    except BaseException as e:
        core.unreserve(n)
        if isinstance(e, TimeoutError) and core.draining:  # cut by the shutdown
            raise Unavailable(
                "[infer] the server is shutting down; this request's body was still arriving: "
                "send it elsewhere"
            ) from None
        if isinstance(e, TimeoutError):  # the deadline's
            seconds = loop.time() - t0
            raise Timeout(
                f"[infer] the client sent its body too slowly ({n} bytes in {seconds:.1f} s; "
                f"a request may pause at most {core.read_timeout:g} s (--read-timeout) and must "
                f"average {MIN_BODY_RATE // 1024} KiB/s after that); dropped"
            ) from None
        raise
    finally:
        core.bodies.discard(deadline)
    return body, n


def _parse(core: Core, info, body: bytes, header_length: str | None):
    """A KServe v2 JSON request (with binary tensors appended when ``header_length`` is set)."""
    if header_length is not None:
        split = _number(header_length)
        if split is None or split > len(body):
            raise InvalidRequest(
                f"[infer] {HEADER_LENGTH}={clip(header_length)} for a body of {len(body)} bytes; "
                "expected the length of the JSON part"
            )
        head, blob = body[:split], memoryview(body)[split:]
    else:
        head, blob = body, memoryview(b"")
    if len(head) > MAX_JSON:
        raise TooLarge(
            f"[infer] {len(head)} bytes of JSON; at most {MAX_JSON} (tensors this large go as "
            "binary data: tritonclient's set_data_from_numpy(..., binary_data=True))"
        )
    try:
        req = json.loads(head, parse_constant=_no_constant)
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise InvalidRequest(f"[infer] the request is not valid JSON: {e}") from None
    if not isinstance(req, dict) or not isinstance(req.get("inputs"), list):
        raise InvalidRequest(
            '[infer] the request must be a JSON object with "inputs": [{"name", "shape", '
            '"datatype", "data"}]'
        )
    params = req.get("parameters") or {}
    if not isinstance(params, dict):
        raise InvalidRequest('[infer] "parameters" must be a JSON object')
    check_listed(info, *(len(req[w]) if isinstance(req.get(w), list) else 0
                         for w in ("inputs", "outputs")))  # fmt: skip
    tensors, offset = {}, 0
    for t in req["inputs"]:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise InvalidRequest('[infer] each input must be an object with a "name"')
        name = t["name"]
        if name in tensors:
            raise InvalidRequest(f"[infer] input {clip(name)} appears twice")
        shape = check_input(info, name, t.get("datatype"), t.get("shape"))
        ip = _parameters(t, f"input {name!r}")
        unsupported(ip, f"input {name!r}")
        size = ip.get("binary_data_size")
        if size is not None and "data" in t:  # (one of the two was dropped without a word)
            raise InvalidRequest(
                f'[infer] input {name!r} has both "data" and binary_data_size; send its values '
                "one way: as JSON data or as binary data after the JSON"
            )
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise InvalidRequest(
                    f"[infer] input {name!r}: binary_data_size={clip(size)}; expected a byte count "
                    ">= 0: the length of this input's part of the binary data after the JSON"
                )
            if offset + size > len(blob):
                raise InvalidRequest(
                    f"[infer] input {name!r} declares {size} bytes of binary data at offset "
                    f"{offset}; the body has {len(blob)} bytes after the JSON"
                )
            tensors[name] = from_bytes(info, name, shape, blob[offset : offset + size])
            offset += size
        elif "data" in t:
            tensors[name] = from_list(info, name, shape, t["data"])
        else:
            raise InvalidRequest(f'[infer] input {clip(name)} has neither "data" nor binary data')
    if offset != len(blob):
        raise InvalidRequest(
            f"[infer] {len(blob) - offset} bytes of binary data after the inputs' declared "
            f"binary_data_size (total {offset}); the sizes must add up to the data sent"
        )
    binary_all = flag(params, "binary_data_output", False)
    outputs, binary = None, {}
    if req.get("outputs") not in (None, []):  # none or []: all of them (as gRPC and Triton)
        if not isinstance(req["outputs"], list):
            raise InvalidRequest('[infer] "outputs" must be a list of {"name": ...}')
        outputs = []
        for o in req["outputs"]:
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                raise InvalidRequest('[infer] each requested output needs a "name"')
            op = _parameters(o, f"output {clip(o['name'])}")
            unsupported(op, f"output {clip(o['name'])}")
            outputs.append(o["name"])
            binary[o["name"]] = flag(op, "binary_data", binary_all, f"output {clip(o['name'])}'s ")
    rid = req.get("id", "")
    if not isinstance(rid, str):
        raise InvalidRequest(f'[infer] "id" must be a string; got {clip(rid)}')
    p = assemble(info, rid, params, tensors, outputs, binary)
    for name in p.outputs:
        p.binary.setdefault(name, binary_all)
    return p


def _parameters(t: dict, what: str) -> dict:
    """An input's or requested output's "parameters": {} when absent or null, else an object
    (5 or [1] was read as none without a word)."""
    p = t.get("parameters")
    if p is None:
        return {}
    if not isinstance(p, dict):
        raise InvalidRequest(f'[infer] {what}: "parameters" must be a JSON object')
    return p


def _no_constant(name: str):
    raise ValueError(f"{name} is not a JSON number (RFC 8259); send finite numbers")


def json_bytes(info, p) -> int:
    """At most how many bytes ``p``'s outputs asked for as JSON take (JSON_NUMBER a number)."""
    n = 0
    for name in p.outputs:
        if not p.binary.get(name):
            shape = [p.x.shape[0] if d == -1 else d for d in info.outputs[name].shape]
            n += math.prod(shape) * JSON_NUMBER + 256  # and its name, datatype and shape
    return n


def _json_data(a: np.ndarray, parts: list[bytes], worker: bool) -> None:
    """Append ``a``'s numbers as a flat JSON list to ``parts``, a piece at a time; in a
    ``worker`` thread letting the event loop's thread have the GIL between pieces (on the
    loop's own thread that only handed it to the scheduler thread and waited up to a switch
    interval to get it back: HTTP JSON throughput fell ~30%); NaN and +-inf as _NONFINITE's
    strings."""
    flat = a.reshape(-1)
    parts.append(b"[")
    for i in range(0, flat.size, JSON_PIECE):
        chunk = flat[i : i + JSON_PIECE]
        if np.isfinite(chunk).all():
            piece = json.dumps(chunk.tolist())[1:-1]
        else:
            piece = ", ".join(_NONFINITE.get(repr(v), repr(v)) for v in chunk.tolist())
        parts.append((", " + piece if i else piece).encode())
        if worker:
            time.sleep(0)  # gives up the GIL: json.dumps holds it for a whole piece
    parts.append(b"]")


def _encode(info, p, values: dict[str, np.ndarray],
            worker: bool = False) -> tuple[bytes, dict, str]:  # fmt: skip
    """(body, headers, media type) of the answer; a large one is encoded in a ``worker``
    thread."""
    res = {"model_name": info.name, "model_version": VERSION}
    if p.id:
        res["id"] = p.id
    parts, blobs = [json.dumps(res)[:-1].encode(), b', "outputs": ['], []
    for k, (name, a) in enumerate(values.items()):
        t = {"name": name, "datatype": info.datatype, "shape": list(a.shape)}
        if k:
            parts.append(b", ")
        if p.binary.get(name):
            b = np.ascontiguousarray(a, a.dtype.newbyteorder("<")).tobytes()
            t["parameters"] = {"binary_data_size": len(b)}
            blobs.append(b)
            parts.append(json.dumps(t).encode())
        else:
            parts.append(json.dumps(t)[:-1].encode() + b', "data": ')
            _json_data(a, parts, worker)
            parts.append(b"}")
    parts.append(b"]}")
    head = b"".join(parts)
    del parts
    if not blobs:
        return head, {}, "application/json"
    return b"".join([head, *blobs]), {HEADER_LENGTH: str(len(head))}, "application/octet-stream"


class _Answer(Response):
    """An inference answer sent in SEND_PIECE pieces, each after the transport has room for it;
    ``release`` runs once the last has gone (or the client has), so its request's bytes count
    against --max-queued-bytes for as long as the answer is held here."""

    def __init__(self, body: bytes, headers: dict, media_type: str, release) -> None:
        super().__init__(body, headers=headers, media_type=media_type)
        self._release = release

    async def __call__(self, scope, receive, send) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code,
                        "headers": self.raw_headers})  # fmt: skip
            body = memoryview(self.body)
            for i in range(0, len(body), SEND_PIECE):
                await _sent(send, {"type": "http.response.body",
                                   "body": bytes(body[i : i + SEND_PIECE]), "more_body": True})  # fmt: skip
            # waits, as every send does, until the transport has taken what came before
            await _sent(send, {"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self._release()


async def _sent(send, message) -> None:
    """``send(message)`` within SEND_TIMEOUT: a client that reads nothing for that long
    loses its connection (uvicorn closes it when the app raises), so a few clients that
    never read cannot hold --max-queued-bytes, and every other client with it, for ever."""
    try:
        await asyncio.wait_for(send(message), SEND_TIMEOUT)
    except TimeoutError:
        raise ConnectionAbortedError(
            f"[http] the client read none of its answer for {SEND_TIMEOUT:g} s; connection closed"
        ) from None


def _error(core: Core, e: ServeError, model: str | None = None) -> JSONResponse:
    core.error(e, "http", model)
    # a 401 names the scheme it wants (RFC 6750's challenge; clients and proxies look for it)
    headers = {"WWW-Authenticate": "Bearer"} if e.http == 401 else None
    return JSONResponse({"error": str(e)}, status_code=e.http, headers=headers)


def make_app(core: Core, metrics=None) -> Starlette:
    def guarded(handler, auth: bool = True, counted: bool = True):
        """``handler`` behind the token check (``auth``) and, ``counted``, --max-concurrency
        (the health endpoints and /metrics answer whatever the load)."""

        async def endpoint(request: Request):
            try:
                if counted:
                    core.enter("http")
            except ServeError as e:
                return _error(core, e, request.path_params.get("model"))
            try:
                if auth:
                    core.authorize(request.headers.get("authorization"))
                return await handler(request)
            except ServeError as e:
                return _error(core, e, request.path_params.get("model"))
            except ClientDisconnect:  # gone mid-body: nobody to answer, nothing was queued
                return Response(status_code=400)
            finally:
                if counted:
                    core.leave("http")

        return endpoint

    def model_of(request: Request):
        pp = request.path_params
        return core.info(pp["model"], pp.get("version"))

    async def live(request):
        return Response(status_code=200)

    async def ready(request):
        return Response(status_code=200 if core.ready and not core.draining else 503)

    async def server_metadata(request):
        return JSONResponse({"name": "leanrnn", "version": VERSION, "extensions": EXTENSIONS})

    async def model_metadata(request):
        return JSONResponse(model_of(request).metadata())

    async def model_ready(request):
        model_of(request)
        return Response(status_code=200 if core.ready and not core.draining else 503)

    async def model_config(request):
        return JSONResponse(model_of(request).config())

    async def stats(request):
        name = request.path_params.get("model")
        names = [model_of(request).name] if name else list(core.infos)
        return JSONResponse({"model_stats": [core.stats(n) for n in names]})

    async def index(request):
        return JSONResponse([{"name": n, "version": VERSION, "state": "READY"} for n in core.infos])

    async def infer(request):
        info = model_of(request)
        # arriving from its headers on: while its body comes, no sequence of its model that
        # was not idle past the timeout then is evicted, for one more timeout at most (a body
        # that took 1.6 s lost its sequence to a 1 s idle timeout)
        arrival = core.scheduler.arriving(info.name)
        try:
            body, held = await _body(request, core)
            try:  # the body counts until its request is (infer_held submits before it awaits)
                head = request.headers.get(HEADER_LENGTH)
                # a large one parsed off the event loop: json.loads of a few MB of numbers held
                # up every other stream (HTTP and gRPC) for as long as it took
                t0 = time.perf_counter()
                p = await off_loop(len(body), _parse, core, info, body, head)
                core.io(info.name, "compute_input", time.perf_counter() - t0)
                del body
            finally:
                core.unreserve(held)
            size = json_bytes(info, p)
        except BaseException:
            core.scheduler.arrived(arrival)
            raise
        values, release = await core.infer_held(p, "http", size, arrival)
        try:  # a large answer off the event loop: it must not hold up the other streams
            t0 = time.perf_counter()
            if size + nbytes(values) <= INLINE:
                answer = _Answer(*_encode(info, p, values), release)
            else:
                answer = _Answer(*await asyncio.to_thread(_encode, info, p, values, True), release)
            core.io(info.name, "compute_output", time.perf_counter() - t0)
            return answer
        except BaseException:
            release()
            raise

    async def prometheus(request):
        if metrics is None:
            return Response(status_code=404)
        data, ctype = metrics.expose()
        return Response(data, media_type=ctype)

    m = "/v2/models/{model}"
    mv = "/v2/models/{model}/versions/{version}"
    routes = [
        Route("/v2/health/live", guarded(live, auth=False, counted=False)),
        Route("/v2/health/ready", guarded(ready, auth=False, counted=False)),
        Route("/v2", guarded(server_metadata)),
        Route("/v2/models/stats", guarded(stats)),
        Route("/v2/repository/index", guarded(index), methods=["POST"]),
        Route("/metrics", guarded(prometheus, counted=False)),
    ]
    for base in (m, mv):
        routes += [
            Route(base, guarded(model_metadata)),
            # a health endpoint (KServe v2), open as the server's are: a readiness probe
            # without the token read "not ready" for ever, with no error
            Route(base + "/ready", guarded(model_ready, auth=False, counted=False)),
            Route(base + "/config", guarded(model_config)),
            Route(base + "/stats", guarded(stats)),
            Route(base + "/infer", guarded(infer), methods=["POST"]),
        ]

    async def not_routed(request, exc):
        # the protocol's error body for any route or method the server does not have
        # (Starlette's own is text/plain, which tritonclient fails to parse)
        what = "method" if exc.status_code == 405 else "endpoint"
        return JSONResponse(
            {"error": f"unsupported {what}: {request.method} {request.url.path}"},
            status_code=exc.status_code,
            headers=getattr(exc, "headers", None),
        )  # fmt: skip  (405's Allow)

    return Starlette(routes=routes, exception_handlers={404: not_routed, 405: not_routed})
