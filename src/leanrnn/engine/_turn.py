"""One arena's turn to run: a lock that other threads wait on and that refuses its own thread
coming back in (a signal handler's run, or a callback's, inside the run it interrupted)."""

from __future__ import annotations

import threading

from ..errors import LeanRNNError

_RLock = type(threading.RLock())  # the C lock: its `with` costs no Python call


class Turn(_RLock):
    """``with turn():`` around everything that uses one arena (a Session's, a Pool's members',
    a GraphSession's, a Trainer's): another thread waits; the holding thread entering again is
    refused. A re-entrant lock alone let it in, and it overwrote the arena the interrupted run
    was using (wrong results in it; through a shared Pool, a segfault); a plain lock
    deadlocked a graph. A hot path may write ``if turn._is_owned(): turn.refuse()`` and then
    ``with turn:`` (the C lock's enter, ~50 ns less than the call). ``what`` names the owner."""

    __slots__ = ("what",)

    def __new__(cls, what: str) -> Turn:
        self = super().__new__(cls)
        self.what = what
        return self

    def __init__(self, what: str) -> None:  # (set in __new__: the C lock takes no argument)
        pass

    def __call__(self) -> Turn:
        if self._is_owned():
            self.refuse()
        return self

    def refuse(self):
        raise LeanRNNError(
            f"[{self.what}] run again while its run is in progress on this thread (from a "
            "signal handler, or a callback inside the run): both would use one arena; run "
            "another model object there (one with the same weights and no Pool in common), or "
            "defer the work until the run returns"
        )


def unpicklable(owner: str, advice: str):
    """A ``__reduce__`` for what holds a Turn and a planned arena (a session, a pool, a
    stream): pickle and copy said "cannot pickle '_thread.RLock' object", naming none of it."""

    def __reduce__(self):
        raise TypeError(f"[{owner}] cannot be pickled or copied (it holds a planned arena and a "
                        f"lock); {advice}")  # fmt: skip

    return __reduce__
