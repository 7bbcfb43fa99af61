"""``leanrnn tune MODEL``: measure engine calls against batch size on this machine and print the
largest batch and chunk meeting a latency target and a memory limit (leanrnn.tuning.tune, the
choice ``leanrnn serve`` makes when --max-batch is not given)."""

from __future__ import annotations

import argparse
import json
import math
import sys

from ..cli import positive_int, size
from .serve import _call_ms


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "tune",
        help="measure call latency against batch size; print the batch and chunk to serve with",
        description="Times engine calls of MODEL (a file, or a shorthand such as lstm:512x2) "
        "at growing batch sizes and chunks on this machine (a few seconds) and prints the "
        "largest batch, then chunk, whose call meets --latency-ms and --memory-limit: what "
        "`leanrnn serve` uses by default for --max-batch and --max-chunk.",
    )
    p.add_argument("model", help="model file or cell:hidden[xlayers], e.g. lstm:512x2")
    p.add_argument("--latency-ms", type=_call_ms, default=10.0,
                   help="longest one engine call may take (default 10, serve's --max-call-ms)")  # fmt: skip
    p.add_argument("--memory-limit", type=size, default=None,
                   help="bytes one call may hold, e.g. 64M (default: 1/4 of available, <= 256M)")  # fmt: skip
    p.add_argument("--max-batch", type=positive_int, default=256, help="largest batch tried")
    p.add_argument("--max-chunk", type=positive_int, default=16, help="largest chunk tried")
    p.add_argument("--threads", type=positive_int, default=None,
                   help="engine threads (default: serve's, all cores but one)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    from .model import add_state_dict_options

    add_state_dict_options(p)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from ..errors import SpecError
    from ..tuning import tune
    from .plan import _sessions, load_model

    pairs = _sessions(load_model(args.model, args, "tune"))
    if len(pairs) != 1:
        raise SpecError(
            f"[tune] {args.model!r} has {len(pairs)} recurrent sessions; tune takes one "
            "recurrent stack (an LSTM/GRU/RNN file, or a shorthand such as lstm:512x2)"
        )
    from .. import config

    # serve's threads by default: tune on all cores chose batch 1 on a loaded machine where
    # serve, on one fewer, chose 256 (and the printed serve command left --threads out)
    threads = args.threads or config.serving_threads()
    m = tune(pairs[0][1], latency=args.latency_ms / 1000,
             memory_limit=args.memory_limit, max_batch=args.max_batch,
             max_chunk=args.max_chunk, threads=threads)  # fmt: skip
    if args.json:
        # a call past the memory limit is not timed (seconds=inf): null, since Python's
        # 'Infinity' is not JSON and strict readers (jq, JSON.parse) refused the whole output
        points = [dict(batch=p.batch, chunk=p.chunk, bytes=p.nbytes,
                       seconds=p.seconds if math.isfinite(p.seconds) else None)
                  for p in m.points]  # fmt: skip
        print(json.dumps(dict(batch=m.batch, chunk=m.chunk, latency=m.latency,
                              meets_target=m.meets_target, memory_limit=m.memory_limit,
                              threads=m.threads, points=points),
                         allow_nan=False))  # fmt: skip
        return 0
    title = (f"{args.model}: calls measured with {m.threads} thread(s); target "
             f"{m.latency * 1e3:g} ms per call, {m.memory_limit / (1 << 20):.0f} MiB")  # fmt: skip
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        print(title)
        print(m.table())
    else:
        t = Table(title=title)
        for h in m.HEADER:
            t.add_column(h, justify="right")
        for r in m.rows():
            t.add_row(*r, style="bold" if r[-1].startswith("chosen") else None)
        Console().print(t)
    chunk = "whole sequences" if m.chunk is None else m.chunk
    print(f"batch {m.batch}, chunk {chunk}  (leanrnn serve --threads {m.threads} "
          f"--max-batch {m.batch}" + (f" --max-chunk {m.chunk})" if m.chunk else ")"))  # fmt: skip
    if not m.meets_target:
        print(f"warning: no call meets the {m.latency * 1e3:g} ms target on this machine, "
              "not even batch 1: this is the fastest there is; raise --latency-ms, or expect "
              "calls over it", file=sys.stderr)  # fmt: skip
    return 0
