"""Signed DHT records: every value peerd stores names its publisher and carries that publisher's signature.

A stored value is an envelope ``{"p": payload JSON bytes, "k": public key, "s": signature, "t": member tag,
"e": expiration}``. The RSA-PSS/SHA-256 signature (by the peer's libp2p identity key, so the signer's peer id
follows from ``k``) covers the DHT key, the subkey, the payload bytes and the expiration the value is stored
with. hivemind keeps the value with the latest expiration per subkey; binding the expiration stops anyone
from re-storing an old signed value with a far-future expiration to freeze its publisher's record.

A value is accepted only if it is well formed, its signature is valid, its signer is the peer it describes
(the payload's ``peer_id``, and a subkey naming a peer: ``<peer id>`` or ``<name>:<peer id>``), and, in a
private swarm, the signer holds the secret (the tag) and is admitted by the allowlist. The same check runs
twice: in the DHT child process as a hivemind record validator (``peerd.swarm.validator``), so forged values
are neither stored by our node nor taken from another node's answer and cannot shadow a valid one; and in
the daemon when it opens a value, which is cheap because successful checks are cached.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import struct
import threading
from collections import Counter, OrderedDict
from dataclasses import dataclass
from typing import Any

import base58
import multihash
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.dht.routing import DHTID
from hivemind.proto import crypto_pb2

from peerd.errors import IdentityError, ProtocolViolation
from peerd.wire.membership import Membership

__all__ = ["DROP_REASONS", "RecordSigner", "RecordVerifier", "key_id", "peer_id_of", "verify_detached"]

DROP_REASONS = ("malformed", "expiration_mismatch", "wrong_signer", "bad_signature", "not_member")
_LABEL = b"peerd.v1.record"
_TAG_LABEL = b"peerd.v1.record-member"
_PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.DIGEST_LENGTH)
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{32,128}")
MAX_PAYLOAD = 64 * 1024
MAX_PUBLIC_KEY = 1024
MAX_SIGNATURE = 512
CACHE_SIZE = 8192


def key_id(key: str) -> bytes:
    """The DHT's own id of ``key``: what the record validator in the DHT process sees instead of the key."""
    return bytes(DHTID.generate(source=key).to_bytes())


@functools.lru_cache(maxsize=4096)  # base58 in pure Python dominates a cached check otherwise
def peer_id_of(public_key: bytes) -> str:
    """libp2p peer id of a serialized ``crypto_pb2.PublicKey`` (sha2-256 multihash, base58)."""
    digest = multihash.encode(hashlib.sha256(public_key).digest(), multihash.coerce_code("sha2-256"))
    return str(base58.b58encode(digest).decode())


def _message(key_id_bytes: bytes, subkey: str, payload: bytes, expiration: float) -> bytes:
    parts = (_LABEL, key_id_bytes, subkey.encode(), payload, struct.pack(">d", expiration))
    return b"".join(len(part).to_bytes(4, "big") + part for part in parts)


def _subkey_owner(subkey: str) -> str | None:
    name = subkey.rsplit(":", 1)[-1]
    return name if _PEER_ID.fullmatch(name) else None


class RecordSigner:
    """Signs this peer's records with its libp2p identity key (an RSA key in a ``crypto_pb2.PrivateKey``)."""

    def __init__(self, identity: bytes, membership: Membership) -> None:
        try:
            key = serialization.load_der_private_key(crypto_pb2.PrivateKey.FromString(identity).data, None)
        except Exception as e:  # protobuf and cryptography raise several types for foreign bytes
            raise IdentityError(f"not a libp2p RSA private key ({type(e).__name__})") from e
        if not isinstance(key, rsa.RSAPrivateKey):
            raise IdentityError(f"identity key is {type(key).__name__}, peerd signs records with RSA keys")
        self._key = key
        self._membership = membership
        spki = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        self.public_key = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=spki).SerializeToString()
        self.peer_id = peer_id_of(self.public_key)

    def envelope(self, key: str, subkey: str, payload: dict[str, Any], expiration: float) -> dict[str, Any]:
        """The value to store under ``key``/``subkey`` until ``expiration``; payload must be JSON-able."""
        data = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
        message = _message(key_id(key), subkey, data, float(expiration))
        signature = self._key.sign(message, _PSS, hashes.SHA256())
        tag = self._membership.tag(_TAG_LABEL, self.peer_id.encode(), message)
        return {"p": data, "k": self.public_key, "s": signature, "t": tag, "e": float(expiration)}

    def sign_detached(self, label: bytes, message: bytes) -> bytes:
        """An RSA-PSS signature over ``label`` and ``message`` (outside the DHT: e.g. a signing key's
        certificate), checked by :func:`verify_detached`."""
        return bytes(self._key.sign(_detached(label, message), _PSS, hashes.SHA256()))


def _detached(label: bytes, message: bytes) -> bytes:
    return b"".join(len(part).to_bytes(4, "big") + part for part in (_LABEL + b"/detached", label, message))


def verify_detached(public_key: bytes, label: bytes, message: bytes, signature: bytes) -> str:
    """The peer id of ``public_key`` if ``signature`` is its :meth:`RecordSigner.sign_detached` over ``label``
    and ``message``; ProtocolViolation otherwise."""
    if len(public_key) > MAX_PUBLIC_KEY or len(signature) > MAX_SIGNATURE:
        raise ProtocolViolation("detached signature or key too large", peer_id="unknown", reason="malformed")
    key = _public_key(public_key)
    if key is None:
        raise ProtocolViolation("not an RSA public key", peer_id="unknown", reason="malformed")
    signer = peer_id_of(public_key)
    try:
        key.verify(signature, _detached(label, message), _PSS, hashes.SHA256())
    except InvalidSignature:
        raise ProtocolViolation(f"signature claiming signer {signer} does not verify", peer_id=signer,
                                reason="bad_signature") from None
    return signer


