"""The ``[ucx]`` section's lanes and in-flight limits: defaults, loading, refusals."""

from __future__ import annotations

import pytest

from kvstore.config import load_config
from kvstore.data_plane_config import UcxConfig
from kvstore.errors import ConfigError


def test_defaults_and_the_environment() -> None:
    config = UcxConfig()
    assert (config.lanes, config.max_lanes) == (1, 8)
    loaded = load_config(
        env={"KVSTORE_UCX_LANES": "3", "KVSTORE_UCX_TENANT_BYTES_IN_FLIGHT": "2GiB"}
    )
    assert loaded.ucx.lanes == 3 and loaded.ucx.tenant_bytes_in_flight == 2 * 1024**3


@pytest.mark.parametrize(
    ("field", "value", "message"),
    [
        ("lanes", 0, "ucx.lanes must be 1 to 8, got 0"),
        ("max_lanes", 9, "ucx.max_lanes must be 1 to 8, got 9"),
        ("connection_bytes_in_flight", 0, "ucx.connection_bytes_in_flight"),
        ("tenant_bytes_in_flight", -1, "ucx.tenant_bytes_in_flight"),
    ],
)
def test_bad_values_name_the_setting(field: str, value: int, message: str) -> None:
    with pytest.raises(ConfigError, match=message):
        UcxConfig(**{field: value})
