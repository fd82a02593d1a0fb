"""Deciding who lied about one chunk, from sealed rows: the answer to a challenge and every proof.

A member whose checks of a span fail challenges its reducer for the rows of one failing chunk. The reducer
answers with every included row's payload; each must hash to what its member sealed. From them the rule is
recomputed over the whole chunk:

- an average that is not its rule applied to the rows; coefficients, copies, norms or a Gram matrix that do
  not follow from them (copies are compared exactly, as the reducer compares them); or a statement carrying a
  seal that does not check out: the **reducer** lied;
- samples, an envelope, block norms or a sketch that misstate a member's sealed row: that **member** lied (to
  frame the reducer, or to hide its own row), whatever the reducer did.

Everything judged is signed by whom it convicts (the reducer's statement and output signature, a member's seal
and samples), so whoever holds the same bytes reaches the same verdict: the challenger forwards them as a proof,
and every member checks it for itself. An honest reducer always has the rows its statement names, so a
challenge cannot convict it; a reducer that does not answer is excluded by whoever challenged it, and only by
them (it harmed nobody else).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import blake3
import torch

from peerd.averaging.aggregation import ROBUST_MIN_MEMBERS, around, differences, distinct
from peerd.averaging.group import Group, is_state_round
from peerd.averaging.layout import chunk_bounds
from peerd.averaging.verify.coefficients import check_medoid, coefficients_of, trimmed_at
from peerd.averaging.verify.energy import NORM_TOLERANCE
from peerd.averaging.verify.keys import KeyBook
from peerd.averaging.verify.payloads import (
    TINY,
    block_norms,
    bounded,
    envelope,
    error_bound,
    sent_count,
    view,
)
from peerd.averaging.verify.randomness import RoundRandomness
from peerd.averaging.verify.samples import MemberSamples
from peerd.averaging.verify.sketches import SKETCH_TOLERANCE
from peerd.averaging.verify.statement import OUTPUT, SEAL, Chunk, Statement, output_parts, seal_parts
from peerd.config import AveragingConfig
from peerd.errors import CodecError
from peerd.wire import codec

__all__ = ["Judgment", "judge_chunk", "misstated_row", "output_signed"]

GRAM_TOLERANCE = 1e-3  # relative to sqrt(G_ii G_jj): float32 Gram sums over a chunk differ across machines


@dataclass
class Judgment:
    reducer: str | None = None  # why the reducer is guilty
    members: dict[str, str] = field(default_factory=dict)  # member -> why its samples misstate its row
    unanswered: str | None = None  # the rows do not match the statement: nothing provable either way


def output_signed(statement: Statement, index: int, payload: bytes, signature: bytes, keys: KeyBook) -> bool:
    """Whether the statement's reducer signed ``payload`` as chunk ``index`` of its span's average."""
    parts = output_parts(statement.round_id, statement.span, index, blake3.blake3(payload).digest())
    return keys.valid(statement.credentials, statement.reducer, signature, OUTPUT, *parts)


def judge_chunk(statement: Statement, index: int, group: Group, rows: dict[int, bytes], out: bytes | None,
                samples: dict[int, MemberSamples], config: AveragingConfig, keys: KeyBook) -> Judgment:
    """The verdict on chunk ``index`` of ``statement``'s span from the revealed ``rows`` (rank -> payload),
    the average ``out`` (already known to be signed by the reducer; None to judge only the members) and the
    ``samples`` of members to check against their rows."""
    verdict = Judgment()
    chunk = statement.chunks[index]
    a, b = chunk_bounds(statement.numel, statement.chunk_numel)[index]
    decoded: dict[int, torch.Tensor] = {}
    for rank in chunk.included:
        row = statement.rows[rank]
        payload = rows.get(rank)
        if payload is None or blake3.blake3(payload).digest() != row.hashes[index]:
            verdict.unanswered = f"the row of rank {rank} is missing or not the one the statement names"
            return verdict
        member = group.members[rank]
        if rank != statement.span and not keys.valid(row.credentials, member, row.seal, SEAL, *seal_parts(
                statement.round_id, statement.span, statement.numel, statement.chunk_numel, row.weight,
                row.hashes)):
            verdict.reducer = f"its statement includes a row of {member} that {member} did not seal"
            return verdict
        try:
            decoded[rank] = codec.decode(payload, peer_id=member, expected_shape=(b - a,))
        except CodecError as e:
            verdict.reducer = f"its statement includes a row that does not decode: {e.message}"
            return verdict
    for rank, member_samples in samples.items():
        if rank in decoded:
            lie = _misstated(member_samples, statement, index, decoded[rank], rows[rank], config)
            if lie is not None:
                verdict.members[group.members[rank]] = lie
    if out is not None and not chunk.void:
        required = max(sent_count(rows[rank]) for rank in chunk.included)
        verdict.reducer = _wrong_average(statement, index, decoded, out, config, required)
    return verdict


def misstated_row(statement: Statement, index: int, group: Group, rank: int, payload: bytes,
                  member: MemberSamples, config: AveragingConfig, keys: KeyBook) -> str | None:
    """Why ``member`` (rank ``rank``) misstated its row in chunk ``index``, if it did: ``payload`` must be the row
    the statement names and the member sealed (else nothing is shown: None)."""
    row = statement.rows.get(rank)
    if row is None or len(row.hashes) <= index or blake3.blake3(payload).digest() != row.hashes[index]:
        return None
    if rank != statement.span and not keys.valid(row.credentials, group.members[rank], row.seal, SEAL, *seal_parts(
            statement.round_id, statement.span, statement.numel, statement.chunk_numel, row.weight, row.hashes)):
        return None
    a, b = chunk_bounds(statement.numel, statement.chunk_numel)[index]
    try:
        decoded = codec.decode(payload, peer_id=group.members[rank], expected_shape=(b - a,))
    except CodecError:
        return None
    return _misstated(member, statement, index, decoded, payload, config)


def _misstated(member: MemberSamples, statement: Statement, index: int, row: torch.Tensor, payload: bytes,
               config: AveragingConfig) -> str | None:
    stated = member.spans.get(statement.span)
    if stated is None:
        return None
    randomness = RoundRandomness(member.seed, statement.chunk_numel)
    offsets = randomness.offsets(statement.span, index, row.numel())
    if not torch.equal(stated.values[index], row[offsets].double()):
        return f"its samples of span {statement.span} chunk {index} are not its sealed row's"
    if not torch.equal(stated.envelope[index], envelope(view(payload), row, config.codec.block_size).double()):
        return f"its envelope of span {statement.span} chunk {index} is not its sealed row's"
    norms = block_norms(row, config.codec.block_size)
    if stated.norms[index].shape != norms.shape or bool(
            ((stated.norms[index] - norms).abs() > NORM_TOLERANCE * norms + TINY).any()):
        return f"its block norms of span {statement.span} chunk {index} are not its sealed row's"
    if stated.sketch is not None:
        true = randomness.sketch(statement.span, index, row)
        if float((stated.sketch[index] - true).abs().max()) > SKETCH_TOLERANCE * float(true.norm()) + 1e-30:
            return f"its sketch of span {statement.span} chunk {index} is not its sealed row's"
    return None


def _wrong_average(statement: Statement, index: int, decoded: dict[int, torch.Tensor], out: bytes,
                   config: AveragingConfig, required: int) -> str | None:
    """Why the reducer's average ``out`` of chunk ``index`` is not its rule applied to the ``decoded`` rows, if it
    is not; ``required``: the most elements an included top-k row carries (payloads.error_bound)."""
    chunk = statement.chunks[index]
    raw = torch.stack([decoded[r] for r in chunk.included])
    rows = raw.double()
    try:
        average = codec.decode(out, peer_id=statement.reducer, expected_shape=(rows.shape[1],))
    except CodecError as e:
        return f"its signed average does not decode: {e.message}"
    if not bounded(view(out)):
        return None  # an honest average coded so may be anywhere its residual put it: nothing to prove
    try:
        if statement.rule != "mean" and not _robust_numbers(chunk, raw, is_state_round(statement.round_id)):
            return None  # the rows overflow float32's Gram matrix: no rule's numbers can be checked here
        found = coefficients_of(statement, [chunk], config)
        coefficients = None if found is None else found[0]
    except ValueError as e:
        return str(e)
    absolute = rows.abs()
    magnitude = absolute.amax(0)
    if coefficients is None:
        expected = trimmed_at(rows[chunk.distinct])
    else:
        expected = coefficients @ rows
        magnitude += coefficients.abs() @ absolute
    allowed = error_bound(view(out), average, None, required) + 1e-5 * magnitude + TINY
    excess = (average.double() - expected).abs() - allowed
    if bool((excess > 0).any()):
        worst = int(excess.argmax())
        return (f"its average of chunk {index} is {float(average[worst]):.6g} at element {worst}, its rule "
                f"applied to the sealed rows gives {float(expected[worst]):.6g}")
    return None


def _robust_numbers(chunk: Chunk, raw: torch.Tensor, agreeing: bool) -> bool:
    """Checks a robust rule's published copies, norms and Gram matrix against the rows (float32, as the
    reducer held them): ValueError naming the first that is not theirs; False if the rows overflow float32's
    Gram matrix (nothing can be checked then), else True. ``agreeing``: a state round, which has no copies."""
    gram = (raw @ raw.t()).double()  # as the reducer computes it
    if not bool(gram.isfinite().all()):
        return False
    copies = list(range(raw.shape[0])) if agreeing else distinct(raw)  # exact, as the reducer compares
    if copies != chunk.same_as:
        raise ValueError(f"its statement's copies {chunk.same_as} are not its rows' {copies}")
    kept = chunk.distinct
    if chunk.norms is not None:
        exact = gram.diagonal()[kept]
        if bool(((chunk.norms - exact).abs() > GRAM_TOLERANCE * exact + 1e-300).any()):
            raise ValueError("its published norms are not its rows'")
    if chunk.gram is not None and len(kept) >= ROBUST_MIN_MEMBERS:
        centered = around(differences(raw[kept].clone(), torch.empty(raw.shape[1])), chunk.medoid)
        if not bool(centered.isfinite().all()):
            return False
        scale = centered.diagonal().clamp_min(0).sqrt()
        slack = GRAM_TOLERANCE * (scale[:, None] * scale[None, :] + 1e-3 * float(centered.diagonal().max()))
        if bool(((chunk.gram - centered).abs() > slack + 1e-300).any()):
            raise ValueError("its published Gram matrix is not its rows'")
        check_medoid(centered, chunk.medoid)
    return True
