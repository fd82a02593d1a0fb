"""Two members gone bad together, for tests only: `python -m tests.integration.colluders start ...` is `peerd
start ...` with a role, ``PEERD_TEST_COLLUDE`` (the folder ``PEERD_TEST_COLLUDE_DIR`` is shared by both):

- ``leak``: writes the seed of every span of every round into the folder as soon as the shares revealed to it let
  it draw it;
- ``lie``: as the reducer of its span in a gradient round, before it averages its last chunk it waits (up to
  ``PEERD_TEST_COLLUDE_WAIT`` seconds) for its accomplice's seed of that span, then hands back the average
  negated wherever none of that seed's samples falls (everywhere, if no seed came), coded and signed like an
  honest average. The values at the samples are the true average's, and so are its magnitudes, envelope and
  block norms: told the seed before it commits, it passes every check but an audit. Its own share of its span
  goes out at once (it has no reason to wait for its own statement).

Both run the honest code everywhere else, and answer a challenge with the rows, as the protocol asks.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import os
import time
from pathlib import Path
from typing import Any

import torch

from peerd.averaging import reducer
from peerd.averaging.reducer import SpanReducer
from peerd.averaging.verify.randomness import RoundRandomness
from peerd.averaging.verify.round import RoundVerification
from peerd.cli import main

ROLE = os.environ.get("PEERD_TEST_COLLUDE", "")
SHARED = Path(os.environ.get("PEERD_TEST_COLLUDE_DIR", "."))
WAIT = float(os.environ.get("PEERD_TEST_COLLUDE_WAIT", "3"))

logger = logging.getLogger(__name__)

_honest_draw = RoundVerification._draw
_honest_share = RoundVerification.reveal_from
_honest_reveal = RoundVerification._reveal
_honest_finalize = SpanReducer._finalize
_honest_average = SpanReducer._average_chunk
_honest_code = reducer.code_average
_FLIP: list[torch.Tensor | None] = [None]  # the elements of the chunk being averaged that the lie negates


def _seed_file(round_id: str, span: int) -> Path:
    return SHARED / hashlib.sha256(f"{round_id}/{span}".encode()).hexdigest()


async def _leaking_draw(self: RoundVerification, span: int) -> RoundRandomness:
    randomness = await _honest_draw(self, span)
    target = _seed_file(self.group.round_id, span)
    target.with_suffix(".part").write_bytes(randomness.seed)
    target.with_suffix(".part").replace(target)  # whole or not at all: the accomplice reads it at once
    return randomness


async def _eager_share(self: RoundVerification, member: str, span: int, share: bytes) -> None:
    await _honest_share(self, member, span, share)
    self.randomness(span)  # drawn once every share is in, not when this member's own checks get to it


async def _own_share_at_once(self: RoundVerification, span: int) -> bytes:
    return self.own_shares[span] if span == self.rank else await _honest_reveal(self, span)


async def _waiting_finalize(self: SpanReducer, index: int) -> None:
    if index == len(self.chunks) - 1 and not self.codec_config.lossless:
        seed = _seed_file(self.group.round_id, self.rank)
        deadline = time.monotonic() + WAIT
        while not seed.exists() and time.monotonic() < deadline:
            await asyncio.sleep(0.02)  # the accomplice's file: nothing to wait on but the folder
        self.__dict__["leaked"] = seed.read_bytes() if seed.exists() else None
        logger.warning("Round %s: %s the accomplice's seed before the last chunk of span %d",
                       self.group.round_id, "got" if seed.exists() else "did not get", self.rank)
    await _honest_finalize(self, index)


def _lying_average(self: SpanReducer, index: int) -> bytearray:
    if index != len(self.chunks) - 1 or self.codec_config.lossless:
        return _honest_average(self, index)
    start, end = self.chunks[index]
    flip = torch.ones(end - start, dtype=torch.bool)
    leaked = self.__dict__.get("leaked")
    if leaked is not None:
        flip[RoundRandomness(leaked, self.config.chunk_numel).offsets(self.rank, index, end - start)] = False
    _FLIP[0] = flip
    try:
        return _honest_average(self, index)
    finally:
        _FLIP[0] = None


def _lying_code(average: torch.Tensor, *args: Any, **kwargs: Any) -> bytearray:
    """The exact average negated where it lies, coded as the honest one is (coding the coded average again
    would move the values at the samples by up to half a step)."""
    if _FLIP[0] is not None:
        average[_FLIP[0]] = -average[_FLIP[0]]
    return _honest_code(average, *args, **kwargs)


if ROLE == "leak":
    RoundVerification._draw = _leaking_draw  # type: ignore[method-assign]
    RoundVerification.reveal_from = _eager_share  # type: ignore[method-assign]
elif ROLE == "lie":
    RoundVerification._reveal = _own_share_at_once  # type: ignore[method-assign]
    SpanReducer._finalize = _waiting_finalize  # type: ignore[method-assign]
    SpanReducer._average_chunk = _lying_average  # type: ignore[method-assign]
    reducer.code_average = _lying_code  # type: ignore[assignment]
else:
    raise SystemExit("tests.integration.colluders needs PEERD_TEST_COLLUDE=leak or lie")

if __name__ == "__main__":
    main()
