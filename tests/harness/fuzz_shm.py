"""Random shared-memory frames for the fuzz suite (:mod:`test_fuzz`), reproducible from one seed.

:func:`fuzz_shm` opens connection after connection to a real server's shm socket and sends random
and mutated frames (:mod:`kvstore.protocol.shm_frames`): unknown ops, lengths over the legal
maximum, truncated bodies, random bodies behind valid headers, well-formed requests with
random keys, lengths and ids (and ids the server handed out). The server may answer with an error
status or hang up; a reply with status INTERNAL (13) or UNKNOWN (2), or no reply at all to a whole
frame that gets one, is a finding.
"""

from __future__ import annotations

import contextlib
import os
import random
import socket
import struct
from collections.abc import Sequence
from dataclasses import dataclass, field

from kvstore.protocol.shm_frames import (
    MAX_TOUCH_LOOKUPS,
    Op,
    ProtocolError,
    frame,
    max_frame_length,
    pack_ids,
    pack_keys,
)
from kvstore.protocol.shm_messages import Lent, read_acquire_reply, read_reserve_reply

#: Reply statuses that are server bugs (gRPC's INTERNAL and UNKNOWN).
BUG_STATUSES = {13: "INTERNAL", 2: "UNKNOWN"}
REPLY_TIMEOUT_S = 10.0
OPS = [
    Op.HELLO,
    Op.LOOKUP,
    Op.ACQUIRE,
    Op.RELEASE,
    Op.RESERVE,
    Op.COMMIT,
    Op.CANCEL,
    Op.TOUCH,
    Op.SYNC,
    Op.WINDOW,  # sent with no descriptor here: always refused
    Op.COMMIT_FROM,
]


class HungUp(Exception):
    """The server closed the connection."""


@dataclass
class ShmReport:
    """What an shm fuzz run sent and got."""

    frames: int = 0
    connections: int = 0
    hangups: int = 0
    statuses: dict[int, int] = field(default_factory=dict)
    findings: list[str] = field(default_factory=list)


class Connection:
    """One raw connection; replies are read whole, any passed file descriptors closed."""

    def __init__(self, path: str) -> None:
        self.sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.sock.settimeout(REPLY_TIMEOUT_S)
        self.sock.connect(path)

    def send(self, data: bytes) -> None:
        try:
            self.sock.sendall(data)
        except (BrokenPipeError, ConnectionResetError) as exc:
            raise HungUp from exc

    def reply(self) -> tuple[int, bytes]:
        data = bytearray()
        while len(data) < 4 or len(data) < 4 + struct.unpack("<I", data[:4])[0]:
            try:
                chunk, fds, _, _ = socket.recv_fds(self.sock, 1 << 20, 4)
            except ConnectionResetError as exc:
                raise HungUp from exc
            for fd in fds:  # HELLO's memfds: not mapped here
                os.close(fd)
            if not chunk:
                raise HungUp
            data += chunk
        length = struct.unpack("<I", data[:4])[0]
        return data[4], bytes(data[5 : 4 + length])

    def close(self) -> None:
        self.sock.close()


