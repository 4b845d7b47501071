"""The multi-host harness itself (tests/harness/netns_hosts.py): hosts reach each other over the
bridge, and nothing reaches a host's loopback from outside it, so a test that passes across hosts
did cross a network path."""

from __future__ import annotations

import socket
import subprocess
import sys

from harness.netns_hosts import Hosts

LISTEN = """
import socket, sys
server = socket.socket()
server.bind((sys.argv[1], 7700))
server.listen()
print("ready", flush=True)
conn, _ = server.accept()
conn.sendall(b"hello from " + sys.argv[1].encode())
"""

CONNECT = """
import socket, sys
try:
    with socket.create_connection((sys.argv[1], 7700), timeout=1.0) as conn:
        print(conn.recv(64).decode())
except OSError as exc:
    print("refused", type(exc).__name__)
"""


def listen(hosts: Hosts, index: int, address: str) -> subprocess.Popen[str]:
    proc = hosts[index].popen(
        [sys.executable, "-c", LISTEN, address], stdout=subprocess.PIPE, text=True
    )
    assert proc.stdout is not None and proc.stdout.readline().strip() == "ready"
    return proc


def connect(hosts: Hosts, index: int, address: str) -> str:
    done = hosts[index].run(
        [sys.executable, "-c", CONNECT, address], capture_output=True, text=True, timeout=30
    )
    return done.stdout.strip()


def test_hosts_talk_over_the_bridge_and_loopback_stays_private() -> None:
    with Hosts(2) as hosts:
        assert hosts[0].address != hosts[1].address
        server = listen(hosts, 0, hosts[0].address)
        try:
            assert connect(hosts, 1, hosts[0].address) == f"hello from {hosts[0].address}"
        finally:
            server.kill()
            server.wait()

        # Host 0's loopback is not host 1's: the same address and port from host 1 finds nothing.
        private = listen(hosts, 0, "127.0.0.1")
        try:
            assert connect(hosts, 1, "127.0.0.1").startswith("refused")
            # From the root namespace neither (the test process is "another host" too).
            with socket.socket() as probe:
                probe.settimeout(1.0)
                assert probe.connect_ex(("127.0.0.1", 7700)) != 0
        finally:
            private.kill()
            private.wait()

        # The root namespace reaches every host through the bridge's gateway address.
        server = listen(hosts, 1, hosts[1].address)
        try:
            with socket.create_connection((hosts[1].address, 7700), timeout=2.0) as conn:
                assert conn.recv(64) == f"hello from {hosts[1].address}".encode()
        finally:
            server.kill()
            server.wait()
        namespaces = [host.namespace for host in hosts]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert not any(name in listed for name in namespaces)
