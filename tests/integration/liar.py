"""A member gone bad in its bookkeeping, for tests only.

    python -m tests.integration.liar start --lie NAME <peerd start arguments>
        ``peerd start`` (with the swarm's secret, so a member) that lies as LIES says; its own checks of what it
        reads stay honest unless a lie needs them off
    python -m tests.integration.liar flood MADDR KEY SECRET_PATH IDENTITY_PATH
        a member that floods KEY with values under subkeys of its own (:func:`flood`)
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import sys
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from hivemind.dht.node import DHTNode
from hivemind.dht.routing import DHTID
from hivemind.utils.serializer import MSGPackSerializer

from peerd.averaging.absences import MAX_APART, Absences
from peerd.averaging.allreduce import AllReducer
from peerd.averaging.group import Group, RoundReport
from peerd.bounded import remember
from peerd.cli import main
from peerd.errors import PeerdError
from peerd.proto import peerd_averaging_pb2 as pb
from peerd.swarm import node
from peerd.swarm.admission import MAX_UNPROVEN_KEYS
from peerd.swarm.identity import generate_identity
from peerd.swarm.signing import RecordSigner
from peerd.wire.frames import read_message
from peerd.wire.membership import Membership, load_secret
from tests.integration import undefended

DECADES = 30 * 365 * 86400.0


def _far_expirations() -> None:
    """Every value it stores expires in 30 years: its record would outlive it."""
    undefended.DEFENCES["expiration-cap"]()  # its own DHT node takes the values, whoever else refuses them
    honest = node.SwarmNode.store

    async def store(self: node.SwarmNode, key: str, subkey: str, payload: dict[str, Any], expiration: float) -> bool:
        return await honest(self, key, subkey, payload, node.now() + DECADES)

    node.SwarmNode.store = store  # type: ignore[method-assign]


HAUNT_AHEAD = 3  # gradient rounds ahead of the furthest trainer it registers for
HAUNT_REFRESH = 1.0  # pairs: seconds between its stores of one round's decision, so that its time stays plausible
HAUNT_LIFETIME = 40.0  # within what readers allow for a round key's entries (configs/synthetic.yaml: 43 + 3 s)


def _haunt_rounds(when: Callable[[float], float], pairs: bool = False) -> None:
    """Registers, at time ``when(its clock)``, for every gradient round the trainers are at or will be at soon
    (it reads their progress records), and never decides: what a member that wants to lead every round and
    stall it does. Its own matchmaking publishes no decision either. ``pairs``: it decides instead, before
    anyone else registers: every trainer whose progress record it read in a group of two with itself (it needs
    no one's registration to name them), stored again every HAUNT_REFRESH seconds; so its decision is there
    at every trainer's first read of the round, whatever the load."""
    honest = node.SwarmNode.store
    haunting: list[asyncio.Task[None]] = []

    async def haunt(swarm: node.SwarmNode) -> None:
        refreshed: dict[str, float] = {}
        progress_key = swarm.records_key.removesuffix(".peers") + ".progress"
        while True:
            await asyncio.sleep(0.3)  # the pace of its reads of the trainers' progress
            try:
                records = await swarm.read_subkeys(progress_key)
            except PeerdError:
                continue
            steps = [(r["fingerprint"], r["step"]) for r in records.values() if isinstance(r, dict) and "step" in r]
            others = sorted(set(records) - {swarm.peer_id})
            if not steps or pairs and len(others) < 2:  # a pair for one trainer alone would be a valid decision
                continue
            fingerprint, step = max(steps, key=lambda s: s[1])
            for ahead in range(HAUNT_AHEAD):
                key = f"{progress_key.removesuffix('.progress')}.{fingerprint}.grad.{step + ahead}"
                if key in refreshed and (not pairs or node.now() - refreshed[key] < HAUNT_REFRESH):
                    continue
                refreshed[key] = node.now()
                entry: dict[str, Any] = {"peer_id": swarm.peer_id, "t": when(node.now())}
                if pairs:
                    entry["groups"] = [sorted([swarm.peer_id, other]) for other in others]
                with contextlib.suppress(PeerdError):
                    await honest(swarm, key, swarm.peer_id, entry, node.now() + HAUNT_LIFETIME)

    async def store(self: node.SwarmNode, key: str, subkey: str, payload: dict[str, Any], expiration: float) -> bool:
        if not haunting:
            haunting.append(asyncio.ensure_future(haunt(self)))
        if "groups" in payload:  # it never decides honestly
            return True
        if "t" in payload:
            if pairs:  # its own matchmaking's registration would replace its decision
                return True
            payload = {**payload, "t": when(payload["t"])}
        return await honest(self, key, subkey, payload, expiration)

    node.SwarmNode.store = store  # type: ignore[method-assign]


def _time_zero() -> None:
    """Registers for every round at time 0 (the earliest possible: the leader of every round) and never
    decides."""
    _haunt_rounds(lambda t: 0.0)


def _first_and_silent() -> None:
    """Registers for every round 5 s before it does (a plausible time, and so the leader of every round) and
    never decides."""
    _haunt_rounds(lambda t: t - 5.0)


FLOOD_VALUES, FLOOD_BYTES = 200, 32_000
FLOOD_TTL = 10.5  # within what readers allow for configs/local.yaml's peers key (8 + 3 s)
FLOOD_BATCH = MAX_UNPROVEN_KEYS  # values per store request (0.5 MB): a client-mode node proves no membership


async def flood(maddr: str, key: str, secret: Path, identity: Path) -> None:
    """Keeps FLOOD_VALUES values of FLOOD_BYTES each (within the size a value may have) under ``key``, each
    under a subkey of its own (``pad<i>:<its peer id>``), signed and tagged as a member: 6.4 MB, more than
    hivemind answers in one message. From a DHT node in client mode (one no lookup asks), so that what the
    flood costs its own node slows nobody else's lookups; straight to every node it met when it joined,
    FLOOD_BATCH values a request."""
    undefended.DEFENCES["one-subkey"]()  # sign values under such subkeys, of up to 64 KiB
    signer = RecordSigner(identity.read_bytes(), Membership(load_secret(secret)))
    dht = await DHTNode.create(initial_peers=[maddr], host_maddrs=["/ip4/127.0.0.1/tcp/0"], client_mode=True,
                               cache_locally=False, cache_on_store=False, wait_timeout=30)
    pad = {"peer_id": signer.peer_id, "pad": "x" * FLOOD_BYTES}
    print(json.dumps({"peer_id": signer.peer_id}), flush=True)
    while True:  # until stopped with a signal
        expiration = node.now() + FLOOD_TTL
        subkeys = [f"pad{i}:{signer.peer_id}" for i in range(FLOOD_VALUES)]
        values = [MSGPackSerializer.dumps(signer.envelope(key, subkey, pad, expiration)) for subkey in subkeys]
        peers = list(dht.protocol.routing_table.peer_id_to_uid)
        stores = [dht.protocol.call_store(peer, [DHTID.generate(source=key)] * len(batch), batch, expiration,
                                          subkeys=subkeys[start:start + FLOOD_BATCH])
                  for peer in peers for start in range(0, FLOOD_VALUES, FLOOD_BATCH)
                  for batch in [values[start:start + FLOOD_BATCH]]]
        results = await asyncio.gather(*stores, return_exceptions=True)
        stored = sum(sum(map(bool, r)) for r in results if r is not None and not isinstance(r, BaseException))
        print(f"flooded {len(peers)} nodes: {stored} values stored", file=sys.stderr, flush=True)


def _pairs() -> None:
    """Decides every round, 5 s early (the leader) and before anyone registers: each trainer in a group of two
    with itself, groups that name it several times."""
    _haunt_rounds(lambda t: t - 5.0, pairs=True)


def _absent() -> None:
    """Registers and is grouped like any member, and never takes part: it sends no contribution, and holds every
    stream opened to it as a reducer, unanswered, until its sender gives up. Its round ends when the last of them
    has, so that its trainer keeps pace with the others' and it is grouped in every round they average in. Its
    registrations ask to be grouped apart from every member it was ever grouped with, as if they were absent."""
    given_up: OrderedDict[str, set[str]] = OrderedDict()  # round -> the members whose streams to it closed
    closed = asyncio.Condition()
    accused: set[str] = set()

    async def hold(self: AllReducer, info: object, reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter) -> None:
        try:
            request = await read_message(reader, pb.ReduceRequest, "?")
            while await reader.read(1 << 16):  # whatever it sends, until it closes the stream
                pass
        except (PeerdError, ConnectionError, OSError, asyncio.IncompleteReadError):
            return
        finally:
            writer.close()
        async with closed:
            remember(given_up, request.round_id, {*given_up.get(request.round_id, set()), str(getattr(info, "peer_id", "?"))}, 64)
            closed.notify_all()

    async def all_reduce(self: AllReducer, group: Group, flat: torch.Tensor, weight: float,
                         *args: Any, **kwargs: Any) -> tuple[torch.Tensor, RoundReport]:
        others = len(group.members) - 1
        accused.update(member for member in group.members if member != self.peer_id)
        with contextlib.suppress(TimeoutError):
            async with closed, asyncio.timeout(2 * self.config.round_timeout):
                await closed.wait_for(lambda: len(given_up.get(group.round_id, ())) >= others)
        return flat.clone(), RoundReport(group.round_id, len(group.members))

    AllReducer._handle_stream = hold  # type: ignore[method-assign]
    AllReducer.all_reduce = all_reduce  # type: ignore[method-assign]
    Absences.apart = lambda self: sorted(accused)[:MAX_APART]  # type: ignore[method-assign]


LIES: dict[str, Callable[[], None]] = {
    "absent": _absent,
    "pairs": _pairs,
    "expirations": _far_expirations,
    "time-zero": _time_zero,
    "first-and-silent": _first_and_silent,
}


if __name__ == "__main__" and sys.argv[1] == "flood":
    generate_identity(Path(sys.argv[5]))
    asyncio.run(flood(sys.argv[2], sys.argv[3], Path(sys.argv[4]), Path(sys.argv[5])))
elif __name__ == "__main__":
    at = sys.argv.index("--lie")
    for name in sys.argv[at + 1].split(","):
        LIES[name]()
    sys.argv = sys.argv[:at] + sys.argv[at + 2:]
    main()
