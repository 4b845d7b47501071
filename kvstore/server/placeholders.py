"""Credentials that are public, refused wherever a server would trust them.

An example that ships a token or a secret gets deployed with it: a server started with the old
``k8s/base`` example accepted its published token and served blocks MAC'd under its published
integrity secret. So a server refuses, with a :class:`ConfigError` naming the setting, any bearer
token (``auth.tokens_file``, stored hashed: compared by digest) or integrity secret
(``integrity.secrets``, ``integrity.secret_file``) that is one of :data:`PUBLIC_VALUES`, and any
integrity secret that still says it is a placeholder (``REPLACE-ME``, ``CHANGE-ME``...). The k8s
example now generates its credentials at deploy time (``k8s/generate-secrets.sh``).
"""

from __future__ import annotations

import hashlib

from kvstore.errors import ConfigError

__all__ = ["PUBLIC_VALUES", "check_secret", "check_token_digest"]

#: Values published in this repository's examples, and where.
PUBLIC_VALUES = {
    "example-token-REPLACE-ME": "the token of the old k8s/base/kustomization.yaml",
    "example-integrity-secret-REPLACE-ME": "the integrity secret of the old k8s/base example",
}
# What a value copied from a template still says (compared case-insensitively, '_' as '-').
_MARKERS = ("replace-me", "change-me", "changeme", "placeholder")
_DIGESTS = {hashlib.sha256(value.encode()).digest(): value for value in PUBLIC_VALUES}
_GENERATE = "generate one, e.g. `openssl rand -hex 32` (k8s: k8s/generate-secrets.sh)"


def check_token_digest(digest: bytes, where: str) -> None:
    """Refuse a token whose SHA-256 ``digest`` is that of a public value; ``where`` names the
    setting, file and line."""
    public = _DIGESTS.get(digest)
    if public is not None:
        raise ConfigError(
            f"{where}: this is the hash of the public token {public!r} "
            f"({PUBLIC_VALUES[public]}); anyone may present it. Replace it: {_GENERATE}, and "
            "list its sha256"
        )


def check_secret(secret: bytes, where: str) -> None:
    """Refuse an integrity secret that is public or a placeholder; ``where`` names the setting
    (and the secret's place in it), never the value of a secret that is not public."""
    text = secret.decode(errors="replace")
    if text in PUBLIC_VALUES:
        raise ConfigError(
            f"{where}: {text!r} is {PUBLIC_VALUES[text]}, public: anyone could sign blocks this "
            f"server accepts. Replace it: {_GENERATE}"
        )
    folded = text.lower().replace("_", "-")
    if any(marker in folded for marker in _MARKERS):
        raise ConfigError(
            f"{where}: the secret is a placeholder (it says replace-me / change-me / "
            f"placeholder), not a secret. Replace it: {_GENERATE}"
        )
