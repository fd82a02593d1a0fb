"""What the tests share: the repository's paths, the transports, peers started and always reaped, p2pd daemons in
this process, the remote-MoE swarm's config, training states to transfer, and short reads of a peer's status.

Test modules import from here (and the attack tests their swarms from tests/integration/swarms.py), never from
each other or from conftest.py (which holds only fixtures)."""

from __future__ import annotations

import asyncio
import math
import os
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Sequence
from contextlib import asynccontextmanager, contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from peerd.launcher import PeerProcess, wait_for
from peerd.training.state import TrainingState

if TYPE_CHECKING:
    from hivemind.p2p import P2P

REPO = Path(__file__).resolve().parents[1]
LOCAL_CONFIG = REPO / "configs" / "local.yaml"
# the environment of a peer run from a patched module under tests/ (a liar, a defence off): it imports the repository
PATCHED_ENV = {"PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}

# The libp2p transports peerd supports (``swarm.host_maddrs``), as loopback listen addresses for tests that run over
# each. QUIC is the stricter one: it drops whatever a stream closed with input unread still held.
LISTEN = {"tcp": "/ip4/127.0.0.1/tcp/0", "quic": "/ip4/127.0.0.1/udp/0/quic-v1"}


# ------------------------------------------------------------------------------------------------- peers


@contextmanager
def ready_peer(name: str, args: Sequence[str], log_dir: Path, timeout: float = 60.0,
               **options: Any) -> Iterator[PeerProcess]:
    """A `peerd start` process that printed its ready line; killed with its whole tree at the end, whatever
    happens (a test that checks the exit code stops it first)."""
    peer = PeerProcess(name, args, log_dir, **options)
    try:
        peer.wait_ready(timeout)
        yield peer
    finally:
        peer.kill()


def training(peer: PeerProcess, timeout: float = 30.0) -> dict[str, Any]:
    """The ``training`` section of the peer's status (None on a peer that does not train); a loaded machine
    may take seconds to answer."""
    section: dict[str, Any] = peer.status(timeout=timeout)["training"]
    return section


def all_reached(peers: Sequence[PeerProcess], key: str, value: int) -> bool:
    return all(training(p)[key] >= value for p in peers)


def rounds(peer: PeerProcess) -> int:
    """The rounds the peer averaged."""
    return int(training(peer)["rounds_ok"])


def time_rounds(peer: PeerProcess, count: int, timeout: float) -> float | None:
    """Seconds until ``peer`` averaged ``count`` more rounds, or None if it did not within ``timeout``."""
    start, started = rounds(peer), time.monotonic()
    try:
        wait_for(lambda: rounds(peer) >= start + count, timeout, f"{count} rounds", 0.5)
    except TimeoutError:
        return None
    return time.monotonic() - started


def validations(peer: PeerProcess, timeout: float = 5.0) -> list[tuple[int, float]]:
    """The peer's validation losses (``/history``) as (step, loss), oldest first."""
    return [(step, loss) for _, step, loss in peer.history(timeout=timeout)["validation_loss"]]


@asynccontextmanager
async def p2p_daemons(n: int, listen: str = LISTEN["tcp"],
                      identities: Sequence[Path] = ()) -> AsyncIterator[list[P2P]]:
    """``n`` p2pd daemons with hivemind's P2P handles: the first alone, the others bootstrapped from its addresses
    and then dialled to each other, each with its key file from ``identities`` if given. All shut down at the
    end, last started first; shutting down one a test already took away is harmless.

    The dials are why a test's first stream opens at once: without them a daemon finds another only through
    p2pd's own DHT, whose routing table fills a moment after the bootstrap connection (on a loaded machine a
    stream opened at once failed with "failed to find any peer in table"). A daemon that re-bootstraps dials
    peers the same way (``peerd.wire.p2pd_control.connect``)."""
    from hivemind.p2p import P2P

    from peerd.wire import p2pd_control

    keys: list[dict[str, str]] = [{"identity_path": str(path)} for path in identities] or [{} for _ in range(n)]
    started: list[P2P] = []
    try:
        started.append(await P2P.create(host_maddrs=[listen], **keys[0]))
        maddrs = [str(m) for m in await started[0].get_visible_maddrs()]
        for i in range(1, n):
            started.append(await P2P.create(host_maddrs=[listen], initial_peers=maddrs, **keys[i]))
        for i, later in enumerate(started[2:], start=2):
            for earlier in started[1:i]:
                suffix = f"/p2p/{earlier.peer_id}"
                addresses = [m.decapsulate(suffix) for m in await earlier.get_visible_maddrs()]
                await p2pd_control.connect(later, earlier.peer_id, addresses)
        yield started
    finally:
        for p2p in reversed(started):
            await p2p.shutdown()
        await _dispatches_ended()


async def _dispatches_ended(timeout: float = 10.0) -> None:
    """Until every inbound stream's dispatch (hivemind's ``ControlClient._handler``, which runs the stream's
    handler) has seen its daemon go. A dispatch still reading when the test's loop ends is cancelled, and asyncio
    closes the connection of a client callback that raised but not of one cancelled: the socket would be left
    for the garbage collector, and the test fail on its ResourceWarning."""
    pending = [task for task in asyncio.all_tasks() if task is not asyncio.current_task()
               and getattr(task.get_coro(), "__qualname__", "") == "ControlClient._handler"]
    if pending:
        await asyncio.wait(pending, timeout=timeout)


# --------------------------------------------------------------------------------------- remote experts

MOE_HIDDEN = 32
# An lm swarm whose last layer is a remote MoE of 4 experts; hosts serve them with `experts_option`.
MOE_CONFIG = f"""
run_name: peerd-moe-test
swarm:
  host_maddrs: ["/ip4/127.0.0.1/tcp/0"]
  record_refresh_period: 1.0
  record_ttl: 4.0
control:
  port: 0
training:
  enabled: true
  task:
    name: lm
    options:
      seq_len: 32
      batch_size: 8
      d_model: {MOE_HIDDEN}
      n_heads: 2
      d_ff: 64
      max_files: 40
      val_files: 4
      val_batches: 2
      moe: {{layers: [-1], num_experts: 4, k: 2, k_min: 1, timeout: 2.0, grace: 0.05, refresh_period: 0.5,
             retry_after: 1.0}}
  lr: 0.01
  target_batch_size: 16
  validation_every: 5
"""


def experts_option(count: int, first_index: int = 0, record_ttl: float = 6.0) -> str:
    """The ``experts`` override (``-o experts=...``) of a host serving ``count`` of MOE_CONFIG's experts from
    ``first_index``."""
    return (f"{{uid_prefix: 'ffn.1.', count: {count}, first_index: {first_index}, hidden_dim: {MOE_HIDDEN}, "
            f"ffn_dim: 64, lr: 0.003, announce_period: 1.0, record_ttl: {record_ttl}}}")


# ---------------------------------------------------------------------------------------- training state

Provider = Callable[[], Awaitable[TrainingState | None]]


def mixed_state(step: int = 11, rows: int = 256) -> TrainingState:
    """A state of several tensors and dtypes (float32, bfloat16, float16, int64, bool, an empty one), about
    ``rows`` x 7.4 KiB: the first tensor, ``model/w``, is ``rows`` x 4 KiB."""
    g = torch.Generator().manual_seed(step)
    return TrainingState(step, {
        "model/w": torch.randn(rows, 1024, generator=g),
        "model/b": torch.randn(1000, generator=g).bfloat16(),
        "inner/0/exp_avg": torch.randn(rows // 2, 1024, generator=g).half(),
        "inner/0/step": torch.tensor(float(step)),
        "outer/empty": torch.empty(0),
        "outer/momentum": torch.randn(rows * 600, generator=g),
        "outer/tokens": torch.randint(0, 1000, (5000,), generator=g),
        "outer/mask": torch.rand(333, generator=g) > 0.5,
    })


def identical(a: TrainingState, b: TrainingState) -> bool:
    """Same step, same tensors in the same order, equal to the bit."""
    return a.step == b.step and list(a.tensors) == list(b.tensors) and all(
        torch.equal(a.tensors[k], b.tensors[k]) for k in a.tensors)


def serving(state: TrainingState | None) -> Provider:
    """A state server's provider that always offers ``state`` (None: nothing to serve)."""

    async def provider() -> TrainingState | None:
        return state

    return provider


def model_in_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """The model's state_dict entries in a peerd checkpoint file (its ``model/<key>`` tensors)."""
    tensors = torch.load(path, weights_only=True)["tensors"]
    return {name.removeprefix("model/"): t for name, t in tensors.items() if name.startswith("model/")}


EXPERTS_TTL = 6.0  # generous: on a loaded 2-core machine a DHT read can take seconds


def host_args(first_index: int) -> list[str]:
    """Flags of a peer that only hosts 2 of MOE_CONFIG's experts, from ``first_index`` on."""
    experts = experts_option(2, first_index, EXPERTS_TTL)
    return ["-o", "training.enabled=false", "-o", f"experts={experts}", "-o", "swarm.roles=[expert_host]"]


def experts(peer: PeerProcess) -> dict[str, Any]:
    section = peer.status()["experts"]
    assert section is not None
    return section


def called(trainer: PeerProcess, uid: str) -> dict[str, Any]:
    client = experts(trainer)["client"] or {"experts": {}}
    return dict(client["experts"].get(uid, {}))


def calls_to(trainer: PeerProcess, uid: str) -> int:
    """Forward calls ``trainer`` made to expert ``uid`` that did not fail."""
    info = called(trainer, uid)
    return int(info.get("forward", {}).get("calls", 0)) - int(info.get("forward", {}).get("errors", 0))


# Robust averaging against an attacker on the synthetic task. Per step the clipped attacker still pulls the
# result by up to tau (the honest members' spread) times its weight share, so it slows training rather than
# stopping it; with configs/synthetic.yaml's lr 0.1 and 32 samples per peer, 30 steps do not reach the
# attack-free loss, with 64 samples (less spread) and lr 0.2 they do.
SYNTHETIC = REPO / "configs" / "synthetic.yaml"
SHARE = 64
LR = 0.2


def validated_or_diverged(peers: Sequence[PeerProcess], steps: int) -> list[dict[str, Any]] | None:
    """The peers' training reports once each validated at ``steps``, or once one's model overflowed (it computes
    no finite gradient again, so the others would wait forever); None until then."""
    reports = [training(p) for p in peers]
    if all((r["validation_step"] or 0) >= steps for r in reports):
        return reports
    if any(validation_loss(r) == math.inf for r in reports):
        return reports
    return None


def validation_loss(report: dict[str, Any]) -> float | None:
    """None before the first validation; inf for a non-finite loss (the status endpoint sends those as null)."""
    if report["validation_step"] is None:
        return None
    loss = report["validation_loss"]
    return math.inf if loss is None or not math.isfinite(loss) else float(loss)
