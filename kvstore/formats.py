"""The versioned formats nodes share, and the promise that makes rolling upgrades lose nothing.

What one node writes another reads: block headers on nvme, in Redis and between peers
(:mod:`kvstore.block`), node descriptions in the cluster index
(:mod:`kvstore.cluster.records`), index entries (:mod:`kvstore.cluster.layout`,
:mod:`kvstore.node.publisher`), the RPCs (the ``kvstore.v1`` protobuf package), and, on one node,
retention records across a restart (:mod:`kvstore.tiers.nvme_retention`) and the shared-memory
frames between a node and the engines beside it (:mod:`kvstore.protocol.shm_frames`). Each carries
a version, and every release keeps one promise (the N-1 promise):

* it **reads and keeps** everything the previous release writes (versions N-1 and N);
* by default it **writes** only what the previous release reads (:data:`PREVIOUS`), so that the
  nodes not yet upgraded read what the upgraded ones write; once the whole fleet runs the new
  release, ``cluster.write_formats = latest`` switches to the newest versions (:data:`LATEST`);
* a version **newer** than it understands (written by a later release, say after a downgrade)
  is a miss that it leaves in place: it never deletes it, counts it apart from corrupt or forged
  data (:class:`NewerFormatError`), and never calls its writer a rogue. Bytes in a version it
  understands that fail their MAC are still corrupt and deleted, as before.

The tables below are the one place where versions are declared; a format change bumps its
``latest`` here, keeps reading the one before, and the release after it may move ``previous``.

This module is a leaf: client and server both import it.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = [
    "BLOCK",
    "FORMATS",
    "INDEX",
    "LATEST",
    "PEER_CALL",
    "PREVIOUS",
    "PREVIOUS_RELEASE",
    "RECORD",
    "RETENTION",
    "RPC_PACKAGE",
    "SHM_FRAMES",
    "UCX_CONTROL",
    "WRITE_FORMATS",
    "Format",
    "NewerFormatError",
]

#: The commit of the release before this one (what the mixed-version test runs beside it).
PREVIOUS_RELEASE = "45561ce"

#: ``cluster.write_formats`` values.
PREVIOUS = "previous"
LATEST = "latest"
WRITE_FORMATS = (PREVIOUS, LATEST)

#: The gRPC package every RPC lives in: fields are only ever added (protobuf ignores unknown
#: ones, so either side of an upgrade reads the other's messages); a change an older reader
#: would misread gets a new package, served beside this one for a release.
RPC_PACKAGE = "kvstore.v1"


@dataclass(frozen=True)
class Format:
    """One shared format: the versions this release reads, the newest one it can write, and
    the newest one the previous release reads (what it writes by default)."""

    name: str
    reads: tuple[int, ...]
    latest: int
    previous: int

    def __post_init__(self) -> None:
        # Declared in the source: a broken table is a programming error.
        if self.latest not in self.reads or self.previous not in self.reads:
            raise ValueError(f"{self.name}: latest and previous must be versions it reads")

    def writes(self, write_formats: str) -> int:
        """The version written under ``cluster.write_formats = write_formats``."""
        if write_formats not in WRITE_FORMATS:
            raise ValueError(
                f"cluster.write_formats must be one of {', '.join(WRITE_FORMATS)}, "
                f"got {write_formats!r}"
            )
        return self.latest if write_formats == LATEST else self.previous

    def is_newer(self, version: int) -> bool:
        """Whether ``version`` is past every version this release reads (a later release's)."""
        return version > max(self.reads)


#: Block headers (:mod:`kvstore.block`): 2 is HMAC-SHA256, 3 keyed BLAKE3 (which the previous
#: release reads and writes, so it is written from the start; ``integrity.mac`` picks 2 or 3).
BLOCK = Format("block header", reads=(2, 3), latest=3, previous=3)
#: Node descriptions (:mod:`kvstore.cluster.records`): 1 without key schemes, 2 with them, 3 with
#: an explicit version and the versions of every format the node reads.
RECORD = Format("node description", reads=(1, 2, 3), latest=3, previous=2)
#: Index entries: ``EPOCH:TIER``; a later version may append ``;``-separated fields, which a
#: reader of version 1 skips (it still learns the tier).
INDEX = Format("index entry", reads=(1,), latest=1, previous=1)

#: The authenticator a node's peer read carries (:mod:`kvstore.node.peer_auth`, gRPC metadata).
PEER_CALL = Format("peer authenticator", reads=(1,), latest=1, previous=1)
#: Control messages over a UCX endpoint (:mod:`kvstore.protocol.ucx_control`), in place of the
#: ``UcxGet`` / ``UcxPut`` gRPC calls. Negotiated per connection (``UcxBind``): a client offers the
#: versions it speaks, the server picks one or answers UNIMPLEMENTED (a release without it), and
#: the client keeps making the gRPC calls then.
UCX_CONTROL = Format("UCX control message", reads=(1,), latest=1, previous=1)
#: Retention records beside the nvme tier's blocks (:mod:`kvstore.tiers.nvme_retention`): node-
#: local, but a downgrade reads them too.
RETENTION = Format("retention record", reads=(1,), latest=1, previous=1)

#: The shared-memory socket's frames (:mod:`kvstore.protocol.shm_frames`, their bodies in
#: :mod:`kvstore.protocol.shm_messages`), the ``version`` of its HELLO reply: node-local (a client
#: and the node on its host), so no node description lists it. A client of one version refuses a
#: node of another and uses gRPC with it, which every release serves.
SHM_FRAMES = Format("shared-memory frames", reads=(3,), latest=3, previous=3)

#: Every format by the name a node description's ``formats`` field gives it.
FORMATS = {
    "block": BLOCK,
    "record": RECORD,
    "index": INDEX,
    "peer_call": PEER_CALL,
    "ucx_control": UCX_CONTROL,
    "retention": RETENTION,
}


class NewerFormatError(Exception):
    """Data in a version of ``fmt`` newer than this release reads: a miss, left where it is.

    Not a corruption: nothing is deleted and its writer is not suspected. (Anyone able to write
    the medium can label bytes with a newer version; that only makes a miss, as deleting would.)
    """

    def __init__(self, fmt: Format, version: int) -> None:
        super().__init__(
            f"{fmt.name} version {version} is newer than this release reads "
            f"({', '.join(map(str, fmt.reads))}): written by a later release; left in place"
        )
        self.format = fmt
        self.version = version
