"""Remote MoE with real processes: expert hosts + a trainer learn together, survive a killed host, refuse junk."""

from __future__ import annotations

import asyncio
import math
import signal
import struct
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from hivemind.p2p import P2P

from peerd.config import StreamLimits
from peerd.errors import ProtocolViolation
from peerd.experts.calls import HANDLER_NAME, wire_codec
from peerd.experts.records import PROTOCOL_VERSION
from peerd.launcher import LocalSwarm, wait_for
from peerd.proto import peerd_experts_pb2 as pb
from peerd.wire import codec
from peerd.wire.frames import read_frame, read_message, write_frame, write_message
from peerd.wire.guard import StreamGuard
from peerd.wire.membership import Membership
from tests.helpers import (
    EXPERTS_TTL,
    LISTEN,
    MOE_CONFIG,
    MOE_HIDDEN,
    called,
    calls_to,
    experts,
    host_args,
    training,
)

pytestmark = pytest.mark.integration

@pytest.fixture
def swarm(tmp_path: Path) -> Iterator[LocalSwarm]:
    config = tmp_path / "moe.yaml"
    config.write_text(MOE_CONFIG)
    with LocalSwarm(config, log_dir=tmp_path) as local_swarm:
        yield local_swarm


@pytest.mark.timeout(180)
def test_moe_lm_learns_with_two_expert_hosts_and_survives_losing_one(swarm: LocalSwarm) -> None:
    host0 = swarm.add_peer(host_args(0))
    host1 = swarm.spawn_peer(host_args(2))
    trainer = swarm.spawn_peer()
    for peer in (host1, trainer):
        peer.wait_ready(60)
    hosts = {host0: ["ffn.1.0", "ffn.1.1"], host1: ["ffn.1.2", "ffn.1.3"]}

    # the hosts advertise their experts in their peer records too
    def advertised() -> bool:
        records = {p["peer_id"]: p for p in trainer.status()["peers"]}
        return all(
            records.get(h.peer_id, {}).get("capabilities", {}).get("experts") == uids
            for h, uids in hosts.items()
        )

    wait_for(advertised, 30, "the hosts' records to list their experts")

    def all_experts_learned() -> bool:
        return all(
            experts(host)["server"]["experts"][uid]["updates"] > 0
            for host, uids in hosts.items()
            for uid in uids
        )

    wait_for(lambda: training(trainer)["step"] >= 12, 90, "the MoE trainer to reach step 12", 0.5)
    wait_for(all_experts_learned, 60, "every expert to be trained by the trainer's backward calls", 0.5)
    report = training(trainer)
    assert report["loss"] < math.log(256) - 1.0, report  # from ~5.55 nats/byte: it learns
    for host, uids in hosts.items():
        served = experts(host)["server"]["experts"]
        for uid in uids:
            assert served[uid]["distance_from_init"] > 0, served[uid]  # its parameters moved: it learned
            assert served[uid]["forward"]["calls"] > 0 and served[uid]["forward"]["errors"] == 0
            # one call per (expert, pass) carries many tokens: never one call per token or sample
            assert served[uid]["forward"]["tokens"] >= 20 * served[uid]["forward"]["calls"]
            # backward calls went through the activations kept from their forward calls (no recompute)
            assert served[uid]["backward_from_kept_graph"] > 0, served[uid]
    layer = experts(trainer)["client"]["layers"]["ffn.1"]
    # a first call may be slow on a loaded machine (and time out), but tokens rarely lack every expert
    assert layer["fallback_tokens"] <= 0.1 * layer["tokens"], (sorted(layer.items()), trainer.log_tail(40))

    # SIGKILL one host mid-training: training goes on, its experts leave routing once their records expire
    step_at_kill = training(trainer)["step"]
    killed_at = time.monotonic()
    host1.proc.kill()
    host1.proc.wait(10)
    wait_for(
        lambda: not any(called(trainer, uid).get("announced") for uid in hosts[host1]),
        30,
        "the killed host's experts to vanish from the trainer's view",
        0.2,
    )
    vanished_after = time.monotonic() - killed_at
    assert vanished_after < EXPERTS_TTL + 4.0, vanished_after
    wait_for(lambda: training(trainer)["step"] >= step_at_kill + 6, 90, "6 more steps after the kill", 0.5)
    for uid in hosts[host1]:  # back-off: a dead expert costs a few failed calls, not one per pass
        info = called(trainer, uid)
        failures = info.get("forward", {}).get("errors", 0) + info.get("backward", {}).get("errors", 0)
        assert failures <= 6, info
    for uid in hosts[host0]:
        assert calls_to(trainer, uid) > 0
    assert math.isfinite(training(trainer)["loss"])

    # the host comes back (new identity, same experts): it is used again
    before = {uid: calls_to(trainer, uid) for uid in hosts[host1]}
    swarm.add_peer(host_args(2))
    wait_for(
        lambda: all(calls_to(trainer, uid) > before[uid] for uid in hosts[host1]),
        60,
        "the restarted host's experts to be called again",
        0.5,
    )
    for peer in swarm.peers:
        if peer is not host1:
            assert peer.stop() == 0, peer.log_tail()


