"""Who a DHT node's routing table admits (peerd/swarm/admission.py): in a private swarm, members only."""

from __future__ import annotations

import asyncio
from pathlib import Path

from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DictionaryDHTValue
from hivemind.dht.validation import CompositeValidator
from hivemind.p2p import PeerID
from hivemind.utils.timed_storage import get_dht_time

from peerd.swarm.admission import MAX_KEYS, MAX_UNPROVEN_KEYS, Admission
from peerd.swarm.identity import generate_identity
from peerd.swarm.signing import RecordLifetimes, RecordSigner
from peerd.swarm.stragglers import guard_node
from peerd.swarm.validator import SignedRecordValidator
from peerd.wire.membership import Membership

SECRET = bytes(range(32))
A, B = "12D3KooWPGVdJA78uHzBaDhQwqcrKkim73xy95Amd9qCuoKhvDVB", "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N"


def test_an_open_swarm_admits_anyone_and_an_allowlist_its_peers() -> None:
    assert Admission(Membership()).admits(A)
    listed = Admission(Membership(allowlist=frozenset({A})))
    assert listed.admits(A) and not listed.admits(B)


def test_with_a_secret_only_the_signers_of_checked_records_get_in() -> None:
    admission = Admission(Membership(secret=SECRET))
    assert not admission.admits(A)
    admission.prove(A)
    assert admission.admits(A) and not admission.admits(B)
    both = Admission(Membership(secret=SECRET, allowlist=frozenset({A})))
    both.prove(B)  # a record of B's passed, but B is not on the allowlist
    assert not both.admits(B) and not both.admits(A)


def test_proofs_are_bounded_the_least_recent_forgotten() -> None:
    admission = Admission(Membership(secret=SECRET), limit=2)
    for peer in ("a", "b", "c"):
        admission.prove(peer)
    assert not admission.admits("a") and admission.admits("b") and admission.admits("c")


async def guarded_node(membership: Membership) -> DHTNode:
    """A DHT node that checks records as peerd's does, guarded (``guard_node``) for ``membership``."""
    validators = [SignedRecordValidator(membership, RecordLifetimes(default=60.0))]
    node = await DHTNode.create(wait_timeout=5, record_validator=CompositeValidator(validators))
    await guard_node(8.0, 1.0, None, node)
    return node


async def admitted(node: DHTNode, peer: PeerID) -> bool:
    """Whether ``peer`` enters ``node``'s routing table within a second: hivemind updates the table in a task of
    its own after each request and answer."""
    for _ in range(100):
        if peer in node.protocol.routing_table:
            return True
        await asyncio.sleep(0.01)
    return False


