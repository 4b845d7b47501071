"""``python -m kvstore.cli``: the same as the ``kvstore`` command."""

import sys

from kvstore.cli import main

sys.exit(main())
