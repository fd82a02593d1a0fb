"""Membership: secrets and allowlists, the stream handshake (both sides, every refusal, replay), the per-peer
limits, and a model that never takes a non-finite step."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Awaitable, Callable
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from peerd.config import TrainingConfig
from peerd.errors import ConfigError, MembershipError, ProtocolViolation
from peerd.proto import peerd_membership_pb2 as pb
from peerd.training.local import LocalModel
from peerd.wire import handshake
from peerd.wire.frames import read_frame, skip_frame, write_frame
from peerd.wire.limits import ByteBudget, PeerSlots, serving_budget
from peerd.wire.membership import Membership, generate_secret, load_allowlist, load_secret

pytestmark = pytest.mark.timeout(30)

ALICE = "12D3KooWAaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa"
BOB = "12D3KooWBbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbbb"
SECRET = Membership(bytes(range(32)))
OTHER_SECRET = Membership(bytes(32))
OPEN = Membership()
PROTOCOL = "peerd.v1.test"

Streams = tuple[asyncio.StreamReader, asyncio.StreamWriter]


async def _pair() -> tuple[Streams, Streams]:
    a, b = socket.socketpair()
    return await asyncio.open_connection(sock=a), await asyncio.open_connection(sock=b)


async def _handshake(initiator: Membership, responder: Membership,
                     admit: Callable[[], str | None] | None = None) -> tuple[BaseException | None, ...]:
    """Runs both sides (Alice opens to Bob); returns each side's error, or None where it succeeded."""
    (ra, wa), (rb, wb) = await _pair()

    async def side(fn: Callable[[], Awaitable[None]], writer: asyncio.StreamWriter) -> BaseException | None:
        try:
            await fn()
            return None
        except (MembershipError, ProtocolViolation) as e:
            return e
        finally:
            writer.close()

    return tuple(await asyncio.gather(
        side(lambda: handshake.initiate(ra, wa, initiator, ALICE, BOB, PROTOCOL), wa),
        side(lambda: handshake.accept(rb, wb, responder, BOB, ALICE, PROTOCOL, admit), wb),
    ))


def test_members_with_the_same_secret_get_through() -> None:
    assert asyncio.run(_handshake(SECRET, SECRET)) == (None, None)
    assert asyncio.run(_handshake(OPEN, OPEN)) == (None, None)


def test_a_members_slot_is_asked_for_only_after_its_proof() -> None:
    """The responder's admission (where the guard takes a member's stream slot) runs only for a peer whose
    proof checked out, and its refusal reaches the initiator as busy."""
    asked: list[str] = []

    def admit() -> str | None:
        asked.append("asked")
        return "too many streams open"

    initiator_error, responder_error = asyncio.run(_handshake(OTHER_SECRET, SECRET, admit))
    assert asked == [] and responder_error is not None and responder_error.context["code"] == "HANDSHAKE_BAD_PROOF"
    initiator_error, responder_error = asyncio.run(_handshake(SECRET, SECRET, admit))
    assert asked == ["asked"]
    assert isinstance(initiator_error, MembershipError) and initiator_error.context["code"] == "HANDSHAKE_BUSY"
    assert isinstance(responder_error, MembershipError) and responder_error.context["code"] == "HANDSHAKE_BUSY"
    assert asyncio.run(_handshake(SECRET, SECRET, lambda: None)) == (None, None)


@pytest.mark.parametrize("initiator, responder, code", [
    (OPEN, SECRET, "HANDSHAKE_NOT_A_MEMBER"),  # a stranger without the secret
    (OTHER_SECRET, SECRET, "HANDSHAKE_BAD_PROOF"),  # a stranger with another secret: caught by its own check
    (SECRET, OPEN, "HANDSHAKE_OPEN_SWARM"),  # a member knocking at an open swarm's peer is told so
])
def test_non_members_are_refused_with_a_reason(initiator: Membership, responder: Membership, code: str) -> None:
    opener, server = asyncio.run(_handshake(initiator, responder))
    assert isinstance(opener, MembershipError) and isinstance(server, MembershipError)
    assert ALICE in str(server) and BOB in str(opener)  # each side names the other
    if initiator.secret is not None and responder.secret is not None:  # the opener refused the responder first
        assert opener.context["code"] == server.context["code"] == code
    else:
        assert server.context["code"] == code == opener.context["code"]


