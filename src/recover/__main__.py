"""``python -m recover``: the same as the ``recover`` command (torchrun launches it this way)."""

import sys

from recover.cli import main

sys.exit(main())
