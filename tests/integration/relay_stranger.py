"""A libp2p node that is no member of the swarm and uses a peerd peer as its relay (test_relay_limits.py).

    python relay_stranger.py sink RELAY_MADDR OUT_FILE          reserve a slot on the relay, count bytes received
    python relay_stranger.py source RELAY_MADDR SINK_ID NBYTES SINK_FILE  push NBYTES to the sink via the relay

Both are plain hivemind P2P nodes (p2pd with autorelay; no peerd, no swarm secret): what any stranger who knows
the relay's address can run. The sink writes ``{"peer_id", "relayed", "received"}`` to OUT_FILE as it goes; the
source prints ``{"sent", "error", "path"}`` (the address its stream went to) once its stream is done or reset.
"""

from __future__ import annotations

import asyncio
import json
import os
import sys
import time
from pathlib import Path

from hivemind.p2p import P2P, P2PDaemonError, PeerID

from peerd.swarm.process import add_p2pd_flags

PROTOCOL = "stranger-sink"
CHUNK = 64 * 1024


async def sink(relay: str, out: Path) -> None:
    add_p2pd_flags({"trustedRelays": relay, "relayDiscovery": 0})
    p2p = await P2P.create(initial_peers=[relay], host_maddrs=["/ip4/0.0.0.0/tcp/0"], use_auto_relay=True,
                           force_reachability="private")
    received = 0

    def report(relayed: bool, **extra: object) -> None:
        # whole or not at all: the test reads the file while it is rewritten
        part = out.with_suffix(".part")
        part.write_text(json.dumps({"peer_id": str(p2p.peer_id), "relayed": relayed, "received": received, **extra}))
        os.replace(part, out)

    async def handle(_info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal received
        while data := await reader.read(CHUNK):
            received += len(data)
        report(True)  # the source stays up until this count reaches what it sent
        writer.close()

    await p2p.add_binary_stream_handler(PROTOCOL, handle)
    relay_id = relay.rsplit("/p2p/", 1)[-1]
    while True:
        addresses = [str(a) for a in await p2p.get_visible_maddrs(latest=True)]
        peers = [str(info.peer_id) for info in await p2p.list_peers()]
        report(any("/p2p-circuit" in a for a in addresses), connected_to_relay=relay_id in peers, peers=len(peers))
        await asyncio.sleep(0.2)  # the test reads the file while this runs; it is stopped by a signal


async def open_stream(p2p: P2P, sink_id: PeerID) -> tuple[object, asyncio.StreamReader, asyncio.StreamWriter]:
    """A stream to the sink, once the source's libp2p DHT can route to it.

    The source learns the sink's relayed address from the relay through libp2p's DHT, whose table takes the
    relay in only after identify, which runs after the bootstrap connect returns. Until then p2pd answers "failed
    to find any peer in table"; a stranger tries again, as this one does (within the caller's 20 s).
    """
    while True:
        try:
            return await p2p.call_binary_stream_handler(sink_id, PROTOCOL)
        except P2PDaemonError as e:  # ControlFailure
            if "failed to find any peer in table" not in str(e):
                raise
        await asyncio.sleep(0.2)  # p2pd gives no event for its routing table taking a peer


async def source(relay: str, sink_id: str, nbytes: int, sink_report: Path) -> None:
    p2p = await P2P.create(initial_peers=[relay], host_maddrs=["/ip4/0.0.0.0/tcp/0"])
    sent, error, path = 0, None, None
    try:
        info, _, writer = await asyncio.wait_for(open_stream(p2p, PeerID.from_base58(sink_id)), 20)
        path = str(info.addr)
        chunk = b"\0" * CHUNK
        while sent < nbytes:
            writer.write(chunk)
            await asyncio.wait_for(writer.drain(), 20)
            sent += len(chunk)
        # stay up (and so keep the circuit) until the sink has counted every byte, at most 20 s
        deadline = time.monotonic() + 20
        while json.loads(sink_report.read_text())["received"] < sent and time.monotonic() < deadline:
            await asyncio.sleep(0.1)  # polling the sink's report file, which has no change notification
        writer.close()
    except (OSError, TimeoutError, RuntimeError, Exception) as e:  # noqa: BLE001 (any reset is the result)
        error = repr(e)[:200]
    print(json.dumps({"sent": sent, "error": error, "path": path}), flush=True)
    await p2p.shutdown()


if __name__ == "__main__":
    if sys.argv[1] == "sink":
        asyncio.run(sink(sys.argv[2], Path(sys.argv[3])))
    else:
        asyncio.run(source(sys.argv[2], sys.argv[3], int(sys.argv[4]), Path(sys.argv[5])))
