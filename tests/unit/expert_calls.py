"""Runs calls through an expert's batch queues as the server does, without a network."""

from __future__ import annotations

import asyncio

from peerd.experts.calls import CallResult
from peerd.experts.server.backend import ExpertBackend
from peerd.experts.server.batching import BatchQueue, PendingCall
from peerd.experts.server.stash import ActivationStash
from peerd.experts.server.workers import Workers

Call = tuple[str, int, list[bytes]] | tuple[str, int, list[bytes], int]  # phase, tokens, payloads[, call id]


def run_calls(
    calls: list[Call], backend: ExpertBackend, wait: float = 0.0, stash: ActivationStash | None = None
) -> list[CallResult]:
    """Submits all ``calls`` at once (with ``wait``, calls to one pass share a batch) and returns the results."""

    async def body() -> list[CallResult]:
        loop = asyncio.get_running_loop()
        workers = Workers(1)
        try:
            queues = {
                phase: BatchQueue(backend, phase, workers, loop, 1024, 4096, wait, stash)
                for phase in ("forward", "backward")
            }
            futures = []
            for phase, tokens, payloads, *call_id in calls:
                future: asyncio.Future[CallResult] = loop.create_future()
                call = PendingCall("peer", tokens, payloads, True, future, 0.0, *call_id)
                assert queues[phase].submit(call)
                futures.append(future)
            return list(await asyncio.gather(*futures))
        finally:
            await asyncio.to_thread(workers.shutdown)  # runs the optimizer steps still pending

    return asyncio.run(body())
