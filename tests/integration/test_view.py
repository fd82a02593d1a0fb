"""Re-bootstrap in a running DHT (peerd.swarm.view.rebootstrap_node), on real p2pd/DHT processes.

Three nodes in-process: A starts a swarm, B joins through A, C starts alone (a DHT of its own: a split brain
made on purpose). C's re-bootstrap towards B (as the daemon does towards the peer reporting the largest view)
joins C to A and B's DHT: its lookup of the records key then finds what A stored. B's re-bootstrap reports its
initial peer A answering, and nobody once A is gone. The nodes run with hivemind's caching off (node.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from contextlib import AsyncExitStack

import pytest
from hivemind.dht import DHTNode

from peerd.config import SwarmConfig
from peerd.swarm.node import SwarmNode, now

pytestmark = pytest.mark.integration


def config(*initial_peers: str) -> SwarmConfig:
    return SwarmConfig(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=list(initial_peers),
                       request_timeout=5.0)


async def started(stack: AsyncExitStack, *initial_peers: str) -> SwarmNode:
    node = await SwarmNode.create(config(*initial_peers), "view-test")
    stack.push_async_callback(node.shutdown)
    return node


async def eventually(check: Callable[[], Awaitable[bool]], timeout: float) -> None:
    """Re-checks a DHT lookup until it holds (each check is a bounded network round trip)."""
    deadline = asyncio.get_running_loop().time() + timeout
    while not await check():
        if asyncio.get_running_loop().time() > deadline:
            raise TimeoutError("condition did not hold in time")


async def dht_caching(_dht: object, node: DHTNode) -> tuple[bool, int, float, bool]:
    """Run in the DHT process: the caching options hivemind's node got."""
    return node.cache_locally, node.cache_nearest, node.cache_refresh_before_expiry, node.cache_on_store


async def scenario() -> tuple[int, int, int, bool]:
    async with AsyncExitStack() as stack:
        a = await started(stack)
        caching = await asyncio.wrap_future(a.dht.run_coroutine(dht_caching, return_future=True))
        assert caching == (False, 0, 0, False), caching
        b = await started(stack, a.visible_maddrs()[0])
        c = await started(stack)
        await a.store(a.records_key, a.peer_id, {"peer_id": a.peer_id, "mark": 1}, now() + 20)  # within the TTL

        async def c_reads_a() -> bool:
            return a.peer_id in await c.read_subkeys(c.records_key)

        split = not await c_reads_a()
        c_answered = await c.rebootstrap([b.visible_maddrs()[0]])  # C has no initial peers of its own
        await eventually(c_reads_a, 30)
        b_answered = await b.rebootstrap()
        await a.shutdown()
        b_after = await b.rebootstrap()
        return c_answered, b_answered, b_after, split


@pytest.mark.timeout(120)
def test_rebootstrap_joins_a_lone_dht_and_counts_initial_peers_answering() -> None:
    c_answered, b_answered, b_after, split = asyncio.run(scenario())
    assert split, "C started alone, so it cannot have read A's record before re-bootstrapping"
    assert c_answered == 0  # no initial peers of its own; it dialed B as the 'other' peer
    assert b_answered == 1
    assert b_after == 0