def test_a_node_that_proved_nothing_stays_out_of_the_table_until_it_does() -> None:
    """A node that talks to a guarded node (here a lookup) is not added to its routing table until it proves
    membership; the guarded node still answers it."""

    async def scenario() -> None:
        guarded = await guarded_node(Membership(secret=SECRET))
        admission = guarded.protocol.admission
        other = await DHTNode.create(initial_peers=await guarded.get_visible_maddrs(), wait_timeout=5)
        try:
            assert await other.find_nearest_nodes([other.node_id]) is not None
            await asyncio.sleep(0)  # hivemind updates the routing table in tasks of their own
            assert other.peer_id not in guarded.protocol.routing_table and admission.kept_out > 0
            admission.prove(str(other.peer_id))
            assert await other.find_nearest_nodes([DHTID.generate()]) is not None
            assert await admitted(guarded, other.peer_id)
        finally:
            await other.shutdown()
            await guarded.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_find_or_store_about_more_keys_than_any_peer_needs_is_refused() -> None:
    async def scenario() -> None:
        guarded = await guarded_node(Membership())  # an open swarm: everyone asks as a member
        other = await DHTNode.create(initial_peers=await guarded.get_visible_maddrs(), wait_timeout=5)
        try:
            target = guarded.peer_id
            answered = await other.protocol.call_find(target, [DHTID.generate() for _ in range(MAX_KEYS)])
            assert answered is not None and len(answered) == MAX_KEYS
            assert await other.protocol.call_find(target, [DHTID.generate() for _ in range(MAX_KEYS + 1)]) is None
            many = [DHTID.generate() for _ in range(MAX_KEYS + 1)]
            assert await other.protocol.call_store(target, many, [b"v"] * len(many), get_dht_time() + 60) is None
            assert guarded.protocol.admission.refused == 2
        finally:
            await other.shutdown()
            await guarded.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_peer_not_yet_admitted_asks_about_few_keys_and_stores_no_whole_dictionary() -> None:
    """Before a record of its proves it a member, a peer's finds and stores are bounded tighter, and a store of a
    whole dictionary (unpacked, subkey by subkey, before any record check) is not taken. A refused store is
    answered "stored nothing", so that its sender (a member handing a newcomer its keys) keeps the node."""

    async def scenario() -> None:
        guarded = await guarded_node(Membership(secret=SECRET))
        admission = guarded.protocol.admission
        other = await DHTNode.create(initial_peers=await guarded.get_visible_maddrs(), wait_timeout=5)
        try:
            target, expiration = guarded.peer_id, get_dht_time() + 60
            answered = await other.protocol.call_find(target, [DHTID.generate() for _ in range(MAX_UNPROVEN_KEYS)])
            assert answered is not None and len(answered) == MAX_UNPROVEN_KEYS
            assert await other.protocol.call_find(target, [DHTID.generate() for _ in range(MAX_UNPROVEN_KEYS + 1)]) \
                is None
            many = [DHTID.generate() for _ in range(MAX_UNPROVEN_KEYS + 1)]
            assert await other.protocol.call_store(target, many, [b"v"] * len(many), expiration) == [False] * len(many)
            dictionary = DictionaryDHTValue()
            for i in range(100):
                dictionary.store(f"subkey{i}", b"v", expiration)
            assert await other.protocol.call_store(target, [DHTID.generate()], [dictionary], expiration) == [False]
            assert admission.refused == 3
            await asyncio.sleep(0)  # hivemind updates the routing table in tasks of their own
            assert target in other.protocol.routing_table  # "stored nothing" is an answer, not a failure
            admission.prove(str(other.peer_id))  # now a member: its dictionary reaches the record checks
            await other.protocol.call_store(target, [DHTID.generate()], [dictionary], expiration)
            assert await other.protocol.call_find(target, [DHTID.generate() for _ in range(MAX_KEYS)]) is not None
            assert admission.refused == 3
        finally:
            await other.shutdown()
            await guarded.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 60))


def test_a_member_gets_in_once_a_record_it_signed_passes_the_validator(tmp_path: Path) -> None:
    """End to end with the record check: the validator's proof is what admits a member, and its peer id is the
    one libp2p authenticates for its DHT node."""
    membership = Membership(secret=SECRET)
    generate_identity(tmp_path / "member.key")
    signer = RecordSigner((tmp_path / "member.key").read_bytes(), membership)

    async def scenario() -> None:
        guarded = await guarded_node(membership)
        member = await DHTNode.create(initial_peers=await guarded.get_visible_maddrs(), wait_timeout=5,
                                      identity_path=str(tmp_path / "member.key"))
        try:
            assert str(member.peer_id) == signer.peer_id
            assert await member.find_nearest_nodes([member.node_id]) is not None
            assert member.peer_id not in guarded.protocol.routing_table
            expiration = get_dht_time() + 30
            value = signer.envelope("run.peers", signer.peer_id, {"peer_id": signer.peer_id}, expiration)
            assert await member.store("run.peers", value, expiration, subkey=signer.peer_id)
            assert await admitted(guarded, member.peer_id)
        finally:
            await member.shutdown()
            await guarded.shutdown()

    asyncio.run(asyncio.wait_for(scenario(), 60))
