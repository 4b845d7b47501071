"""Client-side settings: what a client process takes from its environment, read in one place.

The server's settings come from :func:`kvstore.config.load_config`; a client has only a few, and
none of them needs a file, so :meth:`ClientSettings.from_env` reads them from the environment
(``os.environ`` unless given a mapping) and checks them once. The modules below the clients
receive the resulting object, or the values in it, and never read the environment themselves.

======================== ================================ =======================================
variable                 values                           meaning
======================== ================================ =======================================
``KVSTORE_DATA_PLANE``   ``auto`` (default), ``shm``,     the path of data calls (see
                         ``ucx``, ``grpc``                :mod:`kvstore.client.shm_link`)
``KVSTORE_SHM_DIRECT_    ``1`` (default), ``0``           ``0`` sends every shared-memory read
READS``                                                   through the server (leases), e.g. to
                                                          rule the published index out
``KVSTORE_SHM_PREFAULT`` ``1`` (default), ``0``           ``0``: no background fault-in of the
                                                          pages of the arena's blocks on the
                                                          first read (see
                                                          :mod:`kvstore.client.shm_prefault`)
``KVSTORE_SHM_CUDA_      ``all`` (default), ``off``, or   how much of the arena a CUDA engine's
REGISTER``               a size such as ``16GiB``         process page-locks for DMA, in the
                                                          background (see
                                                          :mod:`kvstore.client.arena_registration`)
``KVSTORE_TOKEN``        a bearer token (default none)    sent on every call, for a server with
                                                          ``auth.tokens_file``
``KVSTORE_TLS_CA``       a PEM file (default none)        the CA of the server's certificate;
                                                          set, the client connects over TLS
``KVSTORE_UCX_CONTROL``  ``0`` (default), ``1``           ``1``: UCX gets and puts send their
                                                          control messages over the UCX endpoint
                                                          (see :mod:`kvstore.client.ucx_control`)
                                                          instead of a gRPC call
======================== ================================ =======================================
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass

from kvstore.config.sizes import parse_size
from kvstore.errors import ConfigError

__all__ = [
    "CUDA_REGISTER_ENV",
    "DATA_PLANES",
    "DATA_PLANE_ENV",
    "DIRECT_READS_ENV",
    "PREFAULT_ENV",
    "TLS_CA_ENV",
    "TOKEN_ENV",
    "UCX_CONTROL_ENV",
    "UCX_LANES_ENV",
    "ClientSettings",
]

#: Accepted values of a client's data plane (its ``data_plane`` argument or the variable).
DATA_PLANES = ("auto", "shm", "ucx", "grpc")
DATA_PLANE_ENV = "KVSTORE_DATA_PLANE"
DIRECT_READS_ENV = "KVSTORE_SHM_DIRECT_READS"
PREFAULT_ENV = "KVSTORE_SHM_PREFAULT"
CUDA_REGISTER_ENV = "KVSTORE_SHM_CUDA_REGISTER"
TOKEN_ENV = "KVSTORE_TOKEN"
TLS_CA_ENV = "KVSTORE_TLS_CA"
UCX_LANES_ENV = "KVSTORE_UCX_LANES"
UCX_CONTROL_ENV = "KVSTORE_UCX_CONTROL"
#: Most UCX lanes a client may open (as ``ucx.max_lanes`` allows at most on a server).
_MAX_LANES = 8
_SWITCH = {"1": True, "0": False}


@dataclass(frozen=True)
class ClientSettings:
    """The settings of one client (see the module docstring); checked when built."""

    #: ``"auto"``, ``"shm"``, ``"ucx"`` or ``"grpc"``.
    data_plane: str = "auto"
    #: Whether shared-memory reads look in the server's published index first.
    shm_direct_reads: bool = True
    #: Whether the first shared-memory read starts faulting the pages of the arena's blocks in.
    shm_prefault: bool = True
    #: Bytes of the arena a CUDA engine page-locks for DMA: ``None`` all of it, 0 none.
    shm_cuda_register: int | None = None
    #: Bearer token sent on every call ("" for none); the clients' ``token=`` overrides it.
    token: str = ""
    #: PEM file of the server's CA ("" for a plain channel); the clients' ``tls_ca=`` overrides it.
    tls_ca: str = ""
    #: UCX endpoints (lanes) the client opens to a server.
    ucx_lanes: int = 1
    #: Whether UCX gets and puts send their control messages over the UCX endpoint itself
    #: (bound by ``UcxBind``) instead of a gRPC call; off by default: on 2 shared cores over TCP
    #: it measured slower than the gRPC call (BENCHMARKS.md, issue 40).
    ucx_control: bool = False

    def __post_init__(self) -> None:
        if not 1 <= self.ucx_lanes <= _MAX_LANES:
            raise ConfigError(
                f"ucx_lanes ({UCX_LANES_ENV}) must be 1 to {_MAX_LANES}, got {self.ucx_lanes}"
            )
        if self.data_plane not in DATA_PLANES:
            raise ConfigError(
                f"data_plane ({DATA_PLANE_ENV}) must be one of {', '.join(DATA_PLANES)}, "
                f"got {self.data_plane!r}"
            )

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> ClientSettings:
        """The settings in ``env`` (default: ``os.environ``); unset or empty means the default.

        Raises :class:`~kvstore.errors.ConfigError` naming the variable and its allowed values.
        """
        env = os.environ if env is None else env
        data_plane = env.get(DATA_PLANE_ENV) or "auto"
        direct = env.get(DIRECT_READS_ENV) or "1"
        prefault = env.get(PREFAULT_ENV) or "1"
        control = env.get(UCX_CONTROL_ENV) or "0"
        switches = (
            (DIRECT_READS_ENV, direct),
            (PREFAULT_ENV, prefault),
            (UCX_CONTROL_ENV, control),
        )
        for name, value in switches:
            if value not in _SWITCH:
                raise ConfigError(f"{name} must be 1 or 0, got {value!r}")
        return cls(
            data_plane=data_plane,
            shm_direct_reads=_SWITCH[direct],
            shm_prefault=_SWITCH[prefault],
            shm_cuda_register=_register_limit(env.get(CUDA_REGISTER_ENV) or "all"),
            token=env.get(TOKEN_ENV, ""),
            tls_ca=env.get(TLS_CA_ENV, ""),
            ucx_lanes=_lanes(env.get(UCX_LANES_ENV) or "1"),
            ucx_control=_SWITCH[control],
        )


def _lanes(value: str) -> int:
    """``KVSTORE_UCX_LANES`` as a number of lanes."""
    if not value.isdigit() or not 1 <= int(value) <= _MAX_LANES:
        raise ConfigError(
            f"{UCX_LANES_ENV} must be a whole number from 1 to {_MAX_LANES}, got {value!r}"
        )
    return int(value)


def _register_limit(value: str) -> int | None:
    """``KVSTORE_SHM_CUDA_REGISTER`` as bytes (``None``: the whole arena)."""
    if value == "all":
        return None
    if value == "off":
        return 0
    try:
        return parse_size(value)
    except (ValueError, TypeError) as exc:
        raise ConfigError(
            f"{CUDA_REGISTER_ENV} must be all, off or a size such as 16GiB, got {value!r}"
        ) from exc
