"""The expert server: serves this peer's experts over libp2p (``protocols/peerd_experts.proto``).

It registers one stream handler on hivemind's P2P, validates each call's header on the event loop (version,
pass, uid, sizes: anything wrong is answered with an error code naming the problem, before any payload is
read into memory), hands the payloads to the expert's :class:`~peerd.experts.server.batching.BatchQueue` and writes
the result back. Compute runs on ``experts.threads`` worker threads, so the daemon's control endpoint keeps
answering. Experts are announced in the DHT (``peerd.experts.records``) every ``experts.announce_period``.
"""

from __future__ import annotations

import asyncio
import logging
import time
from typing import Any

from google.protobuf.message import DecodeError

from peerd.config import ExpertsConfig
from peerd.errors import PeerdError, ProtocolViolation
from peerd.experts.bounds import NormBound
from peerd.experts.calls import HANDLER_NAME, IDLE_SECONDS, PHASES, CallResult
from peerd.experts.records import PROTOCOL_VERSION, ExpertHostRecord, experts_key
from peerd.experts.server.backend import ExpertBackend
from peerd.experts.server.batching import BatchQueue, PendingCall
from peerd.experts.server.headers import check_header, oversized_payload
from peerd.experts.server.modules import build_expert
from peerd.experts.server.stash import ActivationStash
from peerd.experts.server.workers import Workers
from peerd.experts.stats import latency_histogram
from peerd.proto import peerd_experts_pb2 as pb
from peerd.swarm.node import SwarmNode, now
from peerd.wire.frames import (
    MAX_HEADER_BYTES,
    read_frame,
    read_frame_or_eof,
    skip_frame,
    wait_for_close,
    write_frames,
)
from peerd.wire.guard import StreamGuard

__all__ = ["ExpertServer"]

logger = logging.getLogger(__name__)

DRAIN_TIMEOUT = 10.0  # seconds to read the payload of a refused call before answering
STREAM_IDLE_TIMEOUT = 3 * IDLE_SECONDS


