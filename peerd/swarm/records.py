"""The peer record every peer publishes in the DHT, and its strict validation on the reading side.

Records are stored as plain mappings (hivemind serializes DHT values with msgpack) under the key
``<run_name>.peers`` with the peer id as subkey, so one lookup returns the whole swarm. The schema is
``peerd.v1.PeerRecord``; ``protocols/peer_record.v1.schema.json`` is generated from the model below
(``python scripts/gen_schemas.py``) and a test keeps the two identical.

Readers never trust a record: fields are strictly typed, unknown fields are ignored (a newer peer may add
some), and a record that fails validation raises ProtocolViolation, which the swarm node logs (at most once a
minute per peer) before dropping the record.
"""

from __future__ import annotations

import json
from enum import Enum
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from peerd.config.addresses import parse_peer_maddr
from peerd.errors import AddressError, ProtocolViolation

SCHEMA_ID = "peerd.v1.PeerRecord"
PROTOCOL_VERSION = 1
MAX_MADDRS = 32
MAX_EXPERTS = 4096

PeerIdStr = Annotated[str, Field(pattern=r"^[1-9A-HJ-NP-Za-km-z]{32,128}$")]


class PeerState(str, Enum):
    """Lifecycle state of a peer, as advertised to the swarm."""

    STARTING = "starting"
    IDLE = "idle"
    TRAINING = "training"
    AVERAGING = "averaging"
    LEAVING = "leaving"


class Capabilities(BaseModel):
    """What a peer can do for others."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True)

    experts: list[Annotated[str, Field(max_length=256)]] = Field(
        default_factory=list, max_length=MAX_EXPERTS, description="UIDs of the experts this peer serves."
    )
    throughput: float | None = Field(
        default=None, ge=0, allow_inf_nan=False, description="Measured samples per second; null until known."
    )


class PeerRecord(BaseModel):
    """A peer's self-description, refreshed every ``swarm.record_refresh_period`` seconds."""

    model_config = ConfigDict(extra="ignore", strict=True, frozen=True, title=SCHEMA_ID)

    peer_id: PeerIdStr = Field(description="libp2p peer id (base58) of the publishing peer.")
    software_version: str = Field(max_length=64, description="peerd version the peer runs.")
    protocol_version: int = Field(ge=1, description="Version of the peerd wire protocols the peer speaks.")
    roles: list[Annotated[str, Field(pattern=r"^[a-z_]{1,32}$")]] = Field(
        max_length=16, description="Roles: trainer, expert_host, bootstrap, observer."
    )
    # strict=False only here: msgpack delivers the enum as its string value.
    state: PeerState = Field(strict=False, description="Lifecycle state: starting, idle, training, averaging or leaving.")
    maddrs: list[str] = Field(
        max_length=MAX_MADDRS, description="Multiaddrs (with /p2p/<peer_id>) others can dial to reach the peer."
    )
    capabilities: Capabilities = Field(default_factory=Capabilities, description="Experts, throughput.")
    started_at: float = Field(ge=0, allow_inf_nan=False, description="DHT time (s) the peer started.")
    updated_at: float = Field(ge=0, allow_inf_nan=False, description="DHT time (s) of this publication.")
    peers_seen: int | None = Field(
        default=None, ge=0, description="Records the publisher saw at its last read of the swarm, its own included "
        "(readers compare it with their own view to notice a partial one); null: not read yet.")

    @field_validator("maddrs")
    @classmethod
    def _valid_maddrs(cls, value: list[str]) -> list[str]:
        for item in value:
            try:
                parse_peer_maddr(item, field="maddrs")
            except AddressError as e:
                raise ValueError(str(e)) from None
        return value

    def to_wire(self) -> dict[str, Any]:
        return self.model_dump(mode="json")

    @property
    def uptime(self) -> float:
        return max(0.0, self.updated_at - self.started_at)


def parse_record(subkey: object, value: object) -> PeerRecord:
    """Validates one DHT entry; raises ProtocolViolation naming the subkey for anything malformed or spoofed."""
    peer = str(subkey)[:128]
    try:
        record = PeerRecord.model_validate(value)
    except ValidationError as e:
        problems = "; ".join(f"{'.'.join(map(str, err['loc'])) or '<root>'}: {err['msg']}" for err in e.errors())
        raise ProtocolViolation(f"malformed peer record from {peer}: {problems[:500]}", peer_id=peer) from None
    if record.peer_id != subkey:
        raise ProtocolViolation(f"record for {record.peer_id} stored under another peer's subkey {peer}",
                                peer_id=peer)
    if record.updated_at < record.started_at:
        raise ProtocolViolation(f"record of {peer}: updated_at precedes started_at", peer_id=peer)
    return record


def json_schema() -> dict[str, Any]:
    schema = PeerRecord.model_json_schema()
    schema["$id"] = SCHEMA_ID
    schema["description"] = (
        f"{PeerRecord.__doc__} Stored under DHT key '<run_name>.peers', subkey = peer_id. "
        f"Protocol version {PROTOCOL_VERSION}. Unknown fields are ignored by readers."
    )
    return schema


def json_schema_text() -> str:
    return json.dumps(json_schema(), indent=2, sort_keys=True) + "\n"
