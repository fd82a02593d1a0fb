"""The caller's side of remote experts: who is alive (DHT records), one batched call per expert and pass.

:class:`ExpertClient` lives on the daemon's event loop. Model code runs on worker threads and reaches it
through :meth:`ExpertClient.run`. It re-reads ``<run_name>.experts`` every ``refresh_period`` seconds while a
MoE layer tracks experts; an expert is routable when its record is unexpired, its width matches and it is not
backing off. A call that fails or times out makes its expert back off for ``retry_after`` seconds, doubling
per consecutive failure up to :data:`MAX_BACKOFF`; a success, or a new announcement from a restarted host
(another ``started_at``), makes it routable again at once.
"""

from __future__ import annotations

import asyncio
import logging
import math
import threading
import time
from collections.abc import Coroutine, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from hivemind.p2p import P2P

from peerd.averaging import codec
from peerd.averaging.wire import read_frame, read_message, write_frames
from peerd.errors import ActivationsGone, PeerdError, PeerUnreachable, ProtocolViolation, RPCTimeout
from peerd.experts.records import PROTOCOL_VERSION, ExpertReader, SeenExpert, experts_key
from peerd.experts.server import HANDLER_NAME, ExpertServer, max_payload_bytes
from peerd.experts.stats import CallStats, latency_histogram
from peerd.experts.streams import StreamPool
from peerd.proto import peerd_experts_pb2 as pb
from peerd.swarm.node import SwarmNode, now

__all__ = ["Answer", "ExpertClient", "LayerStats"]

logger = logging.getLogger(__name__)

MAX_BACKOFF = 60.0
T = TypeVar("T")


@dataclass
class _Backoff:
    until: float  # time.monotonic()
    delay: float
    started_at: float  # of the record that failed; a new announcement clears the backoff


