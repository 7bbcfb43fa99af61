"""KServe v2 over gRPC (``grpc.aio``), service ``inference.GRPCInferenceService``: health, server
and model metadata, model config and statistics, the repository index, ``ModelInfer`` and the
bidirectional ``ModelStreamInfer``; beside it gRPC's standard health service
(``grpc.health.v1.Health``, grpcio-health-checking's servicer), which load balancers and
Kubernetes' gRPC probes call: services "" and ``inference.GRPCInferenceService`` are SERVING
while the server is ready and NOT_SERVING before and from shutdown on (``Health``).

The message and service definitions are Triton's published ``grpc_service.proto`` and
``model_config.proto``, as compiled by NVIDIA into the ``tritonclient[grpc]`` package (its
``service_pb2``/``service_pb2_grpc``/``model_config_pb2``): the server and its clients then speak
from one copy of the definitions, nothing is generated at build or import time, and no copy of
the .proto files (nor generated code pinned to one protobuf release) lives in this repository.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from functools import partial

import grpc
import numpy as np
from google.protobuf import json_format
from google.protobuf.message import DecodeError
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_health.v1.health import aio as health_aio
from tritonclient.grpc import model_config_pb2, service_pb2, service_pb2_grpc

from .core import Core, hostport, nbytes, off_loop
from .errors import Internal, InvalidRequest, QueueFull, ServeError, Unavailable
from .protocol import (
    EXTENSIONS,
    VERSION,
    assemble,
    check_input,
    check_listed,
    clip,
    from_bytes,
    sequence,
    unsupported,
)
from .scheduler import request_bytes

pb = service_pb2
_log = logging.getLogger("leanrnn.serve")
# Per ModelStreamInfer stream: the most requests read and not yet answered back, and the most
# bytes of answers waiting for the client to take them, before the stream's next request waits.
# 1024 requests let one stream carry as many sequences at once as --max-streams' default.
WINDOW = 1024
WINDOW_BYTES = 4 << 20
# Seconds a stream's next request may take to come once the stream is read again (after its
# bound on requests and bytes in flight stopped it) and still count as having arrived while
# it was not read (Scheduler.arriving).
UNREAD_S = 1.0
_CONTENTS = {"FP32": "fp32_contents", "FP64": "fp64_contents"}
# ModelInfer and ModelStreamInfer take and give serialized messages: grpc.aio would otherwise
# decode and encode them on the event loop, and upb's FromString, ByteSize and SerializeToString
# each take ~1.2 ms a MiB (a 50 MiB answer held every other stream ~180 ms). Those past
# core.INLINE bytes are read and written in a worker thread, with their parsing and encoding.
RAW = ("ModelInfer", "ModelStreamInfer")
# The most top-level fields of a request message, and parameters of one of its tensors (a
# request has a handful of each); the most dimensions of an input (the models' take 2).
MAX_FIELDS = 256
MAX_DIMS = 8


def _submitted(fut: asyncio.Future, _task) -> None:
    """A stream request's task ended (even cancelled before it ran, or refused before it
    reached Core.infer_held, which resolves ``fut`` once it queues or refuses): its pump
    reads on."""
    if not fut.done():
        fut.set_result(None)


def _params(m) -> dict:
    out = {}
    for key, v in m.items():
        which = v.WhichOneof("parameter_choice")
        out[key] = getattr(v, which) if which else None
        if key == "sequence_id" and which == "int64_param" and out[key] < 0:
            # Triton's C++ client (and perf_analyzer) send a uint64 id as int64: 2**64-1
            # arrives as -1, and Triton's server reads it back as the uint64
            out[key] += 1 << 64
    return out


def decode(data: bytes):
    """The ModelInferRequest serialized in ``data``, if it has at most MAX_FIELDS top-level
    fields: a request has a few (its inputs, outputs, parameters and raw buffers), and 16 MiB
    of empty ``outputs {}`` entries decoded into 2.4 GB and 12 s of Python before any check."""
    _few_fields(data)
    try:
        return pb.ModelInferRequest.FromString(data)
    except DecodeError as e:  # (gRPC's own deserializer answered a bare INTERNAL)
        raise InvalidRequest(
            f"[infer] the request is not a ModelInferRequest message: {e}"
        ) from None


def _few_fields(data: bytes) -> None:
    """Refuse ``data`` if it holds more than MAX_FIELDS top-level protobuf fields, counted by
    walking their tags and lengths (at most MAX_FIELDS steps; what is malformed is left to the
    decoder to refuse)."""
    i, end = 0, len(data)
    for _ in range(MAX_FIELDS):
        if i >= end:
            return
        tag, i = _varint(data, i)
        kind = tag & 7
        if kind == 0:
            _, i = _varint(data, i)
        elif kind == 1:
            i += 8
        elif kind == 2:
            size, i = _varint(data, i)
            i += size
        elif kind == 5:
            i += 4
        else:  # groups, or not protobuf at all: FromString says which
            return
    if i < end:
        raise InvalidRequest(
            f"[infer] the request has more than {MAX_FIELDS} top-level fields; a "
            "ModelInferRequest has a handful (its inputs, outputs, parameters and raw buffers)"
        )


def _varint(data: bytes, i: int) -> tuple[int, int]:
    """(value, next index) of the base-128 varint at ``data[i]`` (at most 10 bytes read)."""
    value = shift = 0
    for j in range(i, min(i + 10, len(data))):
        value |= (data[j] & 0x7F) << shift
        if data[j] < 0x80:
            return value, j + 1
        shift += 7
    return value, len(data)  # (cut short: the walk ends, the decoder refuses it)


def parse(core: Core, req) -> tuple:
    info = core.info(req.model_name, req.model_version)
    check_listed(info, len(req.inputs), len(req.outputs))
    raw = req.raw_input_contents
    if raw and len(raw) != len(req.inputs):
        raise InvalidRequest(
            f"[infer] {len(req.inputs)} inputs but {len(raw)} raw_input_contents; expected one "
            "raw buffer per input, in order (or none, with contents)"
        )
    tensors = {}
    for i, t in enumerate(req.inputs):
        if t.name in tensors:
            raise InvalidRequest(f"[infer] input {clip(t.name)} appears twice")
        if len(t.shape) > MAX_DIMS or len(t.parameters) > MAX_FIELDS:
            raise InvalidRequest(
                f"[infer] input {clip(t.name)} has {len(t.shape)} dimensions and "
                f"{len(t.parameters)} parameters; at most {MAX_DIMS} and {MAX_FIELDS}"
            )
        shape = check_input(info, t.name, t.datatype, list(t.shape))
        unsupported(t.parameters, f"input {t.name!r}")
        if raw and t.HasField("contents"):  # Triton refuses this too: which one was meant?
            raise InvalidRequest(
                f"[infer] input {t.name!r} has both contents and raw_input_contents; send its "
                "data in one of them (raw_input_contents for every input, or contents for every "
                "input)"
            )
        if raw:
            tensors[t.name] = from_bytes(info, t.name, shape, raw[i])
        else:
            field = _CONTENTS[info.datatype]
            values = getattr(t.contents, field)
            if len(values) != int(np.prod(shape)):  # counted before anything is converted
                elsewhere = [f.name for f, v in t.contents.ListFields() if f.name != field]
                raise InvalidRequest(
                    f"[infer] input {t.name!r} of shape {list(shape)} {info.datatype} needs "
                    f"{int(np.prod(shape))} values in contents.{field}; got {len(values)}"
                    + (f" (and values in {', '.join(elsewhere)}, which a {info.datatype} input "
                       "does not read)" if elsewhere else "")
                )  # fmt: skip
            # one number at a time into the array: np.asarray made a Python float of each
            # first (13x the message's size in memory, and 5x the time)
            tensors[t.name] = np.fromiter(values, info.dtype, len(values)).reshape(shape)
    for o in req.outputs:
        if len(o.parameters) > MAX_FIELDS:
            raise InvalidRequest(f"[infer] output {clip(o.name)} has {len(o.parameters)} "
                                 f"parameters; at most {MAX_FIELDS}")  # fmt: skip
        unsupported(o.parameters, f"output {clip(o.name)}")
    outputs = [o.name for o in req.outputs] or None
    return info, assemble(info, req.id, _params(req.parameters), tensors, outputs, {})


def answer(info, p, values: dict[str, np.ndarray], stream: bool = False) -> bytes:
    """The serialized ModelInferResponse of ``values`` (a ModelStreamInferResponse's:
    ``stream``), built in place (a response copied into its stream message was another copy)."""
    out = pb.ModelStreamInferResponse() if stream else pb.ModelInferResponse()
    res = out.infer_response if stream else out
    res.model_name, res.model_version, res.id = info.name, VERSION, p.id
    for name, a in values.items():
        res.outputs.add(name=name, datatype=info.datatype, shape=list(a.shape))
        res.raw_output_contents.append(np.ascontiguousarray(a, a.dtype.newbyteorder("<")).tobytes())
    if stream:
        _final(res)
    return out.SerializeToString()


def _final(res) -> None:
    # One answer per stream request, its last: Triton marks every stream answer so, and its
    # clients wait for the mark to know a request is complete
    res.parameters["triton_final_response"].bool_param = True


def add_service(servicer, server) -> None:
    """Register ``servicer`` as inference.GRPCInferenceService on ``server``: every method as
    the published definitions declare it, but RAW's taking and giving bytes."""
    service = pb.DESCRIPTOR.services_by_name["GRPCInferenceService"]
    kinds = {(False, False): grpc.unary_unary_rpc_method_handler,
             (True, True): grpc.stream_stream_rpc_method_handler}  # fmt: skip
    handlers = {}
    for m in service.methods:
        raw = m.name in RAW
        handlers[m.name] = kinds[m.client_streaming, m.server_streaming](
            getattr(servicer, m.name),
            request_deserializer=None if raw else getattr(pb, m.input_type.name).FromString,
            response_serializer=None if raw else getattr(pb, m.output_type.name).SerializeToString,
        )
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler(service.full_name, handlers),))  # fmt: skip
    if hasattr(server, "add_registered_method_handlers"):  # grpcio >= 1.63: faster lookup
        server.add_registered_method_handlers(service.full_name, handlers)


