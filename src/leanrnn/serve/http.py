"""KServe v2 over HTTP/REST (an ASGI app on Starlette): health, server and model metadata, model
config and statistics, the repository index, infer with the binary tensor data extension, and
Prometheus metrics at /metrics. Every error is ``{"error": "..."}`` with the status its kind says.
"""

from __future__ import annotations

import json
import zlib

import numpy as np
from starlette.applications import Starlette
from starlette.requests import ClientDisconnect, Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from .core import Core
from .errors import InvalidRequest, ServeError, TooLarge
from .protocol import EXTENSIONS, VERSION, assemble, check_input, from_bytes, from_list

HEADER_LENGTH = "Inference-Header-Content-Length"
# The JSON part of a request becomes Python objects (~30 bytes a number): larger tensors come as
# binary data (the extension every Triton client has), so memory stays near the body's size.
MAX_JSON = 8 << 20


async def _body(request: Request, limit: int) -> bytes:
    """The request body, decompressed (gzip/deflate), refused past ``limit`` bytes before it is
    all read or inflated."""
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(
            f"[infer] request body of {int(declared)} bytes; the limit is {limit} "
            "(--max-request-bytes); send fewer steps per request"
        )
    parts, n = [], 0
    async for chunk in request.stream():
        n += len(chunk)
        if n > limit:
            raise TooLarge(
                f"[infer] request body over {limit} bytes (--max-request-bytes); send fewer "
                "steps per request"
            )
        parts.append(chunk)
    body = b"".join(parts)
    encoding = request.headers.get("content-encoding", "identity").lower()
    if encoding in ("gzip", "deflate"):
        d = zlib.decompressobj(zlib.MAX_WBITS | (16 if encoding == "gzip" else 0))
        try:
            body = d.decompress(body, limit + 1)
        except zlib.error as e:
            raise InvalidRequest(f"[infer] body is not valid {encoding} data: {e}") from None
        if len(body) > limit or d.unconsumed_tail:
            raise TooLarge(f"[infer] {encoding} body inflates past {limit} bytes")
    elif encoding != "identity":
        raise InvalidRequest(
            f"[infer] Content-Encoding {encoding!r}; expected gzip, deflate or none"
        )
    return body


def _parse(core: Core, info, body: bytes, header_length: str | None):
    """A KServe v2 JSON request (with binary tensors appended when ``header_length`` is set)."""
    if header_length is not None:
        if not header_length.isdigit() or int(header_length) > len(body):
            raise InvalidRequest(
                f"[infer] {HEADER_LENGTH}={header_length!r} for a body of {len(body)} bytes; "
                "expected the length of the JSON part"
            )
        split = int(header_length)
        head, blob = body[:split], memoryview(body)[split:]
    else:
        head, blob = body, memoryview(b"")
    if len(head) > MAX_JSON:
        raise TooLarge(
            f"[infer] {len(head)} bytes of JSON; at most {MAX_JSON} (tensors this large go as "
            "binary data: tritonclient's set_data_from_numpy(..., binary_data=True))"
        )
    try:
        req = json.loads(head)
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
    tensors, offset = {}, 0
    for t in req["inputs"]:
        if not isinstance(t, dict) or not isinstance(t.get("name"), str):
            raise InvalidRequest('[infer] each input must be an object with a "name"')
        name = t["name"]
        if name in tensors:
            raise InvalidRequest(f"[infer] input {name!r} appears twice")
        shape = check_input(info, name, t.get("datatype"), t.get("shape"))
        tp = t.get("parameters") or {}
        size = tp.get("binary_data_size") if isinstance(tp, dict) else None
        if size is not None:
            if not isinstance(size, int) or isinstance(size, bool) or size < 0:
                raise InvalidRequest(
                    f"[infer] input {name!r}: binary_data_size={size!r}; expected a byte count "
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
            raise InvalidRequest(f'[infer] input {name!r} has neither "data" nor binary data')
    if offset != len(blob):
        raise InvalidRequest(
            f"[infer] {len(blob) - offset} bytes of binary data after the inputs' declared "
            f"binary_data_size (total {offset}); the sizes must add up to the data sent"
        )
    binary_all = params.get("binary_data_output", False) is True
    outputs, binary = None, {}
    if req.get("outputs") is not None:
        if not isinstance(req["outputs"], list):
            raise InvalidRequest('[infer] "outputs" must be a list of {"name": ...}')
        outputs = []
        for o in req["outputs"]:
            if not isinstance(o, dict) or not isinstance(o.get("name"), str):
                raise InvalidRequest('[infer] each requested output needs a "name"')
            op = o.get("parameters")
            if not isinstance(op, dict):
                op = {}
            outputs.append(o["name"])
            binary[o["name"]] = op.get("binary_data", binary_all) is True
    rid = req.get("id", "")
    if not isinstance(rid, str):
        raise InvalidRequest(f'[infer] "id" must be a string; got {rid!r}')
    p = assemble(info, rid, params, tensors, outputs, binary)
    for name in p.outputs:
        p.binary.setdefault(name, binary_all)
    return p


def _encode(info, p, values: dict[str, np.ndarray]) -> Response:
    outs, blobs = [], []
    for name, a in values.items():
        t = {"name": name, "datatype": info.datatype, "shape": list(a.shape)}
        if p.binary.get(name):
            b = np.ascontiguousarray(a, a.dtype.newbyteorder("<")).tobytes()
            t["parameters"] = {"binary_data_size": len(b)}
            blobs.append(b)
        else:
            t["data"] = a.reshape(-1).tolist()
        outs.append(t)
    res = {"model_name": info.name, "model_version": VERSION, "outputs": outs}
    if p.id:
        res["id"] = p.id
    head = json.dumps(res).encode()
    if not blobs:
        return Response(head, media_type="application/json")
    return Response(
        b"".join([head, *blobs]),
        media_type="application/octet-stream",
        headers={HEADER_LENGTH: str(len(head))},
    )


def _error(core: Core, e: ServeError) -> JSONResponse:
    core.error(e, "http")
    return JSONResponse({"error": str(e)}, status_code=e.http)


def make_app(core: Core, metrics=None) -> Starlette:
    def guarded(handler, auth: bool = True):
        async def endpoint(request: Request):
            try:
                if auth:
                    core.authorize(request.headers.get("authorization"))
                return await handler(request)
            except ServeError as e:
                return _error(core, e)
            except ClientDisconnect:  # gone mid-body: nobody to answer, nothing was queued
                return Response(status_code=400)

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
        body = await _body(request, core.max_request_bytes)
        p = _parse(core, info, body, request.headers.get(HEADER_LENGTH))
        return _encode(info, p, await core.infer(p, "http"))

    async def prometheus(request):
        if metrics is None:
            return Response(status_code=404)
        data, ctype = metrics.expose()
        return Response(data, media_type=ctype)

    m = "/v2/models/{model}"
    mv = "/v2/models/{model}/versions/{version}"
    routes = [
        Route("/v2/health/live", guarded(live, auth=False)),
        Route("/v2/health/ready", guarded(ready, auth=False)),
        Route("/v2", guarded(server_metadata)),
        Route("/v2/models/stats", guarded(stats)),
        Route("/v2/repository/index", guarded(index), methods=["POST"]),
        Route("/metrics", guarded(prometheus)),
    ]
    for base in (m, mv):
        routes += [
            Route(base, guarded(model_metadata)),
            Route(base + "/ready", guarded(model_ready)),
            Route(base + "/config", guarded(model_config)),
            Route(base + "/stats", guarded(stats)),
            Route(base + "/infer", guarded(infer), methods=["POST"]),
        ]
    return Starlette(routes=routes)
