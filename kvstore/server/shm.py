"""The shared-memory data plane, server side: a UNIX socket that lends the ``dram`` arena.

A co-located client connects, says which namespace it works in, and receives the arena's memfd
and the memfd of its published index (``SCM_RIGHTS``); it maps both once. A block it finds in the
index it copies without asking (a one-way ``TOUCH`` follows within 50 ms, so that the LRU
order and the hit counts see the read); for the others it asks *where* they are: reads lease pages
(:meth:`TieredStore.acquire`), the client copies out of them and releases; writes reserve pages,
the client copies each block into its own write window and commits, and the server copies the
block from the window into the pages (the arena is sealed: clients map it read-only, so no
client can change a block; :mod:`kvstore.server.shm_window`). Payload bytes never cross the
socket, except for a block that cannot be brought into the arena, which comes back inline.

Everything a connection holds (leases, reservations) belongs to its arena session
(:mod:`kvstore.server.sessions`): when the client closes the socket or its process dies, the
kernel closes the socket and the server closes the session, giving everything back, so a crashed
engine cannot leak arena space or pins.

What one client may cost is bounded (:mod:`kvstore.server.shm_limits`): connections in all and
per peer uid, each frame's size by its op, the time a frame may take, and the arena bytes one
connection may hold (its session's quota). Running out of file descriptors pauses accepting, with
a log line, until some are free again; it never stops the data plane.

The server runs on the store's event loop, like the gRPC server, because the store is not
thread-safe; requests are metadata only, so this loop copies a payload only once, at a
commit, from the client's window into the pages it reserved.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
from collections.abc import Callable
from typing import Any

from kvstore.errors import InvalidRequestError, KVStoreError
from kvstore.protocol.checks import check_namespace
from kvstore.protocol.shm_frames import ABSENT_TIER, Cursor, Hello, Op, ProtocolError, frame
from kvstore.protocol.shm_messages import (
    INTERNAL,
    OK,
    AcquiredItem,
    Lent,
    ReservedItem,
    ReserveSlot,
    error_reply,
    pack_acquire_reply,
    pack_commit_reply,
    pack_lookup_reply,
    pack_reserve_reply,
    read_commit,
    read_commit_from,
    read_reserve,
    read_touch,
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
from kvstore.server.shm_listen import file_id as _file_id
from kvstore.server.shm_listen import listen_unix as _listen_unix
from kvstore.server.shm_listen import send_with_fds as _send_with_fds
from kvstore.server.shm_window import WriteWindow, window_limit
from kvstore.store import TieredStore

__all__ = ["ShmServer"]

logger = logging.getLogger(__name__)

# Requests timed into ``kvstore_request_duration_seconds``, by the op label they get.
_TIMED_OPS = {
    Op.LOOKUP: "lookup",
    Op.ACQUIRE: "get",
    Op.RESERVE: "put",
    Op.COMMIT: "put",
    Op.COMMIT_FROM: "put",
}
# accept() failures that pass once something else gives resources back (descriptors, buffers).
_ACCEPT_BACKOFF_S = (0.05, 1.0)


class _Session(ArenaSession):
    """One client connection: what it holds, the namespace its greeting named, its write window
    (:mod:`kvstore.server.shm_window`) and the descriptors the frame being served brought."""

    namespace: bytes | None = None
    window: WriteWindow | None = None
    fds: list[int]


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
            Op.WINDOW: self._window,
            Op.COMMIT_FROM: self._commit_from,
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
        session.fds = []
        try:
            while True:
                request = await read_frame(
                    loop,
                    conn,
                    self.store.max_keys_per_request,
                    self.limits.frame_timeout_s,
                    session.fds,
                )
                if request is None:
                    return
                op, body = request
                try:
                    reply = await self._dispatch(session, op, memoryview(body))
                finally:
                    _close_all(session.fds)  # what the request did not keep
                if reply is None:
                    continue
                if op == Op.HELLO and reply[4] == OK:
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
            _close_all(session.fds)
            self._sessions.close(session)
            if session.window is not None:
                session.window.close()
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
            return None if op in Op.ONE_WAY else error_reply(exc)
        except Exception as exc:
            logger.exception("unexpected failure serving a shared-memory request")
            message = f"internal error: {type(exc).__name__}".encode()
            return None if op in Op.ONE_WAY else frame(INTERNAL, message)
        return None if op in Op.ONE_WAY else frame(OK, result)

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
        return pack_lookup_reply(result.hits, list(map(codes.__getitem__, result.tiers)))

    async def _acquire(self, session: _Session, cursor: Cursor) -> bytes:
        keys = cursor.keys(self.store.max_keys_per_request)
        cursor.done()  # the whole request parses before anything is taken
        acquired = await session.acquire(keys, self._namespace(session))
        items: list[AcquiredItem] = [
            Lent(item.id, item.lease.ranges) if isinstance(item, Leased) else item
            for item in acquired
        ]
        return pack_acquire_reply(items)

    def _release(self, session: _Session, cursor: Cursor) -> bytes:
        ids = cursor.ids()
        cursor.done()
        session.release(ids)
        return b""

    async def _reserve(self, session: _Session, cursor: Cursor) -> bytes:
        keys, lengths, retention = read_reserve(cursor, self.store.max_keys_per_request)
        reserved = await session.reserve(keys, lengths, self._namespace(session), retention)
        items: list[ReservedItem] = []
        for item in reserved:
            if item is None:
                items.append(ReserveSlot.NO_ROOM)
            elif isinstance(item, Reserved):
                items.append(Lent(item.id, item.reservation.ranges))
            else:  # "present"
                items.append(ReserveSlot.PRESENT)
        return pack_reserve_reply(items)

    async def _commit(self, session: _Session, cursor: Cursor) -> bytes:
        ids, retention = read_commit(cursor)
        if self._arena.sealed:
            # Nobody but this server can have written the reserved pages: what they hold is
            # whatever was there before, and must not become a block.
            raise InvalidRequestError(
                "this store's arena is read-only to clients: send the blocks' bytes from a write "
                "window (WINDOW, then COMMIT_FROM), or put them over gRPC"
            )
        result = await session.commit(ids, self._namespace(session), retention)
        return pack_commit_reply(result.stored, result.already_present, result.dropped)

    def _window(self, session: _Session, cursor: Cursor) -> bytes:
        cursor.done()
        if len(session.fds) != 1:
            raise InvalidRequestError(f"WINDOW needs one memfd sent along, got {len(session.fds)}")
        window = WriteWindow(session.fds.pop(), window_limit(self._arena))
        if session.window is not None:
            session.window.close()
        session.window = window
        return b""

    async def _commit_from(self, session: _Session, cursor: Cursor) -> bytes:
        ids, offsets, retention = read_commit_from(cursor)
        held = [session.reservations.get(i) for i in ids]
        if session.window is None or any(item is None for item in held):
            # Reservations it names stay open: the client cancels them, or closing does.
            raise InvalidRequestError(
                "COMMIT_FROM needs a WINDOW first"
                if session.window is None
                else "no open reservation named so on this connection"
            )
        try:
            session.window.land(self._arena, [item[1] for item in held if item], offsets)
        except BaseException:
            session.cancel(ids)  # an offset past the window: nothing of it is stored
            raise
        result = await session.commit(ids, self._namespace(session), retention)
        return pack_commit_reply(result.stored, result.already_present, result.dropped)

    def _touch(self, session: _Session, cursor: Cursor) -> bytes:
        calls, lookups, keys = read_touch(cursor, self.store.max_keys_per_request)
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


def _close_all(fds: list[int]) -> None:
    """Close and forget descriptors a client sent that nothing kept."""
    while fds:
        with contextlib.suppress(OSError):
            os.close(fds.pop())
