"""Regenerates the JSON schemas in protocols/ from the pydantic models (a unit test checks they match)."""

from pathlib import Path

from peerd.swarm.records import json_schema_text

PROTOCOLS = Path(__file__).resolve().parents[1] / "protocols"

if __name__ == "__main__":
    (PROTOCOLS / "peer_record.v1.schema.json").write_text(json_schema_text())
    print(f"wrote {PROTOCOLS / 'peer_record.v1.schema.json'}")
