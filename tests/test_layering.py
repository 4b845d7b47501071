"""The architecture as tests: a client never loads the server side, the router loads only the
index it reads, imports only run downwards, nothing imports in a circle, and no module grows past
what one can hold in one's head.

(a) In a fresh process: importing the client (the package, its public names, ``kvstore.client``,
    the vLLM connector's logic) leaves LMDB, Redis, the store, the tiers, the cluster index and
    the server out of ``sys.modules`` (the connector's logic leaves out vLLM too); importing the
    router or ``kvstore.cluster`` leaves out LMDB, the store, the tiers, the server and the node
    agent.
(b) Every ``import`` in ``kvstore/`` (generated ``_proto`` aside), read from the source with
    :mod:`ast`, including those inside functions and under ``TYPE_CHECKING``:

    1. every module lies in one part of :data:`PARTS`;
    2. no module imports a part of a higher layer;
    3. two parts of the same layer never import each other, but for the pairs of
       :data:`SAME_LAYER` (a module imports freely within its own part);
    4. no part imports what :data:`FORBIDDEN` rules out for it (the client side never the server
       side, the router never the store or the node agent);
    5. no cycle: neither among modules nor among parts.

    :data:`EXCEPTIONS` names the few imports these rules let through, each with why.
(c) No module of ``kvstore/`` (``_proto`` aside) is over :data:`MAX_LINES` lines, and no function
    over :data:`MAX_FUNCTION_LINES` (its decorators, signature and docstring counted), but for
    :data:`LONG_FUNCTIONS`: code that builds a command line's parsers.

Each rule is shown to catch a planted violation: a copy of the package with one import added
(``test_each_rule_catches_a_planted_violation``).
"""

from __future__ import annotations

import ast
import functools
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pytest

import kvstore


@dataclass(frozen=True)
class Part:
    """One part of the package: the modules under ``covers`` (a name covers itself and
    everything under it; ``kvstore``, the package's ``__init__``, covers only itself), on
    ``layer``. A module lies in the part of the longest name covering it."""

    layer: int
    covers: tuple[str, ...]


#: The node agent: what ``kvstore serve`` runs to publish its blocks to the cluster index and read
#: its peers' (it imports the store and the client's channels; a router needs none of it).
NODE_AGENT = ("kvstore.node",)

#: The parts, lowest layer first. A module imports modules of its own part, or of parts of lower
#: layers; of another part of its own layer only as :data:`SAME_LAYER` allows.
PARTS: dict[str, Part] = {
    # -1: the vocabulary, the words of the system both sides use; they import nothing of kvstore
    #     but each other. (Numbered -1 so that the layers above kept their numbers when the
    #     configuration came in between.)
    "vocabulary": Part(
        -1,
        (
            "kvstore._proto",  # generated gRPC code
            "kvstore.errors",
            "kvstore.keys",
            "kvstore.key_scheme",
            "kvstore.types",
            "kvstore.buffers",
            "kvstore.block",
            "kvstore.deprecation",
            "kvstore.formats",
            "kvstore.policy",
            "kvstore.retention",
            "kvstore.deadline",
        ),
    ),
    # 0: the configuration: one frozen dataclass per section, their metadata and the loader,
    #    over the vocabulary (a section checks its values with the vocabulary's words: hash
    #    algorithms, eviction policies, the key scheme).
    "config": Part(0, ("kvstore.config",)),
    # 1: what both sides agree on: gRPC message conversion, shm frames, the published dram index
    #    format, UCX conventions.
    "protocol": Part(1, ("kvstore.protocol",)),
    # 2: the two halves over the protocol, which never import each other: the client, and the
    #    storage tiers.
    "client": Part(2, ("kvstore.client",)),
    "tiers": Part(2, ("kvstore.tiers",)),
    # 3: the tiered store over the tiers, and beside it the cluster index's contract and reader
    #    (its Redis layout, ClusterIndex: what a router reads), which know nothing of each other.
    "store": Part(3, ("kvstore.store",)),
    "index": Part(3, ("kvstore.cluster",)),
    #    And over the client, what a user's tests need (MockTransport, the in-memory store).
    "testing": Part(3, ("kvstore.testing",)),
    # 4: the node agent over the store and the index (membership, publishing, engine events,
    #    peer reads).
    "node agent": Part(4, NODE_AGENT),
    # 5: the server over the store and the agent: gRPC servicer, shm and UCX servers, the app.
    "server": Part(5, ("kvstore.server",)),
    # 6: the top, three programs that never import each other (but see SAME_LAYER): the command
    #    line (it starts the server, lazily inside ``serve``), the engine integrations (clients of
    #    a server) and the KV-aware router (a client of the index and an HTTP proxy); and the
    #    package's front door, which re-exports the client and, lazily in ``__getattr__``,
    #    ``TieredStore`` (that importing it loads none of the server side is what (a) checks).
    "cli": Part(6, ("kvstore.cli",)),
    #    The engine integrations are two floors: the engine-neutral machinery (paged-cache
    #    layouts, block plans, copy pipelines, the store-client protocol) and, above it, one part
    #    per engine, which the engine-neutral floor never imports.
    "integrations": Part(6, ("kvstore.integrations",)),
    "router": Part(6, ("kvstore.router",)),
    "front door": Part(6, ("kvstore",)),
    # 7: each engine's own integration, over the engine-neutral one.
    "vllm integration": Part(7, ("kvstore.integrations.vllm",)),
    "sglang integration": Part(7, ("kvstore.integrations.sglang",)),
}

