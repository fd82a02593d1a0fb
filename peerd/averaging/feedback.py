"""Error feedback for the lossy averaging codec.

Quantization error is not noise that averages out on its own: the same rounding repeats on every round of a
slowly changing tensor. :class:`ErrorFeedback` keeps, per key, what the last payload failed to carry
(``residual = sent - decode(encode(sent))``) and adds it to the next tensor before encoding, so the errors
telescope: the sum of T decoded rounds differs from the sum of the inputs by one residual, not by T of them.
"""

from __future__ import annotations

import torch

from peerd.averaging.codec import decode, encode
from peerd.config import CodecConfig

__all__ = ["ErrorFeedback", "encode_with_feedback"]

_SELF = "<local error feedback>"


class ErrorFeedback:
    """Per-key quantization residuals, each with the shape and dtype of the tensor it compensates."""

    def __init__(self) -> None:
        self._residuals: dict[str, torch.Tensor] = {}

    def __contains__(self, key: object) -> bool:
        return key in self._residuals

    def __len__(self) -> int:
        return len(self._residuals)

    def residual(self, key: str) -> torch.Tensor | None:
        """The residual carried into the next round for ``key``, or None before its first update."""
        return self._residuals.get(key)

    def compensate(self, key: str, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor + residual`` as a new tensor (``tensor`` itself while ``key`` has no residual yet)."""
        residual = self._residuals.get(key)
        if residual is None:
            return tensor
        self._check(key, residual, tensor)
        return torch.add(tensor, residual)

    def update(self, key: str, sent_input: torch.Tensor, decoded: torch.Tensor) -> None:
        """Stores ``sent_input - decoded``: what the payload built from ``sent_input`` failed to carry."""
        if sent_input.shape != decoded.shape or sent_input.dtype != decoded.dtype:
            raise ValueError(
                f"error feedback for {key!r}: decoded {tuple(decoded.shape)} {decoded.dtype} does not match "
                f"the sent tensor {tuple(sent_input.shape)} {sent_input.dtype}"
            )
        residual = self._residuals.get(key)
        if residual is None:
            self._residuals[key] = torch.sub(sent_input, decoded).contiguous()
            return
        self._check(key, residual, sent_input)
        torch.sub(sent_input, decoded, out=residual)

    def reset(self, key: str | None = None) -> None:
        """Forgets the residual of ``key`` (all residuals when None), e.g. after a tensor changes shape."""
        if key is None:
            self._residuals.clear()
        else:
            self._residuals.pop(key, None)

    @staticmethod
    def _check(key: str, residual: torch.Tensor, tensor: torch.Tensor) -> None:
        if residual.shape != tensor.shape or residual.dtype != tensor.dtype:
            raise ValueError(
                f"error feedback for {key!r} holds a residual of {tuple(residual.shape)} {residual.dtype} "
                f"but the tensor is {tuple(tensor.shape)} {tensor.dtype}; call reset({key!r}) after a change"
            )


def encode_with_feedback(
    feedback: ErrorFeedback, key: str, tensor: torch.Tensor, config: CodecConfig
) -> bytearray:
    """Encodes ``tensor`` plus the carried residual of ``key`` and carries the new residual forward.

    With ``config.error_feedback`` off this is plain :func:`encode` and ``feedback`` is left untouched.
    """
    if not config.error_feedback:
        return encode(tensor, config)
    compensated = feedback.compensate(key, tensor)
    payload = encode(compensated, config)
    residual = feedback.residual(key)
    if residual is None:
        feedback.update(key, compensated, decode(payload, peer_id=_SELF))
    else:
        # Decode straight into the residual buffer, then turn it into the residual in place: no allocation.
        decoded = decode(payload, peer_id=_SELF, out=residual)
        torch.sub(compensated, decoded, out=residual)
    return payload
