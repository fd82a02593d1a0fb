"""Plain-text rendering of status data for people (the JSON form is for scripts)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def format_table(headers: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
    cells = [[str(h) for h in headers]] + [[str(c) for c in row] for row in rows]
    widths = [max(len(row[i]) for row in cells) for i in range(len(headers))]
    lines = ["  ".join(cell.ljust(width) for cell, width in zip(row, widths)).rstrip() for row in cells]
    lines.insert(1, "  ".join("-" * width for width in widths))
    return "\n".join(lines)


def _short_id(peer_id: str) -> str:
    return peer_id if len(peer_id) <= 16 else f"{peer_id[:6]}...{peer_id[-6:]}"


def format_peers(peers: Sequence[dict[str, Any]]) -> str:
    if not peers:
        return "(no other peers seen in the DHT)"
    rows = []
    for peer in peers:
        caps = peer.get("capabilities") or {}
        throughput = caps.get("throughput")
        rows.append([
            _short_id(peer.get("peer_id", "?")),
            peer.get("state", "?"),
            ",".join(peer.get("roles", [])),
            peer.get("software_version", "?"),
            "-" if throughput is None else f"{throughput:.1f}",
            len(caps.get("experts", [])),
            f"{peer.get('age', 0):.1f}s",
            (peer.get("maddrs") or ["-"])[0],
        ])
    return format_table(["peer", "state", "roles", "version", "samples/s", "experts", "age", "address"], rows)


def format_status(data: dict[str, Any]) -> str:
    lines = [
        f"peer id:   {data.get('peer_id')}",
        f"run:       {data.get('run_name')}",
        f"state:     {data.get('state')}",
        f"uptime:    {data.get('uptime', 0):.1f}s",
        "addresses: " + ("\n           ".join(data.get("maddrs") or ["-"])),
    ]
    if data.get("dht_error"):
        lines.append(f"warning:   {data['dht_error']}")
    lines += ["", f"peers seen ({len(data.get('peers', []))}):", format_peers(data.get("peers", []))]
    return "\n".join(lines)
