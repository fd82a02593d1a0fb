"""Training progress in the DHT: each trainer publishes its step and samples; all read the swarm's view.

Records live under ``<run_name>.progress`` (subkey = peer id, signed by that peer: ``peerd.swarm.signing``),
expire after ``progress_ttl``, and carry the model fingerprint, so a peer with another model or config in the same run is seen, named and refused
rather than failing later with a shape error inside an all-reduce. A record also names the state its author
agreed on with its group (:class:`StateClaim`), which others vouch for by naming the same one.

A record is its author's claim: :mod:`peerd.training.evidence` decides what of it this peer believes.
"""

from __future__ import annotations

import asyncio
import logging
import math
import time
from dataclasses import dataclass, field

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from peerd.config import TrainingConfig
from peerd.errors import PeerdError, ProtocolViolation
from peerd.swarm.node import SwarmNode, now
from peerd.swarm.records import PeerIdStr

logger = logging.getLogger(__name__)

# The periodic progress publication and read pause this many times the DHT's median request time, if longer
# than training.progress_period (and shorter than a quarter of training.progress_ttl).
PROGRESS_PER_LATENCY = 2.0


async def wait_unless_stopped(stop: asyncio.Event, seconds: float) -> None:
    """Waits ``seconds``, or less if ``stop`` is set meanwhile: a polling pace that never delays shutdown."""
    try:
        await asyncio.wait_for(stop.wait(), seconds)
    except TimeoutError:
        pass


def progress_pause(config: TrainingConfig, dht_latency: float) -> float:
    """Seconds between periodic progress publications and reads, given the DHT's median request time.

    Never ask the DHT much more often than it answers: on a saturated one the reads and stores of every trainer
    only queue behind each other's. But republish well within the record's TTL.
    """
    return max(config.progress_period, min(PROGRESS_PER_LATENCY * dht_latency, config.progress_ttl / 4))


MAX_COUNT = 2**62  # steps and samples: far above any run, and what msgpack and every peer's int64 hold


class StateClaim(BaseModel):
    """The state a trainer holds a copy of and serves to joiners: the one it last agreed on with a group
    (:mod:`peerd.training.transfer.digest`)."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    step: int = Field(ge=0, le=MAX_COUNT, description="The step the state is at.")
    digest: str = Field(pattern=r"^[0-9a-f]{64}$", description="Its root digest (sha256, hex).")


class ProgressRecord(BaseModel):
    """``peerd.v1.Progress``: one trainer's position in training."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    peer_id: PeerIdStr
    fingerprint: str = Field(pattern=r"^[0-9a-f]{8,64}$", description="Hash of task, options, seed, model.")
    step: int = Field(ge=0, le=MAX_COUNT, description="Optimizer steps this peer has applied (the global step it is at).")
    samples: int = Field(ge=0, le=MAX_COUNT, description="Samples accumulated towards the next step.")
    samples_per_second: float = Field(ge=0, allow_inf_nan=False, description="Recent local throughput.")
    time: float = Field(ge=0, allow_inf_nan=False, description="DHT time of publication.")
    # Optional, so records of peers that predate it stay valid; lockstep mode orders group members by it.
    shard: int | None = Field(default=None, ge=0, description="The data shard this peer reads.")
    state: StateClaim | None = Field(default=None, description="The state this peer serves to joiners.")

    @model_validator(mode="after")
    def _check_state(self) -> ProgressRecord:
        if self.state is not None and self.state.step > self.step:
            raise ValueError(f"state.step ({self.state.step}) is ahead of step ({self.step})")
        return self


