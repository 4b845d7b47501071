"""A node's description in the cluster index, signed: the record every reader of the index
(a router, a peer) parses and verifies.

Anyone able to write to the index Redis can write a node's description, so the node signs it: a
MAC (:func:`record_keyring`, a key derived from the cluster's integrity secrets, which a rogue
without them cannot make) over its id, boot epoch, addresses, capacity and an expiry
(:data:`RECORD_VALID_S` ahead, re-signed by the node's renewals once half of it is gone). A reader
holding the secrets (:meth:`NodeInfo.verified`) ignores a description without a valid MAC, one
whose fields were changed (an address pointed elsewhere, a record copied to another node id or
kept from an earlier boot) and one that expired (a record replayed long after). Nodes' clocks
must agree within a fraction of :data:`RECORD_VALID_S`. The node agent that writes and renews it
is :mod:`kvstore.node.membership`.

**Key schemes.** Since record v2 a description also carries the key schemes the node serves
(``keys``: a JSON list of :meth:`kvstore.key_scheme.KeyScheme.to_json`), under the MAC, so a
router names chunks the way the nodes do and nobody without the secrets can make it name them
otherwise. A v2 description is signed under another label than a v1 one: a v1 reader refuses it
(its MAC does not verify) rather than mis-read it, and dropping ``keys`` from a v2 description
does not pass it off as v1. A v1 description (no ``keys`` field) still parses, with no schemes.

**Versions** (:data:`kvstore.formats.RECORD`). Since record v3 a description names its version
(``v``) and the versions of every shared format the node reads (``formats``: a JSON object,
format name → list of versions), both under the MAC and another label again. A node writes the
version ``cluster.write_formats`` picks (v2, which the previous release reads, until the fleet is
upgraded). A description whose ``v`` is newer than this release reads raises
:class:`~kvstore.formats.NewerFormatError`, not :class:`RecordError`: its node runs a later
release, which is not the same as a forged record (nor is it deleted: nobody deletes another
node's description).
"""

from __future__ import annotations

import dataclasses
import json
import time
from collections.abc import Mapping
from dataclasses import dataclass, field

from kvstore.block import Keyring
from kvstore.formats import FORMATS, RECORD, NewerFormatError

__all__ = ["RECORD_VALID_S", "NodeInfo", "RecordError", "reads_now", "record_keyring"]

#: How long a signed description stays valid at least (longer with a long ``lease_ttl_s``).
RECORD_VALID_S = 120.0
_RECORD_LABEL_V1 = b"kvstore node record v1\x00"
_RECORD_LABEL = b"kvstore node record v2\x00"
_RECORD_LABEL_V3 = b"kvstore node record v3\x00"


def reads_now() -> dict[str, tuple[int, ...]]:
    """What a v3 description written by this release says its node reads."""
    return {name: fmt.reads for name, fmt in FORMATS.items()}


def record_keyring(keyring: Keyring) -> Keyring:
    """The key nodes sign their descriptions with, from the cluster's integrity ``keyring``."""
    return keyring.derive(b"node record")


class RecordError(Exception):
    """A node description that does not verify (the message says why)."""


