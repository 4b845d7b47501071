"""Random gRPC requests for the fuzz suite (:mod:`test_fuzz`), each reproducible from one seed.

:func:`fuzz_grpc` sends ``count`` requests to a real ``kvstore serve``: valid-looking and malformed
messages of every ``kvstore.v1.KVStore`` and ``kvstore.v1.UcxTransfer`` method (wrong key lengths,
empty lists, counts past the server's limit, duplicate keys, wrong namespaces), random bytes as
raw serialized messages, Put streams cut off by a cancel or left hanging until their deadline.
Every call has a deadline. Any status is fine except INTERNAL and UNKNOWN, which are server bugs:
they come back as :class:`Finding` records naming the request and the seed it came from.

Writes (Put, UcxPut) never use the seed namespace; Delete may, with random keys (which do not
collide with the seeds), so the seeded blocks must come through untouched.
"""

from __future__ import annotations

import json
import random
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import grpc

from kvstore._proto.kvstore.v1 import kvstore_pb2 as pb
from kvstore._proto.kvstore.v1 import kvstore_pb2_grpc as pb_grpc
from kvstore._proto.kvstore.v1 import ucx_pb2 as ucx_pb
from kvstore._proto.kvstore.v1 import ucx_pb2_grpc as ucx_pb_grpc

#: Statuses that mean the server failed in a way it did not foresee.
BUGS = frozenset({grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN})
#: The deadline of an ordinary call; a stalled Put stream gets :data:`STALL_S`.
DEADLINE_S = 10.0
STALL_S = 0.3
KVSTORE_METHODS = (
    "Lookup",
    "Put",
    "Get",
    "Delete",
    "Stats",
    "DataPlane",
    "Prefetch",
    "PrefetchStatus",
    "CancelPrefetch",
    "KeyScheme",
)
UCX_METHODS = ("UcxGet", "UcxPut")


@dataclass(frozen=True)
class Finding:
    """One request answered INTERNAL or UNKNOWN."""

    index: int
    kind: str
    status: str
    details: str
    request: str

    def __str__(self) -> str:
        return f"#{self.index} {self.kind}: {self.status} {self.details!r}; request {self.request}"


@dataclass
class Target:
    """What the generator knows of the server under test."""

    seed_namespace: bytes
    seed_keys: list[bytes]
    max_keys: int


