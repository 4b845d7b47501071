"""``python -m benchmarks.sim``: see :mod:`benchmarks.sim.run`."""

import sys

from .run import main

sys.exit(main())
