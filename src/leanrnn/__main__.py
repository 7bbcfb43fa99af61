"""``python -m leanrnn`` is the ``leanrnn`` command."""

from .cli import entry

entry()