class Requests:
    """Builds random requests from one :class:`random.Random`."""

    def __init__(self, rng: random.Random, target: Target) -> None:
        self.rng = rng
        self.target = target
        self.other_namespace = rng.randbytes(16)
        self.prefetch_ids: list[int] = []

    # -- parts ------------------------------------------------------------------------------

    def namespace(self, *, write: bool = False) -> bytes:
        roll = self.rng.random()
        if roll < 0.6:
            return self.other_namespace if write else self.target.seed_namespace
        if roll < 0.75:
            return self.other_namespace
        if roll < 0.85:
            return b""
        return self.rng.randbytes(self.rng.choice([1, 15, 17, 32, self.rng.randrange(64)]))

    def scheme_namespace(self) -> str:
        """A declared namespace's JSON: mostly fields of :class:`Namespace` with values of any
        type, now and then not JSON, not an object, or past the size limit."""
        rng = self.rng
        roll = rng.random()
        if roll < 0.1:
            return rng.randbytes(rng.randrange(64)).decode("latin-1")
        if roll < 0.15:
            return "x" * rng.choice([4096, 4097, 70000])
        values: list[Any] = ["m", "", 0, -1, 1, 2**70, 1.5, True, None, [], {}, "\u0000", "é" * 3]
        names = ["model", "revision", "num_layers", "tp_size", "tenant", "lora_id", "bogus"]
        fields: dict[str, Any] = {"model": rng.choice(["m", "m2", rng.randbytes(4).hex()])}
        for _ in range(rng.randrange(4)):
            fields[rng.choice(names)] = rng.choice(values)
        return json.dumps(rng.choice([fields, fields, [fields], "text", 7]))

    def key(self, *, reads_seeds: bool) -> bytes:
        roll = self.rng.random()
        if roll < 0.7:
            return self.rng.randbytes(16)
        if roll < 0.8 and reads_seeds:
            return self.rng.choice(self.target.seed_keys)
        return self.rng.randbytes(self.rng.choice([0, 1, 8, 15, 17, 32, self.rng.randrange(100)]))

    def count(self) -> int:
        roll = self.rng.random()
        if roll < 0.1:
            return 0
        if roll < 0.8:
            return self.rng.randrange(1, 9)
        if roll < 0.95:
            return self.rng.randrange(9, 300)
        return self.target.max_keys + self.rng.randrange(0, 200)  # at or past the limit

    def keys(self, *, reads_seeds: bool, count: int | None = None) -> list[bytes]:
        keys = [
            self.key(reads_seeds=reads_seeds)
            for _ in range(self.count() if count is None else count)
        ]
        if keys and self.rng.random() < 0.2:  # duplicates
            keys += [self.rng.choice(keys) for _ in range(self.rng.randrange(1, 5))]
        return keys

    def value_size(self) -> int:
        # Now and then a block up to and just past the server's 1 MiB block limit: refused Put
        # streams must give back what they received
        # (test_fuzz.test_refused_put_streams_give_their_memory_back).
        roll = self.rng.random()
        if roll < 0.1:
            return 0
        if roll < 0.9:
            return self.rng.randrange(1, 4096)
        if roll < 0.98:
            return self.rng.randrange(4096, 64 * 1024)
        return self.rng.randrange(64 * 1024, 1024 * 1024 + 2)

    def value(self) -> bytes:
        # Zeros: cheap to build, and the server cannot tell.
        return bytes(self.value_size())

    def raw(self) -> bytes:
        size = self.rng.choice([0, 1, 2, 5, 16, 64, self.rng.randrange(4096)])
        data = bytearray(self.rng.randbytes(size))
        if data and self.rng.random() < 0.5:  # a valid message with bytes flipped
            valid = pb.LookupRequest(namespace=self.target.seed_namespace, keys=[b"k" * 16] * 3)
            data = bytearray(valid.SerializeToString())
            for _ in range(self.rng.randrange(1, 4)):
                data[self.rng.randrange(len(data))] = self.rng.randrange(256)
        return bytes(data)

    # -- calls ------------------------------------------------------------------------------

    def make(self, channel: grpc.Channel) -> tuple[str, str, Callable[[], Any]]:
        """One random call: its kind, a short description, and a thunk that makes it."""
        stub = pb_grpc.KVStoreStub(channel)
        ucx = ucx_pb_grpc.UcxTransferStub(channel)
        rng = self.rng
        roll = rng.random()
        if roll < 0.12:
            return self._raw(channel)
        kind = rng.choice([*KVSTORE_METHODS, *UCX_METHODS, "Put", "Get", "PutCut"])
        if kind == "Lookup":
            request: Any = pb.LookupRequest(
                namespace=self.namespace(), keys=self.keys(reads_seeds=True)
            )
            return kind, _describe(request), lambda: stub.Lookup(request, timeout=DEADLINE_S)
        if kind == "Get":
            request = pb.GetRequest(namespace=self.namespace(), keys=self.keys(reads_seeds=True))
            return kind, _describe(request), lambda: list(stub.Get(request, timeout=DEADLINE_S))
        if kind == "Delete":
            request = pb.DeleteRequest(
                namespace=self.namespace(), keys=self.keys(reads_seeds=False)
            )
            return kind, _describe(request), lambda: stub.Delete(request, timeout=DEADLINE_S)
        if kind == "Prefetch":
            request = pb.PrefetchRequest(
                namespace=self.namespace(), keys=self.keys(reads_seeds=True)
            )
            return kind, _describe(request), lambda: self._prefetch(stub, request)
        if kind in ("PrefetchStatus", "CancelPrefetch"):
            ident = (
                rng.choice(self.prefetch_ids)
                if self.prefetch_ids and rng.random() < 0.6
                else (rng.choice([0, 1, 2**63, 2**64 - 1, rng.randrange(2**64)]))
            )
            if kind == "PrefetchStatus":
                status = pb.PrefetchStatusRequest(prefetch_id=ident)
                return kind, f"id={ident}", lambda: stub.PrefetchStatus(status, timeout=DEADLINE_S)
            cancel = pb.CancelPrefetchRequest(prefetch_id=ident)
            return kind, f"id={ident}", lambda: stub.CancelPrefetch(cancel, timeout=DEADLINE_S)
        if kind == "Stats":
            return kind, "", lambda: stub.Stats(pb.StatsRequest(), timeout=DEADLINE_S)
        if kind == "DataPlane":
            return kind, "", lambda: stub.DataPlane(pb.DataPlaneRequest(), timeout=DEADLINE_S)
        if kind == "KeyScheme":
            check = rng.choice(["", "0" * 16, rng.randbytes(8).hex(), "zz", "A" * 16, "0" * 99])
            declared = pb.KeySchemeRequest(namespace=self.scheme_namespace(), secret_check=check)
            described = f"namespace={declared.namespace[:120]!r} secret_check={check!r}"
            return kind, described, lambda: stub.KeyScheme(declared, timeout=DEADLINE_S)
        if kind in ("Put", "PutCut"):
            return self._put(stub, cut=kind == "PutCut")
        if kind == "UcxGet":
            keys = self.keys(reads_seeds=True)
            sizes = [
                rng.choice([0, 1, 4096, 2**63, rng.randrange(2**64)])
                for _ in range(len(keys) + rng.choice([0, 0, -1, 1]))
            ]
            ucx_get = ucx_pb.UcxGetRequest(
                namespace=self.namespace(),
                keys=keys,
                sizes=[s for s in sizes if s >= 0],
                client_id=rng.randbytes(rng.choice([0, 16, 17])),
                transfer_id=rng.randrange(2**64),
            )
            return kind, _describe(ucx_get), lambda: ucx.UcxGet(ucx_get, timeout=DEADLINE_S)
        keys = self.keys(reads_seeds=False)
        lengths = [
            rng.choice([0, 1, 4096, 2**63, rng.randrange(2**64)])
            for _ in range(max(0, len(keys) + rng.choice([0, 0, -1, 1])))
        ]
        ucx_put = ucx_pb.UcxPutRequest(
            namespace=self.namespace(write=True),
            keys=keys,
            lengths=lengths,
            client_id=rng.randbytes(rng.choice([0, 16, 17])),
            transfer_id=rng.randrange(2**64),
        )
        return "UcxPut", _describe(ucx_put), lambda: ucx.UcxPut(ucx_put, timeout=DEADLINE_S)

    def _prefetch(self, stub: pb_grpc.KVStoreStub, request: pb.PrefetchRequest) -> None:
        reply = stub.Prefetch(request, timeout=DEADLINE_S)
        self.prefetch_ids.append(reply.prefetch_id)
        del self.prefetch_ids[:-64]

    def _put(self, stub: pb_grpc.KVStoreStub, *, cut: bool) -> tuple[str, str, Callable[[], Any]]:
        rng = self.rng
        messages: list[pb.PutRequest] = []
        for _ in range(rng.randrange(0, 5)):
            keys = self.keys(reads_seeds=False, count=rng.randrange(0, 5))
            blocks = [pb.Block(key=key, value=self.value()) for key in keys]
            if blocks and rng.random() < 0.1:  # a block without its key or value
                blocks.append(
                    pb.Block(key=rng.randbytes(16)) if rng.random() < 0.5 else pb.Block(value=b"v")
                )
            namespace = self.namespace(write=True) if not messages or rng.random() < 0.2 else b""
            messages.append(pb.PutRequest(namespace=namespace, blocks=blocks))
        sizes = [(len(m.namespace), [len(b.value) for b in m.blocks]) for m in messages]
        if not cut:
            return "Put", f"messages={sizes}", lambda: stub.Put(iter(messages), timeout=DEADLINE_S)
        how = rng.choice(["cancel", "stall"])
        pause = rng.random() * 0.05  # drawn here: the generator is not shared with the workers

        def run() -> Any:
            gate = threading.Event()

            def stream() -> Iterator[pb.PutRequest]:
                yield from messages
                gate.wait(DEADLINE_S)  # left open: cancelled, or cut by its deadline

            timeout = STALL_S if how == "stall" else DEADLINE_S
            future = stub.Put.future(stream(), timeout=timeout)
            if how == "cancel":
                time.sleep(pause)  # sleep: a random moment in the stream to cancel at
                future.cancel()
            try:
                return future.result(timeout=DEADLINE_S + 5)
            finally:
                gate.set()

        return "PutCut", f"{how} messages={sizes}", run

    def _raw(self, channel: grpc.Channel) -> tuple[str, str, Callable[[], Any]]:
        method = self.rng.choice([*KVSTORE_METHODS, *UCX_METHODS])
        service = "UcxTransfer" if method in UCX_METHODS else "KVStore"
        path = f"/kvstore.v1.{service}/{method}"
        payloads = [self.raw() for _ in range(self.rng.randrange(1, 4))]
        described = f"{path} {[p.hex()[:80] for p in payloads]}"
        if method == "Put":
            # no serializers: the bytes go as they are (grpc-stubs wrongly makes them required)
            call = channel.stream_unary(path)  # type: ignore[call-arg]
            return "raw Put", described, lambda: call(iter(payloads), timeout=DEADLINE_S)
        if method == "Get":
            stream = channel.unary_stream(path)  # type: ignore[call-arg]
            return "raw Get", described, lambda: list(stream(payloads[0], timeout=DEADLINE_S))
        unary = channel.unary_unary(path)  # type: ignore[call-arg]
        return f"raw {method}", described, lambda: unary(payloads[0], timeout=DEADLINE_S)