def test_allowlists_are_checked_on_both_ends() -> None:
    only_bob = Membership(allowlist=frozenset({BOB}))
    only_alice = Membership(allowlist=frozenset({ALICE}))
    opener, _ = asyncio.run(_handshake(only_alice, OPEN))  # Alice does not admit Bob: she never dials
    assert isinstance(opener, MembershipError) and opener.context["code"] == "NOT_ON_ALLOWLIST"
    opener, server = asyncio.run(_handshake(OPEN, only_bob))  # Bob does not admit Alice
    assert isinstance(server, MembershipError) and server.context["code"] == "HANDSHAKE_NOT_A_MEMBER"
    assert asyncio.run(_handshake(only_bob, only_alice)) == (None, None)


def test_a_recorded_proof_does_not_open_another_stream() -> None:
    """An eavesdropper replays Alice's proof from one stream on a new one: the responder's fresh nonce is
    part of every proof, so the replay fails."""

    async def body() -> None:
        (ra, wa), (rb, wb) = await _pair()
        recorded: list[bytes] = []

        async def tap() -> None:  # Alice's side, recording her Hello and Proof as an eavesdropper would
            nonce = b"n" * 32
            await write_frame(wa, pb.Hello(version=1, nonce=nonce, has_secret=True).SerializeToString())
            recorded.append(nonce)
            challenge = pb.Challenge.FromString(await read_frame(ra, 1024, BOB, "challenge"))
            proof = SECRET.tag(b"peerd-handshake-v1/initiator", PROTOCOL.encode(), ALICE.encode(), BOB.encode(),
                               nonce, challenge.nonce)
            recorded.append(proof)
            await write_frame(wa, pb.Proof(proof=proof).SerializeToString())
            assert pb.Verdict.FromString(await read_frame(ra, 1024, BOB, "verdict")).code == pb.HANDSHAKE_OK

        await asyncio.gather(tap(), handshake.accept(rb, wb, SECRET, BOB, ALICE, PROTOCOL))
        for writer in (wa, wb):
            writer.close()

        (ra, wa), (rb, wb) = await _pair()

        async def replay() -> int:
            await write_frame(wa, pb.Hello(version=1, nonce=recorded[0], has_secret=True).SerializeToString())
            await read_frame(ra, 1024, BOB, "challenge")
            await write_frame(wa, pb.Proof(proof=recorded[1]).SerializeToString())
            code: int = pb.Verdict.FromString(await read_frame(ra, 1024, BOB, "verdict")).code
            wa.close()
            return code

        code, refused = await asyncio.gather(
            replay(), handshake.accept(rb, wb, SECRET, BOB, ALICE, PROTOCOL), return_exceptions=True)
        assert code == pb.HANDSHAKE_BAD_PROOF
        assert isinstance(refused, MembershipError)
        wb.close()

    asyncio.run(body())


def test_garbage_instead_of_a_hello_is_a_protocol_violation() -> None:
    async def body() -> BaseException | None:
        (_, wa), (rb, wb) = await _pair()
        await write_frame(wa, b"\xff" * 40)
        try:
            await handshake.accept(rb, wb, SECRET, BOB, ALICE, PROTOCOL)
        except ProtocolViolation as e:
            return e
        finally:
            wa.close()
            wb.close()
        return None

    assert isinstance(asyncio.run(body()), ProtocolViolation)


def test_secret_and_allowlist_files(tmp_path: Path) -> None:
    path = tmp_path / "swarm.secret"
    generate_secret(path)
    assert path.stat().st_mode & 0o777 == 0o600
    assert len(load_secret(path)) == 32
    with pytest.raises(ConfigError, match="already exists"):
        generate_secret(path)
    (tmp_path / "bad").write_text("not a secret\n")
    with pytest.raises(ConfigError, match="swarm.secret_path"):
        load_secret(tmp_path / "bad")
    (tmp_path / "allow").write_text(f"# operators\n{ALICE}  # alice's box\n\n{BOB}\n")
    assert load_allowlist(tmp_path / "allow") == {ALICE, BOB}
    (tmp_path / "allow").write_text(f"{ALICE}\nnot-a-peer\n")
    with pytest.raises(ConfigError, match=r"allow:2"):
        load_allowlist(tmp_path / "allow")


def test_stream_slots_and_byte_budgets_are_per_peer_and_shared() -> None:
    slots = PeerSlots(per_peer=2, total=3, bytes_per_peer=100, bytes_total=150)
    assert slots.acquire(ALICE) is not None and slots.acquire(ALICE) is not None
    assert slots.acquire(ALICE) is None  # her third stream
    bob = slots.acquire(BOB)
    assert bob is not None and slots.acquire(BOB) is None  # everyone's third
    alice = slots.budgets[ALICE]
    assert alice.try_reserve(100) and not alice.try_reserve(1)
    assert not bob.try_reserve(60)  # the shared 150 bytes hold only 50 more
    alice.release(100)
    assert bob.try_reserve(60)
    slots.release(ALICE)
    slots.release(ALICE)
    assert ALICE not in slots.budgets and slots.streams == 1


