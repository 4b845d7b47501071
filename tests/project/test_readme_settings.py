"""The README's settings table lists every setting the loader knows, each with its environment
variable, so that the table cannot drift from :func:`kvstore.config.setting_names`."""

from __future__ import annotations

import re
from pathlib import Path

from kvstore.config import env_var, setting_names

README = Path(__file__).resolve().parents[2] / "README.md"
ROW = re.compile(r"^\| `([a-z_]+\.[a-z_]+)` \| `(KVSTORE_[A-Z_]+)` \|", re.M)


def test_every_setting_has_a_row_with_its_environment_variable() -> None:
    rows = dict(ROW.findall(README.read_text("utf-8")))
    missing = [name for name in setting_names() if name not in rows]
    assert missing == [], f"README settings table lacks {missing}"
    wrong = {name: rows[name] for name in setting_names() if rows[name] != env_var(name)}
    assert wrong == {}, f"README names the wrong variable for {wrong}"
    unknown = sorted(set(rows) - set(setting_names()))
    assert unknown == [], f"README lists settings the loader does not know: {unknown}"
