"""Consuming the KV events of the vLLM engine beside a node (``cluster.engine_events``).

vLLM (``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq",
"endpoint": "tcp://*:5557"}'``, which needs prefix caching) publishes on a ZMQ PUB socket one
multipart message per batch: ``[topic, seq, payload]`` where ``seq`` is an 8-byte big-endian
counter from 0 and ``payload`` a msgpack ``KVEventBatch``: an array ``[ts, events, dp_rank]``
whose events are maps tagged by ``type``: ``BlockStored`` (``block_hashes``,
``parent_block_hash``, ``token_ids``, ``block_size``, ``lora_name``, ``extra_keys``,
``group_idx``, ``kv_cache_spec_kind``, ...), ``BlockRemoved`` (``block_hashes``, ``group_idx``) and
``AllBlocksCleared``. :class:`EngineEvents` subscribes to it and feeds
:class:`~.engine_chunks.EngineChunks`.

**Never claim what may be gone.** A sequence number that does not follow the last one (events
were lost: the subscriber fell behind the publisher's high-water mark, or the engine restarted
and counts from 0 again), a batch that cannot be decoded, or the engine's connection closing
(the engine stopped or died: its cache went with it) each drop everything learnt from the
engine, with one log line; what the engine stores afterwards is learnt again. Blocks the engine
cached before this node listened are never claimed (their chains start at unknown parents).

**Staleness.** An engine's change shows in the index within its own publishing delay (vLLM
publishes once per scheduler step) plus ``cluster.publish_interval_s`` plus a Redis round trip.
A chunk the engine evicts after a router's query is a miss there, as with any cache; an engine
that hangs without closing its connection keeps counting until its node's lease ends or the
connection closes.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from kvstore.errors import ConfigError
from kvstore.node.engine_chunks import BlockHash, EngineChunks, StoredBlocks

__all__ = ["EngineEvents", "decode_batch", "load_event_modules"]

logger = logging.getLogger(__name__)

#: Bound on one message from the engine (a batch is far smaller); larger ones are dropped by ZMQ.
MAX_MESSAGE_BYTES = 64 * 1024 * 1024


def load_event_modules() -> tuple[Any, Callable[[bytes], Any]]:
    """``zmq`` (with ``zmq.asyncio``) and a msgpack decoder (``msgpack``'s, or ``msgspec``'s,
    which vLLM itself installs), or one ConfigError naming the extra."""
    try:
        import zmq
        import zmq.asyncio
    except ImportError as exc:
        raise ConfigError(
            "cluster.engine_events needs pyzmq (not installed): pip install 'kvstore[events]'"
        ) from exc
    try:
        import msgpack

        def unpack(payload: bytes) -> Any:
            return msgpack.unpackb(payload, raw=False, strict_map_key=False)

    except ImportError:
        try:
            import msgspec
        except ImportError as exc:
            raise ConfigError(
                "cluster.engine_events needs msgpack (not installed): pip install 'kvstore[events]'"
            ) from exc
        unpack = msgspec.msgpack.decode
    return zmq, unpack


@dataclass(frozen=True)
class Removed:
    """A ``BlockRemoved`` event."""

    hashes: tuple[BlockHash, ...]
    group: int | None


@dataclass(frozen=True)
class Cleared:
    """An ``AllBlocksCleared`` event."""


Event = StoredBlocks | Removed | Cleared


def _hash(value: Any) -> BlockHash:
    if isinstance(value, bytes | int) and not isinstance(value, bool):
        return value
    raise ValueError(f"a block hash must be bytes or an int, got {type(value).__name__}")


def _group(event: dict[Any, Any]) -> int | None:
    group = event.get("group_idx")
    if group is not None and not isinstance(group, int):
        raise ValueError("group_idx must be an int")
    return group


def _kind(event: dict[Any, Any]) -> str | None:
    kind = event.get("kv_cache_spec_kind")
    if kind is not None and not isinstance(kind, str):
        raise ValueError("kv_cache_spec_kind must be a string")
    return kind


def _event(event: Any) -> Event:
    if not isinstance(event, dict):
        raise ValueError("an event must be a map")
    kind = event.get("type")
    if kind == "BlockStored":
        parent = event.get("parent_block_hash")
        tokens = event["token_ids"]
        extra = event.get("extra_keys")
        lora = event.get("lora_name")
        if not isinstance(tokens, list) or not all(type(t) is int for t in tokens):
            raise ValueError("token_ids must be a list of ints")
        if not isinstance(event["block_size"], int):
            raise ValueError("block_size must be an int")
        if extra is not None and not (
            isinstance(extra, list) and all(e is None or isinstance(e, list) for e in extra)
        ):
            raise ValueError("extra_keys must be a list of lists")
        return StoredBlocks(
            hashes=tuple(_hash(h) for h in event["block_hashes"]),
            parent=None if parent is None else _hash(parent),
            token_ids=tokens,
            block_size=event["block_size"],
            lora_name=lora if isinstance(lora, str) else None,
            extra_keys=extra,
            group=_group(event),
            kind=_kind(event),
        )
    if kind == "BlockRemoved":
        return Removed(tuple(_hash(h) for h in event["block_hashes"]), _group(event))
    if kind == "AllBlocksCleared":
        return Cleared()
    raise ValueError(f"unknown event type {kind!r}")


def decode_batch(unpack: Callable[[bytes], Any], payload: bytes) -> list[Event]:
    """The events of one ``KVEventBatch`` payload; ValueError if it is not one."""
    try:
        batch = unpack(payload)
    except Exception as exc:  # msgpack raises several types for corrupt input
        raise ValueError(f"not msgpack: {exc}") from exc
    if not isinstance(batch, list) or len(batch) < 2 or not isinstance(batch[1], list):
        raise ValueError("not a KVEventBatch array [ts, events, ...]")
    try:
        return [_event(event) for event in batch[1]]
    except (KeyError, TypeError) as exc:
        raise ValueError(f"malformed event ({exc!r})") from exc


class EngineEvents:
    """Subscribes to one engine's KV event publisher at ``endpoint`` and applies its batches."""

    def __init__(self, endpoint: str, chunks: EngineChunks) -> None:
        self.endpoint = endpoint
        self.chunks = chunks
        self._zmq, self._unpack = load_event_modules()
        self._seq: int | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._sockets: list[Any] = []
        self._warned: set[str] = set()
        #: Batches applied, and times everything learnt was dropped (tests and logs read them).
        self.batches = 0
        self.resets = 0

    def handle(self, frames: Sequence[bytes]) -> None:
        """Apply one multipart message ``[topic, seq, payload]`` from the publisher."""
        try:
            if len(frames) != 3 or len(frames[1]) != 8:
                raise ValueError(f"expected [topic, seq, payload], got {len(frames)} frames")
            seq = int.from_bytes(frames[1], "big", signed=True)
            events = decode_batch(self._unpack, frames[2])
        except ValueError as exc:
            self._seq = None
            self.lost("undecodable", f"an undecodable batch ({exc})")
            return
        if self._seq is not None and seq != self._seq + 1:
            self.lost("gap", f"a sequence gap ({self._seq} then {seq})")
        self._seq = seq
        try:
            for event in events:
                if isinstance(event, StoredBlocks):
                    self.chunks.stored(event)
                elif isinstance(event, Removed):
                    self.chunks.removed(event.hashes, event.group)
                else:
                    self.chunks.clear()
        except ValueError as exc:
            self._seq = None
            self.lost("undecodable", f"an inconsistent event ({exc})")
            return
        self.batches += 1

    def lost(self, kind: str, why: str) -> None:
        """Events may be missing: drop everything learnt from the engine (one log line per
        kind of loss; later ones at debug level)."""
        held = len(self.chunks.held)
        self.chunks.clear()
        self.resets += 1
        log = logger.debug if kind in self._warned else logger.warning
        self._warned.add(kind)
        log(
            "engine events from %s: %s; dropped the %d chunks learnt from the engine",
            self.endpoint,
            why,
            held,
        )

    def start(self) -> None:
        """Connect to the publisher and apply its batches in the background."""
        zmq = self._zmq
        context = zmq.asyncio.Context.instance()
        sub = context.socket(zmq.SUB)
        sub.setsockopt(zmq.MAXMSGSIZE, MAX_MESSAGE_BYTES)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_HANDSHAKE_SUCCEEDED)
        sub.connect(self.endpoint)
        self._sockets = [sub, monitor]
        self._tasks = [
            asyncio.create_task(self._receive(sub), name="engine-events"),
            asyncio.create_task(self._watch(monitor), name="engine-events-monitor"),
        ]
        logger.info("engine events: listening to %s", self.endpoint)

    async def _receive(self, sub: Any) -> None:
        while True:
            self.handle(await sub.recv_multipart())

    async def _watch(self, monitor: Any) -> None:
        from zmq.utils.monitor import parse_monitor_message

        while True:
            message = parse_monitor_message(await monitor.recv_multipart())
            if message["event"] == self._zmq.EVENT_HANDSHAKE_SUCCEEDED:
                logger.info("engine events: connected to %s", self.endpoint)
            elif message["event"] == self._zmq.EVENT_DISCONNECTED:
                self._seq = None
                self.lost("disconnected", "the engine's connection closed")

    async def stop(self) -> None:
        """Stop listening (what was learnt stays until the node withdraws its entries)."""
        for task in self._tasks:
            task.cancel()
        for task in self._tasks:
            with contextlib.suppress(asyncio.CancelledError):
                await task
        self._tasks = []
        if self._sockets:
            self._sockets[0].disable_monitor()
        for socket in self._sockets:
            socket.close(linger=0)
        self._sockets = []
