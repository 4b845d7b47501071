"""Tests of :mod:`harness.serve`, the tests' one launcher of a real ``kvstore serve``: a user's
``KVSTORE_*`` settings and a config file's default addresses never reach its servers, a refused
start names its config and log, a restart keeps what it should."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
from harness.serve import ServerProcess, clean_env, toml_text

from kvstore import Namespace

NS = Namespace(model="launcher", num_layers=1, num_kv_heads=1, head_size=8)
SIZES = {"dram.capacity": "16MiB", "nvme.capacity": "16MiB"}


def test_toml_text_reads_back_as_the_document() -> None:
    document = {
        "server": {"listen": "127.0.0.1:1", "shm_socket_mode": 0o600, "operators": ["a", "b"]},
        "cluster": {"enabled": True, "publish_interval_s": 0.05, "engine_namespace": '{"m": 1}'},
        "tenants": {"a": {"identities": ["alice"], "dram": "16MiB", "shm": False}},
    }
    assert tomllib.loads(toml_text(document)) == document


def test_a_users_kvstore_variables_never_reach_the_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Each of these would stop the server from starting, or move it, if it leaked through.
    monkeypatch.setenv("KVSTORE_DRAM_CAPACITY", "not-a-size")
    monkeypatch.setenv("KVSTORE_SERVER_LISTEN", "127.0.0.1:1")
    monkeypatch.setenv("KVSTORE_CONFIG", str(tmp_path / "missing.toml"))
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert not [name for name in clean_env() if name.startswith("KVSTORE_")]
    with ServerProcess(tmp_path / "s", settings=SIZES) as server:
        assert server.target != "127.0.0.1:1"
        assert server.stats()["blocks"] == 0
        # The automatic socket went to the server's own TMPDIR, not to $XDG_RUNTIME_DIR.
        assert [p.name[:8] for p in server.tmpdir.iterdir()] == ["kvstore-"]
    assert not server.tmpdir.exists()


def test_a_given_config_file_keeps_its_settings_but_not_the_default_addresses(
    tmp_path: Path,
) -> None:
    given = tmp_path / "given.toml"
    given.write_text(
        '[server]\nlisten = "127.0.0.1:50051"\nmetrics_listen = "127.0.0.1:9464"\n'
        'max_block_bytes = "1MiB"\n[nvme]\npath = "/nowhere/nvme"\n'
    )
    with ServerProcess(tmp_path / "s", ["--config", str(given)], settings=SIZES) as server:
        written = tomllib.loads(server.config_path.read_text())
        assert written["server"]["max_block_bytes"] == "1MiB"
        assert written["server"]["metrics_listen"] == "127.0.0.1:0"
        assert written["nvme"]["path"] == str(tmp_path / "s" / "nvme")
        assert not server.target.endswith(":50051")
        assert not server.metrics_url.startswith("http://127.0.0.1:9464/")
        assert "--config" in server.command() and str(given) not in server.command()


def test_a_refused_start_names_the_config_and_the_servers_words(tmp_path: Path) -> None:
    server = ServerProcess(tmp_path / "s", settings={"dram.capacity": "lots"})
    with pytest.raises(RuntimeError) as refused:
        server.start()
    text = str(refused.value)
    assert "exited with" in text and 'capacity = "lots"' in text and "dram.capacity" in text
    assert not server.running
    server.close()


def test_a_restart_keeps_the_blocks_and_on_request_the_address(tmp_path: Path) -> None:
    with ServerProcess(tmp_path / "s", settings=SIZES, namespace=NS) as server:
        with server.client(data_plane="grpc") as client:
            assert client.put([b"k" * 16], [b"v" * 64]).stored == 1
        first = server.target
        server.restart(same_address=True)
        assert server.target == first and server.starts == 2
        with server.client(data_plane="grpc") as client:
            assert client.get([b"k" * 16]) == [b"v" * 64]  # dram was saved to nvme on the way
        assert (
            tmp_path / "s" / "serve-1.err"
        ).exists() and server.stderr_path.name == "serve-2.err"
