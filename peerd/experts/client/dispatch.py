"""Waiting for expert calls with a quorum: proceed once every token has enough answers and a grace passed.

One pass of a MoE layer makes one call per expert, each carrying a set of tokens. :func:`gather_quorum`
returns as soon as (a) every call finished, or (b) every token got at least its quorum of answers (``k_min``,
or fewer if fewer experts were asked) and ``grace`` seconds have passed since, or (c) ``timeout`` passed.
Calls still running then are cancelled; their tokens count as unanswered by those experts.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Sequence
from typing import TypeVar

import torch

__all__ = ["gather_quorum"]

T = TypeVar("T")


async def gather_quorum(
    calls: Sequence[Awaitable[T]],
    tokens: Sequence[torch.Tensor],
    need: torch.Tensor,
    timeout: float,
    grace: float,
) -> dict[int, T]:
    """Results of the calls that succeeded in time, by index. ``tokens[i]``: token indices call ``i`` covers
    (each token at most once per call); ``need`` [T]: answers each token needs before the grace period."""
    loop = asyncio.get_running_loop()
    pending = {asyncio.ensure_future(call): i for i, call in enumerate(calls)}
    results: dict[int, T] = {}
    answered = torch.zeros_like(need)
    deadline = loop.time() + timeout
    grace_deadline: float | None = None
    try:
        while pending:
            if grace_deadline is None and bool((answered >= need).all()):
                grace_deadline = loop.time() + grace
            until = deadline if grace_deadline is None else min(deadline, grace_deadline)
            remaining = until - loop.time()
            if remaining <= 0:
                break
            done, _ = await asyncio.wait(pending, timeout=remaining, return_when=asyncio.FIRST_COMPLETED)
            for future in done:
                index = pending.pop(future)
                if not future.cancelled() and future.exception() is None:
                    results[index] = future.result()
                    answered[tokens[index]] += 1
    finally:
        for future in pending:
            future.cancel()
        if pending:  # let the cancellations run so no task is left behind un-awaited
            await asyncio.wait(pending)
    return results
