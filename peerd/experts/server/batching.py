"""Server-side batching: concurrent calls to the same (expert, pass) are computed as one batch.

Calls queue per (expert, pass), and within that per caller. The first call of an idle queue schedules a batch
on the server's compute threads (after ``experts.batch_wait`` seconds, 0 by default); when the batch starts it
takes the calls that queued up meanwhile, up to ``experts.max_request_tokens`` tokens, one call of each caller
in turn, so the busier the expert the larger its batches, and a caller with many calls waiting takes no more
of a batch than one with a single call. One caller's calls wait for at most
``experts.max_queued_tokens_per_caller`` tokens at once: the rest of the queue stays open to the others. A
backward call's output gradients are bounded against other callers' (:mod:`peerd.experts.bounds`).
Payloads are decoded and validated on the compute thread, each call on its own: one caller's malformed tensor
fails only that call. Results go back to the event loop through futures.

A forward call with a call id has its activations kept (:mod:`peerd.experts.server.stash`): its autograd graph when
it was computed on its own, its inputs when it shared a batch with other callers' calls (one graph cannot be
split between separate backward calls). A backward call by id takes them back and sends only gradients.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import Counter, OrderedDict, deque
from collections.abc import Callable
from dataclasses import dataclass

import torch

from peerd.errors import CodecError
from peerd.experts.bounds import NormBound
from peerd.experts.calls import CallResult, wire_codec
from peerd.experts.server.backend import BackwardItem, ExpertBackend, ExpertFailure
from peerd.experts.server.stash import ActivationStash
from peerd.experts.server.workers import Job, Workers
from peerd.proto import peerd_experts_pb2 as pb
from peerd.wire import codec

__all__ = ["BatchQueue", "PendingCall"]

logger = logging.getLogger(__name__)

@dataclass
class PendingCall:
    peer: str
    num_tokens: int
    payloads: list[bytes | bytearray]
    lossless: bool
    future: asyncio.Future[CallResult]
    received: float
    call_id: int = 0  # forward: keep the activations under this id; backward: use those kept under it


class BatchQueue:
    def __init__(
        self,
        backend: ExpertBackend,
        phase: str,
        workers: Workers,
        loop: asyncio.AbstractEventLoop,
        max_batch_tokens: int,
        max_queued_tokens: int,
        wait: float,
        stash: ActivationStash | None = None,
        *,
        max_queued_per_caller: int | None = None,
        gradients: NormBound | None = None,
    ) -> None:
        """``max_queued_per_caller``: tokens one caller may have waiting (None: ``max_queued_tokens``);
        ``gradients``: the bound on backward calls' output gradients (None: none)."""
        self.backend = backend
        self._stash = stash if stash is not None and stash.enabled else None
        self.phase = phase
        self._workers = workers
        self._loop = loop
        self._max_batch = max_batch_tokens
        self._max_queued = max_queued_tokens
        self._max_per_caller = max_queued_tokens if max_queued_per_caller is None else max_queued_per_caller
        self._gradients = gradients
        self._wait = wait
        self._calls: OrderedDict[str, deque[PendingCall]] = OrderedDict()  # per caller, next to serve first
        self._queued_tokens = 0
        self._queued_by: Counter[str] = Counter()
        self._scheduled = False
        self._closed = False
        self._mutex = threading.Lock()  # the loop thread appends, a compute thread takes

    def submit(self, call: PendingCall) -> bool:
        """Queues ``call`` (event loop thread); False if the expert, or this caller, already has too many tokens
        waiting."""
        with self._mutex:
            if self._closed or self._queued_tokens + call.num_tokens > self._max_queued \
                    or self._queued_by[call.peer] + call.num_tokens > self._max_per_caller:
                return False
            self._calls.setdefault(call.peer, deque()).append(call)
            self._queued_tokens += call.num_tokens
            self._queued_by[call.peer] += call.num_tokens
            if self._scheduled:
                return True
            self._scheduled = True
        if self._wait > 0:
            self._loop.call_later(self._wait, self._launch)
        else:
            self._launch()
        return True

    @property
    def queued_tokens(self) -> int:
        """Tokens of the calls waiting for a batch (read by the status; a torn read is harmless)."""
        return self._queued_tokens

    def _launch(self) -> None:
        try:
            self._workers.submit(self._run)
        except RuntimeError:  # workers shut down: the server is stopping
            self.close("the expert host is shutting down")

    def close(self, reason: str) -> None:
        with self._mutex:
            self._closed = True
            calls = [call for queued in self._calls.values() for call in queued]
            self._calls, self._queued_tokens = OrderedDict(), 0
            self._queued_by.clear()
        for call in calls:
            self._resolve(call, CallResult(pb.EXPERT_SHUTTING_DOWN, reason))

    def _take(self) -> list[PendingCall]:
        """The next batch: one call of each caller in turn, until the next one would overflow it."""
        with self._mutex:
            taken: list[PendingCall] = []
            tokens = 0
            while self._calls:
                peer, queued = next(iter(self._calls.items()))
                if taken and tokens + queued[0].num_tokens > self._max_batch:
                    break
                call = queued.popleft()
                taken.append(call)
                tokens += call.num_tokens
                self._queued_by[peer] -= call.num_tokens
                del self._calls[peer]
                if queued:  # to the back of the line: the next call is the next caller's
                    self._calls[peer] = queued
                else:
                    del self._queued_by[peer]
            self._queued_tokens -= tokens
            return taken

    def _run(self) -> None:
        try:
            self._process(self._take())
        except Exception:  # never leave callers hanging on an unexpected bug
            logger.exception("Expert %s %s batch failed unexpectedly", self.backend.uid, self.phase)
        with self._mutex:
            more = bool(self._calls) and not self._closed
            self._scheduled = more
        if more:  # requeue behind other experts' batches instead of looping here, so they are served fairly
            self._launch()

    def _process(self, calls: list[PendingCall]) -> None:
        good: list[tuple[PendingCall, list[torch.Tensor]]] = []
        for call in calls:
            shape = (call.num_tokens, self.backend.hidden_dim)
            try:
                tensors = [
                    codec.decode(p, peer_id=call.peer, expected_shape=shape).float() for p in call.payloads
                ]
            except CodecError as e:
                self.backend.stats[self.phase].failed(str(e))
                self._resolve(call, CallResult(pb.EXPERT_BAD_PAYLOAD, str(e)))
                continue
            good.append((call, tensors))
        if not good:
            return
        owners, tokens = [call for call, _ in good], sum(call.num_tokens for call, _ in good)
        delivered = False

        def deliver(results: list[torch.Tensor], kept: list[bool] | None = None) -> None:
            nonlocal delivered
            delivered = True
            for i, (call, part) in enumerate(zip(owners, results, strict=True)):
                try:
                    payload = codec.encode(part, wire_codec(call.lossless))
                except ValueError as e:
                    self._resolve(call, CallResult(pb.EXPERT_INTERNAL_ERROR, str(e), batch_tokens=tokens))
                    continue
                self.backend.stats[self.phase].ok(call.num_tokens, time.monotonic() - call.received)
                ok = CallResult(pb.EXPERT_OK, payload=payload, batch_tokens=tokens, kept=bool(kept and kept[i]))
                self._resolve(call, ok)

        try:
            if self.phase == "forward":
                self._forward([tensors[0] for _, tensors in good], owners, deliver)
            else:
                items: list[BackwardItem] = []
                for call, tensors in good:
                    item = self._backward_item(call, tensors)
                    if item is None:
                        owners.remove(call)
                    else:
                        items.append(item)
                if items:
                    self.backend.backward(items, deliver, self._schedule_step)
        except ExpertFailure as e:
            if delivered:  # the callers have their answer; only the update after it failed
                logger.warning("%s", e)
                return
            for call in owners:
                self.backend.stats[self.phase].failed(str(e))
                self._resolve(call, CallResult(pb.EXPERT_INTERNAL_ERROR, str(e), batch_tokens=tokens))

    def _forward(
        self,
        inputs: list[torch.Tensor],
        calls: list[PendingCall],
        deliver: Callable[[list[torch.Tensor], list[bool]], None],
    ) -> None:
        stash, uid = self._stash, self.backend.uid
        if stash is not None and len(calls) == 1 and calls[0].call_id:
            # a call computed on its own keeps its autograd graph: its backward skips the forward entirely
            outputs, graph = self.backend.forward_keeping_graph(inputs[0])
            deliver([outputs], [stash.put((uid, calls[0].peer, calls[0].call_id), inputs[0], graph)])
            return
        outputs = self.backend.forward(torch.cat(inputs))
        # batched with other callers: keep the inputs only (one graph cannot be split between backward calls)
        kept = [
            stash is not None and call.call_id != 0 and stash.put((uid, call.peer, call.call_id), x, None)
            for call, x in zip(calls, inputs, strict=True)
        ]
        deliver(list(torch.split(outputs, [call.num_tokens for call in calls])), kept)

    def _backward_item(self, call: PendingCall, tensors: list[torch.Tensor]) -> BackwardItem | None:
        """The call's share of the batch, or None after answering it (activations gone or mismatched)."""
        if self._gradients is not None:  # the output gradients: the last payload, with or without the inputs
            tensors = [*tensors[:-1], self._gradients.bound(call.peer, tensors[-1])]
        if not call.call_id:
            return BackwardItem(tensors[0], tensors[1])
        kept = None if self._stash is None else self._stash.take((self.backend.uid, call.peer, call.call_id))
        if kept is None:
            self._resolve(
                call,
                CallResult(
                    pb.EXPERT_ACTIVATIONS_GONE,
                    f"activations of call {call.call_id} are not kept (any more): send the inputs with call_id 0",
                ),
            )
            return None
        if kept.tokens != call.num_tokens:
            self.backend.stats[self.phase].failed("token count differs from its forward call")
            self._resolve(
                call,
                CallResult(
                    pb.EXPERT_BAD_REQUEST,
                    f"call {call.call_id} was a forward of {kept.tokens} tokens, not {call.num_tokens}",
                ),
            )
            return None
        return BackwardItem(kept.inputs, tensors[0], kept.graph)

    def _schedule_step(self, step: Job) -> None:
        try:
            self._workers.submit(step, background=True)
        except RuntimeError:  # shutting down: apply it now rather than lose what the callers taught
            step()

    def _resolve(self, call: PendingCall, result: CallResult) -> None:
        def deliver() -> None:
            if not call.future.done():  # the caller may have given up (stream closed)
                call.future.set_result(result)

        try:
            self._loop.call_soon_threadsafe(deliver)
        except RuntimeError:  # the loop is closed: nobody is waiting any more
            pass
