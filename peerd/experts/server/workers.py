"""The expert server's compute threads: callers' batches first, optimizer steps when nothing else waits.

A backward call is answered as soon as its input gradients exist; the expert's optimizer step comes after, as
background work, so it never delays another caller's forward or backward batch queued behind it. A step that
waits too long is still bounded: :class:`~peerd.experts.server.backend.ExpertBackend` applies its own pending steps
before computing more gradients once :data:`~peerd.experts.server.backend.MAX_PENDING_STEPS` have piled up.
"""

from __future__ import annotations

import logging
import threading
from collections import deque
from collections.abc import Callable

__all__ = ["Workers"]

logger = logging.getLogger(__name__)

Job = Callable[[], None]


class Workers:
    def __init__(self, threads: int, name: str = "peerd-expert") -> None:
        self._urgent: deque[Job] = deque()
        self._background: deque[Job] = deque()
        self._ready = threading.Condition()
        self._closed = False
        self._threads = [
            threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(threads)
        ]
        for thread in self._threads:
            thread.start()

    def submit(self, job: Job, background: bool = False) -> None:
        """Queues ``job``; raises RuntimeError once shut down."""
        with self._ready:
            if self._closed:
                raise RuntimeError("the expert workers are shut down")
            (self._background if background else self._urgent).append(job)
            self._ready.notify()

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._urgent and not self._background and not self._closed:
                    self._ready.wait()
                if self._urgent:
                    job = self._urgent.popleft()
                elif self._background:
                    job = self._background.popleft()
                else:
                    return  # closed and drained
            try:
                job()
            except Exception:  # a job's own bug must not kill the thread that serves every expert
                logger.exception("An expert job failed")

    def shutdown(self) -> None:
        """Finishes the queued jobs (pending optimizer steps included), then stops the threads."""
        with self._ready:
            self._closed = True
            self._ready.notify_all()
        for thread in self._threads:
            thread.join()
