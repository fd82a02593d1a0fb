"""Remote MoE pieces without a network: gating math, quorum waiting, records, server-side validation."""

from __future__ import annotations

import asyncio
import math
import struct
from typing import Any

import pytest
import torch

from peerd.config import ExpertsConfig, MoEConfig, TaskConfig
from peerd.errors import ConfigError, ProtocolViolation
from peerd.experts.calls import wire_codec
from peerd.experts.client.dispatch import gather_quorum
from peerd.experts.client.layer import RemoteMoE
from peerd.experts.client.router import load_balancing_loss, renormalize, route
from peerd.experts.records import ExpertHostRecord, ExpertReader, SeenExpert, bind, parse_host_record
from peerd.experts.server.backend import BackwardItem, ExpertBackend
from peerd.experts.server.modules import build_expert
from peerd.proto import peerd_experts_pb2 as pb
from peerd.wire import codec
from tests.unit.expert_calls import run_calls

pytestmark = pytest.mark.timeout(60)

PEER = "12D3KooWENjauiKw6XaCcnEGVweaqxyu3PpadrVWp1hEAZQydvFL"
OTHER = "12D3KooWRtaQXj9DZCijkmMe1B81YDiREjvqc4BgNZ8639FNP12S"



# --- router -------------------------------------------------------------------------------------------------


def test_top_k_picks_the_highest_scoring_live_experts_best_first() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0], [5.0, 1.0, 4.0, 0.5], [0.0, 0.0, 9.0, 1.0]])
    alive = torch.tensor([True, True, True, True])
    routing = route(logits, alive, k=2)
    assert routing.indices.tolist() == [[1, 2], [0, 2], [2, 3]]
    assert torch.allclose(routing.probs, torch.softmax(logits, -1))
    assert torch.allclose(routing.gates, routing.probs.gather(1, routing.indices))


def test_dead_experts_are_never_chosen_and_get_zero_probability() -> None:
    logits = torch.tensor([[0.1, 3.0, 2.0, -1.0], [500.0, -500.0, 4.0, 0.5]])
    alive = torch.tensor([False, True, False, True])
    routing = route(logits, alive, k=3)  # k is capped at the 2 live experts
    assert routing.indices.shape == (2, 2)
    assert set(routing.indices.flatten().tolist()) <= {1, 3}
    # expert 1 of token 1 has a probability that underflows to 0, yet it still ranks above the dead ones
    assert sorted(routing.indices[1].tolist()) == [1, 3]
    assert routing.probs[:, [0, 2]].abs().sum() == 0
    with pytest.raises(ValueError):
        route(logits, torch.zeros(4, dtype=torch.bool), k=1)


def test_gate_weights_sum_to_one_over_the_experts_that_answered() -> None:
    gates = torch.tensor([[0.5, 0.3, 0.1], [0.4, 0.4, 0.2], [0.6, 0.2, 0.1]], requires_grad=True)
    answered = torch.tensor([[True, False, True], [True, True, True], [False, False, False]])
    weights = renormalize(gates, answered)
    assert torch.allclose(weights[0], torch.tensor([0.5 / 0.6, 0.0, 0.1 / 0.6]))
    assert torch.allclose(weights[:2].sum(-1), torch.ones(2))
    assert weights[2].abs().sum() == 0  # nobody answered: zero output, the residual passes the token through
    weights.sum().backward()  # differentiable, no NaN from the empty row
    assert torch.isfinite(gates.grad).all()


def test_aux_loss_matches_its_definition_on_a_hand_computed_example() -> None:
    # 2 tokens, 3 experts, k = 1. Token 0 -> expert 0, token 1 -> expert 0: f = [1, 0, 0].
    probs = torch.tensor([[0.7, 0.2, 0.1], [0.5, 0.3, 0.2]])
    indices = torch.tensor([[0], [0]])
    # P = [0.6, 0.25, 0.15]; aux = 3 * (1 * 0.6) = 1.8
    assert load_balancing_loss(probs, indices, num_alive=3).item() == pytest.approx(1.8)
    # k = 2: token 0 -> {0, 1}, token 1 -> {0, 2}: f = [2, 1, 1] / 4; aux = 3 * (0.5*0.6 + 0.25*0.25 + 0.25*0.15)
    indices = torch.tensor([[0, 1], [0, 2]])
    assert load_balancing_loss(probs, indices, num_alive=3).item() == pytest.approx(
        3 * (0.3 + 0.0625 + 0.0375)
    )
    # perfectly uniform routing gives exactly 1
    uniform = torch.full((4, 4), 0.25)
    assert load_balancing_loss(uniform, torch.tensor([[0], [1], [2], [3]]), 4).item() == pytest.approx(1.0)


