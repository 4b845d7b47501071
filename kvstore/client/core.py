"""What :class:`KVStoreClient` and :class:`AsyncKVStoreClient` share: every call, without the I/O.

Each call is a *plan*: a generator that builds the requests, decides the data plane (shared
memory, then UCX, then gRPC, in that order), maps errors and decodes the results, and that yields
a :data:`Step` wherever something must wait: a gRPC call (:class:`Rpc`), blocking work such as a
copy through shared memory or a UCX transfer (:class:`Blocking`), or a pause (:class:`Sleep`).
The blocking client runs the steps in the caller's thread, the asyncio client awaits them (calls
through its transport, by default a ``grpc.aio`` channel; blocking work in a worker thread), so
neither blocks an event loop and both behave alike by construction. A failed step is thrown back
into its plan, which either handles it (a fallback) or lets it propagate.

Every plan computes its :class:`Deadline` once, at its start, and gives each step what is left of
it: a fast path that stalls leaves the fallback less time instead of a fresh timeout.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any, TypeVar

import grpc

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore.client.arena_registration import CudaRegistrar
from kvstore.client.cuda_runtime import CudaRuntimeUnavailable
from kvstore.client.device_fill import (
    DeviceFill,
    checked_staging,
    copy_from_lease,
    copy_to_devices,
    device_byte_views,
    is_device_tensor,
    queued_streams,
    settle_queued_writes,
    staging_for,
)
from kvstore.client.settings import ClientSettings
from kvstore.client.shm import ShmDataPlane, ShmLease, ShmReservation, ShmUnavailableError
from kvstore.client.shm_link import ShmLink
from kvstore.client.steps import Blocking, Deadline, Plan, Rpc, Sleep, Step, poll_delays
from kvstore.client.ucx import CONNECT_SHARE, UcxDataClient
from kvstore.errors import DeadlineExceededError, KVStoreError
from kvstore.key_scheme import KeyScheme
from kvstore.keys import Namespace
from kvstore.protocol import messages as _wire
from kvstore.protocol.checks import check_keys, check_pairs
from kvstore.protocol.ucx import ucx_unavailable_reason
from kvstore.retention import KEEP, Retention
from kvstore.types import LookupResult, PrefetchProgress, PutResult

__all__ = [
    "PUT_STREAM_BYTES",
    "UCX_RECHECK_S",
    "Blocking",
    "ClientCore",
    "Deadline",
    "Plan",
    "Rpc",
    "Sleep",
    "Step",
    "poll_delays",
]

logger = logging.getLogger(__name__)

T = TypeVar("T")

#: Most payload bytes one gRPC Put stream carries; a larger put goes as several streams (the
#: server refuses one request past ``server.inflight_bytes``, which is at least 64 MiB).
PUT_STREAM_BYTES = 32 * 1024**2
#: Seconds after which a client whose UCX path is unusable asks the server for it again.
UCX_RECHECK_S = 30.0


class _Fallback:
    """What a fast path returns when the call must go the next way instead."""


_FALLBACK = _Fallback()


class ClientCore:
    """The state and the plans of one client (see the module docstring).

    ``control_channel`` returns a blocking gRPC channel to the server, for the UCX path's control
    calls (made from a worker thread by the asyncio client); it is asked for only when the server
    advertises a UCX listener.
    """

    def __init__(
        self,
        *,
        namespace: Namespace | bytes | None,
        timeout: float,
        settings: ClientSettings,
        control_channel: Callable[[], grpc.Channel],
    ) -> None:
        self.timeout = timeout
        self.settings = settings
        # Fingerprinting hashes JSON; do it once, not on every call.
        self.namespace = None if namespace is None else _wire.namespace_bytes(namespace)
        self.shm = ShmLink(settings, self.namespace, timeout)
        self.ucx: UcxDataClient | None = None
        self._ucx_checked_at: float | None = None
        self._ucx_lock = threading.Lock()
        self._control_channel = control_channel

    def deadline(self, timeout: float | None) -> Deadline:
        """The deadline of a call that starts now (``timeout`` None: the client's default)."""
        return Deadline(self.timeout if timeout is None else timeout)

    @property
    def data_plane(self) -> str:
        """``"shm"``, ``"ucx"`` or ``"grpc"``: the path data calls take now."""
        if self.shm.plane is not None:
            return "shm"
        return "ucx" if self.ucx is not None and self.ucx.usable else "grpc"

    # -- building blocks ---------------------------------------------------------------------

    def _rpc(
        self,
        method: str,
        request: Any,
        deadline: Deadline,
        each: Callable[[Any], None] | None = None,
    ) -> Plan[Any]:
        """A gRPC call in the time left; its failure as a :class:`KVStoreError` (the one place
        where gRPC errors are mapped)."""
        try:
            return (yield Rpc(method, request, deadline.remaining(), each))
        except grpc.RpcError as exc:
            raise _wire.map_rpc_error(exc) from exc

    def _endpoints(self, deadline: Deadline) -> Plan[Any]:
        """The server's ``DataPlaneResponse``; a failure is raised as the ``grpc.RpcError``."""
        return (yield Rpc("DataPlane", pb.DataPlaneRequest(), deadline.remaining()))

    def _shm_plane(self, deadline: Deadline) -> Plan[ShmDataPlane | None]:
        """The shared-memory path, connected first if need be; ``None``: not now."""
        link = self.shm
        if not link.wanted():
            return None
        if link.plane is not None:
            return link.plane
        try:
            endpoints = yield from self._endpoints(deadline)
        except grpc.RpcError as exc:  # an older server, or none: gRPC calls will say which
            link.failed(exc)
            return None
        # A socket that never greets must leave the call's gRPC fallback time to run.
        plane: ShmDataPlane | None = yield Blocking(
            lambda: link.connect(endpoints, deadline.remaining() * CONNECT_SHARE)
        )
        return plane

    def _over_shm(
        self,
        keys: Sequence[bytes],
        deadline: Deadline,
        call: Callable[[ShmDataPlane, float], T],
    ) -> Plan[T | _Fallback]:
        """``call(plane, seconds left)`` on the shared-memory path, or ``_FALLBACK``."""
        plane = yield from self._shm_plane(deadline)
        if plane is None or not plane.usable_for(keys):
            return _FALLBACK
        try:
            result: T = yield Blocking(lambda: call(plane, deadline.remaining()))
        except ShmUnavailableError as exc:
            failure = exc  # ``exc`` is unbound once the except clause ends
            # Closing the plane may wait briefly for its last TOUCH: not on an event loop.
            yield Blocking(lambda: self.shm.failed(failure))
            return _FALLBACK
        return result

    def _ucx_client(self, deadline: Deadline) -> Plan[UcxDataClient | None]:
        """The UCX path, when shared memory is out and the server advertises a UCX listener."""
        if self.shm.mode not in ("auto", "ucx") or self.namespace is None:
            return None
        with self._ucx_lock:
            now = time.monotonic()
            # Ask again after a while: a restarted server may listen on another port.
            due = self._ucx_checked_at is None or (
                now - self._ucx_checked_at > UCX_RECHECK_S
                and (self.ucx is None or not self.ucx.usable)
            )
            if due:
                self._ucx_checked_at = now
        if due:
            try:
                endpoints = yield from self._endpoints(deadline)
            except grpc.RpcError:
                return None  # an older server, or none: the gRPC call will say which
            stale = self._adopt_ucx(endpoints.ucx_address)
            if stale is not None:
                yield Blocking(stale.close)  # aborting its endpoint may wait
        ucx = self.ucx
        return ucx if ucx is not None and ucx.usable else None

    def _adopt_ucx(self, address: str) -> UcxDataClient | None:
        """Follow the UCX listener the server advertises now; the replaced client, to close."""
        with self._ucx_lock:
            stale = None
            if self.ucx is not None and self.ucx.address != address:
                stale, self.ucx = self.ucx, None
            if self.ucx is None and address and ucx_unavailable_reason() is None:
                self.ucx = UcxDataClient(
                    self._control_channel(),
                    address,
                    self.namespace,
                    timeout=self.timeout,
                    lanes=self.settings.ucx_lanes,
                    ucx_control=self.settings.ucx_control,
                )
        return stale

    def _over_ucx(
        self, deadline: Deadline, call: Callable[[UcxDataClient, float], T | None]
    ) -> Plan[T | None]:
        """``call(ucx, seconds left)`` on the UCX path; ``None``: use gRPC."""
        ucx = yield from self._ucx_client(deadline)
        if ucx is None:
            return None
        result: T | None = yield Blocking(lambda: call(ucx, deadline.remaining()))
        return result

    # -- calls -------------------------------------------------------------------------------

    def lookup_tiers(self, keys: Sequence[bytes], timeout: float | None) -> Plan[LookupResult]:
        """The leading hit count and the tier of every key."""
        deadline = self.deadline(timeout)
        fast = yield from self._over_shm(keys, deadline, lambda plane, t: plane.lookup(keys, t))
        if not isinstance(fast, _Fallback):
            return fast
        request = _wire.lookup_request(_wire.namespace_bytes(self.namespace), keys)
        return _wire.lookup_result((yield from self._rpc("Lookup", request, deadline)))

    def put(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        timeout: float | None,
        retention: Retention = KEEP,
    ) -> Plan[PutResult]:
        """Store ``values`` under ``keys`` with ``retention``; what the arena has no room for
        goes over gRPC. Nothing is sent for ``tiers="none"``; UCX carries no retention, so a
        put asking for one goes over shared memory or gRPC."""
        if not retention.stores:
            check_pairs(keys, values, "values")
            return PutResult()
        deadline = self.deadline(timeout)
        fast = yield from self._over_shm(
            keys, deadline, lambda plane, t: plane.put(keys, values, t, retention)
        )
        if isinstance(fast, _Fallback):
            if retention.is_default:
                remote = yield from self._over_ucx(
                    deadline, lambda ucx, t: ucx.put(keys, values, timeout=t)
                )
                if remote is not None:
                    return remote
            return (yield from self._put_grpc(keys, values, deadline, retention))
        result, no_room = fast
        if not no_room:
            return result
        rest = yield from self._put_grpc(
            [keys[i] for i in no_room], [values[i] for i in no_room], deadline, retention
        )
        return _wire.combine_put_results(result, rest)

    def _put_grpc(
        self,
        keys: Sequence[bytes],
        values: Sequence[Any],
        deadline: Deadline,
        retention: Retention = KEEP,
    ) -> Plan[PutResult]:
        namespace = _wire.namespace_bytes(self.namespace)
        check_pairs(keys, values, "values")
        batches = _wire.put_batches(values, PUT_STREAM_BYTES)
        if len(batches) > 1:
            # Checked whole before the first stream, as one request would be on the server.
            check_keys(keys, namespace, len(keys))
        result = PutResult()
        for batch in batches:
            requests = list(_wire.put_requests(namespace, keys[batch], values[batch], retention))
            response = yield from self._rpc("Put", iter(requests), deadline)
            result = _wire.combine_put_results(result, _wire.put_result(response))
        return result

    def get(self, keys: Sequence[bytes], timeout: float | None) -> Plan[list[bytes | None]]:
        """The payload of each key, ``None`` where missing."""
        deadline = self.deadline(timeout)
        fast = yield from self._over_shm(keys, deadline, lambda plane, t: plane.get(keys, t))
        if not isinstance(fast, _Fallback):
            return fast
        remote = yield from self._over_ucx(deadline, lambda ucx, t: ucx.get(keys, timeout=t))
        if remote is not None:
            return remote
        return (yield from self._get_grpc(keys, deadline))

    def _get_grpc(self, keys: Sequence[bytes], deadline: Deadline) -> Plan[list[bytes | None]]:
        values: list[bytes | None] = [None] * len(keys)
        request = _wire.get_request(_wire.namespace_bytes(self.namespace), keys)
        yield from self._rpc("Get", request, deadline, lambda r: _wire.add_get_response(values, r))
        return values

    def get_into(
        self, keys: Sequence[bytes], buffers: Sequence[Any], timeout: float | None
    ) -> Plan[list[bool]]:
        """Fill caller-provided buffers; False where the key is missing or its size differs."""
        deadline = self.deadline(timeout)
        fast = yield from self._over_shm(
            keys, deadline, lambda plane, t: plane.get_into(keys, buffers, t)
        )
        if not isinstance(fast, _Fallback):
            return fast
        filled = yield from self._over_ucx(
            deadline, lambda ucx, t: ucx.get_into(keys, buffers, timeout=t)
        )
        if filled is not None:
            return filled
        return _wire.fill_buffers((yield from self._get_grpc(keys, deadline)), buffers)

    def get_into_device(
        self,
        keys: Sequence[bytes],
        tensors: Sequence[Any],
        staging: Sequence[Any] | None,
        timeout: float | None,
    ) -> Plan[DeviceFill]:
        """Fill torch tensors on any device; see :mod:`kvstore.client.device_fill` for paths."""
        check_pairs(keys, tensors, "tensors")
        if not any(is_device_tensor(t) for t in tensors):
            return DeviceFill((yield from self.get_into(keys, tensors, timeout)), "host")
        deadline = self.deadline(timeout)
        views = device_byte_views(tensors)
        queued = queued_streams(tensors)  # the caller's streams, read on the caller's thread
        if all(t.device.type == "cuda" for t in tensors):
            direct = yield from self._over_shm(
                keys,
                deadline,
                lambda plane, t: self._copy_from_arena(plane, keys, views, queued, t),
            )
            if isinstance(direct, list):
                return DeviceFill(direct, "shm-dma")
        plane = yield from self._shm_plane(deadline)
        if (plane is None or not plane.usable_for(keys)) and all(map(is_device_tensor, tensors)):
            ucx = yield from self._ucx_client(deadline)
            if ucx is not None and (yield Blocking(ucx.device_transports)):
                yield Blocking(lambda: settle_queued_writes(queued))
                filled = yield Blocking(
                    lambda: ucx.get_into(keys, views, timeout=deadline.remaining())
                )
                if filled is not None:
                    return DeviceFill(filled, "ucx-device")
        if staging is None:  # page-locking allocates slowly: off an event loop
            hosts: list[Any] = yield Blocking(lambda: staging_for(tensors))
        else:
            hosts = checked_staging(staging, tensors)
        found = yield from self.get_into(keys, hosts, deadline.remaining())
        path = f"{self.data_plane}-pinned"
        yield Blocking(lambda: copy_to_devices(hosts, views, found, queued))
        return DeviceFill(found, path)

    def _copy_from_arena(
        self,
        plane: ShmDataPlane,
        keys: Sequence[bytes],
        views: Sequence[Any],
        queued: dict[Any, Any],
        timeout: float,
    ) -> list[bool] | None:
        """CUDA tensors over shared memory: DMA from the leased blocks where the arena is
        page-locked here (registering it from the first such call on); ``None`` otherwise."""
        if not self.shm.register_asked:
            try:
                self.shm.register_with(CudaRegistrar())
            except CudaRuntimeUnavailable as exc:
                logger.info("no direct arena -> device copies: %s", exc)
                self.shm.register_with(None)
        if plane.registration is None:
            return None
        with plane.acquire(keys, timeout) as lease:
            return copy_from_lease(lease, views, queued)

    def lease(self, keys: Sequence[bytes], timeout: float | None) -> Plan[ShmLease | None]:
        """The blocks of ``keys`` held in the arena for reading in place; ``None`` where the
        shared-memory path is not in use (see :meth:`ShmDataPlane.acquire`)."""
        deadline = self.deadline(timeout)
        held = yield from self._over_shm(keys, deadline, lambda plane, t: plane.acquire(keys, t))
        return None if isinstance(held, _Fallback) else held

    def reserve(
        self,
        keys: Sequence[bytes],
        sizes: Sequence[int],
        timeout: float | None,
        retention: Retention = KEEP,
    ) -> Plan[ShmReservation | None]:
        """Arena pages for blocks the caller writes in place and commits with ``retention``;
        ``None`` where the shared-memory path is not in use or nothing is to be stored (see
        :meth:`ShmDataPlane.reserve`)."""
        if not retention.stores:
            return None
        deadline = self.deadline(timeout)
        held = yield from self._over_shm(
            keys, deadline, lambda plane, t: plane.reserve(keys, sizes, t, retention)
        )
        return None if isinstance(held, _Fallback) else held

    def delete(self, keys: Sequence[bytes], timeout: float | None) -> Plan[int]:
        """Remove ``keys`` from every tier; how many were present."""
        request = pb.DeleteRequest(keys=list(keys), namespace=_wire.namespace_bytes(self.namespace))
        response = yield from self._rpc("Delete", request, self.deadline(timeout))
        return int(response.deleted)

    def prefetch(self, keys: Sequence[bytes], timeout: float | None) -> Plan[int]:
        """Start a background prefetch of ``keys`` into dram; its id."""
        request = pb.PrefetchRequest(
            namespace=_wire.namespace_bytes(self.namespace), keys=list(keys)
        )
        response = yield from self._rpc("Prefetch", request, self.deadline(timeout))
        return int(response.prefetch_id)

    def prefetch_status(self, prefetch_id: int, timeout: float | None) -> Plan[PrefetchProgress]:
        """State and key counts of a prefetch."""
        request = pb.PrefetchStatusRequest(prefetch_id=prefetch_id)
        response = yield from self._rpc("PrefetchStatus", request, self.deadline(timeout))
        return _wire.prefetch_progress(response)

    def cancel_prefetch(self, prefetch_id: int, timeout: float | None) -> Plan[bool]:
        """Stop a prefetch; False if it had already finished."""
        request = pb.CancelPrefetchRequest(prefetch_id=prefetch_id)
        response = yield from self._rpc("CancelPrefetch", request, self.deadline(timeout))
        return bool(response.cancelled)

    def wait_prefetch(self, prefetch_id: int, timeout: float) -> Plan[PrefetchProgress]:
        """Poll until the prefetch is DONE or CANCELLED; DeadlineExceededError after ``timeout``
        seconds (each poll waits at most the client's timeout)."""
        progress = None
        for remaining, delay in poll_delays(timeout):
            progress = yield from self.prefetch_status(prefetch_id, min(self.timeout, remaining))
            if progress.finished:
                return progress
            yield Sleep(delay)
        raise DeadlineExceededError(f"prefetch not finished within {timeout} s: {progress}")

    def stats(self, timeout: float | None) -> Plan[dict[str, Any]]:
        """Tier usage and counters, including every read this client made before the call."""
        deadline = self.deadline(timeout)
        plane = self.shm.plane
        if plane is not None:
            yield Blocking(lambda: _flush_reads(plane, deadline))
        response = yield from self._rpc("Stats", pb.StatsRequest(), deadline)
        return _wire.stats_dict(response)

    def key_scheme(
        self, namespace: Namespace, secret_check: str, timeout: float | None
    ) -> Plan[KeyScheme]:
        """Declare ``namespace`` (an engine's base) and the fingerprint of its key secret; the
        scheme the server says to name its chunks with."""
        request = _wire.key_scheme_request(namespace, secret_check)
        response = yield from self._rpc("KeyScheme", request, self.deadline(timeout))
        return _wire.key_scheme_result(response, namespace)

    def open_data_plane(self, timeout: float | None) -> Plan[str]:
        """Decide the data path now (shared memory, connected; else UCX, found) rather than on
        the first data call; the one data calls will take: ``"shm"``, ``"ucx"`` or ``"grpc"``."""
        deadline = self.deadline(timeout)
        if (yield from self._shm_plane(deadline)) is None:
            yield from self._ucx_client(deadline)
        return self.data_plane

    def close(self) -> None:
        """Close the shared-memory and UCX paths (blocking: briefly, for the last TOUCH and the
        endpoint's abort)."""
        self.shm.close()
        if self.ucx is not None:
            self.ucx.close()


def _flush_reads(plane: ShmDataPlane, deadline: Deadline) -> None:
    """Let the server count the reads ``plane`` served itself, before its counters are read.

    Best effort: a server that cannot be reached now is what the Stats call will report.
    """
    with contextlib.suppress(ShmUnavailableError, KVStoreError):
        plane.flush_reads(deadline.remaining())
