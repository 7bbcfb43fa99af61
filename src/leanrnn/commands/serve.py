"""``leanrnn serve MODEL [MODEL...]``: a KServe v2 / Triton-protocol server (HTTP and gRPC) with
continuous batching across streams (leanrnn.serve)."""

from __future__ import annotations

import argparse
import os
import sys

from ..cli import port, positive_float, positive_int, size
from ..errors import LeanRNNError


def _model(text: str) -> tuple[str, str]:
    """'NAME=PATH' or 'PATH' (named after the file, without its extension)."""
    name, sep, path = text.partition("=")
    if sep and os.path.exists(text):
        # a path with '=' in it (run=3.lrnn, lr=0.01/m.lrnn) was split as NAME=PATH: another
        # file served under another name, or "does not exist"
        stem = os.path.splitext(os.path.basename(text))[0].replace("=", "_")
        raise argparse.ArgumentTypeError(
            f"{text!r} is a file whose path holds '=', read as NAME=PATH; pass NAME=PATH "
            f"(e.g. {stem or 'model'}={text})"
        )
    if not sep:
        path = text
        name = os.path.splitext(os.path.basename(text))[0]
    if not name or not all(c.isalnum() or c in "-_." for c in name):
        raise argparse.ArgumentTypeError(
            f"{text!r}: model names use letters, digits, '-', '_' and '.'; pass NAME=PATH"
        )
    if not name.strip("."):  # clients resolve /v2/models/../infer to /v2/infer: unreachable
        raise argparse.ArgumentTypeError(
            f"{text!r}: a model name of dots only is a relative path segment in the URLs "
            "clients send; pass NAME=PATH with a letter or digit in NAME"
        )
    return name, path


