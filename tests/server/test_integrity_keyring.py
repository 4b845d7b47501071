"""Where a server's integrity secrets come from (:mod:`kvstore.server.integrity`)."""

from __future__ import annotations

import stat
from pathlib import Path

import pytest

from kvstore.block import CorruptBlockError, Keyring, decode_value, encode_header
from kvstore.config import Config, load_config
from kvstore.errors import ConfigError
from kvstore.server.integrity import load_keyring

KEY, NS, PAYLOAD = bytes(range(16)), bytes(16), b"payload" * 100


def config(**env: str) -> Config:
    return load_config(env={"KVSTORE_DRAM_CAPACITY": "1MiB", **env})


def signs_alike(one: Keyring, two: Keyring) -> bool:
    value = encode_header(KEY, NS, PAYLOAD, one) + PAYLOAD
    try:
        decode_value(KEY, value, two)
    except CorruptBlockError:
        return False
    return True


def test_generated_secret_file_is_private_and_kept(tmp_path: Path) -> None:
    nvme = tmp_path / "data" / "nvme"
    first = load_keyring(config(KVSTORE_NVME_PATH=str(nvme)))
    key_file = nvme / "integrity.key"
    assert stat.S_IMODE(nvme.stat().st_mode) == 0o700
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    assert len(key_file.read_text().strip()) == 64
    again = load_keyring(config(KVSTORE_NVME_PATH=str(nvme)))
    assert signs_alike(first, again)


def test_secrets_setting_wins_and_rotates(tmp_path: Path) -> None:
    old = load_keyring(config(KVSTORE_INTEGRITY_SECRETS="old"))
    both = load_keyring(config(KVSTORE_INTEGRITY_SECRETS="new, old"))
    new = load_keyring(config(KVSTORE_INTEGRITY_SECRETS="new"))
    assert signs_alike(old, both) and not signs_alike(old, new) and signs_alike(both, new)
    with pytest.raises(ConfigError, match=r"integrity\.secrets"):
        config(KVSTORE_INTEGRITY_SECRETS="a,,b")


def test_secret_file_must_exist_and_be_private(tmp_path: Path) -> None:
    path = tmp_path / "secret"
    missing = config(KVSTORE_INTEGRITY_SECRET_FILE=str(path))
    with pytest.raises(ConfigError, match=r"integrity\.secret_file: cannot open"):
        load_keyring(missing)
    path.write_text("new\nold\n")
    path.chmod(0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        load_keyring(missing)
    path.chmod(0o600)
    from_file = load_keyring(missing)
    assert signs_alike(from_file, load_keyring(config(KVSTORE_INTEGRITY_SECRETS="new")))
    path.write_text("\n\n")
    with pytest.raises(ConfigError, match="holds no secret"):
        load_keyring(missing)


def test_without_nvme_a_random_secret_per_process() -> None:
    one = load_keyring(config(KVSTORE_NVME_PATH=""))
    two = load_keyring(config(KVSTORE_NVME_PATH=""))
    assert not signs_alike(one, two)


def test_a_tenant_ring_verifies_only_its_own_blocks_and_keeps_rotation() -> None:
    key, namespace, payload = b"k" * 16, b"n" * 16, b"payload" * 100
    old, new = Keyring([b"old"]), Keyring([b"new", b"old"])
    value = encode_header(key, namespace, payload, old.for_tenant("a")) + payload
    decode_value(key, value, new.for_tenant("a"))  # rotated: the old secret still verifies
    for other in (old.for_tenant("b"), old, Keyring([b"new"]).for_tenant("a")):
        with pytest.raises(CorruptBlockError):
            decode_value(key, value, other)


def test_fingerprints_name_each_secret_without_revealing_it() -> None:
    old, rotated = Keyring([b"old-secret"]), Keyring([b"new-secret", b"old-secret"])
    (old_print,) = old.fingerprints()
    assert rotated.fingerprints()[1] == old_print  # the same secret, the same fingerprint
    assert rotated.fingerprints()[0] != old_print  # the first signs: listed first
    assert len(old_print) == 16 and int(old_print, 16) >= 0
    assert Keyring([b"old-secret"]).fingerprints() == [old_print]  # stable across processes
    # A tenant's ring is bound to its name: other fingerprints, as other MACs.
    assert old.for_tenant("a").fingerprints() != [old_print]
    assert old.for_tenant("a").fingerprints() != old.for_tenant("b").fingerprints()
    assert b"old-secret".hex() not in old_print


def test_mac_setting_picks_the_version_new_blocks_are_signed_with() -> None:
    blake = load_keyring(config(KVSTORE_INTEGRITY_SECRETS="s"))
    hmac_ring = load_keyring(
        config(KVSTORE_INTEGRITY_SECRETS="s", KVSTORE_INTEGRITY_MAC="hmac-sha256")
    )
    assert blake.sign_version == 3 and hmac_ring.sign_version == 2
    assert blake.for_tenant("a").sign_version == 3
    assert hmac_ring.for_tenant("a").sign_version == 2
    assert encode_header(KEY, NS, PAYLOAD, hmac_ring)[4:6] == b"\x02\x00"
    # Either node reads what the other wrote: a cluster can move from one to the other.
    assert signs_alike(blake, hmac_ring) and signs_alike(hmac_ring, blake)
    with pytest.raises(ConfigError, match=r"integrity\.mac must be one of blake3, hmac-sha256"):
        config(KVSTORE_INTEGRITY_MAC="sha1")
