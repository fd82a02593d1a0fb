"""One span of one chunk reduced the way a reducer does it, with its statement and every member's samples, so
unit tests can check honest and lying reducers and members without a network (tests/unit/test_verification.py).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import blake3
import torch

from peerd.averaging.aggregation import around, combine, medoid_of
from peerd.averaging.clipping import clip_coefficients
from peerd.averaging.group import Group, is_state_round
from peerd.averaging.verify.keys import KeyBook, SigningKey
from peerd.averaging.verify.payloads import block_norms, code_average, envelope, sent_count, view
from peerd.averaging.verify.randomness import RoundRandomness
from peerd.averaging.verify.samples import MemberSamples, OwnRow, build_samples, parse_samples
from peerd.averaging.verify.statement import (
    OUTPUT,
    SEAL,
    Statement,
    output_parts,
    parse_statement,
    seal_parts,
    sign_statement,
)
from peerd.config import AveragingConfig, CodecConfig
from peerd.proto import peerd_averaging_pb2 as pb
from peerd.wire import codec
from tests.identities import signers

CODEC = CodecConfig(min_compress_numel=0)
SEED = bytes(range(32))
NUMEL = 20_000


def honest_rows(n: int, spread: float = 0.5, seed: int = 0) -> torch.Tensor:
    """``n`` members' rows of NUMEL elements: a shared direction, each with its own noise ``spread`` times as
    large."""
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(NUMEL, generator=generator) + spread * torch.randn(n, NUMEL, generator=generator)


@dataclass
class Span:
    """Span 0 of a round of ``len(rows)`` members, one chunk; the reducer is member 0."""

    rows: torch.Tensor  # what each member contributes (before coding)
    rule: str = "centered_clip"
    weights: list[float] | None = None
    residual: torch.Tensor | None = None  # the reducer's carried residual
    seed: bytes = SEED
    codec: CodecConfig = field(default_factory=lambda: CODEC)  # lossless: state averaging's rounds
    check_narrow_codes: bool = True  # averaging.verification.check_narrow_codes
    round_id: str = "round"  # a gradient round's; '<prefix>.state.<step>/<digest>' for a state round's
    config: AveragingConfig = field(init=False)

    def __post_init__(self) -> None:
        n, numel = self.rows.shape
        self.config = AveragingConfig(aggregation=self.rule, codec=self.codec, chunk_numel=max(numel, 1024),  # type: ignore[arg-type]
                                      verification={"check_narrow_codes": self.check_narrow_codes})
        self.identities = signers(n)
        self.signing = [SigningKey(identity) for identity in self.identities]
        self.group = Group(self.round_id, tuple(i.peer_id for i in self.identities))
        self.weights = self.weights or [1.0] * n
        self.payloads = [bytes(codec.encode(row, self.codec)) for row in self.rows]
        self.decoded = torch.stack([codec.decode(p, peer_id="test", expected_shape=(numel,)) for p in self.payloads])
        self.randomness = RoundRandomness(self.seed, self.config.chunk_numel)
        self.average()

    def average(self, lie: torch.Tensor | None = None) -> None:
        """What the reducer computes, codes and signs; ``lie``: added to the average before it is coded."""
        out = torch.empty(self.rows.shape[1])
        combined = combine(self.rule, self.decoded.clone(), list(self.weights or []), out,
                           self.config.max_weight_ratio, self.config.clip_radius, self.config.clip_iterations,
                           is_state_round(self.round_id))
        self.coefficients, self.medoid, self.gram = combined.coefficients, combined.medoid, combined.gram
        self.norms, self.same_as = combined.norms, combined.same_as
        if self.rule == "mean":  # the reducer's streaming mean takes the claims as they are
            total = sum(self.weights or [])
            self.coefficients = [w / total for w in self.weights or []]
            out = torch.tensor(self.coefficients) @ self.decoded
        if lie is not None:
            out += lie
        residual = self.residual.clone() if self.residual is not None else None
        self.out_payload = bytes(code_average(out, residual, self.codec, self.check_narrow_codes, "reducer",
                                              max(sent_count(p) for p in self.payloads)))
        self.out = out
        self.out_signature = self.sign_output(self.out_payload)

    def sign_output(self, payload: bytes) -> bytes:
        return self.signing[0].sign(OUTPUT, *output_parts(self.round_id, 0, 0, blake3.blake3(payload).digest()))

    def statement(self, edit: pb.SpanStatement | None = None) -> Statement:
        n, numel = self.rows.shape
        message = pb.SpanStatement(round_id=self.round_id, span_index=0, span_numel=numel,
                                   chunk_numel=self.config.chunk_numel, members=list(self.group.members),
                                   rule=self.rule, reducer=self.signing[0].credentials)
        for rank in range(n):
            hashes = [blake3.blake3(self.payloads[rank]).digest()]
            seal = b"" if rank == 0 else self.signing[rank].sign(SEAL, *seal_parts(
                self.round_id, 0, numel, self.config.chunk_numel, (self.weights or [])[rank], hashes))
            message.rows.add(rank=rank, weight=(self.weights or [])[rank], chunk_hashes=hashes, seal=seal,
                             credentials=self.signing[rank].credentials)
        self.record(message)
        if edit is not None:
            message.MergeFrom(edit)
        return parse_statement(sign_statement(self.signing[0], message), self.group, 0, numel,
                               self.config.chunk_numel, KeyBook())

    def record(self, message: pb.SpanStatement) -> None:
        """Adds this chunk's record to ``message``."""
        record = message.chunks.add(included=list(range(self.rows.shape[0])), coefficients=self.coefficients or [],
                                    medoid=self.medoid)
        if self.gram is not None:
            record.gram[:] = self.gram.reshape(-1).tolist()
        if self.norms is not None:
            record.norms[:] = self.norms.tolist()
        if self.same_as is not None:
            record.same_as[:] = self.same_as

    def samples(self, rank: int, row: torch.Tensor | None = None) -> MemberSamples:
        """Member ``rank``'s samples of its row (``row``: what it claims instead of its decoded row)."""
        decoded = self.decoded[rank] if row is None else row
        numel = decoded.numel()
        bound = envelope(view(self.payloads[rank]), decoded, CODEC.block_size)
        own = OwnRow(decoded, [(0, numel)], [bound], [block_norms(decoded, CODEC.block_size)])
        signed = build_samples(self.signing[rank], self.round_id, self.randomness, {0: own}, self.rule != "mean", {})
        return parse_samples(signed, self.group.members[rank], self.round_id, self.seed, {0: [(0, numel)]},
                             CODEC.block_size, KeyBook())

    def all_samples(self) -> dict[int, MemberSamples]:
        return {rank: self.samples(rank) for rank in range(self.rows.shape[0])}

    def misstate_own_row(self, lie_on: torch.Tensor | None = None) -> dict[int, MemberSamples]:
        """The reducer (rank 0, centered_clip) lies about its own row, as a member lying with it would about its
        own: it claims a row at the honest rows' mean in its Gram matrix and sketch, so the rule keeps it whole,
        and samples (and bounds) a row far off, the one that makes -1000x the honest average (on the elements
        ``lie_on`` marks; every one if None) the rule's result. Sets the average and returns every member's
        samples, the reducer's misstated."""
        decoded = self.decoded.double()
        near = decoded.clone()
        near[0] = decoded[1:].mean(0)
        based = near @ near.t()
        self.medoid = medoid_of(based)
        self.gram = around(based, self.medoid)
        coefficients, _ = clip_coefficients(self.gram, [1.0] * len(near), self.medoid, self.config.clip_radius,
                                            self.config.clip_iterations)
        self.coefficients = coefficients.tolist()
        honest = coefficients @ decoded
        lie = -1000 * honest if lie_on is None else torch.where(lie_on, -1000 * honest, honest)
        far = ((lie - coefficients[1:] @ decoded[1:]) / coefficients[0]).float()
        self.out_payload = bytes(codec.encode(lie.float(), self.config.codec))
        self.out = codec.decode(self.out_payload, peer_id="test")
        samples = self.all_samples()
        sealed = self.payloads[0]
        self.payloads[0] = bytes(codec.encode(far, self.config.codec))  # its envelope: the far row's
        sampled = self.samples(0, row=far)
        self.payloads[0] = sealed
        sketch = self.samples(0, row=near[0].float()).spans[0].sketch
        samples[0] = dataclasses.replace(sampled, spans={0: dataclasses.replace(sampled.spans[0], sketch=sketch)})
        return samples


