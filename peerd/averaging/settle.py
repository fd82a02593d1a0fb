"""What a round leaves in the caller's result once every span is verified: the averages that checked out, and this
peer's own values everywhere else (a span whose reducer failed or lied, a chunk void in its statement)."""

from __future__ import annotations

import torch

from peerd.averaging.group import RoundReport
from peerd.averaging.layout import chunk_bounds
from peerd.averaging.sender import SpanExchange
from peerd.averaging.verify.round import RoundVerification

__all__ = ["settle"]


def settle(verification: RoundVerification, flat: torch.Tensor, result: torch.Tensor,
           spans: list[tuple[int, int]], report: RoundReport, exchanges: list[SpanExchange]) -> None:
    """Keeps this peer's own values wherever an average did not check out or its chunk is void, and carries
    error feedback only where an average is applied."""
    for exchange in exchanges:
        start, end = spans[exchange.index]
        if end == start:
            continue
        verdict = verification.verdicts.get(exchange.index)
        if verdict is None or not verdict.apply:
            result[start:end] = flat[start:end]
            report.unverified[exchange.index] = verdict.reason if verdict is not None else "not verified"
            continue
        for index in verdict.void:
            a, b = chunk_bounds(end - start, verification.config.chunk_numel)[index]
            result[start + a : start + b] = flat[start + a : start + b]
        exchange.commit_feedback(verdict.void)
    start, end = spans[verification.rank]
    for index in verification.own_void:
        a, b = chunk_bounds(end - start, verification.config.chunk_numel)[index]
        result[start + a : start + b] = flat[start + a : start + b]

