"""Finding and loading the ahead-of-time compiled kernels (kernels.aot builds them), without
importing numba: this module, abi and the extension are all a process needs to run a model.

The build is keyed by a *fingerprint*: the kernel sources, the numba/llvmlite/numpy versions,
the Python ABI and this CPU (the code is compiled for its instruction set, like numba's JIT
output). A different fingerprint is a different directory, so a stale build is never loaded.

    <cache>/native/<fingerprint>/_leanrnn_native<EXT_SUFFIX>   the module
    <cache>/native/<fingerprint>/MANIFEST                      its fingerprint, size and sha256
    <cache>/native/<fingerprint>/FAILED                        why the last build failed
    <cache>/native/<fingerprint>/.used                         touched (daily) while in use

A module is loaded only if it has the size and sha256 its MANIFEST records: dlopen maps the file,
so a truncated one (a full disk, a copy cut short) would kill the process with SIGBUS at the first
touch of a missing page, and a garbled one could run garbage. Hashing the ~2.3 MB costs ~2.5 ms. Both
files are written in full and fsynced under a temporary name, then renamed into place (publish).

A failure that will recur (no C compiler, a compile error) is kept, so processes do not retry a
doomed build, for as long as the build's inputs beyond the fingerprint stay as they were
(build_inputs: CC, the compiler it resolves to, Python's headers): a process that runs with CC
unset or fixed, or after a compiler is installed, builds again. One that may not recur (killed,
out of memory or disk, sources edited mid-build) is retried after RETRY_AFTER seconds.

Old fingerprints' folders are pruned (prune): after a successful build, those of other
fingerprints, in ``<cache>/native`` and ``<cache>/numba``, that no process has used for
PRUNE_AFTER_DAYS days (mark_used) are removed; ``leanrnn compile --prune`` does it on demand.

``<cache>`` is config.cache_dir(): ``LEANRNN_CACHE_DIR``, else ``$XDG_CACHE_HOME/leanrnn``, else
``~/.cache/leanrnn`` (kernels.runner falls back to config.temp_cache_dir() to build when that
cannot be written).
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib.machinery
import importlib.util
import json
import os
import platform
import re
import shlex
import shutil
import sys
import sysconfig
import time
from importlib import metadata
from pathlib import Path

from .. import config

MODULE = "_leanrnn_native"
MANIFEST = "MANIFEST"
RETRY_AFTER = 600.0  # seconds before a transient build failure is retried
FAILED = "FAILED"
# A fingerprint's folders that no process has used for this many days go at the next successful
# build of another one (prune): each version's module and numba cache take a few MB, and one
# machine had gathered 562 MB of them in 137 folders.
PRUNE_AFTER_DAYS = 30
USED = ".used"  # in a fingerprint's folder: its mtime says when a process last used it
_MARK_EVERY = 86400.0  # seconds: a folder's USED is renewed at most this often (mark_used)
_FINGERPRINT = re.compile(r"[0-9a-f]{24}")  # fingerprint()'s folder names, all prune touches
_PRUNED = ".pruned-"  # a folder being removed: renamed first, so nobody loads from half of it
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


def _identity(path: str) -> list:
    """A file as a build depends on it: where it resolves to, its size and mtime (a reinstall
    or an upgrade changes them)."""
    real = os.path.realpath(path)
    try:
        st = os.stat(real)
    except OSError:
        return [real, None, None]
    return [real, st.st_size, int(st.st_mtime)]


def compiler_candidates() -> tuple[str, list[list[str]]]:
    """(``CC``, the compiler commands a build tries in order; kernels.aot._compiler takes the
    first whose program resolves): CC's command alone if CC is set (its text as one word if
    its quotes do not balance, none if it is blank), else the compiler Python was built with,
    cc, gcc and clang. Here, not in aot, so that build_inputs keys a failed build on the same
    list without loading the build machinery."""
    cc = os.environ.get("CC", "")
    if cc:
        try:
            cmd = shlex.split(cc)
        except ValueError:  # unbalanced quotes: the build fails on them
            cmd = [cc]
        return cc, [cmd] if cmd else []
    try:
        python_cc = shlex.split(sysconfig.get_config_var("CC") or "cc")
    except ValueError:
        python_cc = []
    return "", [c for c in (python_cc, ["cc"], ["gcc"], ["clang"]) if c]


def build_inputs(fp: str) -> dict:
    """What the build of fingerprint ``fp`` depends on beyond it: ``CC``, the first of
    compiler_candidates that resolves and the file it resolves to, and Python.h, whose absence
    (no python3-dev) fails the compile. Nothing here runs a program: a few stat calls, made
    only when a failure is on record."""
    cc, candidates = compiler_candidates()
    compiler = None
    for cmd in candidates:
        found = shutil.which(cmd[0])
        if found:
            compiler = _identity(found)
            break
    header = Path(sysconfig.get_paths()["include"]) / "Python.h"
    return {"fingerprint": fp, "CC": cc, "compiler": compiler,
            "Python.h": header.is_file()}  # fmt: skip


def _inputs_line(directory: Path, fp: str | None) -> str:
    return json.dumps(build_inputs(fp or directory.name), sort_keys=True)


def record_failure(directory: Path, why: str, transient: bool, fp: str | None = None) -> None:
    """Write ``directory``/FAILED: the kind, why, and the build_inputs it failed under (of
    ``fp``, default: the directory's name, as build_dir names it), on a last line of its own
    (``inputs: {json}``)."""
    directory.mkdir(parents=True, exist_ok=True)
    kind = "transient" if transient else "permanent"
    text = f"{kind}: {why.strip()}\ninputs: {_inputs_line(directory, fp)}\n"
    (directory / FAILED).write_text(text)


def failure(directory: Path, fp: str | None = None) -> str | None:
    """Why the build in ``directory`` (of fingerprint ``fp``, default: the directory's name)
    failed, if that still stands: it failed under the build_inputs of now, and if transient,
    less than RETRY_AFTER seconds ago. A record of other inputs, or of none (written by a
    leanrnn that kept none), does not stand: the next build tries again and records its own."""
    p = directory / FAILED
    try:
        text, age = p.read_text(), time.time() - p.stat().st_mtime
    except OSError:
        return None
    if text.startswith("transient") and age > RETRY_AFTER:
        return None
    text, _, inputs = text.rstrip().rpartition("\ninputs: ")
    if not text or inputs != _inputs_line(directory, fp):
        return None
    return text.split(":", 1)[-1].strip() or text


def mark_used(directory: Path) -> None:
    """Note that a process uses the fingerprint folder ``directory`` (prune spares it): its
    USED file's mtime, renewed at most once a day (otherwise this is one stat). A folder that
    is not there is left so; never raises."""
    marker = directory / USED
    try:
        if time.time() - marker.stat().st_mtime < _MARK_EVERY:
            return
    except FileNotFoundError:
        pass
    except OSError:
        return
    try:
        marker.touch()
    except OSError:  # not there, read-only: nothing to keep
        pass


def _last_used(folder: Path) -> float:
    """When a process last used ``folder``: the newest mtime in it (its USED marker, any file
    written) or atime of a file in it (read; where the file system keeps atimes, this is how
    the folders of leanrnn versions that kept no marker show their use). Directories' atimes
    do not count: listing them, as this does, renews those."""
    newest = folder.stat().st_mtime
    for top, dirs, files in os.walk(folder):
        for name in dirs:
            try:
                newest = max(newest, os.stat(os.path.join(top, name)).st_mtime)
            except OSError:
                pass
        for name in files:
            try:
                st = os.stat(os.path.join(top, name), follow_symlinks=False)
            except OSError:
                continue
            newest = max(newest, st.st_mtime, st.st_atime)
    return newest


def _size(folder: Path) -> int:
    total = 0
    for top, _, files in os.walk(folder):
        for name in files:
            try:
                total += os.stat(os.path.join(top, name), follow_symlinks=False).st_size
            except OSError:
                pass
    return total


@contextlib.contextmanager
def _not_building(lock: Path):
    """Within: True, holding the build lock ``lock`` (kernels.runner holds it while a process
    builds) if there is one; False if another process holds it."""
    try:
        f = open(lock)  # closed below, which releases the lock
    except FileNotFoundError:  # never built here
        yield True
        return
    with f:
        try:
            import fcntl

            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # pragma: no cover - not POSIX: whether it is held cannot be told
            yield False
        except OSError:
            yield False
        else:
            yield True


def prune(root: Path, keep: str, days: float = PRUNE_AFTER_DAYS) -> list[tuple[Path, int]]:
    """Remove the fingerprint folders under ``root``/native and ``root``/numba (a cache_dir()
    or the temp one) that are not of fingerprint ``keep`` and that no process has used for
    ``days`` days (mark_used, _last_used): a fingerprint's folders go together or not at all,
    never while its build lock is held. Each is renamed aside (under the lock), then deleted:
    a process loading from it finds the whole folder or none. Folders named otherwise (and
    $NUMBA_CACHE_DIR, the user's own) are never touched. Returns (folder, bytes) of each one
    removed; never raises (a prune must not fail a build or a run)."""
    cutoff = time.time() - days * 86400.0
    removed: list[tuple[Path, int]] = []
    groups: dict[str, list[Path]] = {}
    for kind in ("native", "numba"):
        try:
            for e in list(os.scandir(root / kind)):
                if not e.is_dir(follow_symlinks=False):
                    continue
                if e.name.startswith(_PRUNED):  # left by a prune that was cut short
                    shutil.rmtree(e.path, ignore_errors=True)
                elif _FINGERPRINT.fullmatch(e.name) and e.name != keep:
                    groups.setdefault(e.name, []).append(Path(e.path))
        except OSError:  # no such folder, or unreadable
            continue
    for fp, folders in sorted(groups.items()):
        aside: list[tuple[Path, int, Path]] = []
        try:
            if max(_last_used(f) for f in folders) > cutoff:
                continue
            with _not_building(root / "native" / fp / ".lock") as free:
                if not free or max(_last_used(f) for f in folders) > cutoff:  # in use now
                    continue
                for f in folders:
                    size, trash = _size(f), f.with_name(f"{_PRUNED}{f.name}.{os.getpid()}")
                    os.rename(f, trash)
                    aside.append((f, size, trash))
        except OSError:  # gone meanwhile (another prune), not ours to remove: left as it is
            pass
        for f, size, trash in aside:
            shutil.rmtree(trash, ignore_errors=True)
            removed.append((f, size))
    return removed
