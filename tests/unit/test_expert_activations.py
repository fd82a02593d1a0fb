"""Kept activations on an expert host: the stash's bounds, and backward through a kept graph being exactly
the backward of recomputing the forward pass (so keeping them changes speed and bytes, never results)."""

from __future__ import annotations

import pytest
import torch

from peerd.config import ExpertsConfig
from peerd.experts.calls import wire_codec
from peerd.experts.server import stash as stash_module
from peerd.experts.server.backend import BackwardItem, ExpertBackend
from peerd.experts.server.modules import build_expert
from peerd.experts.server.stash import ActivationStash
from peerd.proto import peerd_experts_pb2 as pb
from peerd.wire import codec
from tests.unit.expert_calls import run_calls

pytestmark = pytest.mark.timeout(60)

CONFIG = ExpertsConfig(hidden_dim=8, ffn_dim=16, lr=0.1, max_grad_norm=None)



def _backend() -> ExpertBackend:
    return ExpertBackend("x.0", build_expert(CONFIG, "x.0"), CONFIG)  # same seed and uid: same parameters


# --- the stash ----------------------------------------------------------------------------------------------


def test_entries_are_scoped_to_expert_caller_and_call_and_taken_once() -> None:
    stash = ActivationStash(max_tokens=100, ttl=60)
    x = torch.randn(4, 8)
    assert stash.put(("x.0", "peer-a", 7), x, None)
    assert stash.take(("x.0", "peer-b", 7)) is None  # another peer cannot use (or consume) it
    assert stash.take(("x.1", "peer-a", 7)) is None
    kept = stash.take(("x.0", "peer-a", 7))
    assert kept is not None and torch.equal(kept.inputs, x)
    assert stash.take(("x.0", "peer-a", 7)) is None
    assert stash.status()["used"] == 1 and stash.status()["tokens"] == 0


def test_the_token_budget_drops_the_oldest_first_and_never_keeps_an_oversized_call() -> None:
    stash = ActivationStash(max_tokens=10, ttl=60)
    for call in range(3):
        stash.put(("x.0", "p", call), torch.zeros(4, 8), None)
    assert stash.take(("x.0", "p", 0)) is None  # 12 tokens > 10: the first one made room
    assert stash.take(("x.0", "p", 2)) is not None
    assert not stash.put(("x.0", "p", 9), torch.zeros(11, 8), None)
    assert stash.status()["dropped"] == 1 and stash.status()["calls"] == 1


