"""``leanrnn bench``: the command-line front of the harness (``register`` is called by
``leanrnn.cli``). Heavy imports happen inside ``run``."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..errors import LeanRNNError

# the most bytes a results.json --from-json reads (a full bench's is a few MiB)
MAX_RESULTS_BYTES = 256 << 20

EPILOG = """\
default suite: LSTM and GRU, single layer, input = hidden, H in {128, 512, 1024}; (N=1, T=100),
(N=64, T=100), (N=1, T=1000); streaming (N=1, 100 single steps, state carried); 1 and 2
threads; every installed engine. Writes results.json (raw samples), report.md and PNG plots to
--out. Each (engine, config) runs in a fresh process; expect tens of minutes for the full suite.

examples:
  leanrnn bench --quick
  leanrnn bench --engines leanrnn,onnxruntime,torch --cells lstm --hidden 512 --threads 1
  leanrnn bench --precision f32,int8-dynamic --cells lstm --hidden 512,1024 --batch 1
  leanrnn bench --seed-table
  leanrnn bench --from-json bench-out/results.json     # re-render the report only
"""


def _ints(s: str) -> tuple[int, ...]:
    try:
        vals = tuple(int(v) for v in s.split(",") if v.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r}: expected comma-separated integers") from None
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{s!r}: expected positive integers, e.g. 1,2")
    return _once(vals)


def _once(vals: tuple) -> tuple:
    """``vals`` with repeats dropped, in order: ``--hidden 16,16`` measured one row twice and
    the report merged the two as if they were rounds."""
    return tuple(dict.fromkeys(vals))


def _names(s: str) -> tuple[str, ...]:
    vals = tuple(v.strip() for v in s.split(",") if v.strip())
    if not vals:  # an empty list silently meant the default suite
        raise argparse.ArgumentTypeError(f"{s!r}: expected a comma list of names")
    return _once(vals)


def register(subparsers) -> None:
    from ..cli import nonnegative_int, positive_float, positive_int

    p = subparsers.add_parser(
        "bench",
        help="speed and memory side by side with numpy, torch, onnxruntime and MNN",
        description="Benchmark leanrnn against the engines users would pick instead, on the "
        "same weights and inputs, speed and memory together.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument(
        "--quick",
        action="store_true",
        help="small subset: LSTM+GRU, H 128/512, N=1 and 64 at T=100, streaming, 1 thread",
    )
    p.add_argument(
        "--seed-table",
        action="store_true",
        help="only what the seed's table needs: LSTM H=512, N=1, 1 thread",
    )
    p.add_argument(
        "--engines",
        type=_names,
        help="comma list of engine names (see --list-engines) or module:Class",
    )
    p.add_argument(
        "--precision",
        type=_names,
        help="comma list of f32,bf16,bf16-act,int8,int8-dynamic: adds leanrnn's "
        "reduced-precision rows (int8-dynamic also torch-qint8 and onnxruntime-int8); without "
        "f32 only those run",
    )
    p.add_argument("--cells", type=_names, help="comma list: lstm,gru")
    p.add_argument("--hidden", type=_ints, help="hidden sizes, e.g. 128,512,1024")
    p.add_argument(
        "--batch", type=_ints, help="batch sizes; with --steps replaces the default (N, T) shapes"
    )
    p.add_argument("--steps", type=_ints, help="sequence lengths T for the full-sequence runs")
    p.add_argument(
        "--stream-steps",
        type=nonnegative_int,
        help="steps of the streaming config (default 100; 0 = no streaming rows)",
    )
    p.add_argument("--threads", type=_ints, help="thread counts, e.g. 1,2")
    p.add_argument(
        "--out",
        type=Path,
        default=Path("bench-out"),
        help="output directory (default: ./bench-out)",
    )
    p.add_argument("--repeats", type=positive_int, help="max timed samples per row (default 15)")
    p.add_argument("--warmup", type=positive_int,
                   help="warm-up runs per row, at least 1: the last one sizes the timed samples "
                   "(with none, the load and first call did, and a slow first call left samples of "
                   "one call each; default 3)")  # fmt: skip
    p.add_argument(
        "--max-time",
        type=positive_float,
        help="seconds of sampling per row before repeats are cut (default 3)",
    )
    p.add_argument(
        "--rounds",
        type=positive_int,
        help="processes per row, interleaved in time; the median one is reported (default 1)",
    )
    p.add_argument(
        "--interleave",
        type=nonnegative_int,
        help="turns in which a config's engines take their samples, interleaved in time, "
        "their processes alive together; 0: one process after another (default 5)",
    )
    p.add_argument("--timeout", type=positive_float, help="seconds before a row's child is killed")
    p.add_argument("--no-memray", action="store_true", help="skip the native heap figures")
    p.add_argument("--no-bandwidth", action="store_true", help="skip the STREAM measurement")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument(
        "--no-progress",
        action="store_true",
        help="no progress (default: a live bar on a terminal, else one line per finished row)",
    )
    p.add_argument(
        "--from-json",
        type=Path,
        metavar="FILE",
        help="re-render report.md and plots from a saved results.json; runs nothing",
    )
    p.add_argument(
        "--list-engines", action="store_true", help="list engines and whether they can run here"
    )
    p.set_defaults(func=run)


def options_from_args(args):
    """The harness Options for parsed ``args`` (``--quick`` / ``--seed-table`` as the base,
    explicit flags on top)."""
    from .harness import Options
    from .report import SEED_ENGINES

    kw: dict = {"out": args.out}
    if args.seed_table:
        base = Options(
            engines=SEED_ENGINES,
            cells=("lstm",),
            hidden=(512,),
            shapes=((1, 100),),
            threads=(1,),
            stream_steps=100,
            out=args.out,
        )
    elif args.quick:
        base = Options.quick(out=args.out)
    else:
        base = Options(out=args.out)
    if args.engines:
        from .engines import ENGINES

        bad = [e for e in args.engines if e not in ENGINES and not _custom_engine(e)]
        if bad:
            raise LeanRNNError(
                f"[bench] --engines {','.join(bad)}: unknown; expected some of "
                f"{','.join(ENGINES)} or module:Class (a leanrnn.bench.engines.Engine "
                "subclass)"
            )
        kw["engines"] = args.engines
    if args.precision:
        kw["engines"] = with_precisions(kw.get("engines", base.engines), args.precision)
        if not kw["engines"]:  # ran nothing and wrote an empty report over --out
            raise LeanRNNError(
                f"[bench] --precision {','.join(args.precision)} with --engines "
                f"{','.join(args.engines or base.engines)} selects no engine: "
                "the reduced rows are leanrnn's (int8-dynamic's also torch's and onnxruntime's); "
                "add leanrnn to --engines, or f32 to --precision"
            )
    if args.cells:
        bad = [c for c in args.cells if c not in ("lstm", "gru")]
        if bad:
            raise LeanRNNError(f"[bench] --cells {','.join(bad)}: expected lstm and/or gru")
        kw["cells"] = args.cells
    if args.hidden:
        kw["hidden"] = args.hidden
    if args.batch or args.steps:
        kw["shapes"] = tuple((n, t) for n in (args.batch or (1,)) for t in (args.steps or (100,)))
    if args.stream_steps is not None:
        kw["stream_steps"] = args.stream_steps
    if args.threads:
        from .. import config
        from ..errors import SpecError

        over = [t for t in args.threads if t > config.cores()]
        if over:  # (leanrnn clamps to its cores and its peers do not: unequal, silently)
            raise SpecError(
                f"[bench] --threads {','.join(map(str, args.threads))}: this process may use "
                f"{config.cores()} cores, and leanrnn runs at most that many threads where its "
                f"peers would run {over[0]}; compare at {config.cores()} threads or fewer"
            )
        kw["threads"] = args.threads
    for flag, name in (
        ("repeats", "repeats"),
        ("warmup", "warmup"),
        ("max_time", "max_time_s"),
        ("timeout", "timeout_s"),
        ("rounds", "rounds"),
        ("interleave", "interleave"),
    ):
        if getattr(args, flag) is not None:
            kw[name] = getattr(args, flag)
    if args.no_memray:
        kw["memray"] = False
    if args.no_bandwidth:
        kw["bandwidth"] = False
    return base.__class__(**(base.__dict__ | kw))


def _custom_engine(name: str) -> bool:
    """Whether ``module:Class`` can name an engine: the module exists and its Class is an
    Engine subclass (else every row was 'n/a' and the run exited 0). A plugin that fails on its
    own import (a dependency missing) passes: the run reports it unavailable, as a peer's."""
    from .engines import resolve

    mod = name.partition(":")[0]
    if ":" not in name or not mod:
        return False
    try:
        resolve(name)
    except ModuleNotFoundError as e:
        return not (e.name and (mod == e.name or mod.startswith(e.name + ".")))
    except (AttributeError, TypeError):  # no such class, or not an Engine
        return False
    except Exception:  # the plugin's own failure: reported per row, as before
        return True
    return True


