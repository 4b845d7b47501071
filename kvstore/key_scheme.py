"""One value for how chunks are named: the key scheme every party of a deployment shares.

A chunk key (:mod:`kvstore.keys`) depends on four things: the engine's base namespace (model,
shape, cache layout, tenant: :class:`~kvstore.keys.Namespace`), the chunk size in tokens, the
hash algorithm and the key-derivation secret. The vLLM connector names chunks with them, a node
that watches its engine's own prefix cache names the engine's blocks with them, and the router
names a request's chunks with them to ask the index who holds them. If any party differs in any
of the four, every lookup it makes misses, silently.

So they travel together as one :class:`KeyScheme`: set in one place (the node's ``[keys]``
settings: chunk size and hash algorithm; the namespace is the engine's, declared by its
connector), published by the node in its signed description in the cluster index, and read from
there by the router. The secret itself never travels: a scheme names the environment variable
that holds it (``secret_env``) and carries a keyed fingerprint of it (``secret_check``), so two
parties with different secrets disagree visibly without either learning the other's.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import json
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from kvstore.errors import ConfigError
from kvstore.keys import ChunkHasher, HashAlgorithm, Namespace

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "HASH_ALGORITHMS",
    "HASH_SECRET_ENV",
    "PER_REQUEST_FIELDS",
    "KeyScheme",
    "engine_base",
    "hash_secret",
    "namespace_from_json",
    "namespace_to_json",
    "secret_fingerprint",
]

#: Tokens per chunk unless ``keys.chunk_size`` says otherwise.
DEFAULT_CHUNK_SIZE = 256
#: The accepted ``keys.hash_algorithm`` values.
HASH_ALGORITHMS: tuple[HashAlgorithm, ...] = ("xxh3_128", "sha256")
#: The environment variable that holds the key-derivation secret by default.
HASH_SECRET_ENV = "KVSTORE_HASH_SECRET"
#: Namespace fields filled per request or per rank: never part of an engine-wide base namespace.
PER_REQUEST_FIELDS = frozenset({"lora_id", "cache_salt", "tp_rank"})

_SECRET_CHECK_LABEL = b"kvstore key scheme secret check v1\x00"


def engine_base(namespace: Namespace) -> Namespace:
    """``namespace`` with its per-request fields (:data:`PER_REQUEST_FIELDS`) cleared: the
    engine-wide base a scheme carries (rank 0's, no LoRA adapter, no cache salt)."""
    return dataclasses.replace(namespace, lora_id="", cache_salt="", tp_rank=0)


def namespace_to_json(namespace: Namespace) -> str:
    """``namespace`` as :func:`namespace_from_json` reads it: what an engine's connector logs at
    start, for ``keys.namespace`` (and the deprecated ``router.namespace`` and
    ``cluster.engine_namespace``), and what a key-scheme message carries."""
    fields = {
        name: value
        for name, value in dataclasses.asdict(namespace).items()
        if name not in PER_REQUEST_FIELDS
    }
    return json.dumps(fields, sort_keys=True)


def namespace_from_json(text: str, setting: str) -> Namespace:
    """An engine's rank-0 base namespace from ``setting``'s value: a JSON object of
    :class:`~kvstore.keys.Namespace` fields (what the connector logs at start), without the
    per-request ones. Used by every setting that holds one (``keys.namespace`` and its
    deprecated aliases) and by the key-scheme messages."""
    try:
        fields = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ConfigError(f"{setting}: cannot use {text!r}: not JSON ({exc})") from exc
    if not isinstance(fields, dict):
        raise ConfigError(f"{setting}: cannot use {text!r}: not a JSON object")
    known = {f.name for f in dataclasses.fields(Namespace)} - PER_REQUEST_FIELDS
    unknown = sorted(set(fields) - known)
    if unknown:
        raise ConfigError(f"{setting}: unknown fields {unknown}; known: {sorted(known)}")
    try:
        return Namespace(**fields, tp_rank=0)
    except (ConfigError, TypeError) as exc:
        raise ConfigError(f"{setting}: cannot use {text!r}: {exc}") from exc


def hash_secret(env: Mapping[str, str] | None = None) -> str:
    """The key-derivation secret of processes that name chunks (the vLLM connector's default
    ``secret``): ``$KVSTORE_HASH_SECRET`` of ``env`` (the process environment if ``None``), empty
    when unset. Every replica sharing a store must use the same one. Here, not in the loader: a
    connector process reads it without loading a single config section."""
    return (os.environ if env is None else env).get(HASH_SECRET_ENV, "")


def secret_fingerprint(secret: str | bytes) -> str:
    """A short keyed fingerprint of ``secret`` (16 hex digits of an HMAC over a fixed label): equal
    secrets give equal fingerprints; it reveals nothing usable of the secret but a way to test a
    guess, so a weak secret stays weak (choose a long random one)."""
    key = secret.encode() if isinstance(secret, str) else secret
    return hmac.new(key, _SECRET_CHECK_LABEL, hashlib.sha256).hexdigest()[:16]


@dataclass(frozen=True)
class KeyScheme:
    """How one deployment names chunks.

    Attributes:
        namespace: The engine's rank-0 base namespace (per-request fields empty); ``None`` while
            no engine has declared one (a node before its connector connected).
        chunk_size: Tokens per chunk (a multiple of the engine's block size).
        hash_algorithm: One of :data:`HASH_ALGORITHMS`.
        secret_env: The environment variable that holds the key-derivation secret.
        secret_check: :func:`secret_fingerprint` of that secret as this party has it.
    """

    namespace: Namespace | None = None
    chunk_size: int = DEFAULT_CHUNK_SIZE
    hash_algorithm: HashAlgorithm = "xxh3_128"
    secret_env: str = HASH_SECRET_ENV
    secret_check: str = ""

    def __post_init__(self) -> None:
        if self.chunk_size < 1:
            raise ConfigError(f"keys.chunk_size must be >= 1, got {self.chunk_size}")
        if self.hash_algorithm not in HASH_ALGORITHMS:
            raise ConfigError(
                f"keys.hash_algorithm must be one of {list(HASH_ALGORITHMS)}, "
                f"got {self.hash_algorithm!r}"
            )
        if self.namespace is not None:
            filled = sorted(
                name for name in PER_REQUEST_FIELDS if getattr(self.namespace, name) not in ("", 0)
            )
            if filled:
                raise ConfigError(
                    f"a key scheme's namespace is the engine-wide base: {filled} are filled per "
                    "request or rank and must be empty"
                )

    @classmethod
    def with_secret(
        cls,
        namespace: Namespace | None = None,
        chunk_size: int = DEFAULT_CHUNK_SIZE,
        hash_algorithm: HashAlgorithm = "xxh3_128",
        secret_env: str = HASH_SECRET_ENV,
        env: Mapping[str, str] | None = None,
    ) -> KeyScheme:
        """A scheme whose ``secret_check`` is that of ``$secret_env`` in ``env`` (the process
        environment if ``None``; unset: the empty secret)."""
        secret = (os.environ if env is None else env).get(secret_env, "")
        return cls(namespace, chunk_size, hash_algorithm, secret_env, secret_fingerprint(secret))

    def secret(self, env: Mapping[str, str] | None = None) -> bytes:
        """This party's secret, from ``$secret_env``; :class:`ConfigError` if it does not match
        ``secret_check`` (the variable changed since the scheme was made)."""
        value = (os.environ if env is None else env).get(self.secret_env, "")
        if self.secret_check and secret_fingerprint(value) != self.secret_check:
            raise ConfigError(
                f"${self.secret_env} does not hold the secret this key scheme was made with "
                "(every engine, node and router of a deployment needs the same one)"
            )
        return value.encode()

    def hasher(self, secret: bytes, lora_id: str = "", cache_salt: str = "") -> ChunkHasher:
        """The hasher of one request's chunks (its LoRA adapter and cache salt filled in)."""
        if self.namespace is None:
            raise ConfigError("this key scheme has no namespace yet (no engine declared one)")
        return ChunkHasher(
            self.chunk_size,
            self.namespace.for_request(lora_id, cache_salt),
            secret=secret,
            algorithm=self.hash_algorithm,
        )

    def differences(self, other: KeyScheme) -> list[str]:
        """What differs between two schemes, one short phrase each (empty: they name chunks
        alike). A missing namespace on either side is not a difference."""
        found = []
        if self.chunk_size != other.chunk_size:
            found.append(f"chunk_size {self.chunk_size} vs {other.chunk_size}")
        if self.hash_algorithm != other.hash_algorithm:
            found.append(f"hash_algorithm {self.hash_algorithm} vs {other.hash_algorithm}")
        if self.secret_check and other.secret_check and self.secret_check != other.secret_check:
            found.append(f"secret (${self.secret_env} vs ${other.secret_env} differ)")
        if self.namespace is not None and other.namespace is not None:
            mine, theirs = dataclasses.asdict(self.namespace), dataclasses.asdict(other.namespace)
            found.extend(
                f"namespace.{name} {mine[name]!r} vs {theirs[name]!r}"
                for name in mine
                if mine[name] != theirs[name]
            )
        return found

    def to_json(self) -> str:
        """The scheme as one JSON object (sorted keys), as it is published and read back."""
        fields: dict[str, Any] = {
            "chunk_size": self.chunk_size,
            "hash_algorithm": self.hash_algorithm,
            "secret_env": self.secret_env,
            "secret_check": self.secret_check,
        }
        if self.namespace is not None:
            fields["namespace"] = {
                name: value
                for name, value in dataclasses.asdict(self.namespace).items()
                if name not in PER_REQUEST_FIELDS
            }
        return json.dumps(fields, sort_keys=True, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str | bytes, origin: str) -> KeyScheme:
        """The inverse of :meth:`to_json`; :class:`ConfigError` naming ``origin`` (where the text
        came from) if it is not a valid scheme."""
        try:
            fields = json.loads(text)
            if not isinstance(fields, dict):
                raise ValueError("not a JSON object")
            namespace = fields.get("namespace")
            return cls(
                Namespace(**namespace) if namespace is not None else None,
                int(fields.get("chunk_size", DEFAULT_CHUNK_SIZE)),
                fields.get("hash_algorithm", "xxh3_128"),
                str(fields.get("secret_env", HASH_SECRET_ENV)),
                str(fields.get("secret_check", "")),
            )
        except ConfigError as exc:
            raise ConfigError(f"{origin}: {exc}") from exc
        except (ValueError, TypeError) as exc:
            raise ConfigError(f"{origin}: not a key scheme ({exc})") from exc

    def describe(self) -> str:
        """One line for logs: chunk size, algorithm, model and tenant."""
        where = (
            f" model={self.namespace.model!r} tenant={self.namespace.tenant!r}"
            if self.namespace is not None
            else " (no namespace yet)"
        )
        return f"chunk_size={self.chunk_size} hash={self.hash_algorithm}{where}"