def test_aux_loss_gradient_pushes_probability_away_from_the_overloaded_expert() -> None:
    logits = torch.tensor([[2.0, 0.0, 0.0], [2.0, 0.0, 0.0]], requires_grad=True)
    routing = route(logits, torch.ones(3, dtype=torch.bool), k=1)
    load_balancing_loss(routing.probs, routing.indices, 3).backward()
    assert logits.grad is not None and (logits.grad[:, 0] > 0).all()  # descent lowers expert 0's score


# --- quorum ---------------------------------------------------------------------------------------------------


async def _answer(value: int, gate: asyncio.Event | None = None) -> int:
    if gate is not None:
        await gate.wait()
    return value


async def _fail() -> int:
    raise ConnectionError("host gone")


def test_quorum_proceeds_after_k_min_and_grace_without_waiting_for_a_hung_expert() -> None:
    async def body() -> tuple[dict[int, int], float]:
        never = asyncio.Event()
        tokens = [torch.tensor([0, 1]), torch.tensor([0, 1]), torch.tensor([1])]
        need = torch.tensor([1, 1])
        started = asyncio.get_running_loop().time()
        results = await gather_quorum(
            [_answer(10), _answer(11, never), _fail()], tokens, need, timeout=30.0, grace=0.05
        )
        return results, asyncio.get_running_loop().time() - started

    results, elapsed = asyncio.run(body())
    assert results == {0: 10}
    assert elapsed < 5.0  # far below the 30 s timeout: the hung expert was abandoned after the grace period


def test_quorum_waits_until_timeout_when_a_token_has_no_answer_yet() -> None:
    async def body() -> tuple[dict[int, int], float]:
        gate = asyncio.Event()
        tokens = [torch.tensor([0]), torch.tensor([1])]
        asyncio.get_running_loop().call_later(0.2, gate.set)
        started = asyncio.get_running_loop().time()
        results = await gather_quorum(
            [_answer(1), _answer(2, gate)], tokens, torch.tensor([1, 1]), timeout=10.0, grace=0.0
        )
        return results, asyncio.get_running_loop().time() - started

    results, elapsed = asyncio.run(body())
    assert results == {0: 1, 1: 2}  # token 1's only expert answered late but within the timeout
    assert elapsed < 5.0


def test_quorum_gives_up_at_the_timeout() -> None:
    async def body() -> dict[int, int]:
        never = asyncio.Event()
        return await gather_quorum(
            [_answer(1, never)], [torch.tensor([0])], torch.tensor([1]), timeout=0.2, grace=0.0
        )

    assert asyncio.run(body()) == {}


# --- records and config ---------------------------------------------------------------------------------------


def record(**changes: Any) -> dict[str, Any]:
    value = ExpertHostRecord(
        peer_id=PEER,
        maddrs=[],
        protocol_version=1,
        hidden_dim=64,
        module="ffn",
        uids=["ffn.1.0", "ffn.1.1"],
        updates=[3, 4],
        started_at=10.0,
        updated_at=12.0,
    ).to_wire()
    value.update(changes)
    return value


def test_expert_records_are_validated_strictly_and_unknown_fields_ignored() -> None:
    assert parse_host_record(PEER, record(future_field={"x": 1})).hidden_dim == 64
    for bad in (
        record(hidden_dim="64"),
        record(peer_id="nope"),
        record(updates=[3, -1]),
        record(updates=[3]),
        record(uids=["ffn.1.0", "ffn.1.0"], updates=[1, 2]),
        record(uids=["bad uid!"], updates=[1]),
        record(updated_at=float("nan")),
        record(updated_at=1.0),
    ):
        with pytest.raises(ProtocolViolation):
            parse_host_record(PEER, bad)
    with pytest.raises(ProtocolViolation, match="another subkey"):
        parse_host_record(OTHER, record())
    claims = ExpertReader().parse({PEER: (record(), 99.0), OTHER: ("garbage", 99.0)})
    assert sorted(claims) == ["ffn.1.0", "ffn.1.1"] and claims["ffn.1.1"][0].record.updates == 4
    assert claims["ffn.1.0"][0].expires_at == 99.0