async def _raw_call(
    p2p: P2P, host: str, request: pb.ExpertRequest, frames: list[bytes], raw_header: bytes | None = None
) -> tuple[pb.ExpertResponse | None, bytes]:
    reader, writer = await StreamGuard(p2p, Membership(), StreamLimits()).open(host, HANDLER_NAME)
    try:
        if raw_header is not None:
            await write_frame(writer, raw_header)
        else:
            await write_message(writer, request)
        try:
            for frame in frames:
                await write_frame(writer, frame)
        except ConnectionError:
            pass  # the host refused the header and closed the stream before reading the payload; read why
        try:
            response = await asyncio.wait_for(read_message(reader, pb.ExpertResponse, host), 10)
        except (ProtocolViolation, ConnectionError, TimeoutError):  # dropped without an answer
            return None, b""
        data = await read_frame(reader, 1 << 20, host, "result") if response.code == pb.EXPERT_OK else b""
        return response, data
    finally:
        writer.close()


def _request(
    uid: str = "ffn.1.0",
    phase: int = pb.EXPERT_FORWARD,
    tokens: int = 4,
    hidden: int = MOE_HIDDEN,
    frames: list[bytes] | None = None,
    version: int = PROTOCOL_VERSION,
    call_id: int = 0,
) -> pb.ExpertRequest:
    return pb.ExpertRequest(
        protocol_version=version,
        expert_uid=uid,
        phase=phase,
        num_tokens=tokens,
        hidden_dim=hidden,
        payload_bytes=[len(f) for f in frames or []],
        lossless=True,
        call_id=call_id,
    )


def _tensor(rows: int, nan: bool = False) -> bytes:
    data = bytearray(codec.encode(torch.randn(rows, MOE_HIDDEN), wire_codec(lossless=True)))
    if nan:
        struct.pack_into("<f", data, len(data) - 4, math.nan)
    return bytes(data)


