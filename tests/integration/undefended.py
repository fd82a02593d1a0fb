"""An honest peer without the checks of progress claims, for tests only: `python -m tests.integration.undefended
start ...` is `peerd start ...` that believes every member's word, as peerd did before those checks: the
furthest step any member claims is where the swarm is, the state of the member furthest ahead is the one to
load (with nothing vouching for it, and its pieces taken as they come), a failed load is tried again at the
next micro-step, rounds expect every trainer in view, every claimed sample counts, and nobody is excluded.
It shows the damage a lying member does when nothing checks it."""

from __future__ import annotations

from typing import Any

from peerd.cli import main
from peerd.training import joining
from peerd.training.distrust import Distrust
from peerd.training.evidence import Evidence, Vouched
from peerd.training.progress import SwarmProgress
from peerd.training.transfer.download import StateDownloader


def _furthest_step(self: Evidence, view: SwarmProgress) -> int | None:
    steps = [p.step for peer, p in view.peers.items() if peer != self.me]
    return max(steps) if steps else None


def _furthest_claim(self: Evidence, view: SwarmProgress) -> Vouched | None:
    ahead = sorted((p for peer, p in view.peers.items() if peer != self.me and p.state is not None),
                   key=lambda p: -p.step)
    if not ahead or ahead[0].state is None:
        return None
    return Vouched(ahead[0].state.step, ahead[0].state.digest, (ahead[0].peer_id,))


def _no_doubt(self: Evidence, view: SwarmProgress, step: int, digest: str, donor: str) -> str | None:
    return None


def _every_peer(self: Evidence, view: SwarmProgress, step: int) -> int:
    return max(1, len(view.peers))


def _every_sample(self: Evidence, view: SwarmProgress, step: int, own: int, moved_on: bool = False) -> tuple[int, int]:
    others = [p.samples for peer, p in view.peers.items() if peer != self.me and p.step == step]
    return own + sum(others), len(others)


def _taken_as_it_comes(self: StateDownloader, *args: Any) -> None:
    return None


def _no_accusation(self: Distrust, peer: str, reason: str) -> float:
    return 0.0


Evidence.believed_step = _furthest_step  # type: ignore[method-assign]
Evidence.vouched = _furthest_claim  # type: ignore[method-assign]
Evidence.doubt = _no_doubt  # type: ignore[method-assign]
Evidence.peers_near = _every_peer  # type: ignore[method-assign]
Evidence.counted_samples = _every_sample  # type: ignore[method-assign]
StateDownloader._verify = _taken_as_it_comes  # type: ignore[method-assign]
Distrust.accuse = _no_accusation  # type: ignore[method-assign]
joining.RETRY = 0.0

if __name__ == "__main__":
    main()
