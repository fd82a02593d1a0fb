"""A stranger to the swarm (no secret, no peerd: plain hivemind nodes), for tests and benchmarks only.

    python -m tests.integration.stranger cpu MADDR KEY BYTES      BYTES of records signed with costly keys, in
                                                                   DHT store requests sent at once (as many keys
                                                                   each as a peer not yet admitted may store);
                                                                   prints what happened
    python -m tests.integration.stranger dictionary MADDR KEY SUBKEYS REQUESTS
                                                                   REQUESTS stores at once, each of one whole
                                                                   dictionary of SUBKEYS subkeys under KEY
    python -m tests.integration.stranger slots MADDR IDS STREAMS PROTOCOL
                                                                   IDS identities open STREAMS streams each to
                                                                   PROTOCOL and hold them, silent
    python -m tests.integration.stranger read MADDR KEY           prints the payloads stored under KEY, as stored
    python -m tests.integration.stranger finds MADDR KEYS CALLS  CALLS finds of KEYS random keys each at a time,
                                                                   sent again as soon as each ends
    python -m tests.integration.stranger eclipse MADDR N KEY...   N DHT nodes per KEY, each with a node id next to
                                                                   KEY's, that take every store and keep nothing

MADDR ends in the target's /p2p/<peer id>. Each command prints one JSON line when its work is done; ``slots``
then keeps its streams open (reopening any the target refuses or closes), and ``eclipse`` its nodes running, until
it is stopped with a signal.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import json
import secrets
import sys
import time
from typing import Any

from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import rsa
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.dht.storage import DHTLocalStorage, DictionaryDHTValue
from hivemind.p2p import P2P, PeerID
from hivemind.proto import crypto_pb2
from hivemind.utils.serializer import MSGPackSerializer
from hivemind.utils.timed_storage import get_dht_time

from peerd.swarm.admission import MAX_UNPROVEN_KEYS
from peerd.swarm.signing import peer_id_of


def target_of(maddr: str) -> PeerID:
    """The peer a multiaddr ending in /p2p/<peer id> names."""
    return PeerID.from_base58(maddr.rsplit("/p2p/", 1)[1])


def stores_answered(answers: list[list[bool] | None]) -> dict[str, int]:
    """Values the target stored, and requests that failed (an error, not an answer), over store answers."""
    return {"stored": sum(sum(map(bool, answer)) for answer in answers if answer is not None),
            "requests_failed": sum(answer is None for answer in answers)}


def costly_key() -> bytes:
    """A libp2p RSA public key with a 3,072-bit modulus and a 3,071-bit public exponent (OpenSSL verifies with
    exponents up to the modulus' size at 3,072 bits and below)."""
    modulus = rsa.generate_private_key(65537, 3072).private_numbers().public_numbers.n
    exponent = secrets.randbits(3071) | 1 | 1 << 3070
    der = rsa.RSAPublicNumbers(exponent, modulus).public_key().public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo)
    return bytes(crypto_pb2.PublicKey(key_type=crypto_pb2.RSA, data=der).SerializeToString())


def costly_records(nbytes: int) -> tuple[str, list[bytes], float]:
    """Envelopes (msgpack, as hivemind stores them) of about ``nbytes`` in all, under one subkey, each with
    another payload so that no verdict is cached: their signatures are garbage, which costs a verifier
    the same full RSA verification as a valid one."""
    public_key = costly_key()
    subkey, expiration = peer_id_of(public_key), get_dht_time() + 5.0
    values = []
    size = 0
    while size < nbytes:
        payload = json.dumps({"peer_id": subkey, "n": len(values)}).encode()
        value = MSGPackSerializer.dumps({"p": payload, "k": public_key, "s": secrets.token_bytes(383), "t": b"",
                                         "e": expiration})
        values.append(value)
        size += len(value)
    return subkey, values, expiration


