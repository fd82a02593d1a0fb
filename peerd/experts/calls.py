"""What an expert call is to both sides: the handler name, the passes, payload bounds, the codec settings of a
tensor on the wire, a call's result, and the interface of a host a caller can reach in-process.

The caller's side (:mod:`peerd.experts.client`) and the hosting side (:mod:`peerd.experts.server`) both import
this module and never each other: a peer that serves experts and calls them too hands its server to its client
as a :class:`LocalHost`. Wire schema: ``protocols/peerd_experts.proto``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

from peerd.config import CodecConfig
from peerd.proto import peerd_experts_pb2 as pb
from peerd.wire.codec import HEADER

__all__ = [
    "HANDLER_NAME",
    "IDLE_SECONDS",
    "MAX_HIDDEN_DIM",
    "PHASES",
    "CallResult",
    "LocalHost",
    "max_payload_bytes",
    "wire_codec",
]

HANDLER_NAME = "peerd.v1.experts.call"
# A caller reuses a stream idle at most this long; a host drops a stream idle for longer than a multiple of it.
IDLE_SECONDS = 20.0
MAX_HIDDEN_DIM = 65536
# phase -> (its name, how many tensors a call of it carries)
PHASES = {pb.EXPERT_FORWARD: ("forward", 1), pb.EXPERT_BACKWARD: ("backward", 2)}

# fp16 for any tensor size (the codec falls back to raw where fp16 would overflow or lose small values).
_FP16 = CodecConfig(min_compress_numel=2**62, error_feedback=False)
_RAW = CodecConfig(lossless=True, error_feedback=False)


def wire_codec(lossless: bool) -> CodecConfig:
    """How a call's tensors are coded: raw float32 if the caller asked for lossless calls, else fp16."""
    return _RAW if lossless else _FP16


def max_payload_bytes(num_tokens: int, hidden_dim: int) -> int:
    """Largest valid codec payload of a [num_tokens, hidden_dim] tensor (raw float32)."""
    return HEADER.size + 8 * 2 + num_tokens * hidden_dim * 4


@dataclass(frozen=True)
class CallResult:
    """A host's answer to one call: EXPERT_OK and the coded result, or a code and a message naming the problem."""

    code: pb.ExpertCode
    message: str = ""
    payload: bytes | bytearray = b""
    batch_tokens: int = 0
    kept: bool = False  # a forward call's activations are kept for its backward call


class LocalHost(Protocol):
    """An expert host in this process (libp2p cannot dial itself): the client hands it calls to its own experts."""

    async def serve_local(self, request: pb.ExpertRequest, payloads: list[bytes | bytearray]) -> CallResult:
        """Serves one call with the same validation and batches as a remote call."""
        ...