@dataclass(frozen=True)
class Answer:
    result: torch.Tensor  # [num_tokens, hidden_dim]
    kept: bool  # forward by call_id: the host keeps the activations, so the backward may send only gradients


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
    def __init__(self, swarm: SwarmNode, p2p: P2P, run_name: str) -> None:
        self.swarm = swarm
        self.p2p = p2p
        self.key = experts_key(run_name)
        self._loop = asyncio.get_running_loop()
        self._reader = ExpertReader()
        self._directory: dict[str, SeenExpert] = {}
        self._backoff: dict[str, _Backoff] = {}
        self._retry_after = 2.0
        self._refresh_period = math.inf
        self._refresher: asyncio.Task[None] | None = None
        self._found = threading.Event()
        self._waited_for_experts = False
        self._streams = StreamPool(p2p, HANDLER_NAME)
        self.stats: dict[str, dict[str, CallStats]] = {}
        self._local: ExpertServer | None = None
        self.latency = latency_histogram()  # of every call this peer made, for /metrics
        self.layers: dict[str, LayerStats] = {}

    def attach_local(self, server: ExpertServer) -> None:
        """This peer's own expert server: calls to its experts go to it directly (libp2p cannot dial itself)."""
        self._local = server

    # --- discovery --------------------------------------------------------------------------------------------

    def track(self, name: str, refresh_period: float, retry_after: float) -> LayerStats:
        """Registers a MoE layer (any thread); starts the periodic refresh of the expert records."""
        self._refresh_period = min(self._refresh_period, refresh_period)
        self._retry_after = retry_after
        stats = self.layers.setdefault(name, LayerStats())
        self._loop.call_soon_threadsafe(self._ensure_refresher)
        return stats

    def _ensure_refresher(self) -> None:
        if self._refresher is None or self._refresher.done():
            self._refresher = asyncio.ensure_future(self._refresh_periodically())

    async def _refresh_periodically(self) -> None:
        while True:
            await self.refresh()
            # the refresh cadence, not a synchronisation wait; quicker while no expert is known (just joined)
            await asyncio.sleep(self._refresh_period if self._directory else min(self._refresh_period, 0.2))

    async def refresh(self) -> None:
        try:
            seen = self._reader.parse(await self.swarm.read_entries(self.key))
        except PeerdError as e:
            logger.warning("Could not read expert records: %s", e)
            return
        for uid, backoff in list(self._backoff.items()):
            if uid in seen and seen[uid].record.started_at != backoff.started_at:
                del self._backoff[uid]  # the host restarted: give it a chance at once
        # A DHT read may come back incomplete (a slow node); a record we already hold stays until it expires, so
        # an expert leaves routing exactly when its host stopped announcing it, not on a lookup hiccup.
        current = now()
        kept = {
            uid: old for uid, old in self._directory.items() if old.expires_at >= current and uid not in seen
        }
        self._directory = {**kept, **seen}  # replaced whole: worker threads read it without a lock
        if self._directory:
            self._found.set()

    def wait_for_experts(self, timeout: float) -> bool:
        """Blocks a worker thread until some expert record was read, at most ``timeout`` seconds in all: a
        model's first passes right after joining should not fall back for lack of a first DHT answer, but a
        swarm without experts must not stall every pass."""
        if self._found.is_set() or self._waited_for_experts:
            return self._found.is_set()
        found = self._found.wait(timeout)
        self._waited_for_experts = True
        if not found:
            logger.warning(
                "No expert records found in the DHT within %.0fs; MoE layers output zeros until "
                "experts are announced",
                timeout,
            )
        return found

    def routable(self, uids: Iterable[str], hidden_dim: int) -> list[bool]:
        """Per uid: announced, unexpired, of width ``hidden_dim`` and not backing off. Any thread."""
        return [reason is None for reason in self.unroutable_reasons(uids, hidden_dim)]

    def unroutable_reasons(self, uids: Iterable[str], hidden_dim: int) -> list[str | None]:
        """Per uid: why it cannot be routed to now, or None if it can. Any thread."""
        directory, current, clock = self._directory, now(), time.monotonic()
        reasons: list[str | None] = []
        for uid in uids:
            seen = directory.get(uid)
            backoff = self._backoff.get(uid)
            if seen is None:
                reasons.append("not announced")
            elif seen.expires_at < current:
                reasons.append(f"record expired {current - seen.expires_at:.1f}s ago")
            elif seen.record.protocol_version != PROTOCOL_VERSION:
                reasons.append(f"its host speaks expert protocol {seen.record.protocol_version}, not {PROTOCOL_VERSION}")
            elif seen.record.hidden_dim != hidden_dim:
                reasons.append(f"width {seen.record.hidden_dim}, not {hidden_dim}")
            elif backoff is not None and backoff.until > clock:
                reasons.append(f"backing off for {backoff.until - clock:.1f}s")
            else:
                reasons.append(None)
        return reasons

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
        seen = self._directory.get(uid)
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
        self._backoff.pop(uid, None)
        return result

    def _fail(self, uid: str, seen: SeenExpert, reason: str) -> None:
        self._streams.forget(seen.record.peer_id)
        previous = self._backoff.get(uid)
        delay = self._retry_after if previous is None else min(MAX_BACKOFF, previous.delay * 2)
        self._backoff[uid] = _Backoff(time.monotonic() + delay, delay, seen.record.started_at)
        logger.info(
            "Expert %s at %s failed (%s); skipping it for %.1fs",
            uid,
            seen.record.peer_id,
            reason[:200],
            delay,
        )

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
            return Answer(codec.decode(result.payload, peer_id=peer, expected_shape=shape).float(), result.kept)
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
            return Answer(codec.decode(data, peer_id=peer, expected_shape=shape).float(), response.kept)
        self._streams.release(peer, stream)
        raise ActivationsGone(response.message, peer_id=peer)

    # --- views ------------------------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        directory, clock = self._directory, time.monotonic()
        experts = {}
        for uid in sorted(set(directory) | set(self.stats)):
            seen, backoff = directory.get(uid), self._backoff.get(uid)
            calls = self.stats.get(uid, {})
            experts[uid] = {
                "peer_id": seen.record.peer_id if seen else None,
                "announced": seen is not None,
                "backing_off_for": round(backoff.until - clock, 2)
                if backoff and backoff.until > clock
                else 0.0,
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
        if self._refresher is not None:
            self._refresher.cancel()
            self._refresher = None
        self._streams.close()
