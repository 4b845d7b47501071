# Moved to kvstore.config.sizes (issue 39); the old path warns and is removed in kvstore 0.2.0
# (kvstore.deprecation). This stub lets type checkers follow code that still imports it.
from typing import Any

from kvstore.config.sizes import *  # noqa: F403

def __getattr__(name: str) -> Any: ...
