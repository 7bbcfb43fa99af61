"""``leanrnn compile``: build the native kernels for this machine now (kernels.aot), e.g. while
building a container image, instead of on the first run."""

from __future__ import annotations

import argparse
import os
import time


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "compile",
        help="build the native kernels for this machine now (normally: on first use; "
        "about 2-5 minutes on 2 cores)",
    )
    p.add_argument("--cache-dir", help="where to put them (default: LEANRNN_CACHE_DIR or "
                   "~/.cache/leanrnn; set the same LEANRNN_CACHE_DIR when running)")  # fmt: skip
    p.add_argument("--force", action="store_true",
                   help="rebuild even if a build is there, and retry after a recorded failure")  # fmt: skip
    p.set_defaults(func=run)


def run(args) -> int:
    if args.cache_dir:
        from leanrnn.cli import output_dir

        output_dir(args.cache_dir, "compile --cache-dir")
        os.environ["LEANRNN_CACHE_DIR"] = os.path.abspath(args.cache_dir)
    from leanrnn.kernels import native, runner

    d = native.build_dir()
    if args.force:
        native.discard(d)
        (d / "FAILED").unlink(missing_ok=True)
    t0 = time.perf_counter()
    try:
        mod = runner.native_module(build=True)
    except ImportError as e:
        print(f"leanrnn: the native kernels in {runner.where()} are broken: {e}")
        return 1
    if mod is None:
        why = native.failure(runner.where()) or "unknown"
        print(f"leanrnn: could not build the native kernels: {why}")
        print("(leanrnn still runs, on numba's JIT; fix the cause and run `leanrnn compile "
              "--force`)")  # fmt: skip
        return 1
    print(f"native kernels: {mod.__file__} ({time.perf_counter() - t0:.1f} s)")
    return 0
