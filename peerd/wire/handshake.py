"""The membership handshake that starts every peerd stream (``protocols/peerd_membership.proto``).

Both sides prove they hold the swarm secret, bound to both libp2p peer ids (which libp2p's secure channel
has already authenticated), to the protocol and to two fresh nonces, before the protocol's own payload moves
in either direction: a responder reads no payload from a stranger, and an initiator sends no gradient, state
or activations to one. It costs two round trips per stream; expert calls reuse their streams.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Callable

from google.protobuf.message import DecodeError, Message

from peerd.errors import MembershipError, ProtocolViolation
from peerd.proto import peerd_membership_pb2 as pb
from peerd.wire.frames import read_frame, wait_for_close, write_frame
from peerd.wire.membership import Membership

__all__ = ["VERSION", "accept", "initiate", "refuse"]

VERSION = 1
NONCE_BYTES = 32
MAX_MESSAGE_BYTES = 1024
_INITIATOR = b"peerd-handshake-v1/initiator"
_RESPONDER = b"peerd-handshake-v1/responder"


def _proof(membership: Membership, label: bytes, protocol: str, initiator: str, responder: str,
           nonces: tuple[bytes, bytes]) -> bytes:
    return membership.tag(label, protocol.encode(), initiator.encode(), responder.encode(), *nonces)


async def _read(reader: asyncio.StreamReader, kind: type[Message], peer: str) -> Message:
    data = await read_frame(reader, MAX_MESSAGE_BYTES, peer, f"handshake {kind.__name__}")
    try:
        return kind.FromString(data)
    except DecodeError as e:
        raise ProtocolViolation(f"{peer} sent a malformed handshake {kind.__name__}: {e}", peer_id=peer) from e


def _refused(peer: str, code: int, message: str, by_us: bool) -> MembershipError:
    name = pb.HandshakeCode.Name(code) if code in pb.HandshakeCode.values() else f"code {code}"
    text = f"refused {peer}: {message}" if by_us else f"{peer} refused us: {message}"
    return MembershipError(f"{text} ({name})", peer_id=peer, code=name)


async def initiate(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, membership: Membership,
                   me: str, peer: str, protocol: str) -> None:
    """The opening side. Returns once ``peer`` accepted us and proved membership; else MembershipError
    (a refusal, either way) or ProtocolViolation (a garbled handshake)."""
    if not membership.admits(peer):
        raise MembershipError(f"{peer} is not on this swarm's allowlist", peer_id=peer, code="NOT_ON_ALLOWLIST")
    nonce = secrets.token_bytes(NONCE_BYTES)
    await write_frame(writer, pb.Hello(version=VERSION, nonce=nonce, has_secret=membership.secret is not None)
                      .SerializeToString())
    challenge = await _read(reader, pb.Challenge, peer)
    assert isinstance(challenge, pb.Challenge)
    if challenge.code != pb.HANDSHAKE_OK:
        raise _refused(peer, challenge.code, challenge.message[:300], by_us=False)
    if challenge.version != VERSION or len(challenge.nonce) != NONCE_BYTES:
        raise ProtocolViolation(f"{peer} sent a handshake challenge of version {challenge.version} with a "
                                f"{len(challenge.nonce)}-byte nonce", peer_id=peer)
    nonces = (nonce, challenge.nonce)
    if not membership.check_tag(challenge.proof, _RESPONDER, protocol.encode(), me.encode(), peer.encode(),
                                *nonces):
        # an empty proof, so that the responder logs a failed proof from us rather than a broken stream
        await write_frame(writer, pb.Proof().SerializeToString())
        raise MembershipError(f"{peer} is not a member of this swarm: its proof of the swarm secret failed",
                              peer_id=peer, code="HANDSHAKE_BAD_PROOF")
    proof = _proof(membership, _INITIATOR, protocol, me, peer, nonces)
    await write_frame(writer, pb.Proof(proof=proof).SerializeToString())
    verdict = await _read(reader, pb.Verdict, peer)
    assert isinstance(verdict, pb.Verdict)
    if verdict.code != pb.HANDSHAKE_OK:
        raise _refused(peer, verdict.code, verdict.message[:300], by_us=False)


async def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, membership: Membership,
                 me: str, peer: str, protocol: str, admit: Callable[[], str | None] | None = None) -> None:
    """The serving side. Returns once ``peer`` proved membership; else tells it why, lets it read that, and
    raises MembershipError (or ProtocolViolation for a garbled handshake). The caller closes the stream.

    ``admit`` runs once the proof checked out, before the verdict: a reason to refuse the stream as busy (the
    caller takes a member's stream slot there, so only a proven member can take one), or None."""
    hello = await _read(reader, pb.Hello, peer)
    assert isinstance(hello, pb.Hello)
    if hello.version != VERSION:
        await refuse(reader, writer, pb.HANDSHAKE_VERSION, f"handshake version {hello.version}, this peer "
                     f"speaks {VERSION} (upgrade peerd)")
        raise _refused(peer, pb.HANDSHAKE_VERSION, f"handshake version {hello.version}", by_us=True)
    if len(hello.nonce) != NONCE_BYTES:
        await refuse(reader, writer, pb.HANDSHAKE_MALFORMED, f"nonce of {len(hello.nonce)} bytes")
        raise _refused(peer, pb.HANDSHAKE_MALFORMED, f"nonce of {len(hello.nonce)} bytes", by_us=True)
    problem = _membership_problem(membership, peer, hello.has_secret)
    if problem is not None:
        code, reason = problem
        await refuse(reader, writer, code, reason)
        raise _refused(peer, code, reason, by_us=True)
    nonces = (hello.nonce, secrets.token_bytes(NONCE_BYTES))
    await write_frame(writer, pb.Challenge(
        version=VERSION, code=pb.HANDSHAKE_OK, nonce=nonces[1],
        proof=_proof(membership, _RESPONDER, protocol, peer, me, nonces),
    ).SerializeToString())
    proof = await _read(reader, pb.Proof, peer)
    assert isinstance(proof, pb.Proof)
    if not membership.check_tag(proof.proof, _INITIATOR, protocol.encode(), peer.encode(), me.encode(), *nonces):
        reason = "its proof of the swarm secret failed (another secret?)"
        await _answer(reader, writer, pb.Verdict(code=pb.HANDSHAKE_BAD_PROOF, message=reason))
        raise _refused(peer, pb.HANDSHAKE_BAD_PROOF, reason, by_us=True)
    busy = admit() if admit is not None else None
    if busy is not None:
        await _answer(reader, writer, pb.Verdict(code=pb.HANDSHAKE_BUSY, message=busy))
        raise _refused(peer, pb.HANDSHAKE_BUSY, busy, by_us=True)
    await write_frame(writer, pb.Verdict(code=pb.HANDSHAKE_OK).SerializeToString())


def _membership_problem(
    membership: Membership, peer: str, has_secret: bool
) -> tuple[pb.HandshakeCode, str] | None:
    if not membership.admits(peer):
        return pb.HANDSHAKE_NOT_A_MEMBER, "this swarm is private and your peer id is not on its allowlist"
    if membership.secret is not None and not has_secret:
        return pb.HANDSHAKE_NOT_A_MEMBER, ("this swarm is private: start with the swarm's secret "
                                          "(--swarm-secret PATH, swarm.secret_path)")
    if membership.secret is None and has_secret:
        return pb.HANDSHAKE_OPEN_SWARM, "this peer runs an open swarm (no swarm secret); yours has one"
    return None


async def refuse(
    reader: asyncio.StreamReader, writer: asyncio.StreamWriter, code: pb.HandshakeCode, message: str
) -> None:
    """Answers a stream with a refusal in place of the Challenge, and lets the initiator read it before the
    caller closes (closing with input unread can drop the answer inside p2pd: frames.wait_for_close)."""
    await _answer(reader, writer, pb.Challenge(version=VERSION, code=code, message=message))


async def _answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter, refusal: Message) -> None:
    """Best effort: the refused side may already have closed, and the refusal stands either way."""
    try:
        await write_frame(writer, refusal.SerializeToString())
    except (ConnectionError, OSError):
        return
    await wait_for_close(reader)
