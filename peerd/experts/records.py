"""Expert announcements in the DHT: which peer serves which expert, and the strict reading side.

Every expert host stores one ``peerd.v1.ExpertHost`` record under the key ``<run_name>.experts`` with its own
peer id as subkey (the only subkey a signer may use: ``peerd.swarm.signing``), listing the uids it serves,
every ``experts.announce_period`` seconds with expiry ``experts.record_ttl``; one lookup returns every expert
of the run. A host that dies stops refreshing, so its experts vanish from routing once its record expires.
Readers validate each record strictly, ignore unknown fields (a newer host may add some) and drop (counting
them, logging once a minute per subkey) records that are malformed.

A uid is bound to its host (:func:`bind`). Any member can announce any uid, so a reader keeps routing a uid
to the host it already routes it to while that host's record lives, whoever else claims it later or with a
later expiration; a uid that several hosts claim when this reader first sees it goes to none of them until
only one claims it (the reader cannot tell which is the expert's host; a stolen uid would hand a member the
callers' activations and its own answers). Such contests are logged with both hosts.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from peerd.config import EXPERT_UID_PATTERN
from peerd.errors import ProtocolViolation
from peerd.log import RateLimitedLog
from peerd.swarm.records import MAX_MADDRS, PeerIdStr

__all__ = ["ExpertHostRecord", "ExpertReader", "ExpertRecord", "SeenExpert", "bind", "experts_key",
           "parse_host_record"]

SCHEMA_ID = "peerd.v1.ExpertHost"
PROTOCOL_VERSION = 2  # of protocols/peerd_experts.proto
MAX_HOST_EXPERTS = 1024  # experts.count and experts.uids allow no more

logger = logging.getLogger(__name__)

ExpertUid = Annotated[str, Field(pattern=EXPERT_UID_PATTERN)]


def experts_key(run_name: str) -> str:
    return f"{run_name}.experts"


class ExpertRecord(BaseModel):
    """One served expert as a reader sees it: its host's record, for this uid."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    uid: ExpertUid = Field(description="The expert's uid.")
    peer_id: PeerIdStr = Field(description="libp2p peer id of the host; calls go to this peer.")
    maddrs: list[Annotated[str, Field(max_length=512)]] = Field(
        default_factory=list, max_length=MAX_MADDRS, description="The host's multiaddrs (informative)."
    )
    protocol_version: int = Field(ge=1, description="Version of peerd_experts.proto the host speaks.")
    hidden_dim: int = Field(ge=1, le=65536, description="Input and output width of the expert.")
    module: str = Field(max_length=256, description="Architecture: 'ffn' or 'package.module:Class'.")
    updates: int = Field(ge=0, description="Optimizer steps the expert has applied.")
    started_at: float = Field(ge=0, allow_inf_nan=False, description="DHT time (s) the host started serving.")
    updated_at: float = Field(ge=0, allow_inf_nan=False, description="DHT time (s) of this announcement.")


