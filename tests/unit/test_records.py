from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import msgpack
import pytest

from peerd.errors import ProtocolViolation
from peerd.swarm.records import Capabilities, PeerRecord, PeerState, json_schema_text, parse_record

PID = "12D3KooWPGVdJA78uHzBaDhQwqcrKkim73xy95Amd9qCuoKhvDVB"
REPO = Path(__file__).resolve().parents[2]


def record(**changes: Any) -> dict[str, Any]:
    base = PeerRecord(
        peer_id=PID,
        software_version="0.1.0",
        protocol_version=1,
        roles=["trainer"],
        state=PeerState.IDLE,
        maddrs=[f"/ip4/127.0.0.1/tcp/4000/p2p/{PID}"],
        capabilities=Capabilities(experts=["ffn.0.1"], throughput=12.5),
        started_at=100.0,
        updated_at=105.0,
    ).to_wire()
    base.update(changes)
    return base


def test_round_trip_through_msgpack() -> None:
    wire = msgpack.unpackb(msgpack.packb(record()))
    parsed = parse_record(PID, wire)
    assert parsed.state is PeerState.IDLE
    assert parsed.capabilities.throughput == 12.5
    assert parsed.uptime == 5.0
    assert parsed.to_wire() == record()


def test_unknown_fields_are_ignored_for_version_skew() -> None:
    wire = record(future_field={"x": 1})
    wire["capabilities"]["gpu"] = "H100"
    assert parse_record(PID, wire).peer_id == PID


@pytest.mark.parametrize(
    "changes",
    [
        {"peer_id": "not-base58!"},
        {"state": "dancing"},
        {"protocol_version": "1"},
        {"protocol_version": 0},
        {"roles": "trainer"},
        {"maddrs": ["/ip4/1.2.3/tcp/1"]},
        {"maddrs": ["/ip4/1.2.3.4/tcp/1"]},
        {"capabilities": {"throughput": math.nan}},
        {"capabilities": {"throughput": -1.0}},
        {"updated_at": math.inf},
        {"started_at": "yesterday"},
        {"updated_at": 50.0},
        {"maddrs": [f"/ip4/127.0.0.1/tcp/4000/p2p/{PID}"] * 100},
    ],
)
def test_malformed_records_are_rejected_naming_the_peer(changes: dict[str, Any]) -> None:
    with pytest.raises(ProtocolViolation) as info:
        parse_record(PID, record(**changes))
    assert info.value.peer_id == PID


@pytest.mark.parametrize("value", [None, 42, "text", [1, 2], b"\x00\x01"])
def test_non_mapping_values_are_rejected(value: object) -> None:
    with pytest.raises(ProtocolViolation):
        parse_record(PID, value)


def test_record_under_someone_elses_subkey_is_rejected() -> None:
    with pytest.raises(ProtocolViolation, match="another peer"):
        parse_record("12D3KooWMaTSuVuheoHUBtyu5rhcR8eQuYEhNzVauVBWThp1dhkY", record())


def test_committed_schema_matches_the_model() -> None:
    committed = (REPO / "protocols" / "peer_record.v1.schema.json").read_text()
    assert committed == json_schema_text(), "run: python scripts/gen_schemas.py"
    schema = json.loads(committed)
    assert schema["$id"] == "peerd.v1.PeerRecord"
    assert all("description" in field for field in schema["properties"].values())
