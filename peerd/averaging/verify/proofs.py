"""Proofs: what a member that caught a liar sends the others of its round, and how each checks one itself.

A proof holds only what its accused signed (a reducer's statement and output signature, a member's seal and
samples) and the payloads those signatures name, so checking it needs no trust in whoever sent it: the checks
are those of the challenge (disputes.py), run again. A reducer that did not answer a challenge leaves no proof;
its challenger sends what it has, the reducer's signed average of the chunk, and a member holding a different
average of the same chunk signed by the same reducer has one: two averages where there is one.
"""

from __future__ import annotations

from dataclasses import dataclass

from google.protobuf.message import DecodeError

from peerd.averaging.group import Group
from peerd.averaging.layout import chunk_bounds, max_payload_bytes
from peerd.averaging.verify.disputes import judge_chunk, misstated_row, output_signed
from peerd.averaging.verify.keys import KeyBook
from peerd.averaging.verify.samples import MemberSamples, parse_samples
from peerd.averaging.verify.statement import OUTPUT, Statement, output_parts, parse_statement
from peerd.config import AveragingConfig
from peerd.errors import ProtocolViolation
from peerd.proto import peerd_averaging_pb2 as pb

__all__ = ["Evidence", "bad_reduction", "check_proof", "equivocation", "false_samples", "two_averages"]

MAX_MEMBERS = 64


@dataclass(frozen=True)
class Evidence:
    proof: pb.ReductionProof
    frames: list[bytes]


def bad_reduction(statement: Statement, index: int, out: bytes, signature: bytes, rows: dict[int, bytes]) -> Evidence:
    proof = pb.ReductionProof(kind=pb.BAD_REDUCTION, accused=statement.reducer, statement=statement.signed,
                     chunk_index=index, output_signature=signature)
    return Evidence(proof, [out] + [rows[r] for r in statement.chunks[index].included])


def false_samples(statement: Statement, index: int, member: MemberSamples, rank: int, row: bytes) -> Evidence:
    proof = pb.ReductionProof(kind=pb.FALSE_SAMPLES, accused=member.member, statement=statement.signed, chunk_index=index,
                     samples=member.signed, accused_rank=rank)
    return Evidence(proof, [row])


def equivocation(statement: Statement, index: int, one: tuple[bytes, bytes], other: tuple[bytes, bytes]) -> Evidence:
    """Two (hash, signature) pairs of one chunk's average by the statement's reducer."""
    proof = pb.ReductionProof(kind=pb.EQUIVOCATION, accused=statement.reducer, statement=statement.signed,
                     chunk_index=index, output_hash=one[0], output_signature=one[1], other_hash=other[0],
                     other_signature=other[1])
    return Evidence(proof, [])


def frames_expected(proof: pb.ReductionProof, statement: Statement) -> int:
    if proof.kind == pb.BAD_REDUCTION:
        return 1 + len(statement.chunks[proof.chunk_index].included)
    return 1 if proof.kind == pb.FALSE_SAMPLES else 0


def read_statement(signed: pb.Signed, keys: KeyBook) -> tuple[Statement, Group]:
    """A statement on its own (no round of ours to compare it with); ProtocolViolation if it is not one."""
    try:
        body = pb.SpanStatement.FromString(signed.body)
    except DecodeError:
        raise ProtocolViolation("a proof's statement is malformed", peer_id="unknown") from None
    if not 0 < len(body.members) <= MAX_MEMBERS or body.span_index >= len(body.members) or body.chunk_numel < 1 \
            or body.span_numel > body.chunk_numel * 4096:
        raise ProtocolViolation("a proof's statement has an impossible shape", peer_id="unknown")
    group = Group(body.round_id, tuple(body.members))
    return parse_statement(signed, group, body.span_index, body.span_numel, body.chunk_numel, keys), group


def frame_limit(statement: Statement, index: int) -> int:
    a, b = chunk_bounds(statement.numel, statement.chunk_numel)[index]
    return max_payload_bytes(b - a)


def check_proof(proof: pb.ReductionProof, statement: Statement, group: Group, frames: list[bytes], config: AveragingConfig,
                keys: KeyBook) -> str | None:
    """Why ``proof.accused`` is guilty, or None if the proof does not show it."""
    index = proof.chunk_index
    if index >= len(statement.chunks) or len(frames) != frames_expected(proof, statement):
        return None
    if proof.kind == pb.BAD_REDUCTION:
        if proof.accused != statement.reducer or not output_signed(statement, index, frames[0],
                                                                    proof.output_signature, keys):
            return None
        rows = dict(zip(statement.chunks[index].included, frames[1:], strict=True))
        return judge_chunk(statement, index, group, rows, frames[0], {}, config, keys).reducer
    if proof.kind == pb.FALSE_SAMPLES:
        rank = proof.accused_rank
        if rank >= len(group.members) or group.members[rank] != proof.accused:
            return None
        member = parse_samples(proof.samples, proof.accused, statement.round_id,
                               pb.MemberSamples.FromString(proof.samples.body).seed,
                               {statement.span: chunk_bounds(statement.numel, statement.chunk_numel)},
                               config.codec.block_size, keys)
        return misstated_row(statement, index, group, rank, frames[0], member, config, keys)
    if proof.kind == pb.EQUIVOCATION and proof.accused == statement.reducer:
        pairs = ((bytes(proof.output_hash), bytes(proof.output_signature)),
                 (bytes(proof.other_hash), bytes(proof.other_signature)))
        return two_averages(statement, index, *pairs, keys)
    return None


def two_averages(statement: Statement, index: int, one: tuple[bytes, bytes], other: tuple[bytes, bytes],
                 keys: KeyBook) -> str | None:
    """Why the reducer is guilty if it signed both (hash, signature) pairs for chunk ``index`` and they differ."""
    if one[0] == other[0] or not all(
            keys.valid(statement.credentials, statement.reducer, signature, OUTPUT,
                       *output_parts(statement.round_id, statement.span, index, digest))
            for digest, signature in (one, other)):
        return None
    return f"it signed two different averages of chunk {index} of span {statement.span}"