class ExpertHostRecord(BaseModel):
    """The experts one host serves, refreshed every ``experts.announce_period`` seconds by the host."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True, title=SCHEMA_ID)

    peer_id: PeerIdStr = Field(description="libp2p peer id of the host; equals the DHT subkey.")
    maddrs: list[Annotated[str, Field(max_length=512)]] = Field(
        default_factory=list, max_length=MAX_MADDRS, description="The host's multiaddrs (informative)."
    )
    protocol_version: int = Field(ge=1, description="Version of peerd_experts.proto the host speaks.")
    hidden_dim: int = Field(ge=1, le=65536, description="Input and output width of its experts.")
    module: str = Field(max_length=256, description="Architecture: 'ffn' or 'package.module:Class'.")
    uids: list[ExpertUid] = Field(max_length=MAX_HOST_EXPERTS, description="The uids of the experts it serves.")
    updates: list[Annotated[int, Field(ge=0)]] = Field(
        max_length=MAX_HOST_EXPERTS, description="Optimizer steps each of them has applied, in the order of uids.")
    started_at: float = Field(ge=0, allow_inf_nan=False, description="DHT time (s) the host started serving.")
    updated_at: float = Field(ge=0, allow_inf_nan=False, description="DHT time (s) of this announcement.")

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    def experts(self) -> list[ExpertRecord]:
        common = self.model_dump(exclude={"uids", "updates"})
        return [ExpertRecord(uid=uid, updates=updates, **common) for uid, updates in zip(self.uids, self.updates,
                                                                                         strict=True)]


@dataclass(frozen=True)
class SeenExpert:
    record: ExpertRecord
    expires_at: float


def parse_host_record(subkey: object, value: object) -> ExpertHostRecord:
    """Validates one DHT entry; raises ProtocolViolation naming the subkey for anything malformed."""
    host = str(subkey)[:128]
    try:
        record = ExpertHostRecord.model_validate(value)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or '<root>'}: {err['msg']}" for err in e.errors()
        )
        raise ProtocolViolation(f"malformed expert record of {host}: {problems[:500]}", peer_id=host) from None
    if record.peer_id != subkey:
        raise ProtocolViolation(f"expert record of {record.peer_id} stored under another subkey {host!r}",
                                peer_id=host)
    if len(record.updates) != len(record.uids) or len(set(record.uids)) != len(record.uids):
        raise ProtocolViolation(f"expert record of {host}: {len(record.uids)} uids (some twice?) and "
                                f"{len(record.updates)} update counts", peer_id=host)
    if record.updated_at < record.started_at:
        raise ProtocolViolation(f"expert record of {host}: updated_at precedes started_at", peer_id=host)
    return record


def bind(claims: dict[str, list[SeenExpert]], previous: dict[str, SeenExpert], now: float
         ) -> tuple[dict[str, SeenExpert], dict[str, list[str]]]:
    """Which host each uid routes to, from this read's ``claims`` (uid -> every host's record of it) and the
    ``previous`` routing: the host a uid was bound to keeps it while its record lives (also when this read
    missed it: a DHT answer can be incomplete); a free uid goes to its only claimant. Returns the routing and
    the uids left free because several hosts claim them (uid -> those hosts)."""
    routes: dict[str, SeenExpert] = {}
    contested: dict[str, list[str]] = {}
    for uid in claims.keys() | previous.keys():
        offers = {seen.record.peer_id: seen for seen in claims.get(uid, [])}
        old = previous.get(uid)
        if old is not None and old.record.peer_id in offers:
            routes[uid] = offers[old.record.peer_id]
        elif old is not None and old.expires_at >= now:
            routes[uid] = old
        elif len(offers) == 1:
            (routes[uid],) = offers.values()
        elif offers:
            contested[uid] = sorted(offers)
    return routes, contested


class ExpertReader:
    """Validates what ``SwarmNode.read_entries(experts_key(run))`` returned; logs each bad host once a minute."""

    def __init__(self, on_drop: Callable[[str, ProtocolViolation], None] | None = None) -> None:
        self._log = RateLimitedLog(logger)
        self._on_drop = on_drop  # counts the drop where the swarm's other refused records are counted

    def parse(self, entries: dict[str, tuple[object, float]]) -> dict[str, list[SeenExpert]]:
        """Every valid, unexpired host record's experts: uid -> each host's claim of it."""
        claims: dict[str, list[SeenExpert]] = {}
        for subkey, (value, expiration) in entries.items():
            try:
                host = parse_host_record(subkey, value)
            except ProtocolViolation as e:
                if self._on_drop is not None:
                    self._on_drop("malformed", e)
                else:
                    self._log(subkey, logging.WARNING, "Dropping invalid expert record: %s", e)
                continue
            for record in host.experts():
                claims.setdefault(record.uid, []).append(SeenExpert(record, expiration))
        return claims

    def contested(self, uids: dict[str, list[str]]) -> None:
        for uid, hosts in uids.items():
            self._log(("contested", uid), logging.WARNING, "Expert %s is announced by %d hosts (%s); routing it to "
                      "none until only one announces it", uid, len(hosts), ", ".join(hosts))
