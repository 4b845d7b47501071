"""Nodes sharing a Redis tier find out at start whether they can read each other's blocks.

Every node sharing a Redis needs the same integrity secrets. Two nodes started with the defaults
each generate their own ``integrity.key``: without this check each reads the other's blocks as
MAC failures (misses), while its lookups promise them, and nothing says why.

So before a store opens its shared tier, the node joins a record of keyrings kept in Redis
beside its blocks (a sorted set at ``redis.key_prefix + "keyring"``, per tenant under the
tenant's prefix). One entry per live node::

    kvstore-keyring-v1 NODE-ID HOST SIGN-FINGERPRINT FINGERPRINT,FINGERPRINT,...

where a fingerprint is :meth:`kvstore.block.Keyring.fingerprints` (a keyed digest of a fixed
label; never the secret). A Lua script does the join atomically, so of two nodes that start at
the same moment exactly one sees the other: it drops expired entries, reads at most
:data:`MAX_ENTRIES` others, and adds this node's entry only where the node shares at least one
secret with each of them (rotation: a ring of several secrets is compatible with every node that
lists one of them). Entries expire :data:`TTL_S` after their node's last refresh (every
:data:`REFRESH_S`) and a node that stops removes its own.

What a node does with the answer (:class:`Verdict`):

* **shares a secret with every node there**: it joins, and says so in one INFO line; where it
  cannot verify another node's signing secret (or they its own: a rotation done out of order)
  one WARNING line says which;
* **shares no secret with a node already there**: one ERROR line naming ``integrity.secrets``,
  and the store opens *without* its shared tier (local tiers only). Its lookups then never
  promise a block its reads would refuse, it writes nothing the others would refuse, and it
  publishes nothing, so the nodes already there are not disturbed. It stays so until it is
  restarted with the secrets the others use. Refusing to start instead would let anyone able to
  write a record into Redis (or a crashed node's record, until it expires) stop a node from
  serving its own tiers at all;
* **Redis did not answer**: one WARNING line, the shared tier opens as before, and the refresh
  joins once Redis answers; a mismatch found then is one ERROR line (the tier stays: a running
  store does not drop a tier), and the blocks it cannot verify are misses counted in the redis
  tier's ``corrupt_blocks``.

Entries are claims, not proofs: anyone able to write to Redis can add one. The worst one can do
is keep a newly started node off the shared tier, no more than such a writer can do by deleting
the blocks. Unparseable entries are ignored.
"""

from __future__ import annotations

import asyncio
import logging
import os
import re
import socket
from dataclasses import dataclass, field
from typing import Any

from redis.asyncio import Redis
from redis.asyncio.cluster import RedisCluster
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import RedisClusterException, RedisError

from kvstore.block import Keyring
from kvstore.tiers.base import Tier
from kvstore.tiers.redis import RedisTier

__all__ = [
    "MAX_ENTRIES",
    "REFRESH_S",
    "TTL_S",
    "KeyringRecord",
    "Peer",
    "Verdict",
    "check_shared_keyring",
    "record_key",
]

logger = logging.getLogger(__name__)

#: Seconds an entry outlives its node's last refresh.
TTL_S = 30.0
#: Seconds between refreshes of a live node's entry.
REFRESH_S = 10.0
#: Most entries of other nodes one join reads (bounded work, whatever Redis holds).
MAX_ENTRIES = 256
# What "Redis did not answer (or refused)" looks like; the cluster client's bootstrap errors are
# not RedisErrors.
_FAILURES = (RedisError, RedisClusterException, OSError, TimeoutError)
# Seconds the join at start may take: Redis is asked once, and the refresh tries again later.
_START_TIMEOUT_S = 2.0
_TAG = "kvstore-keyring-v1"
_MAX_ENTRY_CHARS = 4096
_ENTRY = re.compile(rf"^{_TAG} (\S+) (\S+) (\S+) (\S+)$")

