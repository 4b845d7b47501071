"""The shipped dashboard and alert rules work against a real store scraped by a real Prometheus.

``test_every_dashboard_and_alert_expression_returns_data`` starts a real redis-server, a real
``kvstore serve`` (tiny dram so that blocks are evicted and demoted, the Redis tier on, /metrics on
port 0, the bound address read from its stdout) and a real Prometheus (Debian's ``prometheus``;
scrape and rule evaluation every second) with the configuration derived from
``deploy/prometheus/prometheus.yml`` and the shipped
``deploy/prometheus/alerts.yml``. A short workload runs over gRPC and shared memory: puts (more than
dram holds), gets (hits in dram and nvme, promotions), lookups and gets of absent keys (misses),
prefetches (ready and missing keys) and a Redis outage (shared tier down, write-throughs past a
re-send queue of 4 blocks dropped, a reconnect).

Then every expression is evaluated through ``/api/v1/query``, parsed out of the shipped files so
that nothing can drift: every target of every dashboard panel (Grafana variables replaced by their
"All" value) and every query variable's metric must return at least one sample with a finite
value. An alert expression is legitimately empty while its alert does not fire, so for alerts the
test evaluates the whole expression (it must be a valid query) and, separately, each operand of its
top-level comparisons and ``and``/``or``/``unless`` (the rules are written as ``SIGNAL > THRESHOLD``
for this): ``sum(increase(kvstore_shared_writes_dropped_total[5m])) > 0`` checks
``sum(increase(kvstore_shared_writes_dropped_total[5m]))``, which returns data whenever the metric
exists, and nothing when its name drifted. Prometheus's own rule health (``/api/v1/rules``) must be
"ok" for every rule. Three alerts are also made to fire for real: shared tier down and dropped
write-throughs during the Redis outage, store down after the store is killed.

The other tests check the files offline: ``promtool check rules`` and ``check config``,
``promtool test rules deploy/prometheus/alerts.test.yml`` (each alert fires on synthetic series
when it should and stays silent when it should not), and that
the dashboard, Grafana's provisioning and ``deploy/compose.yaml`` name each other consistently.
"""

from __future__ import annotations

import json
import math
import re
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import yaml
from harness.prometheus_server import (
    ALERTS,
    DASHBOARDS,
    DEPLOY,
    PROMETHEUS_CONFIG,
    PrometheusServer,
    alert_rules,
    binary,
    dashboard_expressions,
    operands,
)

from kvstore import ChunkHasher, KVStoreClient, Namespace
from kvstore.config import load_config
from kvstore.server.auth import check_exposure

if TYPE_CHECKING:
    from harness.serve import ServerProcess
    from harness.server_factory import ServerFactory

from harness.redis_server import RedisServer

NS = Namespace(model="prometheus-test", num_layers=2, num_kv_heads=2, head_size=64)
HASHER = ChunkHasher(chunk_size=16, namespace=NS)
BLOCK_BYTES = 64 * 1024
DRAM = "1MiB"  # about a dozen blocks: the workload's puts evict and demote
PROMETHEUS_WAIT_S = 30.0


def blocks(first_token: int, count: int) -> tuple[list[bytes], list[bytes]]:
    """``count`` chained keys and random payloads."""
    keys = HASHER.keys(list(range(first_token, first_token + 16 * count)))
    rng = np.random.default_rng(first_token)
    return keys, [rng.integers(0, 256, BLOCK_BYTES, dtype=np.uint8).tobytes() for _ in keys]


def wait_for(condition: Callable[[], str], within: float) -> None:
    """Poll until ``condition`` returns "" (all good); else fail with its last complaint."""
    deadline = time.monotonic() + within
    while True:
        complaint = condition()
        if not complaint:
            return
        assert time.monotonic() < deadline, complaint
        time.sleep(0.5)


def has_finite_sample(result: list[dict[str, object]]) -> bool:
    """Whether an instant vector holds at least one sample that is a number (not NaN)."""
    for sample in result:
        value = sample["value"]
        assert isinstance(value, list)
        if not math.isnan(float(value[1])):
            return True
    return False


def workload(target: str, redis: RedisServer, round_: int) -> None:
    """One round over both planes; rounds repeat across scrapes so that rates are not zero."""
    first = 1000 * round_
    for plane in ("grpc", "shm"):
        with KVStoreClient(target, namespace=NS, data_plane=plane, timeout=10.0) as kv:
            keys, values = blocks(first, 24)  # twice what dram holds: evictions, demotions
            kv.put(keys, values)
            assert kv.lookup(keys[-4:]) == 4
            assert kv.get(keys[-4:]) == values[-4:]  # dram hits
            kv.get(keys[:4])  # older blocks: from nvme (promoted) or redis
            absent, _ = blocks(first + 500, 3)
            assert kv.lookup(absent) == 0  # misses, reason absent
            assert kv.get(absent) == [None] * 3
            prefetch = kv.prefetch([*keys[:6], *absent])  # ready and missing outcomes
            kv.wait_prefetch(prefetch, timeout=20.0)
            first += 100
    if round_ == 2:  # the Redis outage: tier down, dropped write-throughs, then a reconnect
        redis.kill()
        with KVStoreClient(target, namespace=NS, data_plane="grpc", timeout=10.0) as kv:
            for extra in range(3):
                kv.put(*blocks(first + 700 + 100 * extra, 8))
                time.sleep(0.5)


