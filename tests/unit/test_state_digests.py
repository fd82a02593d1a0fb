"""Digests of an agreed state (peerd/training/transfer/digest.py), the manifest that announces them, and a
download that checks every piece as it completes: a donor that sends other bytes than it announced is caught on
that piece and excluded, and only it; a download that switches donors restarts the current piece; a state the
caller does not accept is skipped without accusing anyone. Over in-process socket pairs
(tests/unit/state_streams.py)."""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager

import pytest
import torch

from peerd.errors import ProtocolViolation, StateError
from peerd.training.distrust import Distrust
from peerd.training.state import TrainingState
from peerd.training.transfer import digest
from peerd.training.transfer.digest import piece_template, pieces, root_digest, take_snapshot
from peerd.training.transfer.download import StateDownloader
from peerd.training.transfer.manifest import Manifest, check_manifest, encode_manifest
from peerd.training.transfer.server import StateServer
from tests.unit.state_streams import LocalNet, PausingGuard

pytestmark = pytest.mark.timeout(30)

FP = "fp-test"
HONEST, OTHER, LIAR, JOINER = "donor-honest", "donor-other", "donor-liar", "joiner"
NUMEL = 250_000  # 4 pieces of 65536 elements (the last shorter) with PIECE_NUMEL patched below
CHUNK = 64 << 10


@pytest.fixture(autouse=True)
def small_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(digest, "PIECE_NUMEL", 1 << 16)


def flat(seed: int = 0) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(seed))


def test_a_snapshot_is_cut_into_pieces_whose_digests_bind_step_and_contents() -> None:
    snapshot = take_snapshot(30, flat())
    state = snapshot.state()
    assert list(state.tensors) == ["shared/00000", "shared/00001", "shared/00002", "shared/00003"]
    assert [t.numel() for t in state.tensors.values()] == [65536, 65536, 65536, NUMEL - 3 * 65536]
    assert torch.equal(torch.cat(list(state.tensors.values())), flat())  # views of the one flat copy
    assert snapshot.digests[1] == hashlib.sha256(flat()[65536:131072].numpy().tobytes()).digest()
    assert take_snapshot(30, flat()).root == snapshot.root  # members holding the same bits agree
    assert take_snapshot(31, flat()).root != snapshot.root
    changed = flat()
    changed[-1] += 1e-6
    assert take_snapshot(30, changed).root != snapshot.root
    assert piece_template(0) == {"shared/00000": ((0,), torch.float32)}  # a state has at least one tensor
    assert [t.numel() for t in pieces(torch.empty(0)).values()] == [0]


def test_the_manifest_carries_the_digests_and_the_joiner_computes_the_root_from_them() -> None:
    snapshot = take_snapshot(30, flat())
    manifest = check_manifest(encode_manifest(snapshot.state(), CHUNK), "donor", 1 << 30)
    assert manifest.digests == snapshot.digests and manifest.root == snapshot.root
    assert manifest.digest == snapshot.root  # what a resume point names: other contents restart from zero
    plain = check_manifest(encode_manifest(TrainingState(30, pieces(flat())), CHUNK), "donor", 1 << 30)
    assert plain.digests is None and plain.root is None
    mixed = encode_manifest(snapshot.state(), CHUNK)
    mixed.tensors[2].sha256 = b"short"
    with pytest.raises(ProtocolViolation, match=r"tensor digests of \[5, 32\] bytes"):
        check_manifest(mixed, "donor", 1 << 30)
    with pytest.raises(ValueError, match="needs as many 32-byte digests"):
        encode_manifest(TrainingState(30, pieces(flat()), snapshot.digests[:2]), CHUNK)
    layout = {name: (tuple(t.shape), t.dtype) for name, t in snapshot.state().tensors.items()}
    assert root_digest(30, layout, snapshot.digests) == snapshot.root


Provider = Callable[[], Awaitable[TrainingState | None]]


def serving(state: TrainingState | None) -> Provider:
    async def provider() -> TrainingState | None:
        return state

    return provider


def lying(step: int = 30) -> TrainingState:
    """Noise under the honest pieces' digests: the manifest a joiner accepts, the bytes it must not."""
    return TrainingState(step, pieces(flat(seed=666)), take_snapshot(step, flat()).digests)


@asynccontextmanager
async def swarm(**donors: Provider) -> AsyncIterator[LocalNet]:
    net = LocalNet()
    try:
        for peer, provider in donors.items():
            await StateServer(net.guard(peer), FP, provider, chunk_bytes=CHUNK).start()
        yield net
    finally:
        await net.close()


