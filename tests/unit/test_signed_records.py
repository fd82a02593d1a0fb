"""Signed DHT records: forgeries of every kind are refused and counted, cheapest check first; good records pass
(in the daemon's reader and in the DHT process's hivemind validator); payloads are sealed in a private swarm;
and matchmaking takes groups only from its leader."""

from __future__ import annotations

import asyncio
import logging
import math
import secrets
import time
from collections.abc import Callable
from typing import Any

import pytest
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.validation import DHTRecord
from hivemind.proto import crypto_pb2
from hivemind.utils.serializer import MSGPackSerializer

from peerd.averaging.matchmaking import Matchmaker
from peerd.config import AveragingConfig
from peerd.errors import GroupFailed, ProtocolViolation
from peerd.log import RateLimitedLog
from peerd.swarm import signing
from peerd.swarm.identity import generate_identity
from peerd.swarm.latency import LatencyWindow
from peerd.swarm.sealing import PayloadSeal
from peerd.swarm.signing import RecordLifetimes, RecordSigner, RecordVerifier, key_id, peer_id_of
from peerd.swarm.validator import SignedRecordValidator
from peerd.wire.membership import Membership

pytestmark = pytest.mark.timeout(60)

KEY = "run.peers"
EXPIRATION = 1_900_000_000.25
NOW = EXPIRATION - 10.0  # the verifiers' clock: EXPIRATION is 10 s ahead
LIFETIMES = RecordLifetimes(default=30.0, by_key={key_id(KEY): 20.0}, tolerance=3.0)
OPEN = Membership()
SECRET = b"s" * 32


