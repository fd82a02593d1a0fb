"""What a private swarm's records give away and how long they live, with real processes (light peers).

- A member that signs every record to expire in 30 years (tests/integration/liar.py) and dies: peerd's
  readers and DHT nodes believe an expiration only up to the key's TTL plus the clock tolerance, so the dead
  member never shows up and is gone when killed; with the cap switched off (tests/integration/undefended.py)
  it is listed long after it died.
- A stranger reading the swarm's records from the DHT (tests/integration/stranger.py): peerd seals payloads
  under the swarm secret, so it reads no peer id, address or version; unsealed, it reads all of them.
"""

from __future__ import annotations

import base64
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from peerd.launcher import PeerProcess, wait_for
from tests.helpers import LOCAL_CONFIG, PATCHED_ENV, REPO
from tests.integration.swarms import new_secret

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

RECORD_TTL = 8.0  # configs/local.yaml
AFTERLIFE = RECORD_TTL + 3.0 + 12.0  # the longest a dead member's record may be listed, and some


def peer(name: str, log_dir: Path, secret: Path, module: str = "peerd", extra: tuple[str, ...] = (),
         join: PeerProcess | None = None) -> PeerProcess:
    args = ["--config", str(LOCAL_CONFIG), "--control-port", "0", "--swarm-secret", str(secret), *extra]
    if join is not None:
        args += ["--initial-peers", join.ready["maddrs"][0]]
    process = PeerProcess(name, args, log_dir, env=PATCHED_ENV, module=module)
    process.wait_ready(90)
    return process


def listed(observer: PeerProcess, peer_id: str) -> bool:
    return peer_id in observer.seen_peer_ids()


def far_expirations(log_dir: Path, undefended: bool) -> tuple[bool, bool]:
    """Returns whether the honest peer listed the lying member while it lived, and AFTERLIFE s after it died."""
    secret = new_secret(log_dir)
    module, extra = ("tests.integration.undefended", ("--undefended", "expiration-cap")) if undefended else ("peerd", ())
    honest = peer("honest", log_dir, secret, module, extra)
    liar = None
    try:
        liar = peer("liar", log_dir, secret, "tests.integration.liar", ("--lie", "expirations"), join=honest)

        def seen_or_refused() -> bool:
            refused = honest.status(timeout=30)["records_dropped"].get("expiration_too_far", 0)
            return listed(honest, liar.peer_id) or refused > 2

        wait_for(seen_or_refused, 60, "the liar's record to be read or refused", 0.5)
        alive = listed(honest, liar.peer_id)
        liar.kill()
        died = time.monotonic()
        # a dead member's record must be gone one TTL (plus the clock tolerance) after its last refresh
        wait_for(lambda: time.monotonic() - died > AFTERLIFE, AFTERLIFE + 5, "the afterlife window", 1.0)
        dead = listed(honest, liar.peer_id)
        print(f"undefended={undefended}: the liar listed while alive {alive}, {AFTERLIFE:.0f} s after death {dead}")
        return alive, dead
    finally:
        for process in (liar, honest):
            if process is not None:
                process.kill()


def test_a_record_cannot_outlive_its_author(tmp_path: Path) -> None:
    alive, dead = far_expirations(tmp_path / "defended", undefended=False)
    assert not alive and not dead
    alive, dead = far_expirations(tmp_path / "undefended", undefended=True)
    assert alive and dead, "without the cap the dead liar should still be listed"


def stranger_reads(log_dir: Path, undefended: bool) -> tuple[str, bytes]:
    """A member runs; a stranger reads ``<run>.peers`` from the DHT. Returns the member's peer id and every
    payload byte the stranger got."""
    secret = new_secret(log_dir)
    module, extra = ("tests.integration.undefended", ("--undefended", "sealing")) if undefended else ("peerd", ())
    member = peer("member", log_dir, secret, module, extra)
    try:
        def read() -> bytes | None:
            out = subprocess.run([sys.executable, "-m", "tests.integration.stranger", "read", member.ready["maddrs"][0],
                                  "peerd-local.peers"], capture_output=True, text=True, timeout=60, cwd=REPO,
                                 env={**os.environ, **PATCHED_ENV}, check=True)
            payloads = json.loads(out.stdout.strip().splitlines()[-1])["payloads"]
            return b"".join(base64.b64decode(p) for p in payloads.values()) or None

        return member.peer_id, wait_for(read, 60, "the stranger to read the member's record", 1.0)
    finally:
        member.kill()


def test_strangers_read_nothing_from_a_private_swarms_records(tmp_path: Path) -> None:
    # what a stranger wants to know: who is in the swarm, where, running what
    peer_id, sealed = stranger_reads(tmp_path / "defended", undefended=False)
    assert peer_id.encode() not in sealed and b"127.0.0.1" not in sealed and b"software_version" not in sealed
    peer_id, plain = stranger_reads(tmp_path / "undefended", undefended=True)
    assert peer_id.encode() in plain and b"127.0.0.1" in plain and b"software_version" in plain, plain[:200]