@dataclass(frozen=True)
class NodeInfo:
    """What a node says about itself in the index."""

    node_id: str
    epoch: int
    #: The gRPC target clients dial.
    grpc: str
    #: The UCX data path's address ("" without one).
    ucx: str = ""
    #: Bytes per tier name.
    capacity: Mapping[str, int] = field(default_factory=dict)
    #: Unix time (ms) after which the signed description is no longer believed (0: unsigned).
    expires_ms: int = 0
    #: The key schemes the node serves, each a :meth:`KeyScheme.to_json` text (``None``: a v1
    #: description, from before nodes published them).
    keys: tuple[str, ...] | None = ()
    #: The description's version (:data:`kvstore.formats.RECORD`): 1 and 2 are told apart by
    #: ``keys``; 3 names itself and carries :attr:`formats`.
    version: int = RECORD.previous
    #: Since v3: per shared format, the versions the node reads (empty in v1 and v2).
    formats: Mapping[str, tuple[int, ...]] = field(default_factory=dict)

    def fields(self) -> dict[str, str]:
        """The hash fields stored under :meth:`Layout.node` (unsigned)."""
        fields = {
            "epoch": str(self.epoch),
            "grpc": self.grpc,
            "ucx": self.ucx,
            "capacity": json.dumps(dict(self.capacity)),
        }
        if self.keys is not None:
            fields["keys"] = json.dumps(list(self.keys))
        if self.version >= 3 and self.keys is not None:
            fields["v"] = str(self.version)
            fields["formats"] = json.dumps(self._formats())
        return fields

    def _formats(self) -> dict[str, list[int]]:
        return {name: sorted(versions) for name, versions in sorted(self.formats.items())}

    def signed(self, ring: Keyring, expires_ms: int) -> dict[str, str]:
        """:meth:`fields` valid until ``expires_ms``, with their MAC under ``ring`` (a
        :func:`record_keyring`)."""
        info = dataclasses.replace(self, expires_ms=expires_ms)
        mac = ring.sign(info._message(), ())
        return {**info.fields(), "expires_ms": str(expires_ms), "mac": mac.hex()}

    def _message(self) -> bytes:
        described = [
            self.node_id,
            self.epoch,
            self.grpc,
            self.ucx,
            sorted(dict(self.capacity).items()),
            self.expires_ms,
        ]
        if self.keys is None:  # v1, whatever version says: it had neither
            return _RECORD_LABEL_V1 + json.dumps(described, separators=(",", ":")).encode()
        described.append(list(self.keys))
        if self.version == 2:
            return _RECORD_LABEL + json.dumps(described, separators=(",", ":")).encode()
        if self.version != 3:
            raise ValueError(f"no node description version {self.version}")
        described.append(self._formats())
        return _RECORD_LABEL_V3 + json.dumps(described, separators=(",", ":")).encode()

    @classmethod
    def parse(cls, node_id: str, raw: Mapping[bytes, bytes]) -> NodeInfo:
        """The inverse of :meth:`fields` (nothing verified: see :meth:`verified`);
        :class:`~kvstore.formats.NewerFormatError` for a version this release does not read."""
        text = {k.decode(): v.decode() for k, v in raw.items()}
        version = int(text["v"]) if "v" in text else (2 if "keys" in text else 1)
        if RECORD.is_newer(version):
            raise NewerFormatError(RECORD, version)
        if "v" in text and version < 3:
            raise ValueError(f"a v{version} description names no version")
        formats: dict[str, tuple[int, ...]] = {}
        if version >= 3:
            listed_formats = json.loads(text.get("formats", "{}"))
            if not isinstance(listed_formats, dict) or not all(
                isinstance(v, list) and all(isinstance(i, int) for i in v)
                for v in listed_formats.values()
            ):
                raise ValueError("formats is not an object of version lists")
            formats = {str(name): tuple(v) for name, v in listed_formats.items()}
        keys = None
        if "keys" in text:
            listed = json.loads(text["keys"])
            if not isinstance(listed, list) or not all(isinstance(k, str) for k in listed):
                raise ValueError("keys is not a list of strings")
            keys = tuple(listed)
        return cls(
            node_id,
            int(text.get("epoch", "0")),
            text.get("grpc", ""),
            text.get("ucx", ""),
            json.loads(text.get("capacity", "{}")),
            int(text.get("expires_ms", "0")),
            keys,
            version,
            formats,
        )

    @classmethod
    def verified(
        cls, node_id: str, raw: Mapping[bytes, bytes], ring: Keyring, now: float | None = None
    ) -> NodeInfo:
        """The description stored under ``node_id`` if a node holding ``ring``'s secret signed
        exactly it for that id and it has not expired; :class:`RecordError` otherwise
        (:class:`~kvstore.formats.NewerFormatError`: written by a later release)."""
        try:
            info = cls.parse(node_id, raw)
            mac = bytes.fromhex(raw.get(b"mac", b"").decode())
            message = info._message()
        except (ValueError, TypeError, AttributeError, UnicodeDecodeError) as exc:
            raise RecordError(f"malformed description ({exc})") from exc
        if not mac:
            raise RecordError("unsigned description")
        if not ring.verify(message, (), mac):
            raise RecordError(
                "its MAC does not verify (signed under other integrity secrets, or changed)"
            )
        now_ms = (time.time() if now is None else now) * 1000
        if info.expires_ms <= now_ms:
            raise RecordError(f"it expired {(now_ms - info.expires_ms) / 1000:.0f}s ago")
        return info