@dataclass
class SwarmProgress:
    """The swarm as one trainer sees it; only peers with our fingerprint count towards the batch."""

    peers: dict[str, ProgressRecord] = field(default_factory=dict)
    foreign: dict[str, str] = field(default_factory=dict)  # peer id -> its (different) fingerprint
    # peer id -> its last record seen at the step before its current one (what it had when it moved on)
    previous: dict[str, ProgressRecord] = field(default_factory=dict)

    def samples_at(self, step: int) -> int:
        return sum(p.samples for p in self.peers.values() if p.step == step)

    def peers_at(self, step: int) -> int:
        return sum(1 for p in self.peers.values() if p.step == step)

    @property
    def samples_per_second(self) -> float:
        return sum(p.samples_per_second for p in self.peers.values())


class ProgressTracker:
    def __init__(
        self, swarm: SwarmNode, run_name: str, fingerprint: str, ttl: float, shard: int | None = None
    ) -> None:
        self.swarm = swarm
        self.key = f"{run_name}.progress"
        self.fingerprint = fingerprint
        self.ttl = ttl
        self.shard = shard
        self.view = SwarmProgress()
        self._warned: dict[str, float] = {}
        self.claim: StateClaim | None = None  # the state this peer serves, published with its progress
        # (step, samples, claim) of the last stored record
        self._published: tuple[int, int, StateClaim | None] | None = None
        self._published_at = -math.inf  # time.monotonic() of that store

    async def publish(self, step: int, samples: int, samples_per_second: float, if_changed: bool = False) -> None:
        """Stores this peer's record; ``if_changed``: only if step, samples or claim changed since the last one,
        or it is a quarter of the TTL old (a trainer waiting in a round has nothing new to say)."""
        fresh = time.monotonic() - self._published_at < self.ttl / 4
        claim = self.claim if self.claim is not None and self.claim.step <= step else None
        if if_changed and fresh and self._published == (step, samples, claim):
            return
        record = ProgressRecord(
            peer_id=self.swarm.peer_id, fingerprint=self.fingerprint, step=step, samples=samples,
            samples_per_second=round(max(0.0, samples_per_second), 3), time=now(), shard=self.shard, state=claim,
        )
        try:
            await self.swarm.store(self.key, self.swarm.peer_id, record.model_dump(exclude_none=True),
                                   record.time + self.ttl)
        except PeerdError as e:
            logger.warning("Could not publish training progress: %s", e)
            return
        self._published, self._published_at = (step, samples, claim), time.monotonic()

    async def refresh(self) -> SwarmProgress:
        try:
            entries = await self.swarm.read_subkeys(self.key)
        except PeerdError as e:
            logger.debug("Progress read failed: %s", e)
            return self.view
        view = SwarmProgress()
        for subkey, value in entries.items():
            try:
                record = ProgressRecord.model_validate(value)
            except ValidationError as e:
                self.swarm.drop("malformed", ProtocolViolation(
                    f"malformed progress record from {subkey[:140]!r}: {e.errors()[0]['msg']}", peer_id=subkey))
                continue
            if record.peer_id != subkey:
                self.swarm.drop("wrong_signer", ProtocolViolation(
                    f"progress record for {record.peer_id} stored under {subkey[:140]!r}", peer_id=subkey))
            elif record.fingerprint != self.fingerprint:
                view.foreign[subkey] = record.fingerprint
                self._warn(
                    subkey,
                    f"peer {subkey} trains a different model/config (fingerprint {record.fingerprint}, ours "
                    f"{self.fingerprint}); refusing to average with it. Give both peers the same "
                    "training.task settings, or a different run_name",
                    level=logging.ERROR,
                )
            else:
                view.peers[subkey] = record
                before = self.view.peers.get(subkey)
                if before is not None and before.step < record.step:
                    view.previous[subkey] = before
                elif subkey in self.view.previous and self.view.previous[subkey].step < record.step:
                    view.previous[subkey] = self.view.previous[subkey]
        self.view = view
        return view

    def _warn(self, peer: str, message: str, level: int = logging.WARNING) -> None:
        last = self._warned.get(peer, -1e9)
        if time.monotonic() - last > 60:
            self._warned[peer] = time.monotonic()
            logger.log(level, "%s", message)