def accepting(root: bytes) -> Callable[[Manifest, str], Awaitable[str | None]]:
    async def accept(manifest: Manifest, donor: str) -> str | None:
        return None if manifest.root == root else "not the vouched state"

    return accept


def test_a_donor_sending_other_bytes_than_it_announced_is_caught_on_that_piece_and_excluded() -> None:
    honest = take_snapshot(30, flat())

    async def body() -> None:
        async with swarm(**{LIAR: serving(lying()), HONEST: serving(honest.state())}) as net:
            distrust = Distrust()
            joiner = StateDownloader(net.guard(JOINER), FP, piece_template(NUMEL), 1 << 30, retry_delay=0.0,
                                     distrust=distrust)
            state = await joiner.download([LIAR, HONEST], accept=accepting(honest.root))
            assert torch.equal(torch.cat(list(state.tensors.values())), flat())
            assert state.digests == honest.digests
            assert joiner.status()["bytes_from"] == {LIAR: 65536 * 4, HONEST: NUMEL * 4}  # one piece from the liar
            assert distrust.excluded(LIAR) and not distrust.excluded(HONEST)
            assert "sent tensor shared/00000 of step 30 whose bytes do not match" in distrust.status()[LIAR]["reason"]
            again = await joiner.download([LIAR, HONEST], accept=accepting(honest.root))  # not asked again
            assert joiner.status()["bytes_from"] == {HONEST: NUMEL * 4} and again.digests == honest.digests
            with pytest.raises(StateError, match=f"{LIAR} is excluded"):
                await joiner.download([LIAR], accept=accepting(honest.root))

    asyncio.run(body())


def test_a_switch_of_donors_restarts_the_current_piece_so_each_piece_has_one_donor() -> None:
    honest = take_snapshot(30, flat())

    async def body() -> None:
        async with swarm(**{HONEST: serving(honest.state()), OTHER: serving(honest.state())}) as net:
            # HONEST hands out 600,000 bytes (mid-way through the 3rd piece), then stalls
            pausing = PausingGuard(net.guard(JOINER), HONEST, after=600_000)
            distrust = Distrust()
            joiner = StateDownloader(pausing.as_guard(), FP, piece_template(NUMEL), 1 << 30, retry_delay=0.0,
                                     stall_timeout=0.5, distrust=distrust)
            state = await joiner.download([HONEST, OTHER], accept=accepting(honest.root))
            assert torch.equal(torch.cat(list(state.tensors.values())), flat())
            got, piece = joiner.status()["bytes_from"], 65536 * 4
            assert got[HONEST] > 2 * piece and got[OTHER] == NUMEL * 4 - 2 * piece  # piece 2 fetched again
            assert distrust.status() == {}  # a donor that stalls is no liar

    asyncio.run(body())


def test_a_state_not_accepted_or_without_digests_is_skipped_without_accusing_anyone() -> None:
    honest, newer = take_snapshot(30, flat()), take_snapshot(31, flat(seed=1))

    async def body() -> None:
        async with swarm(**{OTHER: serving(newer.state()), HONEST: serving(honest.state()),
                            LIAR: serving(TrainingState(30, pieces(flat())))}) as net:
            distrust = Distrust()
            joiner = StateDownloader(net.guard(JOINER), FP, piece_template(NUMEL), 1 << 30, rounds=1,
                                     distrust=distrust)
            state = await joiner.download([OTHER, LIAR, HONEST], accept=accepting(honest.root))
            assert state.step == 30 and joiner.status()["bytes_from"] == {HONEST: NUMEL * 4}
            with pytest.raises(StateError) as info:
                await joiner.download([OTHER, LIAR], accept=accepting(honest.root))
            assert "not loaded: not the vouched state" in str(info.value)
            assert "announces no digests of its state" in str(info.value)
            assert distrust.status() == {}

    asyncio.run(body())


def test_a_lie_about_an_empty_piece_is_caught_before_the_payload() -> None:
    empty = TrainingState(4, {"shared/00000": torch.empty(0)}, (b"\x01" * 32,))

    async def body() -> None:
        async with swarm(**{LIAR: serving(empty)}) as net:
            distrust = Distrust()
            joiner = StateDownloader(net.guard(JOINER), FP, piece_template(0), 1 << 30, rounds=1,
                                     distrust=distrust)

            async def anything(manifest: Manifest, donor: str) -> str | None:
                return None

            with pytest.raises(StateError, match="digest of empty tensor shared/00000"):
                await joiner.download([LIAR], accept=anything)
            assert distrust.excluded(LIAR)

    asyncio.run(body())