def _results(path: Path) -> dict:
    """A saved results.json (``--from-json``), or a one-line error naming the file."""
    from .._files import read_regular
    from ..errors import LeanRNNError

    try:
        # (a regular file of a results.json's size: a FIFO waited for a writer for ever, and
        # /dev/zero was read until memory ran out)
        results = json.loads(read_regular(path, MAX_RESULTS_BYTES))
    except OSError as e:  # (was the OS's words alone: "FileNotFoundError: [Errno 2] ...")
        raise LeanRNNError(f"[bench --from-json] cannot read {str(path)!r}: {e.strerror or e}; "
                           "pass the results.json a bench run wrote") from None  # fmt: skip
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise LeanRNNError(f"[bench --from-json] {str(path)!r} is not a bench results JSON "
                           f"({e}); pass the results.json a bench run wrote") from None  # fmt: skip
    if not isinstance(results, dict) or not isinstance(results.get("rows"), list):
        raise LeanRNNError(f"[bench --from-json] {str(path)!r} is not a bench results JSON (no "
                           "'rows' list); pass the results.json a bench run wrote")  # fmt: skip
    return results


def with_precisions(engines: tuple[str, ...], precisions: tuple[str, ...]) -> tuple[str, ...]:
    """``engines`` (the float32 ones) if "f32" is among ``precisions``, then each reduced
    precision's engines (engines.PRECISION_ENGINES) — a peer's only if its float32 engine is
    among ``engines`` (``--engines leanrnn,onnxruntime`` brings onnxruntime-int8, not torch's)."""
    from .engines import PRECISION_ENGINES

    bad = [p for p in precisions if p != "f32" and p not in PRECISION_ENGINES]
    if bad:
        raise LeanRNNError(f"[bench] --precision {','.join(bad)}: unknown; expected some "
                         f"of f32,{','.join(PRECISION_ENGINES)}")  # fmt: skip
    out = list(engines) if "f32" in precisions else []
    for p in precisions:
        for e in PRECISION_ENGINES.get(p, ()):
            family = "leanrnn" if e.startswith("leanrnn") else e.rsplit("-", 1)[0]
            if family in engines and e not in out:
                out.append(e)
    return tuple(out)