class Frames:
    """Builds random frames from one :class:`random.Random`."""

    def __init__(
        self, rng: random.Random, namespace: bytes, seed_keys: list[bytes], max_keys: int
    ) -> None:
        self.rng = rng
        self.namespace = namespace
        self.seed_keys = seed_keys
        self.max_keys = max_keys
        self.ids: list[int] = []  # lease and reservation ids the server handed out

    def keys(self) -> bytes:
        rng = self.rng
        count = rng.choice([0, 1, 2, rng.randrange(1, 40), rng.randrange(1, 40), self.max_keys + 1])
        keys = [
            rng.choice(self.seed_keys) if rng.random() < 0.2 else rng.randbytes(16)
            for _ in range(min(count, 64))
        ]
        body = pack_keys(keys)
        if count != len(keys) or rng.random() < 0.1:  # a count that does not match the keys
            body = (
                struct.pack("<I", count if count != len(keys) else rng.randrange(2**32)) + body[4:]
            )
        return body

    def ids_body(self) -> bytes:
        rng = self.rng
        ids = [
            rng.choice(self.ids) if self.ids and rng.random() < 0.5 else rng.randrange(2**64)
            for _ in range(rng.randrange(0, 6))
        ]
        if ids and rng.random() < 0.3:
            ids.append(ids[0])  # the same id twice
        return pack_ids(ids)

    def body(self, op: int) -> bytes:
        """A well-formed (or nearly) body for ``op``."""
        rng = self.rng
        if op == Op.HELLO:
            return (
                self.namespace
                if rng.random() < 0.7
                else rng.randbytes(rng.choice([0, 15, 17, 64, 65]))
            )
        if op in (Op.LOOKUP, Op.ACQUIRE):
            return self.keys()
        if op == Op.RESERVE:
            keys = self.keys()
            count = min(struct.unpack("<I", keys[:4])[0], 64)
            sizes = [
                rng.choice([0, 1, 512, 4096, 65536, 1 << 20, (1 << 20) + 1, 2**63, 2**64 - 1])
                for _ in range(count)
            ]
            if rng.random() < 0.2:
                sizes = sizes[: rng.randrange(len(sizes) + 1)]
            return keys + struct.pack(f"<{len(sizes)}Q", *sizes)
        if op in (Op.RELEASE, Op.COMMIT, Op.CANCEL):
            return self.ids_body()
        if op == Op.COMMIT_FROM:
            ids = self.ids_body()
            count = struct.unpack("<I", ids[:4])[0]
            offsets = [rng.choice([0, 4096, 2**40, 2**64 - 1]) for _ in range(count)]
            return ids + struct.pack(f"<{count}Q", *offsets)
        if op == Op.TOUCH:
            calls = rng.choice([0, 1, 5, 2**32 - 1])
            lookups = rng.choice([0, 1, MAX_TOUCH_LOOKUPS, MAX_TOUCH_LOOKUPS + 1, 2**32 - 1])
            return struct.pack("<II", calls, lookups) + self.keys()
        return b"" if rng.random() < 0.8 else rng.randbytes(rng.randrange(1, 8))  # SYNC

    def mutate(self, body: bytes) -> bytes:
        rng = self.rng
        data = bytearray(body)
        roll = rng.random()
        if roll < 0.4 and data:
            for _ in range(rng.randrange(1, 4)):
                data[rng.randrange(len(data))] = rng.randrange(256)
        elif roll < 0.7:
            del data[rng.randrange(len(data) + 1) :]
        else:
            data += rng.randbytes(rng.randrange(1, 32))
        return bytes(data)

    def next(self) -> tuple[str, bytes, bool]:
        """A frame's description, its bytes, and whether the server owes a reply to it."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.05:  # an op no server knows
            op = rng.choice([0, 10, 11, 127, 255, rng.randrange(10, 256)])
            return f"op {op}", frame(op, rng.randbytes(rng.randrange(0, 40))), True
        op = rng.choice(OPS)
        if roll < 0.065:  # a length past what the op may have: refused, connection closed
            length = max_frame_length(op, self.max_keys) + rng.choice([1, 2, 1000, 1 << 24])
            return f"op {op} length {length}", struct.pack("<IB", min(length, 2**32 - 1), op), False
        if roll < 0.08:  # a zero length
            return "length 0", struct.pack("<I", 0), False
        body = self.body(op)
        if roll < 0.45:
            body = self.mutate(body)
        if len(body) + 1 > max_frame_length(op, self.max_keys):
            body = body[: max_frame_length(op, self.max_keys) - 1]
        return f"op {op} body {body.hex()[:120]}", frame(op, body), op not in Op.ONE_WAY

    def note(self, request: bytes, status: int, body: bytes) -> None:
        """Keep the ids an OK ACQUIRE or RESERVE reply handed out, for later frames (the reply
        read as the client reads it, for the request's key count)."""
        if status != 0 or len(request) < 9 or request[4] not in (Op.ACQUIRE, Op.RESERVE):
            return
        count = struct.unpack_from("<I", request, 5)[0]
        read = read_acquire_reply if request[4] == Op.ACQUIRE else read_reserve_reply
        with contextlib.suppress(ProtocolError):
            items: Sequence[object] = read(body, count)
            self.ids.extend(item.id for item in items if isinstance(item, Lent))
        del self.ids[:-256]


def fuzz_shm(
    path: str,
    namespace: bytes,
    seed_keys: list[bytes],
    max_keys: int,
    seed: int,
    connections: int,
    frames_each: int,
) -> ShmReport:
    """``connections`` connections one after the other, up to ``frames_each`` frames each.

    A connection ends early when the server hangs up (a refused frame) or with a truncated
    frame (its last bytes never come: the client closes, or waits for the server to hang up).
    """
    rng = random.Random(seed)
    frames = Frames(rng, namespace, seed_keys, max_keys)
    report = ShmReport()
    for number in range(connections):
        conn = Connection(path)
        report.connections += 1
        try:
            if rng.random() < 0.8:  # most fuzz behind a valid greeting
                conn.send(frame(Op.HELLO, namespace))
                status, _ = conn.reply()
                assert status == 0, f"HELLO refused: {status}"
            for _ in range(frames_each):
                described, data, answered = frames.next()
                report.frames += 1
                if rng.random() < 0.015:  # truncated: the rest never comes
                    conn.send(data[: rng.randrange(1, max(2, len(data)))])
                    if rng.random() < 0.2:  # wait for the frame timeout to hang up
                        conn.sock.settimeout(REPLY_TIMEOUT_S)
                        with contextlib.suppress(HungUp):
                            conn.reply()
                            report.findings.append(
                                f"conn {number}: a reply to a truncated {described}"
                            )
                    break
                conn.send(data)
                if not answered:
                    continue
                try:
                    status, body = conn.reply()
                except TimeoutError:
                    report.findings.append(
                        f"conn {number}: no reply within {REPLY_TIMEOUT_S}s to {described}"
                    )
                    break
                report.statuses[status] = report.statuses.get(status, 0) + 1
                if status in BUG_STATUSES:
                    message = body.decode(errors="replace")
                    report.findings.append(
                        f"conn {number}: {BUG_STATUSES[status]} {message!r} to {described}"
                    )
                frames.note(data, status, body)
        except HungUp:
            report.hangups += 1
        finally:
            conn.close()
    return report
