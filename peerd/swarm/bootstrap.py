"""Starting this peer's DHT: p2pd and hivemind's DHT node, in hivemind's child process (``process.py``) or on
the daemon's event loop (``inprocess.py``), bootstrapped from the initial peers with retries and backoff.

:class:`~peerd.swarm.node.SwarmNode` starts through :func:`start_with_retries` once it holds this peer's identity.
"""

from __future__ import annotations

import asyncio
import logging
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hivemind.dht.protocol import ValidationError as DHTValidationError
from hivemind.p2p import P2PDaemonError

from peerd.config import SwarmConfig
from peerd.errors import BootstrapError, DaemonError
from peerd.swarm.clock import clock_skew_error
from peerd.swarm.inprocess import InProcessDHT
from peerd.swarm.reach import p2pd_options
from peerd.swarm.signing import RecordLifetimes
from peerd.swarm.stragglers import guard_node
from peerd.swarm.validator import SignedRecordValidator
from peerd.wire.membership import Membership

__all__ = ["NO_DHT_CACHE", "short_error", "start_dht", "start_with_retries"]

if TYPE_CHECKING:
    from peerd.swarm.process import IsolatedDHT

logger = logging.getLogger(__name__)

# peerd reads every key for its latest value (records, progress, round keys), which a local cache never
# answers, so hivemind's caching only costs: after each read it stores the whole dictionary on the nearest node
# that lacked it, and re-reads cached keys shortly before they expire. Off, a swarm sends fewer bytes, spends
# less CPU and reaches a full view sooner (docs/scaling.md; the measurements are on the benchmarks page).
NO_DHT_CACHE = {"cache_locally": False, "cache_nearest": 0, "cache_refresh_before_expiry": 0, "cache_on_store": False}


async def start_with_retries(config: SwarmConfig, identity_path: Path, fresh_identity: bool, membership: Membership,
                             lifetimes: RecordLifetimes, metrics_port: int,
                             in_process: bool) -> IsolatedDHT | InProcessDHT:
    """Starts p2pd and the DHT (:func:`start_dht`), retrying with backoff while no initial peer answers;
    raises BootstrapError (or ClockSkewError) when an initial peer refuses this one or none answered."""
    delay = config.bootstrap_retry_delay
    last_error: Exception | None = None
    for attempt in range(1, config.bootstrap_attempts + 1):
        try:
            return await start_dht(config, identity_path, fresh_identity, membership, lifetimes, metrics_port,
                                   in_process)
        except DHTValidationError as e:  # an initial peer answered but refused us: retrying cannot help
            raise clock_skew_error(e, config.initial_peers) or BootstrapError(
                f"an initial peer refused this one: {short_error(e)}", addresses=list(config.initial_peers)) from e
        # RuntimeError: hivemind's "DHTNode bootstrap failed: none of the initial_peers responded to a ping",
        # which a busy initial peer (many daemons starting at once on a small machine) gives as readily as a
        # missing one
        except (P2PDaemonError, TimeoutError, OSError, RuntimeError) as e:
            last_error = e
            if not config.initial_peers:
                raise DaemonError(f"could not start p2pd/DHT: {e}") from e
            logger.warning(
                "Bootstrap attempt %d/%d failed: %s", attempt, config.bootstrap_attempts, short_error(e)
            )
            if attempt < config.bootstrap_attempts:
                await asyncio.sleep(delay)  # backoff between real connection attempts, not a sync wait
                delay *= 2
    tried = ", ".join(config.initial_peers)
    raise BootstrapError(
        f"could not reach any initial peer after {config.bootstrap_attempts} attempts (tried: {tried}). "
        f"Check that the peer is running, that the address (including /p2p/<peer id>) matches its ready "
        f"line or `peerd status`, and that its port is reachable from here. Last error: {short_error(last_error)}",
        addresses=list(config.initial_peers),
    )


async def start_dht(config: SwarmConfig, identity_path: Path, fresh_identity: bool, membership: Membership,
                    lifetimes: RecordLifetimes, metrics_port: int, in_process: bool) -> IsolatedDHT | InProcessDHT:
    """One attempt: p2pd and hivemind's DHT node, in hivemind's child process or on this event loop."""
    relay_kwargs, p2pd_flags = p2pd_options(config, metrics_port)
    kwargs: dict[str, Any] = {
        **relay_kwargs,
        "host_maddrs": list(config.host_maddrs),
        "startup_timeout": config.startup_timeout,
        "wait_timeout": config.request_timeout,
        "nat_port_map": config.nat_port_map,
        "identity_path": str(identity_path),
        # a key generated a moment ago is nobody else's: skip hivemind's probe of the swarm for it
        "check_if_identity_free": not fresh_identity,
        **NO_DHT_CACHE,
    }
    if config.announce_maddrs:
        kwargs["announce_maddrs"] = list(config.announce_maddrs)
    validators = [SignedRecordValidator(membership, lifetimes)]
    if in_process:
        node = await InProcessDHT.create(list(config.initial_peers), validators, p2pd_flags, **kwargs)
        await node.run_coroutine(partial(guard_node, config.dht_wait_ratio, config.dht_wait_floor))
        return node
    # here, not at the top: hivemind's DHT class imports torch, which a light peer never loads
    from peerd.swarm.process import IsolatedDHT

    dht = IsolatedDHT(initial_peers=list(config.initial_peers), start=False, p2pd_flags=p2pd_flags,
                      record_validators=validators, **kwargs)
    dht.run_in_background(await_ready=False)
    try:  # blocking the loop is fine here: nothing else runs on it before the swarm is up
        dht.wait_until_ready(timeout=config.startup_timeout)
        dht.run_coroutine(partial(guard_node, config.dht_wait_ratio, config.dht_wait_floor))
    except BaseException:
        dht.shutdown()
        raise
    return dht


def short_error(error: BaseException | None) -> str:
    """The last line of an error's text, which is what hivemind's multi-line errors say."""
    text = str(error) if error else "unknown"
    return text.strip().splitlines()[-1][:300] if text.strip() else type(error).__name__