def test_every_dashboard_and_alert_expression_returns_data(
    server_factory: ServerFactory, tmp_path: Path
) -> None:
    dashboard = dashboard_expressions()
    rules = alert_rules()
    assert len(rules) >= 5 and len(dashboard) >= 20
    redis = RedisServer(tmp_path / "redis").start()
    try:
        server = server_factory(
            "--redis-url",
            redis.url,
            "--metrics-listen",
            "127.0.0.1:0",
            dram_capacity=DRAM,
            nvme_capacity="64MiB",
            # A re-send queue of 4 blocks: the outage's 24 refused write-throughs overflow it,
            # so some are dropped and that alert fires too.
            env={"KVSTORE_REDIS_RESEND_QUEUE_BLOCKS": "4"},
        )
        metrics = metrics_address(server)
        with PrometheusServer(tmp_path / "prometheus", metrics) as prometheus:
            prometheus.wait_scraped()
            for round_ in range(6):
                workload(server.target, redis, round_)
                if round_ == 2:
                    assert_alert_fires(prometheus, "KvstoreSharedTierDown")
                    redis.restart()
                time.sleep(1.0)  # the next round lands in another scrape
            assert_alert_fires(prometheus, "KvstoreSharedWritesDropped")

            def missing() -> str:
                empty = []
                for where, expr in dashboard:
                    if not has_finite_sample(prometheus.query(expr)):
                        empty.append(f"{where}: {expr}")
                for rule in rules:
                    prometheus.query(rule["expr"])  # the whole expression is a valid query
                    for operand in operands(rule["expr"]):
                        if not has_finite_sample(prometheus.query(operand)):
                            empty.append(f"alert {rule['alert']} operand: {operand}")
                return (
                    f"{len(empty)} expressions return no data:\n" + "\n".join(empty)
                    if empty
                    else ""
                )

            wait_for(missing, PROMETHEUS_WAIT_S)

            def unhealthy() -> str:
                groups = prometheus.api("rules")["groups"]
                evaluated = {r["name"]: r for g in groups for r in g["rules"]}
                assert set(evaluated) == {rule["alert"] for rule in rules}
                return "\n".join(
                    f"{name}: {rule['health']} {rule.get('lastError', '')}"
                    for name, rule in evaluated.items()
                    if rule["health"] != "ok"
                )

            wait_for(unhealthy, 10.0)

            server.kill()  # the store goes away: up == 0
            assert_alert_fires(prometheus, "KvstoreDown")
    finally:
        redis.stop()


def metrics_address(server: ServerProcess) -> str:
    """HOST:PORT of the server's /metrics, from the line ``kvstore metrics on URL`` it prints."""
    found = ""

    def printed() -> str:
        nonlocal found
        match = re.search(r"^kvstore metrics on https?://([^/\s]+)", server_stdout(server), re.M)
        found = match.group(1) if match else ""
        return "" if found else "kvstore serve printed no 'kvstore metrics on URL' line"

    wait_for(printed, 10.0)
    return found


def server_stdout(server: ServerProcess) -> str:
    """What the server printed on stdout so far."""
    return server.stdout_path.read_text(errors="replace")


def assert_alert_fires(prometheus: PrometheusServer, name: str) -> None:
    """The alert's whole expression (threshold included) returns a series: it would fire."""
    (rule,) = [rule for rule in alert_rules() if rule["alert"] == name]

    def silent() -> str:
        if prometheus.query(rule["expr"]):
            return ""
        values = {operand: prometheus.query(operand) for operand in operands(rule["expr"])}
        return f"alert {name} does not fire: {rule['expr']}; its operands now: {values}"

    wait_for(silent, 60.0)


def test_operands_split_top_level_comparisons_only() -> None:
    assert operands('up{job="kvstore"} == 0') == ['up{job="kvstore"}']
    assert operands("sum(rate(a[5m])) > 0") == ["sum(rate(a[5m]))"]
    assert operands("(a / (b + c)) < 0.5 * (d > 1) and e >= 1") == [
        "(a / (b + c))",
        "0.5 * (d > 1)",
        "e",
    ]
    assert operands('x{l=~"a|>b"} > bool 2') == ['x{l=~"a|>b"}']
    assert operands("a > on(i) b") == ["a", "b"]
    assert operands("sum by (x) (rate(brand[1m]))") == ["sum by (x) (rate(brand[1m]))"]


