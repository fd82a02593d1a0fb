"""Expert announcements in the DHT: which peer serves which expert, and the strict reading side.

Every expert host stores one ``peerd.v1.ExpertRecord`` per served expert under the key
``<run_name>.experts`` with the expert uid as subkey, every ``experts.announce_period`` seconds with expiry
``experts.record_ttl``; one lookup returns every expert of the run. A host that dies stops refreshing, so its
experts vanish from routing once their records expire. Readers validate each record strictly, ignore
unknown fields (a newer host may add some) and drop (counting them, logging once a minute per uid) records
that are malformed or whose ``uid`` does not match their subkey. Each record is signed by its host (the
swarm node drops one whose ``peer_id`` is not its signer's before it gets here).
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

__all__ = ["ExpertReader", "ExpertRecord", "SeenExpert", "experts_key", "parse_expert_record"]

SCHEMA_ID = "peerd.v1.ExpertRecord"
PROTOCOL_VERSION = 2  # of protocols/peerd_experts.proto

logger = logging.getLogger(__name__)

ExpertUid = Annotated[str, Field(pattern=EXPERT_UID_PATTERN)]


def experts_key(run_name: str) -> str:
    return f"{run_name}.experts"


class ExpertRecord(BaseModel):
    """One served expert, refreshed every ``experts.announce_period`` seconds by its host."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True, title=SCHEMA_ID)

    uid: ExpertUid = Field(description="The expert's uid; equals the DHT subkey.")
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

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


@dataclass(frozen=True)
class SeenExpert:
    record: ExpertRecord
    expires_at: float


def parse_expert_record(subkey: object, value: object) -> ExpertRecord:
    """Validates one DHT entry; raises ProtocolViolation naming the subkey for anything malformed."""
    uid = str(subkey)[:128]
    try:
        record = ExpertRecord.model_validate(value)
    except ValidationError as e:
        problems = "; ".join(
            f"{'.'.join(map(str, err['loc'])) or '<root>'}: {err['msg']}" for err in e.errors()
        )
        raise ProtocolViolation(f"malformed expert record {uid!r}: {problems[:500]}") from None
    if record.uid != subkey:
        raise ProtocolViolation(
            f"expert record for {record.uid!r} stored under another subkey {uid!r}", peer_id=record.peer_id
        )
    if record.updated_at < record.started_at:
        raise ProtocolViolation(
            f"expert record {uid!r}: updated_at precedes started_at", peer_id=record.peer_id
        )
    return record


class ExpertReader:
    """Validates what ``SwarmNode.read_entries(experts_key(run))`` returned; logs each bad uid once a minute."""

    def __init__(self, on_drop: Callable[[str, ProtocolViolation], None] | None = None) -> None:
        self._log = RateLimitedLog(logger)
        self._on_drop = on_drop  # counts the drop where the swarm's other refused records are counted

    def parse(self, entries: dict[str, tuple[object, float]]) -> dict[str, SeenExpert]:
        """Valid, unexpired records keyed by uid."""
        seen = {}
        for subkey, (value, expiration) in entries.items():
            try:
                seen[subkey] = SeenExpert(parse_expert_record(subkey, value), expiration)
            except ProtocolViolation as e:
                if self._on_drop is not None:
                    self._on_drop("malformed", e)
                    continue
                self._log(subkey, logging.WARNING, "Dropping invalid expert record: %s", e)
        return seen
