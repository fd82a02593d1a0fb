"""The compute thread: the one thread of a trainer's daemon that runs the model's work with all of torch's threads.

torch's CPU builds run a large op on a team of OpenMP threads, and every OS thread that ever ran such an op
keeps a team of its own for as long as it lives. GNU libgomp (the OpenMP runtime of torch's wheels) keeps idle
team threads spinning, ready for the next op, only while the threads of all teams fit the machine's cores; past
that they sleep and are woken for every op, and a model's forward and backward (thousands of short ops) pay the
wake-up each time. A daemon touches tensors from many threads (the event loop codes chunks of a round, asyncio's
worker threads load states, expert workers run experts), so left alone the model's ops end up on a sleeping team.

So the model's work (its construction, forward and backward, optimizer steps, states) runs on one thread, and
:func:`configure`, called by a trainer's daemon before anything else touches torch, gives that thread torch's
threads and every other thread one: the compute thread's team is then the only one. The compute thread also
flushes subnormal floats to zero (a flag of the CPU's, set per thread).
"""

from __future__ import annotations

import asyncio
import functools
import threading
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import ParamSpec, TypeVar

import torch

__all__ = ["compute_threads", "configure", "run"]

P = ParamSpec("P")
T = TypeVar("T")

_executor: ThreadPoolExecutor | None = None
_threads = 0
_lock = threading.Lock()


def configure(threads: int | None = None) -> int:
    """Starts the compute thread with ``threads`` torch threads (None: torch's default, which follows
    ``OMP_NUM_THREADS``) and leaves the calling thread, and every thread that first runs torch after it, one torch
    thread. Called once, on the daemon's main thread, before any model exists. Returns the compute thread's
    torch threads."""
    _start(threads or torch.get_num_threads())
    # torch.set_num_threads sets the calling thread's count and the one each new thread takes at its first op
    torch.set_num_threads(1)
    return _threads


def compute_threads() -> int:
    """The compute thread's torch threads (0 before it started)."""
    return _threads


async def run(fn: Callable[P, T], *args: P.args, **kwargs: P.kwargs) -> T:
    """``fn(*args, **kwargs)`` on the compute thread, which is started with torch's default threads if
    :func:`configure` was not called (a trainer used as a library keeps the other threads as they are)."""
    executor = _executor or _start(torch.get_num_threads())
    return await asyncio.get_running_loop().run_in_executor(executor, functools.partial(fn, *args, **kwargs))


def _start(threads: int) -> ThreadPoolExecutor:
    global _executor, _threads
    with _lock:
        if _executor is None:
            def init() -> None:
                torch.get_num_threads()  # a thread takes the default count at its first op: have that happen
                torch.set_num_threads(threads)  # before this, which sets its own count, so that it sticks
                # a CPU flag of this thread's: subnormal floats (below 1.2e-38, where a model's tiny values
                # underflow to) cost the CPU many times a normal one and carry nothing a model needs; every
                # peer flushes them alike, so members still compute the same bits
                torch.set_flush_denormal(True)

            executor = ThreadPoolExecutor(1, thread_name_prefix="peerd-compute", initializer=init)
            executor.submit(int).result()  # the count is set before configure lowers the default
            _executor, _threads = executor, threads
        return _executor
