"""What a trainer believes of the others' progress claims: a step, a sample count, a state to load.

Each progress record is signed by its author, so who claims what is certain; whether it is true is not. A
member can claim any step, any samples and any state. So this peer believes:

- a **step** only when a quorum of other members has reached it: the ``q``-th highest step among them, where
  ``q`` is ``vouchers + 1`` (``training.state_transfer.vouchers``), or all of them in a swarm of fewer
  (a peer with one other member has no third opinion). One liar far ahead moves nobody; a peer that fell
  behind its group sees the group ahead and catches up.
- a **state** only when a quorum publishes the same digest of it (:class:`Vouched`): at least ``vouchers``
  members besides the donor that serves it.
- **samples** towards a step as far as the aggregation will weigh them: with a robust rule, a member's
  claimed samples count at most ``averaging.max_weight_ratio`` times the (lower) median claim at the step,
  the same cap its contribution's weight gets in the round; with ``mean``, as claimed.
- members this peer caught lying not at all, while excluded: as a state donor
  (:class:`~peerd.training.distrust.Distrust`) or in a round (the all-reduce's ban list, ``banned``). A member
  banned from this peer's rounds is not waited for in them either: counted among the trainers a round expects,
  it kept every round's leader waiting out its whole matchmaking window for a registration that never counts.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, replace

from peerd.training.distrust import Distrust
from peerd.training.progress import ProgressRecord, SwarmProgress

__all__ = ["Evidence", "Vouched"]


@dataclass(frozen=True)
class Vouched:
    """A state a quorum of members claims to hold: its step, its root digest (hex), and the members."""

    step: int
    digest: str
    members: tuple[str, ...]  # who publish it: the donors to ask, in the order to ask them


class Evidence:
    def __init__(self, me: str, vouchers: int, weight_ratio: float | None, distrust: Distrust,
                 lag_grace: float = 10.0, banned: Callable[[str], bool] = lambda _: False) -> None:
        """``weight_ratio``: the aggregation's cap on a claimed weight relative to the median (None: uncapped).
        ``lag_grace``: seconds a member that fell behind still counts as coming to our rounds. ``banned``: whether
        this peer's rounds exclude a member now (it lied in one)."""
        self.me = me
        self.vouchers = vouchers
        self.weight_ratio = weight_ratio
        self.distrust = distrust
        self.lag_grace = lag_grace
        self.banned = banned
        self._near: dict[str, float] = {}  # peer -> time.monotonic() it was last within a step of ours

    def others(self, view: SwarmProgress) -> dict[str, ProgressRecord]:
        """The records that count: every trainer with our fingerprint but this one and those excluded."""
        return {peer: p for peer, p in view.peers.items()
                if peer != self.me and not self.distrust.excluded(peer) and not self.banned(peer)}

    def counted(self, view: SwarmProgress) -> SwarmProgress:
        """``view`` without the members excluded now (lockstep waits for every trainer it shows)."""
        kept = self.others(view)
        if self.me in view.peers:
            kept[self.me] = view.peers[self.me]
        return replace(view, peers=kept)

    def quorum(self, others: int) -> int:
        return min(self.vouchers + 1, others)

    def believed_step(self, view: SwarmProgress) -> int | None:
        """The highest step a quorum of the other members has reached; None if no other member is in view."""
        steps = sorted((p.step for p in self.others(view).values()), reverse=True)
        return steps[self.quorum(len(steps)) - 1] if steps else None

    def vouched(self, view: SwarmProgress) -> Vouched | None:
        """The newest state (most members on a tie) that a quorum of the other members claims to hold."""
        others = self.others(view)
        holders: dict[tuple[int, str], list[ProgressRecord]] = {}
        for record in others.values():
            if record.state is not None:
                holders.setdefault((record.state.step, record.state.digest), []).append(record)
        need = self.quorum(len(others))
        agreed = [(key, records) for key, records in holders.items() if len(records) >= need]
        if not agreed:
            return None
        (step, digest), records = max(agreed, key=lambda item: (item[0][0], len(item[1]), item[0][1]))
        believed = self.believed_step(view) or 0
        # those whose own step is believable first (a member claiming to be far ahead is suspect), then ahead first
        ordered = sorted(records, key=lambda r: (r.step > believed + 1, -r.step, r.peer_id))
        return Vouched(step, digest, tuple(r.peer_id for r in ordered))

    def doubt(self, view: SwarmProgress, step: int, digest: str, donor: str) -> str | None:
        """None if enough members besides ``donor`` claim the state ``(step, digest)`` a donor offers; else
        what is missing."""
        others = self.others(view)
        if donor not in others and donor in view.peers:
            return f"{donor} is excluded"
        vouching = sorted(peer for peer, p in others.items()
                          if peer != donor and p.state is not None and (p.state.step, p.state.digest) == (step, digest))
        need = self.quorum(len(others) + (donor not in others)) - 1
        if len(vouching) >= need:
            return None
        return (f"{len(vouching)} other members vouch for its digest {digest[:16]}..., {need} needed "
                "(training.state_transfer.vouchers)")

    def counted_samples(self, view: SwarmProgress, step: int, own: int, moved_on: bool = False) -> tuple[int, int]:
        """Samples towards ``step`` (``own`` plus the others' at it, each capped) and how many others count.
        ``moved_on`` (diloco): members already past ``step`` count with what they had when they left it."""
        claims = {peer: p.samples for peer, p in self.others(view).items() if p.step == step}
        if moved_on:
            for peer, before in view.previous.items():
                if peer not in claims and peer != self.me and before.step == step and peer in self.others(view):
                    claims[peer] = before.samples
        if not claims:
            return own, 0
        if self.weight_ratio is None:
            return own + sum(claims.values()), len(claims)
        ranked = sorted([own, *claims.values()])
        cap = self.weight_ratio * ranked[(len(ranked) - 1) // 2]  # the lower median, as the aggregation's
        return own + int(sum(min(s, cap) for s in claims.values())), len(claims)

    def peers_near(self, view: SwarmProgress, step: int) -> int:
        """Trainers that may join a round at ``step``, this one included: those within a step of it, and those
        behind it that were within a step less than ``lag_grace`` seconds ago (a member that fell behind
        catches up and comes; one that claims to stay behind, or is still downloading, is not waited for). At
        least 2 while any other member is in view, so a peer that got ahead of everyone still waits a
        matchmaking window per step (and they catch up) rather than stepping alone at once."""
        now, others = time.monotonic(), self.others(view)
        self._near = {peer: seen for peer, seen in self._near.items() if peer in others}
        count = 1
        for peer, p in others.items():
            if abs(p.step - step) <= 1:
                self._near[peer] = now
                count += 1
            elif p.step < step and now - self._near.get(peer, -float("inf")) < self.lag_grace:
                count += 1
        return max(count, 2) if others else count

    def unbelieved(self, view: SwarmProgress, step: int) -> dict[str, int]:
        """Members claiming to be more than a step ahead of what this peer believes (its own step at least)."""
        believed = max(step, self.believed_step(view) or 0)
        return {peer: p.step for peer, p in view.peers.items() if peer != self.me and p.step > believed + 1}
