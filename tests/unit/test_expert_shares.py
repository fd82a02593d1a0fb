"""What one caller can take of a served expert: its share of the queue, of each batch and of each update
(peerd/experts/server/batching.py, peerd/experts/bounds.py)."""

from __future__ import annotations

import asyncio

import pytest
import torch

from peerd.config import ExpertsConfig
from peerd.experts.bounds import NormBound
from peerd.experts.calls import CallResult, wire_codec
from peerd.experts.server.backend import ExpertBackend
from peerd.experts.server.batching import BatchQueue, PendingCall
from peerd.experts.server.modules import build_expert
from peerd.experts.server.workers import Workers
from peerd.proto import peerd_experts_pb2 as pb
from peerd.wire import codec

pytestmark = pytest.mark.timeout(60)

HIDDEN = 8


def _backend() -> ExpertBackend:
    config = ExpertsConfig(hidden_dim=HIDDEN, ffn_dim=16, lr=0.05, optimizer="sgd", max_grad_norm=None)
    return ExpertBackend("x.0", build_expert(config, "x.0"), config)


def _payload(tensor: torch.Tensor) -> bytes:
    return bytes(codec.encode(tensor, wire_codec(lossless=True)))


def test_a_caller_with_many_calls_waiting_takes_no_more_of_a_batch_than_a_caller_with_one() -> None:
    async def body() -> list[list[str]]:
        loop = asyncio.get_running_loop()
        workers = Workers(1)
        # a long batch_wait: nothing runs before the batches are taken below
        queue = BatchQueue(_backend(), "forward", workers, loop, 4, 64, 60.0)
        futures = []
        for peer in ["flood"] * 6 + ["other"]:
            futures.append(loop.create_future())
            assert queue.submit(PendingCall(peer, 2, [b""], True, futures[-1], 0.0))
        batches = [[call.peer for call in queue._take()] for _ in range(4)]
        queue.close("done")
        await asyncio.to_thread(workers.shutdown)
        return batches

    batches = asyncio.run(body())
    # 4 tokens a batch, 2 a call: the other caller's call goes in the first batch, not after all six floods
    assert batches == [["flood", "other"], ["flood", "flood"], ["flood", "flood"], ["flood"]]


def test_one_caller_cannot_fill_an_experts_queue() -> None:
    async def body() -> tuple[list[bool], bool]:
        loop = asyncio.get_running_loop()
        workers = Workers(1)
        queue = BatchQueue(_backend(), "forward", workers, loop, 4, 64, 60.0, max_queued_per_caller=16)
        admitted = [queue.submit(PendingCall("flood", 4, [b""], True, loop.create_future(), 0.0)) for _ in range(6)]
        other = queue.submit(PendingCall("other", 4, [b""], True, loop.create_future(), 0.0))
        queue.close("done")
        await asyncio.to_thread(workers.shutdown)
        return admitted, other

    admitted, other = asyncio.run(body())
    assert admitted == [True] * 4 + [False] * 2  # 16 tokens of its own waiting, then refused
    assert other  # while the queue (64 tokens) still takes other callers' calls


def test_the_typical_callers_gradient_is_set_by_a_median_a_liar_has_one_vote_in() -> None:
    bound = NormBound(4.0)
    honest = [torch.full((4, HIDDEN), 0.1 * (1 + i)) for i in range(3)]
    for _ in range(3):
        for i, grad in enumerate(honest):
            assert bound.bound(f"honest-{i}", grad) is grad  # within 4x of each other: never scaled
    for _ in range(50):  # many calls, a thousand times larger: still one caller's median
        scaled = bound.bound("liar", torch.full((4, HIDDEN), 1000.0))
        per_token = float(torch.linalg.vector_norm(scaled)) / 2
        reference = bound.reference()
        assert reference is not None and per_token == pytest.approx(4.0 * reference, rel=1e-4)
    assert bound.reference() == pytest.approx(0.2 * HIDDEN**0.5, rel=1e-4)  # the middle honest caller's
    assert bound.scaled == 50


def test_with_two_callers_the_smaller_sets_the_bound_and_zero_gradients_never_do() -> None:
    bound = NormBound(4.0)
    bound.bound("quiet", torch.zeros(4, HIDDEN))
    assert bound.reference() is None  # a zero gradient teaches nothing and sets nothing
    bound.bound("honest", torch.ones(4, HIDDEN))
    loud = bound.bound("loud", torch.full((4, HIDDEN), 100.0))
    assert torch.allclose(loud, torch.full((4, HIDDEN), 4.0))
    assert NormBound(None).bound("loud", torch.full((4, HIDDEN), 100.0)).max() == 100.0


def _update(liar_scale: float, bounded: bool) -> torch.Tensor:
    """How one backward batch of 3 honest callers and one liar (output gradients ``liar_scale`` times theirs,
    pointing the other way) moves the expert's parameters."""
    torch.manual_seed(0)
    backend = _backend()
    before = torch.cat([p.detach().reshape(-1).clone() for p in backend.params])
    inputs = [torch.randn(4, HIDDEN) for _ in range(4)]
    grads = [torch.randn(4, HIDDEN) * 0.1 for _ in range(3)]
    grads.append(-liar_scale * grads[0])

    async def body() -> list[CallResult]:
        loop = asyncio.get_running_loop()
        workers = Workers(1)
        gradients = NormBound(4.0) if bounded else None
        queue = BatchQueue(backend, "backward", workers, loop, 64, 256, 0.05, gradients=gradients)
        try:
            if gradients is not None:  # the callers' earlier calls, as the bound has seen them
                for i, grad in enumerate(grads):
                    gradients.bound(f"peer-{i}", grad)
            futures = []
            for i, (x, g) in enumerate(zip(inputs, grads, strict=True)):
                futures.append(loop.create_future())
                assert queue.submit(PendingCall(f"peer-{i}", 4, [_payload(x), _payload(g)], True, futures[-1], 0.0))
            return list(await asyncio.gather(*futures))
        finally:
            await asyncio.to_thread(workers.shutdown)

    results = asyncio.run(body())
    assert all(r.code == pb.EXPERT_OK for r in results) and backend.updates == 1
    return torch.cat([p.detach().reshape(-1) for p in backend.params]) - before


def test_a_liar_with_huge_gradients_steers_an_expert_alone_only_without_the_bound() -> None:
    honest = _update(0.0, bounded=False)  # the liar sends zeros: the honest callers' update
    cos = torch.nn.functional.cosine_similarity
    unbounded, bounded = _update(1000.0, bounded=False), _update(1000.0, bounded=True)
    assert float(cos(unbounded, honest, dim=0)) < -0.5  # the liar's direction: the honest update reversed
    assert float(unbounded.norm()) > 50 * float(honest.norm())
    assert float(bounded.norm()) < 5 * float(honest.norm())  # its weight is at most 4 typical callers'