# KEYS[1]: the record; ARGV: this node's entry, TTL in ms, MAX_ENTRIES, its fingerprints (comma).
# Redis's own clock dates every entry, so hosts' clocks need not agree.
_JOIN = """
if redis.replicate_commands then redis.replicate_commands() end
local t = redis.call('TIME')
local now = tonumber(t[1]) * 1000 + math.floor(tonumber(t[2]) / 1000)
local ttl = tonumber(ARGV[2])
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
local entries = redis.call('ZRANGE', KEYS[1], 0, tonumber(ARGV[3]) - 1)
local mine = {}
for fp in string.gmatch(ARGV[4], '[^,]+') do mine[fp] = true end
local ok = 1
for _, entry in ipairs(entries) do
  if entry ~= ARGV[1] and #entry <= @MAX@ then
    local theirs = string.match(entry, '^@TAG@ %S+ %S+ %S+ (%S+)$')
    if theirs then
      local shared = false
      for fp in string.gmatch(theirs, '[^,]+') do
        if mine[fp] then shared = true end
      end
      if not shared then ok = 0 end
    end
  end
end
if ok == 1 then
  redis.call('ZADD', KEYS[1], now + ttl, ARGV[1])
  redis.call('PEXPIRE', KEYS[1], 2 * ttl)
end
return {ok, entries}
""".replace("@MAX@", str(_MAX_ENTRY_CHARS)).replace("@TAG@", _TAG.replace("-", "%-"))


def record_key(key_prefix: str) -> str:
    """The Redis key of the keyring record under ``key_prefix`` (block names there are hex)."""
    return key_prefix + "keyring"


@dataclass(frozen=True)
class Peer:
    """Another node's published keyring: where it runs and its fingerprints (first signs)."""

    host: str
    #: The fingerprint of the secret it signs new blocks with.
    signs: str
    fingerprints: tuple[str, ...]


@dataclass
class Verdict:
    """What joining the record found (``reached`` False: Redis did not answer, or refused)."""

    reached: bool
    #: Why the comparison failed (where Redis did not answer, or refused the script).
    error: str = ""
    joined: bool = False
    #: Nodes this one shares no secret with (it did not join).
    mismatched: list[Peer] = field(default_factory=list)
    #: Nodes it shares a secret with, where one side cannot verify the other's signing secret.
    partial: list[Peer] = field(default_factory=list)
    others: int = 0