#: (importing part, imported part) of one layer allowed to import, and why.
SAME_LAYER: dict[tuple[str, str], str] = {
    ("cli", "router"): "`kvstore router` starts the router (inside the command only)",
    ("cli", "front door"): "`kvstore --version` names the package's version and place",
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
#: The configuration's sections and loader: what only a process that loads a configuration needs.
CONFIG_SECTIONS = tuple(
    f"kvstore.config.{name}"
    for name in (
        "loader",
        "server",
        "data_plane",
        "auth",
        "store",
        "cluster",
        "router",
        "tenants",
        "keys",
        "meta",
        "machine",
    )
)
#: What a router must never load: it is a client of the index, nothing more.
ROUTER_NEVER = ("kvstore.store", "kvstore.tiers", "kvstore.server", "lmdb", *NODE_AGENT)

#: Imports ruled out beyond the layering: nothing in the part on the left imports any of the right
#: (kvstore modules and third-party packages, each covering what lies under it).
FORBIDDEN: dict[str, tuple[str, ...]] = {
    # The client side (what a vLLM worker or scheduler process loads) never the server side.
    "client": SERVER_SIDE,
    # nor does a test of code that uses a client
    "testing": SERVER_SIDE,
    # The engine-neutral integrations load no engine either (an SGLang process never loads vLLM).
    "integrations": (*SERVER_SIDE, "vllm", "sglang"),
    "vllm integration": (*SERVER_SIDE, "sglang"),
    # An SGLang process never loads vLLM (nor the server side).
    "sglang integration": (*SERVER_SIDE, "vllm"),
    # The router reads the index (Redis) and proxies HTTP; the server side is another program.
    "router": ROUTER_NEVER,
}

#: (module, imported module) that every rule lets through, and why; each must still exist.
EXCEPTIONS: dict[tuple[str, str], str] = {}

#: The longest a module of kvstore/ may be.
MAX_LINES = 500
#: The longest a function of kvstore/ may be.
MAX_FUNCTION_LINES = 80

#: "FILE:QUALNAME" (FILE from the package's parent) that may be longer, and why; each must still
#: be over the limit.
LONG_FUNCTIONS: dict[str, str] = {
    "kvstore/cli/__init__.py:_parsers": "argparse: builds the command line's parsers",
}

PACKAGE = Path(kvstore.__file__).parent


def in_part(module: str, name: str) -> bool:
    """Whether ``module`` is ``name`` or lies under it."""
    return module == name or module.startswith(name + ".")


def part_of(module: str) -> str | None:
    """The part a kvstore module lies in (``None``: in none)."""
    best, length = None, -1
    for name, part in PARTS.items():
        for cover in part.covers:
            covered = module == cover or (cover != "kvstore" and in_part(module, cover))
            if covered and len(cover) > length:
                best, length = name, len(cover)
    return best


def layer_of(module: str) -> int:
    """The layer of a kvstore module that lies in a part."""
    name = part_of(module)
    assert name is not None, f"{module} is in no part: add it to PARTS in {Path(__file__).name}"
    return PARTS[name].layer


@dataclass(frozen=True)
class Edge:
    """One import: ``source`` (a kvstore module, in file ``where``) imports ``target`` at
    ``line``."""

    source: str
    target: str  # a kvstore module, or the top-level name of a third-party one
    line: int
    where: str

    def __str__(self) -> str:
        return f"{self.where}:{self.line} imports {self.target}"


@dataclass(frozen=True)
class Graph:
    """The modules of a copy of the package (by name: their files) and its imports."""

    modules: dict[str, Path]
    edges: list[Edge]

    def internal(self, exceptions: bool = False) -> list[Edge]:
        """The imports of kvstore modules, :data:`EXCEPTIONS` left out unless ``exceptions``."""
        return [
            e
            for e in self.edges
            if in_part(e.target, "kvstore")
            and (exceptions or (e.source, e.target) not in EXCEPTIONS)
        ]


@functools.cache
def _imports_in(text: str) -> list[ast.Import | ast.ImportFrom]:
    """Every import statement of a module's source (kept: a copy of the package parses again
    only the files a test changed)."""
    return [n for n in ast.walk(ast.parse(text)) if isinstance(n, ast.Import | ast.ImportFrom)]


def read_graph(package: Path) -> Graph:
    """Every module of the package at ``package`` and every import of those the checks read
    (all but the generated ``_proto``)."""
    root = package.parent

    def name_of(path: Path) -> str:
        parts = path.relative_to(root).with_suffix("").parts
        return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)

    modules = {name_of(path): path for path in sorted(package.rglob("*.py"))}
    edges = []
    for module, path in modules.items():
        if in_part(module, "kvstore._proto"):
            continue
        package_name = module if path.name == "__init__.py" else module.rpartition(".")[0]
        where = str(path.relative_to(root))
        for node in _imports_in(path.read_text()):
            if isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                base = node.module or ""
                if node.level:  # relative: from the package, one level up per extra dot
                    pieces = package_name.split(".")
                    anchor = pieces[: len(pieces) - node.level + 1]
                    base = ".".join([*anchor, *([base] if base else [])])
                # "from kvstore.client import shm" imports the module kvstore.client.shm.
                names = [
                    f"{base}.{alias.name}" if f"{base}.{alias.name}" in modules else base
                    for alias in node.names
                ]
            for name in names:
                target = name if in_part(name, "kvstore") else name.split(".")[0]
                edges.append(Edge(module, target, node.lineno, where))
    return Graph(modules, edges)