def _claims(*hosts: tuple[str, float]) -> dict[str, list[SeenExpert]]:
    return ExpertReader().parse({host: (record(peer_id=host), expires) for host, expires in hosts})


def test_a_uid_stays_with_the_host_it_is_bound_to() -> None:
    """Another member announcing the same uids (later, with a later expiration) reroutes nobody; a uid two hosts
    claim when first seen goes to neither; once the bound host's record expired, the uid is free again."""
    routes, contested = bind(_claims((PEER, 50.0)), {}, now=10.0)
    assert {uid: seen.record.peer_id for uid, seen in routes.items()} == {"ffn.1.0": PEER, "ffn.1.1": PEER}
    assert not contested
    routes, contested = bind(_claims((PEER, 60.0), (OTHER, 1e9)), routes, now=20.0)
    assert {seen.record.peer_id for seen in routes.values()} == {PEER} and routes["ffn.1.0"].expires_at == 60.0
    routes, _ = bind(_claims((OTHER, 1e9)), routes, now=30.0)  # a read that missed the bound host's record
    assert {seen.record.peer_id for seen in routes.values()} == {PEER}
    routes, _ = bind(_claims((OTHER, 1e9)), routes, now=61.0)  # its record expired: the uid is free
    assert {seen.record.peer_id for seen in routes.values()} == {OTHER}
    routes, contested = bind(_claims((PEER, 50.0), (OTHER, 50.0)), {}, now=10.0)
    assert routes == {} and contested == {"ffn.1.0": sorted([PEER, OTHER]), "ffn.1.1": sorted([PEER, OTHER])}


def test_experts_config_uids_and_checks() -> None:
    assert ExpertsConfig(uid_prefix="ffn.2.", count=2, first_index=4).served_uids == ["ffn.2.4", "ffn.2.5"]
    assert ExpertsConfig(uids=["a.0", "b.3"]).served_uids == ["a.0", "b.3"]
    with pytest.raises(ValueError, match="record_ttl"):
        ExpertsConfig(announce_period=10, record_ttl=5)
    with pytest.raises(ValueError, match="twice"):
        ExpertsConfig(uids=["a.0", "a.0"])
    with pytest.raises(ValueError, match="shorter uids"):
        ExpertsConfig(uids=[f"{'x' * 100}.{i}" for i in range(200)])
    assert len(ExpertsConfig(count=1024).served_uids) == 1024
    assert ExpertsConfig(max_request_tokens=32768, max_queued_tokens=65536).queued_tokens_per_caller == 32768
    with pytest.raises(ValueError, match="max_queued_tokens_per_caller"):
        ExpertsConfig(max_queued_tokens_per_caller=100)  # below one call's max_request_tokens
    with pytest.raises(ValueError, match="k_min"):
        MoEConfig(k=1, k_min=2)
    assert MoEConfig(num_experts=2, uid_prefix="ffn.{layer}.").uids_for(3) == ["ffn.3.0", "ffn.3.1"]


def test_moe_lm_has_only_router_parameters_in_its_moe_blocks() -> None:
    from peerd.tasks import build_task

    options = {
        "seq_len": 16,
        "batch_size": 2,
        "d_model": 16,
        "n_heads": 2,
        "d_ff": 32,
        "max_files": 40,
        "val_files": 4,
        "moe": {"layers": [-1], "num_experts": 4},
    }
    task = build_task(TaskConfig(name="lm", options=options), 0)
    moe = [m for m in task.model.modules() if isinstance(m, RemoteMoE)]
    assert len(moe) == 1 and moe[0].uids == ["ffn.1.0", "ffn.1.1", "ffn.1.2", "ffn.1.3"]
    assert [name for name, _ in moe[0].named_parameters()] == ["router.proj.weight"]
    dense = build_task(TaskConfig(name="lm", options={k: v for k, v in options.items() if k != "moe"}), 0)
    assert dense.fingerprint != task.fingerprint
    with pytest.raises(ConfigError, match="moe"):
        build_task(TaskConfig(name="lm", options={**options, "moe": {"layers": [5]}}), 0)


