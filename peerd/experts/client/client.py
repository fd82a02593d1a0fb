"""The caller's side of remote experts: one batched call per expert and pass, over reused libp2p streams.

:class:`ExpertClient` lives on the daemon's event loop. Model code runs on worker threads and reaches it
through :meth:`ExpertClient.run`. Who may be called is :class:`~peerd.experts.client.directory.ExpertDirectory`'s
business (DHT records, backoff); a call that fails or times out reports it there, so its expert backs off.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Coroutine
from dataclasses import dataclass
from typing import Any, TypeVar

import torch

from peerd.errors import ActivationsGone, PeerUnreachable, ProtocolViolation, RPCTimeout
from peerd.experts.bounds import NormBound
from peerd.experts.calls import HANDLER_NAME, LocalHost, max_payload_bytes
from peerd.experts.client.directory import ExpertDirectory
from peerd.experts.client.streams import StreamPool
from peerd.experts.records import PROTOCOL_VERSION, SeenExpert, experts_key
from peerd.experts.stats import CallStats, latency_histogram
from peerd.proto import peerd_experts_pb2 as pb
from peerd.swarm.node import SwarmNode
from peerd.wire import codec
from peerd.wire.frames import read_frame, read_message, write_frames
from peerd.wire.guard import StreamGuard

__all__ = ["Answer", "ExpertClient", "LayerStats"]

logger = logging.getLogger(__name__)

T = TypeVar("T")


@dataclass(frozen=True)
class Answer:
    result: torch.Tensor  # [num_tokens, hidden_dim]
    kept: bool  # forward by call_id: the host keeps the activations, so the backward may send only gradients
    host: str  # the peer that answered


@dataclass
class LayerStats:
    """What one MoE layer saw: tokens routed, tokens that fell back to a zero output, partial answers."""

    passes: int = 0
    tokens: int = 0
    fallback_tokens: int = 0  # no expert answered: zero output, the residual passes the token through
    partial_tokens: int = 0  # fewer than k experts answered; gates renormalized over those that did
    no_expert_alive: int = 0  # passes in which no expert of the layer was routable at all

    def as_dict(self) -> dict[str, Any]:
        return {
            "passes": self.passes,
            "tokens": self.tokens,
            "fallback_tokens": self.fallback_tokens,
            "partial_tokens": self.partial_tokens,
            "no_expert_alive": self.no_expert_alive,
        }


class ExpertClient:
    def __init__(self, swarm: SwarmNode, guard: StreamGuard, run_name: str) -> None:
        self.swarm = swarm
        self.guard = guard
        self.directory = ExpertDirectory(swarm, experts_key(run_name))
        self._loop = asyncio.get_running_loop()
        self._streams = StreamPool(guard, HANDLER_NAME)
        self.stats: dict[str, dict[str, CallStats]] = {}
        self._local: LocalHost | None = None
        self.latency = latency_histogram()  # of every call this peer made, for /metrics
        self.layers: dict[str, LayerStats] = {}
        self._bounds: dict[str, tuple[NormBound, NormBound]] = {}

    def attach_local(self, server: LocalHost) -> None:
        """This peer's own expert server: calls to its experts go to it directly (libp2p cannot dial itself)."""
        self._local = server

    def track(self, name: str, refresh_period: float, retry_after: float) -> LayerStats:
        """Registers a MoE layer (any thread); the directory starts re-reading the expert records."""
        self.directory.track(refresh_period, retry_after)
        return self.layers.setdefault(name, LayerStats())

    def answer_bounds(self, name: str, ratio: float | None) -> tuple[NormBound, NormBound]:
        """The bounds on the answers of the hosts MoE layer ``name`` calls: (forward outputs, input gradients)."""
        # the layer asks on every pass: the pair is built once
        return self._bounds.get(name) or self._bounds.setdefault(name, (NormBound(ratio), NormBound(ratio)))

    def out_of_bound(self, uid: str, phase: pb.ExpertPhase, peer_id: str, left_out: str | None) -> None:
        """Counts an answer of ``uid`` by ``peer_id`` that its layer found over the bound; ``left_out``: why it
        was left out (its expert is then skipped), None if it was scaled down instead. Any thread."""
        name = "forward" if phase == pb.EXPERT_FORWARD else "backward"
        stats = self.stats.get(uid, {}).get(name)
        if stats is not None:
            stats.out_of_bound += 1
        if left_out is not None:
            self._loop.call_soon_threadsafe(self.directory.left_out, uid, peer_id, left_out)

    def within_bound(self, uid: str) -> None:
        """An answer of ``uid`` was within the bound: it is no longer skipped for earlier ones. Any thread."""
        if uid in self.directory.distrust:
            self._loop.call_soon_threadsafe(self.directory.within_bound, uid)

    # --- calls ------------------------------------------------------------------------------------------------

    def run(self, coro: Coroutine[Any, Any, T], timeout: float) -> T:
        """Runs ``coro`` on the daemon's loop from a worker thread and waits at most ``timeout`` seconds."""
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is self._loop:
            coro.close()
            raise RuntimeError(
                "remote experts must be called from a worker thread, not the event loop thread"
            )
        future = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return future.result(timeout)
        except TimeoutError:
            future.cancel()
            raise

    async def call(
        self,
        uid: str,
        phase: pb.ExpertPhase,
        payloads: list[bytearray],
        num_tokens: int,
        hidden_dim: int,
        lossless: bool,
        timeout: float,
        call_id: int = 0,
    ) -> Answer:
        """One call: the [num_tokens, hidden_dim] result, or raises (and the expert backs off; not for
        :class:`ActivationsGone`, which only asks the caller to repeat the backward call with the inputs)."""
        name = "forward" if phase == pb.EXPERT_FORWARD else "backward"
        stats = self.stats.setdefault(
            uid, {"forward": CallStats(histogram=self.latency), "backward": CallStats(histogram=self.latency)}
        )[name]
        seen = self.directory.records.get(uid)
        if seen is None:
            raise PeerUnreachable(f"expert {uid} is not announced in the DHT")
        request = pb.ExpertRequest(
            protocol_version=PROTOCOL_VERSION,
            expert_uid=uid,
            phase=phase,
            num_tokens=num_tokens,
            hidden_dim=hidden_dim,
            payload_bytes=[len(p) for p in payloads],
            lossless=lossless,
            call_id=call_id,
        )
        started = time.monotonic()
        try:
            result = await asyncio.wait_for(self._exchange(seen.record.peer_id, request, payloads), timeout)
        except TimeoutError:
            stats.failed(f"timed out after {timeout}s", timed_out=True)
            self._fail(uid, seen, f"timed out after {timeout}s")
            raise RPCTimeout(
                f"expert {uid} at {seen.record.peer_id} timed out", peer_id=seen.record.peer_id
            ) from None
        except asyncio.CancelledError:  # the layer went on without us (grace period over): late, not failed
            stats.late += 1
            raise
        except ActivationsGone:
            stats.activations_gone += 1
            raise
        except Exception as e:  # whatever went wrong, the layer goes on without this expert
            stats.failed(f"{type(e).__name__}: {e}")
            self._fail(uid, seen, str(e))
            raise
        stats.ok(num_tokens, time.monotonic() - started)
        self.directory.succeeded(uid)
        return result

    def _fail(self, uid: str, seen: SeenExpert, reason: str) -> None:
        self._streams.forget(seen.record.peer_id)
        self.directory.failed(uid, seen, reason)

    async def _exchange(self, peer: str, request: pb.ExpertRequest, payloads: list[bytearray]) -> Answer:
        uid, num_tokens, hidden_dim = request.expert_uid, request.num_tokens, request.hidden_dim
        shape = (num_tokens, hidden_dim)
        if self._local is not None and peer == self.swarm.peer_id:
            result = await self._local.serve_local(request, list(payloads))
            if result.code == pb.EXPERT_ACTIVATIONS_GONE:
                raise ActivationsGone(result.message, peer_id=peer)
            if result.code != pb.EXPERT_OK:
                raise ProtocolViolation(
                    f"own expert {uid} refused the call: {pb.ExpertCode.Name(result.code)} {result.message}",
                    peer_id=peer,
                )
            return Answer(
                codec.decode(result.payload, peer_id=peer, expected_shape=shape).float(), result.kept, peer
            )
        stream = await self._streams.acquire(peer)
        while True:
            answered = False
            try:
                await write_frames(stream.writer, [request.SerializeToString(), *payloads])
                response = await read_message(stream.reader, pb.ExpertResponse, peer)
                answered = True
                if response.code == pb.EXPERT_ACTIVATIONS_GONE:
                    break  # nothing follows: the stream stays usable
                if response.code != pb.EXPERT_OK:
                    raise ProtocolViolation(
                        f"expert {uid} at {peer} refused the call: "
                        f"{pb.ExpertCode.Name(response.code)} {response.message}",
                        peer_id=peer,
                    )
                data = await read_frame(
                    stream.reader, max_payload_bytes(num_tokens, hidden_dim), peer, "expert result"
                )
            except (ProtocolViolation, ConnectionError, OSError):
                stream.writer.close()
                if stream.reused and not answered:  # an idle stream the host (or p2pd) had closed meanwhile
                    self._streams.forget(peer)
                    stream = await self._streams.acquire(peer, fresh=True)
                    continue
                raise
            except (
                BaseException
            ):  # cancelled (timeout, grace period): the stream is mid-exchange, never reuse it
                stream.writer.close()
                raise
            self._streams.release(peer, stream)
            return Answer(codec.decode(data, peer_id=peer, expected_shape=shape).float(), response.kept, peer)
        self._streams.release(peer, stream)
        raise ActivationsGone(response.message, peer_id=peer)

    # --- views ------------------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        records = self.directory.records
        experts = {}
        for uid in sorted(set(records) | set(self.stats)):
            seen = records.get(uid)
            calls = self.stats.get(uid, {})
            experts[uid] = {
                "peer_id": seen.record.peer_id if seen else None,
                "announced": seen is not None,
                "backing_off_for": self.directory.backing_off_for(uid),
                "updates": seen.record.updates if seen else None,
                **{phase: stats.as_dict() for phase, stats in calls.items()},
            }
        layers = {name: stats.as_dict() for name, stats in list(self.layers.items())}
        return {"experts": experts, "layers": layers}

    def totals(self) -> tuple[int, int]:
        """Calls made and calls that failed, over all experts and both passes."""
        stats = [s for per_uid in list(self.stats.values()) for s in per_uid.values()]
        return sum(s.calls for s in stats), sum(s.errors for s in stats)

    async def close(self) -> None:
        self.directory.close()
        self._streams.close()
