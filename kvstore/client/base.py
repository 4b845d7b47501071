"""What :class:`~kvstore.client.sync.KVStoreClient` and
:class:`~kvstore.client.aio.AsyncKVStoreClient` have besides their calls: target, default
timeout, settings, data plane, the arena's registration for device DMA, and the
:class:`~kvstore.client.core.ClientCore` that plans every call."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping

import grpc

from kvstore.client.arena_registration import CudaRegistrar, Registrar
from kvstore.client.core import ClientCore
from kvstore.client.settings import ClientSettings
from kvstore.client.shm_link import ShmLink
from kvstore.client.ucx import UcxDataClient
from kvstore.errors import ConfigError
from kvstore.keys import Namespace

__all__ = ["ClientBase", "client_settings", "no_control_channel", "transport_settings"]


def client_settings(settings: ClientSettings | None, data_plane: str | None) -> ClientSettings:
    """A client's settings: ``settings`` (default: from the environment), with ``data_plane``
    (the constructor argument) taking precedence where given."""
    settings = ClientSettings.from_env() if settings is None else settings
    if data_plane is None or data_plane == settings.data_plane:
        return settings
    return dataclasses.replace(settings, data_plane=data_plane)


def transport_settings(
    settings: ClientSettings, data_plane: str | None, channel_arguments: Mapping[str, object]
) -> ClientSettings:
    """The settings of a client given a transport of its own: its data calls go over that
    transport (``data_plane`` ``"grpc"``), as shared memory and UCX need a server to talk to.

    Raises :class:`ConfigError` for a ``data_plane`` argument asking for another path, and for
    any of ``channel_arguments`` (``token``, ``tls_ca``, ...) given: they configure the gRPC
    channel, which such a client never opens.
    """
    if data_plane not in (None, "auto", "grpc"):
        raise ConfigError(
            f"data_plane={data_plane!r} needs a server's shared memory or UCX listener; a client "
            "given transport= sends everything over it: give data_plane None, 'auto' or 'grpc'"
        )
    given = [name for name, value in channel_arguments.items() if value is not None]
    if given:
        raise ConfigError(
            f"{', '.join(given)} configure the gRPC channel, which a client given transport= "
            "does not open: configure the transport instead"
        )
    return dataclasses.replace(settings, data_plane="grpc")


def no_control_channel() -> grpc.Channel:
    """The UCX control channel of a client given a transport: there is none (its data plane is
    ``"grpc"``, so the core never asks)."""
    raise RuntimeError("a client given transport= has no gRPC channel for the UCX path")


class ClientBase:
    """What both clients have besides their calls: target, default timeout, data plane, core."""

    def __init__(
        self,
        target: str,
        namespace: Namespace | bytes | None,
        timeout: float,
        settings: ClientSettings,
        control_channel: Callable[[], grpc.Channel],
    ) -> None:
        self.target = target
        self.timeout = timeout
        self._core = ClientCore(
            namespace=namespace,
            timeout=timeout,
            settings=settings,
            control_channel=control_channel,
        )

    @property
    def data_plane(self) -> str:
        """``"shm"``, ``"ucx"`` or ``"grpc"``: the path data calls take now."""
        return self._core.data_plane

    @property
    def settings(self) -> ClientSettings:
        """The settings this client was built with."""
        return self._core.settings

    def register_arena_with(self, registrar: Registrar | None = None) -> None:
        """Page-lock this client's mapping of the store's arena for a device's DMA.

        For engines whose KV caches are on a GPU: the mapping is registered piece by piece on a
        background thread (now, or once shared memory connects, and again after a reconnect),
        after which leased blocks (:meth:`lease`) can be copied straight to the device and
        reserved pages (:meth:`reserve`) straight from it, with no host copy; until then they
        report what is covered (``ShmLease.registration``). ``registrar`` defaults to the CUDA
        runtime torch loaded. ``KVSTORE_SHM_CUDA_REGISTER`` bounds the bytes (see
        :mod:`kvstore.client.arena_registration` for the cost, about 0.2-0.7 s per GiB in each
        process). Returns at once.

        Raises:
            CudaRuntimeUnavailable: ``registrar`` is None and this process has no CUDA runtime.
        """
        self._core.shm.register_with(registrar if registrar is not None else CudaRegistrar())

    # Tests and benchmarks look at the paths themselves.
    @property
    def _shm(self) -> ShmLink:
        return self._core.shm

    @property
    def _ucx(self) -> UcxDataClient | None:
        return self._core.ucx
