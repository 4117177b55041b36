"""``python -m metalnn``: the ``metalnn`` command (`metalnn.cli`)."""

import sys

from .cli import main

sys.exit(main())
