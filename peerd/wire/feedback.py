"""Error feedback for the lossy averaging codec: one primitive for every place a round codes values.

Quantization error is not noise that averages out on its own: the same rounding repeats on every round of a
slowly changing tensor. So whoever codes values keeps what the payload failed to carry
(``dropped = values + carried - decode(payload)``) and adds it to the same elements next round: the errors
telescope, and the sum of T decoded rounds differs from the sum of the inputs by one residual, not by T.

A round codes twice (allreduce.py): each member its contribution to a span (sender.py) and each reducer the
span's average (reducer.py). Both go through :func:`encode_with_feedback`; they differ only in where the
results go. A sender keeps ``dropped`` apart and commits it to its residual only once the reducer reports the
chunk included (a lost chunk must not leave a residual for values nobody received); a reducer commits at once
and decodes in place, so it applies exactly the values every member decodes.

A reducer's average of top-k rows that members check (SPARSE8) carries no residual of the reducer's: it leaves
out the average's smallest elements, and each member, the reducer included, puts back into its own residual what
it sent of the elements the average left out (:func:`readd_left_out`). For the mean that carries exactly what was
left out into the next round, spread over the members who sent it, and nothing of it rests on the reducer's word.
"""

from __future__ import annotations

import torch

from peerd.config import CodecConfig
from peerd.wire.codec import decode, encode

__all__ = ["encode_with_feedback", "readd_left_out"]


def encode_with_feedback(
    values: torch.Tensor,
    config: CodecConfig,
    peer_id: str,
    carried: torch.Tensor | None = None,
    dropped: torch.Tensor | None = None,
    decoded: torch.Tensor | None = None,
    with_norm: bool = False,
) -> tuple[bytearray, float]:
    """Codes ``values + carried`` (``values`` alone without ``carried``).

    ``dropped``, if given, receives what the payload fails to carry; it may be ``carried`` itself, which then
    holds the new residual. ``decoded``, if given, receives what every receiver decodes; it may be ``values``.
    Without either, this is plain :func:`encode`. Returns the payload and, with ``with_norm`` and
    ``dropped``, the L2 norm of the coded tensor for the relative coding error a round reports (else 0.0: an
    extra pass over every chunk is not paid where nobody reads it). ``peer_id`` names this peer
    in the errors of its own payload's decode, which would mean a codec bug rather than bad input.
    """
    for name, buffer in (("carried", carried), ("dropped", dropped), ("decoded", decoded)):
        if buffer is not None and (buffer.shape != values.shape or buffer.dtype != values.dtype):
            raise ValueError(
                f"error feedback: {name} is {tuple(buffer.shape)} {buffer.dtype}, the values are "
                f"{tuple(values.shape)} {values.dtype}"
            )
    if carried is not None and dropped is None:
        raise ValueError("error feedback: carrying a residual needs `dropped` to receive the next one")
    # The coded tensor lives in `dropped` (no allocation): it becomes the residual by subtracting the decode.
    coded = values if carried is None else torch.add(values, carried, out=dropped)
    payload = encode(coded, config)
    if dropped is None:
        if decoded is not None:
            decode(payload, peer_id=peer_id, expected_shape=tuple(values.shape), out=decoded)
        return payload, 0.0
    norm = float(coded.norm()) if with_norm else 0.0
    if coded is not dropped:
        dropped.copy_(coded)  # before decoding: `decoded` may alias `values`
    dropped.sub_(decode(payload, peer_id=peer_id, expected_shape=tuple(values.shape), out=decoded))  # out=None: fresh
    return payload, norm


def readd_left_out(residual: torch.Tensor, sent: torch.Tensor, average: torch.Tensor) -> None:
    """Adds to ``residual`` what this peer ``sent`` (as decoded) of the elements the decoded ``average`` of its
    chunk left out (those that decode to 0, rounded away or not carried)."""
    residual.add_(sent.masked_fill(average != 0, 0.0))