class KeyringRecord:
    """This node's entry in one Redis tier's keyring record (one per tenant with a shared tier).

    :meth:`join` once at start; :meth:`start` keeps the entry alive; :meth:`close` removes it.
    """

    def __init__(
        self, url: str, key_prefix: str, keyring: Keyring, *, tenant: str = "", where: str = ""
    ) -> None:
        self.url = url
        self.key = record_key(key_prefix)
        self.tenant = tenant
        self._fingerprints = keyring.fingerprints()
        host = _tame(f"{socket.gethostname()[:64]}:{os.getpid()}")
        #: How log lines name this shared tier (the URL without credentials, the prefix).
        self.where = where or f"{_redacted(url)} (key prefix {key_prefix!r})"
        # SIGN-FINGERPRINT is the first of the ring, listed again so the entry reads alone.
        self.entry = (
            f"{_TAG} {os.urandom(6).hex()} {host} {self._fingerprints[0]} "
            f"{','.join(self._fingerprints)}"
        )
        self._client: Redis | RedisCluster | None = None
        self._task: asyncio.Task[None] | None = None
        self.joined = False
        #: Nodes on the tier whose keyring shares no secret with this one, as last seen
        #: (``keyring_mismatched_nodes`` in ``Stats``, ``kvstore_shared_keyring_mismatched_nodes``).
        self.mismatched = 0
        #: True where the store opened without its shared tier for that reason.
        self.detached = False
        self._reported: set[tuple[str, ...]] = set()

    @property
    def fingerprint(self) -> str:
        """The fingerprint of this node's signing secret."""
        return self._fingerprints[0]

    async def join(self, timeout_s: float = _START_TIMEOUT_S) -> Verdict:
        """Compare with the nodes already recorded and join where compatible (one round trip,
        bounded by ``timeout_s``); :meth:`report` says what it found."""
        try:
            client = self._client or _client(self.url, timeout_s)
            self._client = client
            reply = await asyncio.wait_for(
                client.eval(
                    _JOIN,
                    1,
                    self.key,
                    self.entry,
                    str(round(TTL_S * 1000)),
                    str(MAX_ENTRIES),
                    ",".join(self._fingerprints),
                ),
                timeout_s,
            )
        except _FAILURES as exc:
            return Verdict(reached=False, error=f"{type(exc).__name__}: {exc}")
        verdict = self._judge(reply)
        self.joined = self.joined or verdict.joined
        self.mismatched = len(verdict.mismatched)
        return verdict

    def _judge(self, reply: Any) -> Verdict:
        ok, entries = reply
        mine = set(self._fingerprints)
        verdict = Verdict(reached=True, joined=int(ok) == 1)
        for raw in entries:
            entry = raw.decode(errors="replace") if isinstance(raw, bytes) else str(raw)
            if entry == self.entry or len(entry) > _MAX_ENTRY_CHARS:
                continue
            match = _ENTRY.match(entry)
            if match is None:
                continue
            fingerprints = tuple(match.group(4).split(","))
            # Anyone able to write to Redis wrote these: only tame characters reach the log.
            peer = Peer(_tame(match.group(2)), _tame(match.group(3)), fingerprints)
            verdict.others += 1
            if not mine & set(fingerprints):
                verdict.mismatched.append(peer)
            elif match.group(3) not in mine or self.fingerprint not in fingerprints:
                verdict.partial.append(peer)
        return verdict

    def start(self) -> None:
        """Refresh the entry every :data:`REFRESH_S` seconds until :meth:`close`."""
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(
                self._refresh(), name="kvstore-keyring-record"
            )

    async def _refresh(self) -> None:
        while True:
            await asyncio.sleep(REFRESH_S)
            joined_before = self.joined
            verdict = await self.join(timeout_s=_START_TIMEOUT_S)
            if not verdict.reached:
                logger.debug("keyring record %s: redis did not answer; next try later", self.key)
                continue
            if not verdict.mismatched and verdict.joined and not joined_before:
                self.report(verdict)  # the comparison Redis did not answer at start
            if verdict.mismatched:
                # Found only now (Redis was unreachable at start, or our entry expired while
                # it was): the tier stays open, so say what the misses are, once per set.
                seen = tuple(sorted(peer.signs for peer in verdict.mismatched))
                if seen not in self._reported:
                    self._reported.add(seen)
                    logger.error("%s", self.mismatch_line(verdict, detached=False))

    async def close(self) -> None:
        """Stop refreshing and remove this node's entry (best effort: it expires anyway)."""
        task, self._task = self._task, None
        if task is not None:
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        client, self._client = self._client, None
        if client is None:
            return
        try:
            if self.joined:
                await asyncio.wait_for(client.zrem(self.key, self.entry), _START_TIMEOUT_S)
        except _FAILURES as exc:
            logger.debug("removing keyring entry %s failed: %s", self.key, exc)
        try:
            await asyncio.wait_for(client.aclose(), _START_TIMEOUT_S)
        except _FAILURES as exc:
            logger.debug("closing the keyring record's redis client failed: %s", exc)

    # -- what the log says ---------------------------------------------------------------

    def _who(self) -> str:
        return f"tenant {self.tenant}: " if self.tenant else ""

    def mismatch_line(self, verdict: Verdict, *, detached: bool) -> str:
        """The one line for a node that shares no secret with nodes already on the tier."""
        theirs = ", ".join(f"{p.host} signs {p.signs}" for p in verdict.mismatched[:4])
        more = len(verdict.mismatched) - 4
        if more > 0:
            theirs += f" and {more} more"
        consequence = (
            "running WITHOUT the shared tier (local tiers only) so that lookups promise no "
            "block this node would refuse"
            if detached
            else "their blocks are misses here and ours there (redis corrupt_blocks)"
        )
        return (
            f"{self._who()}integrity.secrets: this node's keyring (signs {self.fingerprint}) "
            f"shares no secret with {len(verdict.mismatched)} node(s) already on the shared "
            f"tier {self.where} ({theirs}): {consequence}; give every node sharing this Redis "
            "the same integrity.secrets (or integrity.secret_file, or a copy of the first "
            "node's nvme integrity.key) and restart this node"
        )

    def report(self, verdict: Verdict) -> None:
        """Log what :meth:`join` found at start, in one line."""
        if not verdict.reached:
            logger.warning(
                "%sintegrity keyring not compared with the other nodes on the shared tier %s "
                "(%s); the shared tier opens as before and the comparison is tried again every "
                "%.0f s",
                self._who(),
                self.where,
                verdict.error,
                REFRESH_S,
            )
            return
        if verdict.mismatched:
            logger.error("%s", self.mismatch_line(verdict, detached=True))
            return
        if verdict.partial:
            names = ", ".join(f"{p.host} signs {p.signs}" for p in verdict.partial[:4])
            logger.warning(
                "%sintegrity.secrets: this node's keyring (signs %s, verifies %s) shares a secret "
                "with every node on the shared tier %s, but not every signing secret (%s): new "
                "blocks one side signs are misses on the other until every node lists the same "
                "secrets (to rotate, add the new secret second everywhere, then move it first)",
                self._who(),
                self.fingerprint,
                ",".join(self._fingerprints),
                self.where,
                names,
            )
            return
        logger.info(
            "%sintegrity keyring (signs %s) matches the %d other node(s) on the shared tier %s",
            self._who(),
            self.fingerprint,
            verdict.others,
            self.where,
        )


