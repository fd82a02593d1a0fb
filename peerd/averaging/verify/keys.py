"""Signing keys and what members sign in a round.

Every round message a member signs (its seal over a contribution, a reducer's statement and averaged chunks,
a member's samples) is signed with a per-daemon Ed25519 key: ~0.1 ms a signature, where the libp2p identity
key (RSA) takes ~1 ms. The signing key is bound to the peer id once, by an RSA signature of the identity key
over it (the certificate in :class:`~peerd.proto.peerd_averaging_pb2.Credentials`). The credentials travel with
what they sign, so a third member checks evidence against a peer it never talked to, and a peer cannot show
different keys to different members.

A signature covers blake3 of a label and the signed fields, each length-prefixed, so no field can run into the
next and no message of one kind can pass for another.
"""

from __future__ import annotations

import struct
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol, TypeVar

import blake3
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey
from google.protobuf.message import DecodeError, Message

from peerd.bounded import remember
from peerd.errors import ProtocolViolation
from peerd.proto import peerd_averaging_pb2 as pb
from peerd.swarm.signing import (
    MAX_PUBLIC_KEY,
    MAX_SIGNATURE,
    PSS,
    detached_message,
    load_public_key,
    peer_id_of,
)

__all__ = ["Identity", "KeyBook", "SigningKey", "digest", "f64", "open_signed", "u64"]

CERTIFICATE = b"peerd.v1.averaging.signing-key"
SIGNATURE_BYTES = 64
KEY_BYTES = 32
KEYBOOK_SIZE = 4096


def verify_detached(public_key: bytes, label: bytes, message: bytes, signature: bytes) -> str:
    """The peer id of ``public_key`` if ``signature`` is its ``RecordSigner.sign_detached`` over ``label`` and
    ``message``; ProtocolViolation otherwise."""
    if len(public_key) > MAX_PUBLIC_KEY or len(signature) > MAX_SIGNATURE:
        raise ProtocolViolation("detached signature or key too large", peer_id="unknown", reason="malformed")
    key = load_public_key(public_key)
    if key is None:
        raise ProtocolViolation("not an RSA public key", peer_id="unknown", reason="malformed")
    signer = peer_id_of(public_key)
    try:
        key.verify(signature, detached_message(label, message), PSS, hashes.SHA256())
    except InvalidSignature:
        raise ProtocolViolation(f"signature claiming signer {signer} does not verify", peer_id=signer,
                                reason="bad_signature") from None
    return signer


class Identity(Protocol):
    """A peer's libp2p identity: what certifies its signing key (``peerd.swarm.signing.RecordSigner``)."""

    peer_id: str
    public_key: bytes

    def sign_detached(self, label: bytes, message: bytes) -> bytes: ...


def u64(value: int) -> bytes:
    return struct.pack(">Q", value)


def f64(value: float) -> bytes:
    return struct.pack(">d", value)


def digest(*parts: bytes | str) -> bytes:
    """blake3 of the length-prefixed ``parts`` (strings as UTF-8): 32 bytes."""
    hasher = blake3.blake3()
    for part in parts:
        data = part.encode() if isinstance(part, str) else part
        hasher.update(len(data).to_bytes(8, "big"))
        hasher.update(data)
    return hasher.digest()


class SigningKey:
    """This daemon's signing key for round messages, with the credentials that bind it to ``identity``."""

    def __init__(self, identity: Identity) -> None:
        self._key = Ed25519PrivateKey.generate()
        raw = self._key.public_key().public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)
        self.peer_id = identity.peer_id
        self.credentials = pb.Credentials(identity_key=identity.public_key, signing_key=raw,
                                          certificate=identity.sign_detached(CERTIFICATE, raw))

    def sign(self, label: bytes, *parts: bytes | str) -> bytes:
        return self._key.sign(digest(label, *parts))


class KeyBook:
    """Signing keys whose certificates checked out (an RSA verify each, so cached; bounded, least recent out).
    Thread-safe: proofs are checked in worker threads."""

    def __init__(self, size: int = KEYBOOK_SIZE) -> None:
        self.size = size
        self._keys: OrderedDict[tuple[bytes, bytes], tuple[str, Ed25519PublicKey]] = OrderedDict()
        self._lock = threading.Lock()

    def key_of(self, credentials: pb.Credentials, peer: str) -> Ed25519PublicKey:
        """``peer``'s signing key from ``credentials``; ProtocolViolation unless they are ``peer``'s."""
        entry = (bytes(credentials.identity_key), bytes(credentials.signing_key))
        with self._lock:
            known = self._keys.get(entry)
            if known is not None:
                self._keys.move_to_end(entry)
        if known is None:
            if len(entry[1]) != KEY_BYTES:
                raise ProtocolViolation(f"credentials of {peer}: signing key of {len(entry[1])} bytes",
                                        peer_id=peer)
            try:
                owner = verify_detached(entry[0], CERTIFICATE, entry[1], bytes(credentials.certificate))
            except ProtocolViolation as e:
                raise ProtocolViolation(f"credentials of {peer}: {e.message}", peer_id=peer) from None
            known = (owner, Ed25519PublicKey.from_public_bytes(entry[1]))
            with self._lock:
                remember(self._keys, entry, known, self.size)
        owner, key = known
        if owner != peer:
            raise ProtocolViolation(f"credentials for {owner} presented as {peer}'s", peer_id=peer)
        return key

    def valid(self, credentials: pb.Credentials, peer: str, signature: bytes, label: bytes,
              *parts: bytes | str) -> bool:
        """Whether ``signature`` is ``peer``'s over ``label`` and ``parts`` (False for foreign credentials)."""
        if len(signature) != SIGNATURE_BYTES:
            return False
        try:
            self.key_of(credentials, peer).verify(signature, digest(label, *parts))
        except (ProtocolViolation, InvalidSignature):
            return False
        return True


M = TypeVar("M", bound=Message)


def open_signed(signed: pb.Signed, kind: type[M], max_bytes: int, signer: str, label: bytes,
                credentials: Callable[[M], pb.Credentials], keys: KeyBook,
                bad: Callable[[str], ProtocolViolation]) -> M:
    """The ``kind`` message ``signed`` carries, once its size, its encoding and ``signer``'s signature over it (by
    the ``credentials`` it holds) check out, in that order, cheapest first; else ``bad(reason)`` is raised."""
    if len(signed.body) > max_bytes:
        raise bad("too large")
    try:
        message: M = kind.FromString(signed.body)  # protobuf's runtime is untyped
    except DecodeError:
        raise bad("malformed") from None
    if not keys.valid(credentials(message), signer, signed.signature, label, signed.body):
        raise bad("signature or credentials do not check out")
    return message
