"""What a request can get wrong, each kind with the HTTP status and gRPC code it answers with."""

from __future__ import annotations

from ..errors import LeanRNNError


class ServeError(LeanRNNError):
    """A request the server refuses; ``http`` and ``grpc`` (a grpc.StatusCode name) say how."""

    http = 400
    grpc = "INVALID_ARGUMENT"
    kind = "invalid"


class InvalidRequest(ServeError, ValueError):
    """Malformed body, wrong tensor names, shapes, dtypes or lengths."""


class NotFound(ServeError):
    http, grpc, kind = 404, "NOT_FOUND", "not_found"


class SequenceError(ServeError):
    """A step for a sequence that is not live (never started, ended, or evicted), or a second
    sequence_start on a live one."""

    kind = "sequence"


class Exhausted(ServeError):
    """The cap on concurrent streams is reached."""

    http, grpc, kind = 429, "RESOURCE_EXHAUSTED", "exhausted"


class QueueFull(Exhausted):
    """Accepted requests hold --max-queued-bytes: this one would pass it. A gRPC stream's
    request of a sequence waits for room instead (its later requests are already on the way:
    one refused in the middle left a gap the next one silently ran across)."""


class TooLarge(ServeError):
    http, grpc, kind = 413, "RESOURCE_EXHAUSTED", "too_large"


class Busy(ServeError):
    """More requests in flight on a transport than --max-concurrency."""

    http, grpc, kind = 503, "RESOURCE_EXHAUSTED", "busy"


class Timeout(ServeError):
    """A client that stalled sending its request (--read-timeout)."""

    http, grpc, kind = 408, "DEADLINE_EXCEEDED", "timeout"


class Unavailable(ServeError):
    """The server is shutting down."""

    http, grpc, kind = 503, "UNAVAILABLE", "unavailable"


class Unauthenticated(ServeError):
    http, grpc, kind = 401, "UNAUTHENTICATED", "unauthenticated"


class Internal(ServeError):
    """The engine failed on a batch (a bug): its requests fail, the server goes on."""

    http, grpc, kind = 500, "INTERNAL", "internal"
