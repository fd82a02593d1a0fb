"""What a stranger's oversized DHT finds cost members: rounds with and without them, same run, peerd against
peerd answering finds of any size (tests/integration/undefended.py ``dht-request-keys``, hivemind's behaviour).

hivemind answers a find about any number of keys, naming the nearest nodes for each: a stranger without the
secret (tests/integration/stranger.py ``finds``) sends --calls finds of --keys random keys each at a time to
the second of two members training configs/synthetic.yaml in a private swarm, each again as soon as it ends.
For each side, the member's time for --rounds rounds is taken before the stranger came, while it runs and after
it left; sides alternate, --repeats times each. peerd refuses a find of more than 1,024 keys once parsed.

    PYTHONPATH=. .venv/bin/python benchmarks/bench_dht_requests.py [--keys 40000] [--calls 2] [--rounds 60]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from peerd.launcher import wait_for
from tests.helpers import REPO, SYNTHETIC, rounds, time_rounds
from tests.integration.swarms import honest_peer, private


def side(undefended: bool, keys: int, calls: int, count: int) -> None:
    log_dir = Path(tempfile.mkdtemp(prefix="bench-dht-requests-"))
    off = "dht-request-keys" if undefended else None
    with private(SYNTHETIC, log_dir, "-o", "logging.level=WARNING") as swarm:
        honest_peer(swarm, "member0", off).wait_ready(90)
        member = honest_peer(swarm, "member1", off)
        member.wait_ready(90)
        wait_for(lambda: rounds(member) >= 3, 120, "the members to average 3 rounds", 0.5)
        before = time_rounds(member, count, 120)
        stranger = subprocess.Popen([sys.executable, "-m", "tests.integration.stranger", "finds",
                                     member.ready["maddrs"][0], str(keys), str(calls)],
                                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=REPO)
        try:
            assert stranger.stdout is not None
            stranger.stdout.readline()  # its first finds were answered or refused
            during = time_rounds(member, count, 300)
        finally:
            stranger.terminate()
            stranger.wait(30)
            if stranger.stdout is not None:
                stranger.stdout.close()
        after = time_rounds(member, count, 120)
        refused = member.status(timeout=60)["dht_requests_refused"]
        label = "any size (undefended)" if undefended else "peerd"
        print(f"{label:22s} {count} rounds: before {before:.1f} s, during {during if during is None else round(during, 1)} s, after {after:.1f} s; "
              f"finds refused {refused}; load {os.getloadavg()[0]:.1f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--keys", type=int, default=40_000, help="keys per find (a find carries at most 4 MiB)")
    parser.add_argument("--calls", type=int, default=2, help="finds in flight at a time")
    parser.add_argument("--rounds", type=int, default=60)
    parser.add_argument("--repeats", type=int, default=2)
    options = parser.parse_args()
    print(f"{time.strftime('%Y-%m-%d %H:%M %Z')}, {os.cpu_count()} cores, load {os.getloadavg()[0]:.1f}; "
          f"a stranger sends {options.calls} finds of {options.keys} keys at a time to one of 2 members")
    for _ in range(options.repeats):
        for undefended in (False, True):
            side(undefended, options.keys, options.calls, options.rounds)


if __name__ == "__main__":
    main()
