"""The one way the tests start a real ``kvstore serve``: :class:`ServerProcess`.

Every server it starts is hermetic, so a user's own ``kvstore serve`` on the README's defaults
(gRPC on 127.0.0.1:50051, metrics on 127.0.0.1:9464, an ``auto`` socket in the temp directory,
data under ``~/.local/share/kvstore``) and the user's ``KVSTORE_*`` variables never meet a test:

* its settings come from a TOML file the launcher writes (``serve-N.toml`` in its work
  directory): the tables of a ``--config FILE`` among its flags, folded in, then gRPC on a free
  loopback port, /metrics on port 0 and nvme in the work directory (whatever that file says),
  then the caller's ``settings`` and ``tenants``; flags and ``env`` come after the file and win
  over it, as they do for users;
* its environment is the test's without any ``KVSTORE_*`` variable and without
  ``XDG_RUNTIME_DIR``, with ``TMPDIR`` a short directory of its own (the ``auto`` socket
  directory lands there: found by the test, removed by :meth:`ServerProcess.close`), plus
  exactly the ``env`` the caller gives;
* readiness is the ``kvstore serving on ADDR`` line, polled with a deadline; a server that exits
  or misses it fails the test with its output and its config file.

Stdout and stderr go to ``NAME-N.out`` / ``NAME-N.err`` in the work directory, one pair per
start, so that a restart keeps the log of the run before it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from types import TracebackType
from typing import Any, Protocol

from harness.ports import free_port
from harness.stop_process import stop_process

__all__ = ["METRICS_LINE", "READY_LINE", "Host", "ServerProcess", "clean_env", "toml_text"]

#: What ``kvstore serve`` prints once it answers on ADDR.
READY_LINE = "kvstore serving on "
#: What it prints (before the ready line) when its /metrics endpoint is up.
METRICS_LINE = "kvstore metrics on "
START_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 20.0


class Host(Protocol):
    """Where a server runs other than this host's loopback: a network namespace
    (``tests/harness/netns_hosts.py``) with an address of its own and a way to run a command in
    it."""

    address: str

    def command(self, argv: Sequence[str]) -> list[str]:
        """``argv`` run inside this host; the process it starts must be the command's own."""
        ...


def without_settings(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """This process's environment without ``KVSTORE_*`` variables (a user's settings), then
    ``env`` on top: for any kvstore command a test runs."""
    base = {name: value for name, value in os.environ.items() if not name.startswith("KVSTORE_")}
    return {**base, **(env or {})}


def clean_env(env: Mapping[str, str] | None = None) -> dict[str, str]:
    """:func:`without_settings` and without ``XDG_RUNTIME_DIR`` (the directory an ``auto``
    socket would go to), then ``env`` on top: for a server."""
    base = without_settings()
    base.pop("XDG_RUNTIME_DIR", None)
    return {**base, **(env or {})}


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int | float):
        return repr(value)
    if isinstance(value, str | os.PathLike):
        return json.dumps(os.fspath(value))  # a JSON string is a TOML basic string
    if isinstance(value, list | tuple):
        return "[" + ", ".join(_toml_value(item) for item in value) + "]"
    raise TypeError(f"no TOML for {value!r}")


def toml_text(document: Mapping[str, Mapping[str, Any]]) -> str:
    """``document`` (section → key → value, a value may be a table of its own:
    ``{"tenants": {"a": {...}}}``) as TOML text."""
    lines: list[str] = []

    def table(name: str, values: Mapping[str, Any]) -> None:
        lines.append(f"[{name}]")
        nested = {key: value for key, value in values.items() if isinstance(value, Mapping)}
        lines.extend(f"{k} = {_toml_value(v)}" for k, v in values.items() if k not in nested)
        for key, value in nested.items():
            table(f"{name}.{key}", value)

    for section, values in document.items():
        table(section, values)
    return "\n".join(lines) + "\n"


