"""Validation of a sender's ReduceRequest against the reducer's own view of the round."""

from __future__ import annotations

import math
from dataclasses import dataclass

from peerd.averaging.group import Group
from peerd.proto import peerd_averaging_pb2 as pb

# raised whenever a round message changes meaning or layout, so peers of different versions refuse each other's
# requests with a reason instead of failing each other's checks
PROTOCOL_VERSION = 6
MAX_WEIGHT = 1e12


@dataclass(frozen=True)
class SpanView:
    """What a reducer expects of every request for its span."""

    group: Group
    peer_id: str  # the reducer
    rank: int
    numel: int
    chunk_numel: int


def check_request(
    view: SpanView, sender: str, request: pb.ReduceRequest, seen: set[str]
) -> tuple[pb.MessageCode, str] | None:
    """None if the request may be served, else (code, reason). BAD_REQUEST excludes the sender from the round.
    ``seen``: senders already contributing or excluded."""
    if sender not in view.group.members or sender == view.peer_id:
        return pb.NOT_A_MEMBER, f"{sender} is not in group {view.group.round_id}"
    if sender in seen:
        return pb.DUPLICATE, "already contributed or excluded"
    if request.protocol_version != PROTOCOL_VERSION:
        return pb.BAD_REQUEST, f"protocol version {request.protocol_version} (this peer speaks {PROTOCOL_VERSION})"
    if request.span_index != view.rank or request.span_numel != view.numel:
        return pb.BAD_REQUEST, (
            f"span {request.span_index} of {request.span_numel} elements, expected span {view.rank} of "
            f"{view.numel} (different model or group view?)"
        )
    if request.chunk_numel != view.chunk_numel:
        return pb.BAD_REQUEST, f"chunks of {request.chunk_numel}, this peer uses {view.chunk_numel}"
    if not (math.isfinite(request.weight) and 0 < request.weight <= MAX_WEIGHT):
        return pb.BAD_REQUEST, f"weight {request.weight} is not finite and in (0, {MAX_WEIGHT:g}]"
    if len(request.seed_commitments) != len(view.group.members) or any(
            len(c) != 32 for c in request.seed_commitments) or len(request.credentials.signing_key) != 32:
        return pb.BAD_REQUEST, ("no seed commitment of 32 bytes for each span, or no signing key: every "
                                "contribution is verified")
    return None
