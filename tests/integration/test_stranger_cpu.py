"""A stranger's CPU attack on the DHT, with real processes: one store request of 1 MB of records signed with
RSA keys whose public exponent is as long as their 3,072-bit modulus (tests/integration/stranger.py). Each
costs an RSA verification ~100x dearer than an honest key's, on the loop that runs the victim's DHT node:
for a light peer, the daemon's own loop, whose control endpoint then stops answering.

peerd refuses such keys before verifying (open swarm) and, in a private swarm, checks the member tag first.
The same request against ``tests/integration/undefended.py`` with those checks switched off shows the damage:
every record verified, the victim's loop blocked for seconds.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from peerd.launcher import PeerProcess
from tests.helpers import LOCAL_CONFIG, REPO
from tests.integration.swarms import new_secret

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

ENV = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
KEY = "peerd-local.peers"  # configs/local.yaml's run
NBYTES = 1_000_000


def attack(log_dir: Path, secret: Path | None, undefended: str | None) -> dict[str, Any]:
    """Starts a light peer, has the stranger store NBYTES of costly records to it while the test polls the
    peer's control endpoint; returns the stranger's report, the slowest status answer meanwhile and the peer's
    refusal counts."""
    log_dir.mkdir(parents=True, exist_ok=True)
    args = ["--config", str(LOCAL_CONFIG), "--control-port", "0"]
    args += ["--swarm-secret", str(secret)] if secret is not None else []
    args += ["--undefended", undefended] if undefended else []
    victim = PeerProcess("victim", args, log_dir, env=ENV,
                         module="tests.integration.undefended" if undefended else "peerd")
    try:
        victim.wait_ready(90)
        before = victim.status(timeout=30)["records_dropped"]
        slowest = 0.0
        done = threading.Event()

        def poll() -> None:
            nonlocal slowest
            while not done.is_set():
                started = time.monotonic()
                victim.status(timeout=120)
                slowest = max(slowest, time.monotonic() - started)
                done.wait(0.05)  # pacing the probes, not waiting for an event

        poller = threading.Thread(target=poll, daemon=True)
        poller.start()
        stranger = subprocess.run([sys.executable, "-m", "tests.integration.stranger", "cpu", victim.ready["maddrs"][0],
                                   KEY, str(NBYTES)], capture_output=True, text=True, timeout=180, env={**os.environ, **ENV},
                                  cwd=REPO, check=True)
        done.set()
        poller.join(130)
        report = json.loads(stranger.stdout.strip().splitlines()[-1])
        after = victim.status(timeout=30)["records_dropped"]
        report["refused"] = {reason: after[reason] - before.get(reason, 0) for reason in after
                             if after[reason] != before.get(reason, 0)}
        report["slowest_status"] = slowest
        print(f"secret={secret is not None} undefended={undefended}: {report}")
        return report
    finally:
        victim.kill()


@pytest.mark.parametrize("private", [False, True], ids=["open", "private"])
def test_costly_keys_cost_the_victim_nothing(private: bool, tmp_path: Path) -> None:
    secret = new_secret(tmp_path) if private else None
    # open swarm: the key check is the defence; private: the member tag, checked first, is enough on its own
    defended = attack(tmp_path / "defended", secret, "key-check" if private else None)
    undefended = attack(tmp_path / "undefended", secret, "key-check,tag-first" if private else "key-check")
    records = defended["records"]
    assert defended["stored"] == 0 and undefended["stored"] == 0
    # defended: refused before any verification, by the cheap checks
    assert defended["refused"] == {"not_member" if private else "bad_key": records}, defended
    # undefended: every record went through an RSA verification, and that blocked the victim's loop
    assert undefended["refused"] == {"bad_signature": records}, undefended
    assert undefended["took"] > 1.0 and undefended["took"] > 5 * defended["took"], (defended, undefended)
    assert undefended["slowest_status"] > 1.0, undefended
