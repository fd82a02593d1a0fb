"""Peers whose wall clocks disagree, made with libfaketime (Debian package ``faketime``).

hivemind's DHT accepts peers within 3 s of each other; within that, a skewed peer must average as if the
clocks agreed; beyond it, `peerd start` must exit 1 with one line naming the offset and the fix. The skew
is applied the way the ``faketime`` command applies it: LD_PRELOAD of libfaketime with ``FAKETIME=<offset>``
in the environment, which the daemon's DHT child process inherits (p2pd, a static Go binary, ignores it:
DHT times come from Python's clock).
"""

from __future__ import annotations

import glob
import re
from collections.abc import Iterator
from pathlib import Path

import pytest

from peerd.launcher import PeerProcess, wait_for
from tests.helpers import REPO, ready_peer, training

pytestmark = pytest.mark.integration

SYNTHETIC = REPO / "configs" / "synthetic.yaml"
LIBFAKETIME = next(iter(sorted(glob.glob("/usr/lib/*/faketime/libfaketime.so.1")
                               + glob.glob("/usr/lib/faketime/libfaketime.so.1"))), None)
needs_faketime = pytest.mark.skipif(
    LIBFAKETIME is None,
    reason="libfaketime not found (Debian package `faketime`; scripts/install-system-packages.sh installs it)",
)
# progress_period 0.5: the peers notice each other's complete batches soon after, so rounds form quickly
ARGS = ["--config", str(SYNTHETIC), "--control-port", "0", "-o", "training.progress_period=0.5"]


def faketime_env(offset: float) -> dict[str, str]:
    assert LIBFAKETIME is not None
    return {"LD_PRELOAD": LIBFAKETIME, "FAKETIME": f"{offset:+g}s", "FAKETIME_DONT_FAKE_MONOTONIC": "1"}


@pytest.fixture(scope="module")
def anchor(tmp_path_factory: pytest.TempPathFactory) -> Iterator[PeerProcess]:
    """The peer with the true clock, shared by the cases: each skewed peer joins through it."""
    with ready_peer("anchor", ARGS, tmp_path_factory.mktemp("clock-anchor")) as peer:
        yield peer


@needs_faketime
@pytest.mark.timeout(100)
@pytest.mark.parametrize("offset", [0.0, 2.0, -2.0, 2.5, -2.5])
def test_peers_within_the_dht_tolerance_average_together(anchor: PeerProcess, tmp_path: Path, offset: float) -> None:
    with ready_peer(f"skewed{offset:+g}", [*ARGS, "--initial-peers", anchor.ready["maddrs"][0]], tmp_path,
                    env=faketime_env(offset)) as skewed:
        before = training(anchor)["rounds_ok"]
        wait_for(lambda: skewed.peer_id in anchor.seen_peer_ids(), 30, "the anchor to see the skewed peer")
        try:
            wait_for(lambda: training(skewed)["rounds_ok"] >= 2 and training(anchor)["rounds_ok"] >= before + 2, 60,
                     f"two averaged rounds with a clock offset of {offset:+g}s", 0.5)
        except TimeoutError as e:
            counts = {p.name: {k: training(p)[k] for k in ("step", "rounds_ok", "rounds_solo")}
                      for p in (anchor, skewed)}
            raise AssertionError(f"{e}; anchor had {before} rounds before; now {counts}\n{skewed.log_tail()}") from e
        report = training(skewed)
        assert report["last_round"]["group_size"] == 2, report
        assert report["averaging"]["stalled"] is False
        assert skewed.stop() == 0


@needs_faketime
@pytest.mark.timeout(90)
@pytest.mark.parametrize("offset", [30.0, -30.0])
def test_a_clock_beyond_the_dht_tolerance_exits_with_one_clear_line(
    anchor: PeerProcess, tmp_path: Path, offset: float
) -> None:
    skewed = PeerProcess(f"skewed{offset:+g}", [*ARGS, "--initial-peers", anchor.ready["maddrs"][0]], tmp_path,
                         env=faketime_env(offset))
    try:
        assert skewed.proc.wait(60) == 1
        log = skewed.log_path.read_text()
        assert "Traceback" not in log, log
        # records the skewed DHT refuses before the check may be warned about; the error is one line
        lines = [line for line in log.splitlines() if "ERROR" in line]
        assert len(lines) == 1 and "clock" in lines[0], log
        measured = re.search(r"([+-]\d+\.\d)\s*s\b", lines[0])
        assert measured is not None and abs(float(measured.group(1)) - offset) < 2, lines[0]
        assert "NTP" in lines[0], lines[0]
    finally:
        skewed.kill()
