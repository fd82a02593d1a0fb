"""Validation of an ExpertRequest header against what this host serves, before any payload is read.

Everything here answers with a :class:`~peerd.experts.calls.CallResult` naming the problem (None: the call may
be served); nothing reads from the stream, so the server decides what to do with payloads still on the way."""

from __future__ import annotations

from peerd.experts.calls import MAX_HIDDEN_DIM, PHASES, CallResult, max_payload_bytes
from peerd.experts.records import PROTOCOL_VERSION
from peerd.experts.server.backend import ExpertBackend
from peerd.proto import peerd_experts_pb2 as pb

__all__ = ["check_header", "oversized_payload"]


def check_header(
    request: pb.ExpertRequest, backends: dict[str, ExpertBackend], max_request_tokens: int
) -> CallResult | None:
    def bad(message: str, code: pb.ExpertCode = pb.EXPERT_BAD_REQUEST) -> CallResult:
        return CallResult(code, message)

    if request.protocol_version != PROTOCOL_VERSION:
        return bad(f"protocol version {request.protocol_version} unsupported; this host speaks {PROTOCOL_VERSION}")
    backend = backends.get(request.expert_uid)
    if backend is None:
        return bad(
            f"unknown expert uid {request.expert_uid[:128]!r}: this host serves {', '.join(backends)[:500]}",
            pb.EXPERT_UNKNOWN,
        )
    if request.phase not in PHASES:
        return bad(f"phase {request.phase} is neither EXPERT_FORWARD nor EXPERT_BACKWARD")
    phase, payloads = PHASES[request.phase]
    if request.phase == pb.EXPERT_BACKWARD and request.call_id:
        payloads = 1  # the output gradients; the inputs are the host's kept activations
    if len(request.payload_bytes) != payloads:
        kind = f"{phase} call" + (" by call_id" if request.call_id and phase == "backward" else "")
        return bad(f"a {kind} carries {payloads} tensors, not {len(request.payload_bytes)}")
    if not 1 <= request.num_tokens <= max_request_tokens:
        return bad(f"num_tokens {request.num_tokens} outside 1..{max_request_tokens} (experts.max_request_tokens)")
    if request.hidden_dim != backend.hidden_dim:
        return bad(f"hidden_dim {request.hidden_dim} differs from the expert's width {backend.hidden_dim}")
    return None


def oversized_payload(request: pb.ExpertRequest, max_request_tokens: int) -> CallResult | None:
    """A refusal if an announced payload is larger than the announced shape allows (or more than two are
    announced): such a caller is not trusted to be read from, its payloads are left unread."""
    sizes = list(request.payload_bytes)
    tokens = min(request.num_tokens, max_request_tokens)
    limit = max_payload_bytes(tokens, min(request.hidden_dim, MAX_HIDDEN_DIM))
    if len(sizes) <= 2 and all(size <= limit for size in sizes):
        return None
    return CallResult(
        pb.EXPERT_BAD_REQUEST,
        f"announced payload sizes {sizes[:4]}: one exceeds the {limit} bytes a "
        f"[{tokens}, {request.hidden_dim}] tensor can take",
    )