def _wait_ms(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not 0 <= v < 60_000:
        raise argparse.ArgumentTypeError(f"{s}: expected milliseconds in 0..60000")
    return v


def _call_ms(s: str) -> float:
    """A call's latency target: a wait (_wait_ms) that must be more than 0 (a 0 ms target was
    run as 0.01 ms without a word: every call one step of one stream)."""
    v = _wait_ms(s)
    if v <= 0:
        raise argparse.ArgumentTypeError(f"{s}: expected milliseconds > 0 (and < 60000)")
    return v


def _request_bytes(s: str) -> int:
    """--max-request-bytes: a size gRPC can take (its message limits are 32-bit: 2G started
    HTTP, loaded the models and then died in gRPC's channel arguments)."""
    v = size(s)
    if v > 2**31 - 1:
        raise argparse.ArgumentTypeError(
            f"{s}: at most 2147483647 bytes (2G - 1), gRPC's largest message"
        )
    return v


def _token(s: str) -> str:
    # '' required the header 'Authorization: Bearer ' and nothing else: a locked door with
    # an empty key, most likely an unset shell variable ($TOKEN)
    if not s.strip():
        raise argparse.ArgumentTypeError(
            "an empty token; expected the secret clients send as 'Authorization: Bearer TOKEN' "
            "(check the variable it came from), or leave --token out for no authorization"
        )
    if not all(33 <= ord(c) < 127 for c in s):  # no client could send it: 401s for everyone
        raise argparse.ArgumentTypeError(
            "a token with whitespace, control or non-ASCII characters (a CR from a CRLF env "
            "file?), which clients' Authorization headers cannot carry as they are; use "
            "printable ASCII"
        )
    return s


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve models over the KServe v2 / Triton protocol (HTTP and gRPC), batched",
        description="Serves recurrent stacks (LSTM/GRU/RNN, forward: a .lrnn saved from one, "
        "a PyTorch, .safetensors or .npz state dict, or an ONNX graph that is only such a "
        "stack, as torch.onnx.export writes one) over the KServe v2 "
        "inference protocol with Triton's sequence extension, on HTTP/REST and gRPC, so "
        "tritonclient and other KServe clients work unchanged. The steps of all live streams "
        "run as batched engine calls. Needs `pip install leanrnn[serve]` (in a clone: "
        "`pip install -e '.[serve]'`).",
    )
    p.add_argument("models", nargs="+", type=_model, metavar="MODEL",
                   help="a model file, or NAME=PATH to choose the name clients use")  # fmt: skip
    p.add_argument("--host", default="127.0.0.1",
                   help="address to bind (default 127.0.0.1: this machine only; 0.0.0.0 "
                   "for every interface)")  # fmt: skip
    p.add_argument("--http-port", type=port, default=8000, help="0: any free port (default 8000)")
    p.add_argument("--grpc-port", type=port, default=None,
                   help="0: any free port (default 8001)")  # fmt: skip
    p.add_argument("--no-grpc", action="store_true", help="HTTP only")
    p.add_argument(
        "--threads",
        type=positive_int,
        default=None,
        help="engine threads (default: all cores but one, left to the transport)",
    )
    p.add_argument(
        "--max-batch",
        type=positive_int,
        default=None,
        help="most streams in one engine call (1: no batching across streams; default: the "
        "largest whose one-step call takes at most --max-call-ms here, measured at start-up "
        "as `leanrnn tune` does)",
    )
    p.add_argument(
        "--max-chunk",
        type=positive_int,
        default=16,
        help="most steps of one stream in one engine call (rounded down to a power of two; "
        "default 16)",
    )
    p.add_argument(
        "--max-wait-ms",
        type=_wait_ms,
        default=2.0,
        help="longest the engine, when idle, waits for more streams to batch (default 2)",
    )
    p.add_argument(
        "--max-call-ms",
        type=_call_ms,
        default=10.0,
        help="about the longest one engine call runs: a stream's chunk is split into calls of "
        "this many ms, so streams that join wait at most about that long (default 10)",
    )
    p.add_argument(
        "--max-streams",
        type=positive_int,
        default=1024,
        help="live sequences per model; beyond it new ones get HTTP 429 / RESOURCE_EXHAUSTED "
        "(default 1024)",
    )
    p.add_argument(
        "--idle-timeout",
        type=positive_float,
        default=60.0,
        help="seconds without a request before a sequence is evicted, and a gRPC stream with "
        "nothing in flight is closed (default 60)",
    )
    p.add_argument(
        "--max-request-bytes",
        type=_request_bytes,
        default=64 << 20,
        help="largest request body (default 64M)",
    )
    p.add_argument(
        "--max-queued-bytes",
        type=size,
        default=1 << 30,
        help="inputs and outputs of accepted requests not yet answered, all models together; "
        "beyond it new requests get HTTP 429 / RESOURCE_EXHAUSTED (default 1G)",
    )
    p.add_argument(
        "--max-concurrency",
        type=positive_int,
        default=None,
        help="requests (HTTP) and calls (gRPC; a stream is one) in flight per transport; beyond "
        "it HTTP 503 / RESOURCE_EXHAUSTED (default: 2 x --max-streams x models, at least 4096); "
        "connections at twice that",
    )
    p.add_argument(
        "--token",
        type=_token,
        default=os.environ.get("LEANRNN_SERVE_TOKEN") or None,  # set but empty: no token
        help="require 'Authorization: Bearer TOKEN' (default: $LEANRNN_SERVE_TOKEN; "
        "health endpoints stay open)",
    )
    p.add_argument(
        "--read-timeout",
        type=positive_float,
        default=30.0,
        help="seconds a connection may take to send a request's headers (from connecting, or "
        "from its last answer), and to send each next piece of a request body (which must "
        "average 64 KiB/s after that); slower ones are dropped (default 30)",
    )
    p.add_argument(
        "--grace",
        type=positive_float,
        default=30.0,
        help="on SIGTERM, seconds to finish accepted work before exiting (default 30)",
    )
    from .model import add_state_dict_options

    # applied to the state dicts among the MODELs (to every MODEL if none is one)
    add_state_dict_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    try:
        from ..serve.server import ServeConfig, serve
    except ModuleNotFoundError as e:
        raise LeanRNNError(
            f"[serve] {e.name} is not installed; pip install 'leanrnn[serve]' (in a clone: "
            "pip install -e '.[serve]')"
        ) from None
    from .. import config as _config
    from .model import cli_advice, load_model, load_options

    if args.no_grpc and args.grpc_port is not None:  # one of them would be ignored
        raise LeanRNNError(f"[serve] --grpc-port {args.grpc_port} and --no-grpc: pick one "
                           "(--no-grpc serves HTTP only)")  # fmt: skip
    names = [n for n, _ in args.models]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise LeanRNNError(f"[serve] two models named {dup}; pass NAME=PATH to tell them apart")
    threads = args.threads or _config.serving_threads()
    cfg = ServeConfig(
        models=dict(args.models), host=args.host, http_port=args.http_port,
        grpc_port=None if args.no_grpc else 8001 if args.grpc_port is None else args.grpc_port,
        threads=threads,
        max_batch=args.max_batch, max_chunk=args.max_chunk, max_wait=args.max_wait_ms / 1000,
        max_call=args.max_call_ms / 1000,
        max_streams=args.max_streams, idle_timeout=args.idle_timeout,
        max_request_bytes=args.max_request_bytes, token=args.token, grace=args.grace,
        max_queued_bytes=args.max_queued_bytes, max_concurrency=args.max_concurrency,
        read_timeout=args.read_timeout,
    )  # fmt: skip
    with cli_advice():
        if not load_options(args):
            return serve(cfg)
        # the server loads files plainly: load them here with the state-dict flags. Beside a
        # state dict, a .lrnn or ONNX file is served as it records itself: the flags are the
        # state dict's (a checkpoint's --prefix refused every .lrnn served with it, and a
        # float16 state dict's --dtype float32 converted a float64 .lrnn, silently); with no
        # state dict among the models they apply to all (--dtype converts a .lrnn stack)
        import asyncio

        from ..formats.checkpoint import sniff
        from ..loading import load
        from ..serve import server

        def state_dict(path) -> bool:
            try:
                return sniff(path) in ("safetensors", "npz", "torch-zip", "pickle")
            except OSError:  # load says what is wrong with it
                return False

        some = any(state_dict(path) for _, path in args.models)
        recorded = [name for name, path in args.models if some and not state_dict(path)]
        if recorded:  # said, not left to be found out (--dtype not applied to them)
            flags = " ".join(f"--{k.replace('_', '-')}" for k in load_options(args))
            print(f"leanrnn serve: {flags} applied to the state dicts among the models; "
                  f"{', '.join(recorded)} served as their files record them",
                  file=sys.stderr)  # fmt: skip

        def flagged(path) -> bool:
            return not some or state_dict(path)

        def loaded():  # once the port is bound (serve_async): a taken one fails first
            return {name: load_model(path, args) if flagged(path) else load(path)
                    for name, path in args.models}  # fmt: skip

        asyncio.run(server.serve_async(cfg, loaded=loaded,
                                       ready_line=lambda s: print(s, flush=True)))  # fmt: skip
        return 0