@dataclass
class Chunks:
    """Span 0 cut into the chunks of ``parts``, each reduced as its Span reduces its one chunk (same rule, weights
    and seed): one statement over every chunk, every member's samples of its whole row."""

    parts: list[Span]

    def __post_init__(self) -> None:
        first = self.parts[0]
        self.length = first.rows.shape[1]
        self.bounds = [(i * self.length, (i + 1) * self.length) for i in range(len(self.parts))]
        self.config, self.group, self.randomness = first.config, first.group, first.randomness

    def statement(self) -> Statement:
        first, n, numel = self.parts[0], self.parts[0].rows.shape[0], self.length * len(self.parts)
        message = pb.SpanStatement(round_id=first.round_id, span_index=0, span_numel=numel,
                                   chunk_numel=self.length, members=list(self.group.members), rule=first.rule,
                                   reducer=first.signing[0].credentials)
        for rank in range(n):
            hashes = [blake3.blake3(part.payloads[rank]).digest() for part in self.parts]
            weight = (first.weights or [])[rank]
            seal = b"" if rank == 0 else first.signing[rank].sign(SEAL, *seal_parts(
                first.round_id, 0, numel, self.length, weight, hashes))
            message.rows.add(rank=rank, weight=weight, chunk_hashes=hashes, seal=seal,
                             credentials=first.signing[rank].credentials)
        for part in self.parts:
            part.record(message)
        return parse_statement(sign_statement(first.signing[0], message), self.group, 0, numel, self.length,
                               KeyBook())

    def samples(self) -> dict[int, MemberSamples]:
        first = self.parts[0]
        found = {}
        for rank in range(first.rows.shape[0]):
            decoded = [part.decoded[rank] for part in self.parts]
            own = OwnRow(torch.cat(decoded), self.bounds,
                         [envelope(view(part.payloads[rank]), row, CODEC.block_size)
                          for part, row in zip(self.parts, decoded, strict=True)],
                         [block_norms(row, CODEC.block_size) for row in decoded])
            signed = build_samples(first.signing[rank], first.round_id, self.randomness, {0: own},
                                   first.rule != "mean", {})
            found[rank] = parse_samples(signed, self.group.members[rank], first.round_id, first.seed,
                                        {0: self.bounds}, CODEC.block_size, KeyBook())
        return found
