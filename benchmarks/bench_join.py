"""A late joiner behind a shaped link downloads a real training state from real daemons, in both modes.

Three `peerd start` processes of ``--config`` (configs/lm-wan.yaml: 19.2M parameters), each in its own network
namespace of benchmarks/netns.py behind a ``--rate`` Mbit/s port (25 by default, both ways): two donors train
to ``training.max_steps`` (2: a sync step or a short diloco phase of ``--inner-steps`` is enough, the state's
size does not depend on how far training went), average their state at step 2 (``state_averaging_every``) and
stay up, serving the state they agree on; then the joiner starts, sees the swarm ahead of it and downloads the
state both donors vouch for before it trains (``training.sync_state_on_join``). That state is what state
averaging averages: sync mode's parameters and Adam slots (3x the parameters in fp32), diloco's shared
parameters and outer momentum (2x).

``--kill-donor``: once the joiner holds ``--kill-at`` of the state, the donor it is downloading from is killed
(SIGKILL of its whole process group: daemon, DHT child, p2pd) and the joiner finishes from the other one,
resuming at the start of the 32 MiB piece the first was sending.

Printed per run: mode, state size, seconds of the download (the joiner's ``state_transfer.download.seconds``:
first request to checked state), achieved Mbit/s of payload, bytes from each donor, donors tried, the step
loaded, and the joiner's seconds from its start to its first training step after loading.

Run (as root: the lab needs network namespaces):
    .venv/bin/python benchmarks/bench_join.py [--modes sync,diloco] [--rate 25] [--kill-donor] [--kill-at 0.4]
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys
import tempfile
import time
from datetime import datetime
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _netns_peerd import NetnsPeer
from netns import NetnsLab, NetnsUnavailable

from peerd.errors import PeerdError
from peerd.launcher import wait_for
from peerd.tables import format_table

ROOT = HERE.parent
PORT = 32337
DONORS = 2


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def training(peer: NetnsPeer) -> dict[str, Any]:
    try:
        return peer.status()["training"] or {}
    except Exception:  # noqa: BLE001 - a killed or busy peer: no status this time
        return {}


def run(lab: NetnsLab, mode: str, args: argparse.Namespace, index: int) -> dict[str, Any]:
    port = PORT + index  # a fresh port per run: the previous run's sockets may linger in TIME_WAIT
    log_dir = Path(tempfile.mkdtemp(prefix=f"peerdbench-join-{mode}-"))
    common = ["--config", str(args.config), "--run-name", f"join-{mode}", "--control-port", "0",
              "-o", f"training.mode={mode}", "-o", f"training.diloco.inner_steps={args.inner_steps}",
              "-o", "training.max_steps=2", "-o", "training.validation_every=1000",
              "-o", "training.state_averaging_every=2", *args.override]
    peers: list[NetnsPeer] = []
    result: dict[str, Any] = {"mode": mode, "load_before": load(), "log_dir": str(log_dir)}
    try:
        for i in range(DONORS):
            extra = ["--host-maddrs", f"/ip4/{lab.addr(i)}/tcp/{port}", "-o", f"training.wait_for_peers={DONORS}",
                     "-o", f"training.task.shard_index={i}"]
            if i:
                extra += ["--initial-peers", peers[0].ready["maddrs"][0]]
            peers.append(NetnsPeer(f"donor{i}", lab.ns(i), [*common, *extra], log_dir))
            peers[-1].wait_ready(180)
        donors = list(peers)
        wait_for(lambda: all(training(d).get("state") == "idle" for d in donors), 1800, f"{mode}: donors at step 2")
        started = time.monotonic()
        joiner = NetnsPeer("joiner", lab.ns(DONORS), [
            *common, "--host-maddrs", f"/ip4/{lab.addr(DONORS)}/tcp/{port}", "-o", "training.wait_for_peers=1",
            "-o", f"training.task.shard_index={DONORS}", "--initial-peers", donors[0].ready["maddrs"][0],
        ], log_dir)
        peers.append(joiner)
        killed = None
        if args.kill_donor:
            # the joiner prints its ready line (and serves its status) only after its start-up download: its
            # log's progress lines (one per tenth of the state) say how much it holds and from whom
            wait_for(lambda: _held(joiner) >= args.kill_at, 1800, "the joiner to hold the share to kill at", 0.05)
            victim = next((d for d in donors if d.peer_id in _last_progress(joiner)), donors[0])
            victim.kill()
            killed = victim.name
        joiner.wait_ready(3600)
        status = training(joiner)
        download = (status.get("state_transfer") or {}).get("download") or {}
        wait_for(lambda: training(joiner).get("step", 0) >= 2 or training(joiner).get("state") != "syncing", 600,
             "the joiner to train after loading")
        result.update(
            state_bytes=download.get("bytes_total"), seconds=download.get("seconds"),
            bytes_from={_name(peers, peer): n for peer, n in (download.get("bytes_from") or {}).items()},
            donors_tried=download.get("donors_tried"), step=status.get("step"), killed=killed,
            ready_after=time.monotonic() - started, state=download.get("state"),
        )
    except (PeerdError, TimeoutError) as e:
        result["error"] = str(e)
        print(f"   FAILED: {e}", flush=True)
    finally:
        for peer in peers:
            peer.send(signal.SIGTERM)
        for peer in peers:
            peer.stop()
    result["load_after"] = load()
    if "error" not in result and not args.keep_logs:
        shutil.rmtree(log_dir, ignore_errors=True)
    return result


def _last_progress(joiner: NetnsPeer) -> str:
    lines = [line for line in joiner.log_path.read_text().splitlines() if "State download progress" in line]
    return lines[-1] if lines else ""


def _held(joiner: NetnsPeer) -> float:
    """Share of the state the joiner holds, from its last download progress line."""
    line = _last_progress(joiner)
    if not line:
        return 0.0
    done, total = line.rsplit("progress ", 1)[1].split()[0].split("/")
    return int(done) / max(int(total), 1)


def _name(peers: list[NetnsPeer], peer_id: str) -> str:
    return next((p.name for p in peers if p.peer_id == peer_id), peer_id[:12])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--modes", default="sync,diloco")
    parser.add_argument("--rate", type=float, default=25.0, help="each peer's link, Mbit/s both ways")
    parser.add_argument("--inner-steps", type=int, default=5, help="diloco: inner steps of the donors' phases")
    parser.add_argument("--kill-donor", action="store_true", help="kill the serving donor mid-transfer")
    parser.add_argument("--kill-at", type=float, default=0.4, help="share of the state held when it is killed")
    parser.add_argument("--config", type=Path, default=ROOT / "configs" / "lm-wan.yaml")
    parser.add_argument("-o", "--override", action="append", default=[], metavar="KEY=VALUE")
    parser.add_argument("--keep-logs", action="store_true")
    args = parser.parse_args()
    args.override = [arg for item in args.override for arg in ("-o", item)]
    print(f"{datetime.now().astimezone():%Y-%m-%d %H:%M:%S %Z}  {shlex.join([sys.executable, *sys.argv])}")
    print(f"load average {load()}; {os.cpu_count()} CPU cores", flush=True)
    results = []
    try:
        with NetnsLab(DONORS + 1, rate_mbit=args.rate) as lab:
            print(lab.describe(), flush=True)
            for index, mode in enumerate(m.strip() for m in args.modes.split(",") if m.strip()):
                print(f"\n== {mode}{' (the serving donor killed at ' + str(args.kill_at) + ')' if args.kill_donor else ''}",
                      flush=True)
                results.append(run(lab, mode, args, index))
    except NetnsUnavailable as e:
        print(f"skipped: {e}")
        return 1
    rows = [[r["mode"], f"{(r.get('state_bytes') or 0) / 1e6:.1f}", f"{r.get('seconds') or 0:.1f}",
             f"{(r.get('state_bytes') or 0) * 8 / 1e6 / max(r.get('seconds') or 1e-9, 1e-9):.1f}",
             ", ".join(f"{k}: {v / 1e6:.1f} MB" for k, v in (r.get("bytes_from") or {}).items()),
             r.get("killed") or "-", r.get("donors_tried"), r.get("step"), f"{r.get('ready_after') or 0:.1f}",
             f"{r['load_before']} / {r['load_after']}", r.get("error", "ok")[:60]] for r in results]
    print()
    print(format_table(["mode", "state MB", "download s", "Mbit/s", "bytes from", "killed", "donors tried",
                        "step loaded", "start -> ready s", "load before / after", "result"], rows))
    return 0 if all("error" not in r for r in results) else 1


def _sigterm(signum: int, frame: object) -> None:
    raise KeyboardInterrupt("SIGTERM")  # unwind through every finally: daemons stopped, namespaces removed


if __name__ == "__main__":
    signal.signal(signal.SIGTERM, _sigterm)
    sys.exit(main())
