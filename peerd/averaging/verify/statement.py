"""A reducer's signed statement about its span, and the seals and output signatures it builds on.

- A member's **seal** signs its whole contribution to a span: round, span, sizes, its claimed weight and the
  blake3 hash of every chunk payload it sent. The reducer checks it before signing its statement, so every row
  a statement includes is one its member committed to.
- The reducer signs each averaged chunk (**output signature**: round, span, chunk, hash of the payload), the
  same signature for every member, so an average a member received is provably the reducer's.
- The **statement** lists, per chunk, whose rows entered the average and with which coefficients, which rows
  are copies of an earlier one (robust rules count identical rows once), and the numbers the coefficients follow
  from: for centered_clip the medoid and the Gram matrix of the distinct rows, for fewer than 3 distinct rows
  their norms; per row, the member's weight, chunk hashes, seal and credentials.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from peerd.averaging.group import Group, is_state_round
from peerd.averaging.verify.keys import KeyBook, SigningKey, f64, open_signed, u64
from peerd.errors import ProtocolViolation
from peerd.proto import peerd_averaging_pb2 as pb

__all__ = ["Chunk", "Row", "Statement", "output_parts", "parse_statement", "seal_parts", "sign_statement"]

SEAL = b"peerd.v1.averaging.seal"
OUTPUT = b"peerd.v1.averaging.output"
STATEMENT = b"peerd.v1.averaging.statement"
MAX_STATEMENT_BYTES = 8 << 20


def seal_parts(round_id: str, span: int, numel: int, chunk_numel: int, weight: float,
               hashes: list[bytes]) -> tuple[bytes | str, ...]:
    return (round_id, u64(span), u64(numel), u64(chunk_numel), f64(weight), b"".join(hashes))


def output_parts(round_id: str, span: int, chunk: int, payload_hash: bytes) -> tuple[bytes | str, ...]:
    return (round_id, u64(span), u64(chunk), payload_hash)


@dataclass(frozen=True)
class Row:
    rank: int
    weight: float
    hashes: list[bytes]
    seal: bytes
    credentials: pb.Credentials


@dataclass(frozen=True)
class Chunk:
    included: list[int]  # ranks, ascending
    coefficients: list[float] | None  # None: trimmed_mean
    medoid: int  # position in `distinct`
    gram: torch.Tensor | None  # centered_clip: len(distinct) square, float64
    void: bool
    same_as: list[int]  # per included row, the position of the first row identical to it (its own if none)
    norms: torch.Tensor | None  # fewer than 3 distinct rows: their squared norms, float64

    @property
    def distinct(self) -> list[int]:
        """Positions in ``included`` of the rows that copy no earlier one."""
        return [i for i, first in enumerate(self.same_as) if first == i]


@dataclass(frozen=True)
class Statement:
    round_id: str
    span: int
    numel: int
    chunk_numel: int
    rule: str
    reducer: str
    credentials: pb.Credentials  # the reducer's
    rows: dict[int, Row]
    chunks: list[Chunk]
    signed: pb.Signed


def sign_statement(key: SigningKey, statement: pb.SpanStatement) -> pb.Signed:
    body = statement.SerializeToString()
    return pb.Signed(body=body, signature=key.sign(STATEMENT, body))


def parse_statement(signed: pb.Signed, group: Group, span: int, numel: int, chunk_numel: int,
                    keys: KeyBook) -> Statement:
    """The statement of span ``span`` of ``group``'s round, signed by its reducer; ProtocolViolation naming the
    reducer if it is not one (a bad signature, another round, sizes or ranks that do not add up)."""
    reducer = group.members[span]

    def bad(reason: str) -> ProtocolViolation:
        return ProtocolViolation(f"statement of {reducer} for span {span} of {group.round_id}: {reason}",
                                 peer_id=reducer)

    message = open_signed(signed, pb.SpanStatement, MAX_STATEMENT_BYTES, reducer, STATEMENT, lambda m: m.reducer,
                          keys, bad)
    if (message.round_id, message.span_index, message.span_numel, message.chunk_numel) != (
            group.round_id, span, numel, chunk_numel) or tuple(message.members) != group.members:
        raise bad("describes another round, span or group")
    if message.rule not in ("mean", "centered_clip", "trimmed_mean"):
        raise bad(f"unknown rule {message.rule[:40]!r}")
    count = max(1, -(-numel // chunk_numel))
    if len(message.chunks) != count:
        raise bad(f"{len(message.chunks)} chunks, expected {count}")
    rows: dict[int, Row] = {}
    for row in message.rows:
        if row.rank >= len(group.members) or row.rank in rows or len(row.chunk_hashes) > count or any(
                len(h) != 32 for h in row.chunk_hashes):
            raise bad(f"malformed row of rank {row.rank}")
        rows[row.rank] = Row(row.rank, row.weight, list(row.chunk_hashes), row.seal, row.credentials)
    try:
        agreeing = is_state_round(group.round_id)
        chunks = [_chunk(record, index, rows, agreeing) for index, record in enumerate(message.chunks)]
    except ValueError as e:
        raise bad(str(e)) from None
    return Statement(message.round_id, span, numel, chunk_numel, message.rule, reducer, message.reducer, rows, chunks,
                     signed)


def _chunk(record: pb.ChunkRecord, index: int, rows: dict[int, Row], agreeing: bool) -> Chunk:
    """One chunk's record; ValueError naming what does not fit. ``agreeing``: a state round, where identical
    rows are members that agree and a rule counts none as a copy."""
    included = list(record.included)
    n = len(included)
    if any(b <= a for a, b in itertools.pairwise(included)) or any(
            r not in rows or len(rows[r].hashes) <= index for r in included):
        raise ValueError(f"chunk {index} includes ranks without a row: {included[:64]}")
    if record.coefficients and len(record.coefficients) != n:
        raise ValueError(f"chunk {index}: {len(record.coefficients)} coefficients for {n} rows")
    same_as = list(record.same_as) or list(range(n))
    if len(same_as) != n or any(first > i or same_as[first] != first for i, first in enumerate(same_as)):
        raise ValueError(f"chunk {index}: copies that do not fit {n} rows")
    if agreeing and same_as != list(range(n)):
        raise ValueError(f"chunk {index}: copies in a state round, where identical rows are members that agree")
    k = sum(1 for i, first in enumerate(same_as) if first == i)
    gram = norms = None
    if record.gram:
        if len(record.gram) != k * k or record.medoid >= k:
            raise ValueError(f"chunk {index}: Gram matrix or medoid does not fit {k} distinct rows")
        gram = torch.tensor(list(record.gram), dtype=torch.float64).view(k, k)
    if record.norms:
        if len(record.norms) != k:
            raise ValueError(f"chunk {index}: {len(record.norms)} norms for {k} distinct rows")
        norms = torch.tensor(list(record.norms), dtype=torch.float64)
    coefficients = [float(c) for c in record.coefficients] if record.coefficients else None
    return Chunk(included, coefficients, record.medoid, gram, record.void, same_as, norms)
