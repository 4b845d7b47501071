"""Client settings: read from the environment in one place, checked, passed down."""

from __future__ import annotations

import pytest

from kvstore import KVStoreClient
from kvstore.client import AsyncKVStoreClient, ClientSettings
from kvstore.errors import ConfigError


def test_defaults_when_unset_or_empty() -> None:
    assert ClientSettings.from_env({}) == ClientSettings("auto", True)
    empty = {"KVSTORE_DATA_PLANE": "", "KVSTORE_SHM_DIRECT_READS": ""}
    assert ClientSettings.from_env(empty) == ClientSettings("auto", True)


@pytest.mark.parametrize("plane", ["auto", "shm", "ucx", "grpc"])
def test_every_data_plane_is_accepted(plane: str) -> None:
    assert ClientSettings.from_env({"KVSTORE_DATA_PLANE": plane}).data_plane == plane


def test_direct_reads_switch() -> None:
    assert not ClientSettings.from_env({"KVSTORE_SHM_DIRECT_READS": "0"}).shm_direct_reads
    assert ClientSettings.from_env({"KVSTORE_SHM_DIRECT_READS": "1"}).shm_direct_reads


def test_prefault_switch() -> None:
    assert ClientSettings.from_env({}).shm_prefault
    assert not ClientSettings.from_env({"KVSTORE_SHM_PREFAULT": "0"}).shm_prefault
    with pytest.raises(ConfigError, match=r"KVSTORE_SHM_PREFAULT must be 1 or 0.*'off'"):
        ClientSettings.from_env({"KVSTORE_SHM_PREFAULT": "off"})


def test_bad_values_name_the_setting_and_the_allowed_values() -> None:
    with pytest.raises(ConfigError, match=r"KVSTORE_DATA_PLANE.*auto, shm, ucx, grpc.*'tcp'"):
        ClientSettings.from_env({"KVSTORE_DATA_PLANE": "tcp"})
    with pytest.raises(ConfigError, match=r"KVSTORE_SHM_DIRECT_READS must be 1 or 0.*'yes'"):
        ClientSettings.from_env({"KVSTORE_SHM_DIRECT_READS": "yes"})
    with pytest.raises(ValueError, match="data_plane"):  # ConfigError is a ValueError
        ClientSettings(data_plane="fast")


def test_settings_are_frozen() -> None:
    settings = ClientSettings()
    with pytest.raises(AttributeError):
        settings.data_plane = "grpc"  # type: ignore[misc]


def test_the_environment_is_read_when_a_client_is_built(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVSTORE_DATA_PLANE", "grpc")
    monkeypatch.setenv("KVSTORE_SHM_DIRECT_READS", "0")
    with KVStoreClient("127.0.0.1:1") as client:
        assert client.settings == ClientSettings("grpc", False)
    # The argument wins over the environment, and given settings are not re-read from it.
    with KVStoreClient("127.0.0.1:1", data_plane="shm") as client:
        assert client.settings == ClientSettings("shm", False)
    with KVStoreClient("127.0.0.1:1", settings=ClientSettings("ucx")) as client:
        assert client.settings == ClientSettings("ucx", True)
    monkeypatch.setenv("KVSTORE_DATA_PLANE", "bogus")
    with pytest.raises(ConfigError, match="KVSTORE_DATA_PLANE"):
        KVStoreClient("127.0.0.1:1")
    with pytest.raises(ConfigError, match="data_plane"):
        AsyncKVStoreClient("127.0.0.1:1", data_plane="bogus")


def test_ucx_lanes_are_a_bounded_whole_number() -> None:
    assert ClientSettings.from_env({}).ucx_lanes == 1
    assert ClientSettings.from_env({"KVSTORE_UCX_LANES": "4"}).ucx_lanes == 4
    for bad in ("0", "9", "two", "-1"):
        with pytest.raises(
            ConfigError, match="KVSTORE_UCX_LANES must be a whole number from 1 to 8"
        ):
            ClientSettings.from_env({"KVSTORE_UCX_LANES": bad})


def test_ucx_control_messages_are_a_switch_off_by_default() -> None:
    assert ClientSettings.from_env({}).ucx_control is False
    assert ClientSettings.from_env({"KVSTORE_UCX_CONTROL": "1"}).ucx_control is True
    with pytest.raises(ConfigError, match="KVSTORE_UCX_CONTROL must be 1 or 0"):
        ClientSettings.from_env({"KVSTORE_UCX_CONTROL": "yes"})
