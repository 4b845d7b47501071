"""The architecture as tests: a client never loads the server side, imports only run downwards,
and no module grows past what one can hold in one's head.

(a) Importing the client (the package, its public names, ``kvstore.client``, the vLLM
    connector's logic) in a fresh process leaves LMDB, Redis, the store, the tiers and the server
    out of ``sys.modules`` (and the connector's logic leaves out vLLM).
(b) Every ``import`` in ``kvstore/`` (generated ``_proto`` aside), read from the source with
    :mod:`ast`, including those inside functions and under ``TYPE_CHECKING``: no module imports one
    of a higher layer of :data:`LAYERS`; the client side imports nothing of the server side nor
    LMDB or Redis; protocol and tiers import nothing of the client.
(c) No module of ``kvstore/`` (``_proto`` aside) is over :data:`MAX_LINES` lines.
"""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvstore

#: Layer of each part of kvstore/, lowest first: a module may import modules of its own layer or
#: of lower ones, never of a higher one. A ``kvstore.X`` key covers ``kvstore.X`` and everything
#: under it; ``kvstore`` (the package's ``__init__``) covers only itself. A module that no key
#: covers fails the test: place it in the table.
LAYERS: dict[str, int] = {
    # 0: leaf modules both sides use; they import nothing of kvstore but each other.
    "kvstore._proto": 0,  # generated gRPC code
    "kvstore.errors": 0,
    "kvstore.keys": 0,
    "kvstore.types": 0,
    "kvstore.buffers": 0,
    "kvstore.block": 0,
    "kvstore.config": 0,
    "kvstore.sizes": 0,
    "kvstore.machine_defaults": 0,
    "kvstore.cluster_config": 0,
    "kvstore.tenant_config": 0,
    "kvstore.router_config": 0,
    "kvstore.policy": 0,
    "kvstore.deadline": 0,
    # 1: what both sides agree on: gRPC message conversion, shm frames, the published dram index
    #    format, UCX conventions.
    "kvstore.protocol": 1,
    # 2: the two halves over the protocol, which never import each other: the client, and the
    #    storage tiers.
    "kvstore.client": 2,
    "kvstore.tiers": 2,
    # 3: the tiered store over the tiers.
    "kvstore.store": 3,
    # 3: the cluster index beside the store (publishes what a store holds; a router reads it).
    "kvstore.cluster": 3,
    # 4: the server over the store: gRPC servicer, shm and UCX servers, the app that builds it.
    "kvstore.server": 4,
    # 5: the top: the command line (it starts the server, lazily inside ``serve``), the engine
    #    integrations (clients of a server), and the package's front door, which re-exports the
    #    client and, lazily in ``__getattr__``, ``TieredStore`` (that importing it loads none of
    #    the server side is what (a) checks).
    "kvstore.cli": 5,
    "kvstore.integrations": 5,
    # 5: the KV-aware router: a client of the cluster index and an HTTP proxy (no server side).
    "kvstore.router": 5,
    "kvstore": 5,
}

#: What a client process must never load: the server side's packages and its dependencies.
SERVER_SIDE = (
    "kvstore.store",
    "kvstore.tiers",
    "kvstore.cluster",
    "kvstore.server",
    "lmdb",
    "redis",
)

#: Imports ruled out beyond the layering: nothing in the part on the left imports any of the right.
FORBIDDEN: dict[str, tuple[str, ...]] = {
    # The client side (what a vLLM worker or scheduler process loads) never the server side.
    "kvstore.client": SERVER_SIDE,
    "kvstore.integrations": SERVER_SIDE,
    # What both sides agree on depends on neither.
    "kvstore.protocol": ("kvstore.client", "kvstore.tiers", "kvstore.store", "kvstore.server"),
    # The tiers are the server side's half of layer 2.
    "kvstore.tiers": ("kvstore.client",),
}

#: The longest a module of kvstore/ may be (the issue's "no file over 600 lines").
MAX_LINES = 600

PACKAGE = Path(kvstore.__file__).parent


def in_part(module: str, part: str) -> bool:
    """Whether ``module`` is ``part`` or lies under it."""
    return module == part or module.startswith(part + ".")


def _module_name(path: Path) -> str:
    parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


#: Every module of the package, generated code included (imports of it are resolved too).
MODULES = {_module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}
#: The modules the checks read: all but the generated code.
CHECKED = {name: path for name, path in MODULES.items() if not in_part(name, "kvstore._proto")}


