"""The settings table of docs/configuration.md is what ``scripts/gen_settings_table.py`` writes
from the settings' metadata, and lists every setting the loader knows, each with its environment
variable, so that the table cannot drift from :func:`kvstore.config.setting_names`."""

from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from kvstore.config import env_var, setting_names

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "configuration.md"
ROW = re.compile(r"^\| `([a-z_]+\.[a-z_]+)` \| `(KVSTORE_[A-Z_]+)` \|", re.M)


def test_the_table_is_what_the_script_writes() -> None:
    result = subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "gen_settings_table.py"), "--check"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stdout + result.stderr


def test_every_setting_has_a_row_with_its_environment_variable() -> None:
    rows = dict(ROW.findall(PAGE.read_text("utf-8")))
    missing = [name for name in setting_names() if name not in rows]
    assert missing == [], f"the settings table lacks {missing}"
    wrong = {name: rows[name] for name in setting_names() if rows[name] != env_var(name)}
    assert wrong == {}, f"the table names the wrong variable for {wrong}"
    unknown = sorted(set(rows) - set(setting_names()))
    assert unknown == [], f"the table lists settings the loader does not know: {unknown}"
    assert any(name.startswith("router.") for name in rows)


def test_a_hand_edit_fails_the_check_with_what_to_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.syspath_prepend(str(ROOT / "scripts"))
    import gen_settings_table as script

    docs = tmp_path / "docs"
    shutil.copytree(ROOT / "docs", docs)  # the other pages: where the help texts' links point
    page = docs / "configuration.md"
    current = PAGE.read_text("utf-8")
    page.write_text(current.replace("| `server.workers` |", "| `server.workerz` |"), "utf-8")
    monkeypatch.setattr(script, "ROOT", tmp_path)
    monkeypatch.setattr(script, "SETTINGS_PAGE", page)
    monkeypatch.setattr(script, "CONNECTOR_PAGE", docs / "vllm.md")
    monkeypatch.setattr(sys, "argv", ["gen_settings_table.py", "--check"])
    assert script.main() == 1
    assert "run python scripts/gen_settings_table.py" in capsys.readouterr().out
    monkeypatch.setattr(sys, "argv", ["gen_settings_table.py"])
    assert script.main() == 0
    assert page.read_text("utf-8") == current
