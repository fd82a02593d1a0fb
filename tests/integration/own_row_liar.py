"""A reducer that lies about its own row, for tests only: `python -m tests.integration.own_row_liar start ...` is
`peerd start ...` (centered_clip) that, in every lossy round, hands back ``PEERD_TEST_LIE_SCALE`` (-1000 by default)
times the honest average of its span (on the fraction ``PEERD_TEST_LIE_FRACTION`` of its elements largest in the
average, 1 by default) and makes it look right: its
Gram matrix, coefficients and sketch put its own row at the mean of the others' (so the rule keeps it whole), and
its samples, envelope and block norms state the row far off that makes the lie the rule's result at every
coordinate. Its sealed row is its honest one; what it states of it after the seed is the lie. A member lying with
a reducer would state its own row the same way.
"""

from __future__ import annotations

import os
from typing import Any

import torch

from peerd.averaging import robust
from peerd.averaging.aggregation import Combined
from peerd.averaging.verify import round as verify_round
from peerd.averaging.verify.payloads import block_norms, envelope
from peerd.averaging.verify.randomness import RoundRandomness
from peerd.averaging.verify.samples import OwnRow
from peerd.cli import main
from peerd.config import CodecConfig
from peerd.proto import peerd_averaging_pb2 as pb

SCALE = float(os.environ.get("PEERD_TEST_LIE_SCALE", "-1000"))
FRACTION = float(os.environ.get("PEERD_TEST_LIE_FRACTION", "1"))
BLOCK = CodecConfig().block_size

_honest_combine = robust.RobustChunks.combine
_honest_rows = verify_round.row_samples
# round id -> (its span, chunk index -> (the far row it samples, the near row it sketches))
STATED: dict[str, tuple[int, dict[int, tuple[torch.Tensor, torch.Tensor]]]] = {}


def _lying_combine(self: robust.RobustChunks, index: int, included: set[str], numel: int,
                   out: torch.Tensor) -> tuple[list[str], Combined]:
    members = [m for m in self.group.members if m in included]
    own = self.group.members[self.rank]
    if self.agreeing or own not in members or len(members) < 3 or numel == 0:
        return _honest_combine(self, index, included, numel, out)
    rows = self.rows[index]
    ranks = [self.group.rank_of(m) for m in members]
    others = [r for r in ranks if r != self.rank]
    near = rows[others, :numel].mean(0)
    rows[self.rank, :numel] = near
    true_others = rows[others, :numel].double().clone()
    members, combined = _honest_combine(self, index, included, numel, out)
    coefficients = torch.tensor(combined.coefficients, dtype=torch.float64)
    mine = ranks.index(self.rank)
    lie = SCALE * out.double()
    if FRACTION < 1:
        # the elements largest in the average, where the lie does the most harm: the members' samples fall at
        # coordinates the reducer cannot predict, so which elements it picks does not help them find it
        picked = out.abs().topk(max(1, round(FRACTION * numel))).indices
        lie = out.double().index_copy(0, picked, lie[picked])
    rest = coefficients[[i for i in range(len(ranks)) if i != mine]] @ true_others
    far = ((lie - rest) / coefficients[mine]).float()
    out.copy_(lie)
    STATED.setdefault(self.group.round_id, (self.rank, {}))[1][index] = (far, near.clone())
    return members, combined


def _lying_rows(key: Any, round_id: str, randomness: RoundRandomness, rows: dict[int, OwnRow],
                with_sketch: bool) -> pb.MemberSamples:
    span, stated = STATED.get(round_id, (-1, {}))
    if span not in rows or not stated:  # samples go out span by span: another span's
        return _honest_rows(key, round_id, randomness, rows, with_sketch)
    del STATED[round_id]
    own = rows[span]
    sampled, sketched = own.row.clone(), own.row.clone()
    envelopes, norms = list(own.envelopes), list(own.norms)
    for index, (far, near) in stated.items():
        a, b = own.chunks[index]
        sampled[a:b], sketched[a:b] = far, near
        envelopes[index], norms[index] = envelope(None, far, BLOCK), block_norms(far, BLOCK)
    # values, envelope and block norms from the far row, the sketch from the near one: two builds, spliced
    far_rows = {**rows, span: OwnRow(sampled, own.chunks, envelopes, norms, own.counts)}
    near_rows = {**rows, span: OwnRow(sketched, own.chunks, envelopes, norms, own.counts)}
    lie = _honest_rows(key, round_id, randomness, far_rows, with_sketch)
    sketch = _honest_rows(key, round_id, randomness, near_rows, with_sketch)
    for entry, near_entry in zip(lie.spans, sketch.spans, strict=True):
        if entry.span_index == span:
            del entry.sketch[:]
            entry.sketch.extend(near_entry.sketch)
    return lie


robust.RobustChunks.combine = _lying_combine  # type: ignore[method-assign]
verify_round.row_samples = _lying_rows  # type: ignore[assignment]

if __name__ == "__main__":
    main()