def layer_of(module: str) -> int:
    """The layer of a kvstore module: the value of the longest key of :data:`LAYERS` covering it."""
    keys = [key for key in LAYERS if module == key or (key != "kvstore" and in_part(module, key))]
    assert keys, f"{module} is in no layer: add it to LAYERS in {Path(__file__).name}"
    return LAYERS[max(keys, key=len)]


@dataclass(frozen=True)
class Edge:
    """One import: ``source`` (a kvstore module) imports ``target`` at ``line``."""

    source: str
    target: str  # a kvstore module, or the top-level name of a third-party one
    line: int

    def __str__(self) -> str:
        where = MODULES[self.source].relative_to(PACKAGE.parent)
        return f"{where}:{self.line} imports {self.target}"


def _imports(module: str) -> list[Edge]:
    """Every import of ``module``, wherever it sits in the file."""
    path = MODULES[module]
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    edges = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            edges += [Edge(module, _resolve(alias.name), node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the package, one level up per extra dot
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            for alias in node.names:
                # "from kvstore.client import shm" imports the module kvstore.client.shm.
                name = f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                edges.append(Edge(module, _resolve(name), node.lineno))
    return edges


def _resolve(name: str) -> str:
    """A kvstore module as named, a third-party one by its top-level name."""
    return name if in_part(name, "kvstore") else name.split(".")[0]


EDGES = [edge for module in CHECKED for edge in _imports(module)]


# -- (a) the client in a fresh process ---------------------------------------------------------


@pytest.mark.parametrize(
    "statement",
    [
        "import kvstore",
        "from kvstore import KVStoreClient, AsyncKVStoreClient, ChunkHasher, Namespace",
        "import kvstore.client",
        # The connector's logic (scheduler and worker halves) without vLLM itself.
        "import kvstore.integrations.vllm_common",
        "import kvstore.integrations.vllm_scheduler, kvstore.integrations.vllm_worker",
        # ... and its figures (vLLM's side of them is kvstore.integrations.vllm_metrics).
        "import kvstore.integrations.vllm_common, kvstore.integrations.vllm_stats",
    ],
)
def test_importing_the_client_loads_nothing_of_the_server_side(statement: str) -> None:
    script = f"import json, sys\n{statement}\nprint(json.dumps(sorted(sys.modules)))"
    # The kvstore under test, also in the child (pytest's own sys.path does not reach it).
    path = os.pathsep.join(filter(None, [str(PACKAGE.parent), os.environ.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        env={**os.environ, "PYTHONPATH": path},
    )
    assert done.returncode == 0, done.stderr
    loaded = json.loads(done.stdout.splitlines()[-1])
    assert "kvstore.client" in loaded  # the statement really loaded the client
    assert sorted(m for m in loaded if any(in_part(m, part) for part in SERVER_SIDE)) == []
    if "integrations" in statement:
        assert [m for m in loaded if in_part(m, "vllm")] == []


# -- (b) the import graph ----------------------------------------------------------------------


def test_every_module_has_a_layer() -> None:
    assert len(CHECKED) > 30  # the walk found the package
    for module in CHECKED:
        layer_of(module)


def test_no_module_imports_a_higher_layer() -> None:
    upward = [
        f"{edge} (layer {layer_of(edge.source)} -> {layer_of(edge.target)})"
        for edge in EDGES
        if in_part(edge.target, "kvstore") and layer_of(edge.target) > layer_of(edge.source)
    ]
    assert upward == []


@pytest.mark.parametrize(("part", "forbidden"), FORBIDDEN.items(), ids=list(FORBIDDEN))
def test_forbidden_imports(part: str, forbidden: tuple[str, ...]) -> None:
    edges = [edge for edge in EDGES if in_part(edge.source, part)]
    assert edges  # the part was read
    assert [str(edge) for edge in edges if any(in_part(edge.target, f) for f in forbidden)] == []


# -- (c) module size -----------------------------------------------------------------------------


def test_no_module_is_over_the_line_limit() -> None:
    lengths = {
        str(path.relative_to(PACKAGE.parent)): len(path.read_text().splitlines())
        for path in CHECKED.values()
    }
    assert {name: n for name, n in lengths.items() if n > MAX_LINES} == {}
