"""The shared-memory data plane, server side: a UNIX socket that lends the ``dram`` arena.

A co-located client connects, says which namespace it works in, and receives the arena's memfd
and the memfd of its published index (``SCM_RIGHTS``); it maps both once. A block it finds in the
index it copies without asking (a one-way ``TOUCH`` follows within 50 ms, so that the LRU
order and the hit counts see the read); for the others it asks *where* they are: reads lease pages
(:meth:`TieredStore.acquire`), the client copies out of them and releases; writes reserve pages,
the client copies in and commits. Payload bytes never cross the socket, except for a block that
cannot be brought into the arena, which comes back inline.

Everything a connection holds (leases, reservations) belongs to its arena session
(:mod:`kvstore.server.sessions`): when the client closes the socket or its process dies, the
kernel closes the socket and the server closes the session, giving everything back, so a crashed
engine cannot leak arena space or pins.

What one client may cost is bounded (:mod:`kvstore.server.shm_limits`): connections in all and
per peer uid, each frame's size by its op, the time a frame may take, and the arena bytes one
connection may hold (its session's quota). Running out of file descriptors pauses accepting, with
a log line, until some are free again; it never stops the data plane.

The server runs on the store's event loop, like the gRPC server, because the store is not
thread-safe; requests are metadata only, so this loop never copies a payload.
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import logging
import os
import socket
import stat
import struct
import time
from collections.abc import Callable
from typing import Any

from kvstore.errors import InvalidRequestError, KVStoreError, status_of
from kvstore.protocol.checks import check_namespace
from kvstore.protocol.shm_frames import (
    ABSENT_TIER,
    MAX_TOUCH_LOOKUPS,
    Cursor,
    Hello,
    Op,
    ProtocolError,
    Slot,
    frame,
    pack_ranges,
)
from kvstore.server.durations import DURATIONS
from kvstore.server.sessions import ArenaSession, ArenaSessions, Leased, Reserved
from kvstore.server.shm_limits import (
    ConnectionCounter,
    FrameRefused,
    RateLimitedLog,
    ShmLimits,
    peer_credentials,
    read_frame,
)
from kvstore.store import TieredStore

__all__ = ["ShmServer"]

logger = logging.getLogger(__name__)

_OK = 0
# Requests timed into ``kvstore_request_duration_seconds``, by the op label they get.
_TIMED_OPS = {Op.LOOKUP: "lookup", Op.ACQUIRE: "get", Op.RESERVE: "put", Op.COMMIT: "put"}
_INTERNAL = 13  # grpc.StatusCode.INTERNAL

# accept() failures that pass once something else gives resources back (descriptors, buffers).
_ACCEPT_BACKOFF_S = (0.05, 1.0)


class _Session(ArenaSession):
    """One client connection: what it holds, and the namespace its greeting named."""

    namespace: bytes | None = None


class ShmServer:
    """Serves the arena of ``store`` to co-located clients on the UNIX socket at ``path``.

    The socket file gets the permission bits ``mode`` whatever the process umask: connecting to a
    UNIX socket needs write permission on it, so ``mode`` decides which local users may map the
    arena (the default, ``0o660``, admits the server's user and group). ``limits`` bounds what
    clients may cost. ``allowed_uids`` and ``allowed_gids``, where given, admit only processes of
    those users or primary groups (``SO_PEERCRED``): a tenant's socket serves that tenant's users
    and nobody else.
    """

    def __init__(
        self,
        store: TieredStore,
        path: str,
        instance_id: bytes,
        mode: int = 0o660,
        limits: ShmLimits | None = None,
        allowed_uids: frozenset[int] | None = None,
        allowed_gids: frozenset[int] | None = None,
        tenant: str = "",
    ) -> None:
        arena = store.arena
        if arena is None:
            raise ValueError("the shared-memory data plane needs a dram tier")
        if not 0 <= mode <= 0o777:
            raise ValueError(f"socket mode must be permission bits (0o000 to 0o777), got {mode:#o}")
        self.store = store
        self.path = path
        self.mode = mode
        self.instance_id = instance_id
        self._arena = arena
        self.limits = limits if limits is not None else ShmLimits()
        #: The peer uids and gids admitted (both ``None``: whoever the socket's mode lets in).
        self.allowed_uids = allowed_uids
        self.allowed_gids = allowed_gids
        #: The tenant it serves (the ``tenant`` label of its request durations).
        self.tenant = tenant
        self._sessions = ArenaSessions(store, self.limits.session_bytes)
        self._connections = ConnectionCounter(self.limits)
        self._refusals = RateLimitedLog()
        self._accept_failures = RateLimitedLog()
        self._tasks: set[asyncio.Task[None]] = set()
        self._listener: socket.socket | None = None
        self._socket_file: tuple[int, int] | None = None
        self._accepting: asyncio.Task[None] | None = None
        self._handlers: dict[int, Callable[[_Session, Cursor], Any]] = {
            Op.HELLO: self._hello,
            Op.LOOKUP: self._lookup,
            Op.ACQUIRE: self._acquire,
            Op.RELEASE: self._release,
            Op.RESERVE: self._reserve,
            Op.COMMIT: self._commit,
            Op.CANCEL: self._cancel,
            Op.TOUCH: self._touch,
            Op.SYNC: self._sync,
        }

    async def start(self) -> None:
        """Create the socket with its mode (replacing a stale one left by a crashed server) and
        accept; raises :class:`OSError` when it cannot be created (no directory, no permission,
        another server listening on it), leaving nothing behind."""
        listener = _listen_unix(self.path, self.mode)
        listener.setblocking(False)
        self._listener = listener
        self._socket_file = _file_id(self.path)
        self._accepting = asyncio.get_running_loop().create_task(self._accept())
        logger.info("shared-memory data plane on %s", self.path)

    async def close(self) -> None:
        """Stop accepting, drop every connection (giving back what it held), remove the socket."""
        if self._accepting is not None:
            self._accepting.cancel()
            try:
                await self._accepting
            except asyncio.CancelledError:
                pass
            except Exception:  # it should never end on its own; closing goes on regardless
                logger.exception("the shared-memory accept loop had failed")
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._listener is not None:
            self._listener.close()
            # Only our own socket: another server may have replaced it since (ours went stale).
            if self._socket_file is not None and _file_id(self.path) == self._socket_file:
                os.unlink(self.path)

    def stats(self) -> dict[str, int]:
        """Open connections and what they hold."""
        return {"connections": len(self._sessions), **self._sessions.stats()}

    # -- connections -------------------------------------------------------------------------

    async def _accept(self) -> None:
        assert self._listener is not None
        loop = asyncio.get_running_loop()
        delay = 0.0
        while True:
            try:
                conn, _ = await loop.sock_accept(self._listener)
            except OSError as exc:
                # Out of descriptors (EMFILE, ENFILE) or buffers: the pending connection stays
                # in the backlog; wait for some to be given back and try again, never give up.
                delay = min(max(2 * delay, _ACCEPT_BACKOFF_S[0]), _ACCEPT_BACKOFF_S[1])
                self._accept_failures.warning(
                    "shared-memory socket cannot accept a connection (%s); retrying every "
                    "%.2fs at most",
                    exc,
                    delay,
                )
                await asyncio.sleep(delay)
                continue
            delay = 0.0
            credentials = peer_credentials(conn)
            uid = None if credentials is None else credentials[0]
            if not self._admits(credentials):
                # The kernel's SO_PEERCRED, not anything the client says: a process of another
                # tenant's user never gets this arena's descriptor.
                self._refusals.warning(
                    "shared-memory connection refused: uid/gid %s is not among this socket's",
                    credentials,
                )
                conn.close()
                continue
            refusal = self._connections.admit(uid)
            if refusal is not None:
                self._refusals.warning("shared-memory connection refused: %s", refusal)
                conn.close()
                continue
            conn.setblocking(False)
            task = loop.create_task(self._serve(conn, uid))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _admits(self, credentials: tuple[int, int] | None) -> bool:
        """Whether a peer with ``(uid, gid)`` may connect (any, where no uid or gid is listed)."""
        if self.allowed_uids is None and self.allowed_gids is None:
            return True
        if credentials is None:
            return False
        uid, gid = credentials
        return uid in (self.allowed_uids or ()) or gid in (self.allowed_gids or ())

    async def _serve(self, conn: socket.socket, uid: int | None) -> None:
        loop = asyncio.get_running_loop()
        session = self._sessions.open(_Session)
        try:
            while True:
                request = await read_frame(
                    loop, conn, self.store.max_keys_per_request, self.limits.frame_timeout_s
                )
                if request is None:
                    return
                op, body = request
                reply = await self._dispatch(session, op, memoryview(body))
                if reply is None:
                    continue
                if op == Op.HELLO and reply[4] == _OK:
                    # The memfds ride along with the greeting; the kernel dups them.
                    await _send_with_fds(loop, conn, reply, self._greeting_fds())
                else:
                    await loop.sock_sendall(conn, reply)
        except FrameRefused as exc:
            self._refusals.warning("shm client (uid %s) sent %s; closing it", uid, exc)
        except TimeoutError:
            self._refusals.warning(
                "shm client (uid %s) began a frame and did not finish it within %.1fs; closing it",
                uid,
                self.limits.frame_timeout_s,
            )
        except (ConnectionError, OSError) as exc:
            logger.debug("shm connection ended: %s", exc)
        finally:
            self._sessions.close(session)
            self._connections.leave(uid)
            conn.close()

    def _greeting_fds(self) -> list[int]:
        index = self._arena.index
        return [self._arena.fd] if index is None else [self._arena.fd, index.fd]

    async def _dispatch(self, session: _Session, op: int, body: memoryview) -> bytes | None:
        """Run one request, timing lookups, acquires and commits; see :meth:`_run`."""
        name = _TIMED_OPS.get(op)
        if name is None:
            return await self._run(session, op, body)
        start = time.perf_counter()
        try:
            return await self._run(session, op, body)
        finally:
            DURATIONS.observe(name, "shm", self.tenant, time.perf_counter() - start)

    async def _run(self, session: _Session, op: int, body: memoryview) -> bytes | None:
        """Run one request; its reply frame (``None`` for one-way requests)."""
        handler = self._handlers.get(op)
        try:
            if handler is None:
                raise ProtocolError(f"unknown shared-memory request code {op}")
            if op != Op.HELLO and session.namespace is None:
                raise InvalidRequestError("HELLO must come first")
            cursor = Cursor(body)
            result = handler(session, cursor)
            if asyncio.iscoroutine(result):
                result = await result
            cursor.done()
        except KVStoreError as exc:
            code = status_of(exc).value[0]
            return None if op in Op.ONE_WAY else frame(code, str(exc).encode())
        except Exception as exc:
            logger.exception("unexpected failure serving a shared-memory request")
            message = f"internal error: {type(exc).__name__}".encode()
            return None if op in Op.ONE_WAY else frame(_INTERNAL, message)
        return None if op in Op.ONE_WAY else frame(_OK, result)

    # -- requests ----------------------------------------------------------------------------

    def _namespace(self, session: _Session) -> bytes:
        assert session.namespace is not None
        return session.namespace

    def _hello(self, session: _Session, cursor: Cursor) -> bytes:
        namespace = bytes(cursor.take(len(cursor.rest())))
        check_namespace(namespace)
        session.namespace = namespace
        tiers = [tier.name for tier in self.store.tiers]
        index = self._arena.index
        return Hello(
            self._arena.capacity,
            0 if index is None else index.size,
            self.store.max_keys_per_request,
            self.instance_id,
            tiers,
        ).pack()

    async def _lookup(self, session: _Session, cursor: Cursor) -> bytes:
        keys = cursor.keys(self.store.max_keys_per_request)
        cursor.done()
        result = await self.store.lookup_shared(keys, self._namespace(session))
        codes = {tier.name: level for level, tier in enumerate(self.store.tiers)}
        codes[""] = ABSENT_TIER
        return struct.pack("<I", result.hits) + bytes(map(codes.__getitem__, result.tiers))

    async def _acquire(self, session: _Session, cursor: Cursor) -> bytes:
        keys = cursor.keys(self.store.max_keys_per_request)
        cursor.done()  # the whole request parses before anything is taken
        acquired = await session.acquire(keys, self._namespace(session))
        parts: list[bytes] = []
        for item in acquired:
            if item is None:
                parts.append(bytes([Slot.MISS]))
            elif isinstance(item, Leased):
                parts.append(
                    struct.pack("<BQ", Slot.LEASE, item.id) + pack_ranges(item.lease.ranges)
                )
            else:
                parts.append(struct.pack("<BQ", Slot.BYTES, len(item)) + bytes(item))
        return b"".join(parts)

    def _release(self, session: _Session, cursor: Cursor) -> bytes:
        ids = cursor.ids()
        cursor.done()
        session.release(ids)
        return b""

    async def _reserve(self, session: _Session, cursor: Cursor) -> bytes:
        keys = cursor.keys(self.store.max_keys_per_request)
        lengths = cursor.u64s(len(keys))
        retention = cursor.retention()
        cursor.done()
        reserved = await session.reserve(keys, lengths, self._namespace(session), retention)
        parts: list[bytes] = []
        for item in reserved:
            if item is None:
                parts.append(bytes([Slot.NO_ROOM]))
            elif isinstance(item, Reserved):
                ranges = pack_ranges(item.reservation.ranges)
                parts.append(struct.pack("<BQ", Slot.RESERVED, item.id) + ranges)
            else:  # "present"
                parts.append(bytes([Slot.PRESENT]))
        return b"".join(parts)

    async def _commit(self, session: _Session, cursor: Cursor) -> bytes:
        ids = cursor.ids()
        retention = cursor.retention()
        cursor.done()
        result = await session.commit(ids, self._namespace(session), retention)
        return struct.pack("<III", result.stored, result.already_present, result.dropped)

    def _touch(self, session: _Session, cursor: Cursor) -> bytes:
        calls, lookups = cursor.unpack("II")
        keys = cursor.keys(self.store.max_keys_per_request)
        cursor.done()
        # Every call read at least one of the keys; lookups are capped by the client.
        if calls > len(keys) or lookups > MAX_TOUCH_LOOKUPS:
            raise ProtocolError(
                f"TOUCH of {len(keys)} keys claims {calls} calls, {lookups} lookups"
            )
        self.store.record_direct_reads(keys, self._namespace(session), calls, lookups)
        return b""

    def _sync(self, session: _Session, cursor: Cursor) -> bytes:
        cursor.done()  # requests are handled in order: answering is the whole point
        return b""

    def _cancel(self, session: _Session, cursor: Cursor) -> bytes:
        ids = cursor.ids()
        cursor.done()
        session.cancel(ids)
        return b""


def _listen_unix(path: str, mode: int) -> socket.socket:
    """A listening UNIX socket at ``path`` whose file has exactly the permission bits ``mode``.

    ``bind`` creates the file with the umask applied, and changing the umask is process-wide (so
    racy with other threads). Instead the file's bits are set between ``bind`` and ``listen``:
    until ``listen`` every connect is refused, so no one gets in under the umask's bits. A stale
    socket (a crashed server's: nobody accepts on it) is replaced; a live one, or anything that
    is not a socket, is left alone and the call fails.
    """
    _remove_stale_socket(path)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    bound = False
    try:
        listener.bind(path)
        bound = True
        _chmod_socket(path, mode)
        listener.listen(64)
    except BaseException:
        listener.close()
        if bound:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        raise
    return listener


def _remove_stale_socket(path: str) -> None:
    """Unlink the socket at ``path`` if no server accepts on it; refuse anything else there."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(info.st_mode):
        raise FileExistsError(errno.EEXIST, "exists and is not a socket", path)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as probe:
        probe.settimeout(1.0)  # a live server with a full backlog would block a plain connect
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            os.unlink(path)  # stale: left by a server that died without removing it
            return
        except PermissionError:
            raise PermissionError(
                errno.EACCES, "a socket this user may not connect to, live or not", path
            ) from None
        except TimeoutError:
            pass  # a server too busy to accept is still a live one
    raise OSError(errno.EADDRINUSE, "another server is listening on it", path)


def _chmod_socket(path: str, mode: int) -> None:
    """``chmod`` the socket just bound at ``path`` without following a symlink put there since
    (in a directory others may write to), where the platform can say so."""
    try:
        os.chmod(path, mode, follow_symlinks=False)
    except NotImplementedError:  # no lchmod here, or ``path`` became a symlink
        if not stat.S_ISSOCK(os.lstat(path).st_mode):
            raise OSError(errno.ELOOP, "no longer the socket just bound", path) from None
        os.chmod(path, mode)


def _file_id(path: str) -> tuple[int, int] | None:
    """``(device, inode)`` of the file at ``path``, or ``None`` if there is none."""
    try:
        info = os.lstat(path)
    except FileNotFoundError:
        return None
    return info.st_dev, info.st_ino


async def _send_with_fds(
    loop: asyncio.AbstractEventLoop, conn: socket.socket, data: bytes, fds: list[int]
) -> None:
    """Send ``data`` with ``fds`` attached to its first byte, then the rest as usual."""
    while True:
        try:
            sent = socket.send_fds(conn, [data], fds)
            break
        except BlockingIOError:  # the client has not drained its socket yet; rare and short
            await asyncio.sleep(0.001)
    if sent < len(data):
        await loop.sock_sendall(conn, data[sent:])
