"""The ``leanrnn`` command: one argparse front door; each subcommand lives in its own module.

A subcommand module exposes ``register(subparsers)`` which adds its parser and sets
``func=run(args) -> int``. Modules import heavy things (torch, onnx, matplotlib) inside ``run``
so ``leanrnn --help`` stays fast. This module also holds what every subcommand shares: argparse
types for counts, and the check that an output path can be written before any work starts.

Errors from bad input (a leanrnn error, or an OSError/ValueError/MemoryError on the way) print
one line, ``leanrnn: error: ...``, and exit 1; ``LEANRNN_DEBUG=1`` shows their traceback.
"""

from __future__ import annotations

import argparse
import importlib
import os
import re
import select
import sys
import threading

from .errors import LeanRNNError

# (module, ...) in the order they appear in --help. Modules that are missing (a half-installed
# tree) are skipped rather than breaking every other command.
COMMANDS = (
    "leanrnn.commands.info",
    "leanrnn.commands.compile",
    "leanrnn.commands.demo",
    "leanrnn.commands.model",
    "leanrnn.commands.plan",
    "leanrnn.commands.score",
    "leanrnn.commands.serve",
    "leanrnn.commands.tune",
    "leanrnn.bench.cli",
)

# Counts past int64 would overflow the moment numpy sees them; nothing real comes near.
INT_MAX = (1 << 63) - 1

# Errors a bad argument, file or environment raises on its way through the library or the OS:
# one line for the user. Anything else (TypeError, AttributeError, ...) is a bug in leanrnn and
# keeps its traceback. LEANRNN_DEBUG=1 shows the traceback of these too.
USER_ERRORS = (LeanRNNError, OSError, MemoryError, ValueError, EOFError)

# `leanrnn inspect m.lrnn | head -1`: the reader left; as for any command cut off by SIGPIPE,
# the shell's 128 + 13, and no message (there is nothing wrong to report).
EXIT_BROKEN_PIPE = 141
EXIT_INTERRUPTED = 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped
_interrupted = threading.Event()  # main() ended by Ctrl-C (entry() then dies by SIGINT)


