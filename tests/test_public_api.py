"""The public surface of the package: what ``kvstore`` exports is derived, not pinned by hand.

``kvstore.__all__`` is exactly the names its namespace holds of kvstore's own (classes,
functions; submodules and helpers aside) and those it loads on first use; every error a client
process can raise is exported; so is every type a client's public method returns; and the shipped
``kvstore.testing`` offers what a user's tests need, loading none of the server side.
"""

from __future__ import annotations

import inspect
import subprocess
import sys
import types
import typing
from pathlib import Path

import kvstore
import kvstore.errors
import kvstore.testing
from kvstore import AsyncKVStoreClient, KVStoreClient

#: Where errors only the server side raises live: a client process never loads them.
SERVER_SIDE = (
    "kvstore.node",
    "kvstore.server",
    "kvstore.store",
    "kvstore.tiers",
    "kvstore.cluster",
)


def _own(value: object) -> bool:
    """A class or function of kvstore's own (not a module, not a typing helper)."""
    module = getattr(value, "__module__", None) or ""
    return not isinstance(value, types.ModuleType) and module.partition(".")[0] == "kvstore"


def test_all_is_derived_from_the_namespace() -> None:
    held = {
        name for name, value in vars(kvstore).items() if not name.startswith("_") and _own(value)
    }
    lazy = set(kvstore._LAZY)  # loaded on first use, so not in vars() until then
    assert set(kvstore.__all__) == held | lazy | {"__version__"}
    for name in kvstore.__all__:
        assert hasattr(kvstore, name), name


def _errors() -> set[type[kvstore.KVStoreError]]:
    found: set[type[kvstore.KVStoreError]] = set()
    todo = [kvstore.KVStoreError]
    while todo:
        error = todo.pop()
        found.add(error)
        todo.extend(error.__subclasses__())
    return found


def test_every_error_a_client_can_raise_is_exported() -> None:
    # every class of the exception tree's own module ...
    for name in kvstore.errors.__all__:
        value = getattr(kvstore.errors, name)
        if isinstance(value, type) and issubclass(value, Exception):
            assert issubclass(value, kvstore.KVStoreError), name
            assert getattr(kvstore, name, None) is value, f"{name} is not exported from kvstore"
    # ... and every subclass defined anywhere on the client's side
    client_side = [
        e
        for e in _errors()
        if e.__module__.startswith("kvstore.") and not e.__module__.startswith(SERVER_SIDE)
    ]
    assert {e.__name__ for e in client_side} <= set(kvstore.__all__)
    for error in client_side:
        assert getattr(kvstore, error.__name__) is error


def _named_types(annotation: object) -> set[type]:
    """The classes an annotation names, through unions and generics."""
    found: set[type] = set()
    for arg in typing.get_args(annotation):
        found |= _named_types(arg)
    origin = typing.get_origin(annotation)
    if isinstance(annotation, type) and origin is None:
        found.add(annotation)
    return found


def test_every_type_a_public_method_returns_is_exported() -> None:
    missing = []
    for client in (KVStoreClient, AsyncKVStoreClient):
        for name, method in inspect.getmembers(client, inspect.isfunction):
            if name.startswith("_"):
                continue
            returned = typing.get_type_hints(method).get("return")
            for kind in _named_types(returned):
                if _own(kind) and getattr(kvstore, kind.__name__, None) is not kind:
                    missing.append(f"{client.__name__}.{name} -> {kind.__module__}.{kind.__name__}")
    # ClientSettings (settings()) is the client's configuration, offered by kvstore.client.
    assert [m for m in missing if "ClientSettings" not in m] == []


def test_public_names_have_docstrings() -> None:
    for name in kvstore.__all__:
        value = getattr(kvstore, name)
        if callable(value) and not isinstance(value, str):
            assert value.__doc__, f"{name} has no docstring"


def test_kvstore_testing_offers_what_a_users_tests_need() -> None:
    assert kvstore.testing.MockTransport is kvstore.MockTransport
    for name in kvstore.testing.__all__:
        assert hasattr(kvstore.testing, name), name
    # its own docstring's example, run as written
    example = inspect.getdoc(kvstore.testing)
    assert example is not None
    code = example.split("::\n", 1)[1].split("\n\n", 1)[0]
    exec(compile(inspect.cleandoc(code), "kvstore.testing", "exec"), {})


def test_kvstore_testing_loads_no_server_side() -> None:
    script = "import sys, kvstore.testing\nprint(' '.join(sorted(sys.modules)))"
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        cwd=Path(kvstore.__file__).parent.parent,
    )
    loaded = done.stdout.split()
    assert [m for m in loaded if m.startswith((*SERVER_SIDE, "lmdb", "redis"))] == []