def test_entries_expire(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = [1000.0]
    monkeypatch.setattr(stash_module.time, "monotonic", lambda: clock[0])
    stash = ActivationStash(max_tokens=100, ttl=5)
    stash.put(("x.0", "p", 1), torch.zeros(2, 8), None)
    stash.put(("x.0", "p", 2), torch.zeros(2, 8), None)
    clock[0] += 6
    assert stash.take(("x.0", "p", 1)) is None
    assert stash.status() == {"max_tokens": 100, "tokens": 0, "calls": 0, "kept": 2, "used": 0, "dropped": 2}


# --- the backend ----------------------------------------------------------------------------------------------


def _backward(backend: ExpertBackend, item: BackwardItem) -> torch.Tensor:
    answers: list[torch.Tensor] = []
    backend.backward([item], answers.extend)  # no scheduler: the optimizer step runs right away
    return answers[0]


def test_backward_through_a_kept_graph_equals_recomputing_the_forward() -> None:
    kept, recomputed = _backend(), _backend()
    x, grad = torch.randn(5, 8), torch.randn(5, 8)
    outputs, graph = kept.forward_keeping_graph(x)
    assert torch.allclose(outputs, recomputed.forward(x))
    from_graph = _backward(kept, BackwardItem(x, grad, graph))
    again = _backward(recomputed, BackwardItem(x, grad))
    assert torch.allclose(from_graph, again, atol=1e-6)
    assert all(torch.allclose(p, q, atol=1e-6) for p, q in zip(kept.params, recomputed.params, strict=True))
    assert (kept.reused_graphs, kept.recomputed, recomputed.recomputed) == (1, 0, 1)
    assert kept.updates == 1


def test_a_graph_older_than_the_parameters_is_recomputed_with_the_new_ones() -> None:
    backend, reference = _backend(), _backend()
    x, grad = torch.randn(3, 8), torch.randn(3, 8)
    _, graph = backend.forward_keeping_graph(x)
    for b in (backend, reference):  # another caller's update lands between this forward and its backward
        _backward(
            b, BackwardItem(torch.randn(2, 8, generator=torch.Generator().manual_seed(1)), torch.ones(2, 8))
        )
    result = _backward(backend, BackwardItem(x, grad, graph))
    assert backend.recomputed == 2 and backend.reused_graphs == 0
    assert torch.allclose(result, _backward(reference, BackwardItem(x, grad)), atol=1e-6)


def test_a_pending_step_is_applied_before_a_forward_that_keeps_its_graph() -> None:
    backend = _backend()
    x = torch.randn(3, 8)
    steps: list[object] = []
    backend.backward([BackwardItem(x, torch.ones(3, 8))], lambda _: None, steps.append)
    assert backend.updates == 0  # the step is owed (scheduled as background work)
    _, graph = backend.forward_keeping_graph(x)
    assert backend.updates == 1 and graph.version == 1
    _backward(backend, BackwardItem(x, torch.ones(3, 8), graph))
    assert backend.reused_graphs == 1


# --- through the batch queue, as the server runs it ------------------------------------------------------------


WAIT = 0.01  # calls submitted together share a batch


def _payload(t: torch.Tensor) -> bytes:
    return bytes(codec.encode(t, wire_codec(lossless=True)))


def test_a_backward_by_call_id_needs_only_the_gradients_and_unknown_ids_are_answered_as_gone() -> None:
    backend, stash = _backend(), ActivationStash(max_tokens=100, ttl=60)
    x, grad = torch.randn(4, 8), torch.randn(4, 8)
    (forward,) = run_calls([("forward", 4, [_payload(x)], 11)], backend, WAIT, stash)
    assert forward.code == pb.EXPERT_OK and forward.kept
    results = run_calls(
        [
            ("backward", 4, [_payload(grad)], 11),
            ("backward", 4, [_payload(grad)], 12),  # never kept
        ],
        backend,
        WAIT,
        stash,
    )
    assert [r.code for r in results] == [pb.EXPERT_OK, pb.EXPERT_ACTIVATIONS_GONE]
    assert "call_id 0" in results[1].message
    expected = _backward(_backend(), BackwardItem(x, grad))
    assert torch.allclose(codec.decode(results[0].payload, peer_id="host"), expected, atol=1e-6)
    assert backend.reused_graphs == 1 and backend.updates == 1


def test_batched_forward_calls_keep_their_inputs_and_a_mismatched_backward_is_refused() -> None:
    backend, stash = _backend(), ActivationStash(max_tokens=100, ttl=60)
    a, b = torch.randn(2, 8), torch.randn(3, 8)
    forwards = run_calls(
        [("forward", 2, [_payload(a)], 1), ("forward", 3, [_payload(b)], 2)], backend, WAIT, stash
    )
    assert all(r.code == pb.EXPERT_OK and r.kept for r in forwards) and backend.batches["forward"] == 1
    results = run_calls(
        [("backward", 2, [_payload(torch.ones(2, 8))], 1), ("backward", 2, [_payload(torch.ones(2, 8))], 2)],
        backend,
        WAIT,
        stash,
    )
    assert results[0].code == pb.EXPERT_OK and backend.recomputed == 1  # one batch graph cannot be split
    assert results[1].code == pb.EXPERT_BAD_REQUEST and "3 tokens" in results[1].message


def test_a_host_that_keeps_nothing_says_so_in_the_forward_answer() -> None:
    backend = _backend()
    nothing = ActivationStash(max_tokens=0, ttl=60)
    (forward,) = run_calls([("forward", 4, [_payload(torch.randn(4, 8))], 5)], backend, WAIT, nothing)
    assert forward.code == pb.EXPERT_OK and not forward.kept
