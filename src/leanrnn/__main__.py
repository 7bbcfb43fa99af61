"""``python -m leanrnn`` is the ``leanrnn`` command."""

import sys

from .cli import main

sys.exit(main())
