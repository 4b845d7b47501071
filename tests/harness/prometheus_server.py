"""A real Prometheus (Debian's ``prometheus`` package) for tests, and the expressions to check.

Not a conftest: :mod:`test_prometheus` imports it. :class:`PrometheusServer` runs
``/usr/bin/prometheus`` on a free loopback port with its storage in a temp directory, scraping and
evaluating rules every second, with a configuration derived from the shipped
``deploy/prometheus/prometheus.yml`` (same job name, same rule files; only the intervals and the
target change). A missing binary is an error naming the package, never a skip.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
import urllib.error
import urllib.parse
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType
from typing import Any

import yaml

from harness.ports import free_port
from harness.stop_process import stop_process

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
PROMETHEUS_CONFIG = DEPLOY / "prometheus" / "prometheus.yml"
ALERTS = DEPLOY / "prometheus" / "alerts.yml"
DASHBOARDS = DEPLOY / "grafana" / "dashboards"
INSTALL_HINT = (
    "scripts/test.sh installs it; on Debian/Ubuntu: apt-get install prometheus "
    "(the package also provides promtool)"
)


def binary(name: str) -> str:
    """Path of ``prometheus`` or ``promtool``; missing is an error that says how to install it."""
    found = shutil.which(name) or (f"/usr/bin/{name}" if Path(f"/usr/bin/{name}").exists() else "")
    if not found:
        raise RuntimeError(
            f"{name} is not installed: the Prometheus tests need it ({INSTALL_HINT})"
        )
    return found


class PrometheusServer:
    """``prometheus`` scraping ``target`` (HOST:PORT) every second, with the shipped rules."""

    def __init__(self, directory: Path, target: str) -> None:
        self.binary = binary("prometheus")
        self.directory = directory
        self.port = free_port()
        self.log_path = directory / "prometheus.log"
        self.config_path = directory / "prometheus.yml"
        self._process: subprocess.Popen[bytes] | None = None
        config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
        config["global"] = {"scrape_interval": "1s", "evaluation_interval": "1s"}
        # The shipped rule files, by absolute path (they are relative to the shipped config).
        config["rule_files"] = [str(PROMETHEUS_CONFIG.parent / f) for f in config["rule_files"]]
        (job,) = config["scrape_configs"]
        job["static_configs"] = [{"targets": [target]}]
        job["scrape_timeout"] = "1s"
        directory.mkdir(parents=True, exist_ok=True)
        self.config_path.write_text(yaml.safe_dump(config))

    @property
    def url(self) -> str:
        """``http://127.0.0.1:PORT``."""
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 30.0) -> PrometheusServer:
        """Start and wait until ``/-/ready`` answers."""
        command = [
            self.binary,
            f"--config.file={self.config_path}",
            f"--storage.tsdb.path={self.directory / 'data'}",
            f"--web.listen-address=127.0.0.1:{self.port}",
            "--web.enable-lifecycle",
        ]
        with self.log_path.open("ab") as log:
            self._process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + timeout
        while True:
            if self._process.poll() is not None:
                raise RuntimeError(
                    f"prometheus exited with {self._process.returncode}:\n{self.log()}"
                )
            try:
                with urllib.request.urlopen(f"{self.url}/-/ready", timeout=1) as reply:
                    if reply.status == 200:
                        return self
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"prometheus not ready after {timeout:.0f}s:\n{self.log()}")
            time.sleep(0.1)

    def wait_scraped(self, timeout: float = 30.0) -> None:
        """Wait for the first successful scrape of the target (Prometheus hands new targets to
        its scrapers some seconds after start: a workload before that would go unseen)."""
        deadline = time.monotonic() + timeout
        while not self.query('up{job="kvstore"} == 1'):
            if time.monotonic() > deadline:
                raise AssertionError(
                    f"prometheus has not scraped the target after {timeout:.0f}s: "
                    f"{self.api('targets')}\n{self.log()}"
                )
            time.sleep(0.2)

    def log(self) -> str:
        """The last lines Prometheus logged."""
        return self.log_path.read_text(errors="replace")[-4000:]

    def api(self, path: str, **params: str) -> Any:
        """GET ``/api/v1/PATH`` and return its ``data``; an error status raises with the reason."""
        query = urllib.parse.urlencode(params)
        try:
            with urllib.request.urlopen(f"{self.url}/api/v1/{path}?{query}", timeout=10) as reply:
                body = json.load(reply)
        except urllib.error.HTTPError as error:
            body = json.load(error)
        if body.get("status") != "success":
            raise AssertionError(f"{path} {params}: {body.get('errorType')}: {body.get('error')}")
        return body["data"]

    def query(self, expr: str) -> list[dict[str, Any]]:
        """The instant vector ``expr`` evaluates to now (``/api/v1/query``)."""
        data = self.api("query", query=expr)
        result = data["result"]
        if data["resultType"] == "scalar":
            return [{"metric": {}, "value": result}]
        assert data["resultType"] == "vector", f"{expr}: {data['resultType']}"
        return list(result)

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after a few seconds."""
        if self._process is None:
            return
        stop_process(self._process, grace_s=10)
        self._process = None

    def __enter__(self) -> PrometheusServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


# --- the expressions the shipped files use -------------------------------------------------------


def _panels(panels: list[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    for panel in panels:
        yield panel
        yield from _panels(panel.get("panels", []))  # collapsed rows nest their panels


def dashboard_variables(dashboard: dict[str, Any]) -> dict[str, str]:
    """Each query variable's value for "All" (its ``allValue``): what the test substitutes."""
    values = {"__rate_interval": "5m", "__interval": "1m"}
    for variable in dashboard.get("templating", {}).get("list", []):
        if variable["type"] == "query":
            assert variable.get("includeAll") and variable.get("allValue"), (
                f"variable {variable['name']}: give it includeAll and an allValue"
            )
            values[variable["name"]] = variable["allValue"]
    return values


