"""`peerd swarm`: the newcomer's first command. Starts N local peers, shows the swarm, trains, stops cleanly."""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

from peerd.config import load_config, parse_overrides
from peerd.errors import DaemonError, PeerdError
from peerd.launcher import LocalSwarm, PeerProcess
from peerd.tables import format_table
from peerd.wire.membership import generate_secret


def swarm_table(peers: list[PeerProcess]) -> str:
    rows = []
    for peer in peers:
        status = peer.status()
        rows.append([peer.name, peer.peer_id, status["state"], len(status["peers"]), f"{status['uptime']:.1f}s",
                     peer.ready["maddrs"][0], peer.control])
    return format_table(["name", "peer id", "state", "sees", "uptime", "address", "control"], rows)


def _fmt(value: float | None, digits: int = 3) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def training_table(peers: list[PeerProcess]) -> tuple[str, list[dict[str, Any]]]:
    rows, reports = [], []
    for peer in peers:
        report = peer.status()["training"] or {}
        reports.append(report)
        last = report.get("last_round") or {}
        rows.append([
            peer.name, report.get("step", "-"), report.get("mode", "-"), _fmt(report.get("loss")), _fmt(report.get("validation_loss")),
            _fmt(report.get("samples_per_second"), 1), f"{report.get('rounds_ok', 0)}/{report.get('rounds_solo', 0)}",
            last.get("group_size", "-"), _fmt(last.get("duration"), 2),
            f"{report.get('bytes_sent', 0) / 2**20:.1f}", _fmt(last.get("codec_error"), 4),
        ])
    headers = ["peer", "step", "mode", "loss", "val loss", "samples/s", "rounds ok/solo", "group", "round s", "MiB sent",
               "codec err"]
    return format_table(headers, rows), reports


def run_local_swarm(n_peers: int, config_path: Path, timeout: float = 60.0, duration: float = 120.0,
                    interval: float = 10.0, private: bool = True, overrides: tuple[str, ...] = ()) -> int:
    """Start, wait for a full mesh in the DHT, print it; if the config trains, watch it train; stop cleanly.
    ``private``: unless the config names a swarm secret, the peers share a fresh one (in the log directory).
    ``overrides``: ``section.key=value`` settings for every peer, as ``peerd start -o``."""
    if not config_path.is_file():
        raise DaemonError(f"config {config_path} not found; run from the repository root or pass --config")
    config = load_config(config_path, parse_overrides(overrides))
    trains = config.training.enabled
    with LocalSwarm(config_path, extra_args=[arg for item in overrides for arg in ("-o", item)]) as swarm:
        print(f"Starting {n_peers} peers from {config_path} (logs in {swarm.log_dir})", flush=True)
        if private and config.swarm.secret_path is None and config.swarm.allowlist_path is None:
            secret = swarm.log_dir / "swarm.secret"
            generate_secret(secret, overwrite=True)
            swarm.extra_args += ["--swarm-secret", str(secret)]
            print(f"Private swarm: the peers share a new secret, {secret} (--open for an open swarm)", flush=True)
        started = time.monotonic()
        try:
            for index in range(n_peers):
                # distinct data shards, so the peers really pool different data
                extra = ["-o", f"training.task.shard_index={index % config.training.task.num_shards}",
                         "-o", f"training.wait_for_peers={n_peers}"]
                extra = extra if trains else []
                experts = config.experts
                if experts is not None and experts.uids is None:  # each peer serves its own range of experts
                    extra += ["-o", f"experts.first_index={experts.first_index + index * experts.count}"]
                peer = swarm.spawn_peer(extra)
                if index == 0:
                    peer.wait_ready(timeout)
            for peer in swarm.peers:
                peer.wait_ready(timeout)
            swarm.wait_all_see_each_other(timeout=timeout)
        except (PeerdError, TimeoutError) as e:
            print(f"swarm failed: {e}", file=sys.stderr)
            for peer in swarm.peers:
                print(peer.log_tail(), file=sys.stderr)
            return 1
        print(f"All {n_peers} peers see each other after {time.monotonic() - started:.1f}s\n", flush=True)
        print(swarm_table(swarm.peers), flush=True)
        healthy = True
        if trains:
            healthy = _watch_training(swarm.peers, duration, interval)
        codes = swarm.stop()
        print(f"\nStopped; exit codes {codes}", flush=True)
        return 0 if healthy and all(code == 0 for code in codes) else 1


def experts_table(peers: list[PeerProcess]) -> str:
    """One row per expert served by the peers (empty when none serves any): calls, tokens, latency, updates."""
    rows = []
    for peer in peers:
        server = (peer.status().get("experts") or {}).get("server") or {}
        for uid, info in server.get("experts", {}).items():
            forward, backward = info.get("forward", {}), info.get("backward", {})
            rows.append([uid, peer.name, forward.get("calls", 0), forward.get("tokens", 0),
                         _fmt(forward.get("mean_ms"), 1), _fmt(backward.get("mean_ms"), 1),
                         forward.get("errors", 0) + backward.get("errors", 0), info.get("updates", 0)])
    if not rows:
        return ""
    return format_table(["expert", "host", "calls", "tokens", "fwd ms", "bwd ms", "errors", "updates"], rows)


def _watch_training(peers: list[PeerProcess], duration: float, interval: float) -> bool:
    print(f"\nTraining for {duration:.0f}s (Ctrl-C stops early)", flush=True)
    first_loss: float | None = None
    deadline = time.monotonic() + duration
    reports: list[dict[str, Any]] = []
    try:
        while time.monotonic() < deadline:
            time.sleep(min(interval, max(0.0, deadline - time.monotonic())))  # the demo's reporting cadence
            table, reports = training_table(peers)
            print(f"\n[{time.strftime('%H:%M:%S')}]\n{table}", flush=True)
            served = experts_table(peers)
            if served:
                print(served, flush=True)
            if first_loss is None:
                first_loss = next((r["loss"] for r in reports if r.get("loss") is not None), None)
    except KeyboardInterrupt:
        print("\ninterrupted; stopping the peers", flush=True)
    last = [r["loss"] for r in reports if r.get("loss") is not None]
    rounds = sum(r.get("rounds_ok", 0) for r in reports)
    if first_loss is not None and last:
        print(f"\nloss {first_loss:.3f} -> {min(last):.3f}; {rounds} averaged rounds in total", flush=True)
    return bool(last) and rounds > 0