# -- the rules: each returns what breaks it, one line each ---------------------------------------


def unplaced(graph: Graph) -> list[str]:
    """Modules in no part."""
    return [m for m in graph.modules if part_of(m) is None]


def upward(graph: Graph) -> list[str]:
    """Imports of a higher layer."""
    return [
        f"{e} (layer {layer_of(e.source)} -> {layer_of(e.target)})"
        for e in graph.internal()
        if part_of(e.source) is not None
        and part_of(e.target) is not None
        and layer_of(e.target) > layer_of(e.source)
    ]


def same_layer(graph: Graph) -> list[str]:
    """Imports between two parts of one layer that :data:`SAME_LAYER` does not allow."""
    found = []
    for e in graph.internal():
        source, target = part_of(e.source), part_of(e.target)
        if source is None or target is None or source == target:
            continue
        if PARTS[source].layer == PARTS[target].layer and (source, target) not in SAME_LAYER:
            found.append(f"{e} ({source} -> {target}, both layer {PARTS[source].layer})")
    return found


def forbidden(graph: Graph) -> list[str]:
    """Imports :data:`FORBIDDEN` rules out."""
    return [
        f"{e} ({part} must not import {ruled})"
        for e in graph.edges
        if (e.source, e.target) not in EXCEPTIONS
        for part, ruled_out in FORBIDDEN.items()
        if part_of(e.source) == part
        for ruled in ruled_out
        if in_part(e.target, ruled)
    ]


