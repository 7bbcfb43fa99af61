"""``leanrnn info``: version, threads, kernel backend and build, BLAS, CPU features, caches,
first-compile cost."""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time


def register(sub: argparse._SubParsersAction) -> None:
    from leanrnn.kernels.runner import BUILD_TIME  # (imported by the CLI already)

    p = sub.add_parser("info", help="describe this machine and the leanrnn install")
    p.add_argument(
        "--compile",
        action="store_true",
        help=f"measure the one-time compile cost with cold caches ({BUILD_TIME})",
    )
    p.add_argument("--json", action="store_true", help="print JSON instead of text")
    p.set_defaults(func=run)


def _cpu_features() -> list[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    keep = ("sse4_2", "avx", "avx2", "fma", "avx512f", "avx512bw", "avx512_bf16",
                            "avx512_vnni", "amx_tile")  # fmt: skip
                    return [f for f in keep if f in flags]
    except OSError:
        pass
    return []


def _time_first_run(cache_dir: str | None) -> float:
    """Seconds for `import leanrnn` + the first run of a default LSTM, in a fresh process."""
    code = (
        "import time; t=time.perf_counter(); import numpy as np, leanrnn; "
        "m=leanrnn.LSTM(64, 128, seed=0); m(np.zeros((10, 1, 64), np.float32)); "
        "print(time.perf_counter()-t)"
    )
    env = dict(os.environ)
    if cache_dir:  # both caches cold: numba's JIT cache and the native build
        env["NUMBA_CACHE_DIR"] = os.path.join(cache_dir, "numba")
        env["LEANRNN_CACHE_DIR"] = os.path.join(cache_dir, "leanrnn")
    # stderr passes through: a cold build shows its progress there (kernels.runner.Progress).
    # -P: not the working directory on the child's sys.path (its modules could shadow others)
    out = subprocess.run([sys.executable, "-P", "-c", code], env=env, stdout=subprocess.PIPE,
                         text=True, check=False)  # fmt: skip
    if out.returncode != 0:
        from leanrnn.errors import LeanRNNError

        raise LeanRNNError(
            f"[info] timing a fresh process failed (exit {out.returncode}); its error is above"
        )
    return float(out.stdout.strip().splitlines()[-1])


def collect(measure_compile: bool) -> dict:
    import numba
    import numpy as np
    from threadpoolctl import threadpool_info

    import leanrnn
    from leanrnn import config
    from leanrnn.kernels import _cpu, native

    native_kernels, built = _native_kernels()
    info = {
        "leanrnn": leanrnn.__version__,
        "python": sys.version.split()[0],
        "numpy": np.__version__,
        "numba": numba.__version__,
        "platform": platform.platform(),
        "cpu": _cpu.cpu_name(),
        "cpu_features": _cpu_features(),
        "kernels_for": _cpu.compiled_for(),
        "cores": config.cores(),
        "threads": config.get_num_threads(),
        "kernel_backend": config.backend(),
        "native_kernels": native_kernels,
        "jit_threading_layer": _threading_layer(),
        "blas": [
            {k: d.get(k) for k in ("internal_api", "version", "num_threads", "architecture")}
            for d in threadpool_info()
            if d.get("user_api") == "blas"
        ],
        "numba_cache_dir": str(config.numba_cache_dir(native.fingerprint())),
        # which GEMM training's big products run on (engine.products), measured only where
        # the kernels are in place (measuring needs them)
        "training_gemm": (
            _gemm() if built or config.backend() == "jit" else "(measured on first training use)"
        ),
        # A process's start-up with the kernels in place (the native build, or the JIT backend:
        # numba compiles and caches as it runs); timed only there: timing it before started the
        # build (minutes, on a fresh install, and a failure it recorded)
        "warm_start_seconds": (
            round(_time_first_run(None), 3) if built or config.backend() == "jit" else None
        ),
    }
    if measure_compile:
        with tempfile.TemporaryDirectory() as d:
            t0 = time.perf_counter()
            info["cold_compile_seconds"] = round(_time_first_run(d), 1)
            info["cold_compile_wall_seconds"] = round(time.perf_counter() - t0, 1)
    return info


def _native_kernels() -> tuple[str, bool]:
    """(where the ahead-of-time compiled kernels are, or why there are none; whether they are
    built). No build here."""
    from leanrnn import config
    from leanrnn.kernels import native, runner

    try:
        mod = runner.native_module(build=False)
    except (ImportError, OSError) as e:
        return f"broken: {e}", False
    if mod is not None:
        if config.backend() == "jit":  # (the module is there, and this process's calls
            # will not use it: it was named as if they did)
            return f"not used (LEANRNN_BACKEND=jit; built: {mod.__file__})", True
        return mod.__file__, True
    why = native.failure(runner.where())
    if why:
        return "build failed: " + why.splitlines()[0], False
    return "not built yet (built on first use)", False


def _gemm() -> str:
    from leanrnn.engine import products

    d = products.gemm_decision()
    if "by" in d:
        return f"{d['choice']} (set by {d['by']})"
    return (f"{d['choice']} (float32, one core: the engine's tile {d['native_gflops']} GFLOP/s, "
            f"BLAS {d['blas_gflops']}; LEANRNN_GEMM=native|blas overrides)")  # fmt: skip


def _threading_layer() -> str:
    import numba

    try:
        return numba.threading_layer()
    except ValueError:  # no parallel kernel has run yet: report what numba would pick
        return f"not started (configured: {numba.config.THREADING_LAYER})"


def run(args) -> int:
    from leanrnn import config

    # This process read the environment when leanrnn was imported; the fresh processes timed
    # below read it again: a bad value must be an error here, not a traceback from a child.
    config.check_env(reread=True)
    info = collect(args.compile)
    if args.json:
        print(json.dumps(info, indent=2))
        return 0
    for k, v in info.items():
        if k == "warm_start_seconds" and v is None:
            v = "(not measured: the native kernels are not built yet; `leanrnn compile` builds them)"
        print(f"{k:22s} {v}")
    if not args.compile:
        print(f"{'cold_compile_seconds':22s} (run `leanrnn info --compile` to measure)")
    return 0
