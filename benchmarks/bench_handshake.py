"""What the membership handshake costs per stream: two p2pd daemons on loopback, one serving a handler that
answers one small frame; the other opens a stream, sends a frame, reads the answer and closes, N times, for:

  raw     hivemind's P2P stream with no handshake (no peerd protocol runs like this any more)
  open    peerd's guard in an open swarm (Hello, Challenge, Proof, Verdict with empty proofs)
  secret  peerd's guard in a private swarm (the same with HMAC-SHA256 proofs both ways)

Rows are interleaved round by round so load changes hit every row alike; prints medians and the load average.
The all-reduce's time with and without a secret: benchmarks/bench_allreduce.py --backends peerd,peerd_secret.

    .venv/bin/python benchmarks/bench_handshake.py --streams 300
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import time
from typing import Any

from hivemind.p2p import P2P, PeerID

from peerd.config import StreamLimits
from peerd.wire.frames import read_frame, write_frame
from peerd.wire.guard import StreamGuard
from peerd.wire.membership import Membership

HANDLER = "peerd.v1.bench.echo"
RAW = "peerd.v1.bench.raw"


async def _echo(info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
    data = await read_frame(reader, 1 << 16, str(info.peer_id), "ping")
    await write_frame(writer, data)
    await reader.read(1)  # let the caller close first, as peerd's protocols do
    writer.close()


async def _exchange(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, peer: str) -> None:
    await write_frame(writer, b"ping")
    await read_frame(reader, 1 << 16, peer, "pong")
    writer.close()


async def main(streams: int) -> None:
    server = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"])
    client = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                              initial_peers=[str(m) for m in await server.get_visible_maddrs()])
    try:
        secret = Membership(os.urandom(32))
        rows: dict[str, tuple[StreamGuard, StreamGuard] | None] = {"raw": None}
        for name, membership in (("open", Membership()), ("secret", secret)):
            serving = StreamGuard(server, membership, StreamLimits())
            await serving.add_handler(f"{HANDLER}.{name}", _echo)
            rows[name] = (serving, StreamGuard(client, membership, StreamLimits()))
        await server.add_binary_stream_handler(RAW, _echo)
        target = str(server.peer_id)
        times: dict[str, list[float]] = {name: [] for name in rows}
        for i in range(streams + 10):  # the first 10 rounds warm up connections and code paths
            for name, pair in rows.items():
                started = time.perf_counter()
                if pair is None:
                    _, reader, writer = await client.call_binary_stream_handler(PeerID.from_base58(target), RAW)
                else:
                    reader, writer = await pair[1].open(target, f"{HANDLER}.{name}")
                await _exchange(reader, writer, target)
                if i >= 10:
                    times[name].append(time.perf_counter() - started)
        load = os.getloadavg()
        raw = statistics.median(times["raw"])
        print(f"{streams} streams per row, loopback, load average {load[0]:.1f} {load[1]:.1f} {load[2]:.1f}")
        print(f"{'row':8} {'median ms':>10} {'p90 ms':>8} {'handshake ms':>13}")
        for name, values in times.items():
            values.sort()
            median = statistics.median(values)
            print(f"{name:8} {median * 1000:10.2f} {values[int(0.9 * len(values))] * 1000:8.2f} "
                  f"{(median - raw) * 1000:13.2f}")
    finally:
        await client.shutdown()
        await server.shutdown()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--streams", type=int, default=300)
    asyncio.run(main(parser.parse_args().streams))