def circles(nodes: Iterable[str], arrows: Iterable[tuple[str, str]]) -> list[list[str]]:
    """The strongly connected components of more than one node, or with an arrow to itself
    (Tarjan's algorithm, iterative), each sorted."""
    following: dict[str, set[str]] = {node: set() for node in nodes}
    for source, target in arrows:
        following.setdefault(source, set()).add(target)
        following.setdefault(target, set())
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(following):
        if start in index:
            continue
        work = [(start, iter(sorted(following[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, rest = work[-1]
            step = next(rest, None)
            if step is not None:
                if step not in index:
                    index[step] = low[step] = len(index)
                    stack.append(step)
                    on_stack.add(step)
                    work.append((step, iter(sorted(following[step]))))
                elif step in on_stack:
                    low[node] = min(low[node], index[step])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1 or node in following[node]:
                    found.append(sorted(component))
    return found


def module_cycles(graph: Graph) -> list[str]:
    """Modules that import each other, directly or through others (``TYPE_CHECKING`` and
    function-level imports included: a cycle is a tangle even where it cannot deadlock; so are
    :data:`EXCEPTIONS`, which are let through the layering, not through this)."""
    arrows = [(e.source, e.target) for e in graph.internal(True) if e.target in graph.modules]
    return [" <-> ".join(c) for c in circles(graph.modules, arrows)]


def part_cycles(graph: Graph) -> list[str]:
    """Parts that import each other, directly or through others (only :data:`SAME_LAYER` pairs
    can make such a circle: every other one breaks the layering first). :data:`EXCEPTIONS` are
    left out: the one there makes a known circle, index <-> node agent, until NodeInfo moves."""
    arrows = {
        (source, target)
        for e in graph.internal()
        if (source := part_of(e.source)) is not None
        and (target := part_of(e.target)) is not None
        and source != target
    }
    return [" <-> ".join(c) for c in circles(PARTS, arrows)]


def too_long(graph: Graph) -> list[str]:
    """Modules over :data:`MAX_LINES` lines (``_proto`` aside)."""
    return [
        f"{path.name}: {n} lines"
        for module, path in graph.modules.items()
        if not in_part(module, "kvstore._proto")
        and (n := len(path.read_text().splitlines())) > MAX_LINES
    ]


def function_lengths(graph: Graph) -> dict[str, int]:
    """Every function of the package (``_proto`` aside) as ``"FILE:QUALNAME"`` (a method as
    ``Class.name``, a nested function as ``outer.name``), and its lines."""
    found: dict[str, int] = {}

    def visit(node: ast.AST, where: str, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.ClassDef):
                visit(child, where, f"{prefix}{child.name}.")
            elif isinstance(child, ast.FunctionDef | ast.AsyncFunctionDef):
                first = min([child.lineno, *(d.lineno for d in child.decorator_list)])
                assert child.end_lineno is not None
                found[f"{where}:{prefix}{child.name}"] = child.end_lineno - first + 1
                visit(child, where, f"{prefix}{child.name}.")
            else:
                visit(child, where, prefix)

    for module, path in graph.modules.items():
        if in_part(module, "kvstore._proto"):
            continue
        depth = len(module.split(".")) - (path.name != "__init__.py")
        where = str(path.relative_to(path.parents[depth]))  # from the package's parent
        visit(ast.parse(path.read_text()), where, "")
    return found


def too_long_functions(graph: Graph) -> list[str]:
    """Functions over :data:`MAX_FUNCTION_LINES` lines that :data:`LONG_FUNCTIONS` does not
    name."""
    return [
        f"{name}: {n} lines"
        for name, n in function_lengths(graph).items()
        if n > MAX_FUNCTION_LINES and name not in LONG_FUNCTIONS
    ]


RULES: dict[str, Callable[[Graph], list[str]]] = {
    "unplaced": unplaced,
    "upward": upward,
    "same_layer": same_layer,
    "forbidden": forbidden,
    "module_cycles": module_cycles,
    "part_cycles": part_cycles,
    "too_long": too_long,
    "too_long_functions": too_long_functions,
}

GRAPH = read_graph(PACKAGE)


# -- (a) the client and the router in a fresh process ------------------------------------------


#: (statement, a module it must load, what it must not load)
FRESH_PROCESS: list[tuple[str, str, tuple[str, ...]]] = [
    ("import kvstore", "kvstore.client", SERVER_SIDE),
    (
        "from kvstore import KVStoreClient, AsyncKVStoreClient, ChunkHasher, Namespace",
        "kvstore.client",
        SERVER_SIDE,
    ),
    ("import kvstore.client", "kvstore.client", SERVER_SIDE),
    ("import kvstore.testing", "kvstore.client.mock_transport", SERVER_SIDE),
    # The connector's logic (scheduler and worker halves) without vLLM itself.
    ("import kvstore.integrations.vllm.common", "kvstore.client", (*SERVER_SIDE, "vllm")),
    (
        "import kvstore.integrations.vllm.scheduler, kvstore.integrations.vllm.worker",
        "kvstore.client",
        (*SERVER_SIDE, "vllm"),
    ),
    # ... and its figures (vLLM's side of them is kvstore.integrations.vllm.metrics).
    (
        "import kvstore.integrations.vllm.common, kvstore.integrations.vllm.stats",
        "kvstore.client",
        (*SERVER_SIDE, "vllm"),
    ),
    # A connector process reads its hash secret and sizes without loading a config section.
    (
        "import kvstore.integrations.vllm.common; from kvstore.config import hash_secret",
        "kvstore.key_scheme",
        CONFIG_SECTIONS,
    ),
    # The SGLang backend's logic without SGLang itself (only its backend class imports SGLang).
    (
        "import kvstore.integrations.sglang.transfer, kvstore.integrations.sglang.scheme",
        "kvstore.client",
        (*SERVER_SIDE, "vllm", "sglang"),
    ),
    # The router: the index's reader and an HTTP proxy (issue 29's done-when).
    ("import kvstore.router", "kvstore.cluster.index", ROUTER_NEVER),
    ("from kvstore.cluster import ClusterIndex, Layout", "kvstore.cluster.index", ROUTER_NEVER),
    # The issue's own statement, word for word in spirit: the router loads none of these.
    (
        "import kvstore.router",
        "kvstore.router",
        ("lmdb", "kvstore.store", "kvstore.tiers", "kvstore.server", "kvstore.node"),
    ),
]


@pytest.mark.parametrize(
    ("statement", "loads", "never"), FRESH_PROCESS, ids=[case[0] for case in FRESH_PROCESS]
)
def test_a_fresh_process_loads_only_its_side(
    statement: str, loads: str, never: tuple[str, ...]
) -> None:
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
    assert loads in loaded  # the statement really loaded what it is about
    assert sorted(m for m in loaded if any(in_part(m, name) for name in never)) == []


def test_the_cluster_package_is_the_index_contract_only() -> None:
    """The node records are part of the contract; the agent lives in kvstore.node."""
    import kvstore.cluster
    from kvstore.cluster.records import NodeInfo

    assert kvstore.cluster.NodeInfo is NodeInfo
    assert set(kvstore.cluster.__all__) <= set(dir(kvstore.cluster))
    assert not hasattr(kvstore.cluster, "Membership")


# -- (b), (c) the rules on the package --------------------------------------------------------


def test_the_walk_found_the_package() -> None:
    assert len(GRAPH.modules) > 30
    assert any(e.source == "kvstore.router.service" for e in GRAPH.edges)
    # every part covers at least one module (a stale name in PARTS is an error too)
    for name, part in PARTS.items():
        assert any(part_of(m) == name for m in GRAPH.modules), f"part {name} covers nothing"
        for cover in part.covers:
            assert any(in_part(m, cover) for m in GRAPH.modules), f"{cover} is not a module"


@pytest.mark.parametrize("rule", RULES)
def test_the_package_keeps_the_rule(rule: str) -> None:
    assert RULES[rule](GRAPH) == []


def test_every_long_function_allowed_is_still_long() -> None:
    lengths = function_lengths(GRAPH)
    assert [f for f in LONG_FUNCTIONS if lengths.get(f, 0) <= MAX_FUNCTION_LINES] == []


def test_every_exception_is_still_needed() -> None:
    edges = {(e.source, e.target) for e in GRAPH.edges}
    assert [pair for pair in EXCEPTIONS if pair not in edges] == []


# -- each rule catches a planted violation ------------------------------------------------------

#: rule -> (file of the package, what is added to it, what the rule's report names)
PLANTED: dict[str, tuple[str, str, str]] = {
    "unplaced": ("newpart/__init__.py", "", "kvstore.newpart"),
    "upward": ("store/tiered.py", "import kvstore.server.app", "kvstore.server.app"),
    # the vocabulary stands below the configuration, the configuration below the protocol.
    "upward/vocabulary-config": (
        "keys.py",
        "from kvstore.config.sizes import parse_size",
        "kvstore.config.sizes",
    ),
    "upward/config-protocol": (
        "config/cluster.py",
        "from kvstore.protocol.messages import namespace_bytes",
        "kvstore.protocol.messages",
    ),
    # client and tiers, store and index: two halves of one layer.
    "same_layer": ("client/core.py", "import kvstore.tiers.dram", "client -> tiers"),
    "same_layer/store-index": (
        "store/tiered.py",
        "from kvstore.cluster.index import ClusterIndex",
        "store -> index",
    ),
    # the router may not load the server side though it lies above it.
    "forbidden": ("router/scoring.py", "import kvstore.server.app", "router must not import"),
    "forbidden/router-agent": (
        "router/service.py",
        "from kvstore.node.peers import PeerSource",
        "kvstore.node.peers",
    ),
    "forbidden/client-lmdb": ("client/sync.py", "import lmdb", "client must not import lmdb"),
    # the engine-neutral integrations never reach up into an engine's folder, nor load an engine.
    "upward/paged-vllm": (
        "integrations/paged/plan.py",
        "from kvstore.integrations.vllm.common import StepPlan",
        "kvstore.integrations.vllm.common",
    ),
    "forbidden/paged-engine": (
        "integrations/paged/kv_layout.py",
        "import vllm",
        "integrations must not import vllm",
    ),
    "forbidden/sglang-vllm": (
        "integrations/sglang/pages.py",
        "import vllm",
        "sglang integration must not import vllm",
    ),
    "module_cycles": ("store/layout.py", "import kvstore.store.tiered", "kvstore.store.tiered"),
    # cli -> router is allowed (SAME_LAYER); router -> cli as well (allowed for the test) closes
    # a circle of parts.
    "part_cycles": ("router/pd.py", "import kvstore.cli.checks", "cli <-> router"),
    "too_long": ("errors.py", "\n" * (MAX_LINES + 1), "errors.py"),
    "too_long_functions": (
        "retention.py",
        "def planted() -> None:\n" + "    pass\n" * MAX_FUNCTION_LINES,
        "kvstore/retention.py:planted: 81 lines",
    ),
}


@pytest.mark.parametrize("planted", PLANTED)
def test_each_rule_catches_a_planted_violation(
    planted: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    rule = planted.partition("/")[0]
    if rule == "part_cycles":  # a circle needs both ways allowed, or the layering catches it
        monkeypatch.setitem(SAME_LAYER, ("router", "cli"), "planted")
    where, text, named = PLANTED[planted]
    copy = tmp_path / "kvstore"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__"))
    target = copy / where
    target.parent.mkdir(parents=True, exist_ok=True)
    with target.open("a") as file:
        file.write("\n" + text + "\n")
    planted_graph = read_graph(copy)
    report = RULES[rule](planted_graph)
    assert len(report) >= 1 and any(named in line for line in report), report
    # ... and the planted import is what broke it: the untouched package keeps the rule.
    assert RULES[rule](GRAPH) == []
    if rule == "part_cycles":  # and, allowed both ways or not, the module graph has no circle
        assert module_cycles(planted_graph) == []