async def join(maddr: str, **options: Any) -> DHTNode:
    """A node that joins through ``maddr``. hivemind's first ping asks the target to ping back, and refuses to
    start when that answer is late (a loaded machine, several nodes starting at once); the stranger does not
    need the member to reach it, so a late answer is only logged (``strict=False``)."""
    return await DHTNode.create(initial_peers=[maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"], strict=False,
                                **options)


async def cpu(maddr: str, key: str, nbytes: int) -> dict[str, Any]:
    target = target_of(maddr)
    node = await join(maddr, wait_timeout=300, cache_locally=False, cache_on_store=False)
    try:
        subkey, values, expiration = costly_records(nbytes)
        started = time.monotonic()
        batches = [values[start:start + MAX_UNPROVEN_KEYS] for start in range(0, len(values), MAX_UNPROVEN_KEYS)]
        answers = await asyncio.gather(*(node.protocol.call_store(
            target, [DHTID.generate(source=key)] * len(batch), batch, expiration, subkeys=[subkey] * len(batch))
            for batch in batches))
        took = time.monotonic() - started
        return {"records": len(values), "bytes": sum(map(len, values)), "requests": len(batches), "took": took,
                **stores_answered(answers)}
    finally:
        await node.shutdown()


async def dictionary(maddr: str, key: str, subkeys: int, requests: int) -> dict[str, Any]:
    """hivemind unpacks a whole dictionary, subkey by subkey, before the record validator sees its first record:
    the cost is in the number of subkeys, however cheap each record is to refuse."""
    target = target_of(maddr)
    node = await join(maddr, wait_timeout=300, cache_locally=False, cache_on_store=False)
    try:
        expiration = get_dht_time() + 60.0
        value = DictionaryDHTValue()
        for i in range(subkeys):
            value.store(MSGPackSerializer.dumps(i), b"x", expiration)
        nbytes, started = len(MSGPackSerializer.dumps(value)), time.monotonic()
        answers = await asyncio.gather(*(node.protocol.call_store(target, [DHTID.generate(source=key)], [value],
                                                                  expiration) for _ in range(requests)))
        return {"subkeys": subkeys, "requests": requests, "bytes": nbytes, "took": time.monotonic() - started,
                **stores_answered(answers)}
    finally:
        await node.shutdown()


async def slots(maddr: str, identities: int, streams: int, protocol: str) -> None:
    target = target_of(maddr)
    nodes = [await P2P.create(initial_peers=[maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"])
             for _ in range(identities)]
    held: list[asyncio.StreamWriter] = []

    async def hold(node: P2P) -> None:
        while True:  # the target closes a silent stream after its handshake deadline: open it again
            try:
                _, reader, writer = await node.call_binary_stream_handler(target, protocol)
            except Exception:  # noqa: BLE001 (refused, reset: try again shortly)
                await asyncio.sleep(0.05)
                continue
            held.append(writer)
            # the target's first answer (a refusal), EOF or a reset: close this one and open another shortly, so
            # that a slot freed by anyone is taken again (the target would keep a refused stream open for a while,
            # waiting for us to close it, and a member's next stream would take the slot first)
            with contextlib.suppress(Exception):
                await reader.read(1)
            held.remove(writer)
            writer.close()
            await asyncio.sleep(0.1)

    tasks = [asyncio.ensure_future(hold(node)) for node in nodes for _ in range(streams)]
    deadline = time.monotonic() + 60
    while len(held) < identities * streams // 2 and time.monotonic() < deadline:
        await asyncio.sleep(0.1)  # polling the count of open streams for the one ready line
    print(json.dumps({"holding": len(held), "peer_ids": [str(n.peer_id) for n in nodes]}), flush=True)
    try:
        await asyncio.gather(*tasks)
    finally:
        for node in nodes:
            await node.shutdown()


async def read(maddr: str, key: str) -> dict[str, Any]:
    node = await join(maddr, cache_locally=False)
    try:
        found = await node.get(key, latest=True)
        entries = {} if found is None else found.value
        payloads = {str(subkey): base64.b64encode(entry.value.get("p", b"")).decode()
                    for subkey, entry in entries.items() if isinstance(entry.value, dict)}
        return {"payloads": payloads}
    finally:
        await node.shutdown()


async def finds(maddr: str, keys: int, calls: int) -> None:
    """A DHT find asks about many keys at once, and its answer holds the nearest nodes for each of them."""
    target = target_of(maddr)
    node = await join(maddr, wait_timeout=30, cache_locally=False, cache_on_store=False)
    sent = [0]

    async def ask() -> None:
        while True:
            await node.protocol.call_find(target, [DHTID.generate() for _ in range(keys)])
            sent[0] += 1

    tasks = [asyncio.ensure_future(ask()) for _ in range(calls)]
    while sent[0] < calls:
        await asyncio.sleep(0.1)  # polling the count of answered finds for the one ready line
    print(json.dumps({"finds": sent[0], "peer_id": str(node.peer_id)}), flush=True)
    try:
        await asyncio.gather(*tasks)
    finally:
        await node.shutdown()


class BlackHole(DHTLocalStorage):  # type: ignore[misc]  # hivemind ships no type information
    """A node's storage that says yes to every store and keeps nothing: every find it answers is NOT_FOUND."""

    def store(self, *args: Any, **kwargs: Any) -> bool:
        return True

    def store_subkey(self, *args: Any, **kwargs: Any) -> bool:
        return True


async def eclipse(maddr: str, per_key: int, keys: list[str]) -> None:
    """Kademlia stores a key on the nodes whose ids are nearest it, and a node picks its own id: ``per_key``
    nodes with ids next to each key's (hivemind stores on 5) become where the swarm stores and looks up that key."""
    ids = [DHTID(int(DHTID.generate(source=key)) ^ (i + 1)) for key in keys for i in range(per_key)]
    nodes = await asyncio.gather(*(join(maddr, node_id=node_id, cache_locally=False, cache_on_store=False,
                                        cache_nearest=0) for node_id in ids))
    for node in nodes:
        node.protocol.storage = BlackHole()
    # a lookup of the node's own id from each node: the swarm's nodes add it to their routing tables
    await asyncio.gather(*(node.find_nearest_nodes([node.node_id]) for node in nodes))
    print(json.dumps({"nodes": len(nodes), "peer_ids": [str(n.peer_id) for n in nodes]}), flush=True)
    try:
        await asyncio.Event().wait()
    finally:
        for node in nodes:
            await node.shutdown()


if __name__ == "__main__":
    command, maddr = sys.argv[1], sys.argv[2]
    if command == "cpu":
        print(json.dumps(asyncio.run(cpu(maddr, sys.argv[3], int(sys.argv[4])))), flush=True)
    elif command == "dictionary":
        print(json.dumps(asyncio.run(dictionary(maddr, sys.argv[3], int(sys.argv[4]), int(sys.argv[5])))), flush=True)
    elif command == "slots":
        asyncio.run(slots(maddr, int(sys.argv[3]), int(sys.argv[4]), sys.argv[5]))
    elif command == "finds":
        asyncio.run(finds(maddr, int(sys.argv[3]), int(sys.argv[4])))
    elif command == "eclipse":
        asyncio.run(eclipse(maddr, int(sys.argv[3]), sys.argv[4:]))
    elif command == "read":
        print(json.dumps(asyncio.run(read(maddr, sys.argv[3]))), flush=True)
    else:
        raise SystemExit(f"unknown command {command!r}")
