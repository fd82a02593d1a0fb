"""Where the per-chunk tensor work of a round (coding, adding, averaging) runs.

Coding a chunk of the default size (2^19 elements) takes less time than handing it to a worker thread and back.
Every hand-off also makes the event loop's thread and the worker threads fight over the GIL, since torch
releases and retakes it around each small op, and with several chunks in flight those waits add up to a large
share of a round's CPU, on machines where the peers already share the cores (the measurements are on the
benchmarks page, "All-reduce"). So chunks up to ``INLINE_MAX_NUMEL`` elements are worked on in the event loop
itself, where a chunk blocks other streams for about a millisecond at most; larger ones still go to a thread.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import ParamSpec, TypeVar

P = ParamSpec("P")
T = TypeVar("T")

INLINE_MAX_NUMEL = 1 << 20


async def run_chunk_work(numel: int, fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` for a chunk of ``numel`` elements: inline if small, else in a worker thread."""
    if numel <= INLINE_MAX_NUMEL:
        return fn(*args, **kwargs)
    return await asyncio.to_thread(fn, *args, **kwargs)
