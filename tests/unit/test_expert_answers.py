"""What a MoE layer does with a host's answer over the bound (peerd/experts/client/layer.py, peerd/experts/bounds.py,
peerd/experts/client/directory.py): left out and its expert skipped once three hosts set the bound or this peer's
own experts are among them, scaled down otherwise (input gradients: always scaled down), never for this peer's own
experts, and measured as a gain, not a size."""

from __future__ import annotations

import asyncio
import time
from types import SimpleNamespace

import pytest
import torch

from peerd.config import MoEConfig
from peerd.experts.bounds import NormBound
from peerd.experts.client.client import Answer
from peerd.experts.client.directory import ExpertDirectory
from peerd.experts.client.layer import RemoteMoE
from peerd.experts.records import ExpertRecord, SeenExpert
from peerd.proto import peerd_experts_pb2 as pb

pytestmark = pytest.mark.timeout(60)

HIDDEN, TOKENS = 8, 6
ME = "me"
HONEST = "12D3KooWENjauiKw6XaCcnEGVweaqxyu3PpadrVWp1hEAZQydvFL"
LIAR = "12D3KooWRtaQXj9DZCijkmMe1B81YDiREjvqc4BgNZ8639FNP12S"


class FakeClient:
    """What the layer's bound reads of its client and tells it."""

    def __init__(self) -> None:
        self.swarm = SimpleNamespace(peer_id=ME)
        self.trusted: list[str] = []
        self.judged: list[tuple[str, str | None]] = []  # (uid, why it was left out; None: scaled)
        self.bounds: tuple[NormBound, NormBound] | None = None

    def answer_bounds(self, name: str, ratio: float | None) -> tuple[NormBound, NormBound]:
        self.bounds = self.bounds or (NormBound(ratio), NormBound(ratio))
        return self.bounds

    def within_bound(self, uid: str) -> None:
        self.trusted.append(uid)

    def out_of_bound(self, uid: str, phase: pb.ExpertPhase, peer_id: str, left_out: str | None) -> None:
        self.judged.append((uid, left_out))


def _layer() -> tuple[RemoteMoE, FakeClient]:
    layer = RemoteMoE(HIDDEN, [f"x.{i}" for i in range(4)], MoEConfig())
    client = FakeClient()
    layer._client = client  # type: ignore[assignment]
    return layer, client


def _answers(gains: dict[str, float], sent: torch.Tensor) -> tuple[dict[int, Answer], list[torch.Tensor], list]:
    """One answer per host, expert i for the i-th host, each ``gain`` times what was sent."""
    results = {i: Answer(sent * gain, False, host) for i, (host, gain) in enumerate(gains.items())}
    plan = [(i, torch.arange(TOKENS), torch.zeros(TOKENS, dtype=torch.long)) for i in range(len(gains))]
    return results, [sent] * len(gains), plan


def test_an_answer_a_thousand_times_the_typical_gain_is_left_out_once_three_hosts_set_the_bound() -> None:
    layer, client = _layer()
    sent = torch.randn(TOKENS, HIDDEN)
    results, inputs, plan = _answers({ME: 1.0, HONEST: 1.5, LIAR: 1000.0}, sent)
    factors = layer._bound(results, inputs, plan, pb.EXPERT_FORWARD)
    assert factors == {0: 1.0, 1: 1.0, 2: 0.0}  # from the first pass: the pass's answers bound each other
    assert client.trusted == ["x.0", "x.1"]
    assert len(client.judged) == 1 and client.judged[0][0] == "x.2" and "gain 1e+03" in str(client.judged[0][1])


def test_with_two_other_hosts_an_answer_over_the_bound_is_scaled_down_not_left_out() -> None:
    layer, client = _layer()
    sent = torch.randn(TOKENS, HIDDEN)
    results, inputs, plan = _answers({HONEST: 1.0, LIAR: 1000.0}, sent)
    factors = layer._bound(results, inputs, plan, pb.EXPERT_FORWARD)
    # the lower median of two is the smaller host's: 4 times its gain
    assert factors[0] == 1.0 and factors[1] == pytest.approx(4.0 / 1000.0)
    assert client.judged == [("x.1", None)]  # one of two may be the liar that set the bound: nobody is skipped


