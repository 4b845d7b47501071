"""A real Redis Cluster on loopback for tests: masters with replicas, master kill, failover.

Not a conftest: test modules import :class:`RedisCluster` and wrap it in their own fixture.
``RedisCluster(directory, masters=3, replicas=1)`` starts ``masters * (1 + replicas)``
``redis-server --cluster-enabled yes`` processes (non-persistent, ``cluster-node-timeout`` 1 s),
joins them with ``redis-cli --cluster create`` and waits until every node says
``cluster_state:ok``. :meth:`kill_master` SIGKILLs the master that owns a slot and
:meth:`wait_promoted` waits until one of its replicas took over and the cluster is ok again.
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import redis

from harness.ports import free_port
from harness.redis_server import redis_server_binary

__all__ = ["ClusterNode", "RedisCluster", "cluster_port"]


def cluster_port() -> int:
    """A free port whose cluster bus port (``port + 10000``) is valid and free too."""
    while True:
        port = free_port()
        if port + 10000 > 65535:
            continue
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


@dataclass
class ClusterNode:
    """One redis-server of the cluster."""

    port: int
    directory: Path
    process: subprocess.Popen[bytes] | None = None

    def client(self, timeout: float = 1.0) -> redis.Redis:
        """A plain (non-cluster) client on this one node."""
        return redis.Redis(
            host="127.0.0.1", port=self.port, socket_timeout=timeout, socket_connect_timeout=timeout
        )

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None


class RedisCluster:
    """``masters`` masters with ``replicas`` replicas each on loopback, files in ``directory``."""

    def __init__(
        self, directory: Path, *, masters: int = 3, replicas: int = 1, node_timeout_ms: int = 1000
    ) -> None:
        self.binary = redis_server_binary()
        cli = shutil.which("redis-cli")
        if cli is None:
            raise RuntimeError("redis-cli is not installed: the Redis Cluster tests need it")
        self.cli = cli
        self.directory = directory
        self.masters = masters
        self.replicas = replicas
        self.node_timeout_ms = node_timeout_ms
        self.nodes = [
            ClusterNode(port, directory / f"node-{port}")
            for port in (cluster_port() for _ in range(masters * (1 + replicas)))
        ]
        self._heirs: dict[int, list[ClusterNode]] = {}

    @property
    def url(self) -> str:
        """``redis+cluster://127.0.0.1:PORT/0`` bootstrapped from the first node."""
        return f"redis+cluster://127.0.0.1:{self.nodes[0].port}/0"

    def start(self, timeout: float = 60.0) -> RedisCluster:
        """Start every node, create the cluster and wait until every node says ok."""
        for node in self.nodes:
            self._launch(node)
        for node in self.nodes:
            self._poll(lambda node=node: self._answers(node), 10.0, f"PING on {node.port}")
        addresses = [f"127.0.0.1:{node.port}" for node in self.nodes]
        create = [self.cli, "--cluster", "create", *addresses]
        create += ["--cluster-replicas", str(self.replicas), "--cluster-yes"]
        result = subprocess.run(create, capture_output=True, timeout=timeout, check=False)
        if result.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {result.stdout[-2000:]!r}")
        self.wait_ok(timeout)
        # Every replica must have finished its first sync, else killing its master loses it.
        self._poll(self._replicas_synced, timeout, "replicas in sync")
        # And every node must list every replica in CLUSTER SLOTS (gossip takes a moment): a
        # client that bootstraps earlier would not know which masters have one.
        self._poll(self._replicas_listed, timeout, "replicas listed in CLUSTER SLOTS")
        return self

    def _launch(self, node: ClusterNode) -> None:
        node.directory.mkdir(parents=True, exist_ok=True)
        command = [self.binary, "--port", str(node.port), "--bind", "127.0.0.1"]
        command += ["--save", "", "--appendonly", "no", "--cluster-enabled", "yes"]
        command += ["--cluster-config-file", str(node.directory / "nodes.conf")]
        command += ["--cluster-node-timeout", str(self.node_timeout_ms)]
        # A replica's first sync starts at once instead of after the 5 s that diskless sync
        # waits by default for more replicas to join it.
        command += ["--repl-diskless-sync-delay", "0"]
        # CLUSTER SLOTS lists a replica only once its replication offset is not 0, which with
        # no writes happens at the master's first replication PING: every second, not every 10.
        command += ["--repl-ping-replica-period", "1"]
        command += ["--dir", str(node.directory)]
        with (node.directory / "log").open("ab") as log:
            node.process = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)

    @staticmethod
    def _poll(condition: object, within: float, what: str) -> None:
        assert callable(condition)
        deadline = time.monotonic() + within
        while not condition():
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis cluster: {what} not within {within} s")
            time.sleep(0.05)

    @staticmethod
    def _answers(node: ClusterNode) -> bool:
        try:
            with node.client() as client:
                return bool(client.ping())
        except redis.RedisError:
            return False

    def _info(self, node: ClusterNode) -> dict[str, str]:
        with node.client() as client:
            return dict(client.execute_command("CLUSTER INFO"))

    def _ok(self, node: ClusterNode) -> bool:
        try:
            return self._info(node).get("cluster_state") == "ok"
        except redis.RedisError:
            return False

    def wait_ok(self, within: float = 30.0) -> None:
        """Wait until every live node says ``cluster_state:ok``."""
        self._poll(
            lambda: all(self._ok(node) for node in self.nodes if node.alive), within, "state ok"
        )

    def _replicas_synced(self) -> bool:
        for node in self.nodes:
            if not node.alive:
                continue
            try:
                with node.client() as client:
                    info = client.info("replication")
            except redis.RedisError:
                return False
            if info.get("role") == "slave" and info.get("master_link_status") != "up":
                return False
        return True

    def _replicas_listed(self) -> bool:
        for node in self.nodes:
            try:
                with node.client() as client:
                    ranges = client.execute_command("CLUSTER SLOTS")
            except redis.RedisError:
                return False
            if any(len(entry) < 3 + self.replicas for entry in ranges):
                return False
        return True

    def roles(self) -> dict[int, tuple[str, int | None]]:
        """Per live node's port, its role (``master``/``slave``) and, for a replica, its master's
        port, as the first live node sees it."""
        live = next(node for node in self.nodes if node.alive)
        with live.client() as client:
            nodes = client.execute_command("CLUSTER NODES")
        by_id = {
            info["node_id"]: int(address.rsplit(":", 1)[1].split("@")[0])
            for address, info in nodes.items()
        }
        out: dict[int, tuple[str, int | None]] = {}
        for address, info in nodes.items():
            port = int(address.rsplit(":", 1)[1].split("@")[0])
            flags = info["flags"]
            role = "master" if "master" in flags else "slave"
            master = by_id.get(info["master_id"]) if role == "slave" else None
            if "fail" not in flags:
                out[port] = (role, master)
        return out

    def node(self, port: int) -> ClusterNode:
        return next(node for node in self.nodes if node.port == port)

    def master_of(self, key: bytes | str) -> ClusterNode:
        """The node serving ``key``'s slot now."""
        live = next(node for node in self.nodes if node.alive)
        with live.client() as client:
            slot = int(client.execute_command("CLUSTER KEYSLOT", key))
            for start, end, master, *_replicas in client.execute_command("CLUSTER SLOTS"):
                if start <= slot <= end:
                    return self.node(int(master[1]))
        raise RuntimeError(f"no master serves slot {slot}")

    def replicas_of(self, master: ClusterNode) -> list[ClusterNode]:
        return [
            self.node(port)
            for port, (role, of) in self.roles().items()
            if role == "slave" and of == master.port
        ]

    def kill_master(self, master: ClusterNode | None = None, key: bytes | str = b"") -> ClusterNode:
        """SIGKILL ``master`` (default: the one serving ``key``'s slot) and return it; its
        replicas, noted before the kill, are what :meth:`wait_promoted` waits on."""
        master = master if master is not None else self.master_of(key)
        assert self.roles()[master.port][0] == "master", f"{master.port} is not a master"
        self._heirs[master.port] = self.replicas_of(master)
        assert master.process is not None
        master.process.kill()
        master.process.wait()
        master.process = None
        return master

    def wait_promoted(self, killed: ClusterNode, within: float = 30.0) -> ClusterNode:
        """Wait until a replica of the killed master is a master and every live node says ok."""
        heirs = self._heirs[killed.port]

        def promoted() -> ClusterNode | None:
            for heir in heirs:
                try:
                    with heir.client() as client:
                        if client.info("replication").get("role") == "master":
                            return heir
                except redis.RedisError:
                    continue
            return None

        self._poll(lambda: promoted() is not None, within, f"a replica of {killed.port} promoted")
        self.wait_ok(within)
        heir = promoted()
        assert heir is not None
        return heir

    def failover(self, replica: ClusterNode, within: float = 30.0) -> None:
        """``CLUSTER FAILOVER`` on ``replica`` (a manual, lossless switch) and wait for it."""
        with replica.client() as client:
            client.execute_command("CLUSTER FAILOVER")
        self._poll(
            lambda: self.roles().get(replica.port, ("", None))[0] == "master", within, "failover"
        )
        self.wait_ok(within)

    def stop(self) -> None:
        """SIGKILL every node (nothing is persisted, so there is nothing to shut down cleanly)."""
        for node in self.nodes:
            if node.process is not None:
                node.process.kill()
                node.process.wait()
                node.process = None

    def __enter__(self) -> RedisCluster:
        try:
            return self.start()
        except BaseException:
            self.stop()
            raise

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()