# The service's methods of extensions this server does not implement (nor list in its
# metadata), by method: what they are part of. The generated servicer's own stubs answered
# "Unexpected <class 'NotImplementedError'>: Method not implemented!".
UNIMPLEMENTED = {
    "RepositoryModelLoad": "model repository (load/unload)",
    "RepositoryModelUnload": "model repository (load/unload)",
    "SystemSharedMemoryStatus": "system shared-memory",
    "SystemSharedMemoryRegister": "system shared-memory",
    "SystemSharedMemoryUnregister": "system shared-memory",
    "CudaSharedMemoryStatus": "CUDA shared-memory",
    "CudaSharedMemoryRegister": "CUDA shared-memory",
    "CudaSharedMemoryUnregister": "CUDA shared-memory",
    "TraceSetting": "trace",
    "LogSettings": "logging",
}


def _unimplemented(method: str, extension: str):
    async def refuse(self, request, context):
        await context.abort(
            grpc.StatusCode.UNIMPLEMENTED,
            f"{method}: this server does not implement the {extension} extension (the server "
            "metadata's extensions list what it does)",
        )

    refuse.__name__ = method
    return refuse


class Servicer(service_pb2_grpc.GRPCInferenceServiceServicer):
    def __init__(self, core: Core) -> None:
        self.core = core

    async def _refuse(self, context, e: ServeError, model: str | None = None):
        """Count ``e`` and abort the call with its code (raises: the call ends here). ``e``'s
        traceback is dropped first: grpc's AbortError, raised while ``e`` is handled, and the
        call's context form a cycle with it, which kept the frames of a refused request, and
        its message, until a garbage collection (+120-180 MiB per refused 60 MiB call)."""
        self.core.error(e, "grpc", model)
        e.with_traceback(None)
        await context.abort(getattr(grpc.StatusCode, e.grpc), str(e))

    async def _enter(self, context) -> None:
        """A call starts: counted against --max-concurrency, or refused (pair with leave)."""
        try:
            self.core.enter("grpc")
        except ServeError as e:
            await self._refuse(context, e)

    async def _guard(self, context, fn, model: list | None = None):
        """Run ``fn()`` within --max-concurrency after the token check; a ServeError aborts the
        call with its code. ``model``: holds the model the call names first (once known)."""
        await self._enter(context)
        try:
            md = dict(context.invocation_metadata() or ())
            self.core.authorize(md.get("authorization"))
            return await fn() if asyncio.iscoroutinefunction(fn) else fn()
        except ServeError as e:
            await self._refuse(context, e, model[0] if model else None)
        finally:
            self.core.leave("grpc")

    async def ServerLive(self, request, context):
        return pb.ServerLiveResponse(live=True)

    async def ServerReady(self, request, context):
        return pb.ServerReadyResponse(ready=self.core.ready and not self.core.draining)

    async def ModelReady(self, request, context):
        # A health method (KServe v2), open without the token as ServerLive and ServerReady;
        # a model or version not served is not ready (Triton's answer: NOT_FOUND made clients'
        # polling loops raise, where HTTP's said False)
        try:
            self.core.info(request.name, request.version)
        except ServeError:
            return pb.ModelReadyResponse(ready=False)
        return pb.ModelReadyResponse(ready=self.core.ready and not self.core.draining)

    async def ServerMetadata(self, request, context):
        return await self._guard(context, lambda: pb.ServerMetadataResponse(
            name="leanrnn", version=VERSION, extensions=EXTENSIONS))  # fmt: skip

    async def ModelMetadata(self, request, context):
        def fn():
            md = self.core.info(request.name, request.version).metadata()
            return json_format.ParseDict(md, pb.ModelMetadataResponse())

        return await self._guard(context, fn, [request.name])

    async def ModelConfig(self, request, context):
        def fn():
            cfg = self.core.info(request.name, request.version).config()
            return pb.ModelConfigResponse(
                config=json_format.ParseDict(cfg, model_config_pb2.ModelConfig())
            )

        return await self._guard(context, fn, [request.name])

    async def ModelStatistics(self, request, context):
        def fn():
            names = [self.core.info(request.name, request.version).name] if request.name else (
                list(self.core.infos))  # fmt: skip
            res = {"model_stats": [self.core.stats(n) for n in names]}
            return json_format.ParseDict(res, pb.ModelStatisticsResponse())

        return await self._guard(context, fn)

    async def RepositoryIndex(self, request, context):
        def fn():
            return pb.RepositoryIndexResponse(models=[
                pb.RepositoryIndexResponse.ModelIndex(name=n, version=VERSION, state="READY")
                for n in self.core.infos])  # fmt: skip

        return await self._guard(context, fn)

    async def _room(self, data: bytes, stream: bool) -> None:
        """Count ``data``'s bytes against --max-queued-bytes (Core.reserve). A stream's
        request waits for room (Core.with_room); refused then, it ends its sequence, read
        from the message (which the stream's own bound holds anyway): else the next
        request, already sent, ran across the gap."""
        n = len(data)
        try:
            self.core.reserve(n)
            return
        except QueueFull:
            if not stream:
                raise
        try:
            await self.core.with_room(lambda: self.core.reserve(n))
        except QueueFull as e:
            with contextlib.suppress(ServeError):
                request = decode(data)
                key = sequence(_params(request.parameters))[0]
                self.core.scheduler.break_off(request.model_name, key, e)
            raise

    async def _read(self, data: bytes, ids: list, stream: bool = False) -> tuple:
        """(info, parsed) of one serialized request; ``ids`` gets its (model_name, id) once
        decoded. Its bytes count against --max-queued-bytes while it is decoded and parsed,
        as an HTTP body's do while read (past it: RESOURCE_EXHAUSTED before any decoding; 12
        calls of 60 MiB took the server 2.4 GB past a 1 GiB limit). Only x, a copy, outlives
        this: the decoded message (the request's size again) goes with the frame.

        ``stream``: a ModelStreamInfer request, whose stream's next requests are already
        sent. It waits for room rather than be refused (up to --idle-timeout, as infer_held's
        wait), and a refusal ends its sequence: refused and left live, the next request ran
        across the gap (Scheduler.break_off)."""
        n = len(data)
        await self._room(data, stream)
        key = None
        try:
            t0 = time.perf_counter()
            request = await off_loop(n, decode, data)
            ids[:] = (request.model_name, request.id)
            if stream:
                with contextlib.suppress(ServeError):  # (its own refusal comes in parse)
                    key = sequence(_params(request.parameters))[0]
            info, p = await off_loop(n, parse, self.core, request)
            self.core.io(info.name, "compute_input", time.perf_counter() - t0)
            return info, p
        except ServeError as e:
            if key is not None:
                self.core.scheduler.break_off(ids[0], key, e)
            raise
        finally:
            self.core.unreserve(n)

    async def ModelInfer(self, data: bytes, context):
        async def fn():
            # the message leaves this call's frames at once: a refusal's AbortError, in a
            # cycle with the call's context, keeps them until a garbage collection
            nonlocal data
            mine, data = data, None
            info, p = await self._read(mine, ids)
            del mine
            values, release = await self.core.infer_held(p, "grpc")
            # the request's bytes count until the call is over: its answer written to the
            # transport (gRPC's flow control: a client that does not read holds it), or gone
            context.add_done_callback(lambda _: release())
            t0 = time.perf_counter()
            res = await off_loop(nbytes(values), answer, info, p, values)
            self.core.io(info.name, "compute_output", time.perf_counter() - t0)
            return res

        ids: list = []  # (model_name, id) once decoded
        return await self._guard(context, fn, ids)

    async def ModelStreamInfer(self, request_iterator, context):
        """Requests are handed to the scheduler in the order they arrive (so one sequence's
        requests keep their order); responses go back as they complete. An error answers that
        request only (error_message), and the stream goes on, except for a message over
        --max-request-bytes, which gRPC refuses by ending the stream (``start``). A stream
        counts as one call against --max-concurrency until it ends."""
        await self._enter(context)
        try:
            async for res in self._stream(request_iterator, context):
                yield res
        finally:
            self.core.leave("grpc")

    async def _stream(self, request_iterator, context):
        try:
            md = dict(context.invocation_metadata() or ())
            self.core.authorize(md.get("authorization"))
        except ServeError as e:
            await self._refuse(context, e)
        # Backpressure: a client that sends but does not read would otherwise have every
        # answer of its stream queued here, without bound. Each request counts against
        # --max-queued-bytes until its answer has been written to the stream (as ModelInfer's
        # and HTTP's do), so the answers of all streams together stay within it: past it, a
        # request of a sequence waits for room (up to its model's --idle-timeout; Core.
        # infer_held), the stream unread meanwhile, and others are answered
        # RESOURCE_EXHAUSTED's error; a refused request of a live sequence ends it (its next
        # requests, already sent, would run across the gap). And the stream holds at most WINDOW
        # requests read and not yet written back, and WINDOW_BYTES of them (a request being
        # computed counts its x and y, an answer its message); past either, its next request
        # is not read (gRPC's flow control then holds the client's sends), and other streams
        # go on.
        out: asyncio.Queue = asyncio.Queue()
        room = asyncio.Event()
        room.set()
        held = [0, 0]  # requests read and not yet written back; their bytes
        tasks: set[asyncio.Task] = set()  # only the unfinished: a stream may carry millions
        closed = False
        metrics = self.core.metrics
        loop = asyncio.get_running_loop()
        idle = self.core.idle_timeout
        last = [loop.time()]  # the stream's last request read or answer written
        idled = asyncio.Event()
        # The stream's next request while the bound stops its reading and requests of the
        # stream are still being computed: arriving (Scheduler.arriving), its token here. Once
        # none is computing, what holds the bound up is answers the client has not read: its
        # own pace, not the server's, and the token goes back.
        computing = [0]
        blocked: list = [None]

        def computed() -> None:
            computing[0] -= 1
            if not computing[0] and blocked[0] is not None:
                self.core.scheduler.arrived(blocked[0])
                blocked[0] = None

        def account(requests: int, nbytes: int) -> None:
            held[0] += requests
            held[1] += nbytes
            if metrics is not None:
                metrics.stream_held(nbytes)
            if held[0] < WINDOW and held[1] < WINDOW_BYTES:
                room.set()
            else:
                room.clear()

        async def one(ids, item, cost: int, arrival: int | None, submitted: asyncio.Future):
            counted = not isinstance(item, ServeError)
            computing[0] += counted  # until its answer is queued (or it is given up)
            try:
                await _one(ids, item, cost, arrival, submitted)
            finally:
                if counted:
                    computed()

        async def _one(ids, item, cost: int, arrival: int | None, submitted: asyncio.Future):
            release = _nothing
            try:
                if isinstance(item, ServeError):
                    self.core.scheduler.arrived(arrival)
                    raise item
                info, p = item
                # queued (or refused) before the pump reads the next request (``submitted``):
                # a sequence's requests in stream order, even one that waits for room
                values, release = await self.core.infer_held(p, "grpc", 0, arrival, submitted)
                t0 = time.perf_counter()
                res = await off_loop(nbytes(values), answer, info, p, values, True)
                self.core.io(info.name, "compute_output", time.perf_counter() - t0)
            except Exception as e:  # (not a cancellation: the client went)
                if not isinstance(e, ServeError):  # a failure here, not a refusal: answered
                    # as one, so the request's place in the stream's bound is given back and
                    # its client is not left waiting for an answer that never comes
                    _log.exception("stream request failed", extra={"fields": {"request": ids}})
                    e = Internal(f"[stream] this request failed: {type(e).__name__}: {e}")
                self.core.error(e, "grpc", ids[0] if ids else None)
                failed = pb.ModelStreamInferResponse(error_message=str(e))
                if ids is not None:  # (None: not a ModelInferRequest at all)
                    failed.infer_response.model_name, failed.infer_response.id = ids
                _final(failed.infer_response)
                res = failed.SerializeToString()
            except BaseException:
                release()
                raise
            if closed:  # the client went while it computed: nobody to send it to
                release()
                return
            account(0, len(res) - cost)  # the answer now, in place of the request
            out.put_nowait((res, len(res), release))

        async def pump():
            requests = request_iterator.__aiter__()
            nxt = None
            try:
                while True:
                    if not room.is_set() and computing[0]:
                        # at the stream's bound while the engine works: the next request
                        # waits unread, arriving until it is submitted, so its sequence is not
                        # evicted as idle behind a large request (``computing``)
                        blocked[0] = self.core.scheduler.arriving()
                    await room.wait()
                    nxt = asyncio.ensure_future(requests.__anext__())
                    if (
                        blocked[0] is not None
                        and not (await asyncio.wait({nxt}, timeout=UNREAD_S))[0]
                    ):
                        # no request was waiting behind the bound after all (or it is still
                        # on its way): the stream is quiet, not arriving (a token kept here
                        # held back every eviction for as long as the stream stayed open)
                        self.core.scheduler.arrived(blocked[0])
                        blocked[0] = None
                    # A stream that sends nothing for --idle-timeout with nothing of its in
                    # flight is closed: idle streams held --max-concurrency's calls for as long
                    # as they stayed open (and any sequence of theirs is evicted by then)
                    while True:
                        wait = idle if held[0] else last[0] + idle - loop.time()
                        if wait <= 0:
                            nxt.cancel()
                            idled.set()
                            return
                        if (await asyncio.wait({nxt}, timeout=wait))[0]:
                            break
                    try:
                        data = nxt.result()
                    except StopAsyncIteration:
                        break
                    # Only x (a copy) outlives the parse: the future held the message until the
                    # next request came, and the decoded one stayed until then too (each the
                    # request's size again, which --max-queued-bytes did not see)
                    nxt = None
                    last[0] = loop.time()
                    cost = len(data)
                    ids: list = []
                    try:
                        info, p = await self._read(data, ids, stream=True)
                        cost = request_bytes(p.x, info.outputs["y"].shape[1], info.dtype)
                        item = (info, p)
                    except ServeError as e:
                        item = e.with_traceback(None)  # (its frames held the message)
                    data = None
                    account(1, cost)
                    # submitted in arrival order: the next request is read once this one is
                    # queued or refused (at once, unless it waits for room: QueueFull)
                    arrival, blocked[0] = blocked[0], None
                    submitted = loop.create_future()
                    task = asyncio.ensure_future(
                        one(tuple(ids) or None, item, cost, arrival, submitted)
                    )
                    tasks.add(task)
                    task.add_done_callback(tasks.discard)
                    if arrival is not None:  # (a task cancelled before it ran runs no finally)
                        task.add_done_callback(partial(_arrived, self.core.scheduler, arrival))
                    task.add_done_callback(partial(_submitted, submitted))
                    await submitted
                await asyncio.gather(*tasks, return_exceptions=True)
            finally:
                if nxt is not None:  # (cancelled: the client went)
                    nxt.cancel()
                    # a read cut short may still end on its own (grpc's iterator raising
                    # StopAsyncIteration as it closes): taken here, not printed to stderr by
                    # asyncio as "Task exception was never retrieved", outside the JSON log
                    nxt.add_done_callback(_taken)
                out.put_nowait((None, 0, _nothing))
                self.core.scheduler.arrived(blocked[0])  # (after the end mark: nothing may keep it)

        reader = asyncio.ensure_future(pump())
        try:
            while True:
                res, n, release = await out.get()
                if res is None:
                    break
                try:
                    yield res  # returns once gRPC has taken it (the client's window allowing)
                finally:  # sent, or the client went: its bytes stop counting either way
                    release()
                account(-1, -n)
                last[0] = loop.time()
            if idled.is_set():
                e = Unavailable(
                    f"[stream] no request on this ModelStreamInfer stream for {idle:g} s "
                    "(--idle-timeout) and none in flight: closed, as its sequences are evicted "
                    "by then; open a new stream (and start its sequences again)"
                )
                await self._refuse(context, e)
        finally:  # the client is gone or done: what the stream still holds stops counting
            closed = True
            reader.cancel()
            for task in list(tasks):  # a request cancelled while computing releases itself
                task.cancel()
            while not out.empty():
                out.get_nowait()[2]()
            if metrics is not None:
                metrics.stream_held(-held[1])
            metrics = None  # answers still computing then count nowhere


