"""Throwaway certificates for the TLS tests, made with the ``openssl`` command.

Not a conftest: :func:`make_pki` writes a CA, a server certificate for 127.0.0.1/localhost, a
client certificate (CN ``alice``) signed by the CA, and a second, unrelated CA with its own client
certificate (CN ``mallory``), into a directory.
"""

from __future__ import annotations

import shutil
import subprocess
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Pki", "make_pki"]


@dataclass(frozen=True)
class Pki:
    """Paths of the files :func:`make_pki` wrote."""

    ca: Path
    server_cert: Path
    server_key: Path
    client_cert: Path
    client_key: Path
    rogue_ca: Path
    rogue_cert: Path
    rogue_key: Path


def _openssl(*args: str, cwd: Path) -> None:
    binary = shutil.which("openssl")
    assert binary is not None, "the TLS tests need the openssl command (apt-get install openssl)"
    subprocess.run([binary, *args], cwd=cwd, check=True, capture_output=True, timeout=30)


def _ca(directory: Path, name: str) -> None:
    _openssl(
        "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.pem", "-days", "2", "-subj", f"/CN={name}",
        cwd=directory,
    )  # fmt: skip


def _leaf(directory: Path, ca: str, name: str, cn: str, extension: str) -> None:
    _openssl(
        "req", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes",
        "-keyout", f"{name}.key", "-out", f"{name}.csr", "-subj", f"/CN={cn}",
        cwd=directory,
    )  # fmt: skip
    (directory / f"{name}.ext").write_text(extension + "\n")
    _openssl(
        "x509", "-req", "-in", f"{name}.csr", "-CA", f"{ca}.pem", "-CAkey", f"{ca}.key",
        "-CAcreateserial", "-out", f"{name}.pem", "-days", "2", "-extfile", f"{name}.ext",
        cwd=directory,
    )  # fmt: skip


def make_pki(directory: Path) -> Pki:
    """Write the certificates into ``directory`` (created) and return their paths."""
    directory.mkdir(parents=True, exist_ok=True)
    _ca(directory, "ca")
    _ca(directory, "rogue-ca")
    _leaf(directory, "ca", "server", "kvstore", "subjectAltName=IP:127.0.0.1,DNS:localhost")
    _leaf(directory, "ca", "client", "alice", "extendedKeyUsage=clientAuth")
    _leaf(directory, "rogue-ca", "rogue", "mallory", "extendedKeyUsage=clientAuth")
    return Pki(
        ca=directory / "ca.pem",
        server_cert=directory / "server.pem",
        server_key=directory / "server.key",
        client_cert=directory / "client.pem",
        client_key=directory / "client.key",
        rogue_ca=directory / "rogue-ca.pem",
        rogue_cert=directory / "rogue.pem",
        rogue_key=directory / "rogue.key",
    )
