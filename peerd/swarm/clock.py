"""Wall clocks that disagree: what peerd tolerates, and the one line it prints beyond that.

Every time a peer writes into the DHT (a record's expiration, a matchmaking registration) is read on the
clock of that peer, and internet peers' clocks differ by seconds. hivemind's DHT admits a peer whose clock
is within ``MAX_CLOCK_OFFSET`` (3 s) of the initial peers it pings at bootstrap; peerd is built to work at
any offset it admits:

- no peer compares a time another peer wrote against its own clock to make a decision another peer must
  share (``peerd.averaging.matchmaking`` orders registrations by their times but cuts a round by what the
  leader has received, on the leader's clock only);
- expirations written by a peer whose clock is behind look up to ``MAX_CLOCK_OFFSET`` shorter to the
  others, so a TTL must outlast its refresh period by that much (:func:`ttl_margin_problems`);
- expirations written by a peer whose clock is ahead look up to ``MAX_CLOCK_OFFSET`` longer, so a reader
  caps how far ahead a value may expire at its key's TTL plus that much (:func:`record_lifetimes`), and no
  further: a record stored to expire in 30 years would outlive its author.

Beyond the tolerance the DHT refuses the join; :func:`clock_skew_error` turns hivemind's refusal into a
:class:`~peerd.errors.ClockSkewError` that names the measured offset and the fix.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from hivemind.utils.timed_storage import MAX_DHT_TIME_DISCREPANCY_SECONDS

from peerd.config import AveragingConfig, ExpertsConfig, PeerdConfig, SwarmConfig, TrainingConfig
from peerd.errors import ClockSkewError
from peerd.swarm.signing import RecordLifetimes, key_id

__all__ = ["MAX_CLOCK_OFFSET", "clock_skew_error", "record_lifetimes", "round_lifetime", "ttl_margin_problems"]

MAX_CLOCK_OFFSET: float = float(MAX_DHT_TIME_DISCREPANCY_SECONDS)

FIX = ("sync this machine's clock (and the other peer's) with NTP, e.g. `timedatectl set-ntp true` "
       "(systemd-timesyncd) or install chrony")
# hivemind.dht.protocol.DHTProtocol.call_ping: "local time must be within 3 seconds  of others(local: <t>, peer: <t>)"
_REFUSAL = re.compile(r"local time must be within .*?local:\s*(?P<local>[-\d.e+]+),\s*peer:\s*(?P<peer>[-\d.e+]+)")


def clock_skew_error(error: BaseException, peers: Iterable[str] = ()) -> ClockSkewError | None:
    """The ClockSkewError for hivemind's refusal of a peer whose clock differs too much, else None.

    ``offset`` is this machine's clock minus the pinged peer's (from the two times hivemind's refusal
    quotes; the ping's round trip on top is milliseconds).
    """
    match = _REFUSAL.search(str(error))
    if match is None:
        return None
    try:
        offset = float(match["local"]) - float(match["peer"])
    except ValueError:
        return None
    where = "ahead of" if offset > 0 else "behind"
    tried = ", ".join(peers) or "the initial peers"
    return ClockSkewError(
        f"clock offset {offset:+.1f} s: this machine's clock is {abs(offset):.1f} s {where} that of the peer it "
        f"joined through ({tried}), and the DHT admits peers within {MAX_CLOCK_OFFSET:g} s of each other; {FIX}",
        offset=offset, peers=list(peers),
    )


def ttl_margin_problems(config: PeerdConfig) -> list[str]:
    """Each TTL of a record this peer refreshes that outlasts its refresh period by less than
    ``MAX_CLOCK_OFFSET``, as a sentence naming the option to raise: a reader whose clock is that far ahead of
    ours sees the record expire between two refreshes, and this peer drops out of its view now and then."""
    ttls = [("swarm.record_ttl", config.swarm.record_ttl, "swarm.record_refresh_period",
             config.swarm.record_refresh_period)]
    if config.training.enabled:
        ttls.append(("training.progress_ttl", config.training.progress_ttl, "training.progress_period",
                     config.training.progress_period))
    if config.experts is not None:
        ttls.append(("experts.record_ttl", config.experts.record_ttl, "experts.announce_period",
                     config.experts.announce_period))
    return [
        f"{ttl_name} ({ttl:g}) outlasts {period_name} ({period:g}) by less than {MAX_CLOCK_OFFSET:g} s, the clock "
        f"offset the DHT admits between peers: to a peer whose clock is ahead, this one vanishes between "
        f"refreshes; raise {ttl_name} to at least {period + MAX_CLOCK_OFFSET + 1:g}"
        for ttl_name, ttl, period_name, period in ttls
        if ttl - period < MAX_CLOCK_OFFSET
    ]


def round_lifetime(averaging: AveragingConfig, window: float) -> float:
    """Seconds a matchmaking entry (a registration, a decision) lives: as long as a round can wait for its
    group and run, judged by readers whose clocks may be ``MAX_CLOCK_OFFSET`` ahead of its writer's."""
    return max(window, averaging.max_matchmaking_window) + averaging.round_timeout + 10.0 + MAX_CLOCK_OFFSET


def record_lifetimes(run_name: str, swarm: SwarmConfig, averaging: AveragingConfig | None = None,
                     training: TrainingConfig | None = None, experts: ExpertsConfig | None = None
                     ) -> RecordLifetimes:
    """How far ahead a value under each of this run's keys may expire: the TTL peers store it with (from
    this peer's config, defaults for the sections it lacks: the swarm must agree on them), plus the clock
    tolerance. Keys not named here are matchmaking's round keys."""
    averaging, training = averaging or AveragingConfig(), training or TrainingConfig()
    window = max(averaging.matchmaking_window, training.diloco.matchmaking_window)
    return RecordLifetimes(
        default=round_lifetime(averaging, window),
        by_key={key_id(f"{run_name}.peers"): swarm.record_ttl,
                key_id(f"{run_name}.progress"): training.progress_ttl,
                key_id(f"{run_name}.experts"): (experts or ExpertsConfig()).record_ttl},
        tolerance=MAX_CLOCK_OFFSET,
    )
