"""Writing a file whole or not at all: every output leanrnn writes (models, run's arrays, score's
results, plots) goes to a temporary file beside its path, renamed over it once complete."""

from __future__ import annotations

import contextlib
import itertools
import os
import stat

from .errors import LeanRNNError


def temp_beside(path: str, suffix: str = "") -> str:
    """A hidden name in ``path``'s directory that is this call's own (the pid and a counter:
    the pid alone was shared by two threads writing one output, and the second rename found
    the file gone), ending in ``suffix`` (np.savez and matplotlib pick their format by it).
    Short, whatever ``path`` is: a name built from the output's own passed the 255-byte limit
    on file names when that was near it. Nothing is created."""
    name = f".leanrnn-{os.getpid()}-{next(_IDS)}.tmp{suffix}"
    return os.path.join(os.path.dirname(os.path.abspath(path)), name)


_IDS = itertools.count()  # next() is atomic under the GIL


@contextlib.contextmanager
def replacing(path: str, suffix: str = ""):
    """Yield a temporary path (``temp_beside``) to write; once the block ends, it replaces
    ``path`` (os.replace: the old file, if any, stays whole until then); if the block fails,
    it is removed and ``path`` is untouched. The OS's refusal (a full disk, a file size limit)
    is a LeanRNNError naming ``path``, not the temporary name. A symlink at ``path`` is
    written through, as writing it in place did: its target is replaced. A file replaced keeps
    its permission bits (the new one was created with the umask's: a private 0600 model came
    back world-readable)."""
    path = through_link(path)
    tmp = temp_beside(path, suffix)
    try:
        with refused_as_error(path):
            try:
                st = os.stat(path)
            except FileNotFoundError:
                st = None  # a new file: the umask's mode, as open() gives
            else:  # private while written (writers open it "wb": its mode stays)
                os.close(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
            yield tmp
            install(tmp, path, st)
    finally:
        with contextlib.suppress(FileNotFoundError):
            os.remove(tmp)


_UNSEEN = object()


def install(tmp: str, path: str, st=_UNSEEN) -> None:
    """os.replace(tmp, path), the file replaced keeping its access (_keep_access): for writers
    that stream into ``tmp`` beyond one block (score's outputs came back 0644 over a 0600
    file). ``st``: ``path``'s stat taken before (None: there was no file), else taken now."""
    if st is _UNSEEN:
        try:
            st = os.stat(path)
        except FileNotFoundError:
            st = None
    if st is not None:
        _keep_access(st, tmp)
    os.replace(tmp, path)


def _keep_access(st: os.stat_result, tmp: str) -> None:
    """``tmp`` (about to replace the file ``st`` describes) given that file's owner and group
    where this process may (root; a group of its own), then its read/write/execute bits (not
    setuid, setgid or sticky: the new file is its writer's), the group's only if the group was
    kept. A new file had the umask's mode: a private 0600 model came back world-readable, and
    root's save of a user's file left it root's. A file system that refuses these (vfat,
    some FUSE mounts) leaves tmp as it was written."""
    group = True
    try:
        os.chown(tmp, st.st_uid, st.st_gid)
    except OSError:
        try:
            os.chown(tmp, -1, st.st_gid)
        except OSError:
            group = st.st_gid == os.stat(tmp).st_gid
    mode = stat.S_IMODE(st.st_mode) & 0o777
    with contextlib.suppress(OSError):
        os.chmod(tmp, mode if group else mode & ~0o070)


def read_regular(path, most: int) -> bytes:
    """The bytes of the regular file ``path``, or OSError saying why not: anything else (a
    FIFO waits for a writer for ever, /dev/zero is read until memory runs out) or more than
    ``most`` bytes. Opened without blocking, checked on the file opened."""
    with open(path, "rb", opener=lambda p, flags: os.open(p, flags | os.O_NONBLOCK)) as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode):
            raise OSError(f"{os.fspath(path)!r} is not a regular file")
        if st.st_size > most:
            raise OSError(f"{os.fspath(path)!r} is {st.st_size:,} bytes; at most {most:,} read")
        return f.read()


def current_umask() -> int:
    """The process's umask, read without setting it where Linux says it (/proc: os.umask's
    set-and-restore changes it for every thread meanwhile), else by that."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("Umask:"):
                    return int(line.split()[1], 8)
    except (OSError, ValueError, IndexError):
        pass
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def through_link(path: str) -> str:
    """Where writing ``path`` goes: a symlink's target (os.replace over the link itself would
    put a file in its place)."""
    return os.path.realpath(path) if os.path.islink(path) else path


@contextlib.contextmanager
def refused_as_error(path: str, op: str = "write"):
    """The OS's refusal to write ``path`` (a full disk, a file size limit, permissions) as a
    LeanRNNError naming it ("OSError: [Errno 27] File too large" named no file)."""
    try:
        yield
    except OSError as e:
        raise LeanRNNError(f"[{op}] cannot write {path!r}: {e.strerror or e}") from e


def write_text(path, text: str) -> None:
    """``path`` holds ``text`` whole, or keeps what it held (``replacing``): written in place, a
    full disk or a Ctrl-C left it cut short (bench's results.json unparseable, every row lost)."""
    with replacing(str(path)) as tmp, open(tmp, "w", encoding="utf-8") as f:
        f.write(text)