@pytest.fixture(scope="module")
def keys(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    """Three identities: a and b are honest peers, c a stranger."""
    directory = tmp_path_factory.mktemp("keys")
    out = {}
    for name in "abc":
        generate_identity(directory / name)
        out[name] = (directory / name).read_bytes()
    return out


def signer(keys: dict[str, bytes], name: str, membership: Membership = OPEN) -> RecordSigner:
    return RecordSigner(keys[name], membership)


def verifier(membership: Membership = OPEN) -> RecordVerifier:
    return RecordVerifier(membership, LIFETIMES, clock=lambda: NOW)


def payload(peer_id: str, **extra: Any) -> dict[str, Any]:
    return {"peer_id": peer_id, "state": "idle", "updated_at": 5.0, **extra}


def refused(verifier: RecordVerifier, subkey: str, value: object, expiration: float = EXPIRATION,
            key: str = KEY) -> str:
    with pytest.raises(ProtocolViolation) as caught:
        verifier.open(key_id(key), subkey, value, expiration)
    return str(caught.value.context["reason"])


def signed_bytes(by: RecordSigner, subkey: str, data: bytes, expiration: float = EXPIRATION) -> dict[str, Any]:
    """An envelope whose payload bytes are ``data`` as they are, validly signed by ``by``: a member gone bad."""
    message = signing._message(key_id(KEY), subkey, data, expiration)
    return {"p": data, "k": by.public_key, "s": by._key.sign(message, signing.PSS, hashes.SHA256()),
            "t": by._membership.tag(signing._TAG_LABEL, by.peer_id.encode(), message), "e": expiration}


def costly_key(modulus_bits: int, exponent_bits: int) -> tuple[bytes, str]:
    """A libp2p public key with a modulus and a public exponent of these sizes (exponent 65537 if 17): what a
    stranger chooses to make every verification expensive. Returns it serialized, with its peer id."""
    modulus = rsa.generate_private_key(65537, modulus_bits).private_numbers().public_numbers.n
    exponent = 65537 if exponent_bits == 17 else secrets.randbits(exponent_bits) | 1 | 1 << (exponent_bits - 1)
    der = rsa.RSAPublicNumbers(exponent, modulus).public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    serialized = crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString()
    return serialized, peer_id_of(serialized)


def test_a_good_record_opens_with_its_signer_and_payload(keys: dict[str, bytes]) -> None:
    a = signer(keys, "a")
    check = verifier()
    value = MSGPackSerializer.loads(MSGPackSerializer.dumps(a.envelope(KEY, a.peer_id, payload(a.peer_id), EXPIRATION)))
    for _ in range(2):  # the second time from the cache
        opened = check.open(key_id(KEY), a.peer_id, value, EXPIRATION)
        assert opened.signer == a.peer_id and opened.payload == payload(a.peer_id)
    assert sum(check.counts().values()) == 0


def test_wrong_signer_is_refused_and_counted(keys: dict[str, bytes]) -> None:
    a, c = signer(keys, "a"), signer(keys, "c")
    check = verifier()
    # the stranger signs a record describing peer a, under a's subkey
    assert refused(check, a.peer_id, c.envelope(KEY, a.peer_id, payload(a.peer_id), EXPIRATION)) == "wrong_signer"
    # ... or describes itself but stores it under a's subkey (to displace a's record)
    assert refused(check, a.peer_id, c.envelope(KEY, a.peer_id, payload(c.peer_id), EXPIRATION)) == "wrong_signer"
    # ... or signs, under its own subkey, a payload that describes a
    assert refused(check, c.peer_id, c.envelope(KEY, c.peer_id, payload(a.peer_id), EXPIRATION)) == "wrong_signer"
    assert check.counts()["wrong_signer"] == 3


def test_one_subkey_per_signer_per_key(keys: dict[str, bytes]) -> None:
    """A subkey is its signer's peer id and nothing else: no member owns a subkey named after something else
    (an expert's uid, another leader's decision) or fills a key with many values of its own."""
    a = signer(keys, "a")
    check = verifier()
    for subkey in ("ffn.0.3", f"groups:{a.peer_id}", f"-{a.peer_id}", f"{a.peer_id}:2", ""):
        assert refused(check, subkey, a.envelope(KEY, subkey, payload(a.peer_id), EXPIRATION)) == "foreign_subkey"
    assert check.counts()["foreign_subkey"] == 5
    # so a key's dictionary, one value per signer of at most MAX_PAYLOAD, stays far below hivemind's 4 MiB
    assert signing.MAX_SIGNERS_PER_KEY >= 100
    with pytest.raises(ProtocolViolation, match="more than"):
        a.envelope(KEY, a.peer_id, payload(a.peer_id, pad="x" * signing.MAX_PAYLOAD), EXPIRATION)


def test_bad_signatures_are_refused_and_counted(keys: dict[str, bytes]) -> None:
    a, c = signer(keys, "a"), signer(keys, "c")
    check = verifier()
    good = a.envelope(KEY, a.peer_id, payload(a.peer_id), EXPIRATION)
    tampered = {**good, "p": good["p"].replace(b"idle", b"gone")}
    assert refused(check, a.peer_id, tampered) == "bad_signature"
    stolen_key = {**c.envelope(KEY, a.peer_id, payload(a.peer_id), EXPIRATION), "k": a.public_key}
    assert refused(check, a.peer_id, stolen_key) == "bad_signature"
    # a signature is bound to its DHT key: a's peer record replayed as a's progress record
    assert refused(check, a.peer_id, good, key="run.progress") == "bad_signature"
    assert check.counts()["bad_signature"] == 3


def test_restored_with_another_expiration_is_refused_and_counted(keys: dict[str, bytes]) -> None:
    a = signer(keys, "a")
    check = verifier()
    good = a.envelope(KEY, a.peer_id, payload(a.peer_id), EXPIRATION)
    assert refused(check, a.peer_id, good, expiration=EXPIRATION + 5) == "expiration_mismatch"
    # claiming the new expiration inside the envelope too breaks the signature instead
    assert refused(check, a.peer_id, {**good, "e": EXPIRATION + 5}, expiration=EXPIRATION + 5) == "bad_signature"
    assert check.counts()["expiration_mismatch"] == 1


def test_expirations_beyond_the_ttl_and_clock_tolerance_are_refused(keys: dict[str, bytes]) -> None:
    """A member's record signed to expire in 30 years would outlive it: only the key's TTL plus the DHT's clock
    tolerance ahead of now is believed (20 + 3 s for KEY, 30 + 3 s for the others)."""
    a = signer(keys, "a")
    check = verifier()
    for ahead, key, ok in [(23.0, KEY, True), (23.5, KEY, False), (33.0, "run.rounds.7", True),
                           (33.5, "run.rounds.7", False), (30 * 365 * 86400.0, KEY, False), (math.inf, KEY, False)]:
        value = a.envelope(key, a.peer_id, payload(a.peer_id), NOW + ahead)
        if ok:
            assert check.open(key_id(key), a.peer_id, value, NOW + ahead).signer == a.peer_id
        else:
            assert refused(check, a.peer_id, value, NOW + ahead, key=key) == "expiration_too_far"
    assert check.counts()["expiration_too_far"] == 4


@pytest.mark.parametrize(("mangle", "reason"), [
    (lambda good: "not a record", "malformed"),
    (lambda good: {k: v for k, v in good.items() if k != "s"}, "malformed"),
    (lambda good: {**good, "e": 7}, "malformed"),
    (lambda good: {**good, "p": b"x" * (signing.MAX_PAYLOAD + 1)}, "malformed"),
    (lambda good: {**good, "k": b"junk"}, "wrong_signer"),  # another key is another signer
    (lambda good: {**good, "p": b"[1, 2]"}, "bad_signature"),  # payloads open only once the signature holds
])
def test_malformed_values_are_refused_and_counted(keys: dict[str, bytes],
                                                  mangle: Callable[[dict[str, Any]], object], reason: str) -> None:
    a = signer(keys, "a")
    check = verifier()
    good = a.envelope(KEY, a.peer_id, payload(a.peer_id), EXPIRATION)
    assert refused(check, a.peer_id, mangle(good)) == reason
    assert check.counts()[reason] == 1


@pytest.mark.parametrize("data", [b"[1, 2]", b"\xff\xfe", b"[" * 30_000, b'{"peer_id": 1}'])
def test_a_members_signed_junk_payload_is_malformed(keys: dict[str, bytes], data: bytes) -> None:
    a = signer(keys, "a")
    check = verifier()
    reason = refused(check, a.peer_id, signed_bytes(a, a.peer_id, data))
    assert reason == ("wrong_signer" if data.startswith(b"{") else "malformed")


def test_private_swarm_refuses_valid_signatures_of_non_members(keys: dict[str, bytes]) -> None:
    member = Membership(secret=SECRET)
    a, c_without_secret = signer(keys, "a", member), signer(keys, "c")
    c_wrong_secret = signer(keys, "c", Membership(secret=b"t" * 32))
    check = verifier(member)
    assert check.open(key_id(KEY), a.peer_id, a.envelope(KEY, a.peer_id, payload(a.peer_id), EXPIRATION),
                      EXPIRATION).signer == a.peer_id
    for c in (c_without_secret, c_wrong_secret):
        value = c.envelope(KEY, c.peer_id, payload(c.peer_id), EXPIRATION)
        assert refused(check, c.peer_id, value) == "not_member"
    assert verifier().open(key_id(KEY), c_without_secret.peer_id, c_without_secret.envelope(
        KEY, c_without_secret.peer_id, payload(c_without_secret.peer_id), EXPIRATION), EXPIRATION)
    # an allowlist without a secret: a valid signature by a peer not on the list
    b = signer(keys, "b")
    listed = verifier(Membership(allowlist=frozenset({a.peer_id})))
    assert refused(listed, b.peer_id, b.envelope(KEY, b.peer_id, payload(b.peer_id), EXPIRATION)) == "not_member"
    assert check.counts()["not_member"] == 2 and listed.counts()["not_member"] == 1


def test_keys_that_make_verification_costly_are_refused_unverified(keys: dict[str, bytes]) -> None:
    """An exponent as long as the modulus (3,071 bits, what OpenSSL allows at 3,072) or a modulus over 4,096
    bits is refused before any verification; in a private swarm a stranger's record fails the member tag first.
    The stranger need not even sign: a garbage signature costs the same full verification."""
    for modulus_bits, exponent_bits in [(3072, 3071), (2048, 2047), (6144, 17)]:
        public_key, peer = costly_key(modulus_bits, exponent_bits)
        value = {"p": b"{}", "k": public_key, "s": secrets.token_bytes(min(512, modulus_bits // 8 - 1)), "t": b"",
                 "e": EXPIRATION}
        assert refused(verifier(), peer, value) == "bad_key"
        assert refused(verifier(Membership(secret=SECRET)), peer, value) == "not_member"
    a = signer(keys, "a")  # an honest key (2048 bits, exponent 65537) passes the same check
    assert signing.key_problem(signing.load_public_key(a.public_key)) is None  # type: ignore[arg-type]


def test_verdicts_are_cached_both_ways(keys: dict[str, bytes], monkeypatch: pytest.MonkeyPatch) -> None:
    """A value seen again (hivemind validates a whole dictionary on every answer) costs a hash, not another
    verification, whether it passed or failed; the cache is bounded."""
    a = signer(keys, "a")
    check = verifier()
    calls: list[str] = []
    honest = RecordVerifier._check

    def counted(self: RecordVerifier, *args: Any) -> Any:
        calls.append(args[-1])
        return honest(self, *args)

    monkeypatch.setattr(RecordVerifier, "_check", counted)
    monkeypatch.setattr(signing, "CACHE_SIZE", 4)
    good = a.envelope(KEY, a.peer_id, payload(a.peer_id), EXPIRATION)
    forged = {**good, "p": good["p"].replace(b"idle", b"gone")}
    for _ in range(3):
        check.open(key_id(KEY), a.peer_id, good, EXPIRATION)
        assert refused(check, a.peer_id, forged) == "bad_signature"
    assert len(calls) == 2 and check.counts()["bad_signature"] == 3
    for i in range(6):
        check.open(key_id(KEY), a.peer_id, a.envelope(KEY, a.peer_id, payload(a.peer_id, i=i), EXPIRATION), EXPIRATION)
    assert len(check._verdicts) == 4


def test_private_payloads_are_sealed_and_open_only_where_they_were_stored(keys: dict[str, bytes]) -> None:
    member = Membership(secret=SECRET)
    a = signer(keys, "a", member)
    value = a.envelope(KEY, a.peer_id, payload(a.peer_id, maddrs=["/ip4/10.1.2.3/tcp/4001"]), EXPIRATION)
    assert b"10.1.2.3" not in value["p"] and a.peer_id.encode() not in value["p"] and b"idle" not in value["p"]
    assert verifier(member).open(key_id(KEY), a.peer_id, value, EXPIRATION).payload["maddrs"] == [
        "/ip4/10.1.2.3/tcp/4001"]
    seal = PayloadSeal(SECRET)
    sealed = seal.seal(b"payload", b"key+subkey")
    assert seal.open(sealed, b"key+subkey") == b"payload"
    assert seal.open(sealed, b"key+another") is None  # moved to another key or subkey
    assert PayloadSeal(b"t" * 32).open(sealed, b"key+subkey") is None  # another swarm's secret
    assert seal.seal(b"payload", b"k") != seal.seal(b"payload", b"k")  # a fresh salt and nonce each time
    # a member's record whose seal does not open under our secret (validly signed and tagged) is malformed
    stranger_seal = RecordSigner(keys["b"], member)
    stranger_seal._seal = PayloadSeal(b"t" * 32)
    b_value = stranger_seal.envelope(KEY, stranger_seal.peer_id, payload(stranger_seal.peer_id), EXPIRATION)
    assert refused(verifier(member), stranger_seal.peer_id, b_value) == "malformed"


def test_the_dht_process_validator_refuses_forgeries(keys: dict[str, bytes]) -> None:
    a, c = signer(keys, "a"), signer(keys, "c")
    validator = SignedRecordValidator(OPEN, LIFETIMES)
    validator.verifier.clock = lambda: NOW

    def record(subkey: object, value: object, expiration: float = EXPIRATION) -> DHTRecord:
        return DHTRecord(key_id(KEY), MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), expiration)

    good = a.envelope(KEY, a.peer_id, payload(a.peer_id), EXPIRATION)
    assert validator.validate(record(a.peer_id, good))
    assert not validator.validate(record(a.peer_id, good, EXPIRATION + 5))
    assert not validator.validate(record(a.peer_id, c.envelope(KEY, a.peer_id, payload(a.peer_id), EXPIRATION)))
    assert not validator.validate(record(a.peer_id, payload(a.peer_id)))  # unsigned, as before signing existed
    assert not validator.validate(DHTRecord(key_id(KEY), b"", MSGPackSerializer.dumps(good), EXPIRATION))
    counts = validator.verifier.counts()
    assert {r: n for r, n in counts.items() if n} == {"malformed": 2, "expiration_mismatch": 1, "wrong_signer": 1}


def test_refusal_logs_remember_a_bounded_number_of_peers(caplog: pytest.LogCaptureFixture) -> None:
    log = RateLimitedLog(logging.getLogger("peerd.test"), every=60.0, size=8)
    with caplog.at_level(logging.WARNING, "peerd.test"):
        for i in range(1000):  # a stranger claiming a new peer id in every message
            log(f"peer{i}", logging.WARNING, "refused %d", i)
        assert not log("peer999", logging.WARNING, "again")  # rate-limited: logged within the minute
    assert len(log) == 8 and len(caplog.records) == 1000


class _FakeSwarm:
    """The two SwarmNode methods matchmaking uses, over a dict of already verified entries."""

    def __init__(self, peer_id: str, entries: dict[str, object]) -> None:
        self.peer_id = peer_id
        self.entries = entries
        self.dropped: list[str] = []
        self.latency = LatencyWindow()

    async def store(self, key: str, subkey: str, value: dict[str, Any], expiration: float) -> bool:
        self.entries[subkey] = value
        return True

    async def read_subkeys(self, key: str) -> dict[str, object]:
        return dict(self.entries)

    def drop(self, reason: str, error: ProtocolViolation) -> None:
        self.dropped.append(reason)


def test_matchmaking_takes_groups_only_from_a_registrant(keys: dict[str, bytes]) -> None:
    a, b, c = (signer(keys, name).peer_id for name in "abc")
    t0 = time.time() - 5.0  # the leader's window is over
    entries: dict[str, object] = {
        a: {"peer_id": a, "t": t0, "groups": [sorted([a, b])]}, b: {"peer_id": b, "t": t0 + 0.5},
        c + "x": {"nonsense": True},
    }
    config = AveragingConfig(matchmaking_window=0.5, max_matchmaking_window=0.5, join_timeout=1.0, min_group_size=2)
    swarm = _FakeSwarm(b, entries)
    group = asyncio.run(Matchmaker(swarm, config).form_group("run.round", 2))  # type: ignore[arg-type]
    assert set(group.members) == {a, b}
    assert swarm.dropped == ["malformed"]  # c + "x": an entry without a registration
    # without a's decision, b waits for its leader until a's deadline, then leads itself, leaving a out
    entries[a] = {"peer_id": a, "t": t0}
    with pytest.raises(GroupFailed, match="1 member"):
        asyncio.run(Matchmaker(swarm, config).form_group("run.round", 2))  # type: ignore[arg-type]
    assert entries[b]["groups"] == [[b]]  # type: ignore[index]