def _some_engine_runs(names) -> None:
    """Refuse a run none of whose engines can run here (it measured nothing, said "nowhere in
    this run" and exited 0), naming why each cannot."""
    from .harness import _engine_status

    status = _engine_status(names)
    if status and all(why is not None for why in status.values()):
        whys = "; ".join(f"{n}: {why}" for n, why in status.items())
        raise LeanRNNError(f"[bench] none of the engines asked for can run here ({whys})")


def run(args) -> int:
    from . import report

    if args.list_engines:
        from .engines import ENGINES

        for name, cls in ENGINES.items():
            why = cls.unavailable()
            print(f"{name:<15} {'ok' if why is None else why:<28} {cls.description}")
        return 0
    from ..cli import output_dir

    if args.from_json:
        results = _results(args.from_json)
        out = args.out if args.out != Path("bench-out") else args.from_json.parent
        output_dir(str(out), "bench --out")  # (a file there ended in FileExistsError)
    else:
        from .harness import run_suite

        output_dir(str(args.out), "bench --out")
        opts = options_from_args(args)
        _some_engine_runs(opts.engines)
        results = run_suite(opts, progress=not args.no_progress)
        out = opts.out
    try:
        # (the tables first: a results.json they cannot read leaves no half-written report)
        if args.seed_table:
            tables = [report.seed_table(results)]
        else:
            tables = [report.latency_table(results), "\nWhere leanrnn is not yet the best:"]
            tables += [f"- {line}" for line in report.summary(results) or ["nowhere in this run"]]
        files = report.write(results, out, plots=not args.no_plots)
    except (TypeError, KeyError, ValueError, AttributeError, IndexError) as e:
        if not args.from_json:
            raise
        # a hand-edited or foreign results.json: one line, not a traceback of the report's
        raise LeanRNNError(f"[bench --from-json] {str(args.from_json)!r} is not a bench "
                           f"results JSON this leanrnn reads ({type(e).__name__}: {e}); pass "
                           "the results.json a bench run wrote") from None  # fmt: skip
    why = None if args.no_plots else report.no_plots_reason()
    if why:
        print(f"bench: no plots: {why}", file=sys.stderr)
    print("\n".join(tables))
    # (--from-json writes no results.json into another --out: it named one there all the same)
    print(f"\nresults: {args.from_json or Path(out) / 'results.json'}")
    for name, path in files.items():
        print(f"{name}: {path}")
    return 0
