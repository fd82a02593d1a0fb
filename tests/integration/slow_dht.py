"""A member whose DHT node answers slowly, for tests only: `python -m tests.integration.slow_dht start ...` is
`peerd start ...` whose DHT node holds find and store requests SLOW_DHT_SECONDS (default 4.5: just under the
default swarm.request_timeout of 5 s) before answering them honestly: every one, or a share SLOW_DHT_SHARE of
them, spread evenly (0.4: two of every five); with SLOW_DHT_SWITCH (a file's path), only while that file exists, so
that a test can time the same swarm with it slow and not, window after window. Its own requests, and everything
else it does, stay honest. hivemind's DHT child is forked from this process after the patch, so it answers
slowly too."""

from __future__ import annotations

import asyncio
import itertools
import math
import os

from hivemind.dht.protocol import DHTProtocol
from hivemind.p2p import P2PContext
from hivemind.proto import dht_pb2

from peerd.cli import main

DELAY = float(os.environ.get("SLOW_DHT_SECONDS", "4.5"))
SHARE = float(os.environ.get("SLOW_DHT_SHARE", "1"))
SWITCH = os.environ.get("SLOW_DHT_SWITCH")
_answered = itertools.count()


async def _hold() -> None:
    """Holds this request DELAY seconds if it is one of the SHARE held (and the switch, if any, is on)."""
    if SWITCH is not None and not os.path.exists(SWITCH):
        return
    n = next(_answered)
    if math.floor((n + 1) * SHARE) > math.floor(n * SHARE):
        await asyncio.sleep(DELAY)

_honest_find = DHTProtocol.rpc_find
_honest_store = DHTProtocol.rpc_store


# hivemind reads the handlers' annotations to register them: they must name the request and response types
async def _slow_find(self: DHTProtocol, request: dht_pb2.FindRequest, context: P2PContext) -> dht_pb2.FindResponse:
    await _hold()
    return await _honest_find(self, request, context)


async def _slow_store(self: DHTProtocol, request: dht_pb2.StoreRequest, context: P2PContext) -> dht_pb2.StoreResponse:
    await _hold()
    return await _honest_store(self, request, context)


DHTProtocol.rpc_find = _slow_find
DHTProtocol.rpc_store = _slow_store

if __name__ == "__main__":
    main()
