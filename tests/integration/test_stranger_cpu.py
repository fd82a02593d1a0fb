"""A stranger's CPU attack on the DHT, with real processes: 1 MB of records signed with RSA keys whose public
exponent is as long as their 3,072-bit modulus, in store requests sent at once (tests/integration/stranger.py).
Each costs an RSA verification ~100x dearer than an honest key's, on the loop that runs the victim's DHT node:
for a light peer, the daemon's own loop, whose control endpoint then stops answering.

peerd refuses such keys before verifying (open swarm) and, in a private swarm, checks the member tag first.
The same requests against ``tests/integration/undefended.py`` with those checks switched off show the damage:
every record verified, the victim's loop blocked for seconds.

Also: stores of one whole dictionary of as many subkeys as a request holds, which hivemind unpacks before any
record check; a private swarm's peer takes no whole dictionary from a peer that has not proven membership.
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
# two stores of a dictionary of 200,000 subkeys (3.7 MB each: 400,000 are more than a request may hold)
SUBKEYS, DICTIONARIES = 200_000, 2


def attack(log_dir: Path, secret: Path | None, undefended: str | None,
           command: tuple[str, ...] = ("cpu", KEY, str(NBYTES))) -> dict[str, Any]:
    """Starts a light peer, has the stranger run ``command`` (tests/integration/stranger.py; by default, store
    NBYTES of costly records) against it while the test polls the peer's control endpoint; returns the
    stranger's report, the slowest status answer meanwhile and the peer's refusal counts."""
    log_dir.mkdir(parents=True, exist_ok=True)
    args = ["--config", str(LOCAL_CONFIG), "--control-port", "0"]
    args += ["--swarm-secret", str(secret)] if secret is not None else []
    args += ["--undefended", undefended] if undefended else []
    victim = PeerProcess("victim", args, log_dir, env=ENV,
                         module="tests.integration.undefended" if undefended else "peerd")
    try:
        victim.wait_ready(90)
        status = victim.status(timeout=30)
        before, requests_refused = status["records_dropped"], status["dht_requests_refused"]
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
        stranger = subprocess.run([sys.executable, "-m", "tests.integration.stranger", command[0],
                                   victim.ready["maddrs"][0], *command[1:]], capture_output=True, text=True,
                                  timeout=180, env={**os.environ, **ENV}, cwd=REPO, check=True)
        done.set()
        poller.join(130)
        report = json.loads(stranger.stdout.strip().splitlines()[-1])
        status = victim.status(timeout=30)
        after, report["requests_refused"] = status["records_dropped"], status["dht_requests_refused"] - requests_refused
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
    # every request answered (the bound on keys per request is not what is tested here), no record stored
    assert defended["stored"] == 0 and undefended["stored"] == 0, (defended, undefended)
    assert defended["requests_failed"] == 0 and undefended["requests_failed"] == 0, (defended, undefended)
    # defended: refused before any verification, by the cheap checks
    assert defended["refused"] == {"not_member" if private else "bad_key": records}, defended
    # undefended: every record went through an RSA verification, and that blocked the victim's loop
    assert undefended["refused"] == {"bad_signature": records}, undefended
    assert undefended["took"] > 1.0 and undefended["took"] > 5 * defended["took"], (defended, undefended)
    assert undefended["slowest_status"] > 1.0, undefended


def test_a_strangers_whole_dictionaries_are_not_unpacked(tmp_path: Path) -> None:
    secret = new_secret(tmp_path)
    command = ("dictionary", KEY, str(SUBKEYS), str(DICTIONARIES))
    defended = attack(tmp_path / "defended", secret, None, command)
    undefended = attack(tmp_path / "undefended", secret, "dht-request-keys", command)
    for report in (defended, undefended):
        assert report["stored"] == 0 and report["requests_failed"] == 0, report
    # refused whole, unopened: answered "stored nothing", and not one of its records reached the record checks
    assert defended["requests_refused"] == DICTIONARIES and defended["refused"] == {}, defended
    # taken: each dictionary unpacked, subkey by subkey, then refused by the record check, with the victim's
    # loop blocked meanwhile
    assert undefended["requests_refused"] == 0 and undefended["refused"] == {"malformed": DICTIONARIES}, undefended
    assert undefended["slowest_status"] > 1.0, undefended