def test_promtool_checks_the_rules_and_the_config() -> None:
    promtool = binary("promtool")
    checks = (
        ["check", "config", str(PROMETHEUS_CONFIG)],
        ["test", "rules", str(ALERTS.with_suffix(".test.yml"))],  # fire / stay silent
        ["check", "rules", str(ALERTS)],
    )
    for command in checks:
        result = subprocess.run(
            [promtool, *command], capture_output=True, text=True, timeout=60, check=False
        )
        assert result.returncode == 0, result.stdout + result.stderr
    assert f"{len(alert_rules())} rules found" in result.stdout


def test_every_alert_is_documented_and_covers_the_issue() -> None:
    rules = {rule["alert"]: rule for rule in alert_rules()}
    metrics = " ".join(rule["expr"] for rule in rules.values())
    for needed in (
        'up{job="kvstore"}',
        "kvstore_shared_tier_up",
        "kvstore_shared_writes_dropped_total",
        "kvstore_tier_write_errors_total",
        "kvstore_tier_hits_total",
    ):
        assert needed in metrics, needed
    for name, rule in rules.items():
        assert rule["labels"]["severity"] in {"critical", "warning"}, name
        assert rule["annotations"]["summary"] and rule["annotations"]["description"], name
    # The scrape job the alerts select is the one the shipped config defines.
    config = yaml.safe_load(PROMETHEUS_CONFIG.read_text())
    assert [job["job_name"] for job in config["scrape_configs"]] == ["kvstore"]


def test_dashboard_provisioning_and_compose_agree() -> None:
    grafana = DEPLOY / "grafana"
    (datasource,) = yaml.safe_load(
        (grafana / "provisioning" / "datasources" / "prometheus.yaml").read_text()
    )["datasources"]
    (provider,) = yaml.safe_load(
        (grafana / "provisioning" / "dashboards" / "kvstore.yaml").read_text()
    )["providers"]
    compose = yaml.safe_load((DEPLOY / "compose.yaml").read_text())["services"]
    assert {"kvstore", "redis", "prometheus", "grafana"} <= set(compose)

    def mounts(service: str) -> dict[str, str]:
        """Container path -> host path (relative to deploy/) of a service's bind mounts."""
        pairs = [volume.split(":") for volume in compose[service]["volumes"]]
        return {container: host for host, container, *_ in pairs if host.startswith("./")}

    grafana_mounts = mounts("grafana")
    assert grafana_mounts["/etc/grafana/provisioning"] == "./grafana/provisioning"
    assert grafana_mounts[provider["options"]["path"]] == "./grafana/dashboards"
    prometheus_mounts = mounts("prometheus")
    assert prometheus_mounts["/etc/prometheus/prometheus.yml"] == "./prometheus/prometheus.yml"
    for rule_file in yaml.safe_load(PROMETHEUS_CONFIG.read_text())["rule_files"]:
        assert prometheus_mounts[f"/etc/prometheus/{rule_file}"] == f"./prometheus/{rule_file}"
    for host in [*grafana_mounts.values(), *prometheus_mounts.values()]:
        assert (DEPLOY / host).exists(), host
    # Grafana reaches Prometheus by its service name; Prometheus scrapes kvstore's metrics port.
    assert datasource["url"] == "http://prometheus:9090"
    (job,) = yaml.safe_load(PROMETHEUS_CONFIG.read_text())["scrape_configs"]
    (target,) = job["static_configs"][0]["targets"]
    environment = compose["kvstore"]["environment"]
    assert environment["KVSTORE_SERVER_METRICS_LISTEN"] == f"0.0.0.0:{target.split(':')[1]}"
    assert target.split(":")[0] == "kvstore"
    assert environment["KVSTORE_REDIS_URL"].startswith("redis://redis:")
    # The image's configuration with the compose environment is a valid one that serves metrics.
    config = load_config(str(DEPLOY / "kvstore.toml"), env=dict(environment))
    assert config.server.metrics_listen == environment["KVSTORE_SERVER_METRICS_LISTEN"]
    assert config.redis.url == environment["KVSTORE_REDIS_URL"]
    check_exposure(config)

    for path in DASHBOARDS.glob("*.json"):
        board = json.loads(path.read_text())
        (variable,) = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
        assert variable["current"]["value"] == datasource["uid"]
        occupied: set[tuple[int, int]] = set()
        for panel in board["panels"]:
            assert panel["type"] == "row" or panel["datasource"]["uid"] == "${datasource}"
            box = panel["gridPos"]
            cells = {
                (x, y)
                for x in range(box["x"], box["x"] + box["w"])
                for y in range(box["y"], box["y"] + box["h"])
            }
            assert box["x"] + box["w"] <= 24 and not cells & occupied, panel["title"]
            occupied |= cells
