"""Prometheus metrics of one server (their own registry, so two servers in one process, as in
tests, do not collide): streams, steps, batches, waits, latencies, evictions, errors."""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    generate_latest,
)

from .errors import ServeError

_BATCH = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024)
_SECONDS = (1e-5, 3e-5, 1e-4, 3e-4, 1e-3, 3e-3, 0.01, 0.03, 0.1, 0.3, 1.0, 3.0, 10.0)


PROTOCOLS = ("http", "grpc")


class Metrics:
    def __init__(self, models: tuple[str, ...] = ()) -> None:
        """``models``: the served models, whose series are made at once (at 0): a series
        that appears only at its first event reads as "no data" to a dashboard, and a rate
        over it starts with a jump."""
        r = self.registry = CollectorRegistry()
        p = "leanrnn_serve_"
        self._active = Gauge(p + "active_streams", "Live sequences (slots held)", ["model"],
                             registry=r)  # fmt: skip
        self._steps = Counter(p + "steps", "Stream-steps computed", ["model"], registry=r)
        self._calls = Counter(p + "engine_calls", "Batched engine calls", ["model"], registry=r)
        self._busy = Counter(
            p + "engine_seconds", "Seconds the engine spent in calls (utilization = rate)",
            ["model"], registry=r,
        )  # fmt: skip
        self._batch = Histogram(p + "batch_size", "Streams per engine call", ["model"],
                                buckets=_BATCH, registry=r)  # fmt: skip
        self._call_steps = Histogram(p + "call_steps", "Steps per engine call", ["model"],
                                     buckets=_BATCH, registry=r)  # fmt: skip
        self._step = Histogram(p + "step_seconds", "Engine seconds per batched step",
                               ["model"], buckets=_SECONDS, registry=r)  # fmt: skip
        self._wait = Histogram(p + "queue_wait_seconds", "From a request's arrival to its "
                               "first step", ["model"], buckets=_SECONDS, registry=r)  # fmt: skip
        self._latency = Histogram(p + "request_seconds", "From a request's arrival to its "
                                  "outputs", ["model", "protocol"], buckets=_SECONDS,
                                  registry=r)  # fmt: skip
        self._evictions = Counter(p + "evictions", "Sequences evicted after the idle timeout",
                                  ["model"], registry=r)  # fmt: skip
        self._errors = Counter(p + "errors", "Refused or failed requests (model: the served "
                               'model the request named, "" if none)',
                               ["kind", "protocol", "model"], registry=r)  # fmt: skip
        self._held = Gauge(p + "stream_held_bytes", "Bytes of gRPC stream answers waiting for "
                           "their clients to read them", registry=r)  # fmt: skip

        kinds = {c.kind for c in _subclasses(ServeError)} | {ServeError.kind}
        for m in models:
            for metric in (self._active, self._steps, self._calls, self._busy, self._batch,
                           self._call_steps, self._step, self._wait, self._evictions):  # fmt: skip
                metric.labels(m)
            for proto in PROTOCOLS:
                self._latency.labels(m, proto)
        for kind in sorted(kinds):
            for proto in PROTOCOLS:
                for m in ["", *models]:
                    self._errors.labels(kind, proto, m)

    def active(self, model: str, n: int) -> None:
        self._active.labels(model).set(n)

    def call(self, model: str, streams: int, ran: int, seconds: float, steps: int, done,
             live: int) -> None:  # fmt: skip
        """One engine call over ``streams`` streams that ran ``ran`` steps (``steps``
        stream-steps in all) in ``seconds``."""
        self._calls.labels(model).inc()
        self._busy.labels(model).inc(seconds)
        self._steps.labels(model).inc(steps)
        self._batch.labels(model).observe(streams)
        self._call_steps.labels(model).observe(ran)
        self._step.labels(model).observe(seconds / ran)
        self._active.labels(model).set(live)

    def request(self, model: str, protocol: str, seconds: float, queued: float) -> None:
        self._latency.labels(model, protocol).observe(seconds)
        self._wait.labels(model).observe(queued)

    def evicted(self, model: str, n: int) -> None:
        self._evictions.labels(model).inc(n)

    def stream_held(self, delta: int) -> None:
        self._held.inc(delta)

    def error(self, kind: str, protocol: str, model: str = "") -> None:
        self._errors.labels(kind, protocol, model).inc()

    def expose(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


def _subclasses(cls) -> list[type]:
    out = []
    for c in cls.__subclasses__():
        out += [c, *_subclasses(c)]
    return out
