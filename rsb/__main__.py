"""``python -m rsb``: the same as the ``rsb`` command."""

import sys

from rsb.cli import main

sys.exit(main())