class ExpertServer:
    def __init__(
        self,
        config: ExpertsConfig,
        swarm: SwarmNode,
        guard: StreamGuard,
        run_name: str,
        backends: dict[str, ExpertBackend],
    ) -> None:
        self.config = config
        self.swarm = swarm
        self.guard = guard
        self.key = experts_key(run_name)
        self.backends = backends
        self.started_at = now()
        self.rejected = 0  # calls refused as malformed (unknown uid, bad header or payload)
        self.last_rejection: str | None = None
        self.latency = latency_histogram()  # of every call served, for /metrics
        for backend in backends.values():
            for stats in backend.stats.values():
                stats.histogram = self.latency
        self._workers = Workers(config.threads)
        self.stash = ActivationStash(config.keep_activations_tokens, config.keep_activations_ttl)
        loop = asyncio.get_running_loop()
        self.gradients = {uid: NormBound(config.max_caller_gradient_ratio) for uid in backends}
        self._queues = {
            (uid, phase): BatchQueue(
                backend,
                phase,
                self._workers,
                loop,
                config.max_request_tokens,
                config.max_queued_tokens,
                config.batch_wait,
                self.stash,
                max_queued_per_caller=config.queued_tokens_per_caller,
                gradients=self.gradients[uid] if phase == "backward" else None,
            )
            for uid, backend in backends.items()
            for phase in ("forward", "backward")
        }
        self._announcer: asyncio.Task[None] | None = None
        self._stop = asyncio.Event()

    @classmethod
    async def create(cls, config: ExpertsConfig, swarm: SwarmNode, guard: StreamGuard, run_name: str) -> ExpertServer:
        """Builds the experts (ConfigError if the module is unusable), serves and announces them."""

        def build() -> dict[str, ExpertBackend]:
            return {uid: ExpertBackend(uid, build_expert(config, uid), config) for uid in config.served_uids}

        server = cls(config, swarm, guard, run_name, await asyncio.to_thread(build))
        await guard.add_handler(HANDLER_NAME, server._handle_stream)
        await server.announce()
        server._announcer = asyncio.ensure_future(server._announce_periodically())
        logger.info(
            "Serving %d experts (%s) of width %d",
            len(server.backends),
            ", ".join(server.uids),
            config.hidden_dim,
        )
        return server

    @property
    def uids(self) -> list[str]:
        return list(self.backends)

    # --- announcing -----------------------------------------------------------------------------------------

    def record(self) -> ExpertHostRecord:
        current = max(now(), self.started_at)
        return ExpertHostRecord(
            peer_id=self.swarm.peer_id,
            maddrs=self.swarm.visible_maddrs(),
            protocol_version=PROTOCOL_VERSION,
            hidden_dim=self.config.hidden_dim,
            module=self.config.module,
            uids=list(self.backends),
            updates=[backend.updates for backend in self.backends.values()],
            started_at=self.started_at,
            updated_at=current,
        )

    async def announce(self) -> None:
        started = time.monotonic()
        expiration = now() + self.config.record_ttl
        try:
            await self.swarm.store(self.key, self.swarm.peer_id, self.record().to_wire(), expiration)
        except PeerdError as e:
            logger.warning("Could not announce the experts: %s", e)
        took = time.monotonic() - started
        if took > self.config.announce_period:
            logger.warning(
                "Announcing the experts took %.1fs (experts.announce_period is %.1fs)",
                took,
                self.config.announce_period,
            )

    async def _announce_periodically(self) -> None:
        while not self._stop.is_set():
            try:
                await asyncio.wait_for(self._stop.wait(), self.config.announce_period)
            except TimeoutError:
                try:
                    await self.announce()
                except Exception:  # keep announcing: a dead announcer would silently retire every expert
                    logger.exception("Announcing the experts failed")

    # --- serving ----------------------------------------------------------------------------------------------

    async def _handle_stream(
        self, info: object, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        """Serves calls on one stream, one after the other, until the caller closes it or anything fails."""
        peer = str(getattr(info, "peer_id", "?"))
        try:
            while not self._stop.is_set():
                # a caller's pool drops streams idle for calls.IDLE_SECONDS; one that holds it longer is not
                # served (it would keep one of its stream slots for nothing)
                header = await asyncio.wait_for(
                    read_frame_or_eof(reader, MAX_HEADER_BYTES, peer, "request header"), STREAM_IDLE_TIMEOUT)
                if header is None:
                    return
                try:
                    request = pb.ExpertRequest.FromString(header)
                except DecodeError as e:
                    raise ProtocolViolation(
                        f"{peer} sent a malformed ExpertRequest: {e}", peer_id=peer
                    ) from e
                result = await self._serve(peer, request, reader)
                backend = self.backends.get(request.expert_uid)
                response = pb.ExpertResponse(
                    code=result.code,
                    message=result.message[:1000],
                    payload_bytes=len(result.payload),
                    batch_tokens=result.batch_tokens,
                    updates=backend.updates if backend else 0,
                    kept=result.kept,
                )
                if result.code == pb.EXPERT_ACTIVATIONS_GONE:  # payload read, stream in step: keep serving
                    await write_frames(writer, [response.SerializeToString()])
                    continue
                if result.code != pb.EXPERT_OK:
                    await write_frames(writer, [response.SerializeToString()])
                    self._log_refusal(peer, result)
                    await wait_for_close(reader)  # unread payload frames may follow: this stream is done
                    return
                await write_frames(writer, [response.SerializeToString(), result.payload])
        except ProtocolViolation as e:
            self.rejected += 1
            self.last_rejection = str(e)[:300]
            logger.info("Dropping expert call stream from %s: %s", peer, e)
        except (ConnectionError, asyncio.IncompleteReadError, OSError, TimeoutError) as e:
            logger.debug("Expert call stream from %s broke: %s", peer, e)
        finally:
            writer.close()

    def _log_refusal(self, peer: str, result: CallResult) -> None:
        if result.code in (pb.EXPERT_UNKNOWN, pb.EXPERT_BAD_REQUEST, pb.EXPERT_BAD_PAYLOAD):
            self.rejected += 1
            self.last_rejection = f"{peer}: {pb.ExpertCode.Name(result.code)} {result.message}"[:300]
        logger.info(
            "Refused an expert call from %s: %s %s", peer, pb.ExpertCode.Name(result.code), result.message
        )

    async def _serve(self, peer: str, request: pb.ExpertRequest, reader: asyncio.StreamReader) -> CallResult:
        sizes = list(request.payload_bytes)
        oversized = oversized_payload(request, self.config.max_request_tokens)
        problem = check_header(request, self.backends, self.config.max_request_tokens) or oversized
        if problem is not None:
            if oversized is None:  # read what the caller sends anyway, so that it reliably gets our answer
                for size in sizes:
                    await asyncio.wait_for(skip_frame(reader, size, peer, "refused payload"), DRAIN_TIMEOUT)
            return problem
        payloads: list[bytes | bytearray] = []
        for size in sizes:
            payloads.append(await read_frame(reader, size, peer, "expert payload"))
        return await self._submit(peer, request, payloads)

    async def serve_local(self, request: pb.ExpertRequest, payloads: list[bytes | bytearray]) -> CallResult:
        """A call from this peer's own model: libp2p cannot dial itself, so it skips the stream, nothing else
        (same validation, same batches as remote calls)."""
        problem = check_header(request, self.backends, self.config.max_request_tokens)
        if problem is None and list(request.payload_bytes) != [len(p) for p in payloads]:
            problem = CallResult(pb.EXPERT_BAD_REQUEST, "payload sizes differ from the header")
        return problem or await self._submit(self.swarm.peer_id, request, payloads)

    async def _submit(
        self, peer: str, request: pb.ExpertRequest, payloads: list[bytes | bytearray]
    ) -> CallResult:
        phase, _ = PHASES[request.phase]
        if self._stop.is_set():
            return CallResult(pb.EXPERT_SHUTTING_DOWN, "the expert host is shutting down")
        future: asyncio.Future[CallResult] = asyncio.get_running_loop().create_future()
        call = PendingCall(
            peer, request.num_tokens, payloads, request.lossless, future, time.monotonic(), request.call_id
        )
        if not self._queues[(request.expert_uid, phase)].submit(call):
            self.backends[request.expert_uid].stats[phase].failed("overloaded")
            return CallResult(
                pb.EXPERT_OVERLOADED,
                f"expert {request.expert_uid} has more than {self.config.max_queued_tokens} tokens queued, or "
                f"{self.config.queued_tokens_per_caller} of this caller's; retry later",
            )
        return await future

    # --- views and shutdown ---------------------------------------------------------------------------------

    def status(self) -> dict[str, Any]:
        return {
            "uids": self.uids,
            "hidden_dim": self.config.hidden_dim,
            "module": self.config.module,
            "rejected_calls": self.rejected,
            "kept_activations": self.stash.status(),
            "last_rejection": self.last_rejection,
            "experts": {uid: {**backend.status(), "scaled_gradient_calls": self.gradients[uid].scaled,
                              "queued_tokens": sum(self._queues[(uid, phase)].queued_tokens
                                                   for phase in ("forward", "backward"))}
                        for uid, backend in self.backends.items()},
        }

    def totals(self) -> tuple[int, int]:
        """Calls served (refused ones included) and calls that failed or were refused."""
        stats = [s for backend in self.backends.values() for s in backend.stats.values()]
        return sum(s.calls for s in stats) + self.rejected, sum(s.errors for s in stats) + self.rejected

    async def stop(self) -> None:
        self._stop.set()
        if self._announcer is not None:
            self._announcer.cancel()
        try:
            await self.guard.remove_handler(HANDLER_NAME)
        except Exception as e:  # noqa: BLE001 (p2pd may already be gone at shutdown)
            logger.debug("Could not unregister the expert handler: %s", e)
        for queue in self._queues.values():
            queue.close("the expert host is shutting down")
        await asyncio.to_thread(self._workers.shutdown)  # applies the optimizer steps still pending

