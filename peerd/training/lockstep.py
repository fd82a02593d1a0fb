"""Lockstep mode (``training.samples_per_step``): every peer contributes a fixed share to every global step.

By default a peer contributes whatever it accumulated when the swarm reached ``target_batch_size``, so
which samples make up a step depends on the peers' relative speed, and two runs of one config differ. In
lockstep mode each peer computes exactly ``samples_per_step`` samples (whole micro-batches from its seeded
shard), then stops and waits until every trainer at its step has its share too: the global batch is the
same in every run. Two more things keep runs identical:

- the wait also covers peers still finishing the previous step, whose records show the old step for a
  moment; a peer that looked at a stale view would otherwise start the round alone;
- group members are ordered by data shard rather than by registration time, so each peer reduces the
  same span of the gradient in every round and in every run (which span a peer reduces decides which
  elements it sends exactly and where the 8-bit codec's error feedback is carried).

The wait is bounded by ``training.lockstep_timeout``; a dead peer also leaves the view when its progress
record expires, so no peer can stall the swarm for longer. In diloco with overlap the peer does not stop: the
wait belongs to the phase's round, which runs in the background while the next phase computes (still exactly
H inner steps each), so a phase does not end with the whole swarm idle until its slowest peer is done.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable, Iterable, Mapping

from peerd.config import TrainingConfig
from peerd.errors import ConfigError
from peerd.training.progress import ProgressRecord, ProgressTracker, SwarmProgress, wait_unless_stopped

OPTION = "training.samples_per_step"
# Seconds between progress reads while a lockstep peer waits for the others' shares (the matchmaker polls
# the DHT at the same pace).
POLL = 0.1

logger = logging.getLogger(__name__)


def share(config: TrainingConfig, batch_size: int) -> int | None:
    """This peer's exact samples per step in lockstep (diloco's ``phase_end: lockstep``: inner_steps times
    accumulate micro-batches a phase), checked to be whole micro-batches; None outside lockstep."""
    samples = config.samples_per_step
    if config.mode == "diloco" and config.diloco.phase_end == "lockstep":
        samples = config.diloco.inner_steps * config.diloco.accumulate * batch_size
    if samples is not None:
        micro_batches_per_step(samples, batch_size)
    return samples


async def wait_for_shares(progress: ProgressTracker, me: str, step: int, samples_per_step: int, timeout: float,
                          stop: asyncio.Event, count_next_step: bool,
                          counted: Callable[[SwarmProgress], SwarmProgress] = lambda view: view) -> int:
    """Waits (at most ``timeout``) until every trainer at ``step``, or finishing the previous one, has its
    share; returns how many trainers at this step have theirs, this one included (the expected group size).
    ``count_next_step`` (diloco): peers one phase ahead have just ended this one and join its round too.
    ``counted``: the view without the members this peer excludes (``Evidence.counted``), never waited for."""
    deadline = time.monotonic() + timeout
    while True:
        view = counted(await progress.refresh())
        missing = waiting_for(view, me, step, samples_per_step)
        if not missing or stop.is_set():
            break
        if time.monotonic() > deadline:
            logger.warning("Step %d: %s did not complete %d samples within training.lockstep_timeout (%.0fs); "
                           "averaging without them", step, ", ".join(missing), samples_per_step, timeout)
            break
        await wait_unless_stopped(stop, POLL)
    ready = ready_at(view, me, step, samples_per_step)
    if count_next_step:
        ready += sum(1 for peer, p in view.peers.items() if peer != me and p.step == step + 1)
    return ready


def micro_batches_per_step(samples_per_step: int, batch_size: int) -> int:
    """Micro-batches that make up one peer's share; refuses a share that is not made of whole ones."""
    if samples_per_step % batch_size:
        lower = samples_per_step // batch_size * batch_size
        options = " or ".join(str(n) for n in (lower, lower + batch_size) if n > 0)
        raise ConfigError(
            f"{OPTION} ({samples_per_step}) must be a multiple of the task's micro-batch size ({batch_size}, "
            f"training.task.options.batch_size for the built-in tasks): set {OPTION} to {options}",
            field=OPTION,
        )
    return samples_per_step // batch_size


def waiting_for(view: SwarmProgress, me: str, step: int, samples_per_step: int) -> list[str]:
    """Peers a lockstep peer at ``step`` still waits for: those at ``step`` short of their share, and those
    still at ``step - 1`` (finishing its round, or shown there by a record not yet refreshed). Peers further
    behind will download the state instead of stepping up to us; peers ahead are handled by the state sync."""
    return sorted(
        peer
        for peer, record in view.peers.items()
        if peer != me
        and (record.step == step - 1 or (record.step == step and record.samples < samples_per_step))
    )


def ready_at(view: SwarmProgress, me: str, step: int, samples_per_step: int) -> int:
    """Trainers at ``step`` with their whole share, this one included."""
    others = sum(
        1 for peer, record in view.peers.items()
        if peer != me and record.step == step and record.samples >= samples_per_step
    )
    return others + 1


def canonical_order(members: Iterable[str], records: Mapping[str, ProgressRecord]) -> tuple[str, ...]:
    """Members sorted by data shard (peer id breaks ties; members without a known shard go last), so the
    rank, and thereby the span, of each peer is the same in every round of every run of a config.
    Every member computes this from the same member list and, barring a record it could not read, the
    same shards; a member missing from ``records`` is sorted by its peer id alone."""
    def key(peer: str) -> tuple[int, int, str]:
        record = records.get(peer)
        shard = record.shard if record is not None else None
        return (0, shard, peer) if shard is not None else (1, 0, peer)

    return tuple(sorted(members, key=key))
