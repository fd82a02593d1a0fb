"""Record payloads that only members can read: sealed under a key derived from the swarm secret.

In a private swarm (one with a secret) the payload of every stored value is encrypted with AES-256-GCM, so
a stranger who asks the DHT for a key gets ciphertext instead of peer ids, addresses, steps, experts and
groups. The signature covers the sealed bytes, so anyone can still check who wrote a value (a third member
weighing evidence needs no secret for that); the member tag and the seal both need the secret.

Each value gets a fresh 16-byte salt and 12-byte nonce. The salt picks a one-off key, HMAC-SHA256 of the
salt under the master key (HKDF of the secret): with a random 96-bit nonce alone, NIST's bound of 2^32
messages per key would be reached by a 64-peer swarm in about half a year of records. The DHT key and
subkey are the associated data, so a sealed payload moved to another key or subkey does not open.
An allowlist without a secret has no key to seal with: payloads stay readable (``docs/security.md``, the threat model).
"""

from __future__ import annotations

import hashlib
import hmac
import secrets

from cryptography.exceptions import InvalidTag
from cryptography.hazmat.primitives import hashes
from cryptography.hazmat.primitives.ciphers.aead import AESGCM
from cryptography.hazmat.primitives.kdf.hkdf import HKDF

__all__ = ["OVERHEAD", "PayloadSeal"]

_INFO = b"peerd.v1.record-payload"
SALT_BYTES = 16
NONCE_BYTES = 12
TAG_BYTES = 16
OVERHEAD = SALT_BYTES + NONCE_BYTES + TAG_BYTES


class PayloadSeal:
    """Seals and opens payloads under ``secret``; with no secret (an open swarm) both return the bytes as
    they are."""

    def __init__(self, secret: bytes | None) -> None:
        self._master = None if secret is None else HKDF(
            algorithm=hashes.SHA256(), length=32, salt=None, info=_INFO).derive(secret)

    @property
    def sealing(self) -> bool:
        return self._master is not None

    def _cipher(self, salt: bytes) -> AESGCM:
        assert self._master is not None
        return AESGCM(hmac.new(self._master, salt, hashlib.sha256).digest())

    def seal(self, data: bytes, associated: bytes) -> bytes:
        if self._master is None:
            return data
        salt, nonce = secrets.token_bytes(SALT_BYTES), secrets.token_bytes(NONCE_BYTES)
        return salt + nonce + self._cipher(salt).encrypt(nonce, data, associated)

    def open(self, sealed: bytes, associated: bytes) -> bytes | None:
        """The payload, or None if ``sealed`` was not sealed under this secret for ``associated``."""
        if self._master is None:
            return sealed
        if len(sealed) < OVERHEAD:
            return None
        salt, nonce = sealed[:SALT_BYTES], sealed[SALT_BYTES:SALT_BYTES + NONCE_BYTES]
        try:
            return self._cipher(salt).decrypt(nonce, sealed[SALT_BYTES + NONCE_BYTES:], associated)
        except InvalidTag:
            return None
