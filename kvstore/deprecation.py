"""The deprecation policy: what is deprecated says the release that removes it.

A deprecated name, setting or import path keeps working, with one warning, until
:data:`REMOVED_IN`, and is gone from that release on. This module holds that release and the
old import paths of modules that moved (:data:`MOVED_MODULES`): importing an old path gives the
very module at its new one (the same object: attributes, ``monkeypatch`` and ``isinstance`` all
agree) and a :class:`DeprecationWarning` naming both paths and the release.

The old paths are served by an import hook (:class:`MovedModules`, installed by ``kvstore``'s
``__init__``) rather than by files left at the old places, so that the moves stay plain renames
in git and changes made to a module under its old name follow it to its new one.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.machinery
import sys
import warnings
from collections.abc import Sequence
from types import ModuleType

__all__ = [
    "MOVED_MODULES",
    "REMOVED_IN",
    "MovedModules",
    "deprecated",
    "install",
    "removal_note",
]

#: The release that removes what is deprecated today (the package is at 0.1.0).
REMOVED_IN = "0.2.0"

#: Old module path -> where the module lives now (issue 39: the configuration became a package).
MOVED_MODULES: dict[str, str] = {
    "kvstore.server_config": "kvstore.config.server",
    "kvstore.data_plane_config": "kvstore.config.data_plane",
    "kvstore.auth_config": "kvstore.config.auth",
    "kvstore.store_config": "kvstore.config.store",
    "kvstore.cluster_config": "kvstore.config.cluster",
    "kvstore.router_config": "kvstore.config.router",
    "kvstore.tenant_config": "kvstore.config.tenants",
    "kvstore.keys_config": "kvstore.config.keys",
    "kvstore.setting_meta": "kvstore.config.meta",
    "kvstore.machine_defaults": "kvstore.config.machine",
    "kvstore.sizes": "kvstore.config.sizes",
}


def removal_note(several: bool = False) -> str:
    """The words every deprecation warning ends with (``several``: of a list of names)."""
    return f"{'they are' if several else 'it is'} removed in kvstore {REMOVED_IN}"


def deprecated(what: str, instead: str) -> str:
    """The one wording of a deprecation warning: what is deprecated, what to do instead, and the
    release that removes it (``"X is deprecated: use Y; it is removed in kvstore 0.2.0"``)."""
    return f"{what} is deprecated: {instead}; {removal_note()}"


class MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """An import hook that answers an old path of :data:`MOVED_MODULES` with the module at its
    new one, and warns."""

    def __init__(self) -> None:
        self._specs: dict[str, importlib.machinery.ModuleSpec | None] = {}

    def find_spec(
        self,
        fullname: str,
        path: Sequence[str] | None = None,
        target: ModuleType | None = None,
    ) -> importlib.machinery.ModuleSpec | None:
        """A spec for an old path (``None`` for every other name: the usual finders have it)."""
        if fullname not in MOVED_MODULES:
            return None
        return importlib.machinery.ModuleSpec(fullname, self)

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType:
        """The module at the new path itself (imported if it is not yet)."""
        new = MOVED_MODULES[spec.name]
        warnings.warn(
            f"{spec.name} moved to {new}: import it from there; {removal_note()}",
            DeprecationWarning,
            stacklevel=2,
        )
        module = importlib.import_module(new)
        self._specs[new] = module.__spec__
        return module

    def exec_module(self, module: ModuleType) -> None:
        """Nothing to run (the module ran at its new path); only its own spec put back, which
        the import system replaced with the old path's."""
        module.__spec__ = self._specs[module.__name__]


def install() -> None:
    """Put the hook first on ``sys.meta_path`` (once). It answers only the old paths, and
    before any other finder: a stale copy of a moved file elsewhere on the path (an older
    install) must not be found instead."""
    if not any(isinstance(finder, MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, MovedModules())