@pytest.mark.parametrize("transport", LISTEN)
@pytest.mark.timeout(120)
def test_malformed_calls_are_refused_with_a_reason_and_the_host_keeps_serving(
    swarm: LocalSwarm, transport: str
) -> None:
    # refusals are the paths that close streams early; QUIC drops what a stream closed with input unread held
    listen = LISTEN[transport]
    host = swarm.add_peer([*host_args(0), "--host-maddrs", listen])
    good, nan = _tensor(4), _tensor(4, nan=True)
    cases: list[tuple[str, pb.ExpertRequest, list[bytes], int | None, str]] = [
        ("unknown uid", _request(uid="ffn.9.9", frames=[good]), [good], pb.EXPERT_UNKNOWN, "ffn.9.9"),
        ("old version", _request(frames=[good], version=7), [good], pb.EXPERT_BAD_REQUEST, "version"),
        (
            "wrong width",
            _request(hidden=MOE_HIDDEN + 1, frames=[good]),
            [good],
            pb.EXPERT_BAD_REQUEST,
            "hidden_dim",
        ),
        ("no tokens", _request(tokens=0, frames=[good]), [good], pb.EXPERT_BAD_REQUEST, "num_tokens"),
        (
            "too many tokens",
            _request(tokens=10**6, frames=[good]),
            [good],
            pb.EXPERT_BAD_REQUEST,
            "num_tokens",
        ),
        ("no phase", _request(phase=0, frames=[good]), [good], pb.EXPERT_BAD_REQUEST, "phase"),
        (
            "missing gradient",
            _request(phase=pb.EXPERT_BACKWARD, frames=[good]),
            [good],
            pb.EXPERT_BAD_REQUEST,
            "2 tensors",
        ),
        (
            "backward by id, with inputs",
            _request(phase=pb.EXPERT_BACKWARD, frames=[good, good], call_id=3),
            [good, good],
            pb.EXPERT_BAD_REQUEST,
            "by call_id carries 1 tensors",
        ),
        ("NaN input", _request(frames=[nan]), [nan], pb.EXPERT_BAD_PAYLOAD, "NaN"),
        (
            "NaN gradient",
            _request(phase=pb.EXPERT_BACKWARD, frames=[good, nan]),
            [good, nan],
            pb.EXPERT_BAD_PAYLOAD,
            "NaN",
        ),
        ("wrong shape", _request(tokens=5, frames=[good]), [good], pb.EXPERT_BAD_PAYLOAD, "shape"),
        ("not a tensor", _request(frames=[b"x" * 64]), [b"x" * 64], pb.EXPERT_BAD_PAYLOAD, "invalid codec"),
        (
            "oversized frame",
            pb.ExpertRequest(
                protocol_version=PROTOCOL_VERSION,
                expert_uid="ffn.1.0",
                phase=pb.EXPERT_FORWARD,
                num_tokens=4,
                hidden_dim=MOE_HIDDEN,
                payload_bytes=[10**7],
            ),
            [],
            pb.EXPERT_BAD_REQUEST,
            "exceeds",
        ),
    ]

    async def body() -> list[str]:
        p2p = await P2P.create(host_maddrs=[listen], initial_peers=host.ready["maddrs"][:1])
        problems = []
        try:
            for name, request, frames, code, text in cases:
                response, _ = await _raw_call(p2p, host.peer_id, request, frames)
                if response is None or response.code != code or text not in response.message:
                    problems.append(f"{name}: got {response}")
            response, _ = await _raw_call(p2p, host.peer_id, _request(), [], raw_header=b"\xff" * 40)
            if response is not None:  # not a protobuf: the stream is dropped
                problems.append(f"garbage header answered: {response}")
            # the host still serves valid calls: forward, then backward (one update)
            response, data = await _raw_call(p2p, host.peer_id, _request(frames=[good]), [good])
            assert response is not None and response.code == pb.EXPERT_OK, response
            assert codec.decode(data, peer_id=host.peer_id).shape == (4, MOE_HIDDEN)
            grad = _tensor(4)
            # a backward by an id the host never kept activations for: not an error, "send the inputs"
            gone = _request(phase=pb.EXPERT_BACKWARD, frames=[grad], call_id=99)
            response, _ = await _raw_call(p2p, host.peer_id, gone, [grad])
            assert response is not None and response.code == pb.EXPERT_ACTIVATIONS_GONE, response
            response, data = await _raw_call(
                p2p, host.peer_id, _request(phase=pb.EXPERT_BACKWARD, frames=[good, grad]), [good, grad]
            )
            assert response is not None and response.code == pb.EXPERT_OK, response
        finally:
            await p2p.shutdown()
        return problems

    problems = asyncio.run(body())
    assert not problems, "\n".join(problems)
    served = experts(host)["server"]
    assert served["rejected_calls"] >= len(cases)
    # only the valid backward changes the parameters (its step runs just after its answer was sent)
    updates = wait_for(lambda: experts(host)["server"]["experts"]["ffn.1.0"]["updates"], 10, "the update")
    assert updates == 1
    assert host.proc.poll() is None
    assert host.stop(signal.SIGTERM) == 0


@pytest.mark.timeout(120)
def test_a_peer_that_serves_and_trains_calls_its_own_experts_in_process(swarm: LocalSwarm) -> None:
    """libp2p cannot dial itself: a peer's model reaches the experts it serves without the network."""
    experts_section = f"{{uid_prefix: 'ffn.1.', count: 4, hidden_dim: {MOE_HIDDEN}, ffn_dim: 64}}"
    peer = swarm.add_peer(["-o", f"experts={experts_section}"])
    wait_for(lambda: training(peer)["step"] >= 5, 90, "the peer to train 5 steps on its own experts", 0.5)
    section = experts(peer)
    for uid in ("ffn.1.0", "ffn.1.1", "ffn.1.2", "ffn.1.3"):
        caller = section["client"]["experts"][uid]
        assert caller["forward"]["calls"] > 0 and caller["forward"]["errors"] == 0, caller
        assert section["server"]["experts"][uid]["updates"] > 0
    assert section["client"]["layers"]["ffn.1"]["fallback_tokens"] == 0
    assert peer.stop() == 0