class ServerProcess:
    """One ``kvstore serve`` subprocess in ``workdir``; start it again (after a stop or a kill)
    on the same nvme directory, on a fresh port or its last address.

    ``flags``: more ``kvstore serve`` flags, kept in :attr:`flags` (a list a test may edit before
    a restart); a ``--config FILE`` among them is folded into the generated file. ``settings``:
    dotted setting names and values (``{"server.tokens_file": path}``) for the generated file;
    ``tenants``: tenant name → its ``[tenants.NAME]`` table. ``env``: variables the server gets
    on top of :func:`clean_env` (``KVSTORE_*`` ones included). ``nvme_path``: ``workdir/nvme``
    unless given (``""`` turns the tier off). ``listen``: a fixed ``HOST:PORT`` instead of a free
    port per start. ``host``: the network namespace to run in. ``tmpdir``: the server's
    ``TMPDIR`` (where its ``auto`` socket directory goes) instead of a fresh one.
    ``namespace``: the default of :meth:`client`. ``name``: the prefix of its files.
    """

    def __init__(
        self,
        workdir: Path,
        flags: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        *,
        settings: Mapping[str, Any] | None = None,
        tenants: Mapping[str, Mapping[str, Any]] | None = None,
        nvme_path: Path | str | None = None,
        listen: str | None = None,
        host: Host | None = None,
        tmpdir: Path | None = None,
        namespace: Any = None,
        name: str = "serve",
    ) -> None:
        workdir.mkdir(parents=True, exist_ok=True)
        self.workdir = workdir
        self.flags = list(flags)
        self.env = dict(env or {})
        self.settings = dict(settings or {})
        self.tenants = {tenant: dict(table) for tenant, table in (tenants or {}).items()}
        #: The LMDB directory of the next run (a test may change it between runs).
        self.nvme_path = Path(nvme_path) if nvme_path else workdir / "nvme"
        #: False where ``nvme_path`` was ``""``: the tier is off.
        self.nvme_enabled = nvme_path != ""
        #: The network namespace it runs in; None: this host, loopback.
        self.host = host
        self.listen = listen or ""
        self.namespace = namespace
        self.name = name
        # Short: socket paths must stay far below the 108-byte limit, and pytest's are long.
        self._own_tmpdir = tmpdir is None
        self.tmpdir = tmpdir if tmpdir is not None else Path(tempfile.mkdtemp(prefix="kvt-"))
        self.tmpdir.mkdir(parents=True, exist_ok=True)
        self.proc: subprocess.Popen[bytes] | None = None
        #: ``HOST:PORT`` the current (or last) run serves on.
        self.target = ""
        #: ``http://HOST:PORT/metrics`` of the current run ("" where metrics are off).
        self.metrics_url = ""
        self.returncode: int | None = None
        self.starts = 0

    # --- files -------------------------------------------------------------------------------

    @property
    def config_path(self) -> Path:
        """The TOML file the current (or last) run was started with."""
        return self.workdir / f"{self.name}-{self.starts}.toml"

    @property
    def stdout_path(self) -> Path:
        """The current (or last) run's stdout: the ready and metrics lines."""
        return self.workdir / f"{self.name}-{self.starts}.out"

    @property
    def stderr_path(self) -> Path:
        """The current (or last) run's stderr: the server's log."""
        return self.workdir / f"{self.name}-{self.starts}.err"

    def stdout(self) -> str:
        """What the current (or last) run wrote to stdout."""
        return _read(self.stdout_path)

    def stderr(self) -> str:
        """What the current (or last) run wrote to stderr: the server's log."""
        return _read(self.stderr_path)

    def output(self) -> str:
        """Both, for a failure message."""
        return f"--- stdout ---\n{self.stdout()}--- stderr ---\n{self.stderr()}"

    # --- the configuration -------------------------------------------------------------------

    def document(self, listen: str) -> dict[str, dict[str, Any]]:
        """The generated config of a run on ``listen``: the tables of a ``--config FILE`` among
        the flags, then the hermetic addresses and nvme path (over the file's), then
        :attr:`settings` and :attr:`tenants` (flags and ``env`` win over all of it)."""
        document: dict[str, dict[str, Any]] = {}
        given = _config_flag(self.flags)
        if given is not None:
            with open(given, "rb") as handle:
                document = tomllib.load(handle)
        # Over the given file (a deployment example may name the defaults): never a user's.
        document.setdefault("server", {}).update(listen=listen, metrics_listen="127.0.0.1:0")
        document.setdefault("nvme", {})["path"] = str(self.nvme_path) if self.nvme_enabled else ""
        for setting, value in self.settings.items():
            section, _, key = setting.partition(".")
            document.setdefault(section, {})[key] = value
        for tenant, table in self.tenants.items():
            document.setdefault("tenants", {})[tenant] = table
        return document

    def command(self) -> list[str]:
        """The command line of the next run (the config file is written by :meth:`start`)."""
        flags = _without_config_flag(self.flags)
        return [
            sys.executable,
            *("-m", "kvstore.cli", "serve", "--config", str(self.config_path), *flags),
        ]

    # --- the process -------------------------------------------------------------------------

    def start(self, *, same_address: bool = False) -> ServerProcess:
        """Start on a fresh free port (or the fixed ``listen``, or with ``same_address`` the
        last run's address) and wait for the ready line; a server that exits first or misses
        the deadline raises :class:`RuntimeError` with its config file and output."""
        assert not self.running, "already running"
        if self.listen:
            listen = self.listen
        elif same_address and self.target:
            listen = self.target
        else:
            address = self.host.address if self.host is not None else "127.0.0.1"
            listen = f"{address}:{free_port()}"
        self.starts += 1
        self.config_path.write_text(toml_text(self.document(listen)))
        env = {
            **clean_env(),
            "PYTHONUNBUFFERED": "1",
            "TMPDIR": str(self.tmpdir),
            **self.env,
        }
        command = self.command()
        # `ip netns exec` execs the server itself: the pid and its signals are the server's.
        argv = self.host.command(command) if self.host is not None else command
        with self.stdout_path.open("wb") as out, self.stderr_path.open("wb") as err:
            self.proc = subprocess.Popen(argv, stdout=out, stderr=err, env=env)
        self.returncode = None
        self.target, self.metrics_url = self._wait_ready()
        return self

    def _wait_ready(self) -> tuple[str, str]:
        assert self.proc is not None
        deadline = time.monotonic() + START_TIMEOUT_S
        while True:
            text = self.stdout()
            lines = text.splitlines()
            ready = [line for line in lines if line.startswith(READY_LINE)]
            if ready and text.endswith("\n"):
                metrics = [line for line in lines if line.startswith(METRICS_LINE)]
                target = ready[0][len(READY_LINE) :].strip()
                return target, metrics[0][len(METRICS_LINE) :].strip() if metrics else ""
            if self.proc.poll() is not None or time.monotonic() > deadline:
                state = (
                    f"exited with {self.proc.returncode}"
                    if self.proc.poll() is not None
                    else f"not ready within {START_TIMEOUT_S:.0f} s"
                )
                self.kill()
                # RuntimeError: a test may expect a start to be refused (pytest.raises).
                raise RuntimeError(
                    f"kvstore serve {' '.join(self.command()[4:])} {state}\n"
                    f"--- {self.config_path.name} ---\n{_read(self.config_path)}"
                    f"{self.output()}"
                )
            time.sleep(0.02)

    @property
    def running(self) -> bool:
        """True while the process has not exited."""
        return self.proc is not None and self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM) -> int:
        """Send ``sig`` and wait for the exit code; SIGTERM and SIGINT must shut the server down
        gracefully, with exit code 0, within :data:`STOP_TIMEOUT_S` (else the test fails, with
        the server's log, after a SIGKILL)."""
        assert self.proc is not None, "never started"
        if not stop_process(self.proc, STOP_TIMEOUT_S, sig):
            self.returncode = self.proc.returncode
            raise AssertionError(
                f"kvstore serve ignored {signal.Signals(sig).name} for {STOP_TIMEOUT_S:.0f} s\n"
                f"{self.stderr()}"
            )
        self.returncode = self.proc.returncode
        if sig in (signal.SIGTERM, signal.SIGINT):
            assert self.returncode == 0, (
                f"kvstore serve exited {self.returncode} on {signal.Signals(sig).name}\n"
                f"{self.stderr()}"
            )
        return self.returncode

    def restart(self, *, same_address: bool = False) -> ServerProcess:
        """SIGTERM (asserting a clean exit), then start again on the same nvme directory."""
        self.stop()
        return self.start(same_address=same_address)

    def kill(self) -> None:
        """SIGKILL, no questions asked."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
        if self.proc is not None:
            self.returncode = self.proc.wait()

    def close(self) -> None:
        """Kill it if it still runs and remove the temp directory the launcher made for it (a
        killed server leaves its socket directory there); every fixture's cleanup."""
        self.kill()
        if self._own_tmpdir:
            shutil.rmtree(self.tmpdir, ignore_errors=True)

    def __enter__(self) -> ServerProcess:
        return self if self.running else self.start()

    def __exit__(
        self,
        kind: type[BaseException] | None,
        error: BaseException | None,
        trace: TracebackType | None,
    ) -> None:
        self.close()

    # --- talking to it -----------------------------------------------------------------------

    def client(self, namespace: Any = ..., **kwargs: Any) -> Any:
        """A blocking :class:`kvstore.KVStoreClient` on this server (in ``namespace``, else the
        launcher's ``namespace``)."""
        from kvstore import KVStoreClient

        chosen = self.namespace if namespace is ... else namespace
        return KVStoreClient(self.target, namespace=chosen, **kwargs)

    def stats(self, timeout: float = 5.0) -> dict[str, Any]:
        """The server's stats, over gRPC."""
        from kvstore import KVStoreClient

        with KVStoreClient(self.target, timeout=timeout, data_plane="grpc") as client:
            return client.stats()


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _config_flag(flags: Sequence[str]) -> str | None:
    """The FILE of the last ``--config FILE`` / ``--config=FILE`` in ``flags`` (argparse's pick)."""
    found = None
    for at, flag in enumerate(flags):
        if flag == "--config" and at + 1 < len(flags):
            found = flags[at + 1]
        elif flag.startswith("--config="):
            found = flag.partition("=")[2]
    return found


def _without_config_flag(flags: Sequence[str]) -> list[str]:
    kept: list[str] = []
    skip = False
    for flag in flags:
        if skip:
            skip = False
        elif flag == "--config":
            skip = True
        elif not flag.startswith("--config="):
            kept.append(flag)
    return kept