@dataclass(frozen=True)
class Opened:
    payload: dict[str, Any]
    signer: str


class RecordVerifier:
    """Checks envelopes; counts rejections by reason (thread-safe: hivemind validates on its own loop)."""

    def __init__(self, membership: Membership) -> None:
        self.membership = membership
        self.dropped: Counter[str] = Counter()
        self._verified: OrderedDict[bytes, str] = OrderedDict()  # digest of (message, key, sig) -> signer
        self._lock = threading.Lock()

    def open(self, key_id_bytes: bytes, subkey: str, value: object, expiration: float) -> Opened:
        """The payload and signer of a valid envelope; ProtocolViolation with ``reason`` (counted) if not."""
        try:
            return self._open(key_id_bytes, subkey, value, expiration)
        except ProtocolViolation as e:
            self.count(str(e.context.get("reason", "malformed")))
            raise

    def count(self, reason: str) -> None:
        with self._lock:
            self.dropped[reason] += 1

    def _open(self, key_id_bytes: bytes, subkey: str, value: object, expiration: float) -> Opened:
        fields = _fields(subkey, value)
        data, public_key, signature, tag, signed_expiration = fields
        claimed = _subkey_owner(subkey)
        if signed_expiration != expiration:
            raise _reject("expiration_mismatch", f"value under {subkey[:140]!r} stored with expiration "
                          f"{expiration}, signed for {signed_expiration}", claimed)
        try:
            payload = json.loads(data)
        except (UnicodeDecodeError, ValueError, RecursionError):  # deep nesting fits in MAX_PAYLOAD
            payload = None
        if not isinstance(payload, dict):
            raise _reject("malformed", f"value under {subkey[:140]!r}: payload is not a JSON object", claimed)
        key = _public_key(public_key)
        if key is None:
            raise _reject("malformed", f"value under {subkey[:140]!r}: not an RSA public key", claimed)
        signer = peer_id_of(public_key)
        described = payload.get("peer_id")
        if described != signer or claimed not in (None, signer):
            raise _reject("wrong_signer", f"value under {subkey[:140]!r} describes "
                          f"{str(described)[:128]} but is signed by {signer}", claimed or signer)
        message = _message(key_id_bytes, subkey, data, expiration)
        digest = hashlib.sha256(message + public_key + signature).digest()
        with self._lock:
            cached = digest in self._verified
            if cached:
                self._verified.move_to_end(digest)
        if not cached:
            self._verify(key, signature, message, signer)
            with self._lock:
                self._verified[digest] = signer
                if len(self._verified) > CACHE_SIZE:
                    self._verified.popitem(last=False)
        if not self.membership.admits(signer) or not self.membership.check_tag(
                tag, _TAG_LABEL, signer.encode(), message):
            raise _reject("not_member", f"value under {subkey[:140]!r} is signed by {signer}, not a member "
                          "of this swarm", signer)
        return Opened(payload, signer)

    @staticmethod
    def _verify(key: rsa.RSAPublicKey, signature: bytes, message: bytes, signer: str) -> None:
        try:
            key.verify(signature, message, _PSS, hashes.SHA256())
        except InvalidSignature:
            raise _reject("bad_signature", f"value claiming signer {signer}: signature does not verify",
                          signer) from None

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {reason: self.dropped[reason] for reason in (*DROP_REASONS, *self.dropped)}


@functools.lru_cache(maxsize=4096)  # a swarm has few keys; parsing DER costs more than a cached check
def _public_key(serialized: bytes) -> rsa.RSAPublicKey | None:
    try:
        proto = crypto_pb2.PublicKey.FromString(serialized)
        key = serialization.load_der_public_key(proto.data)
    except Exception:  # noqa: BLE001 (protobuf and cryptography raise several types for foreign bytes)
        return None
    return key if proto.key_type == crypto_pb2.RSA and isinstance(key, rsa.RSAPublicKey) else None


def _fields(subkey: str, value: object) -> tuple[bytes, bytes, bytes, bytes, float]:
    if not isinstance(value, dict):
        raise _reject("malformed", f"value under {subkey[:140]!r} is not a signed record", _subkey_owner(subkey))
    data, public_key, signature = value.get("p"), value.get("k"), value.get("s")
    tag, expiration = value.get("t"), value.get("e")
    if not (isinstance(data, bytes) and len(data) <= MAX_PAYLOAD
            and isinstance(public_key, bytes) and len(public_key) <= MAX_PUBLIC_KEY
            and isinstance(signature, bytes) and len(signature) <= MAX_SIGNATURE
            and isinstance(tag, bytes) and len(tag) <= 64 and isinstance(expiration, float)):
        raise _reject("malformed", f"value under {subkey[:140]!r} is not a well-formed signed record",
                      _subkey_owner(subkey))
    return data, public_key, signature, tag, expiration


def _reject(reason: str, message: str, peer: str | None) -> ProtocolViolation:
    return ProtocolViolation(message, peer_id=peer or "unknown", reason=reason)
