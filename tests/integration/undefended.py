"""peerd with some defences switched off, for tests and benchmarks only: what the attacks would do without them.

    python -m tests.integration.undefended start --undefended NAME[,NAME...] <peerd start arguments>

is ``peerd start`` with each named defence replaced by what peerd did without it (DEFENCES says what each
one turns off). It runs the honest code everywhere else: a test runs the same scenario against ``peerd`` and
against this, and asserts that the damage shows only here.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import torch
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import hashes

from peerd.averaging import absences, aggregation, matchmaking
from peerd.averaging.verify import checks, coefficients, disputes
from peerd.averaging.verify import verdict as verify_verdict
from peerd.averaging.verify.round import RoundVerification
from peerd.bounded import PeerMedians
from peerd.cli import main
from peerd.experts.client import directory
from peerd.swarm import admission, sealing, signing, stragglers
from peerd.training import joining
from peerd.training.distrust import Distrust
from peerd.training.evidence import Evidence, Vouched
from peerd.training.progress import SwarmProgress
from peerd.training.transfer.download import StateDownloader
from peerd.wire.guard import StreamGuard


def _any_key() -> None:
    """Verify signatures by any RSA key, whatever its exponent and size."""
    signing.key_problem = lambda key: None


def _verify_first() -> None:
    """Verify the signature before the member tag (a stranger's record costs an RSA verification)."""
    honest = signing.RecordVerifier._check

    def check(self: signing.RecordVerifier, message: bytes, public_key: bytes, signature: bytes, tag: bytes,
              signer: str) -> Any:
        key = signing.load_public_key(public_key)
        if key is not None and signing.key_problem(key) is None:
            try:
                key.verify(signature, message, signing.PSS, hashes.SHA256())
            except InvalidSignature:
                return "bad_signature", f"signature by {signer} does not verify"
        return honest(self, message, public_key, signature, tag, signer)

    signing.RecordVerifier._check = check  # type: ignore[method-assign]


def _no_expiration_cap() -> None:
    """Believe any expiration a record is signed with."""
    signing.RecordLifetimes.cap = lambda self, key_id_bytes: math.inf  # type: ignore[method-assign]


def _no_seal() -> None:
    """Store payloads as plain JSON, readable by anyone who asks the DHT."""
    sealing.PayloadSeal.__init__ = lambda self, secret: setattr(self, "_master", None)  # type: ignore[method-assign]


def _old_subkeys() -> None:
    """Any subkey ending in ``:<peer id>`` (or a peer id) is that peer's, and payloads may take 64 KiB."""
    signing.subkey_owner = lambda subkey: (
        subkey.rsplit(":", 1)[-1] if signing._PEER_ID.fullmatch(subkey.rsplit(":", 1)[-1]) else None)
    signing.MAX_PAYLOAD = 64 * 1024


def _latest_expert_claim() -> None:
    """Route each uid to whichever host's record of it expires last (what the DHT kept when a uid was a subkey)."""
    def latest(claims: dict[str, list[Any]], previous: dict[str, Any], now: float) -> Any:
        return {uid: max(offers, key=lambda seen: seen.expires_at) for uid, offers in claims.items()}, {}

    directory.bind = latest  # type: ignore[attr-defined]


def _no_registration_checks() -> None:
    """Believe every registration time, and wait for the earliest registrant's decision, whatever it takes."""
    matchmaking.CLOCK_SPREAD = math.inf
    matchmaking.MAX_FALLBACKS = 0
    matchmaking.Matchmaker._skipping = lambda self, peer: False  # type: ignore[method-assign]


def _any_decision() -> None:
    """Take the earliest registered leader's groups, whatever they are (their shape is checked by pydantic)."""
    matchmaking.decision_problem = lambda *args: None


def _copies_count() -> None:
    """Count every row as a member of its own, identical or not, reducing and checking a reducer's statement
    (no copies to declare, none to look for)."""
    aggregation.distinct = disputes.distinct = lambda rows: list(range(rows.shape[0]))  # type: ignore[attr-defined]
    verify_verdict.look_alike = lambda statement, index, samples: False  # type: ignore[attr-defined]


def _capped_mean_of_pairs() -> None:
    """Average a group of 2 with capped weights only, whatever each row's norm, reducing and checking a
    reducer's statement (which still carries the norms, unused)."""

    def capped_mean(rows: torch.Tensor, weights: list[float], out: torch.Tensor,
                    gram: torch.Tensor) -> aggregation.Combined:
        return replace(aggregation.weighted_mean(rows, weights, out), norms=gram.diagonal().clone())

    def capped_coefficients(squared_norms: torch.Tensor, weights: list[float]) -> torch.Tensor:
        return torch.tensor(weights, dtype=torch.float64) / sum(weights)

    aggregation.equalized_mean = capped_mean
    coefficients.equalized_coefficients = capped_coefficients  # type: ignore[attr-defined]


def _one_pool() -> None:
    """Every stream takes a member's slot before its handshake and holds it for the handshake's whole timeout."""
    StreamGuard.known = lambda self, peer: True  # type: ignore[method-assign]


def _believe_claims() -> None:
    """Believe every member's word about progress and state: the furthest step any member claims is where the
    swarm is, the state of the member furthest ahead is the one to load (nothing vouching for it, its pieces
    taken as they come), a failed load is tried again at the next micro-step, rounds expect every trainer in
    view, every claimed sample counts, and nobody is excluded."""

    def furthest_step(self: Evidence, view: SwarmProgress) -> int | None:
        steps = [p.step for peer, p in view.peers.items() if peer != self.me]
        return max(steps) if steps else None

    def furthest_claim(self: Evidence, view: SwarmProgress) -> Vouched | None:
        ahead = sorted((p for peer, p in view.peers.items() if peer != self.me and p.state is not None),
                       key=lambda p: -p.step)
        if not ahead or ahead[0].state is None:
            return None
        return Vouched(ahead[0].state.step, ahead[0].state.digest, (ahead[0].peer_id,))

    def every_sample(self: Evidence, view: SwarmProgress, step: int, own: int,
                     moved_on: bool = False) -> tuple[int, int]:
        others = [p.samples for peer, p in view.peers.items() if peer != self.me and p.step == step]
        return own + sum(others), len(others)

    Evidence.believed_step = furthest_step  # type: ignore[method-assign]
    Evidence.vouched = furthest_claim  # type: ignore[method-assign]
    Evidence.doubt = lambda self, view, step, digest, donor: None  # type: ignore[method-assign]
    Evidence.peers_near = lambda self, view, step: max(1, len(view.peers))  # type: ignore[method-assign]
    Evidence.counted_samples = every_sample  # type: ignore[method-assign]
    StateDownloader._verify = lambda self, *args: None  # type: ignore[method-assign]
    Distrust.accuse = lambda self, peer, reason: 0.0  # type: ignore[method-assign]
    joining.RETRY = 0.0


def _no_spread_check() -> None:
    """Take the rows' samples as far apart as they lie, whatever distances the coefficients follow from."""
    checks.spread_too_wide = lambda published, values, length: False  # type: ignore[attr-defined]


def _no_block_norms() -> None:
    """Take the rows' block norms as stated, however far apart they lie or little of the average they cover."""
    checks.rows_too_far = lambda *args: False  # type: ignore[attr-defined]
    checks.average_too_large = lambda *args: None  # type: ignore[attr-defined]


def _reveal_at_once() -> None:
    """Reveal this member's seed share of every span as soon as its checks begin, whatever that span's reducer
    has committed to (a reducer done first that drew another span's seed can tell that span's reducer, still
    averaging)."""

    async def reveal(self: RoundVerification, span: int) -> bytes:
        return self.own_shares[span]

    RoundVerification._reveal = reveal  # type: ignore[method-assign]


def _median_only() -> None:
    """Judge a DHT peer's late answers by its median answer time only, however late it is in a share of them."""
    PeerMedians.mean = lambda self, peer: None  # type: ignore[method-assign]


def _wait_for_everyone() -> None:
    """Wait for every member the round's timeout, and group it with everyone, however often it kept a round
    waiting before."""
    absences.Absences.watched = lambda self, members: set()  # type: ignore[method-assign]
    absences.Absences.apart = lambda self: []  # type: ignore[method-assign]


def _admit_anyone() -> None:
    """Let any node that talks to this peer's DHT node into its routing table, as hivemind does."""
    admission.Admission.admits = lambda self, peer_id: True  # type: ignore[method-assign]


def _any_request() -> None:
    """Answer DHT finds and stores about any number of keys, and whole dictionaries from anyone, as hivemind does."""
    stragglers.bound_requests = lambda protocol, admission: None


DEFENCES: dict[str, Callable[[], None]] = {
    "key-check": _any_key,
    "tag-first": _verify_first,
    "stream-pools": _one_pool,
    "expiration-cap": _no_expiration_cap,
    "sealing": _no_seal,
    "one-subkey": _old_subkeys,
    "expert-binding": _latest_expert_claim,
    "registration-checks": _no_registration_checks,
    "decision-checks": _any_decision,
    "identical-rows": _copies_count,
    "pair-norms": _capped_mean_of_pairs,
    "claims": _believe_claims,
    "spread-check": _no_spread_check,
    "block-norms": _no_block_norms,
    "reveal-order": _reveal_at_once,
    "absences": _wait_for_everyone,
    "dht-mean": _median_only,
    "dht-admission": _admit_anyone,
    "dht-request-keys": _any_request,
}


def switch_off(argv: list[str]) -> list[str]:
    """Applies the ``--undefended NAMES`` of ``argv``; returns ``argv`` without it."""
    if "--undefended" not in argv:
        raise SystemExit("tests.integration.undefended needs --undefended NAME[,NAME...]: " + ", ".join(DEFENCES))
    at = argv.index("--undefended")
    for name in argv[at + 1].split(","):
        DEFENCES[name]()
    return argv[:at] + argv[at + 2:]


if __name__ == "__main__":
    sys.argv = switch_off(sys.argv)
    main()
