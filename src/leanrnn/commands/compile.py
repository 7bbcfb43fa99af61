"""``leanrnn compile``: build the native kernels for this machine now (kernels.aot), e.g. while
building a container image, instead of on the first run; ``--prune``: remove the cached kernels
of other fingerprints that nothing has used lately (kernels.native.prune) instead."""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    from leanrnn.kernels.native import PRUNE_AFTER_DAYS  # (imported by the CLI already)
    from leanrnn.kernels.runner import BUILD_TIME  # (so is this)

    p = sub.add_parser(
        "compile",
        help=f"build the native kernels for this machine now (normally: on first use; {BUILD_TIME})",
    )
    p.add_argument("--cache-dir", help="where to put them (default: LEANRNN_CACHE_DIR or "
                   "~/.cache/leanrnn; set the same LEANRNN_CACHE_DIR when running)")  # fmt: skip
    p.add_argument("--force", action="store_true",
                   help="rebuild even if a build is there, and retry after a recorded failure")  # fmt: skip
    p.add_argument("--prune", action="store_true",
                   help="build nothing; remove the cached kernels (native and numba's) of other "
                   "leanrnn, numba, numpy or Python versions and CPUs that no process has used "
                   "for --unused-days days, and say how much that freed (after each build this "
                   f"happens by itself, at {PRUNE_AFTER_DAYS} days)")  # fmt: skip
    p.add_argument("--unused-days", type=_days, default=None, metavar="DAYS",
                   help=f"with --prune: unused for this many days (default {PRUNE_AFTER_DAYS}; "
                   "0: every other fingerprint's)")  # fmt: skip
    p.set_defaults(func=run)


def _days(s: str) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number of days") from None
    if not 0 <= v < 1e6:  # (nan fails too)
        raise argparse.ArgumentTypeError(f"{s}: expected a number of days >= 0")
    return v


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB" if n >= 100_000 else f"{n / 1e3:.1f} kB"


def prune(days: float) -> int:
    """``--prune``: the cache's (and the private temp fallback's) other fingerprints."""
    from leanrnn import config
    from leanrnn.kernels import native

    fp = native.fingerprint()
    roots = [native.cache_root()]
    tmp = config.temp_cache_dir(create=False)
    if tmp is not None and tmp != roots[0]:
        roots.append(tmp)
    total = count = 0
    for root in roots:
        for folder, size in native.prune(root, keep=fp, days=days):
            print(f"removed {folder} ({_mb(size)})")
            total, count = total + size, count + 1
    kept = f"kept this install's ({fp}) and any used in the last {days:g} days"
    if count:
        print(f"leanrnn: freed {_mb(total)} in {count} folders of {roots[0]}; {kept}")
    else:
        print(f"leanrnn: nothing to prune in {roots[0]}; {kept}")
    return 0


def run(args) -> int:
    if args.cache_dir:
        from leanrnn import config
        from leanrnn.cli import output_dir
        from leanrnn.errors import LeanRNNError

        # ~ as LEANRNN_CACHE_DIR reads it (a literal ./~ built where runs never look)
        cache = os.path.expanduser(args.cache_dir)
        output_dir(cache, "compile --cache-dir")
        if not config.writable(Path(cache)):  # (it fell back to /tmp, and built there)
            raise LeanRNNError(f"[compile --cache-dir] {cache!r} cannot be written; pick a "
                               "directory this user can write")  # fmt: skip
        os.environ["LEANRNN_CACHE_DIR"] = os.path.abspath(cache)
    from leanrnn.errors import LeanRNNError
    from leanrnn.kernels import native, runner

    if args.unused_days is not None and not args.prune:
        raise LeanRNNError("[compile] --unused-days is an option of --prune; add --prune")
    if args.prune:
        if args.force:
            raise LeanRNNError("[compile] --prune only prunes, it builds nothing; run `leanrnn "
                               "compile --force` on its own")  # fmt: skip
        return prune(native.PRUNE_AFTER_DAYS if args.unused_days is None else args.unused_days)

    d = native.build_dir()
    if args.force:
        native.discard(d)
        (d / native.FAILED).unlink(missing_ok=True)
    t0 = time.perf_counter()
    try:
        mod = runner.native_module(build=True)
    except ImportError as e:
        print(f"leanrnn: error: the native kernels in {runner.where()} are broken: {e}",
              file=sys.stderr)  # fmt: skip
        return 1
    if mod is None:
        why = native.failure(runner.where()) or "unknown"
        print(f"leanrnn: error: could not build the native kernels: {why}\n"
              "(leanrnn still runs, on numba's JIT; fix the cause and run `leanrnn compile "
              "--force`; a change of CC or of the compiler it finds is retried by itself)",
              file=sys.stderr)  # fmt: skip
        return 1
    print(f"native kernels: {mod.__file__} ({time.perf_counter() - t0:.1f} s)")
    return 0
