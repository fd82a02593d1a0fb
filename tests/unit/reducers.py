"""A SpanReducer without a network for unit tests: its round's verification state, with real identities."""

from __future__ import annotations

import torch

from peerd.averaging.group import Group
from peerd.averaging.reducer import SpanReducer
from peerd.averaging.verify.keys import KeyBook, SigningKey
from peerd.averaging.verify.record import SpanRecord
from peerd.averaging.verify.round import RoundVerification
from peerd.config import AveragingConfig, CodecConfig
from tests.identities import signers


def make_reducer(group: Group, own: torch.Tensor, weight: float, config: AveragingConfig, codec: CodecConfig,
                 out: torch.Tensor, **kwargs: torch.Tensor) -> SpanReducer:
    """The reducer of span 0 of ``group`` (its members are ``signers(len(group.members))``' peer ids) when the
    whole tensor is that span."""
    n = own.numel()
    identity = next(s for s in signers(len(group.members)) if s.peer_id == group.members[0])
    spans = [(0, n)] + [(n, n)] * (len(group.members) - 1)
    verification = RoundVerification(group, 0, SigningKey(identity), KeyBook(), config, spans, out,
                                     lambda *_: None)
    record = SpanRecord(verification, n, config.aggregation, weight, torch.empty(n))
    return SpanReducer(group, 0, own, weight, config, codec, group.members[0], out, record, **kwargs)
