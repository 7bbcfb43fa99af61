"""``leanrnn serve``: recurrent models behind the KServe v2 protocol (Triton's, with its sequence
extension) over HTTP/REST and gRPC, with continuous batching across streams.

Layers: ``scheduler`` (slots, sequences, batched engine calls; numpy and the engine only) <-
``protocol`` (tensors, metadata, config) <- ``core`` (auth, infer on the event loop) <- ``http``
(Starlette) and ``rpc`` (grpc.aio) <- ``server`` (the process). The transport libraries
(``pip install leanrnn[serve]``) are imported by ``http``, ``rpc``, ``metrics`` and ``server``
only: ``import leanrnn`` and ``leanrnn.serve.scheduler`` need none of them.

    $ leanrnn serve speech.lrnn --http-port 8000 --grpc-port 8001
"""

from __future__ import annotations

from .scheduler import Lane, Scheduler

__all__ = ["Lane", "Scheduler"]
