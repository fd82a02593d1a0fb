"""A private swarm with real processes: 3 members holding the secret train together and serve experts; a peer
with no secret and one with another secret join through the same bootstrap address and get nothing: no
round, no expert call, no state: they cannot read the members' records (sealed under the secret), and a
stranger that dials the members anyway is refused and logged with its peer id."""

from __future__ import annotations

import asyncio
import math
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from hivemind.p2p import P2P, PeerID

from peerd.averaging.allreduce import HANDLER_NAME as AVERAGING
from peerd.config import StreamLimits
from peerd.errors import MembershipError, StateError
from peerd.experts.calls import HANDLER_NAME as EXPERTS
from peerd.launcher import LocalSwarm, PeerProcess, wait_for
from peerd.training.transfer.download import StateDownloader
from peerd.training.transfer.probe import probe_state
from peerd.training.transfer.server import HANDLER_NAME as STATE
from peerd.wire import p2pd_control
from peerd.wire.guard import StreamGuard
from peerd.wire.membership import Membership, generate_secret, load_secret
from tests.helpers import MOE_CONFIG, experts_option, validations

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

HOST = experts_option(4)


@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[LocalSwarm]:
    config = tmp_path / "private.yaml"
    # state transfers only to peers behind: strangers join late, so they try; members start together and never
    # need one
    config.write_text(MOE_CONFIG.replace("run_name: peerd-moe-test", "run_name: peerd-private-test"))
    with LocalSwarm(config, log_dir=tmp_path) as local_swarm:
        yield local_swarm


def status(peer: PeerProcess) -> dict[str, Any]:
    return peer.status(timeout=10.0)


def good_calls(peer: PeerProcess) -> int:
    client = (status(peer)["experts"] or {}).get("client") or {"experts": {}}
    return sum(int(info.get(phase, {}).get("calls", 0)) - int(info.get(phase, {}).get("errors", 0))
               for info in client["experts"].values() for phase in ("forward", "backward"))


async def refused(p2p: P2P, attempt: Callable[[], Awaitable[Any]], error: type[Exception], member: str,
                  disconnects: Callable[[str], int]) -> None:
    """``attempt`` fails with ``error`` for a failed proof, and ``member`` then disconnects the dialer; the next
    attempt waits for that, so that it dials afresh instead of racing the disconnect. The member's count moves
    when its own daemon has closed the connection; the dialer's daemon may learn of it only later (or have dialed
    again meanwhile: the member is its bootstrap peer), and a stream opened on a connection the member dropped
    is reset. So the dialer then closes its own connections to the member too."""
    before = await asyncio.to_thread(disconnects, member)
    with pytest.raises(error, match="proof of the swarm secret failed"):
        await attempt()
    async with asyncio.timeout(30):
        while await asyncio.to_thread(disconnects, member) <= before:
            await asyncio.sleep(0.1)  # the count is read from the member's status
        await p2pd_control.disconnect(p2p, PeerID.from_base58(member))


async def dial_every_protocol(bootstrap: str, host: str, members: list[str], secrets: tuple[Path, Path],
                              fingerprint: str, disconnects: Callable[[str], int]) -> str:
    """Joins the DHT through ``bootstrap`` and opens each peerd protocol to each member that serves it (expert
    calls: the host) with another swarm's secret (``secrets[1]``): every open must be refused, after which the
    member disconnects the dialer (``disconnects``: a member's count of peers it disconnected), and a state
    download fails. With the swarm's own secret (``secrets[0]``) the same download gets the model: what the
    handshake keeps from strangers. Returns this dialer's peer id."""
    p2p = await P2P.create(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=[bootstrap])
    try:
        guard = StreamGuard(p2p, Membership(load_secret(secrets[1])), StreamLimits())
        for member in members:
            for protocol in (AVERAGING, STATE, EXPERTS) if member == host else (AVERAGING, STATE):
                await refused(p2p, lambda m=member, p=protocol: guard.open(m, p), MembershipError, member, disconnects)
        await refused(p2p, lambda: probe_state(guard, host, fingerprint, 1 << 30), StateError, host, disconnects)
        holder = StreamGuard(p2p, Membership(load_secret(secrets[0])), StreamLimits())
        layout = (await probe_state(holder, host, fingerprint, 1 << 30)).layout  # the dialer has no model of its own
        state = await StateDownloader(holder, fingerprint, layout, 1 << 30, rounds=1).download([host])
        assert state.step >= 5 and state.nbytes > 10_000
        return guard.peer_id
    finally:
        await p2p.shutdown()


