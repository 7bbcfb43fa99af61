"""Locks renewed in a forked child. Another thread may hold an object's lock at the moment of
``os.fork()`` (the GIL is released while kernels run); the child has no such thread, so nobody
would ever release it and the child's first call would block forever. Objects register here and
the child gives each a fresh lock (kernels.runner does the same for its module-level locks).

    >>> self._lock = threading.Lock(); _fork.renew_lock(self)
"""

from __future__ import annotations

import os
import threading
import weakref
from collections.abc import Callable

# obj -> what to call on it in a forked child. Weak: registering never keeps an object alive.
_hooks: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def in_child(obj, fn: Callable[[object], None]) -> None:
    """Call ``fn(obj)`` in a forked child if ``obj`` is still alive then. ``fn`` must not
    close over ``obj`` (that would keep it alive): it is handed the object."""
    _hooks.setdefault(obj, []).append(fn)


def renew_lock(obj, attr: str = "_lock", make: Callable[[], object] = threading.Lock) -> None:
    """In a forked child, replace ``obj.<attr>`` with ``make()``: a fresh, unheld lock."""
    in_child(obj, lambda o: setattr(o, attr, make()))


def _after_fork_in_child() -> None:
    for obj, fns in list(_hooks.items()):
        for fn in fns:
            fn(obj)


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)
