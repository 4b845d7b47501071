"""Issue 41's shared-memory overwrite probe: a tenant's namespaces cannot write each other's pages.

Before: in a tenant with ``shm = true``, a process that said HELLO in another namespace mapped
the whole arena writable and overwrote the victim's pages; the victim's direct index reads
returned those wrong bytes whatever ``dram.verify_reads`` said, its leased and gRPC reads did
too with verification off. Now the server seals its arena against writable mappings
(``F_SEAL_FUTURE_WRITE``): the attacker, a real subprocess of the server's own user speaking the
socket's protocol by hand, tries every way to change the pages it was handed (a writable map,
``mprotect``, reopening the descriptor read-write, ``pwrite``, punching holes, ``MADV_REMOVE``,
truncating, and committing reserved pages it never wrote), and every one is refused; the victim
then reads its blocks through the direct index read, the leased read and gRPC, with verification
off and on, and gets exactly its bytes.

What the attacker can still do is *read* the arena (the last check: it reads the victim's blocks
through the published index). A tenant's namespaces share its arena for reading: the boundary of
confidentiality is the tenant, and ``tenants.NAME.shm`` stays the tenant's statement that its
engines may read each other's KV (README, Tenants).
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from harness.tenant_config import NS, OTHER_NS, blocks, client, data_plane_of, write_config

from kvstore.client.shm import ShmDataPlane
from kvstore.protocol.messages import namespace_bytes

if TYPE_CHECKING:
    from harness.server_factory import ServerFactory

ATTACKER = textwrap.dedent(
    """
    import ctypes, hashlib, json, mmap, os, socket, struct, sys
    import numpy as np
    from kvstore.protocol.dram_index import IndexReader
    from kvstore.protocol.shm_frames import Cursor, Op, frame, pack_ids, pack_keys
    from kvstore.protocol.shm_messages import ReserveSlot
    from kvstore.protocol.shm_frames import unpack_hello

    path, own, victim = sys.argv[1], bytes.fromhex(sys.argv[2]), bytes.fromhex(sys.argv[3])
    keys = [bytes.fromhex(k) for k in sys.argv[4].split(",")]
    libc = ctypes.CDLL(None, use_errno=True)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(10)
    sock.connect(path)

    def reply(data=b""):
        data = bytearray(data)
        while len(data) < 4 or len(data) < 4 + struct.unpack("<I", data[:4])[0]:
            data += sock.recv(65536)
        return data[4], bytes(data[5:])

    sock.sendall(frame(Op.HELLO, own))
    data, fds, _, _ = socket.recv_fds(sock, 4096, 2)
    status, body = reply(data)
    hello = unpack_hello(body)
    arena_fd, index_fd = fds
    size = hello.arena_size
    out = {}

    def attempt(name, call):
        try:
            result = call()
            out[name] = "done" if result in (None, 0) or result is True else f"returned {result}"
        except OSError as exc:
            out[name] = f"refused: {exc.strerror}"

    def c_call(function, *args):
        if function(*args) != 0:
            raise OSError(ctypes.get_errno(), os.strerror(ctypes.get_errno()))

    attempt("mmap writable", lambda: mmap.mmap(arena_fd, size).close())
    ro = mmap.mmap(arena_fd, size, prot=mmap.PROT_READ)
    base = np.frombuffer(ro, dtype=np.uint8).ctypes.data
    libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    attempt("mprotect writable", lambda: c_call(libc.mprotect, base, 4096, 3))
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    attempt("MADV_REMOVE", lambda: c_call(libc.madvise, base, 4096, 9))
    again = os.open(f"/proc/self/fd/{arena_fd}", os.O_RDWR)
    attempt("reopened read-write, mmap writable", lambda: mmap.mmap(again, size).close())
    attempt("pwrite", lambda: os.pwrite(again, b"\\xee" * 4096, 0) and None)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    attempt("punch hole", lambda: c_call(libc.fallocate, again, 3, 0, size))
    attempt("ftruncate", lambda: os.ftruncate(again, 0))

    # Reserve pages in its own namespace and commit them unwritten (what the reserved pages
    # held before, say another namespace's freed block, must not become a block).
    sock.sendall(frame(Op.RESERVE, pack_keys([os.urandom(16)]) + struct.pack("<Q", 65536)))
    status, body = reply()
    cursor = Cursor(body)
    assert cursor.u8() == ReserveSlot.RESERVED, body
    reservation = cursor.u64()
    sock.sendall(frame(Op.COMMIT, pack_ids([reservation])))
    status, body = reply()
    out["commit of unwritten pages"] = f"status {status}: {body.decode()}"

    index = IndexReader(index_fd, hello.index_size)
    read = []
    for key in keys:
        hit = index.find(key, victim)
        if hit is not None:
            read.append(hashlib.sha256(ro[hit[2] : hit[2] + hit[3]]).hexdigest())
    out["foreign blocks read"] = read
    print(json.dumps(out))
    """
)


@pytest.mark.parametrize("verify", [False, True], ids=["verify-off", "verify-on"])
def test_another_namespace_of_the_tenant_cannot_change_a_page(
    server_factory: ServerFactory, tmp_path: Path, verify: bool
) -> None:
    extra = f"[dram]\nverify_reads = {'true' if verify else 'false'}"
    server = server_factory("--config", str(write_config(tmp_path, extra=extra)))
    socket_path = data_plane_of(server, "alice").shm_socket
    assert socket_path
    keys, values = blocks(41, count=8)
    with client(server, "alice", data_plane="shm") as victim:
        assert victim.put(keys, values).stored == 8
    attack = subprocess.run(
        [
            *(sys.executable, "-c", ATTACKER, socket_path),
            *(namespace_bytes(OTHER_NS).hex(), namespace_bytes(NS).hex()),
            ",".join(k.hex() for k in keys),
        ],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert attack.returncode == 0, attack.stderr
    outcome = json.loads(attack.stdout)
    committed = outcome.pop("commit of unwritten pages")
    read = outcome.pop("foreign blocks read")
    # What the victim gets on every read path (checked first: on a server that let the attacker
    # write, this is where the wrong bytes show).
    fingerprint = namespace_bytes(NS)
    direct = ShmDataPlane(socket_path, fingerprint)
    leased = ShmDataPlane(socket_path, fingerprint, direct_reads=False)
    try:
        assert direct.direct_reads and not leased.direct_reads
        with direct.acquire(keys) as lease:
            in_place = [None if v is None else bytes(v) for v in lease.views]
            in_place = [v if ok else None for v, ok in zip(in_place, lease.intact(), strict=True)]
        got = {"direct index read": direct.get(keys), "direct view": in_place}
        got["leased read"] = leased.get(keys)
        checksums = getattr(direct._index, "checksums", False)
    finally:
        direct.close()
        leased.close()
    with client(server, "alice", data_plane="grpc") as reader:
        got["gRPC read"] = reader.get(keys)
        corrupt = reader.stats()["tiers"]["dram"]["corrupt_blocks"]
    verdicts = {path: _verdict(blocks_got, values) for path, blocks_got in got.items()}
    assert set(verdicts.values()) == {"right"}, verdicts
    assert corrupt == 0
    assert len(outcome) == 7 and all(said.startswith("refused") for said in outcome.values()), (
        outcome
    )
    assert committed.startswith("status 3") and "read-only to clients" in committed  # INVALID_ARG
    assert checksums == verify  # the index carries checksums exactly where reads are verified
    # Reading stays possible inside the tenant (see the module docstring).
    assert read == [hashlib.sha256(v).hexdigest() for v in values]


def _verdict(got: list[bytes | None], wanted: list[bytes]) -> str:
    """ "right", or how many blocks came back wrong and how many were missing."""
    wrong = sum(g is not None and g != w for g, w in zip(got, wanted, strict=True))
    missing = sum(g is None for g in got)
    return "right" if not wrong and not missing else f"{wrong} WRONG BYTES, {missing} missing"