def _count(s: str, least: int) -> int:
    try:
        v = int(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not an integer") from None
    if not least <= v <= INT_MAX:
        raise argparse.ArgumentTypeError(f"{v}: expected an integer in {least}..{INT_MAX:,}")
    return v


def positive_int(s: str) -> int:
    """argparse type: an integer >= 1 (threads, batch, steps, chunk, bytes, ...)."""
    return _count(s, 1)


def nonnegative_int(s: str) -> int:
    """argparse type: an integer >= 0 (counts where 0 means 'none')."""
    return _count(s, 0)


def port(s: str) -> int:
    """argparse type: a TCP port, 0..65535 (0: any free port)."""
    v = _count(s, 0)
    if v > 65535:  # bind() raised OverflowError, a traceback, for 70000
        raise argparse.ArgumentTypeError(f"{v}: expected a port in 0..65535 (0: any free port)")
    return v


_SIZE = re.compile(r"^([+-]?)(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])(?:i?b)?|b)?$", re.IGNORECASE)
_UNITS = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def size(s: str) -> int:
    """argparse type: a size in bytes > 0, with an optional unit in powers of 1024: '512M',
    '2GiB', '1.5g', '1048576'. Every size option (plan/score/tune --memory-limit, serve's
    --max-request-bytes and --max-queued-bytes) parses with this one function."""
    m = _SIZE.match(s.strip())
    if not m:
        raise argparse.ArgumentTypeError(
            f"{s!r} is not a size; expected bytes as a number with an optional unit K, M, G or "
            "T (powers of 1024), e.g. 512M or 2G"
        )
    sign, number, unit = m.groups()
    v = int(float(number) * _UNITS[(unit or "").lower()])
    if sign == "-" or v < 1:
        raise argparse.ArgumentTypeError(f"{s}: expected a size of at least 1 byte, e.g. 512M")
    if v > INT_MAX:
        raise argparse.ArgumentTypeError(f"{s}: expected a size below 8 EiB")
    return v


class _Parser(argparse.ArgumentParser):
    """argparse takes '-1G' after an option for another option (only '-1' and '-1.5' count as
    negative numbers), and said 'expected one argument': with '-' and a digit meaning a value,
    a negative size or count reaches its type function and gets that function's message."""

    def __init__(self, *args, **kw) -> None:
        super().__init__(*args, **kw)
        self._negative_number_matcher = re.compile(r"^-\.?\d")


def positive_float(s: str) -> float:
    """argparse type: a finite number > 0 (seconds)."""
    return _finite(s, zero=False)


def nonnegative_float(s: str) -> float:
    """argparse type: a finite number >= 0 (seconds where 0 means 'the least')."""
    return _finite(s, zero=True)


def _finite(s: str, zero: bool) -> float:
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not (0 <= v if zero else 0 < v) or v == float("inf") or v != v:
        raise argparse.ArgumentTypeError(f"{s}: expected a finite number {'>=' if zero else '>'} 0")
    return v


def output_file(path: str, flag: str, suffix: str = "", stdout: str | None = None) -> str:
    """``path`` if a file can be written there: its directory exists and it is not itself a
    directory or another non-file (a device, a FIFO). Checked before the work that would
    produce the file, so a typo costs nothing. ``stdout``: the name the flag takes for
    standard output, offered when ``path`` is a device."""
    if not path or path.endswith(("/", os.sep)) or os.path.isdir(path):
        raise LeanRNNError(
            f"[{flag}] {path!r} is a directory; expected a file path inside it, e.g. "
            f"{os.path.join(path or '.', 'out' + suffix)!r}"
        )
    parent = os.path.dirname(path) or "."
    if not os.path.isdir(parent):
        what = "is not a directory" if os.path.exists(parent) else "does not exist"
        raise LeanRNNError(
            f"[{flag}] cannot write {path!r}: {parent!r} {what}; create the directory first "
            "or pick another path"
        )
    if not os.access(parent, os.W_OK):
        raise LeanRNNError(f"[{flag}] cannot write {path!r}: {parent!r} is not writable")
    if os.path.exists(path) and not os.path.isfile(path):
        # run --output /dev/null wrote /dev/null.npz; a writer's rename would replace a device
        hint = f", or {stdout!r} for standard output" if stdout else ""
        raise LeanRNNError(f"[{flag}] {path!r} is not a regular file; expected a file path to "
                           f"write (or replace){hint}")  # fmt: skip
    return path


def not_an_input(path: str, flag: str, **inputs: str | None) -> None:
    """Refuse an output ``path`` that is one of the command's ``inputs`` (what=path; None: not
    given): the same path, through a symlink, or a hard link. Writing it would destroy the file
    before (or while) it is read. The check ``leanrnn.convert`` and ``leanrnn score`` make of
    their own outputs."""
    from .loading import same_file

    for what, src in inputs.items():
        if src is not None and same_file(src, path):
            raise LeanRNNError(
                f"[{flag}] output {path!r} is the {what} file itself ({src!r}); writing it "
                "would destroy it: pick another output path"
            )


def output_dir(path: str, flag: str) -> str:
    """``path`` if it is, or can be created as, a directory: it is not a file and its nearest
    existing ancestor is a directory."""
    probe = os.path.abspath(path)
    while not os.path.exists(probe):
        probe = os.path.dirname(probe)
    if not os.path.isdir(probe):
        where = "is a file" if probe == os.path.abspath(path) else f"is under the file {probe!r}"
        raise LeanRNNError(f"[{flag}] {path!r} {where}; expected a directory")
    return path


def build_parser() -> argparse.ArgumentParser:
    from . import __version__

    p = _Parser(
        prog="leanrnn", description="LSTM/GRU/RNN inference on the CPU with planned memory."
    )
    p.add_argument("--version", action="version", version=f"leanrnn {__version__}")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    for name in COMMANDS:
        try:
            mod = importlib.import_module(name)
        except ModuleNotFoundError as e:
            if not e.name or not name.startswith(e.name):
                raise
            continue
        mod.register(sub)
    p.commands = sub.choices  # main: a command's own usage for its unknown arguments
    return p


def _one_line(e: BaseException) -> str:
    if isinstance(e, LeanRNNError):
        msg = str(e)
    elif isinstance(e, MemoryError):
        msg = f"out of memory{': ' + str(e) if str(e) else ''}; try smaller sizes"
    else:  # the OS's or numpy's words: say which kind it was
        msg = f"{type(e).__name__}: {e}"
    return " ".join(msg.split())


def _stdout_closed() -> bool:
    """Whether stdout is a pipe whose reader has gone (poll says POLLERR); then stdout is
    pointed at /dev/null, so that what is still buffered does not fail again when the
    interpreter flushes it at exit. A BrokenPipeError from anything else is reported."""
    try:
        fd = sys.stdout.fileno()
        poll = select.poll()
        poll.register(fd, select.POLLOUT)
        if not any(events & select.POLLERR for _, events in poll.poll(0)):
            return False
        null = os.open(os.devnull, os.O_WRONLY)
        os.dup2(null, fd)
        os.close(null)
    except (OSError, ValueError, AttributeError):  # no descriptor, or no poll() (Windows)
        return False
    return True


def _terminate_as_exit():
    """SIGTERM (a job scheduler's stop, `timeout`, `kill`) ends a command as Ctrl-C does: by an
    exception, so what it writes is cleaned up on the way out (score's spool directory, the
    temporary files of output written whole or not at all) instead of left beside the output
    (312 MB, and 43 GB, of a stopped score's spool). Commands with their own handling (serve's
    drain) install theirs over it. Only from the main thread, and only over the default
    handler; returns what restores it."""
    import signal
    import threading

    if threading.current_thread() is not threading.main_thread():
        return lambda: None
    if signal.getsignal(signal.SIGTERM) is not signal.SIG_DFL:
        return lambda: None  # someone's own handler (an embedding program): left alone

    def stop(signum, frame):
        raise SystemExit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    return lambda: signal.signal(signal.SIGTERM, signal.SIG_DFL)


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:  # (parse_args printed the top-level usage, which lists no command's flags)
        own = parser.commands.get(getattr(args, "command", None) or "", parser)
        own.error(f"unrecognized arguments: {' '.join(unknown)}")
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    restore = _terminate_as_exit()
    _interrupted.clear()
    try:
        rc = int(args.func(args) or 0)
        sys.stdout.flush()  # here, not at exit, where a closed pipe is an ignored exception
        return rc
    except USER_ERRORS as e:
        if isinstance(e, BrokenPipeError) and _stdout_closed():
            return EXIT_BROKEN_PIPE
        if os.environ.get("LEANRNN_DEBUG", "").strip() not in ("", "0"):
            raise
        print(f"leanrnn: error: {_one_line(e)}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: the command's cleanup has run; a line, not a traceback
        if os.environ.get("LEANRNN_DEBUG", "").strip() not in ("", "0"):
            raise
        print("leanrnn: interrupted", file=sys.stderr)
        _interrupted.set()
        return EXIT_INTERRUPTED
    finally:
        restore()  # main() called in-process (an embedding program) gets its SIGTERM back


def entry(argv: list[str] | None = None) -> None:
    """The ``leanrnn`` command (and ``python -m leanrnn``): ``main``, its status the process's.
    Interrupted, the process dies by SIGINT as an uncaught KeyboardInterrupt would make it:
    a shell stops a script's loop only for a child killed by SIGINT, and went on after an exit
    with 130 (``for f in *.npz; do leanrnn score ...; done`` could not be stopped)."""
    rc = main(argv)
    if _interrupted.is_set():
        import signal

        sys.stdout.flush()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    sys.exit(rc)


if __name__ == "__main__":  # pragma: no cover
    entry()