def substitute(expr: str, values: dict[str, str]) -> str:
    """``expr`` with Grafana's ``$name`` / ``${name}`` replaced; an unknown variable is an error."""

    def one(match: re.Match[str]) -> str:
        name = match.group(1) or match.group(2)
        assert name in values, f"unknown dashboard variable ${name} in {expr}"
        return values[name]

    return re.sub(r"\$\{(\w+)\}|\$(\w+)", one, expr)


def dashboard_expressions() -> list[tuple[str, str]]:
    """``(where, expr)`` for every target of every panel of every dashboard, variables filled in,
    plus each query variable's metric (``label_values(METRIC, LABEL)`` needs METRIC to exist)."""
    found = []
    paths = sorted(DASHBOARDS.glob("*.json"))
    assert paths, f"no dashboards in {DASHBOARDS}"
    for path in paths:
        dashboard = json.loads(path.read_text())
        values = dashboard_variables(dashboard)
        for variable in dashboard.get("templating", {}).get("list", []):
            if variable["type"] == "query":
                query = variable["query"]["query"] if isinstance(variable["query"], dict) else ""
                match = re.fullmatch(r"label_values\((\w+(?:\{[^}]*\})?),\s*(\w+)\)", query)
                assert match, f"{path.name} variable {variable['name']}: {query!r}"
                found.append((f"{path.name} ${variable['name']}", match.group(1)))
        for panel in _panels(dashboard["panels"]):
            for target in panel.get("targets", []):
                where = f"{path.name} panel {panel['title']!r} {target.get('refId', '')}"
                found.append((where, substitute(target["expr"], values)))
    return found


def alert_rules() -> list[dict[str, Any]]:
    """Every rule of ``deploy/prometheus/alerts.yml``."""
    groups = yaml.safe_load(ALERTS.read_text())["groups"]
    return [rule for group in groups for rule in group["rules"]]


_OPERATORS = re.compile(r"==|!=|>=|<=|>|<|\band\b|\bor\b|\bunless\b")
_NUMBER = re.compile(r"[-+]?(\d+(\.\d*)?|\.\d+)([eE][-+]?\d+)?")


def operands(expr: str) -> list[str]:
    """The operands of ``expr``'s top-level comparisons and set operations (``and``, ``or``,
    ``unless``), recursively, leaving out bare numbers: for ``A < 0.5 * B and C > 1`` that is
    ``A``, ``0.5 * B`` and ``C``. Operators inside parentheses, label matchers (``{...}``), ranges
    (``[...]``) and strings belong to the operand they are in; a ``bool`` modifier or an
    ``on(...)``/``ignoring(...)`` after an operator is dropped with the operator."""
    depth = 0
    quote = ""
    cuts: list[tuple[int, int]] = []
    i = 0
    while i < len(expr):
        char = expr[i]
        if quote:
            if char == "\\":
                i += 2
                continue
            if char == quote:
                quote = ""
        elif char in "\"'`":
            quote = char
        elif char in "([{":
            depth += 1
        elif char in ")]}":
            depth -= 1
        elif depth == 0:
            match = _OPERATORS.match(expr, i)
            if match:
                end = match.end()
                modifier = re.compile(r"\s*(bool\b)?\s*((on|ignoring)\s*\([^)]*\))?").match(
                    expr, end
                )
                end = modifier.end() if modifier else end
                cuts.append((i, end))
                i = end
                continue
        i += 1
    if not cuts:
        return [] if _NUMBER.fullmatch(expr.strip()) else [expr.strip()]
    parts, start = [], 0
    for begin, end in cuts:
        parts.append(expr[start:begin])
        start = end
    parts.append(expr[start:])
    return [operand for part in parts for operand in operands(part)]
