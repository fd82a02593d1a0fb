"""Validation of a sender's ReduceRequest against the reducer's own view of the round."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING

from peerd.proto import peerd_averaging_pb2 as pb

if TYPE_CHECKING:
    from peerd.averaging.reducer import SpanReducer

PROTOCOL_VERSION = 1
MAX_WEIGHT = 1e12


def check_request(
    reducer: SpanReducer, sender: str, request: pb.ReduceRequest
) -> tuple[pb.MessageCode, str] | None:
    """None if the request may be served, else (code, reason). BAD_REQUEST excludes the sender from the round."""
    if sender not in reducer.group.members or sender == reducer.peer_id:
        return pb.NOT_A_MEMBER, f"{sender} is not in group {reducer.group.round_id}"
    if sender in reducer.excluded or sender in reducer.serving:
        return pb.DUPLICATE, "already contributed or excluded"
    if request.protocol_version != PROTOCOL_VERSION:
        return pb.BAD_REQUEST, f"protocol version {request.protocol_version} (this peer speaks {PROTOCOL_VERSION})"
    if request.span_index != reducer.rank or request.span_numel != reducer.numel:
        return pb.BAD_REQUEST, (
            f"span {request.span_index} of {request.span_numel} elements, expected span {reducer.rank} of "
            f"{reducer.numel} (different model or group view?)"
        )
    if request.chunk_numel != reducer.config.chunk_numel:
        return pb.BAD_REQUEST, f"chunks of {request.chunk_numel}, this peer uses {reducer.config.chunk_numel}"
    if not (math.isfinite(request.weight) and 0 < request.weight <= MAX_WEIGHT):
        return pb.BAD_REQUEST, f"weight {request.weight} is not finite and in (0, {MAX_WEIGHT:g}]"
    return None
