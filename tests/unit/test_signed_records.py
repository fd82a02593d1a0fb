"""Signed DHT records: forgeries of every kind are refused and counted, good records pass (in the daemon's
reader and in the DHT process's hivemind validator), and matchmaking takes groups only from its leader."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

import pytest
from hivemind.dht.validation import DHTRecord
from hivemind.utils.serializer import MSGPackSerializer

from peerd.averaging.matchmaking import GROUPS_PREFIX, Matchmaker
from peerd.config import AveragingConfig
from peerd.errors import GroupFailed, ProtocolViolation
from peerd.swarm.identity import generate_identity
from peerd.swarm.latency import LatencyWindow
from peerd.swarm.signing import RecordSigner, RecordVerifier, key_id
from peerd.swarm.validator import SignedRecordValidator
from peerd.wire.membership import Membership

pytestmark = pytest.mark.timeout(60)

KEY = "run.peers"
EXPIRATION = 1_900_000_000.25
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


def payload(peer_id: str, **extra: Any) -> dict[str, Any]:
    return {"peer_id": peer_id, "state": "idle", "updated_at": 5.0, **extra}


def refused(verifier: RecordVerifier, subkey: str, value: object, expiration: float = EXPIRATION,
            key: str = KEY) -> str:
    with pytest.raises(ProtocolViolation) as caught:
        verifier.open(key_id(key), subkey, value, expiration)
    return str(caught.value.context["reason"])


def test_a_good_record_opens_with_its_signer_and_payload(keys: dict[str, bytes]) -> None:
    a = signer(keys, "a")
    verifier = RecordVerifier(OPEN)
    value = MSGPackSerializer.loads(MSGPackSerializer.dumps(a.envelope(KEY, a.peer_id, payload(a.peer_id), EXPIRATION)))
    for _ in range(2):  # the second time from the cache
        opened = verifier.open(key_id(KEY), a.peer_id, value, EXPIRATION)
        assert opened.signer == a.peer_id and opened.payload == payload(a.peer_id)
    assert sum(verifier.counts().values()) == 0


def test_wrong_signer_is_refused_and_counted(keys: dict[str, bytes]) -> None:
    a, c = signer(keys, "a"), signer(keys, "c")
    verifier = RecordVerifier(OPEN)
    # the stranger signs a record describing peer a, under a's subkey
    assert refused(verifier, a.peer_id, c.envelope(KEY, a.peer_id, payload(a.peer_id), EXPIRATION)) == "wrong_signer"
    # ... or describes itself but stores it under a's subkey (to displace a's record)
    assert refused(verifier, a.peer_id, c.envelope(KEY, a.peer_id, payload(c.peer_id), EXPIRATION)) == "wrong_signer"
    # ... or a groups decision under another leader's subkey
    subkey = GROUPS_PREFIX + a.peer_id
    assert refused(verifier, subkey, c.envelope(KEY, subkey, payload(c.peer_id), EXPIRATION)) == "wrong_signer"
    assert verifier.counts()["wrong_signer"] == 3


def test_bad_signatures_are_refused_and_counted(keys: dict[str, bytes]) -> None:
    a, c = signer(keys, "a"), signer(keys, "c")
    verifier = RecordVerifier(OPEN)
    good = a.envelope(KEY, a.peer_id, payload(a.peer_id), EXPIRATION)
    tampered = {**good, "p": good["p"].replace(b"idle", b"gone")}
    assert refused(verifier, a.peer_id, tampered) == "bad_signature"
    stolen_key = {**c.envelope(KEY, a.peer_id, payload(a.peer_id), EXPIRATION), "k": a.public_key}
    assert refused(verifier, a.peer_id, stolen_key) == "bad_signature"
    # a signature is bound to its DHT key: a's peer record replayed as a's progress record
    assert refused(verifier, a.peer_id, good, key="run.progress") == "bad_signature"
    assert verifier.counts()["bad_signature"] == 3


def test_restored_with_another_expiration_is_refused_and_counted(keys: dict[str, bytes]) -> None:
    a = signer(keys, "a")
    verifier = RecordVerifier(OPEN)
    good = a.envelope(KEY, a.peer_id, payload(a.peer_id), EXPIRATION)
    assert refused(verifier, a.peer_id, good, expiration=EXPIRATION + 3600) == "expiration_mismatch"
    # claiming the new expiration inside the envelope too breaks the signature instead
    assert refused(verifier, a.peer_id, {**good, "e": EXPIRATION + 3600}, expiration=EXPIRATION + 3600) == (
        "bad_signature")
    assert verifier.counts()["expiration_mismatch"] == 1


@pytest.mark.parametrize("mangle", [
    lambda good: "not a record",
    lambda good: {k: v for k, v in good.items() if k != "s"},
    lambda good: {**good, "p": b"[1, 2]"},
    lambda good: {**good, "p": b"\xff\xfe"},
    lambda good: {**good, "k": b"junk"},
    lambda good: {**good, "e": 7},
    lambda good: {**good, "p": b"x" * 70_000},
    lambda good: {**good, "p": b"[" * 60_000},  # json.loads recurses: RecursionError, not a crash
])
def test_malformed_values_are_refused_and_counted(keys: dict[str, bytes],
                                                  mangle: Callable[[dict[str, Any]], object]) -> None:
    a = signer(keys, "a")
    verifier = RecordVerifier(OPEN)
    good = a.envelope(KEY, a.peer_id, payload(a.peer_id), EXPIRATION)
    assert refused(verifier, a.peer_id, mangle(good)) == "malformed"
    assert verifier.counts()["malformed"] == 1


def test_private_swarm_refuses_valid_signatures_of_non_members(keys: dict[str, bytes]) -> None:
    member = Membership(secret=SECRET)
    a, c_without_secret = signer(keys, "a", member), signer(keys, "c")
    c_wrong_secret = signer(keys, "c", Membership(secret=b"t" * 32))
    verifier = RecordVerifier(member)
    assert verifier.open(key_id(KEY), a.peer_id, a.envelope(KEY, a.peer_id, payload(a.peer_id), EXPIRATION),
                         EXPIRATION).signer == a.peer_id
    for c in (c_without_secret, c_wrong_secret):
        value = c.envelope(KEY, c.peer_id, payload(c.peer_id), EXPIRATION)
        assert refused(verifier, c.peer_id, value) == "not_member"
        assert RecordVerifier(OPEN).open(key_id(KEY), c.peer_id, value, EXPIRATION).signer == c.peer_id
    # an allowlist without a secret: a valid signature by a peer not on the list
    b = signer(keys, "b")
    listed = RecordVerifier(Membership(allowlist=frozenset({a.peer_id})))
    assert refused(listed, b.peer_id, b.envelope(KEY, b.peer_id, payload(b.peer_id), EXPIRATION)) == "not_member"
    assert verifier.counts()["not_member"] == 2 and listed.counts()["not_member"] == 1


def test_the_dht_process_validator_refuses_forgeries(keys: dict[str, bytes]) -> None:
    a, c = signer(keys, "a"), signer(keys, "c")
    validator = SignedRecordValidator(OPEN)

    def record(subkey: object, value: object, expiration: float = EXPIRATION) -> DHTRecord:
        return DHTRecord(key_id(KEY), MSGPackSerializer.dumps(subkey), MSGPackSerializer.dumps(value), expiration)

    good = a.envelope(KEY, a.peer_id, payload(a.peer_id), EXPIRATION)
    assert validator.validate(record(a.peer_id, good))
    assert not validator.validate(record(a.peer_id, good, EXPIRATION + 60))
    assert not validator.validate(record(a.peer_id, c.envelope(KEY, a.peer_id, payload(a.peer_id), EXPIRATION)))
    assert not validator.validate(record(a.peer_id, payload(a.peer_id)))  # unsigned, as before signing existed
    assert not validator.validate(DHTRecord(key_id(KEY), b"", MSGPackSerializer.dumps(good), EXPIRATION))
    assert validator.verifier.counts() == {"malformed": 2, "expiration_mismatch": 1, "wrong_signer": 1,
                                           "bad_signature": 0, "not_member": 0}


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


def test_matchmaking_takes_groups_only_from_the_computed_leader(keys: dict[str, bytes]) -> None:
    a, b, c = (signer(keys, name).peer_id for name in "abc")
    t0 = 1_000.0  # DHT times long past: the leader's window is over
    entries: dict[str, object] = {
        a: {"peer_id": a, "t": t0}, b: {"peer_id": b, "t": t0 + 0.5},
        # c registered nothing; its decision (validly signed by c) must not count
        GROUPS_PREFIX + c: {"peer_id": c, "groups": [[b, c]]},
        GROUPS_PREFIX + a: {"peer_id": a, "groups": [sorted([a, b])]},
        "junk": {"peer_id": c},
        c + "x": {"nonsense": True},
    }
    config = AveragingConfig(matchmaking_window=0.5, max_matchmaking_window=0.5, join_timeout=1.0, min_group_size=2)
    swarm = _FakeSwarm(b, entries)
    group = asyncio.run(Matchmaker(swarm, config).form_group("run.round", 2))  # type: ignore[arg-type]
    assert set(group.members) == {a, b}
    assert swarm.dropped == ["malformed"]  # c + "x": a peer-id-like subkey without a registration
    # without a's decision, b waits for its leader rather than taking c's
    del entries[GROUPS_PREFIX + a]
    with pytest.raises(GroupFailed, match="leader"):
        asyncio.run(Matchmaker(swarm, config).form_group("run.round", 2))  # type: ignore[arg-type]