def test_custom_expert_modules_are_checked() -> None:
    config = ExpertsConfig(module="torch.nn:Identity", hidden_dim=8)
    with pytest.raises(ConfigError, match="trainable parameters"):
        build_expert(config, "x.0")
    with pytest.raises(ConfigError, match="no class"):
        build_expert(ExpertsConfig(module="torch.nn:NoSuchThing", hidden_dim=8), "x.0")
    a, b = (build_expert(ExpertsConfig(hidden_dim=8, ffn_dim=16), "x.0") for _ in range(2))
    assert all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters()))  # seeded by uid


# --- server-side validation and batching ------------------------------------------------------------------------


def _payload(tensor: torch.Tensor) -> bytes:
    return bytes(codec.encode(tensor, wire_codec(lossless=True)))


def _nan_payload(shape: tuple[int, int]) -> bytes:
    data = bytearray(codec.encode(torch.zeros(shape), wire_codec(lossless=True)))
    struct.pack_into("<f", data, len(data) - 4, math.nan)  # codecs never encode NaN; forge one
    return bytes(data)


def test_bad_payloads_are_refused_and_never_touch_the_parameters() -> None:
    config = ExpertsConfig(hidden_dim=8, ffn_dim=16, lr=0.1)
    backend = ExpertBackend("x.0", build_expert(config, "x.0"), config)
    before = [p.detach().clone() for p in backend.params]
    good = torch.randn(3, 8)
    results = run_calls(
        [
            ("forward", 3, [_nan_payload((3, 8))]),
            ("forward", 3, [_payload(torch.randn(2, 8))]),  # shape differs from the header's 3 tokens
            ("forward", 3, [b"garbage"]),
            ("backward", 3, [_payload(good), _nan_payload((3, 8))]),
            ("forward", 3, [_payload(good)]),  # a valid call in the same batch is served normally
        ],
        backend,
    )
    codes = [r.code for r in results]
    assert codes == [pb.EXPERT_BAD_PAYLOAD] * 4 + [pb.EXPERT_OK]
    assert "NaN" in results[0].message and "shape" in results[1].message
    assert backend.updates == 0
    assert all(torch.equal(p, q) for p, q in zip(backend.params, before))
    assert backend.stats["forward"].errors == 3 and backend.stats["backward"].errors == 1


def test_concurrent_calls_to_one_expert_are_computed_as_one_batch_and_learn() -> None:
    config = ExpertsConfig(hidden_dim=8, ffn_dim=16, lr=0.1)
    backend = ExpertBackend("x.0", build_expert(config, "x.0"), config)
    inputs = [torch.randn(n, 8) for n in (1, 2, 3)]
    expected = backend.module(torch.cat(inputs)).detach()
    # submitted in one go with a batch_wait: deterministic grouping (in a server, calls arriving while the
    # expert computes are grouped the same way)
    results = run_calls([("forward", x.shape[0], [_payload(x)]) for x in inputs], backend, wait=0.01)
    assert all(r.code == pb.EXPERT_OK for r in results)
    outputs = torch.cat([codec.decode(r.payload, peer_id="host") for r in results])
    assert torch.allclose(outputs, expected, atol=1e-6)
    assert backend.batches["forward"] == 1 and results[0].batch_tokens == 6  # one batch of all 6 tokens
    grads = run_calls(
        [("backward", x.shape[0], [_payload(x), _payload(torch.ones_like(x))]) for x in inputs],
        backend,
        wait=0.01,
    )
    assert all(r.code == pb.EXPERT_OK for r in grads) and backend.updates == 1
    assert backend.status()["distance_from_init"] > 0


def test_optimizer_steps_run_after_the_answer_and_never_pile_up() -> None:
    config = ExpertsConfig(hidden_dim=8, ffn_dim=16, lr=0.1)
    backend = ExpertBackend("x.0", build_expert(config, "x.0"), config)
    steps: list[Any] = []
    answers: list[torch.Tensor] = []
    x = torch.randn(4, 8)
    for _ in range(4):
        item = BackwardItem(x, torch.ones_like(x))
        backend.backward([item], answers.extend, steps.append)  # steps queued, never run
    assert len(answers) == 4 and all(a.shape == x.shape for a in answers)
    assert backend.updates == 2  # with 2 steps owed, each further backward first applied the oldest one
    for step in steps:
        step()
    assert backend.updates == 4 and backend.status()["pending_steps"] == 0