for _m, _ext in UNIMPLEMENTED.items():
    setattr(Servicer, _m, _unimplemented(_m, _ext))


def _arrived(scheduler, token: int, _task) -> None:
    scheduler.arrived(token)


def _taken(f: asyncio.Future) -> None:
    if not f.cancelled():
        f.exception()


def _nothing() -> None:
    pass


class _CappedWatches(health_aio.HealthServicer):
    """grpc.health.v1 with at most ``cap`` Watch streams open. Each holds one of grpc's
    concurrent-call slots (maximum_concurrent_rpcs counts them; --max-concurrency, which
    counts the inference calls, does not) for as long as its client keeps it, without the
    token: uncapped, 70 watches locked authenticated inference out at --max-concurrency 2."""

    def __init__(self, cap: int) -> None:
        super().__init__()
        self.cap, self.watching = cap, 0

    async def Watch(self, request, context) -> None:
        if self.watching >= self.cap:
            await context.abort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"{self.watching} health Watch streams are open, the most this server keeps; "
                "poll Check instead, or close a watch",
            )
        self.watching += 1
        try:
            await super().Watch(request, context)
        finally:
            self.watching -= 1


class Health:
    """The statuses of grpc.health.v1's services, set as the server's readiness changes."""

    SERVICES = ("", "inference.GRPCInferenceService")

    def __init__(self, watches: int = 32) -> None:
        self.servicer = _CappedWatches(watches)

    async def set(self, serving: bool) -> None:
        status = health_pb2.HealthCheckResponse.SERVING if serving else (
            health_pb2.HealthCheckResponse.NOT_SERVING)  # fmt: skip
        for name in self.SERVICES:
            await self.servicer.set(name, status)

    async def shutdown(self) -> None:
        await self.servicer.enter_graceful_shutdown()  # NOT_SERVING, for good


