"""``python -m commfuse.cli``: the ``commfuse`` command without the console script."""

import sys

from commfuse.cli import main

sys.exit(main())
