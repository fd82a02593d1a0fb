"""Plain-text rendering of status data for people (the JSON form is for scripts)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from peerd.control.terminal import format_progress


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
            _via(peer.get("connection")),
            (peer.get("maddrs") or ["-"])[0],
        ])
    return format_table(["peer", "state", "roles", "version", "samples/s", "experts", "age", "via", "address"], rows)


def _via(connection: Any) -> str:
    text = str(connection or "-")
    return f"relay {_short_id(text.removeprefix('relay '))}" if text.startswith("relay ") else text


def format_reachability(reach: dict[str, Any]) -> list[str]:
    """How this peer is reached, and what its relay service carries for others."""
    state = reach.get("state")
    configured = f" (swarm.relay.reachability: {reach.get('configured')})"
    if state == "relayed":
        how = "through relay " + ", ".join(_short_id(r) for r in reach.get("relays", []))
    elif state == "unreachable":
        how = "NOT reachable: behind NAT and no relay holds a slot for this peer yet"
    else:
        how = f"{state}, at its own addresses"
    conns = reach.get("connections") or {}
    lines = [(f"reachable: {how}{configured}; connections: {conns.get('direct', 0)} direct, "
              f"{conns.get('relayed', 0)} relayed")]
    service = reach.get("relay_service") or {}
    if not service.get("enabled"):
        lines.append("relaying:  off (swarm.relay.serve)")
    elif not service.get("active"):
        lines.append("relaying:  on, idle until this peer is known to be reachable")
    else:
        lines.append(f"relaying:  {service.get('reservations_open', 0)} slots held, {service.get('circuits_open', 0)} "
                     f"circuits open ({service.get('circuits_total', 0)} so far), "
                     f"{(service.get('bytes_relayed') or 0) / 2**20:.1f} MiB relayed")
    return lines


def format_status(data: dict[str, Any]) -> str:
    lines = [
        f"peer id:   {data.get('peer_id')}",
        f"run:       {data.get('run_name')}",
        f"state:     {data.get('state')}",
        f"uptime:    {data.get('uptime', 0):.1f}s",
        "addresses: " + ("\n           ".join(data.get("maddrs") or ["-"])),
    ]
    membership = data.get("membership") or {}
    if membership:
        refused = membership.get("streams_refused") or {}
        detail = f", refused {sum(refused.values())} streams ({', '.join(f'{k}: {v}' for k, v in refused.items())})"
        if membership.get("peers_disconnected"):
            detail += f", disconnected {membership['peers_disconnected']} peers"
        lines.append(f"swarm:     {membership.get('mode')}" + (detail if refused else ""))
    if data.get("reachability"):
        lines += format_reachability(data["reachability"])
    if data.get("dht_error"):
        lines.append(f"warning:   {data['dht_error']}")
    view = data.get("view") or {}
    if view.get("partial"):
        lines.append(f"WARNING:   partial view of the swarm (split brain?): {view.get('reason')}; "
                     f"{view.get('rebootstraps', 0)} re-bootstrap(s) so far")
    training = data.get("training")
    if training:
        lines.append(f"training:  {training.get('mode')} | {format_progress(training)}")
        trainable, total = training.get("parameters") or 0, training.get("model_parameters") or 0
        if total > trainable:  # e.g. LoRA: only the adapters are averaged
            line = f"model:     {trainable:,} of {total:,} parameters train ({trainable / total:.2%})"
            moved = training.get("round_bytes")
            if moved:
                line += (f"; a round moves {moved['trainable'] / 2**10:,.0f} KiB, against "
                         f"~{moved['all_parameters'] / 2**10:,.0f} KiB training all of them")
            lines.append(line)
        averaging = training.get("averaging") or {}
        if averaging.get("stalled"):
            lines.append(f"WARNING:   averaging has stopped: {averaging.get('failed_streak')} rounds in "
                         f"{averaging.get('failing_for', 0):.0f} s without averaging although "
                         f"{averaging.get('others_in_view')} other trainer(s) in view; last failure: "
                         f"{averaging.get('last_error')}")
        download = (training.get("state_transfer") or {}).get("download") or {}
        if download.get("state") in ("downloading", "failed"):
            lines.append(f"state:     {download['state']} {download.get('bytes_done', 0) / 2**20:.1f} of "
                         f"{download.get('bytes_total', 0) / 2**20:.1f} MiB from {download.get('donor')} "
                         f"({download.get('donors_tried', 0)} donors tried)")
    lines += ["", f"peers seen ({len(data.get('peers', []))}):", format_peers(data.get("peers", []))]
    experts = data.get("experts") or {}
    if experts.get("server") or experts.get("client"):
        lines += ["", format_experts(experts)]
    return "\n".join(lines)


def _ms(value: Any) -> str:
    return "-" if value is None else f"{value:.1f}"


def format_experts(experts: dict[str, Any]) -> str:
    """The ``experts`` section of a status: served experts (host side) and called experts (caller side)."""
    parts = []
    server = experts.get("server")
    if server:
        rows = []
        for uid, info in server.get("experts", {}).items():
            for phase in ("forward", "backward"):
                calls = info.get(phase, {})
                rows.append([uid, phase, calls.get("calls", 0), calls.get("tokens", 0), calls.get("mean_batch_tokens", "-"),
                             _ms(calls.get("mean_ms")), _ms(calls.get("p99_ms")), calls.get("errors", 0),
                             info.get("updates", 0) if phase == "backward" else "",
                             f"{info.get('distance_from_init', 0):.4f}" if phase == "backward" else ""])
        served = len(server.get("experts", {}))
        lines = [f"experts served ({served}, {server.get('rejected_calls', 0)} malformed calls refused):",
                 format_table(["expert", "pass", "calls", "tokens", "batch", "mean ms", "p99 ms", "errors", "updates",
                               "moved"], rows)]
        parts.append("\n".join(lines))
    client = experts.get("client")
    if client:
        rows = []
        for uid, info in client.get("experts", {}).items():
            fwd, bwd = info.get("forward", {}), info.get("backward", {})
            rows.append([uid, _short_id(info.get("peer_id") or "-"), "yes" if info.get("announced") else "no",
                         fwd.get("calls", 0), _ms(fwd.get("mean_ms")), _ms(fwd.get("p99_ms")), _ms(bwd.get("mean_ms")),
                         _ms(bwd.get("p99_ms")), fwd.get("errors", 0) + bwd.get("errors", 0),
                         fwd.get("timeouts", 0) + bwd.get("timeouts", 0), info.get("backing_off_for", 0.0) or "-"])
        layers = ", ".join(f"{name}: {info.get('fallback_tokens', 0)} of {info.get('tokens', 0)} tokens fell back"
                           for name, info in client.get("layers", {}).items())
        parts.append("\n".join([
            f"experts called ({layers or 'no MoE layer'}):",
            format_table(["expert", "host", "alive", "calls", "fwd mean ms", "fwd p99", "bwd mean ms", "bwd p99",
                          "failures", "timeouts", "backoff s"], rows),
        ]))
    return "\n\n".join(parts)
