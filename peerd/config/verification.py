"""The verification of reductions: how long a step waits and how long a liar stays excluded."""

from __future__ import annotations

from pydantic import Field

from peerd.config.base import Section


class VerificationConfig(Section):
    """Every member checks every average it gets against what the members sent (docs/security.md)."""

    timeout: float = Field(
        default=10.0, gt=0,
        description="Seconds each step of a round's verification (statements, seed shares, samples, a "
        "challenge's rows) waits for a member; a member that misses one is left out of the round's checks, "
        "and what cannot be checked is not applied.",
    )
    ban_seconds: float = Field(
        default=86400.0, gt=0,
        description="How long a peer proven to have lied (a wrong average, misstated samples, two different "
        "averages of one chunk: evidence every member checks itself) stays out of every group and stream.",
    )
    suspect_seconds: float = Field(
        default=600.0, gt=0,
        description="How long a peer stays out after a fault only this peer saw and cannot prove to others (a "
        "reducer that did not answer a challenge, or sent an average its own signature does not cover).",
    )
    audit_probability: float = Field(
        default=0.02, ge=0.0, le=1.0,
        description="Chance that a member asks a reducer for the rows of a chunk whose checks passed, and "
        "recomputes it exactly: a reducer and a member who lie together (the member misstating its row so that "
        "a wrong average looks right) are caught within ~1/this rounds. Costs one chunk's rows (~2 MB at 4 "
        "members) when it happens.",
    )
    max_bans: int = Field(default=1024, ge=16, description="Bans kept at most; the oldest go first.")
    check_narrow_codes: bool = Field(
        default=True,
        description="With `averaging.codec.scheme` topk, blockwise4 or blockwise2, reducers return averages "
        "members can check: the k largest elements of an average of top-k rows at 8 bits (each member carries "
        "what that leaves out of its own row), or 8-bit blocks, without the reducer's own residual. That return leg costs more "
        "bytes than the narrow code (docs/benchmarks.md). Off: averages return in the narrow code with the "
        "reducer's residual and are applied unchecked, so a lying reducer is not caught. Must match across the "
        "swarm: a peer that checks refuses (without accusing anyone) averages it cannot check.",
    )
