"""Signed DHT records: every value peerd stores names its publisher and carries that publisher's signature.

A stored value is an envelope ``{"p": payload, "k": public key, "s": signature, "t": member tag,
"e": expiration}``; ``p`` is the payload's JSON, sealed in a private swarm so that only members can read it
(``sealing.py``). The RSA-PSS/SHA-256 signature (by the peer's libp2p identity key, so the signer's peer id
follows from ``k``) covers the DHT key, the subkey, ``p`` and the expiration the value is stored with.
hivemind keeps the value with the latest expiration per subkey; binding the expiration stops anyone from
re-storing an old signed value with a far-future expiration to freeze its publisher's record.

A value is accepted only if every check passes, cheapest first, so that a stranger's junk costs a hash and
an HMAC, never an RSA verification with parameters of its choosing:

1. its fields have the right types and sizes (``MAX_PAYLOAD`` keeps a key's dictionary, one value per
   signer, far below hivemind's 4 MiB message limit: it takes ``MAX_SIGNERS_PER_KEY`` signers to reach it);
2. its subkey is its signer's peer id: one value per signer per key, so no member owns a subkey named after
   something else (an expert's uid) or fills a key with many;
3. its expiration is the one signed and lies at most the key's TTL plus the DHT's clock tolerance ahead
   (``RecordLifetimes``): a record cannot outlive its author by more than one TTL;
4. in a private swarm, its member tag (HMAC under the secret, binding the signer) and the allowlist;
5. its public key is RSA with exponent 65537 and at most ``MAX_MODULUS_BITS`` bits (OpenSSL accepts an
   exponent as long as a 3,072-bit modulus, which makes one verification cost over a hundred times more:
   ``benchmarks/bench_stranger_cpu.py``);
6. its signature; then the payload opens (the seal) and names its signer as ``peer_id``.

Results after step 3 are cached both ways (bounded): a value seen again costs one SHA-256. The same check
runs twice: in the DHT node as a hivemind record validator (``peerd.swarm.validator``), so forged values are
neither stored by our node nor taken from another node's answer and cannot shadow a valid one; and in the
daemon when it opens a value.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import struct
import threading
from collections import Counter, OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import base58
import multihash
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import padding, rsa
from hivemind.dht.routing import DHTID
from hivemind.proto import crypto_pb2
from hivemind.utils.timed_storage import get_dht_time

from peerd.bounded import remember
from peerd.errors import IdentityError, ProtocolViolation
from peerd.swarm.sealing import PayloadSeal
from peerd.wire.membership import Membership

__all__ = ["DROP_REASONS", "MAX_PAYLOAD", "PSS", "RecordLifetimes", "RecordSigner", "RecordVerifier",
           "detached_message", "key_id", "load_public_key", "peer_id_of"]

DROP_REASONS = ("malformed", "foreign_subkey", "expiration_mismatch", "expiration_too_far", "wrong_signer",
                "not_member", "bad_key", "bad_signature")
_LABEL = b"peerd.v1.record"
_TAG_LABEL = b"peerd.v1.record-member"
PSS = padding.PSS(mgf=padding.MGF1(hashes.SHA256()), salt_length=padding.PSS.DIGEST_LENGTH)
_PEER_ID = re.compile(r"[1-9A-HJ-NP-Za-km-z]{32,128}")
MAX_PAYLOAD = 32 * 1024  # of "p" as stored (sealed or not)
MAX_PUBLIC_KEY = 1024
MAX_SIGNATURE = 512
# hivemind answers a lookup with a key's whole dictionary in one message of at most 4 MiB: this many values of
# the largest size fit (envelope and msgpack framing included)
MAX_SIGNERS_PER_KEY = (4 * 2**20) // (MAX_PAYLOAD + MAX_PUBLIC_KEY + MAX_SIGNATURE + 256)
RSA_EXPONENT = 65537
MAX_MODULUS_BITS = 4096
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


def subkey_owner(subkey: str) -> str | None:
    """The peer a subkey belongs to (who alone may sign a value under it): the peer id it is, or None."""
    return subkey if _PEER_ID.fullmatch(subkey) else None


def _associated(key_id_bytes: bytes, subkey: str) -> bytes:
    return len(key_id_bytes).to_bytes(4, "big") + key_id_bytes + subkey.encode()


@dataclass(frozen=True)
class RecordLifetimes:
    """How far ahead of now a value under each DHT key may expire: the TTL its writer stores it with
    (``by_key``, by :func:`key_id`; ``default`` for the rest, matchmaking's round keys) plus ``tolerance``, the
    clock offset the DHT admits between peers. Built from the config by ``peerd.swarm.clock.record_lifetimes``."""

    default: float
    by_key: Mapping[bytes, float] = field(default_factory=dict)
    tolerance: float = 3.0

    def cap(self, key_id_bytes: bytes) -> float:
        return self.by_key.get(key_id_bytes, self.default) + self.tolerance


class RecordSigner:
    """Signs this peer's records with its libp2p identity key (an RSA key in a ``crypto_pb2.PrivateKey``)."""

    def __init__(self, identity: bytes, membership: Membership) -> None:
        try:
            key = serialization.load_der_private_key(crypto_pb2.PrivateKey.FromString(identity).data, None)
        except Exception as e:  # protobuf and cryptography raise several types for foreign bytes
            raise IdentityError(f"not a libp2p RSA private key ({type(e).__name__})") from e
        if not isinstance(key, rsa.RSAPrivateKey):
            raise IdentityError(f"identity key is {type(key).__name__}, peerd signs records with RSA keys")
        numbers = key.public_key().public_numbers()
        if numbers.e != RSA_EXPONENT or key.key_size > MAX_MODULUS_BITS:
            raise IdentityError(f"identity key has exponent {numbers.e} and {key.key_size} bits; peers accept "
                                f"records signed with exponent {RSA_EXPONENT} and at most {MAX_MODULUS_BITS} bits "
                                "(make one with `peerd keygen`)")
        self._key = key
        self._membership = membership
        self._seal = PayloadSeal(membership.secret)
        spki = key.public_key().public_bytes(serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
        self.public_key = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=spki).SerializeToString()
        self.peer_id = peer_id_of(self.public_key)

    def envelope(self, key: str, subkey: str, payload: dict[str, Any], expiration: float) -> dict[str, Any]:
        """The value to store under ``key``/``subkey`` until ``expiration``; payload must be JSON-able and at
        most ``MAX_PAYLOAD`` bytes once sealed (ProtocolViolation naming the key if larger)."""
        key_bytes = key_id(key)
        plain = json.dumps(payload, sort_keys=True, separators=(",", ":"), allow_nan=False).encode()
        data = self._seal.seal(plain, _associated(key_bytes, subkey))
        if len(data) > MAX_PAYLOAD:
            raise ProtocolViolation(f"this peer's value under {key}/{subkey[:140]} is {len(data)} bytes, more than "
                                    f"the {MAX_PAYLOAD} peers accept", peer_id=self.peer_id)
        message = _message(key_bytes, subkey, data, float(expiration))
        signature = self._key.sign(message, PSS, hashes.SHA256())
        tag = self._membership.tag(_TAG_LABEL, self.peer_id.encode(), message)
        return {"p": data, "k": self.public_key, "s": signature, "t": tag, "e": float(expiration)}

    def sign_detached(self, label: bytes, message: bytes) -> bytes:
        """An RSA-PSS signature over ``label`` and ``message`` (outside the DHT: e.g. a signing key's
        certificate), checked by ``peerd.averaging.verify.keys``."""
        return bytes(self._key.sign(detached_message(label, message), PSS, hashes.SHA256()))


def detached_message(label: bytes, message: bytes) -> bytes:
    """What :meth:`RecordSigner.sign_detached` signs."""
    return b"".join(len(part).to_bytes(4, "big") + part for part in (_LABEL + b"/detached", label, message))


@dataclass(frozen=True)
class Opened:
    payload: dict[str, Any]
    signer: str


class RecordVerifier:
    """Checks envelopes; counts rejections by reason (thread-safe: hivemind validates on its own loop).

    ``clock``: DHT time, against which expirations are capped (tests pass their own)."""

    def __init__(self, membership: Membership, lifetimes: RecordLifetimes,
                 clock: Callable[[], float] = get_dht_time) -> None:
        self.membership = membership
        self.lifetimes = lifetimes
        self.clock = clock
        self.dropped: Counter[str] = Counter()
        self._seal = PayloadSeal(membership.secret)
        # digest of (message, key, signature) -> the reason it failed, or None if it passed
        self._verdicts: OrderedDict[bytes, tuple[str, str] | None] = OrderedDict()
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
        data, public_key, signature, tag, signed_expiration = _fields(subkey, value)
        where = f"value under {subkey[:140]!r}"
        owner = subkey_owner(subkey)
        if owner is None:
            raise _reject("foreign_subkey", f"{where}: a subkey must be its signer's peer id", None)
        if signed_expiration != expiration:
            raise _reject("expiration_mismatch", f"{where} stored with expiration {expiration}, signed for "
                          f"{signed_expiration}", subkey)
        ahead, cap = expiration - self.clock(), self.lifetimes.cap(key_id_bytes)
        if ahead > cap:
            raise _reject("expiration_too_far", f"{where} expires in {ahead:.0f} s, more than the {cap:g} s "
                          "this peer allows for its key (the key's TTL plus the DHT's clock tolerance; peers of "
                          "a swarm must agree on their TTLs)", subkey)
        signer = peer_id_of(public_key)
        if signer != owner:
            raise _reject("wrong_signer", f"{where} is signed by {signer}, not the peer its subkey names", subkey)
        message = _message(key_id_bytes, subkey, data, expiration)
        digest = hashlib.sha256(message + public_key + signature + tag).digest()
        with self._lock:
            known = digest in self._verdicts
            verdict = self._verdicts.get(digest)
            if known:
                self._verdicts.move_to_end(digest)
        if not known:
            verdict = self._check(message, public_key, signature, tag, signer)
            with self._lock:
                remember(self._verdicts, digest, verdict, CACHE_SIZE)
        if verdict is not None:
            raise _reject(verdict[0], f"{where}: {verdict[1]}", signer)
        plain = self._seal.open(data, _associated(key_id_bytes, subkey))
        try:
            payload = None if plain is None else json.loads(plain)
        except (UnicodeDecodeError, ValueError, RecursionError):  # deep nesting fits in MAX_PAYLOAD
            payload = None
        if not isinstance(payload, dict):
            raise _reject("malformed", f"{where}: payload is not a sealed JSON object", signer)
        if payload.get("peer_id") != signer:
            raise _reject("wrong_signer", f"{where} describes {str(payload.get('peer_id'))[:128]} but is "
                          f"signed by {signer}", signer)
        return Opened(payload, signer)

    def _check(self, message: bytes, public_key: bytes, signature: bytes, tag: bytes,
               signer: str) -> tuple[str, str] | None:
        """The costly checks, cheapest first: (reason, explanation) of the first that fails, or None."""
        if not self.membership.admits(signer) or not self.membership.check_tag(
                tag, _TAG_LABEL, signer.encode(), message):
            return "not_member", f"signed by {signer}, not a member of this swarm"
        key = load_public_key(public_key)
        if key is None:
            return "malformed", "not an RSA public key"
        problem = key_problem(key)
        if problem is not None:
            return "bad_key", problem
        try:
            key.verify(signature, message, PSS, hashes.SHA256())
        except InvalidSignature:
            return "bad_signature", f"signature by {signer} does not verify"
        return None

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {reason: self.dropped[reason] for reason in (*DROP_REASONS, *self.dropped)}


def key_problem(key: rsa.RSAPublicKey) -> str | None:
    """Why a value signed with ``key`` is refused unverified, or None: the exponent and size honest keys have,
    so that no signer chooses what a verification costs."""
    exponent, bits = key.public_numbers().e, key.key_size
    if exponent != RSA_EXPONENT or bits > MAX_MODULUS_BITS:
        return (f"signed with an RSA key of exponent {str(exponent)[:20]} and {bits} bits (peers accept exponent "
                f"{RSA_EXPONENT} and at most {MAX_MODULUS_BITS} bits)")
    return None


@functools.lru_cache(maxsize=4096)  # a swarm has few keys; parsing DER costs more than a cached check
def load_public_key(serialized: bytes) -> rsa.RSAPublicKey | None:
    try:
        proto = crypto_pb2.PublicKey.FromString(serialized)
        key = serialization.load_der_public_key(proto.data)
    except Exception:  # noqa: BLE001 (protobuf and cryptography raise several types for foreign bytes)
        return None
    return key if proto.key_type == crypto_pb2.RSA and isinstance(key, rsa.RSAPublicKey) else None


def _fields(subkey: str, value: object) -> tuple[bytes, bytes, bytes, bytes, float]:
    if not isinstance(value, dict):
        raise _reject("malformed", f"value under {subkey[:140]!r} is not a signed record", None)
    data, public_key, signature = value.get("p"), value.get("k"), value.get("s")
    tag, expiration = value.get("t"), value.get("e")
    if not (isinstance(data, bytes) and len(data) <= MAX_PAYLOAD
            and isinstance(public_key, bytes) and len(public_key) <= MAX_PUBLIC_KEY
            and isinstance(signature, bytes) and len(signature) <= MAX_SIGNATURE
            and isinstance(tag, bytes) and len(tag) <= 64 and isinstance(expiration, float)):
        raise _reject("malformed", f"value under {subkey[:140]!r} is not a well-formed signed record", None)
    return data, public_key, signature, tag, expiration


def _reject(reason: str, message: str, peer: str | None) -> ProtocolViolation:
    return ProtocolViolation(message, peer_id=peer or "unknown", reason=reason)