def test_beside_this_peers_own_experts_one_other_host_over_the_bound_is_left_out() -> None:
    layer, client = _layer()
    sent = torch.randn(TOKENS, HIDDEN)
    results, inputs, plan = _answers({ME: 1.0, LIAR: 1000.0}, sent)
    assert layer._bound(results, inputs, plan, pb.EXPERT_FORWARD) == {0: 1.0, 1: 0.0}
    assert client.judged[0][0] == "x.1" and client.judged[0][1] is not None
    # and a liar answering tiny gains beside them sets the bound low, but there is nobody else to leave out
    layer, client = _layer()
    results, inputs, plan = _answers({ME: 1.0, LIAR: 1e-3}, sent)
    assert layer._bound(results, inputs, plan, pb.EXPERT_FORWARD) == {0: 1.0, 1: 1.0} and client.judged == []


def test_input_gradients_over_the_bound_are_scaled_down_never_left_out() -> None:
    layer, client = _layer()
    sent = torch.randn(TOKENS, HIDDEN)
    results, grads, plan = _answers({ME: 1.0, HONEST: 1.0, LIAR: 1000.0}, sent)
    factors = layer._bound(results, grads, plan, pb.EXPERT_BACKWARD)
    assert factors[0] == factors[1] == 1.0 and factors[2] == pytest.approx(4.0 / 1000.0)
    assert client.judged == [("x.2", None)]  # honest experts' gradients vary more: nobody is skipped for them


def test_this_peers_own_answers_are_never_bounded_but_count() -> None:
    layer, client = _layer()
    sent = torch.randn(TOKENS, HIDDEN)
    results, inputs, plan = _answers({HONEST: 1.0, "other": 1.0, ME: 50.0}, sent)
    assert layer._bound(results, inputs, plan, pb.EXPERT_FORWARD) == {0: 1.0, 1: 1.0, 2: 1.0}
    assert client.judged == []


def test_the_bound_is_on_the_gain_so_large_output_gradients_do_not_make_an_honest_answer_look_large() -> None:
    layer, client = _layer()
    small, large = torch.randn(TOKENS, HIDDEN), 100 * torch.randn(TOKENS, HIDDEN)  # a large gate weight
    results = {0: Answer(small, False, ME), 1: Answer(small * 2, False, "other"), 2: Answer(large * 2, False, HONEST)}
    plan = [(i, torch.arange(TOKENS), torch.zeros(TOKENS, dtype=torch.long)) for i in range(3)]
    assert layer._bound(results, [small, small, large], plan, pb.EXPERT_BACKWARD) == {0: 1.0, 1: 1.0, 2: 1.0}
    assert client.judged == []


def test_a_liar_with_a_thousand_calls_has_one_vote_in_the_bound() -> None:
    bound = NormBound(4.0)
    for _ in range(1000):
        bound.observe(LIAR, 1e-6)  # tiny answers, to set the bound low
    for host in (ME, HONEST):
        bound.observe(host, 1.0)
    assert bound.voters == 3 and bound.reference() == 1.0 and bound.factor(3.9) == 1.0
    assert bound.factor(8.0) == pytest.approx(0.5)


def _seen(peer: str) -> SeenExpert:
    record = ExpertRecord(uid="x.0", peer_id=peer, protocol_version=2, hidden_dim=HIDDEN, module="ffn", updates=0,
                          started_at=1.0, updated_at=1.0)
    return SeenExpert(record, expires_at=time.time() + 60)


def test_an_expert_left_out_is_skipped_doubling_until_it_answers_within_the_bound() -> None:
    async def body() -> None:
        directory = ExpertDirectory(SimpleNamespace(drop=None), "run.experts")  # type: ignore[arg-type]
        directory.track(60.0, 2.0)
        directory.records = {"x.0": _seen(LIAR)}
        directory.left_out("x.0", LIAR, "gain 1e3")
        assert directory.distrust["x.0"].delay == 2.0
        assert "out of bound" in str(directory.unroutable_reasons(["x.0"], HIDDEN)[0])
        directory.succeeded("x.0")  # its calls succeed: that clears no distrust
        directory.left_out("x.0", LIAR, "gain 1e3")
        assert directory.distrust["x.0"].delay == 4.0 and directory.backing_off_for("x.0") > 3.0
        directory.records = {"x.0": _seen(HONEST)}  # another host took the uid: the skip was the liar's
        assert directory.unroutable_reasons(["x.0"], HIDDEN) == [None]
        directory.left_out("x.0", HONEST, "gain 9")
        assert directory.distrust["x.0"].delay == 2.0  # afresh
        directory.within_bound("x.0")
        assert directory.unroutable_reasons(["x.0"], HIDDEN) == [None]
        directory.close()

    asyncio.run(body())
