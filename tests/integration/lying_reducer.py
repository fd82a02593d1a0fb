"""A reducer gone bad, for tests only: `python -m tests.integration.lying_reducer start ...` is `peerd start ...`
that hands back -1000 times the true average of its span in every lossy round (gradients, diloco's pseudo-
gradients; lossless state averaging stays honest), signed like an honest average. It keeps the true average for
itself, so it goes on training and lying. When challenged it reveals the rows, as the protocol asks.

``LYING_REDUCER=split``: only one member (the first in the group after itself) gets the lie, the others the true
average, each signed: different answers to different members.
"""

from __future__ import annotations

import os
from typing import Any

from peerd.averaging.reducer import SpanReducer
from peerd.averaging.serving import SenderStream
from peerd.averaging.verify.payloads import code_average
from peerd.cli import main
from peerd.proto import peerd_averaging_pb2 as pb

SCALE = -1000.0
SPLIT = os.environ.get("LYING_REDUCER") == "split"

_honest_average = SpanReducer._average_chunk
_honest_send = SenderStream._send


def _lying_average(self: SpanReducer, index: int) -> bytearray:
    payload = _honest_average(self, index)
    if self.codec_config.lossless:
        return payload
    start, end = self.chunks[index]
    # coded as an honest reducer codes its average (verify/payloads.py), so members decode and check it
    lie = code_average(self.out[start:end] * SCALE, None, self.codec_config,
                       self.config.verification.check_narrow_codes, self.peer_id)
    lies: dict[int, tuple[bytearray, bytes]] = self.__dict__.setdefault("lies", {})
    if not SPLIT:
        self.record.sign_output(index, lie)  # the statement and every member get the lie
        return lie
    honest_signature = self.record.signatures[index]
    lies[index] = (lie, self.record.sign_output(index, lie))
    self.record.signatures[index] = honest_signature
    return payload


async def _lying_send(self: SenderStream, response: pb.ReduceResponse, payload: Any = None) -> None:
    reducer = self.reducer
    lies: dict[int, tuple[bytearray, bytes]] = reducer.__dict__.get("lies", {})
    victim = next(m for m in reducer.group.members if m != reducer.peer_id)
    if payload is not None and self.sender == victim and response.chunk_index in lies:
        payload, signature = lies[response.chunk_index]
        response.signature = signature
    await _honest_send(self, response, payload)


SpanReducer._average_chunk = _lying_average  # type: ignore[method-assign]
SenderStream._send = _lying_send  # type: ignore[method-assign]

if __name__ == "__main__":
    main()