def _describe(message: Any) -> str:
    """A short account of a request: its namespace and key lengths, not megabytes of values."""
    parts = []
    for field, value in message.ListFields():
        if field.name in ("keys",):
            lengths = [len(k) for k in value]
            parts.append(
                f"keys={len(lengths)} lengths={sorted(set(lengths))[:8]} unique={len(set(value))}"
            )
        elif isinstance(value, bytes):
            parts.append(f"{field.name}={value.hex()}")
        elif not isinstance(value, (str, int, float, bool)):  # a repeated field
            parts.append(f"{field.name}={list(value)[:8]}{'...' if len(value) > 8 else ''}")
        else:
            parts.append(f"{field.name}={value}")
    return " ".join(parts)


@dataclass
class GrpcReport:
    """What a gRPC fuzz run sent and got."""

    sent: int
    statuses: dict[str, int]
    findings: list[Finding]
    slowest_s: float


def fuzz_grpc(
    target_address: str, target: Target, seed: int, count: int, workers: int = 8
) -> GrpcReport:
    """Send ``count`` random requests (``workers`` at a time) built from ``seed``.

    The requests are drawn in order from one generator, so a seed names the same requests every
    run; only their interleaving on the server differs.
    """
    rng = random.Random(seed)
    requests = Requests(rng, target)
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    statuses: dict[str, int] = {}
    findings: list[Finding] = []
    slowest = [0.0]  # the longest call not meant to stall, in seconds
    lock = threading.Lock()
    with grpc.insecure_channel(target_address, options=options) as channel:

        def one(index: int, kind: str, described: str, thunk: Callable[[], Any]) -> None:
            started = time.monotonic()
            try:
                thunk()
                name = "OK"
            except grpc.RpcError as exc:
                error: Any = exc
                code = error.code()
                name = code.name
                if code in BUGS or (
                    code == grpc.StatusCode.DEADLINE_EXCEEDED and not described.startswith("stall")
                ):  # a call that is not meant to stall and ran out its deadline: a hang
                    finding = Finding(index, kind, name, str(error.details()), described[:2000])
                    with lock:
                        findings.append(finding)
            except grpc.FutureCancelledError:
                name = "CANCELLED(client)"
            took = time.monotonic() - started
            with lock:
                statuses[name] = statuses.get(name, 0) + 1
                if not described.startswith("stall"):
                    slowest[0] = max(slowest[0], took)

        with ThreadPoolExecutor(workers) as pool:
            futures = []
            for index in range(count):
                kind, described, thunk = requests.make(channel)
                futures.append(pool.submit(one, index, kind, described, thunk))
                if len(futures) >= 4 * workers:  # keep the queue (and its payloads) short
                    futures.pop(0).result()
            for future in futures:
                future.result()
    return GrpcReport(count, statuses, findings, slowest[0])