def test_strangers_get_no_rounds_no_experts_no_state(swarm: LocalSwarm, tmp_path: Path) -> None:
    secret, other = tmp_path / "swarm.secret", tmp_path / "other.secret"
    generate_secret(secret)
    generate_secret(other)
    # members start together: a member that trained alone is believed by a joiner that sees nobody else, not by
    # two joiners that see each other at step 0 (docs: security, claims of progress and state)
    member = ["--swarm-secret", str(secret), "-o", "training.wait_for_peers=3"]
    host = swarm.add_peer([*member, "-o", f"experts={HOST}"], timeout=120)
    members = [host, *(swarm.spawn_peer(member) for _ in range(2))]
    for peer in members:
        peer.wait_ready(120)
    assert status(host)["membership"]["mode"] == "private (swarm secret)"
    wait_for(lambda: all((status(p)["training"]["validation_step"] or 0) >= 5 for p in members), 120,
             "members to validate at step 5", 0.5)
    first_validation = {p.peer_id: status(p)["training"]["validation_loss"] for p in members}
    first_step = {p.peer_id: status(p)["training"]["validation_step"] for p in members}

    strangers = [swarm.spawn_peer([]), swarm.spawn_peer(["--swarm-secret", str(other)])]
    for peer in strangers:
        peer.wait_ready(120)
    stranger_ids = {p.peer_id for p in strangers}
    assert status(strangers[0])["membership"]["mode"] == "open"
    # a stranger dialling every protocol directly, holding the other secret: refused by each
    by_id = {p.peer_id: p for p in members}
    dialer = asyncio.run(dial_every_protocol(host.ready["maddrs"][0], host.peer_id, list(by_id), (secret, other),
                                             status(host)["training"]["fingerprint"],
                                             lambda m: int(status(by_id[m])["membership"]["peers_disconnected"])))
    stranger_ids.add(dialer)

    def refused_everywhere() -> bool:
        # the strangers that joined as peers read no member's record (sealed under the secret, tagged with it),
        # so they never learn whom to dial and train alone; the dialer, who knows the addresses, is refused
        return all(dialer in status(p)["membership"]["refused_peers"] for p in members)

    wait_for(refused_everywhere, 90, "every member to refuse the dialer", 0.5)
    rounds_before = {p.peer_id: status(p)["training"]["rounds_ok"] for p in members}
    wait_for(lambda: all(status(p)["training"]["rounds_ok"] >= rounds_before[p.peer_id] + 3 for p in members),
             90, "members to average 3 more rounds with the strangers around", 0.5)
    for peer in strangers:  # no secret or another one: it sees no member
        assert not {p["peer_id"] for p in status(peer)["peers"]} & {m.peer_id for m in members}

    for peer in strangers:
        report = status(peer)["training"]
        assert report["rounds_ok"] == 0 and report["state_syncs"] == 0, report
        assert good_calls(peer) == 0
    # Learning is judged on the validations taken with the strangers around, by the best of them: 40 files
    # overfit within a few dozen steps at this lr, so the latest one may sit above an earlier minimum.
    wait_for(lambda: all(status(p)["training"]["validation_step"] >= first_step[p.peer_id] + 15 for p in members),
             120, "members to validate 15 steps later", 0.5)
    for peer in members:
        seen = status(peer)
        assert not stranger_ids & {p["peer_id"] for p in seen["peers"]}  # their records are not members'
        assert set(seen["training"]["group_sizes"]) <= {"2", "3"}, seen["training"]  # never 4 or 5 members
        refused = seen["membership"]["streams_refused"]
        assert sum(refused.values()) > 0 and seen["membership"]["streams_accepted"] > 0, refused
        log = Path(peer.log_path).read_text()
        assert f"Refused a stream from {dialer}" in log
        for stranger in stranger_ids:
            if stranger != dialer:  # the dialer got the state once, holding the secret
                assert not any("Sent training state" in line and stranger in line for line in log.splitlines())
        report = seen["training"]
        later = [loss for step, loss in validations(peer, timeout=10.0) if step > first_step[peer.peer_id]]
        assert math.isfinite(report["loss"]) and all(map(math.isfinite, later)), report
        assert min(later) < first_validation[peer.peer_id], (first_validation[peer.peer_id], later)
    for code in swarm.stop():
        assert code == 0
