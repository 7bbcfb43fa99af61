"""Finding and loading the ahead-of-time compiled kernels (kernels.aot builds them), without
importing numba: this module, abi and the extension are all a process needs to run a model.

The build is keyed by a *fingerprint*: the kernel sources, the numba/llvmlite/numpy versions,
the Python ABI and this CPU (the code is compiled for its instruction set, like numba's JIT
output). A different fingerprint is a different directory, so a stale build is never loaded.

    <cache>/native/<fingerprint>/_leanrnn_native<EXT_SUFFIX>   the module
    <cache>/native/<fingerprint>/FAILED                        why the last build failed

A failure that will recur (no C compiler, a compile error) is kept until the file is deleted,
so processes do not retry a doomed build; one that may not (killed, out of memory or disk,
sources edited mid-build) is retried after RETRY_AFTER seconds.

``<cache>`` is ``LEANRNN_CACHE_DIR``, else ``$XDG_CACHE_HOME/leanrnn``, else ``~/.cache/leanrnn``.
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import os
import platform
import sys
import sysconfig
import time
from importlib import metadata
from pathlib import Path

MODULE = "_leanrnn_native"
RETRY_AFTER = 600.0  # seconds before a transient build failure is retried
_HERE = Path(__file__).parent
# Everything the compiled code depends on: the kernels, their block size, the glue.
_SOURCES = [
    *sorted(_HERE.glob("*.py")),
    _HERE / "native.c",
    _HERE.parent / "formats" / "packing.py",
]
_NOT_COMPILED = ("native.py", "runner.py", "reference.py")  # never reach the compiled code


def cache_root() -> Path:
    d = os.environ.get("LEANRNN_CACHE_DIR")
    if d:
        return Path(d)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return Path(xdg) / "leanrnn" if xdg else Path.home() / ".cache" / "leanrnn"


def _cpu() -> str:
    """What the compiled code may assume of the CPU: its model and feature flags."""
    try:
        with open("/proc/cpuinfo") as f:
            seen = [ln for ln in f if ln.startswith(("model name", "flags", "Features"))]
        return "".join(sorted(set(seen)))
    except OSError:  # not Linux: the platform's own description
        return platform.machine() + platform.processor()


def fingerprint() -> str:
    h = hashlib.sha256()
    for p in _SOURCES:
        if p.name in _NOT_COMPILED:
            continue
        h.update(p.name.encode())
        h.update(p.read_bytes())
    from ..formats.packing import B

    h.update(f"B={B}".encode())
    for dist in ("numba", "llvmlite", "numpy"):
        try:
            h.update(f"{dist}={metadata.version(dist)}".encode())
        except metadata.PackageNotFoundError:
            h.update(f"{dist}=none".encode())
    h.update(sys.implementation.cache_tag.encode())
    h.update(str(sysconfig.get_config_var("EXT_SUFFIX")).encode())
    h.update(_cpu().encode())
    from ._cpu import signature  # the register tile and cache blocking compiled in

    h.update(signature().encode())
    return h.hexdigest()[:24]


def build_dir(fp: str | None = None) -> Path:
    return cache_root() / "native" / (fp or fingerprint())


def module_path(directory: Path) -> Path:
    return directory / (MODULE + str(sysconfig.get_config_var("EXT_SUFFIX") or ".so"))


def load(directory: Path, fp: str):
    """The extension module in ``directory``, or None if there is none; raises ImportError if
    it is there but broken or built from other sources."""
    path = module_path(directory)
    if not path.exists():
        return None
    loader = importlib.machinery.ExtensionFileLoader(MODULE, str(path))
    spec = importlib.util.spec_from_file_location(MODULE, str(path), loader=loader)
    mod = importlib.util.module_from_spec(spec)
    loader.exec_module(mod)
    if getattr(mod, "fingerprint", None) != fp:
        raise ImportError(f"{path} was built for {getattr(mod, 'fingerprint', '?')}, not {fp}")
    return mod


def record_failure(directory: Path, why: str, transient: bool) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    kind = "transient" if transient else "permanent"
    (directory / "FAILED").write_text(f"{kind}: {why.strip()}\n")


def failure(directory: Path) -> str | None:
    """Why the build in ``directory`` failed, if that still stands (see the module docstring)."""
    p = directory / "FAILED"
    try:
        text, age = p.read_text(), time.time() - p.stat().st_mtime
    except OSError:
        return None
    if text.startswith("transient") and age > RETRY_AFTER:
        return None
    return text.split(":", 1)[-1].strip() or text
