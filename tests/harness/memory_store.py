"""The in-memory store moved to the package, for users' tests as for ours:
:class:`kvstore.testing.MemoryStore`. Kept importable here for the test modules that still
import it from the harness."""

from kvstore.testing import MemoryStore

__all__ = ["MemoryStore"]
