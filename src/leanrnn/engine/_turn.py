"""One arena's turn to run: a lock that other threads wait on and that refuses its own thread
coming back in (a signal handler's run, or a callback's, inside the run it interrupted)."""

from __future__ import annotations

import threading

from ..errors import LeanRNNError


class Turn:
    """``with turn:`` around everything that uses one arena (a Session's, a Pool's members', a
    GraphSession's, a Trainer's). Another thread waits; the holding thread entering again is
    refused: with a re-entrant lock it got in and overwrote the arena the interrupted run was
    using (wrong results in it, a segfault through a shared Pool), and with a plain lock a
    graph's deadlocked. ``what`` names the owner in the error."""

    __slots__ = ("_lock", "_running", "what")

    def __init__(self, what: str) -> None:
        self._lock = threading.Lock()
        self._running = 0  # the ident of the thread holding the turn; 0: nobody
        self.what = what

    def __enter__(self) -> Turn:
        me = threading.get_ident()
        if self._running == me:  # read without the lock: only this thread sets it to ``me``
            raise LeanRNNError(
                f"[{self.what}] run again while its run is in progress on this thread (from a "
                "signal handler, or a callback inside the run): both would use one arena; run "
                "another model object there (one with the same weights and no Pool in common), "
                "or defer the work until the run returns"
            )
        self._lock.acquire()
        self._running = me
        return self

    def __exit__(self, *exc) -> None:
        self._running = 0
        self._lock.release()


def unpicklable(owner: str, advice: str):
    """A ``__reduce__`` for what holds a Turn and a planned arena (a session, a pool, a
    stream): pickle and copy said "cannot pickle '_thread.RLock' object", naming none of it."""

    def __reduce__(self):
        raise TypeError(f"[{owner}] cannot be pickled or copied (it holds a planned arena and a "
                        f"lock); {advice}")  # fmt: skip

    return __reduce__