async def check_shared_keyring(
    tiers: list[Tier], keyring: Keyring, tenant: str = ""
) -> tuple[list[Tier], KeyringRecord | None]:
    """Join the keyring record of the shared tier among ``tiers`` (none: nothing to do).

    Returns the tiers the store should open, without the shared one where this node shares no
    secret with the nodes already on it (see the module docstring; the record then says
    :attr:`~KeyringRecord.detached` and publishes nothing), and the record (``None`` without a
    shared tier); logs the outcome in one line.
    """
    shared = next((tier for tier in tiers if isinstance(tier, RedisTier)), None)
    if shared is None:
        return tiers, None
    record = KeyringRecord(shared.url, shared.key_prefix, keyring, tenant=tenant)
    verdict = await record.join()
    record.report(verdict)
    if verdict.reached and not verdict.joined:
        record.detached = True
        await record.close()
        await shared.close()
        return [tier for tier in tiers if tier is not shared], record
    record.start()
    return tiers, record


def _tame(text: str) -> str:
    """``text`` with anything but letters, digits and ``._:-`` replaced, at most 80 characters."""
    return re.sub(r"[^A-Za-z0-9._:-]", "_", text[:80])


def _redacted(url: str) -> str:
    """``url`` without user name and password (they must never reach a log)."""
    return re.sub(r"//[^@/]*@", "//", url)


def _client(url: str, timeout_s: float) -> Redis | RedisCluster:
    """A client for a ``redis.url`` (the schemes :class:`~kvstore.tiers.redis.RedisTier` takes),
    one attempt per command, nothing longer than ``timeout_s``."""
    options: dict[str, Any] = {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
    }
    for scheme in ("redis+cluster://", "rediss+cluster://"):
        if url.startswith(scheme):
            plain = scheme.replace("+cluster", "")
            return RedisCluster.from_url(plain + url[len(scheme) :], **options)
    return Redis.from_url(url, **options)
