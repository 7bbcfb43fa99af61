"""The engine issue's bar table, through the bench harness.

Single-layer LSTM, input = hidden, H in {128, 512, 1024}, (N=1, T=100) and (N=64, T=100), on 1
and 2 threads: leanrnn vs onnxruntime's LSTM op vs torch.nn.LSTM, same weights, each in its own
process, median of repeated runs. The bar: leanrnn no slower than the faster peer in every row.
Every row is measured in three processes at different times (``--rounds``), and the one with the
median time is reported: this machine is shared, and a process can land in a spell where the
same job runs 20% slower.

    python benchmarks/engine_bars.py [--out DIR] [--hidden 128,512] [--threads 1] [--rounds 3]

Same as ``leanrnn bench --engines leanrnn,onnxruntime,torch --cells lstm --batch 1,64
--steps 100 --stream-steps 0 --no-bandwidth``, whose report.md carries this table too.
Exit status 1 if a row misses the bar (or leanrnn's output is wrong).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from leanrnn.bench import report
from leanrnn.bench.cli import _ints
from leanrnn.bench.harness import Options, run_suite
from leanrnn.cli import positive_float, positive_int


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=Path("bench-out/engine-bars"))
    ap.add_argument("--hidden", type=_ints, default=(128, 512, 1024))
    ap.add_argument("--threads", type=_ints, default=(1, 2))
    ap.add_argument("--max-time", type=positive_float, default=1.5, help="sampling seconds per row")
    ap.add_argument(
        "--rounds",
        type=positive_int,
        default=3,
        help="processes per row, interleaved in time; the median one is reported",
    )
    args = ap.parse_args(argv)

    opts = Options(
        engines=("leanrnn", *report.BAR_PEERS),
        cells=("lstm",),
        hidden=args.hidden,
        shapes=((1, 100), (64, 100)),
        stream_steps=0,
        threads=args.threads,
        max_time_s=args.max_time,
        rounds=args.rounds,
        bandwidth=False,
        out=args.out,
    )
    results = run_suite(opts)
    files = report.write(results, opts.out)
    table = report.bars_table(results)
    print(table or "no rows: is onnxruntime or torch installed?")
    print(f"\nreport: {files['report']}\nresults: {opts.out / 'results.json'}")
    rows = report.bar_rows(results)
    return 0 if rows and all(r["passed"] for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
