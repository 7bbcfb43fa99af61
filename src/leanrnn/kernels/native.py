"""Finding and loading the ahead-of-time compiled kernels (kernels.aot builds them), without
importing numba: this module, abi and the extension are all a process needs to run a model.

The build is keyed by a *fingerprint*: the kernel sources, the numba/llvmlite/numpy versions,
the Python ABI and this CPU (the code is compiled for its instruction set, like numba's JIT
output). A different fingerprint is a different directory, so a stale build is never loaded.

    <cache>/native/<fingerprint>/_leanrnn_native<EXT_SUFFIX>   the module
    <cache>/native/<fingerprint>/MANIFEST                      its fingerprint, size and sha256
    <cache>/native/<fingerprint>/FAILED                        why the last build failed

A module is loaded only if it has the size and sha256 its MANIFEST records: dlopen maps the file,
so a truncated one (a full disk, a copy cut short) would kill the process with SIGBUS at the first
touch of a missing page, and a garbled one could run garbage. Hashing ~0.5 MB costs ~1 ms. Both
files are written in full and fsynced under a temporary name, then renamed into place (publish).

A failure that will recur (no C compiler, a compile error) is kept until the file is deleted,
so processes do not retry a doomed build; one that may not (killed, out of memory or disk,
sources edited mid-build) is retried after RETRY_AFTER seconds.

``<cache>`` is config.cache_dir(): ``LEANRNN_CACHE_DIR``, else ``$XDG_CACHE_HOME/leanrnn``, else
``~/.cache/leanrnn`` (kernels.runner falls back to config.temp_cache_dir() to build when that
cannot be written).
"""

from __future__ import annotations

import hashlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import sys
import sysconfig
import time
from importlib import metadata
from pathlib import Path

from .. import config

MODULE = "_leanrnn_native"
MANIFEST = "MANIFEST"
RETRY_AFTER = 600.0  # seconds before a transient build failure is retried
_HERE = Path(__file__).parent
# Everything the compiled code depends on: the kernels (their layout constants included, in
# abi.py) and the glue. Nothing outside kernels/: a docstring edit elsewhere rebuilds nothing.
_SOURCES = [*sorted(_HERE.glob("*.py")), _HERE / "native.c"]
_NOT_COMPILED = ("native.py", "runner.py", "reference.py")  # never reach the compiled code


def cache_root() -> Path:
    return config.cache_dir()


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


def build_dir(fp: str | None = None, root: Path | None = None) -> Path:
    return (root or cache_root()) / "native" / (fp or fingerprint())


def module_path(directory: Path) -> Path:
    return directory / (MODULE + str(sysconfig.get_config_var("EXT_SUFFIX") or ".so"))


def _write_durably(path: Path, data: bytes) -> None:
    """``path`` holds ``data`` in full or is untouched: written and fsynced under another name,
    then renamed over it (a crash leaves a stray .tmp, never a short file)."""
    staged = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        with open(staged, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(staged, path)
    finally:
        staged.unlink(missing_ok=True)


def publish(directory: Path, built: Path, fp: str) -> Path:
    """Install the module file ``built`` (of fingerprint ``fp``) into ``directory``, with its
    MANIFEST; returns the module's path. The manifest goes first: a loader that comes between
    the two renames finds no module (or the old one, which the manifest no longer vouches for)
    and builds or waits for the build lock, never loads a half-published one."""
    data = built.read_bytes()
    directory.mkdir(parents=True, exist_ok=True)
    final = module_path(directory)
    manifest = {"fingerprint": fp, "module": final.name, "size": len(data),
                "sha256": hashlib.sha256(data).hexdigest()}  # fmt: skip
    _write_durably(directory / MANIFEST, json.dumps(manifest, indent=1).encode())
    _write_durably(final, data)
    try:  # make the renames themselves durable
        fd = os.open(directory, os.O_RDONLY)
    except OSError:  # pragma: no cover - not POSIX
        return final
    try:
        os.fsync(fd)
    except OSError:  # pragma: no cover - some file systems refuse fsync on a directory
        pass
    finally:
        os.close(fd)
    return final


def discard(directory: Path) -> None:
    """Remove the build in ``directory`` (a process that has it loaded keeps its mapping)."""
    module_path(directory).unlink(missing_ok=True)
    (directory / MANIFEST).unlink(missing_ok=True)


def verify(directory: Path, fp: str) -> Path | None:
    """The module in ``directory`` if its MANIFEST vouches for it (fingerprint ``fp``, size,
    sha256); None if there is no module; ImportError saying what is wrong otherwise. Nothing
    here maps the file, so a broken one cannot crash the process."""
    path = module_path(directory)
    try:
        with open(path, "rb") as f:
            data = f.read()
    except FileNotFoundError:
        return None
    except OSError as e:
        raise ImportError(f"{path} cannot be read: {e}") from None
    where = directory / MANIFEST
    try:
        with open(where, "rb") as f:
            manifest = json.loads(f.read(4096))  # a few hundred bytes; never read a huge one
        want = (manifest["fingerprint"], manifest["module"], manifest["size"], manifest["sha256"])
    except FileNotFoundError:
        raise ImportError(f"{path} has no {MANIFEST} (an interrupted or foreign build)") from None
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise ImportError(f"{where} is unreadable ({type(e).__name__}: {e})") from None
    got = (fp, path.name, len(data), hashlib.sha256(data).hexdigest())
    for what, w, g in zip(("fingerprint", "module", "size", "sha256"), want, got, strict=True):
        if w != g:
            raise ImportError(f"{path} does not match its {MANIFEST}: {what} is {g!r}, the "
                              f"manifest says {w!r} (truncated, overwritten or foreign)")  # fmt: skip
    return path


def load(directory: Path, fp: str):
    """The extension module in ``directory``, or None if there is none; raises ImportError if
    it is there but broken (see verify) or built from other sources."""
    path = verify(directory, fp)
    if path is None:
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
