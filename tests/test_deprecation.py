"""The deprecation policy (:mod:`kvstore.deprecation`): every old import path of a moved module
still gives the module, the same object as at its new path, with a warning naming the release
that removes it; type checkers follow the old path through its stub. Every deprecated setting
(an old name, an alias, one that is ignored) warns with the release that removes it, and no
deprecation warning in kvstore/ is worded by hand."""

from __future__ import annotations

import ast
import contextlib
import importlib
import logging
import subprocess
import sys
from pathlib import Path

import pytest

import kvstore
from kvstore.config import deprecated_names, env_var, load_config, setting_metas
from kvstore.config.cluster import PEER_TOKEN_DEPRECATED
from kvstore.config.keys import ALIASES as ENGINE_ALIASES
from kvstore.config.router import ROUTER_KEYS_DEPRECATED
from kvstore.deprecation import MOVED_MODULES, REMOVED_IN
from kvstore.errors import ConfigError

PACKAGE = Path(kvstore.__file__).parent


@pytest.mark.parametrize(("old", "new"), MOVED_MODULES.items())
def test_an_old_path_is_the_new_module_with_a_warning(old: str, new: str) -> None:
    sys.modules.pop(old, None)
    with pytest.warns(DeprecationWarning, match=rf"{old} moved to {new}.*kvstore {REMOVED_IN}"):
        module = importlib.import_module(old)
    assert module is importlib.import_module(new)
    assert module.__spec__ is not None and module.__spec__.name == new  # its own spec kept
    # the file is gone from the old place (a plain rename), a stub for type checkers is there
    short = old.rpartition(".")[2]
    assert not (PACKAGE / f"{short}.py").exists()
    assert f"from {new} import *" in (PACKAGE / f"{short}.pyi").read_text()


def test_every_stub_names_a_moved_module() -> None:
    stubs = {f"kvstore.{p.stem}" for p in PACKAGE.glob("*.pyi")}
    assert stubs == set(MOVED_MODULES)


def test_from_import_of_an_old_path_in_a_fresh_process() -> None:
    """``from kvstore.store_config import DramConfig`` as other code wrote it still runs, and
    the warning points at the line that imported."""
    script = (
        "import warnings\nwarnings.simplefilter('always')\n"
        "from kvstore.store_config import DramConfig\n"
        "from kvstore.config.store import DramConfig as New\nassert DramConfig is New\n"
    )
    done = subprocess.run(
        [sys.executable, "-c", script],
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
        cwd=PACKAGE.parent,
    )
    assert done.returncode == 0, done.stderr
    assert "<string>:3: DeprecationWarning: kvstore.store_config moved" in done.stderr


# -- deprecated settings: every warning names the release that removes the setting -----------

ENV = {"KVSTORE_NVME_PATH": "/nonexistent/kvstore-test", "KVSTORE_DRAM_CAPACITY": "64MiB"}
REMOVAL = f"removed in kvstore {REMOVED_IN}"


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


@pytest.mark.parametrize("old", sorted(deprecated_names()))
def test_every_old_setting_name_warns_with_its_removal(
    old: str, caplog: pytest.LogCaptureFixture
) -> None:
    meta = setting_metas()[deprecated_names()[old]]
    value = {"": "1", "size": "1MiB", "mode": "0600", "list": "a"}.get(meta.kind, "1")
    if meta.kind == "choice":
        value = meta.choices[0]
    logs = caplog.at_level(logging.WARNING, logger="kvstore.config")
    with logs, contextlib.suppress(ConfigError):  # a value the section refuses still warned
        load_config(env={**ENV, env_var(old): value})
    assert any(env_var(old) in w and REMOVAL in w for w in _warnings(caplog)), _warnings(caplog)


def test_the_old_cuda_check_variable_warns_with_its_removal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    with caplog.at_level(logging.WARNING, logger="kvstore.config"):
        config = load_config(env={**ENV, "KVSTORE_FORCE_CUDA_CHECK": "1"})
    assert config.dram.force_cuda_check
    assert [w for w in _warnings(caplog) if "KVSTORE_FORCE_CUDA_CHECK" in w and REMOVAL in w]


def test_the_old_engine_settings_warn_with_their_removal(
    caplog: pytest.LogCaptureFixture,
) -> None:
    env = {f"KVSTORE_CLUSTER_ENGINE_{old.upper()}": v for old, v in [("chunk_size", "64")]}
    with caplog.at_level(logging.WARNING, logger="kvstore.config"):
        load_config(env={**ENV, **env})
    assert [w for w in _warnings(caplog) if "cluster.engine_chunk_size" in w and REMOVAL in w]


def test_every_deprecated_setting_has_a_warning_naming_its_removal() -> None:
    """A setting its help calls deprecated is named by one of the warnings that say when it
    goes: the engine aliases' (with_aliases), cluster.peer_token's, the router's fallback."""
    deprecated = {n for n, m in setting_metas().items() if m.help.startswith("deprecated")}
    assert deprecated  # the check checks something
    for warning in (PEER_TOKEN_DEPRECATED, ROUTER_KEYS_DEPRECATED):
        assert warning.endswith(REMOVAL), warning
    named = {f"cluster.{old}" for old in ENGINE_ALIASES}
    named |= {n for n in deprecated if n in PEER_TOKEN_DEPRECATED or n in ROUTER_KEYS_DEPRECATED}
    assert sorted(deprecated - named) == []


def _name(node: ast.AST) -> str:
    if isinstance(node, ast.Name):
        return node.id
    return node.attr if isinstance(node, ast.Attribute) else ""


def test_no_deprecation_warning_is_worded_by_hand() -> None:
    """Every ``logger.warning`` / ``warnings.warn`` in kvstore/ whose text says "deprecated"
    takes that text from :func:`kvstore.deprecation.deprecated` (or ``removal_note``, or a
    ``*_DEPRECATED`` constant made by it), so none can leave out the release."""
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        if "_proto" in path.parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)):
                continue
            if node.func.attr not in ("warning", "warn"):
                continue
            texts = [
                c.value
                for arg in node.args
                for c in ast.walk(arg)
                if isinstance(c, ast.Constant) and isinstance(c.value, str)
            ]
            if not any("deprecated" in t for t in texts):
                continue
            names = {n.id for arg in node.args for n in ast.walk(arg) if isinstance(n, ast.Name)}
            attrs = {
                n.attr for arg in node.args for n in ast.walk(arg) if isinstance(n, ast.Attribute)
            }
            made = names | attrs
            if not (
                {"deprecated", "removal_note"} & made
                or any(n.endswith("_DEPRECATED") for n in made)
            ):
                found.append(f"{path.relative_to(PACKAGE.parent)}:{node.lineno}")
    assert found == []
