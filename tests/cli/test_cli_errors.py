"""The ``kvstore`` command explains itself: version, help with placeholders and defaults, and
one-line errors (no traceback, nothing opened or written) for every source of a setting.

Every test runs the real command in a subprocess, as a user would.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from harness.serve import without_settings

import kvstore
from kvstore.config import load_config, parse_size

TIMEOUT_S = 30


def kvstore_cli(
    *args: str, env: dict[str, str] | None = None, timeout: float = TIMEOUT_S
) -> subprocess.CompletedProcess[str]:
    """``python -m kvstore.cli ARGS`` with the test's environment (PYTHONPATH included)."""
    return subprocess.run(
        [sys.executable, "-m", "kvstore.cli", *args],
        env=without_settings(env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def one_line_error(result: subprocess.CompletedProcess[str]) -> str:
    """The single error line of a failed run; asserts the failure had no traceback."""
    assert result.returncode != 0, result.stdout + result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    errors = [line for line in lines if "error" in line.lower() or line.startswith("kvstore ")]
    assert len(errors) == 1, result.stderr
    return errors[0]


def test_version_names_the_package_version() -> None:
    result = kvstore_cli("--version")
    assert result.returncode == 0, result.stderr
    assert result.stdout.startswith(f"kvstore {kvstore.__version__} ")
    assert str(Path(kvstore.__file__).parent) in result.stdout


def test_bare_command_prints_the_commands_and_exits_2() -> None:
    result = kvstore_cli()
    assert result.returncode == 2
    assert "Traceback" not in result.stderr
    for command in ("serve", "stats", "demo"):
        assert command in result.stderr


def test_serve_help_shows_placeholders_and_this_machines_defaults() -> None:
    result = kvstore_cli("serve", "--help")
    assert result.returncode == 0, result.stderr
    text = " ".join(result.stdout.split())  # argparse wraps lines
    for placeholder in ("--dram-capacity SIZE", "--listen HOST:PORT", "--nvme-path DIR"):
        assert placeholder in text
    assert "--redis-url URL" in text and "--tls-cert FILE" in text
    assert "DRAM_CAPACITY" not in text
    defaults = load_config(None, env={k: v for k, v in os.environ.items() if "KVSTORE_" not in k})
    assert f"(default: {defaults.nvme.path})" in text
    assert defaults.nvme.path.startswith("/")  # resolved, no ~
    assert "(default: 127.0.0.1:50051)" in text
    # The arena default follows the memory available at the moment help runs: a real size.
    shown = text.rsplit("--dram-capacity SIZE", 1)[1].split("(default: ", 1)[1].split(",")[0]
    assert 0 < parse_size(shown) <= 16 * 1024**3


def test_misspelt_flag_suggests_the_right_one() -> None:
    line = one_line_error(kvstore_cli("serve", "--dram-capcity", "1GiB"))
    assert "--dram-capcity" in line and "did you mean --dram-capacity?" in line


def test_size_from_the_environment_names_setting_variable_and_format(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    result = kvstore_cli("serve", "--nvme-path", str(nvme), env={"KVSTORE_NVME_CAPACITY": "big"})
    line = one_line_error(result)
    assert "nvme.capacity" in line and "KVSTORE_NVME_CAPACITY" in line and "'big'" in line
    assert "GiB" in line  # what a size looks like
    assert not nvme.exists()


def test_size_from_a_flag_names_the_setting(tmp_path: Path) -> None:
    line = one_line_error(
        kvstore_cli("serve", "--nvme-path", str(tmp_path / "n"), "--nvme-capacity", "5x")
    )
    assert "nvme.capacity" in line and "command line" in line and "'5x'" in line


def test_size_from_the_config_file_names_the_file(tmp_path: Path) -> None:
    config = tmp_path / "kvstore.toml"
    config.write_text(f'[nvme]\npath = "{tmp_path / "n"}"\ncapacity = "lots"\n')
    line = one_line_error(kvstore_cli("serve", "--config", str(config)))
    assert "nvme.capacity" in line and str(config) in line and "'lots'" in line
    assert not (tmp_path / "n").exists()


def test_unknown_key_in_the_config_file_suggests_the_known_one(tmp_path: Path) -> None:
    config = tmp_path / "kvstore.toml"
    config.write_text("[dram]\ncapacty = 1\n")
    line = one_line_error(kvstore_cli("serve", "--config", str(config)))
    assert "dram.capacty" in line and "did you mean dram.capacity?" in line


def test_arena_larger_than_the_machine_names_dram_capacity_and_the_maximum(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    line = one_line_error(
        kvstore_cli("serve", "--dram-capacity", "100TiB", "--nvme-path", str(nvme))
    )
    assert "dram.capacity=100.0 TiB" in line and "at most" in line and "MemTotal" in line
    assert not nvme.exists()


def test_port_out_of_range_names_listen_and_the_range(tmp_path: Path) -> None:
    result = kvstore_cli("serve", "--listen", "127.0.0.1:99999", "--nvme-path", str(tmp_path / "n"))
    line = one_line_error(result)
    assert "server.listen" in line and "'127.0.0.1:99999'" in line and "0 to 65535" in line


def test_port_in_use_is_refused_before_any_tier_opens(tmp_path: Path) -> None:
    nvme = tmp_path / "nvme"
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        listen = f"127.0.0.1:{taken.getsockname()[1]}"
        line = one_line_error(kvstore_cli("serve", "--listen", listen, "--nvme-path", str(nvme)))
    assert "server.listen" in line and listen in line and "already in use" in line
    assert not nvme.exists()  # LMDB (and the integrity key) never opened


def test_log_level_names_the_allowed_levels() -> None:
    line = one_line_error(kvstore_cli("serve", "--log-level", "chatty"))
    assert "--log-level" in line and "CHATTY" in line
    assert all(level in line for level in ("DEBUG", "INFO", "WARNING", "ERROR"))


def test_unknown_kvstore_variable_is_warned_with_the_closest_known_one() -> None:
    env = {
        "KVSTORE_NVME_CAPACTY": "1GiB",
        # Read by clients and the test suites: never warned about.
        "KVSTORE_TOKEN": "x",
        "KVSTORE_TLS_CA": "",
        "KVSTORE_FUZZ_SEED": "1",
        "KVSTORE_SKIP_SLOW": "1",
        "KVSTORE_SKIP_VLLM": "1",
    }
    result = kvstore_cli("--version", env=env)
    assert result.returncode == 0  # --version exits before the warning; check a command too
    result = kvstore_cli("stats", "--target", "127.0.0.1:1", "--timeout", "1", env=env)
    warnings = [line for line in result.stderr.splitlines() if "warning" in line]
    assert warnings == [
        "kvstore: warning: unknown environment variable KVSTORE_NVME_CAPACTY ignored, "
        "did you mean KVSTORE_NVME_CAPACITY?"
    ]
    assert "Traceback" not in result.stderr


@pytest.mark.parametrize("name", ["KVSTORE_TARGET", "KVSTORE_DATA_PLANE", "KVSTORE_HASH_SECRET"])
def test_client_side_variables_are_known(name: str) -> None:
    from kvstore.config import unknown_env_vars

    assert unknown_env_vars({name: "x"}) == []


MEMINFO = """MemTotal:       16000000 kB
MemAvailable:    8000000 kB
CommitLimit:    10000000 kB
Committed_AS:    9000000 kB
"""


def test_arena_limit_is_the_machines_memory_or_what_strict_overcommit_leaves() -> None:
    from kvstore.cli.checks import arena_limit, check_arena
    from kvstore.errors import ConfigError

    assert arena_limit(MEMINFO, "0") == (16000000 * 1024, "MemTotal, the memory of this machine")
    limit, why = arena_limit(MEMINFO, "2")
    assert limit == 1000000 * 1024 and "overcommit_memory=2" in why
    check_arena(900000 * 1024, MEMINFO, "2")
    with pytest.raises(ConfigError, match=r"dram\.capacity=.*at most 976\.6 MiB"):
        check_arena(1100000 * 1024, MEMINFO, "2")


@pytest.mark.parametrize(
    ("target", "says"),
    [
        ("127.0.0.1:0", "a port from 1 to 65535"),
        ("127.0.0.1:70000", "a port from 1 to 65535"),
        ("host:port", "a port from 1 to 65535"),
        ("http://127.0.0.1:50051", "is a URL"),
        ("a b:1", "HOST:PORT"),
    ],
)
def test_bad_target_names_the_flag_and_the_form(target: str, says: str) -> None:
    line = one_line_error(kvstore_cli("stats", "--target", target))
    assert "--target" in line and says in line, line


def test_a_target_without_a_port_means_the_servers_default_port_not_443() -> None:
    from kvstore.cli.targets import parse_target
    from kvstore.config import ServerConfig

    default_port = ServerConfig().listen.rpartition(":")[2]
    assert parse_target("localhost") == f"localhost:{default_port}"
    assert parse_target("[::1]") == f"[::1]:{default_port}"
    assert parse_target("[::1]:7000") == "[::1]:7000"
    help_text = kvstore_cli("stats", "--help").stdout
    assert f"HOST alone means port {default_port}" in " ".join(help_text.split())


@pytest.mark.parametrize("command", ["stats", "demo"])
def test_nothing_listening_asks_whether_kvstore_serve_runs(command: str) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]  # bound, never listening: connections are refused
        line = one_line_error(kvstore_cli(command, "--target", f"127.0.0.1:{port}"))
    assert line.startswith(
        f"kvstore {command}: nothing answers at 127.0.0.1:{port} — is `kvstore serve` running?"
    ), line


def test_a_taken_default_metrics_port_gives_way_to_a_free_one_in_one_warning_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    from kvstore.cli.checks import free_metrics_port

    with socket.socket() as holder:  # another server's /metrics
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        taken = f"127.0.0.1:{holder.getsockname()[1]}"
        config = load_config(
            env={}, overrides={"nvme.path": str(tmp_path), "server.metrics_listen": taken}
        )
        with caplog.at_level("WARNING", logger="kvstore.cli.checks"):
            moved = free_metrics_port(config, default=taken)
        assert moved.server.metrics_listen == "127.0.0.1:0"
        assert [r.getMessage() for r in caplog.records] == [
            f"metrics port {taken.rpartition(':')[2]} is in use (another kvstore serve on this "
            "host?): serving /metrics on a free port instead, shown by the 'kvstore metrics on' "
            "line; pin one with --metrics-listen HOST:PORT"
        ]
        # Not the default (set by the user): used as given, and refused by preflight if taken.
        assert free_metrics_port(config).server.metrics_listen == taken
    # The default port free: kept.
    assert free_metrics_port(config, default=taken).server.metrics_listen == taken


def test_a_metrics_port_that_was_set_and_is_taken_is_still_refused(tmp_path: Path) -> None:
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        port = holder.getsockname()[1]
        result = kvstore_cli(
            "serve", "--listen", "127.0.0.1:0", "--nvme-path", str(tmp_path / "nvme"),
            "--dram-capacity", "16MiB", "--metrics-listen", f"127.0.0.1:{port}",
        )  # fmt: skip
    line = one_line_error(result)
    assert "server.metrics_listen" in line and "already in use" in line, line


def test_a_dram_tier_smaller_than_one_page_is_refused_naming_both_settings(tmp_path: Path) -> None:
    line = one_line_error(
        kvstore_cli("serve", "--dram-capacity", "1KiB", "--nvme-path", str(tmp_path / "nvme"))
    )
    assert "dram.capacity=1024 B is smaller than one page (dram.page_size=64.0 KiB)" in line
    assert "at least 64KiB, or 0" in line
    assert not (tmp_path / "nvme").exists()  # refused before anything opened


def test_help_says_which_units_are_binary_and_which_decimal() -> None:
    assert parse_size("4G") == 4 * 10**9 and parse_size("4GiB") == 4 * 1024**3
    text = " ".join(kvstore_cli("serve", "--help").stdout.split())
    assert "KiB... are powers of 1024; KB or K... powers of 1000: 4G is 4000000000 bytes" in text


def test_an_old_setting_name_warns_once_naming_the_new_one(tmp_path: Path) -> None:
    """``[server] shm_socket_mode`` moved to ``[shm] socket_mode``: the old variable still sets it
    (here to a bad value, so that the command ends at once and names the new setting)."""
    nvme = tmp_path / "nvme"
    env = {"KVSTORE_SERVER_SHM_SOCKET_MODE": "rw-rw----"}
    result = kvstore_cli("serve", "--nvme-path", str(nvme), env=env)
    warnings = [line for line in result.stderr.splitlines() if "WARNING" in line]
    assert len(warnings) == 1, result.stderr
    assert "KVSTORE_SERVER_SHM_SOCKET_MODE is deprecated" in warnings[0]
    assert "use KVSTORE_SHM_SOCKET_MODE" in warnings[0]
    line = one_line_error(result)
    assert "shm.socket_mode (from KVSTORE_SERVER_SHM_SOCKET_MODE)" in line, line
    assert not nvme.exists()