def test_frames_beyond_a_peers_budget_end_its_stream() -> None:
    async def body() -> None:
        reader = asyncio.StreamReader()
        reader.feed_data((2000).to_bytes(8, "little") + bytes(2000))
        token = serving_budget.set(ByteBudget(limit=1000))
        try:
            with pytest.raises(ProtocolViolation, match="in flight"):
                await read_frame(reader, 1 << 20, ALICE, "chunk")
        finally:
            serving_budget.reset(token)
        reader = asyncio.StreamReader()
        reader.feed_data((2000).to_bytes(8, "little") + bytes(2000))
        assert len(await read_frame(reader, 1 << 20, ALICE, "chunk")) == 2000  # our own reads: no budget

    asyncio.run(body())


def test_a_frame_writer_waits_while_the_other_side_reads_nothing() -> None:
    """drain() holds the writer back on every loop, CPython 3.12's and 3.13's selector transport included
    (whose writelines() alone never pauses the protocol before 3.12.9 and 3.13.2): frames sent to a peer that
    reads nothing do not pile up in memory."""
    async def body() -> None:
        (reader, reading_end), (_, writer) = await _pair()
        payload = bytes(8 << 20)
        task = asyncio.create_task(write_frame(writer, payload))
        try:
            done, _ = await asyncio.wait({task}, timeout=0.2)
            assert not done and writer.transport.get_write_buffer_size() > 0
            assert len(await read_frame(reader, len(payload), ALICE, "payload")) == len(payload)
            assert await task == 8 + len(payload)
        finally:
            writer.close()
            reading_end.close()

    asyncio.run(body())


def test_a_frame_written_to_a_lost_stream_fails_and_later_streams_still_work() -> None:
    """Both ends gone: the write raises like drain() does, and the socket that inherits the descriptor still
    reads (CPython 3.12's writelines() on a lost connection could leave the closed one registered)."""
    async def body() -> None:
        (_, lost), (_, other_end) = await _pair()
        other_end.transport.abort()
        lost.transport.abort()
        with pytest.raises(ConnectionResetError):
            await write_frame(lost, b"late")
        await asyncio.sleep(0)  # lets the loop close the lost socket, as it would before any next stream
        (reader, reading_end), (_, writer) = await _pair()
        try:
            await write_frame(writer, b"next")
            assert await asyncio.wait_for(read_frame(reader, 4, ALICE, "frame"), 5) == b"next"
        finally:
            writer.close()
            reading_end.close()

    asyncio.run(body())


def _task() -> Any:
    return SimpleNamespace(model=torch.nn.Linear(4, 1))  # LocalModel reads only the model


@pytest.mark.parametrize("optimizer", ["sgd", "adam"])
def test_a_step_that_would_make_the_model_non_finite_is_not_taken(optimizer: str) -> None:
    local = LocalModel(TrainingConfig.model_validate({"optimizer": optimizer, "lr": 10.0}), _task(), error_feedback=False)
    before = [p.detach().clone() for p in local.params]
    assert local.apply(torch.full((local.numel,), float("nan"))) is not None
    assert local.apply(torch.full((local.numel,), 3e38)) is not None  # finite, but the step overflows
    for p, old in zip(local.params, before):
        assert torch.equal(p.detach(), old)
    assert all(torch.isfinite(t).all() for t in local.state_tensors())
    assert local.apply(torch.full((local.numel,), 0.01)) is None  # and it still trains
    assert not torch.equal(local.params[0].detach(), before[0])


def test_a_refused_payload_is_skipped_without_being_held() -> None:
    async def body() -> None:
        reader = asyncio.StreamReader(limit=1 << 16)
        reader.feed_data((3 << 20).to_bytes(8, "little") + bytes(3 << 20) + (5).to_bytes(8, "little") + b"after")
        reader.feed_eof()
        await skip_frame(reader, 4 << 20, ALICE, "refused payload")
        assert await read_frame(reader, 16, ALICE, "next") == b"after"  # the stream is still in step
        reader = asyncio.StreamReader()
        reader.feed_data((100).to_bytes(8, "little") + bytes(10))
        reader.feed_eof()
        with pytest.raises(ProtocolViolation, match="10 of the 100"):
            await skip_frame(reader, 1000, ALICE, "refused payload")

    asyncio.run(body())
