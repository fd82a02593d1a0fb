"""Aggregation rules (peerd/averaging/aggregation.py) and a reducer combining robustly (robust.py), no network."""

from __future__ import annotations

import asyncio
import itertools

import pytest
import torch

from peerd.averaging.aggregation import cap_weights, centered_clip, combine, trimmed_mean
from peerd.averaging.group import Group
from peerd.averaging.reducer import SpanReducer
from peerd.config import AveragingConfig, CodecConfig
from peerd.wire import codec
from peerd.wire.topk import choose_k
from tests.identities import signers
from tests.unit.reducers import make_reducer

pytestmark = pytest.mark.timeout(30)

CODEC = CodecConfig(min_compress_numel=0)
ME, A, B, BAD = (signer.peer_id for signer in signers(4))


def honest_rows(n: int, numel: int, spread: float, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    g = torch.randn(numel, generator=generator)
    return g + spread * torch.randn(n, numel, generator=generator)


def test_claims_are_capped_at_a_multiple_of_the_lower_median() -> None:
    assert cap_weights([32, 32, 32, 320], 2.0) == [32, 32, 32, 64]
    assert cap_weights([32, 48, 16, 40], 2.0) == [32, 48, 16, 40]  # within 2x of the median 32: untouched
    # two members have no majority: the smaller claim sets the cap, so a 10x claim gets 2x
    assert cap_weights([10.0, 1.0], 2.0) == [2.0, 1.0]


def test_centered_clip_without_outliers_is_the_weighted_mean() -> None:
    rows = honest_rows(4, 4096, 0.5)
    weights = [1.0, 2.0, 1.0, 1.5]
    expected = (torch.tensor(weights)[:, None] * rows).sum(0) / sum(weights)
    out = torch.empty(4096)
    result = centered_clip(rows.clone(), weights, out, radius=AveragingConfig().clip_radius, iterations=3)
    assert result.kept == [1.0] * 4
    assert torch.allclose(out, expected, atol=1e-5)


def test_centered_clip_bounds_a_flipped_and_scaled_member() -> None:
    rows = honest_rows(4, 4096, 0.5)
    honest = rows[:3].mean(0)
    rows[3] *= -1000.0
    out = torch.empty(4096)
    result = combine("centered_clip", rows, [32.0, 32.0, 32.0, 320.0], out, 2.0, 0.75, 3)
    assert result.weights == [32.0, 32.0, 32.0, 64.0]
    assert result.kept[3] < 1e-3 and min(result.kept[:3]) > 0.5
    # the honest members' own spread around their mean is about 0.5 * sqrt(4096 * 2 / 3) = 26
    assert float((out - honest).norm()) < 0.5 * float(honest.norm())


@pytest.mark.parametrize("attack", ["scaled", "one element off every support", "spread over the others' zeros"])
def test_top_k_rows_cannot_dodge_the_clip_by_where_they_put_their_mass(attack: str) -> None:
    """A reducer clips the dense rows it decodes from top-k payloads: how an attacker places the few elements it
    sends (on the honest members' positions, off all of them, concentrated or spread) changes its L2 distance
    from the others, which is what is clipped, not how far it gets."""
    sparse = CodecConfig(min_compress_numel=0, scheme="topk", density=0.05, value_bits=2)

    def sent(row: torch.Tensor) -> torch.Tensor:
        return codec.decode(bytes(codec.encode(row, sparse)), peer_id=ME, expected_shape=tuple(row.shape))

    true = honest_rows(4, 8192, 0.5)
    rows = torch.stack([sent(true[i]) for i in range(3)] + [torch.zeros(8192)])
    honest = rows[:3].mean(0)
    size = 1000.0 * float(honest.norm())
    unused = (rows[:3] == 0).all(0).nonzero().view(-1)
    if attack == "scaled":
        rows[3] = sent(-1000.0 * true[3])
    elif attack == "one element off every support":
        rows[3, unused[0]] = size
    else:
        rows[3, unused[: choose_k(8192, 0.05)]] = size / choose_k(8192, 0.05) ** 0.5
    assert float(rows[3].norm()) > 100 * float(honest.norm())
    out, plain = torch.empty(8192), torch.empty(8192)
    result = combine("centered_clip", rows.clone(), [1.0] * 4, out, 2.0, 0.75, 3)
    combine("mean", rows.clone(), [1.0] * 4, plain, 2.0, 0.75, 3)
    assert result.kept[3] < 0.01 and min(result.kept[:3]) > 0.5, result.kept
    assert float((out - honest).norm()) < 0.5 * float(honest.norm())
    assert float((plain - honest).norm()) > 50 * float(honest.norm())  # what the clip prevents


def test_a_majority_in_exact_agreement_is_the_answer() -> None:
    value = torch.randn(2048)
    rows = torch.stack([value, value, value, 1e6 * torch.randn(2048)])
    out = torch.empty(2048)
    result = centered_clip(rows, [1.0] * 4, out, radius=AveragingConfig().clip_radius, iterations=3)
    assert torch.equal(out, value)
    assert result.kept == [1.0, 1.0, 1.0, 0.0]


def test_trimmed_mean_drops_the_extremes_of_each_coordinate() -> None:
    rows = torch.tensor([[1.0, 10.0], [2.0, 20.0], [3.0, -1e9], [1e9, 30.0]])
    out = torch.empty(2)
    result = trimmed_mean(rows, [1.0] * 4, out)
    assert out.tolist() == [2.5, 15.0]
    assert result.kept == [0.5, 1.0, 0.5, 0.0]


@pytest.mark.parametrize("rule", ["centered_clip", "trimmed_mean"])
def test_two_members_give_neither_side_the_last_word(rule: str) -> None:
    """No majority: each row is scaled down to the smaller norm, then the mean of the capped weights. A member
    sending -1000x its gradient (and claiming 10x the samples) cancels its partner's step at worst."""
    out = torch.empty(2)
    result = combine(rule, torch.tensor([[3.0, 4.0], [-3000.0, -4000.0]]), [1.0, 10.0], out, 2.0, 2.0, 3)
    assert result.weights == [1.0, 2.0] and result.kept == pytest.approx([1.0, 1e-3])
    assert torch.allclose(out, torch.tensor([-1.0, -4.0 / 3.0]))  # (x + 2 * -x) / 3: |x| at most, whatever it sent
    combine(rule, torch.tensor([[3.0, 4.0], [6.0, 8.0]]), [1.0, 1.0], out, 1.0, 2.0, 3)
    assert torch.allclose(out, torch.tensor([3.0, 4.0]))
    # an honest pair of close rows is hardly touched
    honest = honest_rows(2, 4096, 0.5, seed=5)
    out = torch.empty(4096)
    combine(rule, honest.clone(), [1.0, 1.0], out, 1.0, 2.0, 3)
    assert torch.linalg.vector_norm(out - honest.mean(0)) < 0.1 * torch.linalg.vector_norm(honest.mean(0))


@pytest.mark.parametrize("rule", ["centered_clip", "trimmed_mean"])
@pytest.mark.parametrize("copies", [2, 3])
def test_identical_rows_count_as_one_member(rule: str, copies: int) -> None:
    """Two honest members and sybils sending the same row, ranked first (a sybil picks its peer id): 2 copies
    of 4 make CenteredClip's radius 0 and their row the result, 3 of 5 are a majority; as one member among
    three distinct rows it is clipped like any outlier, and its copies are left out."""
    honest = honest_rows(2, 4096, 0.5, seed=7)
    sybil = 1000.0 * torch.ones(4096)
    rows = torch.cat([sybil.expand(copies, 4096), honest])
    out = torch.empty(4096)
    result = combine(rule, rows.clone(), [1.0] * (2 + copies), out, 1.0, AveragingConfig().clip_radius, 3)
    assert torch.linalg.vector_norm(out - honest.mean(0)) < 0.01 * torch.linalg.vector_norm(sybil), rule
    assert result.kept[1:copies] == [0.0] * (copies - 1) and result.weights[1:copies] == [0.0] * (copies - 1)
    # what the copies did when each counted: the sybils' row, or most of the way to it
    counted = torch.empty(4096)
    (centered_clip if rule == "centered_clip" else trimmed_mean)(rows.clone(), [1.0] * (2 + copies), counted,
                                                                   *((AveragingConfig().clip_radius, 3)
                                                                     if rule == "centered_clip" else ()))
    assert torch.linalg.vector_norm(counted - honest.mean(0)) > 0.3 * torch.linalg.vector_norm(sybil), rule


def robust_reducer(own: torch.Tensor, out: torch.Tensor) -> SpanReducer:
    config = AveragingConfig(chunk_numel=1024, codec=CODEC)
    return make_reducer(Group("round", (ME, A, B, BAD)), own, 32.0, config, CODEC, out)


def test_the_reducer_clips_the_attacker_and_says_so_whatever_the_arrival_order() -> None:
    rows = honest_rows(4, 1024, 0.5, seed=3)
    payloads = {A: bytes(codec.encode(rows[1], CODEC)), B: bytes(codec.encode(rows[2], CODEC)),
                BAD: bytes(codec.encode(-1000.0 * rows[3], CODEC))}
    claims = {A: 32.0, B: 32.0, BAD: 320.0}

    async def combined(order: tuple[str, ...]) -> tuple[bytes, torch.Tensor, SpanReducer]:
        out = torch.empty(1024)
        reducer = robust_reducer(rows[0].clone(), out)
        for sender in order:
            reducer.robust.claims[sender] = claims[sender]  # type: ignore[union-attr]
            reducer.add(payloads[sender], sender, claims[sender], 0, torch.empty(1024))
        payload = bytes(reducer._average_chunk(0))
        reducer.close()
        return payload, out, reducer

    async def body() -> None:
        results = [await combined(order) for order in itertools.permutations([A, B, BAD])]
        assert len({payload for payload, _, _ in results}) == 1  # bit-identical, arrival order does not matter
        _, out, reducer = results[0]
        honest = rows[:3].mean(0)
        assert float((out - honest).norm()) < 0.5 * float(honest.norm())
        note = reducer.clipped[BAD]
        # the honest members may lose a little of their deviation too (the center leans towards the attacker
        # by at most tau times its capped share), never most of it
        assert all(reducer.clipped[m].kept > 0.5 for m in (ME, A, B) if m in reducer.clipped)
        # averaging.max_weight_ratio 1: nobody outweighs the median claim
        assert note.kept < 1e-3 and note.weight == 32.0 and note.claimed_weight == 320.0 and note.chunks == 1
        assert reducer.weights[0] == 32.0 * 4

    asyncio.run(body())


@pytest.mark.parametrize("rule", ["centered_clip", "trimmed_mean"])
def test_agreeing_members_outvote_one_liar_in_state_averaging(rule: str) -> None:
    """Three honest members hold one state bit for bit and a fourth sends its negation: as copies they would
    count once, a pair with the liar that cancels to zero; as members that agree, their state is the result."""
    state = honest_rows(1, 4096, 0.5, seed=11)[0]
    rows = torch.stack([state, state, state, -state])
    agreed, collapsed = torch.empty(4096), torch.empty(4096)
    combine(rule, rows.clone(), [1.0] * 4, agreed, 1.0, AveragingConfig().clip_radius, 3, agreeing=True)
    assert torch.equal(agreed, state), rule
    combine(rule, rows.clone(), [1.0] * 4, collapsed, 1.0, AveragingConfig().clip_radius, 3)
    assert torch.linalg.vector_norm(collapsed) < 0.01 * torch.linalg.vector_norm(state), rule


def test_an_outlier_in_the_first_row_costs_the_others_no_precision() -> None:
    """Distances are taken from a base row among the majority: from a -1000x first row, float32 would lose the
    honest rows' distances to each other and CenteredClip would clip them at random."""
    generator = torch.Generator().manual_seed(3)
    common = torch.randn(4096, generator=generator)
    honest = common + 0.7 * torch.randn(3, 4096, generator=generator)
    honest *= honest.abs() > honest.abs().quantile(0.75)  # sparse, as top-k rows are
    rows = torch.cat([-1000 * honest[:1], honest])
    exact = torch.empty(4096, dtype=torch.float64)
    centered_clip(rows.double(), [1.0] * 4, exact, 1.0, 20)
    got = torch.empty(4096)
    centered_clip(rows.clone(), [1.0] * 4, got, 1.0, 20)
    assert float((got.double() - exact).norm() / exact.norm()) < 1e-6