async def start(core: Core, host: str, port: int, max_bytes: int, max_rpcs: int):
    """A running grpc.aio server on host:port (0: any free port), its health service NOT_SERVING
    until ``Health.set(True)``; returns (server, port, health).
    Beyond ``max_rpcs`` calls in flight (a ModelStreamInfer stream counts as one until it
    ends) new calls get RESOURCE_EXHAUSTED; the ones in flight are unaffected. Health Watch
    streams may hold half of the calls beyond --max-concurrency (``core.max_in_flight``).
    A message over ``max_bytes`` is refused by gRPC itself, before this server reads it: a
    unary call gets RESOURCE_EXHAUSTED; on a ModelStreamInfer stream it ends the stream (the
    answers of its requests still computing are lost with it), as at any gRPC server's limit
    (Triton's is 2 GiB): keep a stream's requests under --max-request-bytes."""
    server = grpc.aio.server(maximum_concurrent_rpcs=max_rpcs, options=[
        # gRPC's default SO_REUSEPORT lets a second server share a taken port and take half
        # its connections (and so half of some sequences' requests): refuse instead
        ("grpc.so_reuseport", 0),
        ("grpc.max_receive_message_length", max_bytes),
        # unbounded: the answers are (y is checked against max_bytes before a request runs,
        # the states are the model's size); a y just under max_bytes plus h_n, c_n and the id
        # passed the check, ran, advanced its sequence, and then could not be sent
        ("grpc.max_send_message_length", -1),
    ])  # fmt: skip
    try:
        add_service(Servicer(core), server)
        health = Health(max(1, (max_rpcs - core.max_in_flight) // 2))
        await health.set(False)
        health_pb2_grpc.add_HealthServicer_to_server(health.servicer, server)
        try:
            bound = server.add_insecure_port(hostport(host, port))
        except RuntimeError:  # grpcio >= 1.5x raises where older ones returned 0
            bound = 0
        if bound == 0:
            raise OSError(
                f"[serve] cannot bind gRPC to {hostport(host, port)} (in use, or not an address of "
                "this machine); pick another --grpc-port"
            )
        await server.start()
    except BaseException:
        # Ctrl-C while starting (the task cancelled at its next await): left to the collector,
        # grpc's shutdown coroutine was never awaited and the loop had closed. A server whose
        # start was cancelled refuses to stop (InvalidStateError): there is nothing to stop.
        with contextlib.suppress(Exception):
            await server.stop(None)
        raise
    return server, bound, health
