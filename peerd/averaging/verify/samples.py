"""A member's samples: what it reveals of its own rows once the round's seed is known.

For every span it has a row in (the span it reduces included), per chunk: its decoded row at the sampled
coordinates, its envelope and norm per coarse block, and (robust rules) its sketch. It signs them, so a member
that misstates its own row to make an honest reducer's average look wrong is caught when that reducer reveals
the sealed row (disputes.py).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy
import torch

from peerd.averaging.verify.keys import KeyBook, SigningKey, open_signed
from peerd.averaging.verify.payloads import COARSE_BLOCKS
from peerd.averaging.verify.randomness import SAMPLES, SKETCH_SIZE, RoundRandomness
from peerd.errors import ProtocolViolation
from peerd.proto import peerd_averaging_pb2 as pb

__all__ = ["MemberSamples", "OwnRow", "SpanRows", "build_samples", "parse_samples", "row_samples", "sign_samples"]

LABEL = b"peerd.v1.averaging.samples"
MAX_SAMPLES_BYTES = 16 << 20


@dataclass
class OwnRow:
    """This member's decoded row in one span, its chunks' bounds, envelopes and block norms (filled while it is
    sent)."""

    row: torch.Tensor
    chunks: list[tuple[int, int]]
    envelopes: list[torch.Tensor]
    norms: list[torch.Tensor]  # per chunk, payloads.block_norms of its row
    counts: list[int] = field(default_factory=list)  # elements each chunk's payload carried by position (top-k)


@dataclass(frozen=True)
class SpanRows:
    """What one member states about its row in one span, per chunk."""

    values: list[torch.Tensor]  # float64, at the chunk's sampled coordinates
    envelope: list[torch.Tensor]  # float64, per coarse block
    norms: list[torch.Tensor]  # float64, per coarse block: the row's L2 norm there
    sketch: list[torch.Tensor] | None  # float64, SKETCH_SIZE projections
    outputs: list[tuple[bytes, bytes]]  # (hash, reducer's signature) of each average it received


@dataclass(frozen=True)
class MemberSamples:
    member: str
    seed: bytes
    spans: dict[int, SpanRows]
    signed: pb.Signed


def sample_count(length: int) -> int:
    return SAMPLES if length > 0 else 0


def envelope_count(length: int, block_size: int) -> int:
    return -(-length // (COARSE_BLOCKS * block_size))


def build_samples(key: SigningKey, round_id: str, randomness: RoundRandomness, rows: dict[int, OwnRow],
                  with_sketch: bool, outputs: dict[int, dict[int, tuple[bytes, bytes, bytes]]]) -> pb.Signed:
    """``outputs``: span -> chunk -> (payload, signature, hash) of the averages this member received."""
    return sign_samples(key, row_samples(key, round_id, randomness, rows, with_sketch), outputs)


def row_samples(key: SigningKey, round_id: str, randomness: RoundRandomness, rows: dict[int, OwnRow],
                with_sketch: bool) -> pb.MemberSamples:
    """What this member's samples say of its ``rows`` (span -> its row there), before the averages it received
    are added (:func:`sign_samples`): its rows are sealed as they go out, well before the last average is in,
    and projecting them is most of the work."""
    message = pb.MemberSamples(round_id=round_id, member=key.peer_id, seed=randomness.seed,
                               credentials=key.credentials)
    for span, own in sorted(rows.items()):
        entry = message.spans.add(span_index=span)
        at = [randomness.offsets(span, index, b - a) + a for index, (a, b) in enumerate(own.chunks)]
        entry.values.extend(own.row[torch.cat(at)].tolist() if at else [])
        entry.envelope.extend(torch.cat(own.envelopes).tolist() if own.envelopes else [])
        entry.block_norms.extend(torch.cat(own.norms).tolist() if own.norms else [])
        if with_sketch and own.chunks:
            entry.sketch.extend(torch.cat([randomness.sketch(span, index, own.row[a:b])
                                           for index, (a, b) in enumerate(own.chunks)]).tolist())
    return message


def sign_samples(key: SigningKey, message: pb.MemberSamples,
                 outputs: dict[int, dict[int, tuple[bytes, bytes, bytes]]]) -> pb.Signed:
    """``message`` (:func:`row_samples`) with the hash and signature of every average this member received in
    each of its spans, in chunk order up to the first missing one, signed."""
    for entry in message.spans:
        received = outputs.get(entry.span_index, {})
        index = 0
        while index in received:
            _, signature, digest = received[index]
            entry.output_hashes.append(digest)
            entry.output_signatures.append(signature)
            index += 1
    body = message.SerializeToString()
    return pb.Signed(body=body, signature=key.sign(LABEL, body))


def _doubles(field: Iterable[float]) -> torch.Tensor:
    # numpy reads a repeated double field at once (torch.tensor goes element by element, ~250x slower)
    return torch.from_numpy(numpy.array(field, dtype=numpy.float64))


def parse_samples(signed: pb.Signed, member: str, round_id: str, seed: bytes,
                  layout: dict[int, list[tuple[int, int]]], block_size: int, keys: KeyBook) -> MemberSamples:
    """``member``'s samples for the spans in ``layout`` (span -> chunk bounds) it states (others are skipped);
    ProtocolViolation naming it if they are not its, not of this round and seed, or do not fit the layout."""

    def bad(reason: str) -> ProtocolViolation:
        return ProtocolViolation(f"samples of {member} in {round_id}: {reason}", peer_id=member)

    message = open_signed(signed, pb.MemberSamples, MAX_SAMPLES_BYTES, member, LABEL, lambda m: m.credentials,
                          keys, bad)
    if message.member != member:
        raise bad(f"signed as the samples of {message.member[:60]!r}")
    if message.round_id != round_id or message.seed != seed:
        raise bad("drawn for another round or seed")
    spans: dict[int, SpanRows] = {}
    for entry in message.spans:
        chunks = layout.get(entry.span_index)
        if entry.span_index in spans:
            raise bad(f"span {entry.span_index} twice")
        if chunks is None:  # a span the caller does not ask about (a proof names one span only)
            continue
        sizes = [(sample_count(b - a), envelope_count(b - a, block_size)) for a, b in chunks]
        blocks = sum(e for _, e in sizes)
        if len(entry.values) != sum(s for s, _ in sizes) or len(entry.envelope) != blocks or len(
                entry.block_norms) != blocks or (
                entry.sketch and len(entry.sketch) != SKETCH_SIZE * len(chunks)) or len(entry.output_hashes) > len(
                chunks) or len(entry.output_hashes) != len(entry.output_signatures):
            raise bad(f"span {entry.span_index}: sizes do not fit its chunks")
        values, envelope, norms = (_doubles(field) for field in (entry.values, entry.envelope, entry.block_norms))
        if not all(bool(t.isfinite().all()) for t in (values, envelope, norms)):
            raise bad(f"span {entry.span_index}: non-finite values")
        if bool((norms < 0).any()):
            raise bad(f"span {entry.span_index}: a negative norm")
        sketch = _doubles(entry.sketch).view(len(chunks), SKETCH_SIZE) if entry.sketch else None
        spans[entry.span_index] = SpanRows(
            list(torch.split(values, [s for s, _ in sizes])), list(torch.split(envelope, [e for _, e in sizes])),
            list(torch.split(norms, [e for _, e in sizes])),
            list(sketch.unbind(0)) if sketch is not None else None,
            [(bytes(h), bytes(g)) for h, g in zip(entry.output_hashes, entry.output_signatures, strict=True)])
    return MemberSamples(member, seed, spans, signed)
